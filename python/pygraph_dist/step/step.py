"""What one training iteration does, and so what a graph contains.

Forward (with rank 0's buffers, under autocast), the loss, backward with the
gradient reduction, clipping, and the optimizer step (through the GradScaler
for fp16). The same functions run in every mode — probe, warm-up, capture,
eager — so graphed and eager training perform the same kernels in the same
order and stay bitwise equal.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections import defaultdict
from typing import Callable

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch import nn

from ..launch import collectives
from ..loop.amp import AmpConfig, ScaleGrad
from ..loop.conformance import loss_seed
from ..loop.outputs import find_loss, loss_error, map_outputs
from ..reduce.reducer import GradientReducer
from ..runtime import patches
from . import clip_route


_FREE_SIDE_STREAMS: dict[int, list] = {}


def acquire_side_stream(device: torch.device) -> torch.cuda.Stream:
    """A side stream for one wrapped model to warm up and capture on: one that
    an earlier, torn-down model gave back, else a new one.

    cuBLAS and cuBLASLt keep a workspace per (handle, stream) for the life of
    the process (torch's CublasHandlePool), so a new stream per model left
    65 MiB allocated on an H100 (torch 2.11) for every model wrapped and torn
    down. Two live models never share a stream: newer torch frees a stream's
    workspaces when any graph captured on it is destroyed (pytorch#193402),
    which would pull the workspace from under the other model's graphs."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    free = _FREE_SIDE_STREAMS.setdefault(index, [])
    return free.pop() if free else torch.cuda.Stream(torch.device("cuda", index))


def release_side_stream(stream: torch.cuda.Stream) -> None:
    """Give a model's side stream back, once its graphs are destroyed."""
    _FREE_SIDE_STREAMS.setdefault(stream.device.index, []).append(stream)


class IterationStep:
    def __init__(
        self,
        module: nn.Module,
        optimizer: torch.optim.Optimizer,
        reducer: GradientReducer,
        *,
        amp: AmpConfig,
        grad_scaler: torch.amp.GradScaler | None,
        loss_fn: Callable | None,
        max_grad_norm: float | None,
        group: dist.ProcessGroup,
        broadcast_buffers: bool,
        device: torch.device,
        skip_nonfinite: bool = False,
    ) -> None:
        self.module = module
        # What the model call runs: the module, or its torch.compile'd callable
        # (wrap(compile=...), compiled.py).
        self.call = module
        self.optimizer = optimizer
        self.optimizer_class = type(optimizer)  # the user's: wrap() swaps the class in later
        self.reducer = reducer
        self.amp = amp
        self.grad_scaler = grad_scaler
        self.loss_fn = loss_fn
        self.max_grad_norm = max_grad_norm
        # The global norm of the last clipped step, before clipping (written inside
        # the step graph too): what a framework's clip_grad_norm_() hands back.
        # In the gradients' dtype, as clip_grad_norm_ returns it.
        self.grad_norm = self._norm_buffer(device) if max_grad_norm is not None else None
        # The user's own clip_grad_norm_, moved into the steps the engine runs
        # (clip_route.py; agreed by the probe). Never in a step the loop runs.
        self.routed_clip = None
        # Whether the one 0-dim tensor of a tuple output is the loss (find_loss):
        # set at wiring, only where the probe's monitor checks which tensor the
        # loop calls backward() on, and never with amp="fp16" (whose scaling of
        # every output of a loss-less call must not change).
        self.tuple_loss = False
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.device = device
        self.stream = acquire_side_stream(device) if device.type == "cuda" else None
        self.mark = None  # set around a capture: PoolAccount.mark (pool_account.py)
        self.loss_chain = None  # the constants the loop scales the loss by (probe.py; tier 1)
        self.buffers = list(module.buffers()) if broadcast_buffers and self.world_size > 1 else []
        self.sparse_ids = {id(p) for p in reducer.sparse_params}
        # skip_nonfinite: steps skipped because the reduced gradients held inf or
        # NaN, counted on the device (no host sync inside the iteration).
        self.skip_nonfinite = skip_nonfinite
        self.skipped = torch.zeros(1, dtype=torch.float32, device=device) if skip_nonfinite else None
        # True while the engine itself calls optimizer.step(): the graph-aware
        # optimizer then runs the real step instead of routing to the engine.
        self.delegating = False
        # Whether place_optimizer_state() has run (it runs once, before the first step).
        self.state_placed = device.type != "cuda"

    def _norm_buffer(self, device) -> torch.Tensor:
        params = self.reducer.params
        return torch.zeros((), dtype=params[0].dtype if params else torch.float32, device=device)

    def route_clip(self, plan) -> None:
        """Clip as ``plan`` (a clip_route.ClipPlan) in every step the engine runs.
        The norm buffer in the dtype torch's clip_grad_norm_ returns: the
        gradients' dtypes promoted (mixed bf16/fp32 parameters give fp32)."""
        self.routed_clip = plan
        dtype = functools.reduce(torch.promote_types, (p.dtype for p in plan.params))
        if self.grad_norm is None or self.grad_norm.dtype != dtype:
            self.grad_norm = torch.zeros((), dtype=dtype, device=self.device)

    # ---------------------------------------------------------- streams
    @contextlib.contextmanager
    def on_compute_stream(self):
        """Run on the capture stream, ordered after and before the caller's stream.

        Every iteration computes there, probe and eager ones included, so that
        the AccumulateGrad nodes autograd caches per parameter (kept alive by
        any loss the user still holds) always carry the capture stream; a node
        created on another stream makes capture fail (torch warns "The
        AccumulateGrad node's stream does not match", input_buffer.cpp)."""
        if self.stream is None:
            yield
            return
        current = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(current)
        with torch.cuda.stream(self.stream):
            yield
        current.wait_stream(self.stream)

    # ------------------------------------------------------------ parts
    def outputs(self, args, kwargs):
        """What the model call computes: the module's output, or loss_fn's."""
        if self.loss_fn is None:
            return self.call(*args, **kwargs)
        if not args:
            raise TypeError(
                "with loss_fn=..., call the wrapped model as model(*inputs, target): the last "
                "positional argument is the target"
            )
        return self.loss_fn(self.call(*args[:-1], **kwargs), args[-1])

    def forward(self, args, kwargs, *, sync: bool = True, need_loss: bool = True):
        """Buffers, then the outputs under autocast, the reducer armed for the
        backward that follows (``sync=False``: inside ``no_sync()``, gradients
        accumulate locally). Returns ``(loss, outputs)``; ``loss`` is None when
        the outputs hold no loss and ``need_loss`` is False."""
        self.reducer.wait_tail()  # never left behind by an earlier iteration, but cheap to be sure
        self.reducer.enabled = sync
        self.broadcast_buffers()
        with self.amp.autocast():
            out = self.outputs(args, kwargs)
        loss = find_loss(out, tuples=self.tuple_loss)
        if loss is None and need_loss:
            raise TypeError(loss_error(out, "loss_fn" if self.loss_fn is not None else "the wrapped module"))
        return loss, out

    def scaled(self, loss: torch.Tensor) -> torch.Tensor:
        """The tensor whose backward the iteration runs (fp16: the scale applied in backward)."""
        if self.grad_scaler is None:
            return loss
        return ScaleGrad.apply(loss, self.grad_scaler._scale)  # noqa: SLF001

    def forward_backward(self, inputs):
        """Forward and backward of the whole batch; ``(loss, outputs)``."""
        args, kwargs = inputs
        loss, out = self.forward(args, kwargs)
        if self.mark is not None:  # a capture accounting its pool (pool_account.py)
            self.mark("forward")
        # The loop's own scaling of the loss (loss *= n, loss / k; conformance.scale_chain) as the seed.
        self.scaled(loss).backward(loss_seed(self.loss_chain, loss) if self.loss_chain else None)
        self.reducer.finish_pending()
        if self.mark is not None:
            self.mark("backward")
        # Detached, so that a graph's static outputs hold no autograd graph;
        # the loss keeps its identity inside the outputs.
        detached = loss.detach()
        return detached, map_outputs(out, lambda t: detached if t is loss else t.detach())

    def body(self, inputs):
        """The whole iteration: what a one-graph capture contains; ``(loss, outputs)``.

        Nothing of the user's runs between this backward and this step, so
        where the step is per parameter (``overlap_reason() is None``) the
        last bucket's all-reduce — the first layers' gradients, ready only at
        the very end of backward, with nothing left to hide it behind — runs
        while every other parameter steps."""
        self.reducer.defer_waits = self.overlap_reason() is None
        try:
            result = self.forward_backward(inputs)
        finally:
            self.reducer.defer_waits = False
        self.apply_step(None, owned=True)
        return result

    def overlap_reason(self) -> str | None:
        """Why the step cannot overlap the last bucket's all-reduce (None: it can).
        The split step must be the same step: per-parameter updates only, no
        global norm or inf check over all gradients, no hooks that would run
        twice."""
        from torch.optim import optimizer as _optimizer

        if self.world_size == 1:
            return "nothing to overlap"
        if os.environ.get("PYGRAPH_DIST_STEP_OVERLAP", "1") == "0":
            return "switched off by PYGRAPH_DIST_STEP_OVERLAP=0"
        if (self.max_grad_norm is not None or self.routed_clip is not None or self.grad_scaler is not None
                or self.skip_nonfinite):
            return "the step needs every reduced gradient first (clipping, scaler or inf check)"
        if self.sparse_ids:
            return "sparse parameters split the step already"
        if self.optimizer_class not in PER_PARAMETER_OPTIMIZERS:
            return f"{self.optimizer_class.__name__} is not known to step per parameter"
        if (self.optimizer._optimizer_step_pre_hooks or self.optimizer._optimizer_step_post_hooks  # noqa: SLF001
                or _optimizer._global_optimizer_pre_hooks or _optimizer._global_optimizer_post_hooks):  # noqa: SLF001
            return "optimizer step hooks would run twice"
        return None

    def apply_step(self, closure, part: str = "all", *, owned: bool = False):
        """Clip (if configured), then step — through GradScaler for fp16.

        With sparse parameters the step is split, always in the same way:
        ``part="graphed"`` steps the dense parameters (the step graph),
        ``part="sparse"`` the sparse ones (eagerly: sparse updates sync), and
        ``"all"`` does both in that order, so eager and graphed training
        run the same kernels. wrap() refuses clipping and fp16 with sparse
        gradients, so both parts are plain optimizer steps.

        ``owned``: the engine runs this iteration (warm-up, capture), so the
        user's clip_grad_norm_ routed into the step applies (clip_route.py);
        in a step the loop runs, the user's own call clips."""
        if not self.state_placed:
            self.place_optimizer_state()
        self.delegating = True
        try:
            ids = self.sparse_ids
            if ids:
                result = None
                if part in ("all", "graphed"):
                    with only_params(self.optimizer, lambda p: id(p) not in ids):
                        result = self._optimizer_step(closure)
                if part in ("all", "sparse"):
                    with only_params(self.optimizer, lambda p: id(p) in ids):
                        self.optimizer.step()
                return result
            tail = self.reducer.take_tail()
            if tail is not None:  # only left by body() when overlap_reason() is None
                return self._step_around_tail(*tail)
            norm = None
            routed = self.routed_clip if owned else None
            if self.max_grad_norm is not None:
                if self.grad_scaler is not None:
                    self.grad_scaler.unscale_(self.optimizer)
                params = [p for p in self.reducer.params if p.grad is not None]
                norm = clip_route.clip_in_spans(params, self.max_grad_norm)
                self.grad_norm.copy_(norm)
            elif routed is not None:  # torch's call as the user wrote it, their parameter order
                norm = clip_route.clip_in_spans(routed.params, routed.max_norm, routed.foreach)
                self.grad_norm.copy_(norm)
            if self.grad_scaler is not None:
                result = self.grad_scaler.step(self.optimizer)
                self.grad_scaler.update()
                return result
            if self.skip_nonfinite:
                # After the user's own clip (routed), judged on the clipped gradients,
                # as the eager step after their call judges them.
                return self._step_if_finite(closure, norm if routed is None else None)
            return self._optimizer_step(closure)
        finally:
            self.delegating = False

    def place_optimizer_state(self) -> None:
        """Once, before the first step creates the optimizer's state: give the
        cached blocks of the iteration just run back to the driver, so that the
        state (twice the parameters for Adam) is allocated in segments of its own.

        Created lazily by the first ``step()``, the state otherwise lands in the
        free blocks of the activations of the first backward, splitting their
        segments. A split segment holding one live block can be neither reused
        by the graphs' private pool nor released by the ``empty_cache()`` that
        ``torch.cuda.graph`` runs before capture, so its free part stays
        reserved next to the pool for good (issue 26, peak reserved memory at
        world size 1). Placement only: the arithmetic is unchanged. Not while
        capturing (a capture cannot free memory), and not when the state exists
        already (a loaded checkpoint)."""
        self.state_placed = True
        if self.optimizer.state or torch.cuda.is_current_stream_capturing():
            return
        torch.cuda.empty_cache()

    def _step_around_tail(self, indices: list[int], work):
        """The step in two parts: the parameters outside the tail bucket
        (already reduced), then the tail's once its all-reduce is done.
        Per-parameter optimizers make this the same step, bitwise."""
        params = self.reducer.params
        last = {id(params[i]) for i in indices}
        if any(p.grad is not None and id(p) not in last for p in params):
            with only_params(self.optimizer, lambda p: id(p) not in last):
                self._optimizer_step(None)
        work.wait()
        with only_params(self.optimizer, lambda p: id(p) in last):
            return self._optimizer_step(None)

    def _step_if_finite(self, closure, norm):
        """The optimizer step, skipped inside the fused kernel when the global
        gradient norm is not finite. Gradients are all-reduced, so every rank
        sees the same norm and skips alike; no host sync."""
        if norm is None:
            grads = [p.grad for p in self.reducer.params if p.grad is not None]
            norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads))) if grads else None
        if norm is None:
            return self._optimizer_step(closure)
        # A 0-dim tensor, like GradScaler's: fused Adam subtracts it from each 0-dim step count.
        found_inf = (~torch.isfinite(norm)).to(torch.float32).reshape(())
        self.skipped.add_(found_inf)
        if not all(g.get("fused") for g in self.optimizer.param_groups):
            # Not graphed (CPU parameters): a host check does the same.
            return None if bool(found_inf) else self._optimizer_step(closure)
        self.optimizer.found_inf = found_inf  # read by fused Adam/AdamW/SGD, as GradScaler does
        try:
            return self._optimizer_step(closure)
        finally:
            del self.optimizer.found_inf

    def _optimizer_step(self, closure):
        return self.optimizer.step(closure) if closure is not None else self.optimizer.step()

    def clear_grads(self) -> None:
        for p in self.reducer.params:
            p.grad = None

    def reset_grad_scaler_round(self) -> None:
        """Forget what a failed capture left in the scaler's per-optimizer state."""
        if self.grad_scaler is not None:
            patches.reset_grad_scaler_round(self.grad_scaler)

    # ----------------------------------------------------------- inputs
    def to_device(self, args, kwargs):
        if self.device.type != "cuda":
            return args, kwargs

        def move(x):
            if isinstance(x, torch.Tensor) and x.device != self.device:
                return x.to(self.device, non_blocking=True)
            return x

        return pytree.tree_map(move, (args, kwargs))

    def static_copy(self, x):
        if isinstance(x, torch.Tensor):
            s = torch.empty_like(x, device=self.device)
            s.copy_(x)
            return s
        return x

    def evaluate(self, args, kwargs):
        """Eval mode or no_grad: the module's own output (or loss_fn's), no graphs."""
        args, kwargs = self.to_device(args, kwargs)
        with self.amp.autocast():
            return self.outputs(args, kwargs)

    # ---------------------------------------------------------- buffers
    def broadcast_buffers(self) -> None:
        """Rank 0's buffers at the start of every forward, as DDP(broadcast_buffers=True)."""
        if not self.buffers:
            return
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = defaultdict(list)
        for b in self.buffers:
            by_dtype[b.dtype].append(b)
        for tensors in by_dtype.values():
            flat = torch._utils._flatten_dense_tensors(tensors)
            collectives.broadcast(flat, group_src=0, group=self.group)
            if self.rank != 0:
                torch._foreach_copy_(tensors, torch._utils._unflatten_dense_tensors(flat, tensors))

    def sync_module_states(self) -> None:
        """Start every rank from rank 0's parameters and buffers, as DDP does."""
        if self.world_size == 1:
            return
        with torch.no_grad():
            for t in list(self.module.parameters()) + list(self.module.buffers()):
                collectives.broadcast(t.data, group_src=0, group=self.group)


# torch's optimizers that update each parameter from its own gradient and
# state only: stepping the parameters in two calls is the same step, bitwise.
PER_PARAMETER_OPTIMIZERS = frozenset(
    getattr(torch.optim, n) for n in ("SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "RMSprop",
                                      "Adagrad", "Adadelta", "Rprop") if hasattr(torch.optim, n))


@contextlib.contextmanager
def only_params(optimizer: torch.optim.Optimizer, keep: Callable[[torch.Tensor], bool]):
    """Let ``optimizer.step()`` see only the parameters ``keep`` selects.
    Per-parameter optimizers (all that wrap() accepts with sparse gradients)
    update each parameter from its own state, so a split step is the same step."""
    saved = [g["params"] for g in optimizer.param_groups]
    try:
        for g in optimizer.param_groups:
            g["params"] = [p for p in g["params"] if keep(p)]
        yield
    finally:
        for g, params in zip(optimizer.param_groups, saved):
            g["params"] = params
