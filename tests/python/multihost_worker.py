"""One rank of the two-host tests (test_multihost.py), started by a real launcher.

    <launcher> python tests/python/multihost_worker.py --out DIR [--steps N]

``pgd.init()`` reads whatever the launcher set (torchrun, Open MPI, MPICH,
Slurm); a tiny model trains through ``pgd.wrap`` (the eager engine on CPU:
graphs are unavailable there) with Gloo. Writes DIR/rank<R>.json: what the
rank saw of the launch, the host it ran on, and the exact bits of its losses
and final parameters, which the test compares with a 4-rank run on one host.
"""

from __future__ import annotations

import time

T0 = time.monotonic()

import argparse  # noqa: E402
import hashlib
import json  # noqa: E402
import os  # noqa: E402
import socket  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import pygraph_dist as pgd  # noqa: E402
from common import MLP, data, flat_params  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=6)
    args = p.parse_args()

    t_import = time.monotonic()
    e = pgd.init()
    t_init = time.monotonic()
    rank = dist.get_rank()
    torch.manual_seed(0)
    base = MLP()
    model, opt = pgd.wrap(base, torch.optim.AdamW(base.parameters(), lr=1e-2))
    losses = []
    for step in range(args.steps):
        x, y = data(step, rank)
        opt.zero_grad(set_to_none=True)
        loss = model(x, y)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()).hex())  # exact bits
    t_train = time.monotonic()
    params = flat_params(base)
    # Every rank must hold the same parameters (data parallel): gather the digests.
    digest = hashlib.sha256(str(params.view(torch.int32).tolist()).encode()).hexdigest()
    digests = [None] * dist.get_world_size()
    dist.all_gather_object(digests, digest)
    report = pgd.report().models[0]
    result = {
        "rank": e.rank, "world": e.world_size, "local_rank": e.local_rank,
        "local_world": e.local_world_size, "launcher": e.launcher,
        "variables": dict(e.variables),
        "dist_rank": rank, "dist_world": dist.get_world_size(), "backend": dist.get_backend(),
        "host": socket.gethostname(), "pid": os.getpid(),
        "losses": losses, "params_sha256": digest, "all_digests": digests,
        "graphs_possible": report.graphs_possible, "loop": report.loop,
        "seconds": {"import": round(t_import - T0, 2), "init": round(t_init - t_import, 2),
                    "train": round(t_train - t_init, 2)},
    }
    Path(args.out, f"rank{rank}.json").write_text(json.dumps(result))
    pgd.shutdown()


if __name__ == "__main__":
    main()
