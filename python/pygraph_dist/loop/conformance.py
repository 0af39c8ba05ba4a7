"""The state of the user's training loop, and what it may do.

A replayed graph performs forward, backward, reduction, clipping and the
optimizer step at the model call, so afterwards the user's ``backward()``,
``step()`` and ``zero_grad()`` must be no-ops, and anything else the loop
does to parameters, gradients or optimizer state between the model call and
``step()`` would be silently lost. :class:`LoopState` is the one owner of
where the loop stands (stage, who runs backward and step this iteration,
whether ``zero_grad()`` happened since the last step, the loss handed out,
the probe's verdict) and of the rule for deviations: :meth:`violation`
records one during the probe (the verdict is agreed across ranks and turns
graphs off, the loop keeps running as written) and raises
:class:`LoopConformanceError` once graphs run the iteration (the step has
already happened; continuing would train differently from what the loop says).
"""

from __future__ import annotations

import contextlib
import enum
import zlib
from typing import Callable

import torch

from ..runtime.spans import timed
from .monitor import LoopMonitor, Violation, user_location


class LoopConformanceError(RuntimeError):
    """The training loop changed after graphs were captured, in a way a replay cannot honour."""


class Stage(enum.Enum):
    IDLE = "idle"          # between optimizer.step() and the next model call
    FORWARD = "forward"    # the model call returned; backward() expected
    BACKWARD = "backward"  # backward() done; optimizer.step() expected


class Mode(enum.Enum):
    USER = "user"    # the loop as written: the user's backward() and step() do the work
    OWNED = "owned"  # the engine ran (or replayed) the whole iteration at the model call


AFTER_CALL = "between the model call and optimizer.step()"
AFTER_BACKWARD = "between loss.backward() and optimizer.step()"


class LoopState:
    def __init__(self, owned_storages: Callable[[], set[int]], *, monitor: bool) -> None:
        self.stage = Stage.IDLE
        self.mode: Mode | None = None
        self.zeroed_since_step = True
        self.returned_loss: torch.Tensor | None = None
        self.returned_edge: tuple | None = None
        self.returned_version = 0
        self.probe_done = False
        self.verdict: str | None = None  # why the loop cannot be graphed, once agreed
        # Tier 2 (agreed during the probe): why the whole iteration cannot be one
        # graph, while forward/backward graphs with the user's code between them can.
        self.split_reason: str = ""
        self.saw_no_sync = False  # a probe step called the model inside no_sync()
        self.backward_seen = False  # backward() called since the last model call
        self.zero_check_pending = False  # probe: gradients were present at the model call
        # Probe: autograd nodes of the outputs handed out this step, and the
        # model's parameters, to tell whether the user's loss reaches
        # parameters other than through the model call (tier 2 could not).
        self.output_nodes: set = set()
        self.param_ids: set[int] = set()
        self.monitor = LoopMonitor(self, owned_storages) if monitor else None
        self.forward_violations: list[Violation] = []
        # clip_route.py: the user's clip_grad_norm_ seen in this probe step, the
        # probe steps' so far, and the calls in this (owned) iteration.
        self.clip_this_step = None
        self.clip_probe: list = []
        self.clip_calls = 0
        # The constants the loop scales the returned loss by before backward()
        # (scale_chain; None: not scaled), set at the probe; False with a GradScaler.
        self.loss_chain: tuple | None = None
        self.loss_key: tuple | None = None  # chain_key(loss_chain); () for an unscaled loss
        self.scaled_loss_ok = True

    @property
    def owned(self) -> bool:
        return self.mode is Mode.OWNED

    # ---------------------------------------------------------- the rule
    def violation(self, what: str, fix: str, *, defer: bool = False, split_ok: bool = False) -> None:
        """A deviation from a loop a graph can replay: recorded while the loop
        runs as written (probe), raised once graphs run the iteration.

        ``defer``: record it even then, to be raised at ``optimizer.step()``
        (for calls seen inside the monitor's own handler, where the mode
        cannot be popped). ``split_ok``: tier 2 (forward and backward graphs,
        the user's code between them) still honours it."""
        if self.owned and not defer:
            self.stop()
            raise LoopConformanceError(f"{what} at {user_location()}, after graphs were captured. {fix}")
        if self.monitor is not None and self.monitor.active:
            self.monitor.record(what, fix, split_ok=split_ok)

    def forward_violation(self, what: str, where: str, fix: str) -> None:
        """Something the probe saw inside the forward (outside the monitor's
        window), judged with the rest at ``optimizer.step()``. Tier 2 replays
        the forward too, so it does not honour it."""
        if self.monitor is not None:
            self.forward_violations.append(Violation(what, where, fix, split_ok=False))

    def watch(self, window: str) -> None:
        """Start (or move) the monitor's window over the user's code."""
        if self.monitor is not None:
            self.monitor.start(window)

    @contextlib.contextmanager
    def unwatched(self):
        """The monitor looks away (the engine's own writes, e.g. inside zero_grad())."""
        m = self.monitor
        active = m is not None and m.active
        if active:
            m.active = False
        try:
            yield
        finally:
            if active:
                m.active = True

    def stop(self) -> list[Violation]:
        return self.monitor.stop() if self.monitor is not None else []

    # ------------------------------------------------------- transitions
    @timed("loop state")
    def model_called(self, *, in_no_sync: bool = False) -> None:
        """Before a training call of the model: in a graphed loop, a step must
        have ended the last one, outside ``no_sync()``."""
        if self.stage is not Stage.IDLE:
            several = self.stage is Stage.FORWARD and not self.backward_seen
            self.violation(
                "the wrapped model was called again before backward() of the previous call's "
                "outputs (several forward passes into one loss)" if several else
                "the wrapped model was called again before optimizer.step() (gradient "
                "accumulation, or a second forward pass in one training step)",
                "Each graph replay is one full optimizer step, already taken when the model call "
                "returns: use one model call per optimizer.step(), or wrap(..., graphs=False). To "
                "skip the step on a non-finite loss, pass wrap(..., skip_nonfinite=True), which skips "
                "it inside the graph, instead of skipping backward()/step() in the loop."
                if self.owned else
                "Graphs replay one forward pass at a time; this loop trains eagerly, as written."
                if several else
                "One model call per optimizer.step() can be graphed as one iteration; accumulation "
                "is graphed per micro-batch (tier 2).",
                split_ok=not several,
            )
        if in_no_sync:
            self.saw_no_sync = True
            self.violation(
                "the model was called inside model.no_sync() (gradient accumulation without "
                "reduction)",
                "A whole-iteration graph always reduces gradients; accumulation is graphed per "
                "micro-batch (tier 2)." if not self.owned else
                "Change the loop back, or wrap(..., graphs=False).",
                split_ok=True,
            )

    @timed("loop state")
    def user_forward(self, *, probe: bool, grads_present: bool) -> None:
        """The loop runs as written this iteration."""
        # Checked at the backward, not here: zero_grad() between the model call and
        # backward() (a common DDP loop) zeroes in time.
        self.zero_check_pending = probe and not self.zeroed_since_step and grads_present
        self.mode = Mode.USER

    @timed("loop state")
    def handed_out(self, loss: torch.Tensor | None, *, watch: bool = True) -> None:
        """The model call returned; ``loss`` is the loss among its outputs, or None."""
        self.returned_loss = loss
        # Taken now: an in-place change of the loss (loss *= k) moves its grad_fn and version.
        self.returned_edge = loss_edge(loss) if loss is not None else None
        self.returned_version = loss._version if loss is not None else 0
        self.stage = Stage.FORWARD
        self.backward_seen = False
        self.clip_calls = 0
        if watch:
            self.watch(AFTER_CALL)

    @timed("loop state")
    def backward_called(self, target, kwargs: dict) -> bool:
        """A ``backward()`` in the user's window; returns whether it should run."""
        self.backward_seen = True
        if self.zero_check_pending:
            self.zero_check_pending = False
            if not self.zeroed_since_step:
                self.violation(
                    "optimizer.zero_grad() was not called since the previous optimizer.step(), so "
                    "gradients accumulate across iterations",
                    "A graph overwrites gradients every iteration; call zero_grad() once per step.",
                )
        if isinstance(target, (list, tuple)) and len(target) == 1:
            target = target[0]
        loss = self.returned_loss
        # The returned loss, unchanged -- or scaled by constants (Accelerate's
        # loss / gradient_accumulation_steps, the Trainer's loss *= process count),
        # the same ones at every step: a graph seeds its backward with what those
        # steps make of 1.0, bitwise the loop's own seed (loss_seed).
        chain = None
        if loss is not None and not getattr(target, "_backward_hooks", None):
            chain = (() if target is loss and target._version == self.returned_version
                     else scale_chain(target, loss, self.returned_edge))
        is_loss = chain is not None and self._same_scale(chain)
        if not is_loss and self.output_nodes and self.reaches_params(target):
            self.violation(
                "the loss's backward reaches model parameters directly, not only through the "
                "outputs of the model call (for example a regulariser over model.parameters() "
                "computed outside the model)",
                "Graphs hold the model's backward; compute that term inside the module's forward "
                "(or loss_fn=...) to have the loop graphed.",
            )
        extra = any(kwargs.get(k) is not None for k in ("gradient", "grad_tensors", "inputs")) or bool(
            kwargs.get("create_graph"))
        expected = is_loss and not extra and self.stage is Stage.FORWARD
        if not expected and self.returned_loss is None:
            self.violation(
                "the loss is computed outside the model (the model call returned no loss, and "
                "backward() was called on the user's own loss)",
                "A whole-iteration graph needs the loss inside the model call: return it from the "
                "module (or an output with .loss), or pass wrap(..., loss_fn=...) and call "
                "model(*inputs, target).",
                split_ok=not extra,
            )
        elif not expected:
            self.violation(
                "backward() was called on a tensor other than the loss returned by the model call "
                "(for example a sum with another loss, a scale that changes from step to step, or "
                "scaler.scale(loss)), or with extra arguments"
                if not is_loss or extra
                else "backward() was called twice in one training step",
                "A graph applies the backward of the returned loss. Compute the full loss inside "
                "the model or loss_fn=..., and use amp='fp16' instead of your own GradScaler.",
                split_ok=not extra,
            )
        if self.monitor is not None:
            self.monitor.set_window(AFTER_BACKWARD)
        if self.owned:
            self.stage = Stage.BACKWARD
            return False  # the graph (or the owned iteration) already ran it
        return True

    def _same_scale(self, chain: tuple) -> bool:
        """Whether the loss's scaling ``chain`` is the loop's: unit steps drop
        out; the probe's first backward sets it (an unscaled loss too), the
        other probe steps and every owned iteration must match it. A GradScaler
        (amp="fp16") takes none."""
        key = chain_key(chain)
        if key and not self.scaled_loss_ok:
            return False
        if self.loss_key is None and not self.owned and not self.probe_done:  # the probe's first backward
            self.loss_key = key
            self.loss_chain = tuple((op, t.detach().clone()) for op, t in chain) if key else None
        return key == (self.loss_key or ())

    def reaches_params(self, target) -> bool:
        """Whether ``target``'s autograd graph reaches a model parameter without
        passing through an output of a model call (probe only: a graph walk)."""
        stack = [getattr(target, "grad_fn", None)] if isinstance(target, torch.Tensor) else []
        seen: set = set()
        while stack:
            fn = stack.pop()
            if fn is None or fn in seen or fn in self.output_nodes:
                continue
            seen.add(fn)
            var = getattr(fn, "variable", None)
            if var is not None and id(var) in self.param_ids:
                return True
            stack.extend(n for n, _ in fn.next_functions)
        return False

    @timed("loop state")
    def backward_finished(self) -> None:
        """End of an autograd backward that reduced gradients (the user's)."""
        if self.mode is Mode.USER:
            self.stage = Stage.BACKWARD

    @timed("loop state")
    def step_called(self, closure, *, probe: bool) -> list[Violation]:
        """``optimizer.step()``: check it, close the window and return what the probe saw."""
        if closure is not None:
            self.violation("optimizer.step(closure) re-evaluates the model",
                           "Closures re-evaluate the model; a graph cannot. Change the loop back, "
                           "or wrap(..., graphs=False)." if self.owned else
                           "Closures re-evaluate the model; a graph cannot.")
        if self.stage is Stage.FORWARD and (self.owned or probe) and self.monitor is not None:
            self.violation("optimizer.step() was called without loss.backward()",
                           "A graph always runs backward before the step. Call loss.backward().")
        seen = self.stop() + self.forward_violations
        self.forward_violations = []
        if self.owned and seen:
            raise LoopConformanceError(
                f"{seen[0]} — after graphs were captured, the optimizer step already ran inside "
                "the graph. Change the loop back, or wrap(..., graphs=False)."
            )
        self.stage = Stage.IDLE
        self.zeroed_since_step = False
        self.zero_check_pending = False
        self.output_nodes = set()
        return seen

    def stage_after_backward(self) -> bool:
        return self.stage is Stage.BACKWARD

    def in_step(self) -> bool:
        """Between a model call and its optimizer.step()."""
        return self.stage is not Stage.IDLE

    def clip_seen(self, plan) -> None:
        """Probe: a clip_grad_norm_ the step could apply (clip_route.py)."""
        if self.clip_this_step is not None:
            self.violation("clip_grad_norm_() was called twice in one step",
                           "Clip once per step to have the whole iteration graphed.", split_ok=True)
        self.clip_this_step = plan

    def end_probe_step(self) -> None:
        """Probe: this step's clip joins the probe's record."""
        self.clip_probe.append(self.clip_this_step)
        self.clip_this_step = None

    @timed("loop state")
    def zero_grad_called(self) -> None:
        if self.stage is Stage.BACKWARD:
            self.violation("zero_grad() between loss.backward() and optimizer.step() discards the "
                           "gradients", "Call zero_grad() before the model call or after step().")
        self.zeroed_since_step = True


_UNIT_OPS = ("DivBackward0", "MulBackward0")
_MAX_UNIT_STEPS = 4


def loss_edge(loss: torch.Tensor) -> tuple:
    """Where a tensor computed from ``loss`` points in autograd: its node and
    output number, or (None, the tensor) for a leaf."""
    return (loss.grad_fn, loss.output_nr) if loss.grad_fn is not None else (None, loss)


def scale_chain(target, loss, edge: tuple | None = None) -> tuple | None:
    """The steps by which ``target`` is ``loss`` multiplied or divided by
    numbers (in place or not, up to a few times), from ``target`` down:
    ``(("mul" | "div", the 0-dim CPU tensor autograd saved; clone it to keep it), ...)``; None when
    it is not. ``edge``: ``loss_edge(loss)`` taken when the loss was handed
    out, before any in-place change. Read from the autograd nodes
    (``_saved_other``: no device sync)."""
    if not isinstance(target, torch.Tensor) or not isinstance(loss, torch.Tensor):
        return None
    if target.dtype != loss.dtype or target.shape != loss.shape:
        return None
    want, want_nr = edge if edge is not None else loss_edge(loss)
    fn, chain = target.grad_fn, []
    for _ in range(_MAX_UNIT_STEPS):
        if fn is None or type(fn).__name__ not in _UNIT_OPS:
            return None
        edges = fn.next_functions
        if len(edges) != 2 or edges[1][0] is not None:
            return None
        try:
            other = fn._saved_other  # noqa: SLF001
        except (AttributeError, RuntimeError):
            return None
        if not (isinstance(other, torch.Tensor) and other.device.type == "cpu" and other.numel() == 1):
            return None
        chain.append(("mul" if type(fn).__name__ == "MulBackward0" else "div", other))
        node, nr = edges[0]
        if (want is not None and node is want and nr == want_nr) or (
                want is None and getattr(node, "variable", None) is want_nr):
            return tuple(chain)
        fn = node
    return None


def chain_key(chain: tuple) -> tuple:
    """A scaling chain as comparable values, steps by 1 left out (exact)."""
    return tuple((op, str(t.dtype), v) for op, t in chain if (v := t.item()) != 1)


def chain_digest(chain: tuple | None) -> int:
    """A number every rank computes alike from the same scaling (0: none)."""
    key = chain_key(chain) if chain else ()
    return zlib.crc32(repr(key).encode()) if key else 0


def loss_seed(chain: tuple, loss: torch.Tensor) -> torch.Tensor | None:
    """What backward of ``loss`` scaled by ``chain`` hands the loss: 1.0 through
    each step's backward (MulBackward0: ``grad * other``, DivBackward0:
    ``grad / other``), the same ops on the same dtypes, so bitwise the same.
    None for an unscaled loss."""
    if not chain_key(chain):
        return None
    seed = torch.ones_like(loss)
    for op, other in chain:
        seed = seed * other if op == "mul" else seed / other
    return seed

