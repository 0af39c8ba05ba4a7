"""Exit stress: many 2-rank Gloo jobs that end normally or by error, counting aborts.

    python tests/python/exit_stress.py --n 500            # 500 process exits (250 jobs)
    python tests/python/exit_stress.py --n 20 --fork-server   # what the slow pytest test runs

The ranks import the pygraph_dist this Python finds (installed, or through
PYTHONPATH=python with the extension built in place).

Each job starts 2 CPU ranks that call ``pgd.init()``, ``pgd.wrap()``, train a
few steps and then end in one of the ways below (cycled, so every way is
covered). A process "aborted" when it died of SIGABRT or printed
``terminate called`` (a C++ std::terminate, e.g. a joinable std::thread
destroyed during interpreter exit, or an exception escaping a destructor).
Prints one line per aborted process with its output tail, then a summary
line; exits 1 if any process aborted or ended with an unexpected code.

The ways to end (``--modes`` picks a subset):
  normal      the script returns (exit 0)
  shutdown    ``pgd.shutdown()`` then return (exit 0)
  raise       both ranks raise after the last step (exit 1, traceback)
  sys_exit    both ranks call ``sys.exit(3)`` (exit 3)
  mixed       rank 0 raises, rank 1 calls ``sys.exit(3)``
  destroy     ``dist.destroy_process_group()`` then raise (exit 1)
  peer_raise  rank 1 raises mid-training; rank 0's next collective fails (exit 1, 1)
  peer_kill   rank 1 ends with os._exit(9) mid-training; rank 0's next collective fails
  in_flight   both ranks raise inside backward, with bucket all-reduces in flight (exit 1)
  after_wait  both ranks wait for an async all-reduce and return at once, its tensor kept
              alive into interpreter exit (exit 0): the Gloo thread drops the finished Work
              while the interpreter finalizes (torch's stock Gloo aborts now and then: 1 in 16
              exits here, 5 in 16 in a module-level script)

``--backend gloo``: the ranks make their own ``dist.init_process_group("gloo")``
(env://) instead of ``pgd.init()``, as a script that only swaps DDP for
``pgd.wrap()`` does: torch's stock Gloo, and the group created before
torch._dynamo is imported (the optimizer imports it), so that
``destroy_process_group()`` leaves its Gloo threads running into interpreter
exit. What must not abort there is pygraph_dist's own collectives (its Works
hold no Python object, python/pygraph_dist/launch/collectives.py); after_wait issues
its all-reduce through them. ``--user-collectives`` makes after_wait call
``dist.all_reduce`` over the stock group instead: torch's own race, which
pygraph_dist cannot reach (for comparison; expect aborts).
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
MODES = ("normal", "shutdown", "raise", "sys_exit", "mixed", "destroy", "peer_raise", "peer_kill",
         "in_flight", "after_wait")
EXPECTED = {"normal": (0, 0), "shutdown": (0, 0), "raise": (1, 1), "sys_exit": (3, 3),
            "mixed": (1, 3), "destroy": (1, 1), "peer_raise": (1, 1), "peer_kill": (1, 9),
            "in_flight": (1, 1), "after_wait": (0, 0)}
_LAUNCHER_PREFIXES = ("OMPI_", "PMI_", "PMIX_", "SLURM_", "TORCHELASTIC_")
_LAUNCHER_NAMES = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}


# ------------------------------------------------------------------ a rank
class _Lingering:
    """Keeps a tensor alive into interpreter exit, and exit busy for a moment:
    module globals are cleared after the interpreter is marked finalizing."""

    def __init__(self, tensor) -> None:
        self.tensor = tensor

    def __del__(self) -> None:
        time.sleep(0.3)


def rank_main(mode: str, steps: int, backend: str = "pgd", user_collectives: bool = False) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn

    import pygraph_dist as pgd

    if backend == "pgd":
        pgd.init(backend="auto")
    else:
        dist.init_process_group(backend)  # the script's own, from RANK, WORLD_SIZE, MASTER_*

    rank = dist.get_rank()
    if mode == "after_wait":
        x = torch.ones(1 << 16)
        if backend == "pgd" or user_collectives:
            work = dist.all_reduce(x, async_op=True)  # through pgd_gloo, or torch's own race
        else:
            from pygraph_dist.launch import collectives

            work = collectives.all_reduce(x, async_op=True)
        work.wait()
        del work  # a Gloo thread may still hold it, and drop it a moment later
        globals()["_linger"] = _Lingering(x)
        sys.exit(0)
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 4))

    class WithLoss(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = base

        def forward(self, x, y):
            return nn.functional.cross_entropy(self.net(x), y)

    # Tiny buckets: several all-reduces per backward, so that some are in
    # flight when an error interrupts it.
    model, opt = pgd.wrap(WithLoss(), torch.optim.SGD(base.parameters(), lr=0.1), bucket_cap_mb=0.0005)
    g = torch.Generator().manual_seed(rank)
    for step in range(steps):
        if step == steps - 1 and rank == 1 and mode in ("peer_raise", "peer_kill"):
            if mode == "peer_kill":
                os._exit(9)
            raise RuntimeError("exit_stress: rank 1 fails mid-training")
        if step == steps - 1 and mode == "in_flight":
            def fail(grad):
                raise RuntimeError("exit_stress: error inside backward")
            base[0].weight.register_hook(fail)  # the first layer's gradient comes last
        opt.zero_grad(set_to_none=True)
        loss = model(torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g))
        loss.backward()
        opt.step()
    if mode == "shutdown":
        pgd.shutdown()
        return
    if mode == "destroy":
        dist.destroy_process_group()
        raise RuntimeError("exit_stress: error after destroy_process_group")
    if mode == "sys_exit" or (mode == "mixed" and rank == 1):
        sys.exit(3)
    if mode in ("raise", "mixed"):
        raise RuntimeError(f"exit_stress: error on rank {rank}")
    if mode in ("peer_raise", "peer_kill"):
        raise AssertionError("exit_stress: rank 0 should have failed in a collective")


# ------------------------------------------------------------------ driver
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(rank: int, port: int) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in _LAUNCHER_NAMES and not k.startswith(_LAUNCHER_PREFIXES)}
    env.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
               PYTHONUNBUFFERED="1", PYTHONFAULTHANDLER="1", CUDA_VISIBLE_DEVICES="")
    return env


def _start_job(mode: str, steps: int, timeout: float, backend: str, user_collectives: bool, servers,
               fork: bool):
    import rank_server

    port = _free_port()
    extra = ["--user-collectives"] if user_collectives else []
    cmd = [sys.executable, __file__, "--rank-mode", mode, "--steps", str(steps), "--backend", backend, *extra]
    # What a rank imports before its process group exists, in its order: pgd.init()
    # imports torch._dynamo first; the script's own init_process_group("gloo")
    # comes before its optimizer imports torch._dynamo.
    preload = rank_server.PRELOAD_PGD_INIT if backend == "pgd" else rank_server.PRELOAD_PGD
    procs = [servers.popen(cmd, env=_env(rank, port), preload=preload, fork=fork, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, cwd=str(ROOT)) for rank in range(2)]
    return {"mode": mode, "procs": procs, "deadline": time.monotonic() + timeout}


def _aborted(code: int, out: str) -> bool:
    return code in (-signal.SIGABRT, 128 + signal.SIGABRT) or "terminate called" in out


def run(n: int, jobs: int, modes: tuple[str, ...], steps: int, timeout: float, verbose: bool,
        backend: str = "pgd", user_collectives: bool = False, fork_server: bool = False) -> dict:
    """Run ``n`` process exits (``n // 2`` jobs of 2 ranks), ``jobs`` jobs at a time."""
    import rank_server  # this file's directory is sys.path[0]

    servers = rank_server.ServerPool(limit=2)  # one per rank, used with fork_server
    try:
        return _run(n, jobs, modes, steps, timeout, verbose, backend, user_collectives, servers, fork_server)
    finally:
        servers.close()


def _run(n, jobs, modes, steps, timeout, verbose, backend, user_collectives, servers, fork) -> dict:
    todo = [modes[i % len(modes)] for i in range((n + 1) // 2)]
    running: list[dict] = []
    stats = {"exits": 0, "aborts": 0, "unexpected": 0, "timeouts": 0, "by_mode": {}}
    t0 = time.monotonic()
    while todo or running:
        while todo and len(running) < jobs:
            running.append(_start_job(todo.pop(0), steps, timeout, backend, user_collectives, servers, fork))
        time.sleep(0.05)
        for job in list(running):
            procs = job["procs"]
            late = time.monotonic() > job["deadline"]
            if not late and any(p.poll() is None for p in procs):
                continue
            running.remove(job)
            if late:
                for p in procs:
                    if p.poll() is None:
                        p.kill()
            expected = EXPECTED[job["mode"]]
            for rank, p in enumerate(procs):
                out = p.communicate()[0].decode(errors="replace")
                code = p.returncode
                stats["exits"] += 1
                m = stats["by_mode"].setdefault(job["mode"], {"exits": 0, "aborts": 0})
                m["exits"] += 1
                if late:
                    stats["timeouts"] += 1
                    print(f"TIMEOUT mode={job['mode']} rank={rank}\n{out[-2000:]}", flush=True)
                elif _aborted(code, out):
                    stats["aborts"] += 1
                    m["aborts"] += 1
                    print(f"ABORT mode={job['mode']} rank={rank} code={code}\n{out[-3000:]}", flush=True)
                elif code != expected[rank]:
                    stats["unexpected"] += 1
                    print(f"UNEXPECTED mode={job['mode']} rank={rank} code={code} "
                          f"(expected {expected[rank]})\n{out[-3000:]}", flush=True)
                elif verbose:
                    print(f"ok mode={job['mode']} rank={rank} code={code}", flush=True)
    stats["seconds"] = round(time.monotonic() - t0, 1)
    return stats


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=500, help="process exits (2 per job)")
    ap.add_argument("--jobs", type=int, default=2, help="jobs running at once")
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma-separated subset of {MODES}")
    ap.add_argument("--steps", type=int, default=3, help="training steps before the exit")
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds per job")
    ap.add_argument("--verbose", action="store_true")
    ap.add_argument("--backend", default="pgd", choices=["pgd", "gloo"],
                    help="pygraph_dist's wrapped Gloo through pgd.init() (default), or the ranks' own "
                         "init_process_group with torch's stock Gloo")
    ap.add_argument("--user-collectives", action="store_true",
                    help="with --backend gloo: after_wait calls dist.all_reduce (torch's own race)")
    ap.add_argument("--fork-server", action="store_true",
                    help="fork each rank from a server (one per rank) that imported what the rank imports "
                         "before its process group exists (tests/python/rank_server.py): what the pytest "
                         "test runs, to spare 40 imports of torch; without it every rank is a new Python")
    ap.add_argument("--rank-mode", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.rank_mode:
        rank_main(args.rank_mode, args.steps, args.backend, args.user_collectives)
        return 0
    modes = tuple(m for m in args.modes.split(",") if m)
    unknown = set(modes) - set(MODES)
    if unknown:
        ap.error(f"unknown modes {sorted(unknown)}; choose from {MODES}")
    s = run(args.n, args.jobs, modes, args.steps, args.timeout, args.verbose, args.backend,
            args.user_collectives, args.fork_server)
    per_mode = ", ".join(f"{k} {v['aborts']}/{v['exits']}" for k, v in s["by_mode"].items())
    print(f"exit_stress ({args.backend}): {s['exits']} process exits in {s['seconds']} s: {s['aborts']} aborted, "
          f"{s['unexpected']} unexpected exit codes, {s['timeouts']} timed out (aborts by mode: {per_mode})",
          flush=True)
    return 0 if s["aborts"] == 0 and s["unexpected"] == 0 and s["timeouts"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
