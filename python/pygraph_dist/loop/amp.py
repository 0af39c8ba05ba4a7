"""Mixed precision that survives capture: autocast without the weight cache,
and fp16 loss scaling whose scale lives on the device.

Why the cache is off: with ``cache_enabled=True`` autocast keeps casted
weights between ops; ``make_graphed_callables`` refuses it because the cache
conflicts with separately captured regions (pytorch#71631, PR #84289). The
cast is recomputed instead; the result is bitwise the same.

Why the scale is applied in backward: ``GradScaler.scale(loss)`` multiplies
the loss, so the user would have to call ``scaler.scale(loss).backward()``
instead of ``loss.backward()``. :class:`ScaleGrad` returns the loss unchanged
and multiplies the incoming gradient by the scale tensor in backward — the
same multiplication MulBackward does — so the user's ``loss.backward()`` is
unchanged, the returned loss is the real (unscaled) value, and the scale is
read from device memory at run time, so replays use the current scale.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from ..runtime.spans import timed

_ALIASES = {
    None: None,
    "none": None,
    "fp32": None,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
}


@timed("signature")
def autocast_state(kind: str) -> tuple:
    """State outside a call's arguments that a graph bakes in: the caller's
    autocast on device type ``kind`` (part of every graph's key)."""
    return (torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind))


def dtype_name(dtype: torch.dtype) -> str:
    """The short name report() uses for an autocast dtype: "bf16", "fp16", or torch's name."""
    return {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, str(dtype).replace("torch.", ""))


@dataclass(frozen=True)
class AmpConfig:
    dtype: torch.dtype | None
    device_type: str

    @property
    def enabled(self) -> bool:
        return self.dtype is not None

    @property
    def needs_grad_scaler(self) -> bool:
        return self.dtype is torch.float16

    @property
    def name(self) -> str:
        return {None: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[self.dtype]

    def autocast(self) -> contextlib.AbstractContextManager:
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.dtype, cache_enabled=False)


def parse_amp(amp: str | torch.dtype | None, device_type: str) -> AmpConfig:
    """``amp=`` of :func:`pygraph_dist.wrap`: None, "bf16" or "fp16" (or the dtypes)."""
    key = amp.lower() if isinstance(amp, str) else amp
    if key in (torch.bfloat16, torch.float16):
        return AmpConfig(key, device_type)
    if key not in _ALIASES:
        raise ValueError(
            f"amp={amp!r} is not supported: use None (fp32), 'bf16' or 'fp16'."
        )
    return AmpConfig(_ALIASES[key], device_type)


class ScaleGrad(torch.autograd.Function):
    """Identity in forward; multiplies the gradient by ``scale`` in backward."""

    @staticmethod
    def forward(ctx, loss: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        # Not save_for_backward: GradScaler.update() changes the scale in place,
        # which would trip autograd's version check; we want the current value.
        ctx.scale = scale
        return loss.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.scale, None


def make_grad_scaler(device_type: str) -> torch.amp.GradScaler:
    return torch.amp.GradScaler(device_type)


def ensure_scale_initialised(scaler: torch.amp.GradScaler, device: torch.device) -> torch.Tensor:
    """GradScaler creates its scale tensor lazily in scale(); do it now, outside capture."""
    if scaler._scale is None:  # noqa: SLF001 - GradScaler has no public hook for this
        scaler._lazy_init_scale_growth_tracker(device)  # noqa: SLF001
    return scaler._scale  # noqa: SLF001
