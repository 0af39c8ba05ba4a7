"""One region the host watch runs around (host_copies.py): an observed
warm-up, a substituted capture or a verified check iteration. ``_Session``
holds what the region copied and read; ``_HostMode`` (a ``TorchDispatchMode``)
routes every host-to-device copy and every host read of a device value to it;
``torch.tensor``/``torch.as_tensor``/``Tensor.new_tensor`` are patched while a
region is active (on its thread only), since they copy below the Python
dispatch key otherwise, and so are ``Tensor.__getitem__``/``__setitem__``, whose
integer lists (``x[..., [-2], :]``) and host index tensors torch copies to the
device out of sight too.
Hugging Face transformers, when loaded, takes the branch
it takes under stream capture in every region, observed warm-ups too
(``patches.transformers_capture_branch``): its masks are skipped eagerly after
a host read of the attention mask, and built under capture, so a warm-up would
otherwise never see the copies the capture makes.
"""

from __future__ import annotations

import contextlib
import threading

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ..runtime import patches
from ..runtime._ext import NOT_CAPTURABLE_TAG
from .host_record import HostRecord
from .host_values import _Constants, call_site, difference, meta_of

_aten = torch.ops.aten
_TO_COPY = _aten._to_copy.default
_COPY = _aten.copy_.default
_LOCAL_SCALAR = _aten._local_scalar_dense.default
_EQUAL = _aten.equal.default


class HostTensorError(RuntimeError):
    """A host tensor made in forward that a graph cannot replay (carries the
    not-capturable tag: the capture fails for good, the signature runs eagerly)."""


def _refuse(text: str) -> HostTensorError:
    return HostTensorError(f"{NOT_CAPTURABLE_TAG}{text}")


_FIX = ("make it on the GPU (torch.arange(..., device=...), torch.full(..., device=...)) or pass it "
        "to the model as an input")


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
        if patches.is_higher_order_op(func):
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


def _target(device, default=None) -> torch.device:
    """Where a factory call puts its tensor: ``device``, else ``default``, else torch's
    default device. torch.get_default_device() itself calls torch.tensor([]) when the
    default device has no index (set_default_device("cuda")); that call is torch's."""
    if device is not None:
        return torch.device(device)
    if default is not None:
        return default
    _local.inner = True
    try:
        return torch.get_default_device()
    finally:
        _local.inner = False


def _passes_through(s) -> bool:
    return s is None or getattr(_local, "inner", False)


def _patched_tensor(original):
    def tensor(data, *args, **kwargs):
        s = _session()
        if _passes_through(s) or args or isinstance(data, torch.Tensor):
            return original(data, *args, **kwargs)
        target = _target(kwargs.get("device"))
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
        if _passes_through(s) or isinstance(data, torch.Tensor):
            return original(data, dtype=dtype, device=device)
        target = _target(device)
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


def _is_index_list(obj) -> bool:
    """A list torch indexes with as one integer or boolean tensor (not the legacy
    list of slices/None, which torch reads as a tuple)."""
    if not isinstance(obj, list) or not obj:
        return False
    return all(isinstance(v, (int, bool)) or _is_index_list(v) for v in obj)


def _moved(item, device) -> tuple:
    """One index item as the device index tensors torch would make of it."""
    if _is_index_list(item):
        item = torch.tensor(item, device="cpu")  # on the host, whatever the default device
    elif not _plain_host(item) or item.dim() == 0:  # a 0-dim host tensor indexes as a number
        return (item,)
    parts = item.nonzero().unbind(1) if item.dtype in (torch.bool, torch.uint8) else (item,)
    return tuple(part.to(device) for part in parts)  # the copies the session sees, at the caller's line


def _device_index(index, device):
    """``index`` with its integer/boolean lists and host index tensors on ``device``.
    torch copies them inside the indexing, from pageable memory and out of every
    mode's sight (a list is built on the device below the dispatch key; a host
    tensor is moved in the index kernel), and autograd saves the host tensor for
    the backward's copy. Moved here, each is a host copy of the session at the
    indexing line, and autograd saves the device tensor. A boolean mask becomes
    its integer indices on the host first, as torch's kernel does
    (``expandTensors``): the same indexing, the same integers."""
    items = index if isinstance(index, tuple) else (index,)
    if not any(_is_index_list(i) or (_plain_host(i) and i.dim() > 0) for i in items):
        return index
    out = tuple(part for item in items for part in _moved(item, device))
    return out if isinstance(index, tuple) or len(out) != 1 else out[0]


def _patched_indexing(original):
    """``Tensor.__getitem__(self, index)`` or ``__setitem__(self, index, value)``."""
    def indexing(self, index, *value):
        s = _session()
        if s is not None and self.device.type == s.device_type:
            index = _device_index(index, self.device)
        return original(self, index, *value)

    indexing.__name__ = original.__name__
    indexing.__wrapped__ = original
    return indexing


_patch_lock = threading.Lock()
_patch_depth = 0
_swap: list = []  # the patches.Swap in place while sessions are active


def _patch() -> None:
    """The tensor factories patched while any session is active (patches.py,
    entry ``host_tensor_factories``)."""
    global _patch_depth
    with _patch_lock:
        _patch_depth += 1
        if _patch_depth > 1:
            return
        patches.settle_device_constructors()
        _swap[:] = [patches.Swap("host_tensor_factories", [
            (torch, "tensor", _patched_tensor(torch.tensor)),
            (torch, "as_tensor", _patched_as_tensor(torch.as_tensor)),
            (torch.Tensor, "new_tensor", _patched_new_tensor(torch.Tensor.new_tensor)),
            (torch.Tensor, "__getitem__", _patched_indexing(torch.Tensor.__getitem__)),
            (torch.Tensor, "__setitem__", _patched_indexing(torch.Tensor.__setitem__))])]
        branch = patches.transformers_capture_branch(lambda: _session() is not None)
        if branch is not None:
            _swap.append(branch)


def _unpatch() -> None:
    global _patch_depth
    with _patch_lock:
        _patch_depth -= 1
        if _patch_depth > 0:
            return
        for swap in _swap:
            swap.undo()
        _swap.clear()


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
