"""Tier 2 as the engine routes it: the model calls and the ``optimizer.step()``
of a loop whose own code runs between graphs.

:meth:`Engine._train_call <pygraph_dist.engine.engine.Engine._train_call>` hands a
step's first model call to :meth:`Tier2Router.first_call` once the probe has
found a tier-2 loop (``loop.split_reason``), and every later model call of the
same step (accumulation, several forwards) to :meth:`Tier2Router.forward`;
:meth:`Engine.optimizer_step
<pygraph_dist.engine.engine.Engine.optimizer_step>` takes the step's entry
(:meth:`Tier2Router.end_step`), asks :meth:`Tier2Router.step_ready` whether the
step graph may replace the eager step and, once the engine's drift checks pass,
:meth:`Tier2Router.replay_step`. The graphs themselves (their capture, the
autograd.Function, the step graph) are :mod:`~pygraph_dist.tiers.split`'s.

:class:`Tier2Router` is a part the engine holds (``Engine.tier2``), given the
parts it uses; what changes per call (the iteration, the optimizer state's
version, the call's sync, ``no_sync()``, the ignored arguments) is passed per
call. A call tier 2 does not run falls back to the loop as written through
``user_forward``: :meth:`Probe.user_forward <pygraph_dist.engine.probe.Probe.user_forward>`,
which sits a layer above and is passed in as a callable.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from ..graphs import host_copies
from ..graphs.graph_cache import GraphCache, GraphEntry
from ..loop.accumulation import LearnedAccumulation
from ..loop.arguments import IgnoredArgs
from ..loop.conformance import LoopState, Mode
from ..loop.outputs import find_loss
from ..runtime._ext import C
from ..step.step import IterationStep
from .capture import GraphRunner
from .split import SplitGraphs

Phase = C.Phase


class Tier2Router:
    """The engine's tier-2 routing for one wrapped model (``Engine.tier2``)."""

    def __init__(self, split: SplitGraphs, step: IterationStep, loop: LoopState, cache: GraphCache,
                 runner: GraphRunner, accum: LearnedAccumulation, *, user_forward: Callable,
                 agree_device: torch.device, loss_graphs: bool) -> None:
        """``user_forward(args, kwargs, *, probe, sync, ignored)``: the loop as
        written (probe.py); ``agree_device``: a check-mode replay's comparison,
        over the step's group (``step.group``, None after teardown); ``loss_graphs``:
        ``wrap(loss_graphs=...)``, the loss lane."""
        self.split = split
        self.step = step
        self.loop = loop
        self.cache = cache
        self.runner = runner
        self.accum = accum
        self.user_forward = user_forward
        self.agree_device = agree_device
        self.loss_graphs = loss_graphs
        self.step_entry: GraphEntry | None = None  # the entry whose forward graphs ran this step

    def first_call(self, entry: GraphEntry, phase, args, kwargs, leaves, *, iteration: int, state_version: int,
                   sync: bool, require_sync: bool, ignored: IgnoredArgs):
        """A step's first model call in a tier-2 loop: warm up eagerly, capture
        the forward/backward/step graphs, or replay the forward graph."""

        def as_written():
            return self.user_forward(args, kwargs, probe=False, sync=sync, ignored=ignored)

        if phase == Phase.WARMUP:
            if not entry.first_seen_s:
                entry.first_seen_s = time.perf_counter()
            entry.warmups += 1
            with host_copies.observing(self.runner.host_watch, entry):
                out = as_written()
            return self.split.record(entry, out) if self._lane_eligible(sync, require_sync) else out
        if phase == Phase.CAPTURE:
            reducer = self.step.reducer
            if reducer.eager_buckets:
                entry.policy.disable("tier 2 keeps every gradient bucket in the graph; buckets "
                                     f"{list(reducer.eager_buckets)} are reduced eagerly "
                                     "(sparse gradients or eager_params)")
                return as_written()
            if any(isinstance(x, torch.Tensor) and x.requires_grad for x in leaves):
                entry.policy.disable("an input of the model call requires grad; tier 2's backward "
                                     "graph computes parameter gradients only")
                return as_written()
            ok = self.split.capture(entry, args, kwargs, iteration=iteration,
                                    state_version=state_version,
                                    no_sync_variant=self.loop.saw_no_sync or self.accum.k > 1)
            if not ok:
                return as_written()
        elif entry.host_copies is not None and host_copies.check_due(entry):  # check mode: the step as written
            return host_copies.run_checked(
                entry, as_written, cache=self.cache,
                iteration=iteration, leaves=leaves, group=self.step.group, device=self.agree_device,
                collective=True, rank=self.step.rank)
        out = self.forward(entry, leaves, iteration=iteration, sync=sync)
        return out if out is not None else as_written()

    def _lane_eligible(self, sync: bool, require_sync: bool) -> bool:
        """Whether this loop's loss may be learned for the "lane" graph
        (loss_lane.py): one synchronised model call per step, no GradScaler of
        amp="fp16" (which scales the outputs' gradients)."""
        return (self.loss_graphs and not self.split.lane_failed and not self.split.lane_off
                and self.step.device.type == "cuda"
                and self.step.grad_scaler is None
                and sync and require_sync and not self.loop.saw_no_sync
                and self.accum.k <= 1)

    def forward(self, entry: GraphEntry, leaves: list, *, iteration: int, sync: bool):
        """Replay ``entry``'s forward graph for this call, or None when it has
        no graph for it (not tier 2, released, or no variant for no_sync())."""
        if entry.tier != 2 or not entry.live or sync not in entry.bwd_graphs:
            return None
        self.loop.mode = Mode.USER
        out = self.split.forward(entry, leaves, sync=sync,
                                 label=f"[{entry.description}] at iteration {iteration}")
        self.step_entry = entry
        # Read as plain tensors: with the loss lane, the outputs' numel() and
        # dtype would each be a call through LaneTensor.__torch_function__.
        with torch._C.DisableTorchFunctionSubclass():
            loss = find_loss(out, tuples=self.step.tuple_loss)
        self.loop.handed_out(loss, watch=False)
        return out

    def end_step(self) -> GraphEntry | None:
        """``optimizer.step()``: the entry whose forward graphs ran this step
        (None: none did), and the step no longer in tier 2."""
        entry, self.step_entry = self.step_entry, None
        return entry

    def step_ready(self, entry: GraphEntry, closure) -> bool:
        """Whether ``entry``'s step graph may replace this ``optimizer.step()``
        (the caller then checks drift): not when the step is not the one
        captured (a closure, the graphs released, a GradScaler's step)."""
        if closure is not None or not entry.live or entry.tier != 2:
            return False
        optimizer = self.step.optimizer
        if getattr(optimizer, "grad_scale", None) is not None or \
                getattr(optimizer, "found_inf", None) is not None:
            return False  # a GradScaler hands this step its scale and inf flag: eager
        return True

    def replay_step(self, entry: GraphEntry, *, iteration: int) -> None:
        """The step graph, in place of the eager step."""
        self.split.replay_step(entry, f"[{entry.description}] step at iteration {iteration}")
