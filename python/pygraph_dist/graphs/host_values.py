"""The values side of host_copies.py: what a host copy sends (bitwise
comparisons, the pinned staging buffer), which line of the model made a copy or
a read (``call_site``), and the recipes that make a device tensor a constant
(``_Constants``: digests through the aten ops, forgotten on in-place writes).

Torch only: no engine state. Used by host_session.py (one observed, substituted
or verified region) and host_copies.py (the records and the engine's hooks).
"""

from __future__ import annotations

import hashlib
import os
import sys
from dataclasses import dataclass

import torch
from torch.utils.weak import WeakIdKeyDictionary

_PKG_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the package, not graphs/
# The host watch's own modules: never the line that made a copy.
_WATCH_FILES = {os.path.join(_PKG_DIR, "graphs", f)
                for f in ("host_copies.py", "host_values.py", "host_session.py")}
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__))
_STDLIB_WRAPPERS = {"contextlib.py", "functools.py"}

# Digests of CPU tensors read as op arguments: bounded, so that hashing stays cheap.
_CPU_DIGEST_MAX = 1 << 22


# ================================================================ tensor helpers
def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def meta_of(t: torch.Tensor) -> tuple:
    return (t.dtype, tuple(t.shape), tuple(t.stride()))


def same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape, strides and bytes (bitwise: NaN equals NaN, -0.0 is not 0.0)."""
    return meta_of(a) == meta_of(b) and torch.equal(_bytes(a), _bytes(b))


def same_value(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and same_tensor(a, b)
    if isinstance(a, float) and isinstance(b, float):
        return a.hex() == b.hex()
    return type(a) is type(b) and a == b


def difference(meta0: tuple, target0: tuple, values0: torch.Tensor,
               meta1: tuple, target1: tuple, values1: torch.Tensor) -> str:
    """How two copies of one line differ, or "" when they do not."""
    if meta0[:2] != meta1[:2]:
        return (f"{str(meta0[0]).replace('torch.', '')}{list(meta0[1])} then "
                f"{str(meta1[0]).replace('torch.', '')}{list(meta1[1])}")
    if meta0 != meta1 or target0 != target1:
        return "its layout or target changed"
    a, b = _bytes(values0), _bytes(values1)
    if torch.equal(a, b):
        return ""
    size = max(1, values0.element_size())
    n = int((a.view(-1, size) != b.view(-1, size)).any(dim=1).sum()) if a.numel() else 0
    return f"{n} of {values0.numel()} values differ"


def staging_buffer(values: torch.Tensor, target: tuple, *, pin: bool) -> torch.Tensor:
    """The host values as the copy sends them, in pinned memory: converted to the
    target dtype on the host where torch's blocking copy converts them there (a
    ``non_blocking=True`` copy converts on the device, and so does the graph's
    copy of this buffer), broadcast to the destination's shape for ``copy_``."""
    kind, dtype, non_blocking = target[0], target[1], target[-1]
    src = values.to(dtype) if values.dtype != dtype and not non_blocking else values
    layout = {}
    if kind == "copy_":
        src = src.expand(target[2]).contiguous()
    elif target[4] not in (None, torch.preserve_format):
        # The layout the copy's output gets: copied as one block, no host temporary.
        layout = {"memory_format": target[4]}
    buf = torch.empty_like(src, pin_memory=pin, **layout)
    buf.copy_(src)
    if pin and buf.numel() and not buf.is_pinned():  # never seen; pin_memory() keeps a dense layout
        buf = buf.pin_memory()
    return buf


def _digest(text: str) -> str:
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


def value_digest(t: torch.Tensor) -> str | None:
    """A digest of a host tensor's metadata and bytes (None when too large)."""
    if t.numel() > _CPU_DIGEST_MAX:
        return None
    h = hashlib.blake2b(digest_size=16)
    h.update(repr(meta_of(t)).encode())
    raw = _bytes(t)
    try:
        h.update(raw.numpy().tobytes())
    except (RuntimeError, TypeError):  # no numpy
        h.update(bytes(raw.tolist()))
    return h.hexdigest()


def _storage_ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


# ================================================================ where a call comes from
def _skipped(filename: str) -> bool:
    path = os.path.abspath(filename)
    return (path in _WATCH_FILES or path.startswith(_TORCH_DIR + os.sep) or filename.startswith("<frozen")
            or os.path.basename(path) in _STDLIB_WRAPPERS and "site-packages" not in path)


# pygraph_dist's frames that only pass a call through: the handlers of its own
# torch-function and dispatch modes (the loop monitor, the generator guard, the
# widening casts: active around the same forward) and spans.timed's wrapper.
_PASS_THROUGH = ("__torch_function__", "__torch_dispatch__")
_SPANS_FILE = os.path.join(_PKG_DIR, "runtime", "spans.py")


def _passes_through(code) -> bool:
    path = os.path.abspath(code.co_filename)
    return path.startswith(_PKG_DIR + os.sep) and (code.co_name in _PASS_THROUGH or path == _SPANS_FILE)


def call_site(depth: int = 1) -> tuple[str, str] | None:
    """``(key, text)`` of the line that made this copy or read: the innermost frame
    outside torch, this module and pygraph_dist's own mode handlers. None when
    that frame is pygraph_dist's own (moving the call's CPU inputs, for
    example): not the model's."""
    frame = sys._getframe(depth)
    while frame is not None and (_skipped(frame.f_code.co_filename) or _passes_through(frame.f_code)):
        frame = frame.f_back
    if frame is None:
        return "<unknown>", "<unknown>"
    filename = os.path.abspath(frame.f_code.co_filename)
    if filename.startswith(_PKG_DIR + os.sep):
        return None
    key = f"{filename}:{frame.f_lineno}"
    return key, _site_text(frame)


def _site_text(frame) -> str:
    # The reasons' own naming: a framework's line, then the user's (imported here: this
    # module stays torch-only at import).
    from ..loop.monitor import frames_of, locate

    site = locate(frames_of(frame))
    return str(site) if site is not None else (
        f"{os.path.relpath(os.path.abspath(frame.f_code.co_filename))}:{frame.f_lineno}")


# ================================================================ constant recipes
class _Unknown(Exception):
    pass


# aten ops whose outputs are not a function of their arguments' values.
_NOT_VALUES = frozenset((
    "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "empty_permuted",
    "resize_", "resize_as_", "set_", "_local_scalar_dense", "item", "equal", "_pin_memory", "pin_memory",
    "record_stream",
))
# Ops that read only the metadata of their first tensor argument.
_META_SELF = frozenset(("zeros_like", "ones_like", "full_like", "new_zeros", "new_ones", "new_full",
                        "fill_", "zero_", "copy_"))


@dataclass(frozen=True)
class _OpInfo:
    name: str
    pure: bool  # the outputs are a function of the arguments' values
    mutated: tuple  # positions (int) or keyword names (str) of the arguments it writes
    meta_args: frozenset  # positions / names whose values it does not read


_INFO: dict = {}


def _op_info(func) -> _OpInfo:
    info = _INFO.get(func)
    if info is not None:
        return info
    schema = func._schema
    base = func._opname if hasattr(func, "_opname") else schema.name.split("::")[-1]
    mutated, meta = [], set()
    for i, arg in enumerate(schema.arguments):
        ref = arg.name if arg.kwarg_only else i
        if arg.alias_info is not None and arg.alias_info.is_write:
            mutated.append(ref)
            if arg.name == "out" or arg.kwarg_only:
                meta.add(ref)
        if i == 0 and base in _META_SELF:
            meta.add(ref)
    tags = getattr(func, "tags", ())
    pure = (func.namespace == "aten" and base not in _NOT_VALUES
            and torch.Tag.nondeterministic_seeded not in tags)
    info = _INFO[func] = _OpInfo(func.name(), pure, tuple(mutated), frozenset(meta))
    return info


class _Constants:
    """Device tensors of one observed iteration whose values follow from
    constants, each with the digest of its recipe."""

    def __init__(self, device_type: str) -> None:
        self.device_type = device_type
        self.known = WeakIdKeyDictionary()  # tensor -> (recipe, storage data_ptr)
        self.broken = False

    def key(self, t: torch.Tensor) -> str | None:
        """The recipe digest of ``t``; a host tensor's is its value digest."""
        if type(t) is not torch.Tensor or t.layout is not torch.strided:
            return None
        kind = t.device.type
        if kind != self.device_type:
            digest = value_digest(t) if kind == "cpu" else None
            return None if digest is None else f"host:{digest}"
        got = self.known.get(t)
        if got is None or self.broken:
            return None
        return got[0] if _storage_ptr(t) == got[1] else None

    def _norm(self, x, meta: bool = False) -> str:
        if isinstance(x, torch.Tensor):
            if meta:
                return f"meta{meta_of(x)}{x.device}"
            k = self.key(x)
            if k is None:
                raise _Unknown
            return k
        if x is None or isinstance(x, (bool, int, str)):
            return repr(x)
        if isinstance(x, float):
            return x.hex()
        if isinstance(x, complex):
            return f"{x.real.hex()}+{x.imag.hex()}j"
        if isinstance(x, (list, tuple)):
            return "(" + ",".join(self._norm(v) for v in x) + ")"
        if isinstance(x, (torch.dtype, torch.device, torch.layout, torch.memory_format)):
            return str(x)
        raise _Unknown

    def recipe(self, func, args, kwargs, *, read: bool = False) -> str | None:
        """The digest of ``func`` applied to these arguments, before it runs; None
        when an argument is not a constant (or the op's result is not a function
        of its arguments). ``read``: a host read, whose result is the value read."""
        if self.broken:
            return None
        info = _op_info(func)
        if not info.pure and not read:
            return None
        if not self._on_device(args, kwargs):
            return None  # a host op: its values are digested where a device op reads them
        try:
            parts = [info.name]
            parts += [self._norm(a, i in info.meta_args) for i, a in enumerate(args)]
            parts += [f"{k}={self._norm(v, k in info.meta_args)}" for k, v in sorted(kwargs.items())]
        except _Unknown:
            return None
        except Exception:  # noqa: BLE001 - tracking must never break the model
            self.broken = True
            return None
        return _digest("|".join(parts))

    def _on_device(self, args, kwargs) -> bool:
        kind = self.device_type
        device = kwargs.get("device")
        if device is not None and torch.device(device).type == kind:
            return True
        for a in args:
            if isinstance(a, torch.Tensor):
                if a.device.type == kind:
                    return True
            elif isinstance(a, (list, tuple)):
                if any(isinstance(b, torch.Tensor) and b.device.type == kind for b in a):
                    return True
        return any(isinstance(v, torch.Tensor) and v.device.type == kind for v in kwargs.values())

    def after(self, func, args, kwargs, out, recipe: str | None) -> None:
        """Give ``out`` (and every argument the op wrote) the recipe, or forget them."""
        try:
            info = _op_info(func)
            for ref in info.mutated:
                t = kwargs.get(ref) if isinstance(ref, str) else (args[ref] if ref < len(args) else None)
                for i, m in enumerate(t if isinstance(t, (list, tuple)) else (t,)):
                    if isinstance(m, torch.Tensor):
                        self.forget_storage(m)
                        self._set(m, None if recipe is None else f"{recipe}/w{ref}.{i}")
            outs = out if isinstance(out, (list, tuple)) else (out,)
            for i, o in enumerate(outs):
                if isinstance(o, torch.Tensor):
                    self._set(o, None if recipe is None else f"{recipe}/{i}")
        except Exception:  # noqa: BLE001 - conservative from here on
            self.broken = True

    def _set(self, t: torch.Tensor, recipe: str | None) -> None:
        if recipe is None or type(t) is not torch.Tensor or t.device.type != self.device_type:
            if t in self.known:
                del self.known[t]
            return
        self.known[t] = (_digest(recipe), _storage_ptr(t))

    def forget_storage(self, t: torch.Tensor) -> None:
        """``t``'s storage is written: no tensor on it keeps its recipe."""
        ptr = _storage_ptr(t)
        for other in [o for o, (_, p) in self.known.items() if p == ptr]:
            del self.known[other]

    def forget_all(self) -> None:
        self.known = WeakIdKeyDictionary()
