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
import weakref
from dataclasses import dataclass, field
from typing import Protocol

import torch

from ..loop.amp import AmpConfig
from ..loop.param_groups import watch_param_groups
from ..runtime import patches

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
        patches.mark_amp_scaling_step(opt)  # what fused=True sets in __init__

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


class StepOwner(Protocol):
    """What a graph-aware optimizer calls on the engine of its model
    (``engine.Engine``, a layer above): public attributes and methods only."""

    delegating_step: bool  # the engine's step is calling the optimizer's own step()
    grad_scaler: torch.amp.GradScaler | None  # amp="fp16": saved with the optimizer's state

    def optimizer_step(self, closure=None): ...

    def optimizer_zero_grad(self, set_to_none: bool = True) -> None: ...

    def on_optimizer_state_loaded(self, extra) -> None: ...


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


def make_graph_aware(opt: torch.optim.Optimizer, engine: StepOwner | None) -> torch.optim.Optimizer:
    """Swap ``opt``'s class for its graph-aware subclass and attach ``engine``
    (the :class:`StepOwner` its ``step()``, ``zero_grad()`` and state go through)."""
    cls = type(opt)
    if not issubclass(cls, GraphedOptimizerMixin):
        if cls not in _CLASSES:
            _CLASSES[cls] = type(f"Graphed{cls.__name__}", (GraphedOptimizerMixin, cls), {})
        patches.swap_class(opt, _CLASSES[cls], "optimizer.__class__")  # kept at shutdown: patches.py says why
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
