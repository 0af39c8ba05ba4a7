"""Per-rank test cases, run as separate processes by conftest.run_ranks.

    python tests/python/workers.py <case> --out DIR [case args]

Each case returns a JSON-able dict, written to DIR/rank<R>.json; the pytest
side asserts on it. Cases that exercise failures print what they saw and
exit non-zero instead.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import pygraph_dist as pgd

CASES = {}


def case(fn):
    CASES[fn.__name__] = fn
    return fn


# ----------------------------------------------------------------- CPU cases
@case
def init_only(args):
    t0 = time.monotonic()
    import datetime

    try:
        env = pgd.init(rendezvous_timeout=datetime.timedelta(seconds=args.rendezvous_timeout))
    except pgd.LaunchError as exc:
        print(f"LaunchError after {time.monotonic() - t0:.1f}s: {exc}", flush=True)
        sys.exit(3)
    t = torch.tensor([dist.get_rank() + 1.0])
    dist.all_reduce(t)
    return {"rank": env.rank, "world": env.world_size, "launcher": env.launcher,
            "sum": float(t), "master_addr": os.environ.get("MASTER_ADDR")}


# ----------------------------------------------------------------- main
def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("case", choices=sorted(CASES))
    parser.add_argument("--out", required=True)
    parser.add_argument("--variant", default="plain")
    parser.add_argument("--amp", default="fp32")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--how", default="exit")
    parser.add_argument("--rendezvous-timeout", type=float, default=60)
    args = parser.parse_args()
    result = CASES[args.case](args)
    rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", 0))
    Path(args.out, f"rank{rank}.json").write_text(json.dumps(result, default=str))
    pgd.shutdown()


if __name__ == "__main__":
    main()
