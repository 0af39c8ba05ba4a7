"""pygraph_dist's own collectives: safe at interpreter exit over any process group.

Every collective pygraph_dist issues (bucket all-reduces, buffer and
parameter broadcasts, the capture agreement, sparse gradients) goes through
here. Each builds its options as ``torch.distributed``'s function of the same
name does and calls the process group's own method, so the same collective
runs on the same backend; what differs is that it is issued through
``pygraph_dist._C`` (csrc/python_free.h) with torch's thread-local Python
objects hidden and, on CPU, with Python-free aliases of the tensors. A Gloo
Work released by a Gloo worker thread while the interpreter finalizes then
never takes the GIL (the abort "terminate called without an active
exception" after a script finished, issue 25).

pygraph_dist's own backend (``pgd_gloo``, ``pgd_nccl``, from
``pygraph_dist.init()``) does the same for every collective, the user's
included. This covers the user's own ``init_process_group("gloo")``: torch's
stock backend, reached here only by pygraph_dist's own collectives. As in
DDP's C++ reducer, they do not go through ``__torch_function__``: a
TorchFunctionMode (pygraph_dist's loop monitor, a user's) does not see them.
"""

from __future__ import annotations

import pickle
from typing import Any

import torch
import torch.distributed as dist

from ..runtime import patches
from ..runtime._ext import C

AllgatherOptions, AllreduceOptions, BroadcastOptions = patches.c10d_option_classes()


def _group(group):
    return group if group is not None else dist.group.WORLD


def _real(t: torch.Tensor) -> torch.Tensor:
    # As torch.distributed: complex tensors travel as their real view.
    return torch.view_as_real(t) if t.is_complex() else t


def _finish(work, async_op: bool):
    if async_op:
        return work
    if work is not None:
        work.wait()
    return None


def all_reduce(tensor: torch.Tensor, *, op=dist.ReduceOp.SUM, group=None, async_op: bool = False):
    """``dist.all_reduce(tensor, op, group, async_op)``; the Work when ``async_op``."""
    opts = AllreduceOptions()
    opts.reduceOp = op
    opts.asyncOp = async_op
    return _finish(C.python_free_allreduce(_group(group), [_real(tensor)], opts), async_op)


def broadcast(tensor: torch.Tensor, *, group_src: int = 0, group=None, async_op: bool = False):
    """``dist.broadcast(tensor, group=group, group_src=group_src, async_op=async_op)``:
    ``group_src`` is the source's rank in ``group``."""
    opts = BroadcastOptions()
    opts.rootRank = group_src
    opts.rootTensor = 0
    opts.asyncOp = async_op
    return _finish(C.python_free_broadcast(_group(group), [_real(tensor)], opts), async_op)


def all_gather(tensor_list: list[torch.Tensor], tensor: torch.Tensor, *, group=None,
               async_op: bool = False):
    """``dist.all_gather(tensor_list, tensor, group, async_op)``."""
    opts = AllgatherOptions()
    opts.asyncOp = async_op
    work = C.python_free_allgather(_group(group), [[_real(t) for t in tensor_list]], [_real(tensor)], opts)
    return _finish(work, async_op)


def all_gather_object(obj: Any, *, group=None, device: torch.device) -> list[Any]:
    """Every rank's ``obj``, in rank order, as ``dist.all_gather_object`` gives
    them: pickled, sizes gathered first, then the padded bytes, on ``device``
    (one the group's backend serves)."""
    group = _group(group)
    world = dist.get_world_size(group)
    data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(device)
    size = torch.tensor([data.numel()], dtype=torch.int64, device=device)
    sizes = [torch.zeros_like(size) for _ in range(world)]
    all_gather(sizes, size, group=group)
    counts = [int(s.item()) for s in sizes]
    padded = torch.zeros(max(counts), dtype=torch.uint8, device=device)
    padded[: data.numel()] = data
    outs = [torch.empty_like(padded) for _ in range(world)]
    all_gather(outs, padded, group=group)
    return [pickle.loads(bytes(o[:n].tolist())) for o, n in zip(outs, counts)]
