"""Run one test case as one rank: ``python rank_main.py MODULE:FUNCTION --out DIR [--name value ...]``.

The case is a plain function in a test module (its body next to the test
that asserts on its result); ``--name value`` pairs become its keyword
arguments (ints and floats parsed as such); a case with an ``out`` parameter
also gets DIR (to write its result itself when it does not return). Its
return value (JSON-able) is written to ``DIR/rank<r>.json``; afterwards the
process group is shut down the way a user's script would.
"""

from __future__ import annotations

import faulthandler
import importlib
import inspect
import json
import os
import signal
import sys
from pathlib import Path


def _value(text: str):
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def main(argv: list[str]) -> None:
    # run_ranks sends SIGUSR1 before it kills a rank that ran past its timeout:
    # every thread's stack goes to the rank's log, to show where it waited.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    target, rest = argv[0], argv[1:]
    if len(rest) % 2:
        raise SystemExit(f"rank_main: arguments come in --name value pairs, got {rest}")
    kwargs = {rest[i].lstrip("-").replace("-", "_"): _value(rest[i + 1]) for i in range(0, len(rest), 2)}
    module_name, func_name = target.split(":")
    sys.path.insert(0, str(Path(__file__).parent))
    func = getattr(importlib.import_module(module_name), func_name)
    out = kwargs["out"]
    if "out" not in inspect.signature(func).parameters:
        del kwargs["out"]
    result = func(**kwargs)

    import torch.distributed as dist

    import pygraph_dist as pgd

    rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", 0))
    Path(out, f"rank{rank}.json").write_text(json.dumps(result, default=str))
    pgd.shutdown()


if __name__ == "__main__":
    main(sys.argv[1:])
