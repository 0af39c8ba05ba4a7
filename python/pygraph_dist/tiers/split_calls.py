"""Tier 2 as the engine routes it: the model calls and the ``optimizer.step()``
of a loop whose own code runs between graphs.

:meth:`Engine._train_call <pygraph_dist.engine.engine.Engine._train_call>` hands a
step's first model call here once the probe has found a tier-2 loop
(``loop.split_reason``), and every later model call of the same step
(accumulation, several forwards); :meth:`Engine.optimizer_step
<pygraph_dist.engine.engine.Engine.optimizer_step>` asks :meth:`_split_step_now`
whether the step graph replaces the eager step. The graphs themselves (their
capture, the autograd.Function, the step graph) are :mod:`~pygraph_dist.tiers.split`'s.

:class:`Tier2Calls` is a mixin of :class:`~pygraph_dist.engine.engine.Engine`: it
reads the engine's attributes (``split``, ``loop``, ``cache``, ``reducer``,
``accum``, ``_call_sync``, ``_split_step``...) and falls back to the loop as
written through ``Engine._user_forward`` (:mod:`~pygraph_dist.engine.probe`).
"""

from __future__ import annotations

import time

import torch

from ..graphs import host_copies
from ..graphs.graph_cache import GraphEntry
from ..loop.conformance import Mode
from ..loop.outputs import find_loss
from ..runtime._ext import C

Phase = C.Phase


class Tier2Calls:
    """The engine's tier-2 routing (mixed into ``Engine``)."""

    def _split_call(self, entry: GraphEntry, phase, args, kwargs, leaves):
        """A step's first model call in a tier-2 loop: warm up eagerly, capture
        the forward/backward/step graphs, or replay the forward graph."""
        if phase == Phase.WARMUP:
            if not entry.first_seen_s:
                entry.first_seen_s = time.perf_counter()
            entry.warmups += 1
            with host_copies.observing(self.runner.host_watch, entry):
                out = self._user_forward(args, kwargs, probe=False)
            return self.split.record(entry, out) if self._lane_eligible() else out
        if phase == Phase.CAPTURE:
            if self.reducer.eager_buckets:
                entry.policy.disable("tier 2 keeps every gradient bucket in the graph; buckets "
                                     f"{list(self.reducer.eager_buckets)} are reduced eagerly "
                                     "(sparse gradients or eager_params)")
                return self._user_forward(args, kwargs, probe=False)
            if any(isinstance(x, torch.Tensor) and x.requires_grad for x in leaves):
                entry.policy.disable("an input of the model call requires grad; tier 2's backward "
                                     "graph computes parameter gradients only")
                return self._user_forward(args, kwargs, probe=False)
            ok = self.split.capture(entry, args, kwargs, iteration=self.iteration,
                                    state_version=self.opt_state_version,
                                    no_sync_variant=self.loop.saw_no_sync or self.accum.k > 1)
            if not ok:
                return self._user_forward(args, kwargs, probe=False)
        elif entry.host_copies is not None and host_copies.check_due(entry):  # check mode: the step as written
            return host_copies.run_checked(
                entry, lambda: self._user_forward(args, kwargs, probe=False), cache=self.cache,
                iteration=self.iteration, leaves=leaves, group=self.group, device=self.agree_device,
                collective=True, rank=self.rank)
        out = self._split_forward(entry, leaves)
        return out if out is not None else self._user_forward(args, kwargs, probe=False)

    def _lane_eligible(self) -> bool:
        """Whether this loop's loss may be learned for the "lane" graph
        (loss_lane.py): one synchronised model call per step, no GradScaler of
        amp="fp16" (which scales the outputs' gradients)."""
        return (self.config.loss_graphs and not self.split.lane_failed and not self.split.lane_off
                and self.device.type == "cuda"
                and self.grad_scaler is None
                and self._call_sync and self.require_sync and not self.loop.saw_no_sync
                and self.accum.k <= 1)

    def _split_forward(self, entry: GraphEntry, leaves: list):
        """Replay ``entry``'s forward graph for this call, or None when it has
        no graph for it (not tier 2, released, or no variant for no_sync())."""
        sync = self._call_sync
        if entry.tier != 2 or not entry.live or sync not in entry.bwd_graphs:
            return None
        self.loop.mode = Mode.USER
        out = self.split.forward(entry, leaves, sync=sync,
                                 label=f"[{entry.description}] at iteration {self.iteration}")
        self._split_step = entry
        # Read as plain tensors: with the loss lane, the outputs' numel() and
        # dtype would each be a call through LaneTensor.__torch_function__.
        with torch._C.DisableTorchFunctionSubclass():
            loss = find_loss(out, tuples=self.step.tuple_loss)
        self.loop.handed_out(loss, watch=False)
        return out

    def _split_step_now(self, entry: GraphEntry, closure) -> bool:
        """``optimizer.step()`` after forward graphs: replay the step graph, unless
        the step is not the one captured (then the caller steps eagerly)."""
        if closure is not None or not entry.live or entry.tier != 2:
            return False
        if getattr(self.optimizer, "grad_scale", None) is not None or \
                getattr(self.optimizer, "found_inf", None) is not None:
            return False  # a GradScaler hands this step its scale and inf flag: eager
        drift = self.cache.drift(entry, self.reducer, self.optimizer,
                                 self.opt_plan.lr_tensors, self.opt_state_version)
        if drift:
            self._invalidate(entry, drift)
            return False
        self.split.replay_step(entry, f"[{entry.description}] step at iteration {self.iteration}")
        return True
