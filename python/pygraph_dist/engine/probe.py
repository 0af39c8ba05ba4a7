"""The loop as written: the probe's watched forward, its verdict, and the
eager forward that every other path falls back to.

A model call that the engine does not run itself (the probe iterations, the
eager phase, tier 2's warm-up, a call no graph fits) goes through
:meth:`Probe.user_forward`: the module's forward as written, the user's
``backward()`` and ``step()`` doing the rest. During the probe the
:class:`~pygraph_dist.loop.monitor.LoopMonitor` watches the code around it, and at
the probe's ``optimizer.step()``
(:meth:`Engine.optimizer_step <pygraph_dist.engine.engine.Engine.optimizer_step>`)
:meth:`Probe.finish` has all ranks agree on the verdict: one graph
per iteration (tier 1), graphs per micro-batch (tier 2,
:mod:`~pygraph_dist.tiers.split_calls`), or eager training for good.

:class:`Probe` is a part the engine holds (``Engine.probe``): it is given the
parts it uses (the step, the loop's state, the runner, the graph cache) and
what it cannot read from them is passed per call (the call's sync, the
ignored arguments, the iteration).
"""

from __future__ import annotations

import contextlib
import logging

import torch

from ..graphs.graph_cache import GraphCache, GraphEntry
from ..launch import agreement
from ..loop.arguments import IgnoredArgs
from ..loop.conformance import LoopState, chain_digest
from ..loop.monitor import Violation, user_location, watch_host_syncs, watch_inner_autocast
from ..loop.outputs import map_outputs
from ..runtime._ext import C
from ..step import clip_route
from ..step.step import IterationStep
from ..tiers.capture import GraphRunner
from ..tiers.split import output_tensors

logger = logging.getLogger("pygraph_dist")

Phase = C.Phase


class Probe:
    """The engine's forward as written and the probe's verdict (``Engine.probe``)."""

    def __init__(self, step: IterationStep, loop: LoopState, runner: GraphRunner, cache: GraphCache, *,
                 agree_device: torch.device, compiled: bool, graphs_possible: bool,
                 graphs_reason: str) -> None:
        """``agree_device``: where the verdict is agreed, over the step's group
        (``step.group``, None after teardown); ``compiled``: torch.compile runs the forward
        (no hooks that would make it recompile); why the model has no graphs, if so."""
        self.step = step
        self.loop = loop
        self.runner = runner
        self.cache = cache
        self.agree_device = agree_device
        self.compiled = compiled
        self.graphs_possible = graphs_possible
        self.graphs_reason = graphs_reason
        self.inner_seen: list[str] = []  # autocast inside forward, seen by a probe (monitor.py)

    def user_forward(self, args, kwargs, *, probe: bool, sync: bool, ignored: IgnoredArgs):
        """Forward as written; the user's backward() and step() do the rest.
        Returns what the module returns. ``sync``: this call's backward
        all-reduces; ``ignored``: wrap(ignore_args=...), watched by a probe."""
        loop, step = self.loop, self.step
        device = step.device
        if loop.owned and loop.zeroed_since_step:
            step.clear_grads()  # the user's zero_grad() was a no-op during owned iterations
        # Only a probe checks for gradients left from the last step (a C++ loop: reducer.all_grads_none).
        loop.user_forward(probe=probe, grads_present=probe and not step.reducer.all_grads_none())
        args, kwargs = step.to_device(args, kwargs)
        watcher = None
        if probe and ignored and not self.compiled:
            args, kwargs, watcher = ignored.watch(args, kwargs)
        with step.on_compute_stream(), watch_host_syncs(
                probe and device.type == "cuda", self.runner.sync_sites), \
                watch_inner_autocast(probe and not self.inner_seen and not self.compiled,  # hooks: recompiles
                                     device.type, self.inner_seen), \
                watcher if watcher is not None else contextlib.nullcontext():
            loss, out = step.forward(args, kwargs, sync=sync, need_loss=False)
        if watcher is not None:
            watcher.on = False
            for name, how, where in watcher.uses:
                loop.forward_violation(
                    f"the forward reads {name!r} ({how}), which wrap(ignore_args=...) leaves out of the "
                    "graphs' signatures", where,
                    f"A graph would replay the value it was captured with. Remove {name!r} from "
                    "ignore_args (each value then gets its own graph), or stop reading it in forward.")
        if step.grad_scaler is not None:
            # amp="fp16": the scale is applied in backward. To the loss when the
            # module returns one; otherwise to every output, so that whatever
            # loss the user computes from them is scaled exactly once.
            if loss is not None:
                scaled = step.scaled(loss)
                out = map_outputs(out, lambda t: scaled if t is loss else t)
                loss = scaled
            else:
                out = map_outputs(out, lambda t: step.scaled(t) if t.requires_grad else t)
        if probe:
            loop.output_nodes |= {t.grad_fn for t in output_tensors(out) if t.grad_fn is not None}
        loop.handed_out(loss, watch=probe)
        return out

    def finish(self, entry: GraphEntry, violations, *, iteration: int) -> None:
        """The probe's ``optimizer.step()`` done: all ranks agree on the verdict
        (tier 1, tier 2 or eager), written into the loop's state, the step and
        ``entry``'s policy."""
        self.loop.end_probe_step()
        clip, why = clip_route.probe_plan(self.loop)
        if why:
            violations = [*violations, Violation(why, user_location(), "Call clip_grad_norm_ the same "
                                                 "way every step to have the whole iteration graphed.",
                                                 split_ok=True)]
        whats: set[str] = set()
        unique = [v for v in violations if not (v.what in whats or whats.add(v.what))]  # each once
        verdict = agreement.agree(
            ok=not violations,
            reason="; ".join(str(v) for v in unique),
            digests=[clip.digest() if clip is not None else 0, chain_digest(self.loop.loss_chain)],
            group=self.step.group,
            device=self.agree_device,
            explain=lambda everyone: "ranks clip differently (clip_grad_norm_'s max_norm or parameters) or "
                                     "scale the loss by different numbers before backward()",
        )
        if not verdict.agreed:
            # Not one graph per iteration. Tier 2 if every rank's deviations
            # are ones forward/backward graphs with the user's code between them
            # still run as written (every rank takes this branch alike).
            blocking = [v for v in unique if not v.split_ok]
            split = agreement.agree(
                ok=not blocking, reason="; ".join(str(v) for v in blocking),
                digests=[], group=self.step.group, device=self.agree_device,
            )
            if split.agreed:
                if self.graphs_possible and not self.loop.split_reason and self.step.rank == 0:
                    logger.info("graphed per micro-batch (tier 2: forward and backward graphs, "
                                "your code between them, the step graph at optimizer.step()). "
                                "One graph per iteration (tier 1) would need: %s", verdict.reason)
                self.loop.split_reason = verdict.reason
                if entry.policy.phase != Phase.PROBE:
                    self.loop.probe_done = True
                    # Where no graph can run (a CPU build, graphs=False) the report still says
                    # what the loop fits ("fits tier 2"); it trains eagerly, as a conforming one.
                    if self.graphs_reason:
                        entry.policy.disable(self.graphs_reason)
                return
            self.loop.split_reason = ""
            if not split.agreed:
                verdict = split
            self.loop.verdict = verdict.reason
            entry.policy.conformance_failed(verdict.reason)
            self.cache.event(entry, iteration, "loop not graphable", verdict.reason)
            if self.step.rank == 0:
                logger.warning("this training loop cannot be replayed as a CUDA graph: %s. "
                               "Training continues eagerly, exactly as written.", verdict.reason)
            return
        if entry.policy.phase != Phase.PROBE:  # last probe iteration done
            self.loop.probe_done = True
            if clip is not None and self.graphs_possible and not self.loop.split_reason:
                self.step.route_clip(clip)  # the user's clip_grad_norm_ moves into the step (clip_route.py)
            if not self.loop.split_reason:  # the loop's own loss scaling seeds the graph's backward
                self.step.loss_chain = self.loop.loss_chain
            if self.graphs_reason:
                entry.policy.disable(self.graphs_reason)
