"""Gradient accumulation without ``no_sync()``: the micro-batch count, learned.

A loop that accumulates over K micro-batches without ``model.no_sync()``
all-reduces every micro-batch's gradients under DDP, K times the traffic of
one step. The first optimizer step shows how many model calls a step makes;
every rank then agrees (one small all-reduce, at the first ``step()`` on every
rank alike) on deferring: micro-batches 1..K-1 of a step accumulate locally
and the K-th reduces the sum, inside its backward as usual (a graphed loop
replays the tier-2 backward graph without, then with, the all-reduces).

What DDP's loop sees must not change, so two things are watched:

* **the step ends on another count.** Fewer calls than K (the short last
  accumulation of an epoch): the local sums are reduced eagerly before
  anything reads them — at the first read of a ``.grad`` (``clip_grad_norm_``,
  ``scaler.unscale_``, logging) or at ``optimizer.step()``, whichever comes
  first; every rank reduces exactly once in that window, whatever it reads,
  so the collectives pair up. More calls than K: calls from the K-th on
  reduce as DDP does, ``R(R(a) + b) = R(a) + R(b)``. Either is reported.
* **gradients read between micro-batches.** After a deferred backward a
  ``.grad`` holds this rank's partial sum, where DDP's holds the reduced
  one. A loop that reads gradients between micro-batches in its first step
  is never deferred (agreed). One that starts doing so later gets a
  :class:`AccumulationReadError` naming the line, rather than a different
  value (or, if only some ranks read, collectives that no longer pair).

The reads are seen by a ``TorchFunctionMode`` that is only active between a
deferred model call and the next model call, ``step()`` or ``zero_grad()``
(and, to learn, during the first step): ``param.grad`` is a property whose
getter passes through torch-function modes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch.overrides import TorchFunctionMode

from ..launch.agreement import agreed_max
from ..runtime.spans import timed
from .monitor import exit_if_on_top, remove_from_under_own_modes, user_location

logger = logging.getLogger("pygraph_dist")

_GRAD_GET = torch.Tensor.grad.__get__
_BACKWARDS = (torch.Tensor.backward, torch.autograd.backward)


class AccumulationReadError(RuntimeError):
    """Gradients were read between micro-batches whose all-reduce is deferred."""


class _ReadGuard(TorchFunctionMode):
    """Sees ``param.grad`` reads of the model's parameters after a backward."""

    _pgd_mode = True  # monitor.remove_from_under_own_modes

    def __init__(self, owner: LearnedAccumulation) -> None:
        super().__init__()
        self.owner = owner
        self.armed = False  # a backward ran since the window opened
        self.in_backward = False

    @timed("accumulation")  # includes the op itself
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _BACKWARDS:
            self.in_backward = True  # the reducer's own reads (CPU autograd runs hooks here)
            try:
                return func(*args, **kwargs)
            finally:
                self.in_backward = False
                self.armed = True
        if (self.armed and not self.in_backward and func == _GRAD_GET and args
                and id(args[0]) in self.owner.param_ids):
            self.owner.grad_read()
        return func(*args, **kwargs)


class LearnedAccumulation:
    """The per-model state: calls this step, the agreed K, pending local sums."""

    def __init__(self, params, *, reduce_now: Callable[[], None], group, device: torch.device,
                 rank: int, world_size: int, enabled: bool) -> None:
        """``params``: the reducer's (whose ``.grad`` reads are watched);
        ``reduce_now``: all-reduce the pending local sums, unwatched, on the
        compute stream; ``group`` and ``device``: where the first step's
        agreement runs (``group`` is set to None at teardown)."""
        self.param_ids = {id(p) for p in params}
        self.reduce_now = reduce_now
        self.group = group
        self.device = device
        self.rank = rank
        self.calls = 0  # training calls of the model since the last step()
        self.k = 0  # agreed micro-batches per step; 0: every call reduces (DDP)
        self.decided = not enabled or world_size == 1
        self.reason = ("off (wrap(..., learn_accumulation=False))" if not enabled else
                       "nothing to reduce at world size 1" if world_size == 1 else "")
        self.used_no_sync = False
        self.mid_read = False  # a .grad read between micro-batches (first step)
        self.pending = False  # deferred micro-batches not reduced yet
        self.read_in_window = False  # a .grad read since the window opened
        self.read_where = ""
        self.deferred_calls = 0
        self.corrections: dict[str, int] = {}  # reason -> steps
        self._guard: _ReadGuard | None = None

    # ------------------------------------------------------------ the loop
    @timed("accumulation")
    def model_call(self, explicit_sync: bool) -> bool:
        """A training call of the model: whether its backward reduces."""
        self._close_window(at_model_call=True)
        self.calls += 1
        if not explicit_sync:
            self.used_no_sync = True
            return False
        if self.k and self.calls < self.k:
            self.deferred_calls += 1
            self.pending = True
            return False
        if self.k and self.calls == self.k + 1:
            self._note("the step made more micro-batches (each from the learned count on reduces)",
                       f"{self.calls} model calls in a step of {self.k}")
        self.pending = False  # this call's backward reduces the accumulated sum
        return True

    @timed("accumulation")
    def after_model_call(self) -> None:
        """The call returned: watch reads while sums are pending (or to learn)."""
        if self.pending or not self.decided:
            self._open_window()

    @timed("accumulation")
    def zero_grad(self) -> None:
        """The user dropped the gradients: nothing is pending any more."""
        self._close_window(at_model_call=False)
        self.pending = False

    @timed("accumulation")
    def step(self) -> None:
        """``optimizer.step()``, before it steps: reduce what is pending, learn K."""
        self._close_window(at_model_call=False)
        if self.pending:
            self._reduce("the step ended early", f"optimizer.step() after {self.calls} of {self.k} micro-batches")
        if not self.decided:
            self._decide()
        self.calls = 0

    # ------------------------------------------------------------ internals
    def grad_read(self) -> None:
        if not self.decided:
            self.read_where = self.read_where or user_location()
            self.read_in_window = True
            return
        if self.pending:
            self.read_where = user_location()
            self._reduce("gradients read before the last micro-batch",
                         f"a .grad read at {self.read_where} after {self.calls} of {self.k} micro-batches")
            self.read_in_window = True

    def _reduce(self, key: str, detail: str) -> None:
        self.reduce_now()
        self.pending = False
        self._note(key, detail + "; the local sums were reduced eagerly")

    def _note(self, key: str, detail: str) -> None:
        first = key not in self.corrections
        self.corrections[key] = self.corrections.get(key, 0) + 1
        if first and self.rank == 0:
            logger.info("gradient accumulation: %s (reported once per kind)", detail)

    def _decide(self) -> None:
        got = agreed_max([self.calls, -self.calls, int(self.used_no_sync), int(self.mid_read)],
                         group=self.group, device=self.device)
        most, fewest, no_sync, mid = got[0], -got[1], got[2], got[3]
        self.decided = True
        if no_sync:
            self.reason = "off: the loop uses model.no_sync()"
        elif mid:
            self.reason = (f"off: gradients are read between micro-batches"
                           f"{' (' + self.read_where + ')' if self.read_where else ''}")
        elif most != fewest:
            self.reason = f"off: ranks made {fewest} to {most} model calls in their first step"
        elif most < 2:
            self.reason = "one model call per step"
        else:
            self.k = most
            self.reason = f"learned: {most} micro-batches per step, all-reduced on the last"
            if self.rank == 0:
                logger.info("gradient accumulation without no_sync(): %d micro-batches per step, "
                            "learned in the first step; the all-reduce runs on the last of them "
                            "(wrap(..., learn_accumulation=False) reduces every one, as DDP)", most)

    def _open_window(self) -> None:
        if self._guard is None:
            self._guard = _ReadGuard(self)
            self._guard.__enter__()
        self._guard.armed = False
        self.read_in_window = False

    def _close_window(self, *, at_model_call: bool) -> None:
        guard, self._guard = self._guard, None
        if guard is not None and not exit_if_on_top(guard) and not remove_from_under_own_modes(guard):
            guard.owner = _Inert()  # a mode the user entered sits on top: leave ours, disarmed
        if at_model_call and self.read_in_window:
            if not self.decided:
                self.mid_read = True
            else:
                raise AccumulationReadError(
                    f"a gradient was read at {self.read_where} between micro-batches of a step whose "
                    f"all-reduce pygraph_dist defers to the last of {self.k} micro-batches (learned in "
                    "the first step, where no gradient was read between micro-batches). The value "
                    "would have been this rank's partial sum, not DDP's reduced one. Accumulate "
                    "inside model.no_sync() (then .grad holds local sums, as with DDP), or pass "
                    "wrap(..., learn_accumulation=False) to all-reduce every micro-batch.")
        self.read_in_window = False

    def describe(self) -> str:
        text = self.reason
        if self.k:
            text += f"; {self.deferred_calls} micro-batch all-reduces skipped"
            if self.corrections:
                text += "; reduced eagerly: " + ", ".join(f"{r} ({n} steps)" for r, n in self.corrections.items())
        return text


class _Inert:
    """Stands in for the owner of a guard left on the mode stack."""

    param_ids: frozenset = frozenset()

    def grad_read(self) -> None:
        pass
