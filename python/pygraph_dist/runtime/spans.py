"""Host-time spans of the per-step path, for benchmarks/host_cost.py.

``PYGRAPH_DIST_HOST_SPANS=1`` in the environment *before* pygraph_dist is
imported turns them on; it is read once, here. Off (the default), ``timed``
returns the function it decorates unchanged, so the hot path pays nothing,
not even a global check.

On, every decorated function adds its *exclusive* host time (its own
duration minus that of the spans it called) to its phase, so the phases of
one step add up to the time spent inside spans without double counting. A
span costs about two ``perf_counter_ns`` calls and a wrapper frame (~0.3-1 us
on a busy host): compare phases with each other, and totals with a run that
has spans off.
"""

from __future__ import annotations

import functools
import os
from time import perf_counter_ns
from typing import Callable, TypeVar

ENABLED: bool = os.environ.get("PYGRAPH_DIST_HOST_SPANS", "") == "1"

F = TypeVar("F", bound=Callable)

# phase -> [exclusive ns, calls]
_totals: dict[str, list[int]] = {}
# One slot per open span: the inclusive ns of the spans it called.
_children: list[int] = []


def timed(phase: str) -> Callable[[F], F]:
    """Decorator: count the function's exclusive host time under ``phase``
    (identity when spans are off)."""

    def decorate(fn: F) -> F:
        if not ENABLED:
            return fn
        rec = _totals.setdefault(phase, [0, 0])

        @functools.wraps(fn)
        def inner(*args, **kwargs):
            _children.append(0)
            t0 = perf_counter_ns()
            try:
                return fn(*args, **kwargs)
            finally:
                dt = perf_counter_ns() - t0
                rec[0] += dt - _children.pop()
                rec[1] += 1
                if _children:
                    _children[-1] += dt

        return inner  # type: ignore[return-value]

    return decorate


def reset() -> None:
    """Zero every phase (e.g. after warm-up)."""
    for rec in _totals.values():
        rec[0] = rec[1] = 0


def snapshot() -> dict[str, dict[str, int]]:
    """``{phase: {"ns": exclusive ns, "calls": n}}`` since the last :func:`reset`."""
    return {phase: {"ns": rec[0], "calls": rec[1]} for phase, rec in _totals.items()}


def overhead_ns(samples: int = 20000, rounds: int = 5) -> float:
    """Measured cost of one span around an empty function, in ns (0 when off).
    The fastest of ``rounds`` passes of each: a process descheduled during one
    pass (a loaded CI machine) once made the bare loop the slower, and the
    cost 0."""
    if not ENABLED:
        return 0.0

    def empty():
        return None

    wrapped = timed("__calibration__")(empty)
    per_round = max(1, samples // rounds)

    def one_pass(fn) -> int:
        t0 = perf_counter_ns()
        for _ in range(per_round):
            fn()
        return perf_counter_ns() - t0

    bare = min(one_pass(empty) for _ in range(rounds))
    spanned = min(one_pass(wrapped) for _ in range(rounds))
    _totals.pop("__calibration__", None)
    return max(0.0, (spanned - bare) / per_round)
