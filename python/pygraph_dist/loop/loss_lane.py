"""Tier 2's loss inside the graphs: the loop's own loss, learned and replayed.

A tier-2 loop computes its loss outside the model call::

    out = model(x)                          # forward graph
    loss = F.cross_entropy(out, y)          # the user's code, eagerly
    loss.backward()                         # autograd, then the backward graph
    optimizer.step()                        # step graph

Most of such a step's host time is the eager part: the loss's kernels and an
autograd backward that runs the loss's backward and hands the outputs'
gradients to the backward graph. This module takes both out of the steady
state, for the loss the loop computes the same way every step:

* **learn** (the last eager warm-up step): the model call's outputs are handed
  out as :class:`LaneTensor` (a ``torch.Tensor`` subclass, same storage, same
  autograd), whose ``__torch_function__`` records every torch call made on
  them and on what is computed from them, until ``backward()`` is called on
  one of those tensors. What that tensor was computed from — the calls, the
  other tensors they read (``y``), the plain values passed — is the loss's
  :class:`LossTrace`;
* **capture**: tier 2's capture (:mod:`~pygraph_dist.tiers.split`) adds a backward
  variant ``"lane"`` that replays the trace on the forward graph's outputs and
  the trace's tensors' static copies, then runs the same backward as the
  ``"fresh"`` variant (the first synchronised backward after
  ``zero_grad(set_to_none=True)``): gradient of the loss with respect to the
  outputs, then ``autograd.backward(outputs, grads)``, the all-reduces inside;
* **replay** (:class:`LaneRun`, one per model call): the calls on the outputs
  are matched against the trace, in order. Intermediate results are computed
  eagerly as well (a view costs nothing; ``cross_entropy`` before ``/ k`` or
  ``scaler.scale()`` runs twice, once here and once in the graph); the call
  that produces the loss is not: its tensors are copied into the static
  copies and the caller gets a *pending* loss. ``loss.backward()`` on it
  replays the ``"lane"`` graph and fills the loss in. A loop that reads the
  pending loss before ``backward()`` (or anything else the graph cannot
  replay: gradients present, a later model call in between, a hook) gets the
  loss computed eagerly at that moment from the values it was computed from,
  and the step continues exactly as tier 2 without the lane.

Calls on the outputs that are not the trace's next call (logging, metrics) run
as written and do not end the lane; an in-place change of an output or of a
trace result (through any view: their version counters are compared) and a
hook registered on one do. The lane is bitwise equal to tier 2 without it (and
so to ``graphs=False``): the same kernels on the same values, the loss's
backward inside the graph instead of eagerly (autocast's cast cache off there:
the outputs are leaves inside the capture, which eager casts would not cache).
"""

from __future__ import annotations

import copy
import weakref

import torch
import torch.utils._pytree as pytree

from .amp import autocast_state

_SIMPLE = (type(None), bool, int, float, str, slice, torch.dtype, torch.device, torch.layout,
           torch.memory_format, torch.Size, type(Ellipsis))
_RANDOM = ("dropout", "rand", "bernoulli", "multinomial", "normal", "uniform", "exponential")
_MAX_OPS = 64

# LaneRun states
MATCHING, PENDING, COMMITTED, OFF = "matching", "pending", "committed", "off"


def _plain(func, args, kwargs):
    with torch._C.DisableTorchFunctionSubclass():
        return func(*args, **kwargs)


def _name(func) -> str:
    name = getattr(func, "__name__", None) or str(func)
    if name == "__get__":  # a property (Tensor.shape.__get__): its own name
        name = getattr(getattr(func, "__self__", None), "__name__", name)
    return name


# What a pending loss answers without its value: it has the loss's metadata.
_METADATA = {"numel", "nelement", "dim", "ndimension", "ndim", "size", "shape", "dtype", "device", "layout",
             "is_floating_point", "is_complex", "requires_grad", "is_cuda", "element_size", "is_contiguous",
             "stride", "__len__", "__hash__"}


def _call_text(func) -> str:
    """How the user wrote a call on the loss: ``float(loss)``, ``loss.item()``."""
    name = _name(func)
    if name.startswith("__") and name.endswith("__"):
        return f"{name.strip('_')}(loss)"
    return f"loss.{name}()" if hasattr(torch.Tensor, name) else f"{name}(loss)"


# Calls that attach something to a tensor's backward: the graph computes the
# outputs' gradients without the user's hook (or retained .grad).
HOOKS = {"register_hook", "retain_grad", "register_post_accumulate_grad_hook"}


def _mutating(name: str, kwargs: dict) -> bool:
    if kwargs.get("out") is not None or kwargs.get("inplace") is True:
        return True
    if name.startswith("__i") or name in ("__setitem__", "__set__", "copy_", "set_"):
        return True
    return name.endswith("_") and not name.startswith("_") and not name.endswith("__")


def _tensors_of(result) -> list | None:
    """The tensors a call returned (one, or a tuple/list of them), None otherwise."""
    if isinstance(result, torch.Tensor):
        return [result]
    if isinstance(result, (tuple, list)) and result and all(isinstance(r, torch.Tensor) for r in result):
        return list(result)
    return None


def _owner(args, kwargs):
    """The live run that must see a call: the run of a waiting tensor in it (a
    pending loss, even after another step's tensors: ``torch.stack([earlier,
    loss])``), else the run of its first LaneTensor whose run is live, else
    None. Tensors are looked for as torch calls take them: arguments and
    keyword arguments, and lists or tuples of tensors among them."""
    first = None
    for a in (*args, *kwargs.values()):
        for b in (a if isinstance(a, (list, tuple)) else (a,)):
            if isinstance(b, LaneTensor):
                owner = b._pgd_owner  # noqa: SLF001
                if owner is not None and owner.live:
                    if b._pgd_waiting:  # noqa: SLF001
                        return owner
                    first = first or owner
    return first


class LaneTensor(torch.Tensor):
    """A tensor handed out by a tier-2 model call (or computed from one) whose
    torch calls the loss lane sees. Same storage and autograd as the tensor it
    wraps; once its step is over it behaves as a plain tensor."""

    _pgd_owner = None
    _pgd_slot = -1
    _pgd_waiting = False  # a pending loss (or a copy of it) without its value yet

    def _settled(self) -> torch.Tensor:
        """This tensor's value as a plain tensor (a pending loss computed first)."""
        owner = self._pgd_owner
        if owner is not None and self._pgd_waiting:
            owner.realize("the loss was saved or copied before backward()")
        t = getattr(self, "_pgd_real", self)
        with torch._C.DisableTorchFunctionSubclass():
            return torch.Tensor._make_subclass(torch.Tensor, t, t.requires_grad)

    def __reduce_ex__(self, proto):  # torch.save, pickle: a plain tensor (the lane is this process's)
        return self._settled().__reduce_ex__(proto)

    def __deepcopy__(self, memo):
        return copy.deepcopy(self._settled(), memo)

    def __format__(self, spec: str) -> str:
        # f"{loss:.4f}", f"{loss}": Tensor.__format__ formats the value of a 0-dim
        # plain Tensor only (type(self) is Tensor); a subclass's raises or shows its repr.
        if self.dim() == 0:  # as Tensor.__format__ does for a plain 0-dim tensor, spec or not
            return self.item().__format__(spec)
        return super().__format__(spec)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        owner = _owner(args, kwargs)
        if owner is None or not owner.live:
            return _plain(func, args, kwargs)
        return owner.op(func, args, kwargs)


def track(t: torch.Tensor, owner, slot: int, *, fresh: bool = False) -> LaneTensor:
    """``t`` as a :class:`LaneTensor` of ``owner`` (same storage, attached to
    autograd). ``fresh``: ``t`` is a new tensor inside an ``autograd.Function``'s
    forward, wrapped without a view (a view made there could not be changed in
    place by the caller)."""
    if isinstance(t, LaneTensor):
        w = t
    elif fresh:
        w = torch.Tensor._make_subclass(LaneTensor, t, t.requires_grad)
    else:
        w = t.as_subclass(LaneTensor)
    w._pgd_owner = owner
    w._pgd_slot = slot
    return w


class TraceOp:
    __slots__ = ("func", "spec", "code", "outs", "autocast")

    def __init__(self, func, spec, code, outs, autocast) -> None:
        self.func, self.spec, self.code, self.outs, self.autocast = func, spec, code, outs, autocast


class LossTrace:
    """The calls that computed the loss from a model call's outputs.

    ``ops``: in call order, each with its arguments coded as ``("s", slot)``
    (an output, or a result of an earlier call), ``("e", j)`` (another tensor:
    its shape, dtype and device are ``exts[j]``) or ``("c", value)``;
    ``terminal``: the loss's slot."""

    def __init__(self, ops: list[TraceOp], exts: list[tuple], terminal: int, n_outs: int,
                 device_type: str) -> None:
        self.ops, self.exts, self.terminal, self.n_outs = ops, exts, terminal, n_outs
        self.device_type = device_type

    def describe(self) -> str:
        return " -> ".join(_name(op.func) for op in self.ops)

    def static_exts(self, device) -> list[torch.Tensor]:
        """Buffers for the trace's other tensors, copied in at every replay."""
        return [torch.zeros(shape, dtype=dtype, device=dev) for shape, dtype, dev in self.exts]

    def compute(self, outs: list[torch.Tensor], exts: list[torch.Tensor]) -> torch.Tensor:
        """Run the trace on ``outs`` (the model call's output tensors, in
        :func:`~pygraph_dist.loop.outputs.map_outputs` order) and ``exts``: the loss."""
        slots: dict[int, torch.Tensor] = dict(enumerate(outs))
        for op in self.ops:
            result = _run(op, self._leaves(op, slots, exts), self.device_type)
            for slot, t in zip(op.outs, _tensors_of(result)):
                if slot >= 0:
                    slots[slot] = t
        return slots[self.terminal]

    @staticmethod
    def _leaves(op: TraceOp, slots: dict, exts: list) -> list:
        return [slots[v] if k == "s" else exts[v] if k == "e" else v for k, v in op.code]


def version(t: torch.Tensor) -> int:
    with torch._C.DisableTorchFunctionSubclass():
        return t._version


def changed(versions: list) -> bool:
    """Whether a tensor of ``versions`` ((weak ref, _version) pairs) changed in place since."""
    for ref, v in versions:
        t = ref()
        if t is not None and version(t) != v:
            return True
    return False


def rebuild(result, wrapped: list):
    """``result`` (a tensor, or a tuple, list or named result such as max()'s)
    with ``wrapped`` in place of its tensors."""
    if isinstance(result, torch.Tensor):
        return wrapped[0]
    try:
        return type(result)(wrapped)
    except TypeError:
        return tuple(wrapped)


def _run(op: TraceOp, leaves: list, device_type: str):
    args, kwargs = pytree.tree_unflatten(leaves, op.spec)
    enabled, dtype = op.autocast
    # Explicitly on or off: the engine's own autocast (amp=...) must not reach the loss.
    # No cast cache: inside the capture the outputs are leaves that require grad,
    # whose casts autocast would cache and share between calls (eager: not leaves).
    # Not under the caller's inference_mode either (the loss read inside one
    # before backward()): the loss computed here is the one backward() runs through.
    with torch.autocast(device_type, dtype=dtype, enabled=enabled, cache_enabled=False), torch.enable_grad(), \
            torch.inference_mode(False):
        return _plain(op.func, args, kwargs)


def _backward_target(func, args, kwargs):
    """(target, extra): what ``backward()`` was called on, and whether with arguments."""
    if func is torch.Tensor.backward:
        target = args[0] if args else kwargs.get("self")
        rest = list(args[1:]) + [v for k, v in kwargs.items() if k != "self"]
    else:
        target = args[0] if args else kwargs.get("tensors")
        rest = list(args[1:]) + [v for k, v in kwargs.items() if k != "tensors"]
        if isinstance(target, (list, tuple)) and len(target) == 1:
            target = target[0]
    return target, any(v is not None and v is not False for v in rest)


class Recorder:
    """Learns the loss trace from one eager step (see the module docstring).
    ``trace`` once ``backward()`` was called on a tensor computed from the
    outputs; ``why`` when the loss cannot be replayed, in words."""

    def __init__(self, device) -> None:
        self.device = device
        self.live = True
        self.ops: list[TraceOp] = []
        self.exts: list[torch.Tensor] = []
        self.ext_index: dict[int, int] = {}
        self.next_slot = 0
        self.n_outs = 0
        self.dirty: set[int] = set()  # slots changed in place
        self.versions: list = []  # (weak ref, _version) of the outputs and every result
        self.trace: LossTrace | None = None
        self.why = ""

    def wrap_outputs(self, tensors: list[torch.Tensor]) -> list:
        self.next_slot = len(tensors)
        self.n_outs = len(tensors)
        wrapped = [track(t, self, i) for i, t in enumerate(tensors)]
        self.versions = [(weakref.ref(t), version(t)) for t in wrapped]
        return wrapped

    def op(self, func, args, kwargs):
        if func is torch.Tensor.backward or func is torch.autograd.backward:
            self._finish(*_backward_target(func, args, kwargs))
            self.live = False
            return _plain(func, args, kwargs)
        leaves, spec = pytree.tree_flatten((args, kwargs))
        code = []
        for x in leaves:
            if isinstance(x, LaneTensor) and x._pgd_owner is self:
                code.append(("s", x._pgd_slot))
            elif isinstance(x, torch.Tensor):
                j = self.ext_index.get(id(x))
                if j is None:
                    j = self.ext_index[id(x)] = len(self.exts)
                    self.exts.append(x)
                code.append(("e", j))
            elif isinstance(x, _SIMPLE):
                code.append(("c", x))
            else:
                code.append(("o", type(x).__name__))
        name = _name(func)
        if _mutating(name, kwargs):
            self.dirty.update(v for k, v in code if k == "s")
        if name in HOOKS and any(k == "s" for k, _ in code):
            self.why = f"{name}() on an output of the model call (or a tensor computed from it)"
        result = _plain(func, args, kwargs)
        tensors = _tensors_of(result)
        if tensors is None or _mutating(name, kwargs):
            return result
        outs = list(range(self.next_slot, self.next_slot + len(tensors)))
        self.next_slot += len(tensors)
        self.versions.extend((weakref.ref(t), version(t)) for t in tensors)
        self.ops.append(TraceOp(func, spec, tuple(code), tuple(outs),
                                autocast_state(self.device.type) + (torch.is_grad_enabled(),)))
        return rebuild(result, [track(t, self, s) for t, s in zip(tensors, outs)])

    def _finish(self, target, extra: bool) -> None:
        why = self.why
        self.why = ""
        self._learn(target, extra)
        self.why = why or self.why
        if self.why:
            self.trace = None
        self.exts, self.ext_index = [], {}  # the trace keeps their shapes; not the user's tensors

    def _learn(self, target, extra: bool) -> None:
        if changed(self.versions):  # through any alias: views and detach() share the counter
            self.why = "an output of the model call (or a tensor computed from it) was changed in place"
            return
        if not (isinstance(target, LaneTensor) and target._pgd_owner is self):
            self.why = "backward() was called on a tensor not computed from the model call's outputs"
            return
        if extra:
            self.why = "backward() was called with arguments (gradient, retain_graph, inputs, ...)"
            return
        if target.dim() != 0 or not target.is_floating_point() or not target.requires_grad:
            self.why = "backward() was called on a tensor that is not a scalar loss"
            return
        producer = {s: op for op in self.ops for s in op.outs}
        need, stack = set(), [target._pgd_slot]
        while stack:
            s = stack.pop()
            if s in need or s < self.n_outs:
                continue
            need.add(s)
            stack.extend(v for k, v in producer[s].code if k == "s")
        ops = [op for op in self.ops if need.intersection(op.outs)]
        read = need | {v for op in ops for k, v in op.code if k == "s"}
        why = self._check(ops, read)
        if why:
            self.why = why
            return
        used = sorted({v for op in ops for k, v in op.code if k == "e"})
        renumber = {j: i for i, j in enumerate(used)}
        ops = [TraceOp(op.func, op.spec, tuple(("e", renumber[v]) if k == "e" else (k, v) for k, v in op.code),
                       op.outs, op.autocast[:2]) for op in ops]
        exts = [(tuple(self.exts[j].shape), self.exts[j].dtype, self.exts[j].device) for j in used]
        self.trace = LossTrace(ops, exts, target._pgd_slot, self.n_outs, self.device.type)

    def _check(self, ops: list[TraceOp], read: set) -> str:
        if not ops:
            return "backward() was called on an output of the model call itself"
        if len(ops) > _MAX_OPS:
            return f"the loss takes more than {_MAX_OPS} torch calls"
        for op in ops:
            name = _name(op.func)
            if any(k == "o" for k, _ in op.code):
                return f"{name}() in the loss takes an argument that is not a tensor or a plain value"
            if any(r in name for r in _RANDOM):
                return f"{name}() in the loss draws random numbers"
            if not op.autocast[2]:
                return f"{name}() in the loss ran with gradients disabled"
            if read.intersection(self.dirty):
                return "an output of the model call (or a tensor computed from it) was changed in place"
            for k, v in op.code:
                if k == "e":
                    x = self.exts[v]
                    if x.requires_grad:
                        return (f"{name}() in the loss reads a tensor that requires grad besides the model "
                                "call's outputs")
                    if x.device != self.device or x.layout != torch.strided or not x.is_contiguous():
                        # (contiguous: the static copy must be laid out as the tensor it stands for)
                        return (f"{name}() in the loss reads a tensor that is not a contiguous dense tensor on "
                                "the model's device")
        return ""
