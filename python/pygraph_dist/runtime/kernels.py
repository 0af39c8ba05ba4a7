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

The same widening serves :class:`WideningCasts`: while an iteration is
captured, every ``bf16/fp16 -> fp32`` copy of a dense CUDA tensor (above all
autocast's weight-gradient casts, ``ToCopyBackward``, one per weight per
backward) runs as the widen kernel instead of torch's unrolled copy. Widening
is exact, so the values are those torch computes, bit for bit.
"""

from __future__ import annotations

import functools
import os

import torch
from torch.utils._python_dispatch import TorchDispatchMode

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


def _widen_kernel(src: torch.Tensor, dst: torch.Tensor) -> bool:
    """``dst.copy_(src)`` through the widen kernel (and torch for the tail);
    False, with nothing written, where the kernel does not apply."""
    if not _launch(1, src, dst):
        return False
    n, tail = src.numel(), src.numel() % 16
    if tail:
        _flat(dst)[n - tail:].copy_(_flat(src)[n - tail:])
    return True


def widen_into(src: torch.Tensor, dst: torch.Tensor) -> None:
    """``dst.copy_(src)`` for a narrower ``src`` (exact)."""
    if not _widen_kernel(src, dst):
        dst.copy_(src)


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


_TO_COPY = torch.ops.aten._to_copy.default
_NARROW = (torch.bfloat16, torch.float16)
_PLAIN_FORMATS = (None, torch.preserve_format, torch.contiguous_format)


def _widened(x, kwargs: dict) -> torch.Tensor | None:
    """``x.to(torch.float32)`` through the widen kernel, or None where torch's
    own copy must run (another dtype, layout, device or memory format, a
    tensor subclass, a non-contiguous or tiny tensor, no Triton)."""
    if (type(x) is not torch.Tensor or x.dtype not in _NARROW or not x.is_cuda
            or kwargs.get("dtype") is not torch.float32 or x.numel() < 16 or not x.is_contiguous()):
        return None
    if (kwargs.get("layout", torch.strided) is not torch.strided or kwargs.get("pin_memory")
            or kwargs.get("memory_format") not in _PLAIN_FORMATS
            or kwargs.get("device", x.device) != x.device
            or set(kwargs) - {"dtype", "layout", "device", "pin_memory", "non_blocking", "memory_format"}):
        return None
    out = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    return out if _widen_kernel(x, out) else None


class WideningCasts(TorchDispatchMode):
    """Active around a capture: ``aten._to_copy`` from bf16/fp16 to fp32 runs
    as the widen kernel (see the module docstring); every other op, and every
    copy the kernel does not cover, runs as torch runs it. Not for compiled
    modules (the engine does not enter it for them)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _TO_COPY and len(args) == 1:
            out = _widened(args[0], kwargs)
            if out is not None:
                return out
        return func(*args, **kwargs)


def widening_ready(device: torch.device) -> bool:
    """Compile the widen kernel for bf16 and fp16 sources now (outside any
    capture); False where it cannot run (no Triton, not CUDA)."""
    if device.type != "cuda" or _kernels() is None:
        return False
    wide = torch.empty(_BLOCK, dtype=torch.float32, device=device)
    for narrow in _NARROW:
        widen_into(torch.ones(_BLOCK, dtype=narrow, device=device), wide)
    return True
