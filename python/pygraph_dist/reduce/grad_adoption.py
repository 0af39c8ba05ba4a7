"""World size 1: the gradients a tier-1 graph computes become the bucket views.

At world size 1 nothing is all-reduced: the flat buckets are there so that
every graph and eager iteration of the model finds the gradients in one
memory. The hand-written whole-iteration recipe keeps autograd's gradients,
allocated in the graph's pool, as ``.grad``; copying them into the buckets
inside the graph cost 47 us of GPU time per step at 502 parameter tensors on
an H100, 0.75% of the step, and 3 us at 18 (issue 26). So a tier-1 capture at
world size 1 leaves autograd's gradients where they are (no copy recorded)
and, once every rank accepted the capture, re-points each bucket view at its
gradient with ``Tensor.set_``. Every holder of a view -- ``.grad``, the C++
``ParamWatch``, the reducer -- then sees the graph's memory. From then on each
view is the gradient the graph writes on every replay; eager iterations and
later captures copy into the views as before, by the foreach copy (the views
no longer sit side by side in one buffer). Training is bitwise the same: the
same values, not copied. A flat buffer all of whose views moved is then
freed (its storage resized to nothing; about 0.5 GB at GPT-2 small) and
grown again, zeroed, when the views go back; where the graph recorded the
world-size-1 all-reduce on the buffers (``PYGRAPH_DIST_SOLO_ALLREDUCE=1``:
NCCL was handed their address) they stay.

A capture adopts only where nothing else could read the views it moves: no
other live graph of the model (the cache's entries; tier 2's clip graph is
dropped when they move), every trainable parameter got a gradient in the
captured backward (otherwise the adopted gradients are copied into their
views inside the capture, as before), dense graph buckets only. When the
model's last live graph is released (invalidated, evicted, or dropped by the
selection), the views go back to their bucket slots, values copied
(:meth:`GradAdoption.restore`): left in the released graph's pool, they would
keep its segments reserved, and the next capture would take a second pool
next to them.
``PYGRAPH_DIST_ADOPT_GRADS=0`` keeps the copies (an A/B for benchmarks)."""

from __future__ import annotations

import os

import torch


class GradAdoption:
    __slots__ = ("enabled", "pending", "moved", "slots", "freed")

    def __init__(self, world_size: int, dense_graph_buckets_only: bool) -> None:
        self.enabled = (world_size == 1 and dense_graph_buckets_only
                        and os.environ.get("PYGRAPH_DIST_ADOPT_GRADS", "1") != "0")
        # Parameter index -> autograd's gradient, during an adopting capture.
        self.pending: dict[int, torch.Tensor] | None = None
        self.moved = False  # the views are a graph's gradients, not slices of the buffers
        self.slots: dict[int, torch.Tensor] = {}  # index -> the view's bucket slot (an alias)
        self.freed: list[tuple[torch.Tensor, int]] = []  # (flat buffer, its bytes) while freed

    def begin(self) -> None:
        """The capture about to record a backward may keep its gradients."""
        self.pending = {}

    def take(self, index: int, grad: torch.Tensor) -> bool:
        """From the gradient hook: whether ``grad`` stays ``.grad`` (no copy)."""
        if self.pending is None:
            return False
        self.pending[index] = grad
        return True

    def end_of_backward(self, params: list, views: list) -> bool:
        """Whether the captured backward's gradients stay ``.grad`` (every
        trainable parameter got one); otherwise they are copied into their views
        now (recorded in the capture) and the views are ``.grad``, as without
        adoption."""
        pending = self.pending
        if pending is None:
            return False
        trainable = {i for i, p in enumerate(params) if p.requires_grad and views[i] is not None}
        if trainable == pending.keys():
            return True
        for i, grad in pending.items():
            views[i].copy_(grad)
        self.pending = None
        return False

    def commit(self, views: list, free: tuple[list, list] | None = None) -> bool:
        """The capture was accepted: each adopted gradient becomes its view's
        memory; ``free``: (flat buffers, parameter indices per bucket) to free
        where every view left them (:meth:`free_buffers`). Whether any moved."""
        pending, self.pending = self.pending, None
        if not pending:
            return False
        with torch.no_grad():
            for i, grad in pending.items():
                self.slots.setdefault(i, views[i].detach())  # its own TensorImpl: set_ leaves it
                views[i].set_(grad)
        self.moved = True
        if free is not None:
            self.free_buffers(*free)
        return True

    def free_buffers(self, buffers: list, bucket_params: list) -> None:
        """After :meth:`commit`: free each flat buffer none of whose views is in
        it any more (nothing reads it until :meth:`restore`)."""
        full = [buf for buf, idx in zip(buffers, bucket_params)
                if buf is not None and idx and all(i in self.slots for i in idx)]
        if not full:
            return
        if full[0].is_cuda:
            torch.cuda.synchronize()  # an eager iteration's copies into them may still run
        for buf in full:
            storage = buf.untyped_storage()
            self.freed.append((buf, storage.nbytes()))
            storage.resize_(0)  # the slots alias this storage: they grow back with it

    def describe(self) -> str:
        if not self.moved:
            return ""
        freed = sum(n for _, n in self.freed)
        return ("; world size 1: .grad is the graph's own gradients (no copies"
                + (f"; flat buckets freed, {freed / 2**20:.1f} MiB)" if freed else ")"))

    def restore(self, views: list) -> bool:
        """The views back in their bucket slots, with their values (the graph
        that wrote them is gone); freed buffers grown again first, zeroed.
        Whether any moved back."""
        if not self.moved:
            return False
        cuda = any(v.is_cuda for v in self.slots.values())
        if cuda:
            torch.cuda.synchronize()  # the last replay may still be writing them; rare
        with torch.no_grad():
            for buf, nbytes in self.freed:
                buf.untyped_storage().resize_(nbytes)
                buf.zero_()  # the gaps between slots too
            self.freed.clear()
            for i, slot in self.slots.items():
                slot.copy_(views[i])
                views[i].set_(slot)
        if cuda:
            torch.cuda.synchronize()  # before any stream writes the slots again
        self.moved = False
        return True

    def drop(self) -> None:
        """A capture that failed or was not accepted: its gradients are not kept."""
        self.pending = None
