"""Wiring: the parts of a wrapped model, built and connected once, at ``wrap()``.

:meth:`EngineWiring._wire` runs first in :class:`Engine.__init__
<pygraph_dist.engine.engine.Engine>`: it checks the model and optimizer, makes the
optimizer capturable (:mod:`~pygraph_dist.step.optim`), decides whether graphs are
possible at all (:meth:`EngineWiring._why_no_graphs`), and builds the parts the
step uses — the reducer, the :class:`~pygraph_dist.step.step.IterationStep`, the
loop's state, the watchdog, the graph cache, the capture runner, tier 2's
graphs and routing, the probe, learned accumulation, evaluation graphs — each
given the parts and values it uses, none the engine itself (the optimizer and
the clip router reach it through Protocols of its public members:
``optim.StepOwner``, ``clip_route.ClipOwner``). The state of the step in
flight is ``Engine.__init__``'s own, passed to the parts per call.

:class:`EngineWiring` is a mixin of :class:`~pygraph_dist.engine.engine.Engine`; the
attribute names it sets are the ones the rest of the package reads.
"""

from __future__ import annotations

import logging
import os
import weakref

import torch
import torch.distributed as dist
from torch import nn

from ..graphs.graph_cache import GraphCache
from ..launch import agreement
from ..launch.backend import graph_safe_backend
from ..launch.watchdog import ReplayWatchdog
from ..loop.accumulation import LearnedAccumulation
from ..loop.amp import ensure_scale_initialised, make_grad_scaler, parse_amp
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
from ..step.optim import make_graph_aware, prepare_optimizer
from ..step.step import IterationStep, release_side_stream
from ..tiers.capture import GraphRunner
from ..tiers.evaluation import EvalGraphs
from ..tiers.split import SplitGraphs
from ..tiers.split_calls import Tier2Router
from ..tiers.split_clip import SplitClip
from .probe import Probe

logger = logging.getLogger("pygraph_dist")


class EngineWiring:
    """Builds and connects the engine's parts (mixed into ``Engine``)."""

    def _wire(
        self,
        module: nn.Module,
        optimizer: torch.optim.Optimizer,
        config: WrapConfig,
        group: dist.ProcessGroup | None,
    ) -> None:
        """Check the model and optimizer, and build every part; raises what
        ``wrap()`` raises for a model or optimizer it cannot take."""
        if not dist.is_initialized():
            raise RuntimeError(
                "pygraph_dist.wrap() needs a process group: call pygraph_dist.init() (or "
                "torch.distributed.init_process_group) first."
            )
        self.module = module
        self.optimizer = optimizer
        self.config = config
        self.group = group if group is not None else dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        self.world_size = dist.get_world_size(self.group)

        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        # Frozen now, so without a bucket: unfreezing one later is refused (_check_unfrozen).
        self._frozen_at_wrap = [(n, p) for n, p in module.named_parameters() if not p.requires_grad]
        module_ids = {id(p) for p in module.parameters()}
        foreign = [p for g in optimizer.param_groups for p in g["params"] if id(p) not in module_ids]
        if foreign:
            raise ValueError(
                f"the optimizer holds {len(foreign)} parameter(s) that are not parameters of the "
                "wrapped model; wrap the model that owns every optimized parameter."
            )
        devices = sorted({str(p.device) for _, p in named}) or ["cpu"]
        self.device = torch.device(devices[0])
        self.amp = parse_amp(config.amp, self.device.type)
        sparse = sparse_param_names(module, {n for n, _ in named})
        self.opt_plan = prepare_optimizer(optimizer, device=self.device, amp=self.amp,
                                          skip_nonfinite=config.skip_nonfinite, sparse=bool(sparse))
        self.graphs_reason = self._why_no_graphs(devices)
        self.graphs_possible = not self.graphs_reason and self.device.type == "cuda"

        grad_scaler = make_grad_scaler(self.device.type) if self.amp.needs_grad_scaler else None
        if grad_scaler is not None:
            ensure_scale_initialised(grad_scaler, self.device)
        if sparse:
            check_sparse_support(sparse, optimizer, self.amp, config)
        self.reducer = GradientReducer(named, self.group, config.bucket_cap_mb,
                                       sparse=sparse, eager=config.eager_params,
                                       comm_dtype=config.grad_comm_dtype)
        self.reducer.on_finalize = self._on_backward_finished
        self.step = IterationStep(
            module, optimizer, self.reducer, amp=self.amp, grad_scaler=grad_scaler,
            loss_fn=config.loss_fn, max_grad_norm=config.max_grad_norm, group=self.group,
            broadcast_buffers=config.broadcast_buffers, device=self.device,
            skip_nonfinite=config.skip_nonfinite)
        cuda = self.device.type == "cuda"
        self.agree_device = self.device if cuda else torch.device("cpu")
        if self.world_size > 1:  # before the first collective that needs the same model everywhere
            agreement.check_same_model(list(module.named_parameters()) + list(module.named_buffers()),
                                       self.reducer.buffers, group=self.group, device=self.agree_device)
        self.step.sync_module_states()
        # The side stream goes back to the pool at teardown, or when the engine
        # is garbage (its graphs go with it), never twice (step.acquire_side_stream).
        self._release_stream = (weakref.finalize(self, release_side_stream, self.step.stream)
                                if self.step.stream is not None else None)
        # torch.compile inside the graph (compiled.py): ours (compile=...) or the user's.
        self.compile_user = is_compiled(module)
        if config.compile is not None:
            self.step.call = torch.compile(module, **config.compile)  # the module itself stays as is
        self.compiled = config.compile is not None or self.compile_user
        self.ignored = IgnoredArgs(config.ignore_args, module)
        self.varying = VaryingScalars()
        self.compile_stats = CompileStats()
        if self.compiled:
            COMPILE_TIMER.install()
            if disable_donated_buffers():
                logger.info("torch._functorch.config.donated_buffer set to False: tier 2 captures the "
                            "compiled backward with retain_graph=True, which donated buffers forbid")
        make_graph_aware(optimizer, self)

        self.fp_backend = graph_safe_backend(self.group, "cuda") if cuda else None
        self.loop = LoopState(self.owned_storages, monitor=config.monitor)
        self.loop.scaled_loss_ok = grad_scaler is None  # amp="fp16": the scaler's seed, nothing else
        self.loop.param_ids = {id(p) for p in self.reducer.params}
        # Every parameter of the module, frozen ones too: clip_grad_norm_(model.parameters())
        # is routed to this engine (clip_route.py).
        self.clip_param_ids = frozenset(id(p) for p in module.parameters())
        clip_route.install()
        clip_route.remember(module)
        self.step.tuple_loss = config.monitor and grad_scaler is None
        timeout = config.replay_timeout
        if timeout is None:
            timeout = _group_timeout_s(self.group)
        self.watchdog = ReplayWatchdog(timeout if self.graphs_possible else 0)
        self.cache = GraphCache(rank=self.rank, max_graphs=config.max_graphs,
                                graph_memory_mb=config.graph_memory_mb,
                                pad_batch_to=config.pad_batch_to, pad_value=config.pad_value)
        self.runner = GraphRunner(self.step, self.reducer, self.cache, optimizer=optimizer,
                                  group=self.group, agree_device=self.agree_device,
                                  fp_backend=self.fp_backend, watchdog=self.watchdog,
                                  select=config.select, select_margin=config.select_margin)
        # autocast's bf16/fp16 -> fp32 gradient casts recorded as the widen
        # kernel (exact; kernels.WideningCasts). Not around compiled modules
        # (inductor makes its own casts; a dispatch mode must not meet dynamo);
        # PYGRAPH_DIST_FAST_CASTS=0 records torch's own copies.
        self.runner.watch_generators = not self.compiled
        self.runner.host_watch.enabled = self.graphs_possible and not self.compiled  # host_copies.py
        self.runner.widening = (self.graphs_possible and not self.compiled
                                and os.environ.get("PYGRAPH_DIST_FAST_CASTS", "1") != "0"
                                and kernels.widening_ready(self.device))
        self.split = SplitGraphs(self.runner, self.loop.backward_finished)
        # Adopted views leave a released graph's pool (not at teardown: nothing trains after it).
        self.cache.on_none_live = lambda: None if self.closed else self.reducer.restore_views()
        self.accum = LearnedAccumulation(
            self.reducer.params, reduce_now=_reduce_now(self.reducer, self.step, self.loop),
            group=self.group, device=self.agree_device, rank=self.rank, world_size=self.world_size,
            enabled=config.learn_accumulation)
        # tier 2: the loop's clip_grad_norm_ as a graph
        self.split_clip = SplitClip(self.step, self.runner, self.accum, clip_param_ids=self.clip_param_ids)
        self.reducer.on_views_moved = self.split_clip.release  # its graph read the old views
        self.probe = Probe(self.step, self.loop, self.runner, self.cache,
                           agree_device=self.agree_device, compiled=self.compiled,
                           graphs_possible=self.graphs_possible, graphs_reason=self.graphs_reason)
        self.tier2 = Tier2Router(self.split, self.step, self.loop, self.cache, self.runner, self.accum,
                                 user_forward=self.probe.user_forward,
                                 agree_device=self.agree_device, loss_graphs=config.loss_graphs)
        self.evals = EvalGraphs(module, self.step, self.cache, self.runner, enabled=config.eval_graphs,
                                graphs_possible=self.graphs_possible, graphs_reason=self.graphs_reason)
        # fast_lane.py: zero_grad in one C++ call.
        self._clear_grads = ClearGrads(optimizer, self.step.optimizer_class, self.reducer.watch,
                                       self.reducer.params)

        if self.opt_plan.changes and self.rank == 0:
            logger.info("optimizer %s reconfigured for capture: %s", self.step.optimizer_class.__name__,
                        ", ".join(self.opt_plan.changes))
        if self.opt_plan.sgd_float_lr and self.graphs_possible and self.rank == 0:
            logger.info("SGD's lr stays a float baked into the graphs (a change of lr captures again): %s",
                        self.opt_plan.sgd_float_lr)
        if self.graphs_reason and self.rank == 0:
            logger.info("graphs unavailable: %s", self.graphs_reason)

    def _why_no_graphs(self, devices: list[str]) -> str:
        """Why this model trains without graphs, the first reason found; "" if it can have them."""
        reasons = []
        if not self.config.graphs:
            reasons.append("graphs are disabled (wrap(..., graphs=False))")
        ok, why = graphs_available()
        if not ok:
            reasons.append(why)
        if len(devices) > 1:
            reasons.append(f"parameters span several devices ({', '.join(devices)})")
        elif self.device.type != "cuda" and ok:
            reasons.append(f"the model is on {self.device}, not on a CUDA device")
        if not self.opt_plan.graphable and self.device.type == "cuda" and len(devices) == 1:
            reasons.append(self.opt_plan.reason)
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
