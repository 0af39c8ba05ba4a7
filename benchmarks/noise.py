"""Noisy neighbours: busy-loop processes on the cores the ranks are pinned to.

The ``noisy`` condition of bench_scaling.py pins every thread of every rank
(its main thread, NCCL's proxy, torch's watchdog) to a few cores with
pin_threads(), and local rank 0 starts busy-loop processes pinned to the same
cores with start_busy(), right before the timed loop; both are undone right
after. The ``pinned`` condition pins without busy loops (the control).

Busy loops are bounded three ways: stop_busy() in a ``finally``, an atexit
handler for whatever is still alive, and in the child itself a deadline
(max_s) and a check that its parent is still the process that started it, so
that a rank killed by SIGKILL leaves nothing spinning.
"""

from __future__ import annotations

import atexit
import os
import subprocess
import sys
import time

_BUSY_SCRIPT = r"""
import os, sys, time
cpus = [int(c) for c in sys.argv[1].split(",")]
deadline = time.monotonic() + float(sys.argv[2])
parent = os.getppid()
os.sched_setaffinity(0, cpus)
x = 0
while time.monotonic() < deadline and os.getppid() == parent:
    for _ in range(100000):
        x += 1
"""
_LIVE: list[subprocess.Popen] = []  # this process's busy loops, stopped at exit whatever happens


def noisy_cpus(k: int) -> list[int]:
    """The k last cores this process may run on (core 0 tends to take more interrupts)."""
    allowed = sorted(os.sched_getaffinity(0))
    return allowed[-k:] if 0 < k < len(allowed) else allowed


def start_busy(cpus: list[int], procs: int, max_s: float) -> list[subprocess.Popen]:
    out = []
    for _ in range(procs):
        p = subprocess.Popen([sys.executable, "-c", _BUSY_SCRIPT, ",".join(map(str, cpus)), str(max_s)],
                             stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        out.append(p)
        _LIVE.append(p)
    time.sleep(0.5)  # interpreter start-up: spinning before the timed loop begins
    return out


def stop_busy(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout=5)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
        if p in _LIVE:
            _LIVE.remove(p)


atexit.register(lambda: stop_busy(list(_LIVE)))


def pin_threads(cpus: list[int]) -> dict[int, set[int]]:
    """Pin every thread of this process to cpus; returns each thread's previous mask."""
    saved = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            saved[int(tid)] = os.sched_getaffinity(int(tid))
            os.sched_setaffinity(int(tid), cpus)
        except OSError:  # the thread ended meanwhile
            pass
    return saved


def unpin_threads(saved: dict[int, set[int]], default: set[int]) -> None:
    """Restore the masks; threads started while pinned get the process's original mask."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), saved.get(int(tid), default))
        except OSError:
            pass
