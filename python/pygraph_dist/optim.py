"""Making the user's optimizer capturable, and graph-aware, in place.

``wrap()`` returns the *same* optimizer object with its class swapped for a
subclass that mixes in :class:`GraphedOptimizerMixin` (the technique
``torch.nn.utils.parametrize`` uses for modules, and Lightning for
optimizers). Everything that holds the optimizer — LR schedulers, checkpoint
code, ``isinstance`` checks — keeps working, and ``step()``/``zero_grad()``
route through the engine.

What "capturable" needs, on torch 2.11 (reference notes §2.3–2.4):
  * Adam/AdamW: ``capturable=True`` (``fused=True`` alone fails capture on
    2.11); the step counter lives on the device; the learning rate becomes a
    one-element device tensor so that schedulers update it in place
    (``lr_scheduler._update_param_group_val`` fills tensors) and replays see
    the new value.
  * fp16: GradScaler only avoids a host sync with optimizers that take the
    scale on the device (``_step_supports_amp_scaling``: fused Adam, AdamW,
    SGD), so fp16 turns ``fused=True`` on.
  * SGD has no ``capturable`` option and its foreach path turns a tensor lr
    into a host scalar; its fused kernel reads a tensor lr on the device
    (``_fused_sgd_.tensor_lr``). So SGD is switched to ``fused=True`` with the
    lr as a device tensor, like Adam's: an lr schedule that changes every step
    reaches the graph without capturing again. Where the fused kernel cannot
    be used (sparse gradients, a non-float parameter, a tensor weight decay or
    momentum, a torch without the overload) the lr stays a float baked into
    the graph, and a change of lr makes the engine capture again.
The same changes apply whether or not graphs end up being used, so that eager
and graphed training run the same arithmetic.
"""

from __future__ import annotations

import logging
import os
import sys
import weakref
from dataclasses import dataclass, field

import torch

from .amp import AmpConfig

logger = logging.getLogger("pygraph_dist")

# Optimizers whose capturable step reads a tensor lr on the device. Adam and
# AdamW (fused or not); RMSprop and Adadelta take a tensor lr in their
# capturable foreach/single-tensor paths (torch/optim/rmsprop.py,
# adadelta.py: "if capturable and isinstance(lr, Tensor)"). NAdam, RAdam,
# Adamax and ASGD call _to_scalar(lr) -- a host read -- so their lr stays a
# float baked into the graph.
_TENSOR_LR = (torch.optim.Adam, torch.optim.AdamW, torch.optim.RMSprop, torch.optim.Adadelta)
_FUSABLE = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD)


@dataclass
class OptimizerPlan:
    graphable: bool
    reason: str = ""
    changes: list[str] = field(default_factory=list)
    # Per param group: the device tensor that holds its lr, or None (float lr).
    lr_tensors: list[torch.Tensor | None] = field(default_factory=list)
    # SGD only: why its lr stays a float baked into the graph ("" when on the device).
    sgd_float_lr: str = ""


def prepare_optimizer(
    opt: torch.optim.Optimizer, *, device: torch.device, amp: AmpConfig, skip_nonfinite: bool = False,
    sparse: bool = False,
) -> OptimizerPlan:
    """Reconfigure ``opt`` for capture on ``device``; say what changed and why not if it cannot be.

    ``sparse``: the model has parameters with sparse gradients (stepped by the
    same optimizer, eagerly), which SGD's fused kernel does not take."""
    plan = OptimizerPlan(graphable=True)
    cls = type(opt)
    name = cls.__name__
    if device.type != "cuda":
        plan.graphable = False
        plan.reason = "parameters are not on a CUDA device"
        plan.lr_tensors = [None] * len(opt.param_groups)
        return plan

    if isinstance(opt, _TENSOR_LR) or "capturable" in opt.defaults:
        for g in opt.param_groups:
            if g.get("differentiable"):
                return _not_graphable(plan, opt, f"{name}(differentiable=True) cannot be captured")
            if not g.get("capturable", False):
                g["capturable"] = True
                _note(plan, "capturable=True")
    elif not isinstance(opt, torch.optim.SGD):
        return _not_graphable(
            plan, opt,
            f"{name} is not known to be capturable: graphs support Adam, AdamW, SGD and torch "
            "optimizers with a `capturable` option. Training runs eagerly.",
        )

    if skip_nonfinite and not amp.needs_grad_scaler:
        if not isinstance(opt, _FUSABLE):
            raise ValueError(
                f"skip_nonfinite=True skips the update inside the fused optimizer kernel (its "
                f"found_inf input, as GradScaler uses it); {name} has no fused kernel. Use Adam, "
                "AdamW or SGD, or skip_nonfinite=False.")
        _make_fused(opt, plan, "non-finite steps skipped on the device")
    if amp.needs_grad_scaler:
        if not isinstance(opt, _FUSABLE):
            return _not_graphable(
                plan, opt,
                f"fp16 loss scaling inside a graph needs an optimizer that takes the scale on the "
                f"device (fused Adam, AdamW or SGD); {name} does not. Use amp='bf16', or one of those.",
            )
        _make_fused(opt, plan, "fp16 loss scaling without a host sync")
        opt._step_supports_amp_scaling = True  # what fused=True sets in __init__

    device_lr = isinstance(opt, _TENSOR_LR)
    if isinstance(opt, torch.optim.SGD):
        why_not = _sgd_device_lr_problem(opt, sparse)
        if why_not is None:
            device_lr = True
            _make_fused(opt, plan, "its kernel reads the lr on the device")
        else:
            plan.sgd_float_lr = why_not
    for g in opt.param_groups:
        lr = g["lr"]
        if device_lr:
            if not isinstance(lr, torch.Tensor):
                # Schedulers created later take their base lr from initial_lr: keep it a float.
                g.setdefault("initial_lr", float(lr))
                g["lr"] = torch.tensor(float(lr), dtype=torch.float32, device=device)
                _note(plan, "lr as a device tensor (lr assignments and schedulers reach the graph)")
            elif lr.device != device or lr.dtype != torch.float32 or lr.dim() != 0:
                g["lr"] = lr.detach().to(device=device, dtype=torch.float32).reshape(())
            plan.lr_tensors.append(g["lr"])
        else:
            plan.lr_tensors.append(None)
    watch_param_groups(opt, plan.lr_tensors)

    # Existing state (a loaded checkpoint, earlier eager steps) must live where
    # capturable/fused kernels expect it: the step counter on the device, float32.
    for p, state in opt.state.items():
        step = state.get("step") if isinstance(state, dict) else None
        if isinstance(step, torch.Tensor) and step.device != p.device:
            state["step"] = step.to(device=p.device, dtype=torch.float32)
        elif step is not None and not isinstance(step, torch.Tensor):
            state["step"] = torch.tensor(float(step), dtype=torch.float32, device=p.device)
    return plan


_FUSED_SGD_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)


def _sgd_device_lr_problem(opt: torch.optim.SGD, sparse: bool) -> str | None:
    """Why SGD cannot run fused with a device lr here, or None if it can."""
    if "tensor_lr" not in torch.ops.aten._fused_sgd_.overloads():
        return f"torch {torch.__version__} has no fused SGD kernel that reads a tensor lr"
    if sparse:
        return "the model has sparse gradients, which SGD's fused kernel does not take"
    for i, g in enumerate(opt.param_groups):
        if g.get("differentiable"):
            return f"param group {i} has differentiable=True"
        for k in ("weight_decay", "momentum", "dampening"):
            if isinstance(g.get(k), torch.Tensor):
                return f"param group {i}'s {k} is a tensor; the fused kernel takes a float"
        for p in g["params"]:
            if p.dtype not in _FUSED_SGD_DTYPES or p.device.type != "cuda":
                return f"a parameter is {p.dtype} on {p.device}; the fused kernel takes CUDA floats"
    return None


def _make_fused(opt: torch.optim.Optimizer, plan: OptimizerPlan, why: str) -> None:
    """Every param group on the fused kernel (foreach back to its default), noted once."""
    for g in opt.param_groups:
        if not g.get("fused"):
            g["fused"] = True
            g["foreach"] = None
            _note(plan, f"fused=True ({why})")


def _note(plan: OptimizerPlan, change: str) -> None:
    if change not in plan.changes:
        plan.changes.append(change)


def _not_graphable(plan: OptimizerPlan, opt, reason: str) -> OptimizerPlan:
    plan.graphable = False
    plan.reason = reason
    plan.lr_tensors = [None] * len(opt.param_groups)
    return plan


# ---------------------------------------------------------------------------
# Hyperparameters as scripts set them.


def write_lr(target: torch.Tensor, value) -> bool:
    """Write ``value`` -- a Python or numpy number, or a one-element tensor --
    into the device lr tensor ``target`` (no host sync); False if it is none of those."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            return False
        with torch.no_grad():
            target.copy_(value.detach().reshape(()))
        return True
    try:
        number = float(value)  # int, float, numpy scalars, Decimal, ...
    except (TypeError, ValueError):
        return False
    with torch.no_grad():
        target.fill_(number)
    return True


_HERE = __file__.rsplit("/", 1)[0]


def _user_line() -> str:
    """``file:line`` of the nearest caller outside torch and pygraph_dist (the
    script line that set a hyperparameter, also through a scheduler's step())."""
    frame = sys._getframe(2)
    while frame is not None:
        path = frame.f_code.co_filename
        if not (path.startswith(_HERE) or f"{os.sep}torch{os.sep}" in path):
            return f"{os.path.basename(path)}:{frame.f_lineno}"
        frame = frame.f_back
    return ""


class WatchedParamGroup(dict):
    """A param group of a wrapped optimizer: a dict that behaves as the one it
    replaces, except that

    * a number (or a one-element tensor) assigned to ``'lr'`` of a group whose
      lr lives on the device is written *into* that tensor, which the graphs
      read -- ``group['lr'] = get_lr(it)`` (nanoGPT), timm's schedulers
      (``param_group[field] = value``), ``group['lr'] *= 0.1`` all reach the
      next replay without capturing again;
    * any other key assigned a new value records the script line that did it,
      for the warning about hyperparameters a graph bakes in.

    ``update``/``setdefault`` go through ``__setitem__``; a group dict replaced
    in the list is caught by :func:`adopt_assigned_lrs` at the next model call
    or step. ``version`` counts the changes a graph could miss (an lr written
    into the device tensor is not one): an unchanged version is an unchanged
    group, which spares the drift check its per-key comparisons.
    """

    __slots__ = ("lr_tensor", "set_at", "version")

    def __init__(self, group: dict, lr_tensor: torch.Tensor | None) -> None:
        super().__init__(group)
        self.lr_tensor = lr_tensor
        self.set_at: dict[str, str] = {}
        self.version = 0

    def __setitem__(self, key, value) -> None:
        if key == "lr" and self.lr_tensor is not None and value is not self.lr_tensor \
                and write_lr(self.lr_tensor, value):
            value = self.lr_tensor
        else:
            old = dict.get(self, key, _MISSING)
            if old is not value:
                self.version += 1
                if key != "params" and old is not _MISSING and not _same(old, value):
                    self.set_at[key] = _user_line()
        dict.__setitem__(self, key, value)

    def update(self, *args, **kwargs) -> None:
        for k, v in dict(*args, **kwargs).items():
            self[k] = v

    def setdefault(self, key, default=None):
        if key not in self:
            self[key] = default
        return dict.__getitem__(self, key)

    def __ior__(self, other):
        self.update(other)
        return self

    def __delitem__(self, key) -> None:
        self.version += 1
        dict.__delitem__(self, key)

    def pop(self, *args):
        self.version += 1
        return dict.pop(self, *args)

    def popitem(self):
        self.version += 1
        return dict.popitem(self)

    def clear(self) -> None:
        self.version += 1
        dict.clear(self)

    def __reduce__(self):  # pickled (deepcopy, torch.save of the optimizer) as a plain dict
        return (dict, (dict(self),))


_MISSING = object()


def group_versions(opt: torch.optim.Optimizer) -> tuple | None:
    """Each param group with its ``version``, for :func:`same_versions`; None
    unless every group is a WatchedParamGroup."""
    groups = opt.param_groups
    if not all(isinstance(g, WatchedParamGroup) for g in groups):
        return None
    return tuple((g, g.version) for g in groups)


def same_versions(opt: torch.optim.Optimizer, versions: tuple | None) -> bool:
    """Whether the param groups are the same dicts as in ``versions``, none
    changed since: then nothing :func:`hyperparams_drift` compares changed."""
    if versions is None:
        return False
    groups = opt.param_groups
    if len(groups) != len(versions):
        return False
    for g, (g0, v0) in zip(groups, versions):
        if g is not g0 or g.version != v0:
            return False
    return True


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return False
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - an odd type compares as changed
        return False


def watch_param_groups(opt: torch.optim.Optimizer, lr_tensors: list[torch.Tensor | None]) -> None:
    """Replace ``opt``'s param group dicts, in place in its list, by
    :class:`WatchedParamGroup` s (same keys and values)."""
    groups = opt.param_groups
    for i, g in enumerate(groups):
        lr_t = lr_tensors[i] if i < len(lr_tensors) else None
        if isinstance(g, WatchedParamGroup):
            g.lr_tensor = lr_t
        else:
            groups[i] = WatchedParamGroup(g, lr_t)


def adopt_assigned_lrs(opt: torch.optim.Optimizer, lr_tensors: list[torch.Tensor | None]) -> None:
    """An lr that reached a group without ``__setitem__`` (``group.update``, a
    replaced group dict) is written into the device tensor, which goes back into
    the group. Called at every model call and step, before anything reads the lr,
    so that the eager step, a capture and a replay all read the tensor."""
    for g, t in zip(opt.param_groups, lr_tensors):
        if t is not None:
            cur = g.get("lr")
            if cur is not t and write_lr(t, cur):
                dict.__setitem__(g, "lr", t)


# ---------------------------------------------------------------------------
# Hyperparameters baked into a graph.


def snapshot_hyperparams(opt: torch.optim.Optimizer) -> list[dict]:
    return [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]


def where_set(opt: torch.optim.Optimizer, group: int, key: str) -> str:
    """The script line that last assigned ``key`` of param group ``group``, or ""."""
    groups = opt.param_groups
    g = groups[group] if group < len(groups) else None
    return g.set_at.get(key, "") if isinstance(g, WatchedParamGroup) else ""


def hyperparams_drift(
    opt: torch.optim.Optimizer, snapshot: list[dict], lr_tensors: list[torch.Tensor | None]
) -> str | None:
    """What changed since ``snapshot`` that a replay would not see, or None.

    A number assigned to a device-lr group (``group["lr"] = 1e-4``) was
    already written into the device tensor the graph reads (WatchedParamGroup,
    adopt_assigned_lrs): not a change. Reasons start with
    ``param group I: 'KEY'`` (the engine counts them per key).
    """
    adopt_assigned_lrs(opt, lr_tensors)
    groups = opt.param_groups
    if len(groups) != len(snapshot):
        return f"the optimizer now has {len(groups)} param groups instead of {len(snapshot)}"
    for i, (g, snap) in enumerate(zip(groups, snapshot)):
        if len(g) != len(snap) + 1:  # +1: 'params'
            added = sorted(set(g) - set(snap) - {"params"})
            if added:
                return f"param group {i}: '{added[0]}' was added"
        for k, v in snap.items():
            cur = g.get(k)
            if cur is v:
                continue
            where = where_set(opt, i, k)
            at = f" (set at {where})" if where else ""
            if isinstance(v, torch.Tensor) or isinstance(cur, torch.Tensor):
                return f"param group {i}: '{k}' was replaced by another object{at}"
            if not _same(cur, v):
                return f"param group {i}: '{k}' changed from {v!r} to {cur!r}{at}"
    return None


# ---------------------------------------------------------------------------


class GraphedOptimizerMixin:
    """Routes ``step``/``zero_grad`` of a wrapped optimizer through the engine.

    ``optimizer.step()`` in a graphed iteration does nothing: the step already
    ran inside the graph launched by the model call. Checkpoints:
    ``state_dict()`` stores plain float learning rates and the GradScaler
    state; ``load_state_dict()`` makes the engine capture again, because the
    loaded state tensors are new objects at new addresses.
    """

    def step(self, closure=None):
        engine = self.__dict__.get("_pgd_engine")
        if engine is None or engine.delegating_step:
            return super().step(closure)  # type: ignore[misc]
        return engine.optimizer_step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        engine = self.__dict__.get("_pgd_engine")
        if engine is None:
            # A wrapper that subclasses our class and keeps the optimizer inside
            # (Lightning Fabric's _FabricOptimizer: its class derives from ours, its
            # __dict__ is its own): the wrapped optimizer's zero_grad, which the
            # engine must see (else the loop check sees no zero_grad at all).
            inner = self.__dict__.get("_optimizer")
            if isinstance(inner, GraphedOptimizerMixin) and inner is not self:
                return inner.zero_grad(set_to_none)
            return super().zero_grad(set_to_none)  # type: ignore[misc]
        engine.optimizer_zero_grad(set_to_none)

    def state_dict(self):
        sd = super().state_dict()  # type: ignore[misc]
        engine = self.__dict__.get("_pgd_engine")
        for g in sd["param_groups"]:
            if isinstance(g.get("lr"), torch.Tensor):
                g["lr"] = float(g["lr"].item())
        if engine is not None and engine.grad_scaler is not None:
            sd["pygraph_dist"] = {"grad_scaler": engine.grad_scaler.state_dict()}
        return sd

    def load_state_dict(self, state_dict) -> None:
        extra = state_dict.get("pygraph_dist") if isinstance(state_dict, dict) else None
        super().load_state_dict(state_dict)  # type: ignore[misc]
        engine = self.__dict__.get("_pgd_engine")
        if engine is not None:
            engine.on_optimizer_state_loaded(extra)


_CLASSES: dict[type, type] = {}


def make_graph_aware(opt: torch.optim.Optimizer, engine) -> torch.optim.Optimizer:
    """Swap ``opt``'s class for its graph-aware subclass and attach ``engine``."""
    cls = type(opt)
    if not issubclass(cls, GraphedOptimizerMixin):
        if cls not in _CLASSES:
            _CLASSES[cls] = type(f"Graphed{cls.__name__}", (GraphedOptimizerMixin, cls), {})
        opt.__class__ = _CLASSES[cls]
    opt.__dict__["_pgd_engine"] = engine
    _repatch_scheduler_step(opt)
    return opt


def _repatch_scheduler_step(opt: torch.optim.Optimizer) -> None:
    """An LR scheduler created before wrap() put an instance-level ``step`` on the
    optimizer that calls the *original* class's step directly (torch's
    ``LRScheduler.__init__``: ``patch_track_step_called``). Left alone, every
    ``optimizer.step()`` would bypass the engine and step a second time."""
    patched = opt.__dict__.get("step")
    if patched is None or not getattr(patched, "_wrapped_by_lr_sched", False):
        return
    ref = weakref.ref(opt)

    def step(*args, **kwargs):
        o = ref()
        o._opt_called = True  # what the scheduler's wrapper records
        return type(o).step(o, *args, **kwargs)

    step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    opt.__dict__["step"] = step
