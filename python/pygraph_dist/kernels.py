"""The two casts of the bf16 gradient all-reduce, as single vectorised passes.

``grad * (1/world_size)`` into the bf16 send buffer, and the reduced bf16
buffer back into the fp32 bucket. In torch both are mixed-dtype elementwise
ops, which run as *unrolled* (not vectorised) kernels with a dynamic cast per
element: on an H200 they took longer than the fp32 multiply they replace
(MLP-32: 307 us for the scale-and-cast against 194 us for the fp32 multiply,
GPT-2: the bf16 -> fp32 copies 391 us per iteration), so the bf16 all-reduce
was slower than the fp32 one (benchmarks/results/h200x2-issue14-scaling).

On CUDA, with Triton importable (it ships with torch's CUDA wheels), the casts
are two small Triton kernels over the flat memory: an fp32 multiply then
round-to-nearest-even to bf16 (bitwise what ``torch.mul(g, s, out=bf16)``
computes), and the exact widening back. Elsewhere, or for layouts they do not
cover, the torch ops. ``PYGRAPH_DIST_TRITON=0`` forces the torch ops.
"""

from __future__ import annotations

import functools
import os

import torch

_BLOCK = 4096


@functools.lru_cache(maxsize=1)
def _kernels():
    """(scale_to_narrow, widen) Triton kernels, or None without Triton."""
    if os.environ.get("PYGRAPH_DIST_TRITON", "1") == "0":
        return None
    try:
        import triton
        import triton.language as tl
    except Exception:  # noqa: BLE001 - no Triton (CPU wheels), or a broken install: the torch ops
        return None

    @triton.jit
    def scale_to_narrow(src, dst, n, scale, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        x = tl.load(src + offs, mask=mask)
        tl.store(dst + offs, (x * scale).to(dst.dtype.element_ty, fp_downcast_rounding="rtne"), mask=mask)

    @triton.jit
    def widen(src, dst, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        x = tl.load(src + offs, mask=mask)
        tl.store(dst + offs, x.to(dst.dtype.element_ty), mask=mask)

    return scale_to_narrow, widen


def _flat_pair(src: torch.Tensor, dst: torch.Tensor) -> bool:
    """Both tensors cover one dense span of memory in the same element order."""
    if src.shape != dst.shape or src.stride() != dst.stride() or src.device != dst.device:
        return False
    if src.is_contiguous():
        return dst.is_contiguous()
    span = 1 + sum((s - 1) * st for s, st in zip(src.shape, src.stride()) if s > 0)
    return span == src.numel() and all(st > 0 for st in src.stride())


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.as_strided((t.numel(),), (1,), t.storage_offset())


def _launch(which: int, src: torch.Tensor, dst: torch.Tensor, *scalars) -> bool:
    """Run kernel ``which`` over the 16-element-aligned bulk of the flat pair
    (one Triton specialisation: 16-byte aligned pointers, n divisible by 16,
    compiled by warm_up() before any capture); the tail of up to 15 elements
    is left to the caller. False when the kernels do not apply."""
    k = _kernels()
    if (k is None or not src.is_cuda or src.numel() < 16 or src.data_ptr() % 16 or dst.data_ptr() % 16
            or not _flat_pair(src, dst)):
        return False
    n = src.numel() // 16 * 16
    k[which][((n + _BLOCK - 1) // _BLOCK,)](src, dst, n, *scalars, BLOCK=_BLOCK)
    return True


def scale_into(src: torch.Tensor, dst: torch.Tensor, scale: float) -> None:
    """``dst = src * scale``, rounded once to ``dst``'s (narrower) dtype."""
    if not _launch(0, src, dst, scale):
        torch.mul(src, scale, out=dst)
        return
    n, tail = src.numel(), src.numel() % 16
    if tail:
        torch.mul(_flat(src)[n - tail:], scale, out=_flat(dst)[n - tail:])


def widen_into(src: torch.Tensor, dst: torch.Tensor) -> None:
    """``dst.copy_(src)`` for a narrower ``src`` (exact)."""
    if not _launch(1, src, dst):
        dst.copy_(src)
        return
    n, tail = src.numel(), src.numel() % 16
    if tail:
        _flat(dst)[n - tail:].copy_(_flat(src)[n - tail:])


def warm_up(device: torch.device, narrow: torch.dtype, wide: torch.dtype = torch.float32) -> str:
    """Compile the kernels for this dtype pair now, outside any capture (a
    capture cannot load a module). Returns what the casts run as."""
    if device.type != "cuda" or _kernels() is None:
        return "torch"
    a = torch.ones(_BLOCK, dtype=wide, device=device)
    b = torch.empty(_BLOCK, dtype=narrow, device=device)
    scale_into(a, b, 0.5)
    widen_into(b, a)
    return "triton"
