"""Host tensors made in forward, graphed: pageable host-to-device copies, and
host reads of device values computed from them.

A forward that builds a tensor on the host and copies it to the GPU every
iteration -- ``nn.Transformer.generate_square_subsequent_mask(T).to(device)``,
``torch.tensor(0.5, device="cuda")``, transformers' sliding-window cache
(``torch.tensor(window).to(device)``) -- cannot be captured as written: a copy
from pageable host memory is not a graph node, and torch refuses it while
capturing ("Cannot copy between CPU and CUDA tensors during CUDA graph capture
unless the CPU tensor is pinned"). Such a copy is graphed here when its host
values are the same on every iteration:

* **trigger** -- a capture that failed with that error (every model is captured
  as before until one does, so this module costs nothing elsewhere) switches the
  model's :class:`HostWatch` on: from then on the warm-up iterations of every
  signature (tier 1, tier 2's forward, evaluation forwards) are *observed* and
  their captures *substitute*. Not for ``torch.compile``'d modules (a dispatch
  mode would meet dynamo);
* **observe** (eager warm-up): :class:`_HostMode`, a ``TorchDispatchMode``, sees
  every ``aten._to_copy`` / ``aten.copy_`` from a non-pinned CPU tensor to the
  device, and ``torch.tensor`` / ``torch.as_tensor`` / ``Tensor.new_tensor``
  with a device target (patched while observing: they copy below the Python
  dispatch key otherwise), names each by its line (the innermost frame outside
  torch and pygraph_dist; copies made by pygraph_dist itself, such as moving CPU
  inputs, are not the model's), and records the n-th copy of each line with a
  copy of its host values. After the first observed iteration the values are
  pinned (``pin_memory``, outside any capture), converted to the target dtype;
* **substitute** (capture): the n-th copy at a line is checked against every
  observed iteration (dtype, shape, strides, values bitwise) and performed from
  the pinned buffer with ``non_blocking=True`` -- a copy the graph records and
  replays from that fixed buffer, which the graph entry owns until it is
  released. A line whose values (or number of copies) differed between
  iterations, or differ at capture, refuses the capture with a non-retryable
  reason naming it; the signature then trains eagerly, as written.

The assumption, and the documented limit: a graph replays the copy from the
buffer filled at warm-up, so replays are bitwise equal to eager training as long
as the host values are the same on every iteration. Values that change only
after the warm-ups (a tensor made from the step counter after step 1000) are
not seen; ``PYGRAPH_DIST_CHECK_HOST_COPIES=N`` runs every N-th iteration of such
a signature eagerly, observed, and drops its graphs (on every rank) when the
values moved.

**Host reads of constants.** A copied mask is often read back on the host at
once: ``nn.TransformerEncoder`` asks whether the mask is causal with
``bool((mask == causal).all())``, a host synchronisation that no capture
allows. While observing or substituting, :class:`_Constants` follows every
device tensor computed only from observed host copies, deterministic device
factories (``torch.full/zeros/arange(..., device=...)``) and deterministic
aten ops on those, by a digest of that recipe; in-place writes (by the op
schemas) forget every tensor on the written storage. A host read
(``.item()``, ``bool()``, ``torch.equal``, ``.cpu()``/``.tolist()``) of such a
constant is recorded at warm-up with its recipe and answered at capture from
the record, without a sync: the recipe fixes the value. A read of anything else
(a value computed from inputs or weights) refuses the capture with a reason
naming its line, as a host synchronisation.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import sys
import threading
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakIdKeyDictionary

from ._ext import NOT_CAPTURABLE_TAG

logger = logging.getLogger("pygraph_dist")

CHECK_ENV = "PYGRAPH_DIST_CHECK_HOST_COPIES"
# What torch says when a capture meets a pageable host<->device copy (Copy.cu).
PAGEABLE_COPY_ERROR = "Cannot copy between CPU and CUDA tensors during CUDA graph capture"

_THIS_FILE = os.path.abspath(__file__)
_PKG_DIR = os.path.dirname(_THIS_FILE)
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__))
_STDLIB_WRAPPERS = {"contextlib.py", "functools.py"}

_aten = torch.ops.aten
_TO_COPY = _aten._to_copy.default
_COPY = _aten.copy_.default
_LOCAL_SCALAR = _aten._local_scalar_dense.default
_EQUAL = _aten.equal.default

# Digests of CPU tensors read as op arguments: bounded, so that hashing stays cheap.
_CPU_DIGEST_MAX = 1 << 22


class HostTensorError(RuntimeError):
    """A host tensor made in forward that a graph cannot replay (carries the
    not-capturable tag: the capture fails for good, the signature runs eagerly)."""


def _refuse(text: str) -> HostTensorError:
    return HostTensorError(f"{NOT_CAPTURABLE_TAG}{text}")


_FIX = ("make it on the GPU (torch.arange(..., device=...), torch.full(..., device=...)) or pass it "
        "to the model as an input")


# =================================================================== the model's watch
class HostWatch:
    """One wrapped model's switch (``GraphRunner.host_watch``): off until a
    capture meets a pageable host copy; then every warm-up is observed and every
    capture substitutes. ``device_type``/``pin`` are settable for tests."""

    def __init__(self, *, enabled: bool = False, device_type: str = "cuda", pin: bool = True) -> None:
        self.enabled = enabled  # wiring: CUDA graphs possible, module not compiled
        self.wanted = False
        self.device_type = device_type
        self.pin = pin
        self.check_every = check_every_from_env()
        self._retired: list = []  # (event, buffers) of released graphs, freed once the event passed

    @property
    def on(self) -> bool:
        return self.enabled and self.wanted

    def retire(self, buffers: list) -> None:
        """Keep ``buffers`` (read by a graph just released) until the work queued
        so far on the current stream is done: a replay may still be reading them,
        and freed pinned memory is handed to the next ``pin_memory()``."""
        self._purge()
        if not buffers:
            return
        if self.device_type != "cuda" or not torch.cuda.is_available():
            return
        try:
            event = torch.cuda.Event()
            event.record()
        except RuntimeError:  # CUDA going away (teardown): nothing runs any more
            return
        self._retired.append((event, buffers))

    def _purge(self) -> None:
        self._retired = [(e, b) for e, b in self._retired if e is not None and not e.query()]


def check_every_from_env() -> int:
    text = os.environ.get(CHECK_ENV, "").strip()
    if not text:
        return 0
    try:
        n = int(text)
    except ValueError:
        raise ValueError(f"{CHECK_ENV} must be a whole number of iterations, got {text!r}") from None
    return max(0, n)


# ====================================================================== records
@dataclass
class CopyRecord:
    """The n-th host-to-device copy of one line, as the observed iterations made it."""

    site: str  # file:line as reasons name it
    meta: tuple  # dtype, shape, strides of the host source
    target: tuple  # what the copy produces (dtype, device, ...)
    values: torch.Tensor  # the host values (a copy)
    buffer: torch.Tensor | None = None  # pinned, in the target dtype: what the graph copies from
    varied: str = ""  # how the observed iterations disagreed ("" when they did not)


@dataclass
class ReadRecord:
    """A host read of a constant device value, by its recipe."""

    site: str
    value: Any
    varied: str = ""


@dataclass
class HostRecord:
    """What the observed iterations of one signature copied and read (``GraphEntry.host_copies``)."""

    watch: HostWatch
    iterations: int = 0
    copies: dict = field(default_factory=dict)  # (line key, n) -> CopyRecord
    counts: dict = field(default_factory=dict)  # line key -> copies per iteration
    count_varied: dict = field(default_factory=dict)  # line key -> text
    sites: dict = field(default_factory=dict)  # line key -> site text
    reads: dict = field(default_factory=dict)  # recipe -> ReadRecord
    check_calls: int = 0  # replays counted by check_due()

    @property
    def checking(self) -> bool:
        """Check mode is on for this signature (it has copies to check)."""
        return self.watch.check_every > 0 and bool(self.copies)

    def buffers(self) -> list:
        return [c.buffer for c in self.copies.values() if c.buffer is not None]

    def retire(self) -> None:
        """The entry's graphs are released: its pinned buffers go (once no replay reads them)."""
        self.watch.retire(self.buffers())
        for c in self.copies.values():
            c.buffer = None

    def describe(self) -> str:
        """For the "captured" event: what the graph replays from host buffers."""
        if not self.copies and not self.reads:
            return ""
        parts = []
        if self.copies:
            lines = sorted({self.sites[k] for k, _ in self.copies})
            nbytes = sum(c.buffer.numel() * c.buffer.element_size() for c in self.copies.values()
                         if c.buffer is not None)
            parts.append(f"{len(self.copies)} host-to-device cop{'y' if len(self.copies) == 1 else 'ies'} "
                         f"replayed from pinned buffers ({nbytes} B) at {', '.join(lines[:3])}"
                         + (f" +{len(lines) - 3}" if len(lines) > 3 else ""))
        if self.reads:
            lines = sorted({r.site for r in self.reads.values()})
            parts.append(f"{len(self.reads)} host read{'s' if len(self.reads) > 1 else ''} of constant "
                         f"device values answered at capture ({', '.join(lines[:3])})")
        return "; ".join(parts)

    # ------------------------------------------------------------- merging
    def merge(self, session: "_Session") -> None:
        """Fold one observed iteration in: what differs from the earlier ones is marked varied."""
        first = self.iterations == 0
        for key, count in session.counts.items():
            self.sites.setdefault(key, session.sites[key])
            if first:
                self.counts[key] = count
            elif self.counts.get(key, 0) != count and key not in self.count_varied:
                self.count_varied[key] = (f"copied {self.counts.get(key, 0)} then {count} times in one "
                                          "iteration")
        if not first:
            for key, count in self.counts.items():
                if key not in session.counts and key not in self.count_varied:
                    self.count_varied[key] = f"copied {count} then 0 times in one iteration"
        for k, (meta, target, values) in session.copies.items():
            old = self.copies.get(k)
            if old is None:
                self.copies[k] = CopyRecord(session.sites[k[0]], meta, target, values)
                continue
            if not old.varied:
                old.varied = difference(old.meta, old.target, old.values, meta, target, values)
                if old.varied:
                    old.buffer = None
        for recipe, (site, value) in session.reads.items():
            old = self.reads.get(recipe)
            if old is None:
                self.reads[recipe] = ReadRecord(site, value)
            elif not old.varied and not same_value(old.value, value):
                old.varied = "the value differed between iterations (a non-deterministic op)"
        self.iterations += 1
        for c in self.copies.values():  # outside any capture: warm-ups are eager
            if c.buffer is None and not c.varied:
                c.buffer = staging_buffer(c.values, c.target, pin=self.watch.pin)


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
    return (path == _THIS_FILE or path.startswith(_TORCH_DIR + os.sep) or filename.startswith("<frozen")
            or os.path.basename(path) in _STDLIB_WRAPPERS and "site-packages" not in path)


# pygraph_dist's frames that only pass a call through: the handlers of its own
# torch-function and dispatch modes (the loop monitor, the generator guard, the
# widening casts: active around the same forward) and spans.timed's wrapper.
_PASS_THROUGH = ("__torch_function__", "__torch_dispatch__")
_SPANS_FILE = os.path.join(_PKG_DIR, "spans.py")


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
    try:
        # The reasons' own naming: a framework's line, then the user's.
        from .monitor import frames_of, locate

        site = locate(frames_of(frame))
        if site is not None:
            return str(site)
    except ImportError:
        pass
    return f"{os.path.relpath(os.path.abspath(frame.f_code.co_filename))}:{frame.f_lineno}"


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


# =================================================================== one iteration
OBSERVE, SUBSTITUTE, VERIFY = "observe", "substitute", "verify"


class _Session:
    """One observed, substituted or verified region (an iteration or a capture)."""

    def __init__(self, record: HostRecord, state: str) -> None:
        self.record = record
        self.state = state
        self.device_type = record.watch.device_type
        self.constants = _Constants(self.device_type)
        self.counts: dict = {}  # line key -> copies so far
        self.sites: dict = {}  # line key -> text
        self.copies: dict = {}  # (line key, n) -> (meta, target, values)
        self.reads: dict = {}  # recipe -> (site, value)
        self.changed = ""  # VERIFY: the first difference from the record

    # ------------------------------------------------------------- copies
    def host_copy(self, func, args, kwargs):
        """A pageable host-to-device copy: (handled, result)."""
        if self.device_type == "cpu":  # tests: the CPU plays the device, there is no host
            return False, None
        if func is _TO_COPY:
            src = args[0]
            device = kwargs.get("device")
            if (device is None or torch.device(device).type != self.device_type or not _plain_host(src)):
                return False, None
            target = ("_to_copy", kwargs.get("dtype") or src.dtype, str(device), kwargs.get("layout"),
                      kwargs.get("memory_format"), bool(kwargs.get("non_blocking")))
        else:
            if len(args) < 2:
                return False, None
            dst, src = args[0], args[1]
            if (not isinstance(dst, torch.Tensor) or dst.device.type != self.device_type
                    or not _plain_host(src)):
                return False, None
            non_blocking = args[2] if len(args) > 2 else kwargs.get("non_blocking", False)
            target = ("copy_", dst.dtype, tuple(dst.shape), tuple(dst.stride()), str(dst.device),
                      bool(non_blocking))
        where = call_site()
        if where is None:  # pygraph_dist's own copy (the call's CPU inputs): not the model's
            return False, None
        key, text = where
        n = self.counts.get(key, 0)
        self.counts[key] = n + 1
        self.sites.setdefault(key, text)
        if self.state == OBSERVE:
            self.copies[(key, n)] = (meta_of(src), target, src.detach().clone())
            return False, None
        if self.state == VERIFY:
            self._verify_copy(key, n, text, src, target)
            return False, None
        buf = self._buffer(key, n, text, src, target)
        if src.numel() == 0:  # nothing to copy: no copy at all (torch.tensor([], device=...))
            if func is _COPY:
                return True, args[0]
            fmt = kwargs.get("memory_format")
            dtype, device = kwargs.get("dtype") or src.dtype, kwargs.get("device")
            if fmt in (None, torch.preserve_format):
                return True, torch.empty_strided(src.shape, src.stride(), dtype=dtype, device=device)
            return True, torch.empty(src.shape, dtype=dtype, device=device, memory_format=fmt)
        if func is _TO_COPY:
            return True, func(buf, **{**kwargs, "non_blocking": True})
        return True, func(args[0], buf, non_blocking=True)

    def _buffer(self, key, n, text, src, target) -> torch.Tensor:
        rec = self.record
        varied = rec.count_varied.get(key)
        if varied:
            raise _refuse(f"the number of host tensors copied to the GPU at {text} changed between "
                          f"iterations ({varied}); this signature runs eagerly; {_FIX}")
        c = rec.copies.get((key, n))
        if c is None:
            raise _refuse(f"a host tensor copied to the GPU at {text} was not copied in the warm-up "
                          f"iterations (copy {n + 1} of this line); this signature runs eagerly; {_FIX}")
        why = c.varied or difference(c.meta, c.target, c.values, meta_of(src), target, src)
        if why:
            raise _refuse(f"a host tensor copied to the GPU at {text} changed between iterations ({why}); "
                          f"this signature runs eagerly; {_FIX}")
        if c.buffer is None:  # retired with released graphs: never the case after a warm-up
            raise _refuse(f"the pinned buffer of the host copy at {text} is gone; this signature runs "
                          "eagerly")
        return c.buffer

    def _verify_copy(self, key, n, text, src, target) -> None:
        if self.changed:
            return
        c = self.record.copies.get((key, n))
        if c is None:
            self.changed = f"a host tensor copied to the GPU at {text} was not copied at capture"
            return
        why = difference(c.meta, c.target, c.values, meta_of(src), target, src)
        if why:
            self.changed = f"a host tensor copied to the GPU at {text} changed since the capture ({why})"

    def finish(self) -> None:
        """SUBSTITUTE: every line copied as often as in the warm-ups; VERIFY: the same."""
        rec = self.record
        for key, count in rec.counts.items():
            if self.counts.get(key, 0) != count:
                text = rec.sites.get(key, key)
                msg = (f"a host tensor copied to the GPU at {text} was copied {count} times in warm-up and "
                       f"{self.counts.get(key, 0)} times in this iteration")
                if self.state == VERIFY:
                    self.changed = self.changed or msg
                    return
                raise _refuse(f"{msg}; this signature runs eagerly; {_FIX}")

    # --------------------------------------------------------------- reads
    def host_read(self, func, args, kwargs):
        """A read of device values on the host: (handled, result)."""
        if func is _LOCAL_SCALAR or func is _EQUAL:
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            if not tensors or not any(t.device.type == self.device_type for t in tensors):
                return False, None
            what = "bool()/.item()" if func is _LOCAL_SCALAR else "torch.equal()"
        else:  # _to_copy from the device to the host
            src = args[0]
            device = kwargs.get("device")
            if (not isinstance(src, torch.Tensor) or src.device.type != self.device_type
                    or device is None or torch.device(device).type != "cpu"):
                return False, None
            if kwargs.get("pin_memory") and kwargs.get("non_blocking"):
                return False, None  # an asynchronous copy into pinned memory: capturable as it is
            tensors, what = [src], ".cpu()/.tolist()"
        if self.state == VERIFY:
            return False, None
        where = call_site()
        if where is None:
            return False, None
        _, text = where
        recipe = self.constants.recipe(func, args, kwargs, read=True)
        if self.state == OBSERVE:
            out = func(*args, **kwargs)
            if recipe is not None:
                value = out.clone() if isinstance(out, torch.Tensor) else out
                old = self.reads.get(recipe)
                if old is None:
                    self.reads[recipe] = (text, value)
            return True, out
        if recipe is None:
            raise _refuse(f"a host synchronisation at {text}: {what} reads a device value computed from the "
                          "model's inputs or weights, which a graph cannot replay; this signature runs "
                          "eagerly; decide on the host, or on the GPU with torch.where")
        got = self.record.reads.get(recipe)
        if got is None or got.varied:
            raise _refuse(f"a host synchronisation at {text}: {what} reads a constant device value that "
                          f"the warm-up iterations {'read differently' if got else 'did not read'}; this "
                          "signature runs eagerly")
        return True, (got.value.clone() if isinstance(got.value, torch.Tensor) else got.value)


def _plain_host(t) -> bool:
    return (isinstance(t, torch.Tensor) and type(t) is torch.Tensor and t.device.type == "cpu"
            and t.layout is torch.strided and not t.is_pinned())


class _HostMode(TorchDispatchMode):
    """The dispatch mode of a :class:`_Session` (see the module docstring)."""

    supports_higher_order_operators = True

    def __init__(self, session: _Session) -> None:
        super().__init__()
        self.session = session

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        s = self.session
        if isinstance(func, torch._ops.HigherOrderOperator):
            s.constants.forget_all()  # its body is not followed
            return func(*args, **kwargs)
        recipe = s.constants.recipe(func, args, kwargs)
        handled, out = False, None
        if func is _TO_COPY:
            handled, out = s.host_copy(func, args, kwargs)  # host to device
            if not handled:
                handled, out = s.host_read(func, args, kwargs)  # device to host
        elif func is _COPY:
            handled, out = s.host_copy(func, args, kwargs)
        elif func is _LOCAL_SCALAR or func is _EQUAL:
            handled, out = s.host_read(func, args, kwargs)
        if not handled:
            out = func(*args, **kwargs)
        s.constants.after(func, args, kwargs, out, recipe)
        return out


# ========================================================= torch.tensor and friends
_local = threading.local()  # the session of this thread, for the patched factories


def _session() -> _Session | None:
    return getattr(_local, "session", None)


def _target(device, default) -> torch.device:
    return torch.device(device) if device is not None else default


def _patched_tensor(original):
    def tensor(data, *args, **kwargs):
        s = _session()
        if s is None or args or isinstance(data, torch.Tensor):
            return original(data, *args, **kwargs)
        target = _target(kwargs.get("device"), torch.get_default_device())
        if target.type != s.device_type:
            return original(data, *args, **kwargs)
        requires_grad = kwargs.pop("requires_grad", False)
        kwargs.pop("pin_memory", None)
        kwargs["device"] = "cpu"
        out = original(data, **kwargs).to(target)  # the copy the dispatch mode sees
        return out.requires_grad_() if requires_grad else out

    tensor.__wrapped__ = original
    return tensor


def _patched_as_tensor(original):
    def as_tensor(data, dtype=None, device=None):
        s = _session()
        if s is None or isinstance(data, torch.Tensor):
            return original(data, dtype=dtype, device=device)
        target = _target(device, torch.get_default_device())
        if target.type != s.device_type:
            return original(data, dtype=dtype, device=device)
        return original(data, dtype=dtype, device="cpu").to(target)

    as_tensor.__wrapped__ = original
    return as_tensor


def _patched_new_tensor(original):
    def new_tensor(self, data, *args, **kwargs):
        s = _session()
        if s is None or args or isinstance(data, torch.Tensor):
            return original(self, data, *args, **kwargs)
        target = _target(kwargs.get("device"), self.device)
        if target.type != s.device_type:
            return original(self, data, *args, **kwargs)
        requires_grad = kwargs.pop("requires_grad", False)
        kwargs.pop("pin_memory", None)
        kwargs["device"] = "cpu"
        kwargs.setdefault("dtype", self.dtype)
        out = torch.tensor(data, **kwargs).to(target)
        return out.requires_grad_() if requires_grad else out

    new_tensor.__wrapped__ = original
    return new_tensor


_patch_lock = threading.Lock()
_patch_depth = 0
_saved: list = []


def _patch() -> None:
    global _patch_depth
    with _patch_lock:
        _patch_depth += 1
        if _patch_depth > 1:
            return
        own = "new_tensor" in torch.Tensor.__dict__
        _saved[:] = [(torch, "tensor", torch.tensor, True), (torch, "as_tensor", torch.as_tensor, True),
                     (torch.Tensor, "new_tensor", torch.Tensor.new_tensor, own)]
        torch.tensor = _patched_tensor(torch.tensor)
        torch.as_tensor = _patched_as_tensor(torch.as_tensor)
        torch.Tensor.new_tensor = _patched_new_tensor(torch.Tensor.new_tensor)


def _unpatch() -> None:
    global _patch_depth
    with _patch_lock:
        _patch_depth -= 1
        if _patch_depth > 0:
            return
        for owner, name, original, own in _saved:
            if own:
                setattr(owner, name, original)
            else:
                delattr(owner, name)
        _saved.clear()


@contextlib.contextmanager
def _active(session: _Session):
    previous = _session()
    _local.session = session
    _patch()
    try:
        with _HostMode(session):
            yield session
    finally:
        _unpatch()
        _local.session = previous


# ============================================================= the engine's hooks
def observing(watch: HostWatch | None, entry):
    """Around an eager warm-up iteration (or warm-up forward) of ``entry``: record
    its host copies and constant reads, when the model's watch is on."""
    if watch is None or not watch.on:
        return contextlib.nullcontext()
    return _observing(watch, entry)


@contextlib.contextmanager
def _observing(watch: HostWatch, entry):
    record = entry.host_copies
    if record is None:
        record = entry.host_copies = HostRecord(watch)
    session = _Session(record, OBSERVE)
    with _active(session):
        yield
    record.merge(session)  # not after an iteration that raised: the user's error propagates


def substituting(watch: HostWatch | None, entry):
    """Around the capture of ``entry``'s iteration (or forward): its host copies
    from the pinned buffers, its constant reads from the record. Nothing when the
    watch is off or no warm-up of ``entry`` was observed (then a host copy fails
    the capture as torch makes it, and :func:`capture_failed` arranges the retry)."""
    if watch is None or not watch.on or entry.host_copies is None or not entry.host_copies.iterations:
        return contextlib.nullcontext()
    return _substituting(entry.host_copies)


@contextlib.contextmanager
def _substituting(record: HostRecord):
    session = _Session(record, SUBSTITUTE)
    with _active(session):
        yield
    session.finish()


def capture_failed(watch: HostWatch | None, entry, error: BaseException | None, reason: str,
                   retryable: bool) -> tuple[str, bool]:
    """``(reason, retryable)`` of a failed capture, seen by the host watch: a
    pageable host copy in a signature whose warm-ups were not observed switches
    the watch on and asks for another attempt, after observed warm-ups."""
    if watch is None or not watch.enabled or error is None or not is_pageable_copy_error(error):
        return reason, retryable
    record = entry.host_copies
    if record is not None and record.iterations:
        return reason, retryable  # observed, and still a pageable copy: one this module does not see
    watch.wanted = True
    entry.warmups = 0  # the engine then gives the retry at least one (observed) warm-up
    return (f"{reason}; the next warm-up iterations observe the host tensors copied in forward, to "
            "graph them"), True


def is_pageable_copy_error(error: BaseException) -> bool:
    e, seen = error, 0
    while e is not None and seen < 6:
        if PAGEABLE_COPY_ERROR in str(e):
            return True
        e, seen = e.__cause__ or e.__context__, seen + 1
    return False


def describe(entry) -> str:
    """``"; ..."`` for the "captured" event of ``entry``, or ""."""
    record = getattr(entry, "host_copies", None)
    text = record.describe() if record is not None else ""
    return f"; {text}" if text else ""


# ================================================================== check mode
def check_due(entry) -> bool:
    """Check mode (``PYGRAPH_DIST_CHECK_HOST_COPIES=N``): whether this replay of
    ``entry`` runs eagerly instead, observed against the record (every N-th)."""
    record = entry.host_copies
    if record is None or not record.checking:
        return False
    record.check_calls += 1
    return record.check_calls % record.watch.check_every == 0


@contextlib.contextmanager
def verifying(entry):
    """Around an eager check iteration of ``entry``: yields the session, whose
    ``changed`` says how the host copies differ from the record ("" if not)."""
    session = _Session(entry.host_copies, VERIFY)
    with _active(session):
        yield session
    session.finish()


def changed_reason(changed: str) -> str:
    return (f"{changed}: its graph replayed values the forward no longer copies (check mode, "
            f"{CHECK_ENV}); this signature runs eagerly from here on; {_FIX}")


def conclude_check(session: _Session, entry, cache, iteration: int, *, group=None, device=None,
                   collective: bool, rank: int = 0) -> None:
    """After a check iteration: when the host copies changed (on any rank, agreed
    by ``collective`` training signatures; evaluation decides alone), the graphs of
    ``entry`` are released and it runs eagerly for good."""
    changed = session.changed
    if collective:
        from . import agreement

        moved = agreement.agreed_max([1 if changed else 0], group=group, device=device)[0]
        if moved and not changed:
            changed = "a host tensor copied to the GPU changed since the capture on another rank"
    if not changed:
        return
    cache.release(entry)
    entry.policy.reject(changed_reason(changed))
    cache.event(entry, iteration, "host copies changed", entry.policy.reason)
    if rank == 0 or session.changed:
        logger.warning("graph for [%s] dropped: %s", entry.description, entry.policy.reason)
