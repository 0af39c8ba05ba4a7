"""The engine's :class:`~pygraph_dist.reports.reporting.ModelReport`: what one
wrapped model decided and ran, as ``report()`` shows it.

:func:`describe_model` builds it from the parts and wrap-time facts it reads,
passed by name (``Engine.describe`` passes its own). Nothing here runs per
step, and nothing holds the engine. Callers: ``Engine.describe``, hence
``report()`` (:mod:`~pygraph_dist.reports.reporting`), the Lightning strategy
and the tests.
"""

from __future__ import annotations

from dataclasses import asdict

import torch
from torch import nn

from ..graphs.graph_cache import GraphCache
from ..loop.accumulation import LearnedAccumulation
from ..loop.amp import AmpConfig
from ..loop.compiled import CompileStats
from ..loop.compiled import describe as describe_compile
from ..loop.config import WrapConfig
from ..loop.conformance import LoopState
from ..reduce.reducer import GradientReducer
from ..reports.model_notes import capture_divergences
from ..reports.reporting import ModelReport
from ..step.optim import OptimizerPlan
from ..step.step import IterationStep
from ..tiers.capture import GraphRunner
from ..tiers.split import SplitGraphs
from ..tiers.split_clip import SplitClip
from .probe import Probe


def describe_model(
    *,
    module: nn.Module,
    rank: int,
    world_size: int,
    device: torch.device,
    config: WrapConfig,
    amp: AmpConfig,
    opt_plan: OptimizerPlan,
    graphs_possible: bool,
    graphs_reason: str,
    fp_backend,
    compile_stats: CompileStats,
    compile_user: bool,
    loop: LoopState,
    step: IterationStep,
    reducer: GradientReducer,
    cache: GraphCache,
    runner: GraphRunner,
    split: SplitGraphs,
    split_clip: SplitClip,
    accum: LearnedAccumulation,
    probe: Probe,
) -> ModelReport:
    """This model's :class:`~pygraph_dist.reports.reporting.ModelReport`."""
    tier2 = ""
    if loop.verdict:
        loop_text = f"not graphable: {loop.verdict}"
    elif loop.probe_done and loop.split_reason:
        # What the check found; what ran is the signatures' (report.summarize).
        clip = tier2 = "; ".join(d for d in (split.describe_lane(), split_clip.describe()) if d)
        loop_text = (f"fits tier 2 (graphs per micro-batch, your code between them{'; ' + clip if clip else ''}); "
                     f"not tier 1 because: {loop.split_reason}")
    elif loop.probe_done:
        loop_text = f"conforms (checked over {config.probe} probe iterations)"
        if step.routed_clip is not None and graphs_possible:
            loop_text += f"; your {step.routed_clip.describe()}"
    else:
        loop_text = "not checked yet"
    stock = device.type == "cuda" and fp_backend is None and graphs_possible
    backend = "graph-safe (pgd_nccl, fingerprints on)" if fp_backend is not None else (
        "stock (collective fingerprints off)" if device.type == "cuda" else "cpu")
    graphs = cache.describe(reducer.kinds)
    graphs_replayed = any(g.replays for g in graphs if g.tier != "eval")
    return ModelReport(
        model=type(module).__name__, rank=rank, world_size=world_size,
        graphs_possible=graphs_possible, graphs_reason=graphs_reason, loop=loop_text,
        amp=amp.name + (" (fp32 casts in graphs: Triton)" if runner.widening
                        and amp.enabled else ""),
        optimizer=step.optimizer_class.__name__,
        optimizer_changes=list(opt_plan.changes), buckets=reducer.describe(),
        backend=backend, eager_buckets=reducer.describe_eager(),
        graphs=graphs,
        skipped_steps=int(step.skipped.item()) if step.skipped is not None else None,
        compile=describe_compile(config.compile, compile_stats, compile_user),
        events=[asdict(e) for e in cache.events],
        accumulation=accum.describe(), stock_backend=stock,
        tier1_needs=loop.split_reason if loop.probe_done else "",
        inner_autocast=probe.inner_seen[0] if probe.inner_seen else "",
        tier2_user_code=tier2,
        numerics=capture_divergences(module) if graphs_replayed else [],
    )
