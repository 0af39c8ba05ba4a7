"""The user's own ``torch.nn.utils.clip_grad_norm_`` inside the step graph.

The loop most scripts write clips between ``backward()`` and ``step()``::

    loss = model(x, y)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()

A whole-iteration graph (tier 1) has stepped at the model call already, so a
clip written there would come too late; before this module such a loop was
graphed per micro-batch (tier 2), its clipping eager between the graphs --
0.6 ms of host time at 18 parameter tensors, 5.5 ms at 500 (issue 26). Now:

* :func:`install` (at the first ``wrap()``) puts :func:`clip_grad_norm_` in
  place of ``torch.nn.utils.clip_grad_norm_`` (and ``torch.nn.utils.clip_grad``'s);
  ``pgd.shutdown()`` puts torch's back (``patches.py``, entry ``clip_grad_norm_``).
  For parameters that are not a wrapped model's it calls torch's, unchanged.
* During the probe (the loop as written), a clip over *all* of a wrapped
  model's trainable parameters, norm 2, with nothing else unusual, runs as
  written and is recorded instead of counting as a change of gradients. If
  the rest of the loop conforms, the ranks agree on it with the verdict and
  the step clips inside the graph (:func:`clip_in_spans`): torch's norm over
  the parameters in the order the call passed them, with its ``max_norm`` and
  ``foreach``, and the multiply over the buckets' spans -- the same value for
  every element, so graphed training stays bitwise equal to ``graphs=False``.
* In an iteration the engine ran (tier 1), the call returns what torch's
  would: the total norm before clipping, computed by the step that already
  ran. A different ``max_norm``, parameter list or norm then is a changed
  loop (:class:`~pygraph_dist.loop.conformance.LoopConformanceError`, with the fix).
* Where the loop runs as written (eager, evaluation), torch's runs. In a
  tier-2 step the same call is captured as a graph of its own and replayed
  (:mod:`~pygraph_dist.tiers.split_clip`).

``clip_grad_norm_(model.parameters(), ...)`` builds the parameter list anew
every step: 1.2-1.5 ms of host time at 500 parameter tensors (``nn.Module``'s
recursive generator), paid with DDP too. For a wrapped model (or its wrapper)
the router does not run that generator: :func:`parameters_of` recognises a
``Module.parameters()`` generator not yet started and hands out the tuple read
the first time, read again after torch's global registration hooks saw a
parameter or submodule registered anywhere (``setattr``, ``register_parameter``,
``add_module``, ``load_state_dict(assign=True)``) or the engine saw a
parameter's storage change. What torch has no hook for (``del``,
``ModuleList.insert``, ``bias = None``) is not seen: docs/limits.md.

``from torch.nn.utils import clip_grad_norm_`` executed before ``wrap()`` binds
torch's function to a name of the script's own (or of a helper module it
imported). At every ``wrap()``, :func:`install` also rebinds such names --
every module global that *is* torch's function, outside torch and
pygraph_dist, and the globals of the functions on the stack that called
``wrap()`` -- to :func:`clip_grad_norm_`, which is torch's for every parameter
no wrapped model owns. A module imported after ``wrap()`` gets the router from
``torch.nn.utils`` itself. Only a reference kept elsewhere (an attribute, a
default argument, a closure) stays torch's: the monitor then sees its
gradient writes as changes of the loop, with a reason that names the line.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import operator
import os
import types
import zlib
from typing import Protocol

import torch

from ..launch import lifetime
from ..loop.conformance import LoopState
from ..reduce.bucket_comm import copy_plan
from ..runtime import patches

class ClipOwner(Protocol):
    """What routing a clip reads of the engine that owns the parameters
    (``engine.Engine``, a layer above): public attributes and methods only."""

    closed: bool  # torn down: the clip is torch's again
    clip_param_ids: frozenset[int]  # every parameter of the model, frozen ones too
    loop: LoopState  # where the loop stands in the step, and what the probe saw
    step: object  # its IterationStep (step.py, which imports this module): routed_clip, routable()'s reads
    split_clip: object  # tier 2's SplitClip (a layer above): call(params, ...) -> the norm, or None

    @property
    def in_tier2_step(self) -> bool:
        """This step's model calls replayed tier 2's forward graphs."""

    def probing(self) -> bool:
        """A probe iteration: the loop runs as written."""

    def grad_norm_after_step(self) -> torch.Tensor:
        """The norm the step that already ran (tier 1) clipped with."""


# torch's functions, as they were before install(); the step calls these.
ORIGINAL = patches.TORCH_CLIP_GRAD_NORM
_TOTAL_NORM = getattr(torch.nn.utils, "get_total_norm", None)  # torch >= 2.6


def clip_in_spans(params, max_norm: float, foreach: bool | None = None, *, spans: bool | None = None) -> torch.Tensor:
    """torch's ``clip_grad_norm_(params, max_norm, 2.0, foreach=foreach)``, with the
    multiplication by the clip coefficient run over flat spans of the gradient
    buckets instead of tensor by tensor; what the step graphs clip with.

    The norm is torch's own (``get_total_norm``, the same kernels and order), and
    so is the coefficient (``max_norm / (norm + 1e-6)`` clamped to 1). Each
    gradient element is then multiplied by that one float32 number, which gives
    the same bits whichever kernel does it; but the foreach kernel packs at most
    ~110 tensors into a launch, one block per 64K elements, and leaves most of the
    GPU idle on models with a few hundred large tensors (96 us against ~42 for
    the same 64 MB as a few long tensors; issue 26, session 43). Gradients that
    sit back to back in a bucket (``copy_plan``) go to the same kernel as one
    tensor, the rest as they are.

    ``spans`` None: only while a CUDA graph is being captured, where finding the
    spans (1.8 ms at 502 gradients on a slow host) is paid once; an eager step runs
    torch's function, the same values. Anything but plain float32 strided
    gradients on one device runs torch's function too."""
    params = [params] if isinstance(params, torch.Tensor) else list(params)
    grads = [p.grad for p in params if p.grad is not None]
    if spans is None:
        spans = bool(grads) and grads[0].is_cuda and torch.cuda.is_current_stream_capturing()
    # PYGRAPH_DIST_CLIP_SPANS=0 (A/B in benchmarks): torch's multiply, tensor by tensor.
    if (not spans or os.environ.get("PYGRAPH_DIST_CLIP_SPANS") == "0" or _TOTAL_NORM is None or len(grads) < 2
            or any(type(g) is not torch.Tensor or g.layout != torch.strided or g.dtype != torch.float32
                   or g.device != grads[0].device for g in grads)):
        return ORIGINAL(params, max_norm, 2.0, error_if_nonfinite=False, foreach=foreach)
    with torch.no_grad():
        norm = _TOTAL_NORM(grads, 2.0, False, foreach)
        coef = torch.clamp(float(max_norm) / (norm + 1e-6), max=1.0)  # torch's expression, its kernels
        runs, rest = copy_plan(grads)
        tensors = [span for span, _ in runs] + [grads[k] for k in rest]
        if foreach is False:
            for t in tensors:
                t.mul_(coef)
        else:  # torch's foreach kernel (vectorised; an elementwise one would broadcast coef)
            torch._foreach_mul_(tensors, coef)
    return norm


@dataclasses.dataclass(frozen=True)
class ClipPlan:
    """A clip the step applies: torch's ``clip_grad_norm_(params, max_norm, 2.0,
    foreach=foreach)``. ``params`` None: the reducer's (wrap(max_grad_norm=...))."""

    max_norm: float
    params: tuple | None = None
    foreach: bool | None = None

    def same_call(self, params: list, max_norm, norm_type, error_if_nonfinite, foreach) -> bool:
        numbers = isinstance(max_norm, (int, float)) and not isinstance(max_norm, bool)  # a tensor divides otherwise
        return (numbers and float(max_norm) == self.max_norm and float(norm_type) == 2.0 and not error_if_nonfinite
                and foreach == self.foreach and self.params is not None
                and (params is self.params  # the cached model.parameters() (parameters_of)
                     or (len(params) == len(self.params) and all(map(operator.is_, params, self.params)))))

    def same(self, other: "ClipPlan") -> bool:
        return other.same_call(list(self.params or ()), self.max_norm, 2.0, False, self.foreach)

    def digest(self) -> int:
        """Equal on ranks that clip alike (the agreement's digest)."""
        return zlib.crc32(repr((self.max_norm, self.foreach, len(self.params or ()))).encode())

    def describe(self) -> str:
        return f"clip_grad_norm_(max_norm={self.max_norm:g}) inside the step graph"


def install() -> None:
    """Put :func:`clip_grad_norm_` in place of torch's (once), and in place of
    the names the calling script bound to torch's function (every call); the
    rebinding itself is ``patches.route_clip_grad_norm`` (undone at ``pgd.shutdown()``)."""
    patches.route_clip_grad_norm(clip_grad_norm_)


_own = patches.own_package  # the packages whose names install() leaves alone


def rebind(spaces: list[dict]) -> list[str]:
    """Every global of ``spaces`` that is torch's ``clip_grad_norm_`` becomes the
    router; returns the names. ``uninstall`` binds them back."""
    return patches.rebind_clip_names(spaces, clip_grad_norm_)


# ------------------------------------------------ model.parameters(), cached
_PARAMETERS_CODE = torch.nn.Module.parameters.__code__
_structure = [0]  # bumped when any module registers a parameter or a submodule
_CACHE = "_pgd_parameters"  # in a remembered module's __dict__: (structure, parameters)
_hooks: list = []


def structure_changed(*_args) -> None:
    """The cached parameter tuples are read again at their next use: torch's
    global registration hooks call this when a parameter or submodule is set
    anywhere, and the engine when a parameter's storage or requires_grad
    drifted. Returns None (as a hook: the registration is unchanged)."""
    _structure[0] += 1


def remember(module: torch.nn.Module) -> None:
    """``module.parameters()`` passed to the clip is read once per structure
    (:func:`parameters_of`): a wrapped model and its wrapper. The cache lives in
    the module's own ``__dict__`` (found by identity, collected with it)."""
    if not _hooks:
        from torch.nn.modules import module as torch_module

        _hooks.append(torch_module.register_module_parameter_registration_hook(structure_changed))
        _hooks.append(torch_module.register_module_module_registration_hook(structure_changed))
    module.__dict__.setdefault(_CACHE, (-1, ()))


def parameters_of(parameters) -> tuple | None:
    """The parameters a ``module.parameters()`` generator would yield, for a
    remembered module, without running it -- or None (anything else: a list, a
    generator already started, ``recurse=False``, another module's). The tuple
    is read from the generator itself the first time and after
    :func:`structure_changed`; on a cached answer the generator is closed, as
    torch's clip would have used it up (a generator kept and passed again is
    empty, as with torch). Changes torch has no hook for are not seen: ``del``
    of a parameter or submodule, ``ModuleList.insert``/``Sequential.insert``,
    ``module.bias = None``, writes into ``module._parameters`` (docs/limits.md)."""
    if type(parameters) is not types.GeneratorType or parameters.gi_code is not _PARAMETERS_CODE:
        return None
    frame = parameters.gi_frame
    if frame is None or parameters.gi_suspended or parameters.gi_running:  # started or done
        return None
    local = frame.f_locals
    if local.get("recurse") is not True:
        return None
    module = local.get("self")
    if _CACHE not in getattr(module, "__dict__", {}):  # not remembered
        return None
    params = cached_parameters(module)
    if params is not None:
        parameters.close()
        return params
    params = tuple(parameters)
    module.__dict__[_CACHE] = (_structure[0], params)
    return params


def cached_parameters(module) -> tuple | None:
    """The tuple :func:`parameters_of` hands out for ``module.parameters()``
    while it is current (no :func:`structure_changed` since it was read), else None."""
    cached = getattr(module, "__dict__", {}).get(_CACHE)
    return cached[1] if cached is not None and cached[0] == _structure[0] else None


def uninstall() -> None:
    """Give torch its function back (tests), also to the names :func:`install` rebound."""
    patches.undo("clip_grad_norm_")


@functools.wraps(ORIGINAL)
def clip_grad_norm_(parameters, max_norm, norm_type=2.0, error_if_nonfinite=False, foreach=None):
    # torch's clip_grad_norm_ (its docstring, through functools.wraps); for a
    # wrapped model's parameters, routed by its engine (module docstring).
    params = parameters_of(parameters)  # model.parameters() of a wrapped model: cached
    if params is None:
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    engine = _engine_of(params)
    if engine is None:  # torch's, as called: a generator stays one (torch warns when it is empty)
        given = (p for p in params) if isinstance(parameters, types.GeneratorType) else params
        return ORIGINAL(given, max_norm, norm_type, error_if_nonfinite=error_if_nonfinite, foreach=foreach)
    return route(engine, params, max_norm, norm_type, error_if_nonfinite, foreach)


def _engine_of(params: list) -> ClipOwner | None:
    """The live engine whose model any of ``params`` belongs to (the first
    parameter's, at once, for the usual model.parameters())."""
    if not params:
        return None
    engines = [e for e in lifetime.live_engines()
               if not e.closed and getattr(e, "clip_param_ids", None) is not None]
    first = id(params[0])
    for engine in engines:
        if first in engine.clip_param_ids:
            return engine
    for engine in engines:
        ids = engine.clip_param_ids
        if any(id(p) in ids for p in params):
            return engine
    return None


def routable(step, clip_param_ids: frozenset[int], params: list, max_norm, norm_type, error_if_nonfinite,
             foreach) -> str:
    """Why this call cannot move into the step graph ("" when it can). ``step``:
    the model's :class:`~pygraph_dist.step.step.IterationStep` (its clip, scaler,
    sparse parameters and reducer); ``clip_param_ids``: every parameter of the model."""
    if step.max_grad_norm is not None:
        return "wrap(max_grad_norm=...) clips inside the step already"
    if step.grad_scaler is not None:
        return "amp='fp16' scales the gradients until the step unscales them"
    numbers = (int, float)
    if not (isinstance(max_norm, numbers) and isinstance(norm_type, numbers)) or isinstance(max_norm, bool):
        # A tensor max_norm divides as a tensor (other kernels than a float's)
        # and would be read on the host every step to check it.
        return "max_norm or norm_type is not a Python number"
    norm, limit = float(norm_type), float(max_norm)
    if norm != 2.0:
        return f"norm_type={norm_type} (the step clips with norm 2)"
    if math.isnan(limit) or limit <= 0:
        # max_norm=inf stays: a norm only (Trainer's max_grad_norm=0 logs it so), the
        # gradients multiplied by 1.0 in the graph as eagerly, bitwise.
        return f"max_norm={max_norm}"
    if error_if_nonfinite:
        return "error_if_nonfinite=True reads the norm on the host"
    if step.sparse_ids:
        return "the model has sparse gradients (stepped eagerly, outside the graph)"
    ids = clip_param_ids
    if not all(id(p) in ids for p in params):
        return "the parameters include some of another model"
    passed = {id(p) for p in params}
    if len(passed) != len(params):
        return "a parameter is passed twice"
    if not all(id(p) in passed for p in step.reducer.params if p.requires_grad):
        return "the call clips part of the model's trainable parameters"
    return ""


def route(engine: ClipOwner, params: list, max_norm, norm_type, error_if_nonfinite, foreach):
    """The call for a wrapped model's parameters (:func:`clip_grad_norm_`, for its engine)."""
    loop = engine.loop
    plan = engine.step.routed_clip
    # The engine ran this iteration: its step (and the clip in it) already
    # happened. After optimizer.step() (a norm logged after the step, say) the
    # call is the loop's own again, as in eager training.
    if loop.owned and loop.in_step():
        loop.clip_calls += 1
        after_backward = loop.stage_after_backward()
        if plan is not None and loop.clip_calls == 1 and after_backward and plan.same_call(
                params, max_norm, norm_type, error_if_nonfinite, foreach):
            with torch._C.DisableTorchFunction():  # the norm's copy is ours, not the loop's: unwatched
                return engine.grad_norm_after_step()
        what = (f"clip_grad_norm_(max_norm={max_norm}) was called twice in one step" if loop.clip_calls > 1
                else f"clip_grad_norm_(max_norm={max_norm}, norm_type={norm_type}) in a loop whose graph "
                     "was captured without it" if plan is None
                else f"clip_grad_norm_(max_norm={max_norm}) before loss.backward()" if not after_backward
                else f"clip_grad_norm_(max_norm={max_norm}, norm_type={norm_type}) differs from the call "
                     f"the graph clips like ({plan.describe()}, the same parameters, norm 2)")
        loop.violation(what, "The graph clips as the probe iterations did. Keep the clipping call the "
                             "same in every iteration, or wrap(..., graphs=False).")
    if engine.probing() and loop.stage_after_backward():
        why = routable(engine.step, engine.clip_param_ids, params, max_norm, norm_type, error_if_nonfinite,
                       foreach)
        if not why:
            loop.clip_seen(ClipPlan(float(max_norm), tuple(params), foreach))
        else:
            loop.violation(f"clip_grad_norm_() between loss.backward() and optimizer.step() cannot move "
                           f"into the step graph: {why}",
                           "Clip all of the model's parameters (model.parameters()) with norm 2 and a "
                           "positive max_norm, or pass wrap(..., max_grad_norm=...) and drop the call, "
                           "to have the whole iteration graphed. This loop is graphed per micro-batch "
                           "(tier 2), the clipping between the graphs.",
                           split_ok=True)
        with loop.unwatched():  # judged here, not by its writes to the gradients
            return ORIGINAL(params, max_norm, norm_type, error_if_nonfinite=error_if_nonfinite,
                            foreach=foreach)
    if engine.in_tier2_step:  # tier 2: this step's model calls replayed graphs
        norm = engine.split_clip.call(params, max_norm, norm_type, error_if_nonfinite, foreach)
        if norm is not None:  # split_clip.py: the same call as a graph of its own
            return norm
    return ORIGINAL(params, max_norm, norm_type, error_if_nonfinite=error_if_nonfinite, foreach=foreach)


def probe_plan(loop) -> tuple[ClipPlan | None, str]:
    """The clip the probe steps so far agree on, and "" -- or None and why not."""
    plans = loop.clip_probe
    first = plans[0] if plans else None
    for p in plans[1:]:
        if (p is None) != (first is None) or (p is not None and not p.same(first)):
            return None, "clip_grad_norm_() was called differently (or not at all) in some probe iterations"
    return first, ""
