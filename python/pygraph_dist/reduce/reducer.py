"""Bucketed gradient all-reduce driven by autograd hooks — our own, not DDP's.

DDP's reducer is what breaks whole-iteration capture (runtime-stats syncs on
iterations 1-10, ``find_unused_parameters`` D2H copies, AccumulateGrad nodes
pinned to the construction stream; reference notes §1.2, §1.4). This one is
plain autograd hooks and c10d calls, so a capture records exactly its kernels:

* parameters are planned into buckets, each dense bucket one flat buffer
  and each parameter a view of it (``bucket_layout.py``);
* each parameter's post-accumulate-grad hook writes ``grad / world_size`` into
  its slot of the bucket's flat buffer (DDP multiplies by 1/world_size while
  copying, ``Reducer::mark_variable_ready_dense``; same arithmetic; NCCL's
  ``ReduceOp.AVG`` rounds 1/world_size to bf16 in bf16 buckets). At world size
  1 it copies, or a tier-1 capture keeps the gradient (``grad_adoption.py``);
* a full bucket is all-reduced asynchronously, strictly in bucket order, so
  every rank issues the same collectives in the same order whatever order its
  gradients arrive in (DDP's ``next_bucket_`` rule); NCCL runs it on its own
  stream, overlapped with the rest of backward. At world size 1 nothing is
  issued: the bucket is its own sum, and an empty collective still forks the
  graph (``PYGRAPH_DIST_SOLO_ALLREDUCE=1`` issues it, for A/B);
* once its gradient is in the bucket, each ``param.grad`` becomes a view
  into its bucket (DDP's ``gradient_as_bucket_view``): no copy back, every
  graph of the model shares the same gradient memory, and autograd's fresh
  gradient is freed then (at world size 1, small ones when their bucket is
  complete: ``bucket_comm.BucketCopies``) instead of living on next to the
  bucket until the end of backward;
* at the end of backward (an autograd final callback, which runs on the
  stream backward was called from) the remaining buckets are launched and
  the caller's stream waits for every all-reduce.

With ``grad_comm_dtype=torch.bfloat16`` the hook writes ``grad / world_size``
into a bf16 buffer, cast back into the fp32 bucket after the all-reduce, on a
side stream while backward goes on (``bucket_comm.py``).

A parameter that produced no gradient in a backward pass contributes zeros to
its bucket (its slot is cleared), and its ``.grad`` is still set to the
reduced value so that every rank applies the same update (DDP would leave the
``.grad`` of a parameter no rank used untouched; knowing that takes a host
sync every iteration, which a graph cannot make). A frozen parameter
(``requires_grad=False`` now, trainable at ``wrap()``) is different: its slot
is cleared and its ``.grad`` left as it is -- None after ``zero_grad()`` -- so
the optimizer skips it, as with DDP; graphs are captured again when a
parameter is frozen or unfrozen (``graph_cache.drift``).

Buckets that leave the graph ("eager buckets") are reduced *after* every
graph bucket, in bucket order, at the end of backward: in eager iterations by
the end-of-backward callback, in segmented graphs between the forward/backward
graph and the step graph (``reduce_eager``). The rule is the same in every
mode, so every rank runs the same collectives in the same order. Two kinds:

* ``sparse``: the weight of ``nn.Embedding``/``nn.EmbeddingBag(sparse=True)``
  (planned alone, like DDP's ``expect_sparse_gradient``). Its gradient's
  indices and values are all-gathered (``bucket_comm.reduce_sparse``): a host
  sync, so this cannot be captured.
* ``eager``: a dense bucket whose all-reduce must not be captured (named in
  ``wrap(..., eager_params=...)``, or one whose collective failed capture).
  Backward still writes its flat buffer; only the all-reduce runs eagerly.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Collection, Sequence

import torch
import torch.distributed as dist
from torch.autograd import Variable

from ..graphs.capture_guard import BucketCaptureError
from ..launch import collectives
from ..runtime import kernels
from ..runtime._ext import C
from ..runtime.spans import timed
from .bucket_comm import DONE, BucketCopies, CastBack, Join, reduce_sparse, warn_unused
from .bucket_layout import EAGER, GRAPH, SPARSE, plan_layout
from .grad_adoption import GradAdoption

logger = logging.getLogger("pygraph_dist")

DEFAULT_FIRST_BUCKET_MB = 1.0  # torch.distributed._DEFAULT_FIRST_BUCKET_BYTES


class UnsupportedGradientError(RuntimeError):
    """A gradient the reducer cannot reduce (sparse where a dense one was planned, or the reverse)."""


class OutsideGradientError(RuntimeError):
    """The user's backward reached parameters outside a graphed model call (tier 2, split.py)."""


class GradientReducer:
    def __init__(
        self,
        named_params: Sequence[tuple[str, torch.nn.Parameter]],
        group: dist.ProcessGroup | None = None,
        bucket_cap_mb: float = 25.0,
        first_bucket_cap_mb: float = DEFAULT_FIRST_BUCKET_MB,
        *,
        sparse: Collection[str] = (),
        eager: Collection[str] = (),
        comm_dtype: torch.dtype | None = None,
    ) -> None:
        """``sparse``: names of parameters whose gradients are sparse; ``eager``:
        names of dense parameters reduced outside the graph. Both get buckets
        of their own. ``comm_dtype``: the dtype floating-point dense buckets
        of wider types are all-reduced in (bf16 compression)."""
        self.group = group if group is not None else dist.group.WORLD
        self.world_size = dist.get_world_size(self.group)
        self.names = [n for n, _ in named_params]
        self.params = [p for _, p in named_params]
        unknown = (set(sparse) | set(eager)) - set(self.names)
        if unknown:
            raise ValueError(f"no parameter requiring grad is named {sorted(unknown)}; names are "
                             f"those of module.named_parameters(), e.g. {self.names[:3]}")
        self.is_sparse = [n in sparse for n in self.names]
        self.sparse_params = [p for p, s in zip(self.params, self.is_sparse) if s]
        layout = plan_layout(self.names, self.params, self.is_sparse, eager=eager,
                             bucket_cap_mb=bucket_cap_mb, first_bucket_cap_mb=first_bucket_cap_mb,
                             comm_dtype=comm_dtype, world_size=self.world_size)
        self.plan = layout.plan
        self.buffers, self.bucket_params, self.kinds = layout.buffers, layout.bucket_params, layout.kinds
        self.comm_dtype, self.comm = layout.comm_dtype, layout.comm  # comm: bf16 send buffers
        self.views, self.comm_views = layout.views, layout.comm_views  # per parameter
        self.bucket_of = layout.bucket_of
        self.eager_reasons: dict[int, str] = {}
        # World size 1: a bucket's copies batched (bucket_comm.py), or none (grad_adoption.py).
        self._copies = BucketCopies(len(self.buffers)) if self.world_size == 1 else None
        self._solo = self.world_size == 1 and os.environ.get("PYGRAPH_DIST_SOLO_ALLREDUCE", "0") != "1"
        self.on_views_moved = None  # set by the engine: graphs that read the old views go
        # CUDA cast-backs overlap backward on a stream of their own (made here,
        # not during a capture).
        cuda_comm = [c for c in self.comm if c is not None and c.is_cuda]
        self._cast_stream = torch.cuda.Stream(cuda_comm[0].device) if cuda_comm else None
        # The casts as single vectorised passes (kernels.py), compiled now.
        self.cast_backend = kernels.warm_up(cuda_comm[0].device, self.comm_dtype) if cuda_comm else "torch"
        for b, kind in enumerate(self.kinds):
            if kind == SPARSE:
                self.eager_reasons[b] = "sparse gradient (all-gathered; NCCL has no sparse all-reduce)"
            elif self.names[self.bucket_params[b][0]] in eager:
                self.set_eager(b, "named in wrap(..., eager_params=...)")
        self.adoption = GradAdoption(self.world_size, not self.eager_buckets)
        self.enabled = True
        # Set by the engine while capturing a segmented iteration: eager
        # buckets are then left for reduce_eager() between the graphs.
        self.defer_eager = False
        self.on_finalize = None  # called after each completed reduction round
        # Set by the engine around a backward its own step follows (tier 1): the last
        # graph bucket's all-reduce is not waited for here but left as the ``tail`` for the
        # step, which steps the other parameters first (IterationStep.apply_step). A step
        # per bucket was slower (GPT-2, 2xH200 fp32: 11.66 against 11.43-11.53 ms/it).
        self.defer_waits = False
        self.tail: tuple[int, object] | None = None  # (bucket, its work)
        # Set while a tier-2 backward graph owns this backward pass: a gradient
        # reaching a parameter live would bypass the graph's reduction.
        self.outside_grad_error: str | None = None
        self.rounds = 0  # completed backward passes
        self.last_unused: frozenset[str] = frozenset()  # params without a gradient, last round
        self._reset_round()
        self._handles = [p.register_post_accumulate_grad_hook(functools.partial(self._on_grad_ready, i))
                         for i, p in enumerate(self.params) if p.requires_grad]
        self.unused_warned: set[str] = set()
        self._newly_unused: list[str] = []
        # The per-step checks over every parameter (drift, .grad views), a C++ loop each
        # (csrc/param_watch.h; ~0.1 us per parameter in Python). None: an older extension.
        watch = getattr(C, "ParamWatch", None)
        self.watch = watch(self.params, self.views) if watch is not None else None

    # ---------------------------------------------------------------- state
    def _reset_round(self) -> None:
        self._ready = [0] * len(self.buffers)
        self._got_grad = [False] * len(self.params)
        self._next_bucket = 0
        self._works: list = []
        self._finalize_queued = False
        if self._copies is not None:
            self._copies.clear()

    def remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def set_eager(self, b: int, reason: str) -> None:
        """Take dense bucket ``b``'s all-reduce out of the graph (from the next capture on)."""
        if self.kinds[b] == GRAPH:
            self.kinds[b] = EAGER
            self.eager_reasons[b] = reason

    @property
    def eager_buckets(self) -> tuple[int, ...]:
        return tuple(b for b, k in enumerate(self.kinds) if k != GRAPH)

    def describe(self) -> str:
        sizes = [b.bytes for b in self.plan.buckets]
        if not sizes:
            return "no parameters require grad"
        eager = self.eager_buckets
        tail = f"; {len(eager)} reduced outside the graph" if eager else ""
        if any(c is not None for c in self.comm):
            tail += (f"; all-reduced in {str(self.comm_dtype).replace('torch.', '')}"
                     f"{' (casts: Triton kernels)' if self.cast_backend == 'triton' else ''}")
        tail += self.adoption.describe()
        return (
            f"{len(sizes)} buckets, {sum(sizes) / 2**20:.1f} MiB in all "
            f"(largest {max(sizes) / 2**20:.1f} MiB){tail}"
        )

    def describe_eager(self) -> list[str]:
        """One line per bucket that leaves the graph: what it holds and why."""
        out = []
        for b in self.eager_buckets:
            names = [self.names[i] for i in self.bucket_params[b]]
            shown = ", ".join(names[:3]) + (f" +{len(names) - 3}" if len(names) > 3 else "")
            out.append(f"bucket {b} ({shown}; {self.plan.buckets[b].bytes / 2**20:.2f} MiB dense "
                       f"size) {self.kinds[b]}: {self.eager_reasons.get(b, '')}")
        return out

    # ---------------------------------------------------------------- hooks
    def _on_grad_ready(self, index: int, param: torch.Tensor) -> None:
        if not self.enabled:
            return
        if self.outside_grad_error is not None:
            raise OutsideGradientError(self.outside_grad_error)
        if not self._finalize_queued:
            Variable._execution_engine.queue_callback(self._finalize)
            self._finalize_queued = True
        grad = param.grad
        if grad is None:
            return
        if grad.is_sparse != self.is_sparse[index]:
            raise UnsupportedGradientError(
                f"parameter '{self.names[index]}' produced a {'sparse' if grad.is_sparse else 'dense'} "
                "gradient where a " + ("sparse" if self.is_sparse[index] else "dense") + " one was "
                "planned. pygraph_dist plans sparse gradients for the weights of nn.Embedding and "
                "nn.EmbeddingBag with sparse=True; other sources of sparse gradients are not supported."
            )
        deferred = False
        if not grad.is_sparse and self.comm_views[index] is not None:
            # Compressed bucket: the scaled gradient goes straight to the bf16
            # buffer, rounded once (fp32 product, then bf16), as before when it
            # went through the fp32 bucket first. world_size > 1 here.
            kernels.scale_into(grad, self.comm_views[index], 1.0 / self.world_size)
        elif not grad.is_sparse:
            view = self.views[index]
            divide = self.world_size > 1  # at world size 1 there is nothing to divide
            if grad.data_ptr() == view.data_ptr() and grad.stride() == view.stride():
                if divide:
                    view.mul_(1.0 / self.world_size)  # AccumulateGrad accumulated into the view
            elif divide:
                torch.mul(grad, 1.0 / self.world_size, out=view)
            else:  # world size 1: kept by an adopting capture, or copied (a small one with its bucket)
                deferred = (self.adoption.take(index, grad)
                            or self._copies.defer(self.bucket_of[index], param, view, grad))
        if not grad.is_sparse and grad is not self.views[index] and not deferred:
            # The gradient now lives in its bucket: .grad becomes the view at
            # once (at world size 1, when its bucket is copied), so autograd's
            # fresh gradient is freed and its memory serves the rest of
            # backward; left until the end of backward, every gradient was live
            # twice (issue 26). torch's optimizer-in-backward recipe also sets
            # .grad in this hook (torch/csrc/autograd/functions/accumulate_grad.cpp).
            param.grad = self.views[index]
        self._got_grad[index] = True
        b = self.bucket_of[index]
        self._ready[b] += 1
        if self._ready[b] == len(self.bucket_params[b]):
            if self._copies is not None:
                self._copies.flush(b)
            self._launch_in_order()

    def _launch_in_order(self) -> None:
        ready, params = self._ready, self.bucket_params
        while self._next_bucket < len(self.buffers) and ready[self._next_bucket] == len(params[self._next_bucket]):
            self._launch(self._next_bucket)

    def _launch(self, b: int) -> None:
        """Graph buckets: all-reduce now (async). Eager buckets wait for the end of backward."""
        self._next_bucket = b + 1
        if self.kinds[b] != GRAPH:
            return
        try:
            self._works.append((b, self._all_reduce(b)))
        except Exception as exc:
            if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                raise BucketCaptureError(b, exc) from exc
            raise

    def _all_reduce(self, b: int, *, overlap: bool = True):
        if self._solo:  # one rank: the bucket is already the sum (the module docstring)
            return DONE
        comm = self.comm[b]
        if comm is None:
            return collectives.all_reduce(self.buffers[b], group=self.group, async_op=True)
        # The hooks already wrote grad / world_size into the bf16 buffer.
        work = collectives.all_reduce(comm, group=self.group, async_op=True)
        if not (overlap and comm.is_cuda):
            return CastBack(work, comm, self.buffers[b])
        # On a side stream: wait for this bucket's all-reduce and cast it back
        # while backward computes the next buckets' gradients. The stream
        # backward runs on joins it at the end of backward (a fork and join
        # that a capture records like any other).
        # Fork from the caller first: while capturing, that is what puts the
        # side stream into the capture, and a captured all-reduce may only be
        # waited for from a capturing stream (graph_safe_backend.cpp).
        self._cast_stream.wait_stream(torch.cuda.current_stream(comm.device))
        with torch.cuda.stream(self._cast_stream):
            work.wait()  # this stream waits for NCCL's
            kernels.widen_into(comm, self.buffers[b])
            done = torch.cuda.Event()
            done.record(self._cast_stream)  # this bucket's cast-back, not the ones after it
        return Join(done, comm.device)

    def _finalize(self) -> None:
        """End of backward: reduce what is left, wait, expose the reduced grads."""
        try:
            if self._copies is not None:
                self._copies.flush_all()
            for b in range(len(self.buffers)):
                if self._ready[b] < len(self.bucket_params[b]):
                    self._clear_missing(b)
            for b in range(self._next_bucket, len(self.buffers)):
                self._launch(b)
            works = self._works
            if self.defer_waits and works and self.tail is None:
                self.tail, works = works[-1], works[:-1]
            for _, work in works:
                work.wait()  # on the stream backward was called from
            if not self.adoption.end_of_backward(self.params, self.views):
                self.expose_grads()
            self.last_unused = frozenset(
                self.names[i] for i, got in enumerate(self._got_grad) if not got and self.params[i].requires_grad
            )
            if not self.defer_eager:
                self.reduce_eager(self.eager_buckets)
            self._warn_unused()
        finally:
            self.rounds += 1
            self._reset_round()
        if self.on_finalize is not None:
            self.on_finalize()

    @timed("grad views")
    def expose_grads(self) -> None:
        """Every trainable parameter's ``.grad`` becomes its bucket view. A frozen
        parameter's is left as it is, as DDP leaves it: None after zero_grad(),
        so the optimizer skips it."""
        if self.watch is not None:
            self.watch.expose_grads()
            return
        for p, view in zip(self.params, self.views):
            if view is not None and p.requires_grad and p.grad is not view:
                p.grad = view

    def all_grads_none(self) -> bool:
        """Whether no parameter has a ``.grad`` (after ``zero_grad(set_to_none=True)``)."""
        if self.watch is not None:
            return self.watch.all_grads_none()
        return all(p.grad is None for p in self.params)

    def param_state(self) -> bytes | tuple:
        """Every parameter's data pointer and requires_grad, in a form that
        compares with ``==`` (graph_cache.drift: taken at capture, compared
        before every replay); :func:`graph_cache.decode_param_state` reads it."""
        if self.watch is not None:
            return self.watch.state()
        return [p.data_ptr() for p in self.params], [p.requires_grad for p in self.params]

    def reduce_eager(self, buckets: Sequence[int], sparse_grads: dict[int, torch.Tensor] | None = None) -> None:
        """All-reduce eager buckets now, in order, on the current stream.

        ``sparse_grads`` (param index -> local sparse gradient) stands in for
        ``param.grad``: after a graph replay the local gradient lives in the
        tensor the capture produced, not in ``.grad``."""
        for b in buckets:
            if self.kinds[b] == SPARSE:
                i = self.bucket_params[b][0]
                grad = sparse_grads[i] if sparse_grads is not None else self.params[i].grad
                self.params[i].grad = reduce_sparse(self.params[i], grad, self.world_size, self.group)
            else:
                self._all_reduce(b, overlap=False).wait()

    def _warn_unused(self) -> None:
        if self._newly_unused:
            names, self._newly_unused = self._newly_unused, []
            warn_unused(names, dist.get_rank(self.group))

    def _clear_missing(self, b: int) -> None:
        for i in self.bucket_params[b]:
            if not self._got_grad[i]:
                if self.comm_views[i] is not None:
                    self.comm_views[i].zero_()
                elif self.views[i] is not None:
                    self.views[i].zero_()
                elif self.params[i].grad is not None:
                    self.params[i].grad = None  # a stale sparse gradient from an earlier step
                name = self.names[i]
                if name not in self.unused_warned and self.params[i].requires_grad:
                    self.unused_warned.add(name)
                    self._newly_unused.append(name)

    def reduce_now(self) -> None:
        """Reduce the gradients accumulated locally (deferred micro-batches) now,
        eagerly, in bucket order: what the end of a synchronised backward that
        added nothing does — the same scaling and all-reduces, ``.grad`` the
        bucket views afterwards."""
        enabled, self.enabled = self.enabled, True
        self._finalize_queued = True  # outside autograd: _finalize runs below, not as a callback
        try:
            for i, p in enumerate(self.params):
                if p.requires_grad and p.grad is not None:
                    self._on_grad_ready(i, p)
            self._finalize()
        finally:
            self.enabled = enabled

    def finish_pending(self) -> None:
        """Run the end-of-backward step now if autograd never got to it (error paths)."""
        if self._finalize_queued:
            self._finalize()

    def abandon(self) -> None:
        """Forget a half-done reduction (e.g. after a failed capture): nothing was launched for real."""
        self._reset_round()
        self.tail = None
        self.adoption.drop()

    def commit_adoption(self) -> None:
        """An accepted capture's gradients become the views, ``.grad`` the views (grad_adoption.py)."""
        # Solo: no all-reduce was recorded on the flat buffers, nothing reads them once the views moved.
        if self.adoption.commit(self.views, (self.buffers, self.bucket_params) if self._solo else None):
            self._views_moved()
            self.expose_grads()

    def restore_views(self) -> None:
        """No graph of the model is live: adopted views go back to the buckets."""
        if self.adoption.restore(self.views):
            self._views_moved()

    def _views_moved(self) -> None:
        self._copies.forget_plans()  # spans of where the views were
        if self.on_views_moved is not None:  # graphs that read them there go (tier 2's clip)
            self.on_views_moved()

    def zero_views(self) -> None:  # the buffers, or the views once they moved
        torch._foreach_zero_([t for t in (self.views if self.adoption.moved else self.buffers) if t is not None])

    def take_tail(self) -> tuple[list[int], object] | None:
        """The all-reduce the end of backward left running: (parameter indices
        of its bucket, its work), handed out once."""
        if self.tail is None:
            return None
        (b, work), self.tail = self.tail, None
        return self.bucket_params[b], work

    def wait_tail(self) -> None:
        """Wait for a left-running all-reduce now (whoever steps without splitting)."""
        tail = self.take_tail()
        if tail is not None:
            tail[1].wait()

