"""Bucketed gradient all-reduce driven by autograd hooks — our own, not DDP's.

DDP's reducer is what breaks whole-iteration capture (runtime-stats syncs on
iterations 1-10, ``find_unused_parameters`` D2H copies, AccumulateGrad nodes
pinned to the construction stream; reference notes §1.2, §1.4). This one is
plain autograd hooks and c10d calls, so a capture records exactly its kernels:

* parameters are planned into buckets by the torch-free core
  (``plan_buckets``: reverse order, per dtype/device, first bucket small);
* each parameter's post-accumulate-grad hook writes ``grad / world_size`` into
  its slot of the bucket's flat buffer (DDP multiplies by 1/world_size while
  copying, ``Reducer::mark_variable_ready_dense``; same arithmetic);
* a full bucket is all-reduced asynchronously, strictly in bucket order, so
  every rank issues the same collectives in the same order whatever order its
  gradients arrive in (DDP's ``next_bucket_`` rule); NCCL runs it on its own
  stream, overlapped with the rest of backward;
* at the end of backward (an autograd final callback, which runs on the
  stream backward was called from) the remaining buckets are launched, the
  caller's stream waits for every all-reduce, and each ``param.grad`` becomes
  a view into its bucket (DDP's ``gradient_as_bucket_view``) — no copy back,
  and every graph of the model shares the same gradient memory.

A parameter that produced no gradient in a backward pass contributes zeros to
its bucket (its slot is cleared), and its ``.grad`` is still set to the
reduced value so that every rank applies the same update.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.autograd import Variable

from ._ext import C

logger = logging.getLogger("pygraph_dist")

DEFAULT_FIRST_BUCKET_MB = 1.0  # torch.distributed._DEFAULT_FIRST_BUCKET_BYTES


class UnsupportedGradientError(RuntimeError):
    """A gradient the reducer cannot reduce (sparse, or on another device than planned)."""


class GradientReducer:
    def __init__(
        self,
        named_params: Sequence[tuple[str, torch.nn.Parameter]],
        group: dist.ProcessGroup | None = None,
        bucket_cap_mb: float = 25.0,
        first_bucket_cap_mb: float = DEFAULT_FIRST_BUCKET_MB,
    ) -> None:
        self.group = group if group is not None else dist.group.WORLD
        self.world_size = dist.get_world_size(self.group)
        self.names = [n for n, _ in named_params]
        self.params = [p for _, p in named_params]
        devices = sorted({str(p.device) for p in self.params}, key=str)
        self._device_code = {d: i for i, d in enumerate(devices)}
        specs = [
            C.ParamSpec(
                p.numel(), p.element_size(), _dtype_code(p.dtype),
                self._device_code[str(p.device)], p.requires_grad,
            )
            for p in self.params
        ]
        cap = max(1, int(bucket_cap_mb * 2**20))
        first = max(1, int(min(first_bucket_cap_mb, bucket_cap_mb) * 2**20))
        self.plan = C.plan_buckets(specs, cap, first)

        self.buffers: list[torch.Tensor] = []
        self.bucket_params: list[list[int]] = []
        for b in self.plan.buckets:
            p0 = self.params[b.params[0]]
            self.buffers.append(torch.zeros(b.numel, dtype=p0.dtype, device=p0.device))
            self.bucket_params.append(list(b.params))
        self.views: list[torch.Tensor | None] = [None] * len(self.params)
        self.bucket_of: list[int] = list(self.plan.bucket_of_param)
        for i, p in enumerate(self.params):
            b = self.bucket_of[i]
            if b >= 0:
                self.views[i] = _bucket_view(self.buffers[b], p, self.plan.offset_of_param[i])

        self.enabled = True
        self.on_finalize = None  # called after each completed reduction round
        self.rounds = 0  # completed backward passes
        self._reset_round()
        self._handles = [
            p.register_post_accumulate_grad_hook(functools.partial(self._on_grad_ready, i))
            for i, p in enumerate(self.params)
            if p.requires_grad
        ]
        self.unused_warned: set[str] = set()

    # ---------------------------------------------------------------- state
    def _reset_round(self) -> None:
        self._ready = [0] * len(self.buffers)
        self._got_grad = [False] * len(self.params)
        self._next_bucket = 0
        self._works: list = []
        self._finalize_queued = False

    def remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def describe(self) -> str:
        sizes = [b.bytes for b in self.plan.buckets]
        if not sizes:
            return "no parameters require grad"
        return (
            f"{len(sizes)} buckets, {sum(sizes) / 2**20:.1f} MiB in all "
            f"(largest {max(sizes) / 2**20:.1f} MiB)"
        )

    # ---------------------------------------------------------------- hooks
    def _on_grad_ready(self, index: int, param: torch.Tensor) -> None:
        if not self.enabled:
            return
        if not self._finalize_queued:
            Variable._execution_engine.queue_callback(self._finalize)
            self._finalize_queued = True
        grad = param.grad
        if grad is None:
            return
        if grad.is_sparse:
            raise UnsupportedGradientError(
                f"parameter '{self.names[index]}' produced a sparse gradient; pygraph_dist "
                "reduces dense gradients only (use nn.Embedding(sparse=False))."
            )
        view = self.views[index]
        if grad.data_ptr() == view.data_ptr() and grad.stride() == view.stride():
            view.mul_(1.0 / self.world_size)  # AccumulateGrad accumulated into the view
        else:
            torch.mul(grad, 1.0 / self.world_size, out=view)
        self._got_grad[index] = True
        b = self.bucket_of[index]
        self._ready[b] += 1
        if self._ready[b] == len(self.bucket_params[b]):
            self._launch_in_order()

    def _launch_in_order(self) -> None:
        while (
            self._next_bucket < len(self.buffers)
            and self._ready[self._next_bucket] == len(self.bucket_params[self._next_bucket])
        ):
            self._launch(self._next_bucket)

    def _launch(self, b: int) -> None:
        self._works.append(dist.all_reduce(self.buffers[b], group=self.group, async_op=True))
        self._next_bucket = b + 1

    def _finalize(self) -> None:
        """End of backward: reduce what is left, wait, expose the reduced grads."""
        try:
            for b in range(self._next_bucket, len(self.buffers)):
                if self._ready[b] < len(self.bucket_params[b]):
                    self._clear_missing(b)
                self._launch(b)
            for work in self._works:
                work.wait()  # on the stream backward was called from
            for i, view in enumerate(self.views):
                if view is not None and self.params[i].grad is not view:
                    self.params[i].grad = view
        finally:
            self.rounds += 1
            self._reset_round()
        if self.on_finalize is not None:
            self.on_finalize()

    def _clear_missing(self, b: int) -> None:
        for i in self.bucket_params[b]:
            if not self._got_grad[i]:
                self.views[i].zero_()
                name = self.names[i]
                if name not in self.unused_warned:
                    self.unused_warned.add(name)
                    logger.warning(
                        "parameter '%s' received no gradient in this backward pass; it "
                        "contributes zeros to its all-reduce (reported once per parameter)",
                        name,
                    )

    def finish_pending(self) -> None:
        """Run the end-of-backward step now if autograd never got to it (error paths)."""
        if self._finalize_queued:
            self._finalize()

    def abandon(self) -> None:
        """Forget a half-done reduction (e.g. after a failed capture): nothing was launched for real."""
        self._reset_round()


def _dtype_code(dtype: torch.dtype) -> int:
    # Any stable integer per dtype will do: the planner only compares codes.
    return _DTYPE_CODES.setdefault(dtype, len(_DTYPE_CODES))


_DTYPE_CODES: dict[torch.dtype, int] = {}


def _bucket_view(buffer: torch.Tensor, p: torch.Tensor, offset: int) -> torch.Tensor:
    """A view of ``buffer`` shaped like ``p``, with ``p``'s strides when it is dense
    (channels_last weights keep their layout, as DDP's bucket views do)."""
    n = p.numel()
    if p.is_contiguous() or not _dense_non_overlapping(p):
        return buffer[offset : offset + n].view(p.shape)
    return buffer.as_strided(p.shape, p.stride(), offset)


def _dense_non_overlapping(t: torch.Tensor) -> bool:
    if t.numel() == 0:
        return True
    span = 1 + sum((s - 1) * st for s, st in zip(t.shape, t.stride()) if s > 0)
    return span == t.numel() and all(st >= 0 for st in t.stride())
