"""Wiring: the parts of a wrapped model, built and connected once, at ``wrap()``.

:func:`build_parts` runs first in :class:`Engine.__init__
<pygraph_dist.engine.engine.Engine>`: it checks the model and optimizer, makes the
optimizer capturable (:mod:`~pygraph_dist.step.optim`), decides whether graphs are
possible at all (:func:`_why_no_graphs`), and builds the parts the step uses —
the reducer, the :class:`~pygraph_dist.step.step.IterationStep`, the loop's
state, the watchdog, the graph cache, the capture runner, tier 2's graphs and
routing, the probe, learned accumulation, evaluation graphs — each given the
parts and values it uses, none the engine itself. It returns them, with the
facts decided at wrap time (device, AMP, the optimizer's plan, why no graphs),
as :class:`EngineParts`; the engine holds each under the field's name.

The builder reads nothing of the engine. It is given the engine as ``owner``
only where the engine itself is what is attached: the graph-aware optimizer's
:class:`~pygraph_dist.step.optim.StepOwner` (its public members), the
lifetime the side stream's release follows (``weakref.finalize``), and
``owned_storages`` for the loop's monitor. The callbacks that read the
engine's own state (the reducer's ``on_finalize``, the cache's
``on_none_live``) are connected by ``Engine.__init__``; the state of the step
in flight is the engine's, passed to the parts per call.
"""

from __future__ import annotations

import logging
import os
import weakref
from dataclasses import dataclass, fields
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from ..graphs.graph_cache import GraphCache
from ..launch import agreement
from ..launch.backend import graph_safe_backend
from ..launch.watchdog import ReplayWatchdog
from ..loop.accumulation import LearnedAccumulation
from ..loop.amp import AmpConfig, ensure_scale_initialised, make_grad_scaler, parse_amp
from ..loop.arguments import IgnoredArgs, VaryingScalars
from ..loop.compiled import CompileStats, disable_donated_buffers, is_compiled
from ..loop.compiled import TIMER as COMPILE_TIMER
from ..loop.config import WrapConfig, check_sparse_support, sparse_param_names
from ..loop.conformance import LoopState
from ..loop.fast_lane import ClearGrads
from ..reduce.reducer import GradientReducer
from ..runtime import kernels, patches
from ..runtime._ext import graphs_available
from ..step import clip_route
from ..step.optim import OptimizerPlan, StepOwner, make_graph_aware, prepare_optimizer
from ..step.step import IterationStep, release_side_stream
from ..tiers.capture import GraphRunner
from ..tiers.evaluation import EvalGraphs
from ..tiers.split import SplitGraphs
from ..tiers.split_calls import Tier2Router
from ..tiers.split_clip import SplitClip
from .probe import Probe

logger = logging.getLogger("pygraph_dist")


@dataclass(slots=True)
class EngineParts:
    """What :func:`build_parts` returns: the wrap-time facts and the parts, one
    field per attribute of the engine of the same name (``frozen_at_wrap``,
    ``release_stream`` and ``clear_grads`` are the engine's private
    ``_frozen_at_wrap``, ``_release_stream`` and ``_clear_grads``)."""

    # what wrap() was given, and where the model is
    module: nn.Module
    optimizer: torch.optim.Optimizer
    config: WrapConfig
    group: dist.ProcessGroup
    rank: int
    world_size: int
    device: torch.device
    agree_device: torch.device  # where agreement's collectives run: the device, or the CPU
    frozen_at_wrap: list  # (name, parameter) frozen at wrap(): unfreezing one is refused
    # what was decided at wrap time
    amp: AmpConfig
    opt_plan: OptimizerPlan
    graphs_reason: str
    graphs_possible: bool
    compile_user: bool  # the user compiled the module
    compiled: bool  # torch.compile inside the graph, the user's or wrap(compile=...)'s
    fp_backend: object | None  # the graph-safe backend (fingerprints), None with a stock one
    clip_param_ids: frozenset
    # the parts
    reducer: GradientReducer
    step: IterationStep
    release_stream: weakref.finalize | None
    ignored: IgnoredArgs
    varying: VaryingScalars
    compile_stats: CompileStats
    loop: LoopState
    watchdog: ReplayWatchdog
    cache: GraphCache
    runner: GraphRunner
    split: SplitGraphs
    accum: LearnedAccumulation
    split_clip: SplitClip
    probe: Probe
    tier2: Tier2Router
    evals: EvalGraphs
    clear_grads: ClearGrads

    def engine_attributes(self):
        """(the engine's attribute name, value) for every field: the field's name,
        with ``_`` in front for the three the engine keeps private."""
        for f in fields(self):
            yield ("_" if f.name in ENGINE_PRIVATE else "") + f.name, getattr(self, f.name)


ENGINE_PRIVATE = frozenset({"frozen_at_wrap", "release_stream", "clear_grads"})


def build_parts(
    module: nn.Module,
    optimizer: torch.optim.Optimizer,
    config: WrapConfig,
    group: dist.ProcessGroup | None,
    *,
    owner: StepOwner,
    owned_storages: Callable[[], set[int]],
) -> EngineParts:
    """Check the model and optimizer, and build every part; raises what
    ``wrap()`` raises for a model or optimizer it cannot take.

    ``owner`` (the engine) becomes the optimizer's :class:`StepOwner`, and the
    side stream goes back to the pool when it is garbage; ``owned_storages``
    is the loop monitor's. Nothing of ``owner`` is read here."""
    if not dist.is_initialized():
        raise RuntimeError(
            "pygraph_dist.wrap() needs a process group: call pygraph_dist.init() (or "
            "torch.distributed.init_process_group) first."
        )
    group = group if group is not None else dist.group.WORLD
    rank = dist.get_rank(group)
    world_size = dist.get_world_size(group)

    named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    # Frozen now, so without a bucket: unfreezing one later is refused (_check_unfrozen).
    frozen_at_wrap = [(n, p) for n, p in module.named_parameters() if not p.requires_grad]
    module_ids = {id(p) for p in module.parameters()}
    foreign = [p for g in optimizer.param_groups for p in g["params"] if id(p) not in module_ids]
    if foreign:
        raise ValueError(
            f"the optimizer holds {len(foreign)} parameter(s) that are not parameters of the "
            "wrapped model; wrap the model that owns every optimized parameter."
        )
    devices = sorted({str(p.device) for _, p in named}) or ["cpu"]
    device = torch.device(devices[0])
    amp = parse_amp(config.amp, device.type)
    sparse = sparse_param_names(module, {n for n, _ in named})
    opt_plan = prepare_optimizer(optimizer, device=device, amp=amp,
                                 skip_nonfinite=config.skip_nonfinite, sparse=bool(sparse))
    graphs_reason = _why_no_graphs(config, devices, device, opt_plan)
    graphs_possible = not graphs_reason and device.type == "cuda"

    grad_scaler = make_grad_scaler(device.type) if amp.needs_grad_scaler else None
    if grad_scaler is not None:
        ensure_scale_initialised(grad_scaler, device)
    if sparse:
        check_sparse_support(sparse, optimizer, amp, config)
    reducer = GradientReducer(named, group, config.bucket_cap_mb,
                              sparse=sparse, eager=config.eager_params,
                              comm_dtype=config.grad_comm_dtype)
    step = IterationStep(
        module, optimizer, reducer, amp=amp, grad_scaler=grad_scaler,
        loss_fn=config.loss_fn, max_grad_norm=config.max_grad_norm, group=group,
        broadcast_buffers=config.broadcast_buffers, device=device,
        skip_nonfinite=config.skip_nonfinite)
    cuda = device.type == "cuda"
    agree_device = device if cuda else torch.device("cpu")
    if world_size > 1:  # before the first collective that needs the same model everywhere
        agreement.check_same_model(list(module.named_parameters()) + list(module.named_buffers()),
                                   reducer.buffers, group=group, device=agree_device)
    step.sync_module_states()
    # The side stream goes back to the pool at teardown, or when the engine
    # is garbage (its graphs go with it), never twice (step.acquire_side_stream).
    release_stream = (weakref.finalize(owner, release_side_stream, step.stream)
                      if step.stream is not None else None)
    # torch.compile inside the graph (compiled.py): ours (compile=...) or the user's.
    compile_user = is_compiled(module)
    if config.compile is not None:
        step.call = torch.compile(module, **config.compile)  # the module itself stays as is
    compiled = config.compile is not None or compile_user
    ignored = IgnoredArgs(config.ignore_args, module)
    varying = VaryingScalars()
    compile_stats = CompileStats()
    if compiled:
        COMPILE_TIMER.install()
        if disable_donated_buffers():
            logger.info("torch._functorch.config.donated_buffer set to False: tier 2 captures the "
                        "compiled backward with retain_graph=True, which donated buffers forbid")
    make_graph_aware(optimizer, owner)

    fp_backend = graph_safe_backend(group, "cuda") if cuda else None
    loop = LoopState(owned_storages, monitor=config.monitor)
    loop.scaled_loss_ok = grad_scaler is None  # amp="fp16": the scaler's seed, nothing else
    loop.param_ids = {id(p) for p in reducer.params}
    # Every parameter of the module, frozen ones too: clip_grad_norm_(model.parameters())
    # is routed to this engine (clip_route.py).
    clip_param_ids = frozenset(id(p) for p in module.parameters())
    clip_route.install()
    clip_route.remember(module)
    step.tuple_loss = config.monitor and grad_scaler is None
    timeout = config.replay_timeout
    if timeout is None:
        timeout = _group_timeout_s(group)
    # Ctrl-C while a replay waits for a peer that took it a step earlier: the
    # watchdog aborts this group (watchdog.py, interrupt_group)
    watchdog = ReplayWatchdog(timeout if graphs_possible else 0, interrupt_group=group if cuda else None)
    cache = GraphCache(rank=rank, max_graphs=config.max_graphs,
                       graph_memory_mb=config.graph_memory_mb,
                       pad_batch_to=config.pad_batch_to, pad_value=config.pad_value)
    runner = GraphRunner(step, reducer, cache, optimizer=optimizer,
                         group=group, agree_device=agree_device,
                         fp_backend=fp_backend, watchdog=watchdog,
                         select=config.select, select_margin=config.select_margin)
    # autocast's bf16/fp16 -> fp32 gradient casts recorded as the widen
    # kernel (exact; kernels.WideningCasts). Not around compiled modules
    # (inductor makes its own casts; a dispatch mode must not meet dynamo);
    # PYGRAPH_DIST_FAST_CASTS=0 records torch's own copies.
    runner.watch_generators = not compiled
    runner.host_watch.enabled = graphs_possible and not compiled  # host_copies.py
    runner.widening = (graphs_possible and not compiled
                       and os.environ.get("PYGRAPH_DIST_FAST_CASTS", "1") != "0"
                       and kernels.widening_ready(device))
    split = SplitGraphs(runner, loop.backward_finished)
    accum = LearnedAccumulation(
        reducer.params, reduce_now=_reduce_now(reducer, step, loop),
        group=group, device=agree_device, rank=rank, world_size=world_size,
        enabled=config.learn_accumulation)
    # tier 2: the loop's clip_grad_norm_ as a graph
    split_clip = SplitClip(step, runner, accum, clip_param_ids=clip_param_ids)
    reducer.on_views_moved = split_clip.release  # its graph read the old views
    probe = Probe(step, loop, runner, cache,
                  agree_device=agree_device, compiled=compiled,
                  graphs_possible=graphs_possible, graphs_reason=graphs_reason)
    tier2 = Tier2Router(split, step, loop, cache, runner, accum,
                        user_forward=probe.user_forward,
                        agree_device=agree_device, loss_graphs=config.loss_graphs)
    evals = EvalGraphs(module, step, cache, runner, enabled=config.eval_graphs,
                       graphs_possible=graphs_possible, graphs_reason=graphs_reason)
    # fast_lane.py: zero_grad in one C++ call.
    clear_grads = ClearGrads(optimizer, step.optimizer_class, reducer.watch, reducer.params)

    if opt_plan.changes and rank == 0:
        logger.info("optimizer %s reconfigured for capture: %s", step.optimizer_class.__name__,
                    ", ".join(opt_plan.changes))
    if opt_plan.sgd_float_lr and graphs_possible and rank == 0:
        logger.info("SGD's lr stays a float baked into the graphs (a change of lr captures again): %s",
                    opt_plan.sgd_float_lr)
    if graphs_reason and rank == 0:
        logger.info("graphs unavailable: %s", graphs_reason)
    return EngineParts(
        module=module, optimizer=optimizer, config=config, group=group, rank=rank,
        world_size=world_size, device=device, agree_device=agree_device, frozen_at_wrap=frozen_at_wrap,
        amp=amp, opt_plan=opt_plan, graphs_reason=graphs_reason, graphs_possible=graphs_possible,
        compile_user=compile_user, compiled=compiled, fp_backend=fp_backend, clip_param_ids=clip_param_ids,
        reducer=reducer, step=step, release_stream=release_stream, ignored=ignored, varying=varying,
        compile_stats=compile_stats, loop=loop, watchdog=watchdog, cache=cache, runner=runner, split=split,
        accum=accum, split_clip=split_clip, probe=probe, tier2=tier2, evals=evals, clear_grads=clear_grads)


def _why_no_graphs(config: WrapConfig, devices: list[str], device: torch.device, opt_plan: OptimizerPlan) -> str:
    """Why this model trains without graphs, the first reason found; "" if it can have them."""
    reasons = []
    if not config.graphs:
        reasons.append("graphs are disabled (wrap(..., graphs=False))")
    ok, why = graphs_available()
    if not ok:
        reasons.append(why)
    if len(devices) > 1:
        reasons.append(f"parameters span several devices ({', '.join(devices)})")
    elif device.type != "cuda" and ok:
        reasons.append(f"the model is on {device}, not on a CUDA device")
    if not opt_plan.graphable and device.type == "cuda" and len(devices) == 1:
        reasons.append(opt_plan.reason)
    return reasons[0] if reasons else ""


def _reduce_now(reducer: GradientReducer, step: IterationStep, loop: LoopState):
    """Learned accumulation's eager reduction of the pending local sums: on the
    compute stream, and not seen by the loop's monitor (accumulation.py)."""

    def reduce_now() -> None:
        with loop.unwatched(), step.on_compute_stream():
            reducer.reduce_now()

    return reduce_now


def _group_timeout_s(group) -> float:
    """The collective timeout the process group was created with (what init() was
    given), for the replay watchdog; torch keeps it on the group's backend options."""
    try:
        timeout = patches.backend_timeout_s(
            patches.group_backend(group, torch.device("cuda" if torch.cuda.is_available() else "cpu")))
        if timeout is not None:
            return timeout
    except (RuntimeError, AttributeError, ValueError):  # PrivateAPIMissing is a RuntimeError
        pass
    from ..launch import launch_env

    return launch_env.last_timeout_s()
