"""Run one test case as one rank: ``python rank_main.py MODULE:FUNCTION --out DIR [--name value ...]``.

The case is a plain function in a test module (its body next to the test
that asserts on its result); ``--name value`` pairs become its keyword
arguments (ints and floats parsed as such); a case with an ``out`` parameter
also gets DIR (to write its result itself when it does not return). Its
return value (JSON-able) is written to ``DIR/rank<r>.json``; afterwards the
process group is shut down the way a user's script would.
"""

from __future__ import annotations

import ctypes
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


PARENT_ENV = "PGD_TEST_RANKS_PARENT"  # the pid of the test process that started this rank


def die_with_the_test() -> None:
    """Linux: this rank gets SIGKILL when the test process that started it dies.

    A `timeout` around pytest, or a Ctrl-C, kills pytest without its finally
    blocks, and a rank left running keeps its GPU and host busy while the next
    command measures. Session 41's GPU call saw this: the ranks of a test
    killed at the call's limit may have run on while a benchmark measured.
    PR_SET_PDEATHSIG survives the exec that started this process; a parent
    that was already gone before the prctl is caught by the pid check."""
    parent = os.environ.get(PARENT_ENV)
    if parent and die_with_the_parent() and os.getppid() != int(parent):
        os._exit(1)


def die_with_the_parent() -> bool:
    """Linux: SIGKILL to this process when its parent dies (PR_SET_PDEATHSIG,
    which fork() clears and exec keeps); whether it could be set."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return False
    return True


def main(argv: list[str]) -> None:
    die_with_the_test()
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
