"""Where every gradient lives: the buckets, their flat buffers and the views into them.

Built once, when the reducer is made (``wrap()``), outside any capture; every
graph of the model then reads and writes the same memory, so a graph never
copies gradients in or out:

* the parameters are planned into buckets by the torch-free core
  (``C.plan_buckets``: reverse order, per dtype/device, first bucket small,
  a sparse or ``eager_params`` parameter alone in its bucket);
* a dense bucket owns one flat buffer, and each of its parameters a view of
  it shaped (and, when dense, strided) like the parameter, which becomes its
  ``.grad`` (DDP's ``gradient_as_bucket_view``); a sparse bucket has none.
  Each view starts at a multiple of 16 elements, the padding between them
  zero: one unaligned view (after a 10-class head's bias) made torch's fused
  AdamW and foreach copies take their unvectorised path for every later slot;
* with ``grad_comm_dtype`` a floating-point bucket of a wider type gets a
  persistent send buffer in that dtype, with views of its own, which the
  reducer's hooks write ``grad / world_size`` into (``bucket_comm.py``).

:class:`reducer.GradientReducer` takes these lists as its own attributes and
drives the reduction over them.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch

from ..runtime._ext import C

logger = logging.getLogger("pygraph_dist")

# A bucket's kind: all-reduced inside the graph, outside it (dense), or all-gathered (sparse).
GRAPH, EAGER, SPARSE = "graph", "eager", "sparse"


@dataclass
class BucketLayout:
    """The plan and the tensors :func:`plan_layout` made for it, indexed by
    bucket (``buffers``, ``bucket_params``, ``kinds``, ``comm``) or by
    parameter (``views``, ``comm_views``, ``bucket_of``)."""

    plan: object  # C.BucketPlan
    buffers: list[torch.Tensor | None]  # a dense bucket's flat buffer; None for a sparse one
    bucket_params: list[list[int]]
    kinds: list[str]  # GRAPH or SPARSE here; the reducer turns dense buckets EAGER
    comm_dtype: torch.dtype | None  # None at world size 1 whatever was asked
    comm: list[torch.Tensor | None]  # a compressed bucket's send buffer
    views: list[torch.Tensor | None]  # each parameter's view of its bucket (its .grad)
    comm_views: list[torch.Tensor | None]  # where a compressed bucket's hook writes
    bucket_of: list[int]


def plan_layout(names: Sequence[str], params: Sequence[torch.nn.Parameter], is_sparse: Sequence[bool], *,
                eager: Collection[str], bucket_cap_mb: float, first_bucket_cap_mb: float,
                comm_dtype: torch.dtype | None, world_size: int) -> BucketLayout:
    """Plan the buckets and allocate their buffers (zeros) and views."""
    devices = sorted({str(p.device) for p in params}, key=str)
    device_code = {d: i for i, d in enumerate(devices)}
    specs = [
        C.ParamSpec(
            p.numel(), p.element_size(), _dtype_code(p.dtype),
            device_code[str(p.device)], p.requires_grad,
            isolated=sparse or n in eager,
        )
        for n, p, sparse in zip(names, params, is_sparse)
    ]
    cap = max(1, int(bucket_cap_mb * 2**20))
    first = max(1, int(min(first_bucket_cap_mb, bucket_cap_mb) * 2**20))
    plan = C.plan_buckets(specs, cap, first, _align_elements())

    # Dense buckets own a flat buffer; a sparse bucket has none (its
    # gradient keeps its own indices and values).
    buffers: list[torch.Tensor | None] = []
    bucket_params: list[list[int]] = []
    kinds: list[str] = []
    for b in plan.buckets:
        p0 = params[b.params[0]]
        sparse_bucket = is_sparse[b.params[0]]
        buffers.append(None if sparse_bucket else torch.zeros(b.numel, dtype=p0.dtype, device=p0.device))
        bucket_params.append(list(b.params))
        kinds.append(SPARSE if sparse_bucket else GRAPH)
    # bf16 compression: a persistent buffer per bucket (static for graphs):
    # cast in, all-reduce, cast back into the fp32 bucket after the wait.
    # At world size 1 nothing is sent: no casts, no rounding (as the
    # 1/world_size multiply, skipped there too).
    if comm_dtype is not None and world_size == 1:
        logger.info("grad_comm_dtype=%s has no effect at world size 1: nothing is sent, the "
                    "gradients stay in their own dtype", str(comm_dtype).replace("torch.", ""))
        comm_dtype = None
    comm: list[torch.Tensor | None] = [  # zeros: the padding between slots is all-reduced too
        torch.zeros(buf.numel(), dtype=comm_dtype, device=buf.device)
        if comm_dtype is not None and buf is not None and buf.is_floating_point()
        and buf.element_size() > torch.empty((), dtype=comm_dtype).element_size() else None
        for buf in buffers
    ]
    views: list[torch.Tensor | None] = [None] * len(params)
    # Where a compressed bucket's hook writes grad / world_size (bf16).
    comm_views: list[torch.Tensor | None] = [None] * len(params)
    bucket_of: list[int] = list(plan.bucket_of_param)
    for i, p in enumerate(params):
        b = bucket_of[i]
        if b >= 0 and buffers[b] is not None:
            views[i] = _bucket_view(buffers[b], p, plan.offset_of_param[i])
            if comm[b] is not None:
                comm_views[i] = _bucket_view(comm[b], p, plan.offset_of_param[i])
    return BucketLayout(plan, buffers, bucket_params, kinds, comm_dtype, comm, views, comm_views, bucket_of)


def _align_elements() -> int:
    """Each slot's offset is a multiple of this many elements (the core's
    default, 16: every view 16-byte aligned, csrc/core/bucket_plan.h);
    ``PYGRAPH_DIST_BUCKET_ALIGN=1`` packs slots back to back as DDP does (an
    A/B for benchmarks)."""
    value = os.environ.get("PYGRAPH_DIST_BUCKET_ALIGN", "")
    if not value:
        return C.BUCKET_ALIGN_ELEMENTS
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"PYGRAPH_DIST_BUCKET_ALIGN={value!r}: expected a positive number of elements")
    return int(value)


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
