"""The bucket collectives that are more than one all-reduce: compressed and sparse.

:class:`reducer.GradientReducer` all-reduces a plain dense bucket itself
(an all-reduce of its flat buffer, async, collectives.py). Two kinds of bucket need more,
and what they need is here:

* **compressed** (``grad_comm_dtype=torch.bfloat16``): the hook already wrote
  ``grad * (1/world_size)`` straight into the bucket's bf16 send buffer (the
  product is rounded once, as DDP's ``bf16_compress_hook`` rounds its cast;
  one pass over the gradient instead of two). After the all-reduce the bf16
  sum is cast back into the fp32 bucket: by :class:`CastBack` on the waiting
  stream, or -- on CUDA, overlapped with the rest of backward -- on the
  reducer's side stream, which the waiting stream joins through :class:`Join`
  at the end of backward, so only the last bucket's cast-back is left there.
  Both casts are vectorised Triton kernels on CUDA (``kernels.py``): torch's
  mixed-dtype elementwise ops are unrolled kernels that made the bf16 path
  slower than fp32.
* **sparse** (the weight of ``nn.Embedding``/``nn.EmbeddingBag(sparse=True)``,
  in a bucket of its own): :func:`reduce_sparse` all-gathers every rank's
  indices and values -- sizes first, because the number of entries may differ
  per rank -- scaled by 1/world_size and coalesced. NCCL cannot all-reduce
  sparse tensors, and the sizes exchange is a host sync, so this runs
  eagerly, after every graph bucket (``GradientReducer.reduce_eager``).

Each ``wait()`` here, like a c10d work's, makes the *calling* stream wait.

At world size 1 there is nothing to scale, and a dense gradient is only
copied into its bucket: :class:`BucketCopies` copies a bucket's small
gradients together once the bucket is complete (a ``torch.cat`` per span of
adjacent slots), instead of one kernel per parameter tensor.
"""

from __future__ import annotations

import logging
import os

import torch
import torch.distributed as dist

from ..launch import collectives
from ..loop.monitor import storage_ptr  # not untyped_storage(): no Python object for a bucket's storage
from ..runtime import kernels

logger = logging.getLogger("pygraph_dist")


class CastBack:
    """A compressed bucket's all-reduce: ``wait()`` waits, then writes the
    reduced values back into the full-precision bucket (on the waiting stream)."""

    __slots__ = ("work", "comm", "buffer")

    def __init__(self, work, comm: torch.Tensor, buffer: torch.Tensor) -> None:
        self.work, self.comm, self.buffer = work, comm, buffer

    def wait(self):
        self.work.wait()
        kernels.widen_into(self.comm, self.buffer)
        return True


class Done:
    """The all-reduce of a bucket at world size 1, which issues nothing: the
    bucket already holds the sum over the one rank."""

    __slots__ = ()

    def wait(self):
        return True


DONE = Done()


class Join:
    """An overlapped cast-back: ``wait()`` makes the waiting stream wait for this
    bucket's cast-back on the side stream (an event recorded right after it)."""

    __slots__ = ("event", "device")

    def __init__(self, event: torch.cuda.Event, device: torch.device) -> None:
        self.event, self.device = event, device

    def wait(self):
        torch.cuda.current_stream(self.device).wait_event(self.event)
        return True


class BucketCopies:
    """World size 1: the small gradients waiting to be copied into their buckets.

    A copy kernel per parameter tensor costs ~1.4 us of GPU time inside a graph
    on an H100 (0.7 ms per step at 502 tensors, where the hand-written recipe,
    which keeps autograd's gradient as ``.grad``, launches none). Only
    gradients of at most :data:`SMALL` elements wait: a larger one is copied
    at once, as before (batched too, GPT-2's step was 0.6% slower on an H100:
    its copy outlasts a launch, and -- a guess, not profiled -- copied at once
    it may still be in L2). Once the bucket is complete, the waiting
    gradients whose slots follow each other, :data:`CAT_MIN` elements or more
    together, are copied by one ``torch.cat`` into that span of the bucket;
    the others by one ``torch._foreach_copy_``. (The foreach copy gives each
    64K-element chunk a single thread block: 18 gradients of a small MLP took
    21 us of GPU time on an H100, against ~28 us for the whole fused AdamW
    step. A span of a few small gradients between large ones -- a layer's
    biases and LayerNorm -- is better left to it: a cat per such span made
    bench_scaling's 32-layer MLP 2% slower.) The same values are
    copied, so training is bitwise unchanged. A waiting gradient lives until
    its bucket is complete and is ``.grad`` until then: a hook registered
    after ``wrap()`` sees it, not the view. All of a bucket's waiting
    gradients are copied on the stream current when it completes (backward on
    one stream). ``PYGRAPH_DIST_BUCKET_CAT=0``: the foreach copy only (A/B)."""

    SMALL = 1 << 18  # elements (1 MiB of fp32): ~0.7 us of copy at ~3 TB/s, about one launch
    CAT_MIN = 1 << 16  # elements of a span worth a cat of its own: one foreach chunk

    __slots__ = ("pending", "plans", "use_cat")

    def __init__(self, buckets: int) -> None:
        self.pending: list[list] = [[] for _ in range(buckets)]
        # Per bucket: the copy plan of each set of waiting views, by their ids
        # in arrival order (the views live as long as the reducer).
        self.plans: list[dict] = [{} for _ in range(buckets)]
        self.use_cat = os.environ.get("PYGRAPH_DIST_BUCKET_CAT", "1") != "0"

    def defer(self, b: int, param: torch.Tensor, view: torch.Tensor, grad: torch.Tensor) -> bool:
        """Copy ``grad`` into ``view`` now, or (small) with its bucket: whether it waits."""
        if grad.numel() > self.SMALL:
            view.copy_(grad)
            return False
        self.pending[b].append((param, view, grad))
        return True

    def flush(self, b: int) -> None:
        """Copy bucket ``b``'s waiting gradients; each ``.grad`` becomes its view,
        so the fresh gradients are freed."""
        pending = self.pending[b]
        if not pending:
            return
        views = [v for _, v, _ in pending]
        grads = [g for _, _, g in pending]
        # cat(out=) takes contiguous gradients that do not require grad (they
        # do under backward(create_graph=True)); the foreach copy takes any: a
        # non-contiguous one (a channels_last weight's) goes to it alone.
        if (len(pending) > 1 and self.use_cat
                and not (torch.is_grad_enabled() and any(g.requires_grad for g in grads))):
            strided = tuple(k for k, g in enumerate(grads) if not g.is_contiguous())
            key = (tuple(map(id, views)), strided)
            plan = self.plans[b].get(key)
            if plan is None:
                if len(self.plans[b]) >= 16:  # arrival orders that keep changing: keep the cache small
                    self.plans[b].clear()
                plan = self.plans[b][key] = copy_plan(views, self.CAT_MIN, exclude=strided)
            runs, rest = plan
        else:
            runs, rest = (), range(len(pending))
        for out, members in runs:
            torch.cat([grads[k].view(-1) for k in members], out=out)
        if len(rest) == 1:
            views[rest[0]].copy_(grads[rest[0]])
        elif rest:
            torch._foreach_copy_([views[k] for k in rest], [grads[k] for k in rest])
        for param, view, _ in pending:
            param.grad = view
        pending.clear()

    def forget_plans(self) -> None:
        for plans in self.plans:
            plans.clear()

    def flush_all(self) -> None:
        for b in range(len(self.pending)):
            self.flush(b)

    def clear(self) -> None:
        for pending in self.pending:
            pending.clear()


def copy_plan(views: list[torch.Tensor], min_numel: int = 0, exclude: tuple[int, ...] = ()) -> tuple[list, list]:
    """How to copy into ``views`` (slots of a bucket, in arrival order; or any
    gradients, clip_route.clip_in_spans):
    ``runs``, each ``(span, positions)`` -- a flat view of the bucket over
    contiguous slots of one storage that follow each other with no gap, two or more, at
    least ``min_numel`` elements together, and the positions of their views
    in slot order -- and ``rest``, the positions left to the foreach copy (a
    slot alone, in a shorter span, not contiguous, or in ``exclude``: its
    gradient is not)."""
    ptrs = [storage_ptr(v) for v in views]
    # A tensor without a data pointer (storage_ptr -1) has no storage to join on.
    fits = [v.is_contiguous() and k not in exclude and ptrs[k] > 0 for k, v in enumerate(views)]
    order = sorted((k for k, ok in enumerate(fits) if ok), key=lambda k: (ptrs[k], views[k].storage_offset()))
    runs: list = []
    rest = [k for k, ok in enumerate(fits) if not ok]
    group: list[int] = []

    def close() -> None:
        total = sum(views[k].numel() for k in group)
        if len(group) >= 2 and total >= min_numel:
            first = views[group[0]]
            runs.append((first.as_strided((total,), (1,), first.storage_offset()), list(group)))
        else:
            rest.extend(group)
        group.clear()

    for k in order:
        if group:
            last = views[group[-1]]
            if (views[k].storage_offset() != last.storage_offset() + last.numel()
                    or ptrs[k] != ptrs[group[-1]]):
                close()
        group.append(k)
    close()
    return runs, sorted(rest)


def reduce_sparse(p: torch.Tensor, grad: torch.Tensor | None, world_size: int, group) -> torch.Tensor:
    """The mean over ranks of parameter ``p``'s sparse gradient ``grad`` (None:
    unused on this rank), coalesced; every rank takes part."""
    if grad is None:  # unused on this rank: contributes nothing, still takes part
        indices = torch.zeros(1, 0, dtype=torch.int64, device=p.device)
        values = torch.zeros(0, *p.shape[1:], dtype=p.dtype, device=p.device)
    else:
        indices, values = grad._indices(), grad._values()
    values = values * (1.0 / world_size)  # as dense gradients: scale, then sum
    if world_size > 1:
        indices, values = _all_gather_varying(indices, values, group)
    return torch.sparse_coo_tensor(indices, values, p.shape).coalesce()


def _all_gather_varying(indices: torch.Tensor, values: torch.Tensor, group) -> tuple[torch.Tensor, torch.Tensor]:
    """Every rank's (indices, values), concatenated in rank order; ranks may hold
    different numbers of entries, so the counts go first and the rest is padded."""
    world = dist.get_world_size(group)
    n = torch.tensor([indices.shape[1]], dtype=torch.int64, device=indices.device)
    counts_t = [torch.zeros_like(n) for _ in range(world)]
    collectives.all_gather(counts_t, n, group=group)
    counts = torch.cat(counts_t).tolist()
    most = max(counts)
    pad = most - indices.shape[1]
    if pad:
        indices = torch.cat([indices, indices.new_zeros(indices.shape[0], pad)], dim=1)
        values = torch.cat([values, values.new_zeros(pad, *values.shape[1:])], dim=0)
    all_i = [torch.empty_like(indices) for _ in range(world)]
    all_v = [torch.empty_like(values) for _ in range(world)]
    collectives.all_gather(all_i, indices.contiguous(), group=group)
    collectives.all_gather(all_v, values.contiguous(), group=group)
    return (torch.cat([t[:, :c] for t, c in zip(all_i, counts)], dim=1),
            torch.cat([t[:c] for t, c in zip(all_v, counts)], dim=0))


def warn_unused(names: list[str], rank: int) -> None:
    """One message for the parameters first seen without a gradient in a
    backward: a warning on rank 0, info elsewhere (ranks usually agree)."""
    shown = ", ".join(names[:6]) + (f" and {len(names) - 6} more" if len(names) > 6 else "")
    logger.log(logging.WARNING if rank == 0 else logging.INFO,
               "parameter(s) %s received no gradient in a backward pass; they contribute "
               "zeros to the all-reduce, as with DDP(find_unused_parameters=True), and are stepped "
               "with that zero gradient (weight decay and momentum still move them), where DDP "
               "leaves a parameter that no rank used out of the step. Freeze parameters you do "
               "not train with requires_grad_(False): they are left out (reported once)", shown)
