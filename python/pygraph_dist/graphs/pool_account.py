"""What a graph's private memory pool holds, phase by phase (issue 47, item 2).

A capture allocates everything the iteration allocates in the graph's private
pool, and the pool keeps all of it for the graph's life: what forward keeps for
backward (saved activations, the outputs, autocast's low-precision copies of
the weights), the gradients backward leaves (at world size 1 the graph's own
``.grad``, grad_adoption.py), and the temporaries at the iteration's peak.
Eager training allocates the same, but gives it back to the caching allocator
between iterations; a graph cannot. ``report(verbose=True)`` prints the split
under each signature, so a pool bigger than the buckets says what it is.

The figures are ``torch.cuda.memory_allocated`` at the end of each phase of the
capture, counted from its start; the rest of the pool (its reserved growth) is
the temporaries at the peak, workspaces and segment rounding.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

logger = logging.getLogger("pygraph_dist")


def _mib(n: int) -> str:
    return f"{max(n, 0) / 2**20:.0f} MiB"


class PoolAccount:
    """Allocated bytes at the end of forward, backward and the step of one capture."""

    def __init__(self, device: torch.device, held_grads: Callable[[], int] | None = None) -> None:
        self.device = device
        self.base = torch.cuda.memory_allocated(device)
        self.held_grads = held_grads  # bytes of the gradients the graph's own memory holds
        self.marks: dict[str, int] = {}
        self.grad_bytes = 0

    def mark(self, phase: str) -> None:
        """Inside a capture: an accounting error must never fail it (the report
        then lacks the line), so any is logged and dropped."""
        try:
            self.marks[phase] = torch.cuda.memory_allocated(self.device) - self.base
            if phase == "backward" and self.held_grads is not None:
                self.grad_bytes = self.held_grads()
        except Exception:  # noqa: BLE001 - informational only
            logger.debug("pool accounting failed at %s", phase, exc_info=True)
            self.marks.clear()

    def describe(self, pool_bytes: int) -> str:
        """One line: the pool and what it holds ("" when nothing was measured)."""
        if "forward" not in self.marks or pool_bytes <= 0:
            return ""
        parts = [f"{_mib(self.marks['forward'])} kept by forward for backward (saved activations, outputs, "
                 "autocast's weight copies)"]
        if "backward" in self.marks:
            grads = f", {_mib(self.grad_bytes)} of it the gradients (.grad is the graph's own)" \
                if self.grad_bytes else ""
            parts.append(f"{_mib(self.marks['backward'])} left after backward{grads}")
        if "step" in self.marks:
            parts.append(f"{_mib(self.marks['step'])} after the step")
        parts.append(f"{_mib(pool_bytes - max(self.marks.values()))} temporaries at the peak, workspaces "
                     "and segment rounding")
        return f"pool {_mib(pool_bytes)}: " + "; ".join(parts)


def held_grad_bytes(params: list, views: list) -> int:
    """Bytes of the ``.grad`` tensors that are not bucket views (autograd's own, in the pool)."""
    return sum(p.grad.numel() * p.grad.element_size() for p, v in zip(params, views)
               if p.grad is not None and not p.grad.is_sparse  # sparse: all-gathered, not the pool's
               and (v is None or p.grad.data_ptr() != v.data_ptr()))
