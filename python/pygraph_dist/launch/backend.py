"""Registering the graph-safe c10d backends and finding them again.

``pgd_nccl`` wraps ProcessGroupNCCL for CUDA tensors and ``pgd_gloo`` wraps
ProcessGroupGloo for CPU tensors; both are ``pygraph_dist._C.GraphSafeBackend``
(csrc/graph_safe_backend.h). The inner backends are built exactly as
``torch.distributed.distributed_c10d._new_process_group_helper`` builds the
stock ones, so the wrapper changes nothing but what it adds.
"""

from __future__ import annotations

import threading
import weakref

import torch
import torch.distributed as dist

from ..runtime import patches
from ..runtime._ext import C

NCCL_NAME = "pgd_nccl"
GLOO_NAME = "pgd_gloo"

_lock = threading.Lock()
# Every wrapper created in this process, by group name and device type. Weak:
# a destroyed group must not be kept alive by this registry.
_created: dict[tuple[str, str], weakref.ReferenceType] = {}


def _remember(group_name: str, device: str, backend) -> None:
    with _lock:
        _created[(group_name, device)] = weakref.ref(backend)


def _create_nccl(opts, backend_options):
    from torch.distributed import ProcessGroupNCCL

    if backend_options is None:
        backend_options = ProcessGroupNCCL.Options()
        backend_options.is_high_priority_stream = False
    patches.set_options_timeout(backend_options, opts.timeout)
    backend_options.global_ranks_in_group = opts.global_ranks_in_group
    backend_options.group_name = opts.group_id
    inner = ProcessGroupNCCL(opts.store, opts.group_rank, opts.group_size, backend_options)
    patches.set_sequence_number(inner)
    wrapped = C.GraphSafeBackend(inner, "cuda")
    _remember(opts.group_id, "cuda", wrapped)
    return wrapped


def _create_gloo(opts, backend_options):
    from torch.distributed import ProcessGroupGloo

    inner = ProcessGroupGloo(opts.store, opts.group_rank, opts.group_size, timeout=opts.timeout)
    inner.options.global_ranks_in_group = opts.global_ranks_in_group
    inner.options.group_name = opts.group_id
    patches.set_sequence_number(inner)
    wrapped = C.GraphSafeBackend(inner, "cpu")
    _remember(opts.group_id, "cpu", wrapped)
    return wrapped


def register() -> None:
    """Register ``pgd_nccl`` and ``pgd_gloo`` with torch.distributed (idempotent)."""
    names = {n.lower() for n in dist.Backend.backend_list}
    if NCCL_NAME not in names and dist.is_nccl_available():
        dist.Backend.register_backend(NCCL_NAME, _create_nccl, extended_api=True, devices=["cuda"])
    if GLOO_NAME not in names and dist.is_gloo_available():
        dist.Backend.register_backend(GLOO_NAME, _create_gloo, extended_api=True, devices=["cpu"])


def resolve(backend: str, *, cuda: bool) -> str:
    """The backend string for ``init_process_group`` that ``init(backend=...)`` means."""
    register()
    if backend == "auto":
        return f"cpu:gloo,cuda:{NCCL_NAME}" if cuda else GLOO_NAME
    return backend


def graph_safe_backend(group=None, device: str | torch.device = "cuda"):
    """The GraphSafeBackend serving ``device`` tensors in ``group``, or None.

    None means the group was created with a stock backend (``init(backend="nccl")``
    or a plain ``init_process_group``): the engine then captures through it
    without fingerprints, and says so in its report.
    """
    group = group if group is not None else dist.group.WORLD
    dev = torch.device(device)
    try:
        backend = patches.group_backend(group, dev)
    except (RuntimeError, ValueError):
        return None
    if isinstance(backend, C.GraphSafeBackend):
        return backend
    return None
