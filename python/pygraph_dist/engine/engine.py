"""The engine: the life of one iteration of a wrapped model, its hot path.

The user's loop stays as written::

    optimizer.zero_grad(set_to_none=True)
    loss = model(x, y)          # model = GraphedModule -> Engine.run
    loss.backward()
    optimizer.step()            # -> Engine.optimizer_step

Per input signature (shapes, dtypes, devices, non-tensor arguments) an
iteration goes through the phases of the core's ``CapturePolicy``, each one
branch of :meth:`Engine.run`:

* **probe** (first iterations of the first signature): the loop runs exactly
  as written, watched by the :class:`~pygraph_dist.loop.monitor.LoopMonitor`; the
  verdict is agreed by all ranks (:mod:`~pygraph_dist.loop.conformance`).
* **warmup**: the model call runs the *whole* iteration eagerly on the capture
  stream; the user's ``backward()`` and ``step()`` then do nothing.
* **capture**: the same iteration recorded and agreed
  (:mod:`~pygraph_dist.tiers.capture`), then launched once.
* **replay**: inputs copied into static buffers, one launch, a fresh loss.
* **eager**: training as written, for good; the reason is in ``report()``.

Module map: docs/design.md, a line per module. This module keeps the hot
path: :meth:`Engine.run` → :meth:`Engine._train_call` (guard match → key →
drift → ``begin_iteration`` → probe or eager / tier 2 / tier 1's warm-up,
capture, replay, each a visible branch; a step's later calls:
:meth:`Engine._later_call`), the hand-out, and the optimizer's ``step()``
and ``zero_grad()``.

The engine *has* its parts, and no base class: each part is built in
:mod:`~pygraph_dist.engine.wiring` (:func:`~pygraph_dist.engine.wiring.build_parts`)
and given only what it uses, none holding the engine: the reducer, the
:class:`~pygraph_dist.step.step.IterationStep`, the graph cache and the
:class:`~pygraph_dist.tiers.capture.GraphRunner` (tier 1), ``probe``
(:class:`~pygraph_dist.engine.probe.Probe`: the loop as written, the
verdict), ``tier2`` (:class:`~pygraph_dist.tiers.split_calls.Tier2Router`),
``split_clip``, ``accum`` (learned accumulation), ``evals`` (evaluation
graphs). What changes per call (the iteration, the call's sync, the optimizer
state's version) is passed to them per call. The optimizer and the clip
router reach the engine through Protocols of its public members
(``optim.StepOwner``, ``clip_route.ClipOwner``). Off the step, the engine
keeps its own lifecycle (``owned_storages`` for the monitor,
``on_optimizer_state_loaded``, ``teardown``); its report is built by
:func:`~pygraph_dist.engine.report.describe_model`.

Numerics: warm-up, eager and replay run the same kernels in the same order,
so graphed training is bitwise identical to the engine's eager mode
(``graphs=False``); tests check that against a 2-rank reference.
"""

from __future__ import annotations

import logging
import re
import time

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch import nn

from ..graphs import host_copies
from ..graphs.graph_cache import GraphEntry
from ..launch import lifetime
from ..loop.amp import autocast_state
from ..loop.arguments import leaf_name, varying_detail
from ..loop.compiled import TIMER as COMPILE_TIMER
from ..loop.config import WrapConfig
from ..loop.conformance import LoopConformanceError, Mode, Stage  # noqa: F401 - Mode, Stage re-exported
from ..loop.fast_lane import build_guard
from ..loop.monitor import storage_ptr, user_location
from ..loop.outputs import hand_out_outputs
from ..loop.param_groups import adopt_assigned_lrs
from ..runtime._ext import C
from ..runtime.spans import timed
from ..step import clip_route
from ..step.optim import prepare_optimizer
from ..tiers.capture import SELECT_REPLAYS
from .report import describe_model
from .wiring import build_parts

logger = logging.getLogger("pygraph_dist")

Phase = C.Phase
_BAKED = re.compile(r"param group (\d+): '([^']+)'")  # param_groups.hyperparams_drift's reasons
TORN_DOWN = "pygraph_dist was torn down (destroy_process_group or exit)"
_flatten = timed("signature")(pytree.tree_flatten)  # spans.py: identity unless PYGRAPH_DIST_HOST_SPANS=1


def _hand_out_loss_py(loss: torch.Tensor) -> torch.Tensor:
    """csrc/hand_out.cpp's, for an extension built before it: a clone of a leaf
    copy (the leaf a copy too, so that a loss the user keeps does not hold the
    graph's pool)."""
    with torch.enable_grad():
        return loss.detach().clone().requires_grad_(True).clone()


_hand_out_loss = getattr(C, "hand_out_loss", _hand_out_loss_py)


class Engine:
    """One wrapped model and its optimizer: ``GraphedModule.__call__`` is
    :meth:`run`, the optimizer's ``step()`` and ``zero_grad()`` are
    :meth:`optimizer_step` and :meth:`optimizer_zero_grad`. The parts are
    built by :func:`~pygraph_dist.engine.wiring.build_parts` and held here,
    each under its field's name; off the step: :meth:`describe`,
    :meth:`teardown`, :meth:`owned_storages`, :meth:`on_optimizer_state_loaded`."""

    def __init__(
        self,
        module: nn.Module,
        optimizer: torch.optim.Optimizer,
        config: WrapConfig,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        parts = build_parts(module, optimizer, config, group,  # wiring.py: every part, built and connected
                            owner=self, owned_storages=self.owned_storages)
        # Each part and wrap-time fact under its field's name (EngineParts says
        # what each is); frozen_at_wrap, release_stream and clear_grads as _private.
        for name, value in parts.engine_attributes():
            setattr(self, name, value)
        # The parts' calls back into the engine's own state.
        self.reducer.on_finalize = self._on_backward_finished
        # Adopted views leave a released graph's pool (not at teardown: nothing trains after it).
        self.cache.on_none_live = lambda: None if self.closed else self.reducer.restore_views()
        # The state of the step in flight, read and written by run() and optimizer_step().
        self._call_sync = True  # this model call's backward all-reduces (accumulation.py)
        self.iteration = 0  # optimizer steps begun (model calls that start a step)
        self.require_sync = True  # False inside GraphedModule.no_sync()
        self.opt_state_version = 0
        self.buffers_sync_due = False  # see run()
        self.baked_changes: dict[str, int] = {}  # invalidations per baked hyperparameter key
        self.closed = False
        self._entry: GraphEntry | None = None
        self._phase = None
        # fast_lane.py: the entry whose InputGuard the next call is tried against
        # (the last one replayed; never with pad_batch_to, whose padding the guard skips).
        self._guarded: GraphEntry | None = None
        self._owned_lane = getattr(C, "replay_owned", None) is not None  # CUDA builds
        self._norm_requests: list[torch.Tensor] = []  # grad_norm_after_step(), filled by the step
        self.serial = lifetime.register(self)

    @property
    def grad_scaler(self):
        return self.step.grad_scaler

    @property
    def delegating_step(self) -> bool:
        return self.step.delegating

    @property
    def entries(self):
        return self.cache.entries

    @property
    def in_tier2_step(self) -> bool:
        """This step's model calls replayed tier 2's forward graphs (clip_route.route)."""
        return self.tier2.step_entry is not None

    # ============================================================ one iteration
    @timed("model call")
    def run(self, args: tuple, kwargs: dict):
        """The wrapped model's call: one training iteration (or an evaluation)."""
        if self.compiled:  # compilations from here on are this model's
            COMPILE_TIMER.install()
            COMPILE_TIMER.current = (self.compile_stats, self._first_iteration)
        if self.closed:  # after teardown (no process group left): the module as is
            return self.step.evaluate(args, kwargs)
        if not torch.is_grad_enabled():  # evaluation (no_grad, inference_mode): forward graphs
            sync, self.buffers_sync_due = self.buffers_sync_due, False
            return self.evals.call(args, kwargs, iteration=self.iteration, ignored=self.ignored,
                                   sync_buffers=sync)
        if not self.module.training:  # eval mode with autograd on: the module as is, eagerly
            return self.step.evaluate(args, kwargs)
        if self._frozen_at_wrap:
            self._check_unfrozen()
        adopt_assigned_lrs(self.optimizer, self.opt_plan.lr_tensors)
        self._call_sync = self.accum.model_call(self.require_sync)
        # DDP's require_forward_param_sync: the first no-grad call after a
        # synchronised training forward broadcasts rank 0's buffers (evaluation.py).
        self.buffers_sync_due = self._call_sync
        out = self._train_call(args, kwargs)
        self.accum.after_model_call()
        return out

    def _check_unfrozen(self) -> None:
        thawed = [n for n, p in self._frozen_at_wrap if p.requires_grad]
        if thawed:
            shown = ", ".join(repr(n) for n in thawed[:4])
            shown += f" and {len(thawed) - 4} more" if len(thawed) > 4 else ""
            raise RuntimeError(
                f"parameter(s) {shown} did not require grad when pygraph_dist.wrap() was called and "
                "require it now. Gradients are all-reduced for the parameters that were trainable at "
                "wrap(), so these would train on each rank's own gradient and the ranks would drift "
                "apart (DDP has the same rule). Wrap with every parameter you will train set "
                "requires_grad=True, and freeze with requires_grad_(False) afterwards: frozen "
                "parameters are left out of the step, and unfreezing them is fine.")

    def _train_call(self, args: tuple, kwargs: dict):
        """A training call: warm-up, capture, replay, or the loop as written."""
        self.reducer.finish_pending()
        if self.loop.stage is not Stage.IDLE and not self.loop.owned:
            return self._later_call(args, kwargs)  # not the step's first call
        self.loop.model_called(in_no_sync=not self.require_sync)
        self.iteration += 1
        # The entry replayed last accepts this call (its InputGuard: fast_lane.py),
        # or the call's key is built and looked up. leaves None: the guard holds
        # the call's tensors, copied by the replay.
        entry, leaves = self._guard_match(args, kwargs), None
        if entry is not None and self._owned_lane:
            fresh = self._replay_owned(entry)
            if fresh is not None:
                return fresh
        if entry is None:
            args, kwargs = self.cache.pad(args, kwargs)
            leaves, spec = _flatten((args, kwargs))
            masked, spec = self.ignored.signature(args, kwargs, leaves, spec)
            entry = self._entry_for(masked, spec)
            if entry.policy.phase == Phase.REPLAY and not self.cache.pad_batch_to:
                self._guard(entry, args, kwargs, masked)
        if entry.policy.phase == Phase.REPLAY:
            self._drifted(entry)
        elif entry.policy.phase == Phase.WARMUP and self.cache.captured_any:
            entry.policy.cap_warmup(0 if entry.warmups else 1)
        phase = entry.policy.begin_iteration()
        self._entry, self._phase = entry, phase
        entry.last_used = self.iteration
        if leaves is None and phase != Phase.REPLAY:  # drift: the long way from here
            entry.guard.discard()
            leaves, _ = _flatten((args, kwargs))

        if phase in (Phase.PROBE, Phase.EAGER):  # the loop as written (probe.py)
            return self._user_forward(args, kwargs, probe=phase == Phase.PROBE)
        if self.loop.split_reason:  # tier 2: graphs per micro-batch (split_calls.py)
            return self.tier2.first_call(entry, phase, args, kwargs, leaves, iteration=self.iteration,
                                         state_version=self.opt_state_version, sync=self._call_sync,
                                         require_sync=self.require_sync, ignored=self.ignored)
        self.loop.mode = Mode.OWNED  # tier 1: the whole iteration, warmed up, captured or replayed
        if phase == Phase.WARMUP:
            if not entry.first_seen_s:
                entry.first_seen_s = time.perf_counter()
            entry.warmups += 1
            with self.runner.timed(entry.eager_times, self._selecting(entry)), \
                    host_copies.observing(self.runner.host_watch, entry):
                loss = self.runner.run_owned(self.step.to_device(args, kwargs))
            return self._hand_out(loss)
        if phase == Phase.CAPTURE:
            return self._hand_out(self.runner.capture(entry, args, kwargs, iteration=self.iteration,
                                                      state_version=self.opt_state_version))
        if entry.host_copies is not None and host_copies.check_due(entry):  # check mode
            return self._hand_out(host_copies.run_checked(
                entry, lambda: self.runner.run_owned(self.step.to_device(args, kwargs)), cache=self.cache,
                iteration=self.iteration, leaves=leaves, group=self.group, device=self.agree_device,
                collective=True, rank=self.rank))
        if not self._selecting(entry):
            return self._hand_out(self.runner.replay(entry, leaves, iteration=self.iteration))
        with self.runner.timed(entry.replay_times, True):
            loss = self.runner.replay(entry, leaves, iteration=self.iteration)
        if len(entry.replay_times) >= SELECT_REPLAYS:
            self.runner.select(entry, iteration=self.iteration)
        return self._hand_out(loss)

    def _later_call(self, args: tuple, kwargs: dict):
        """Another model call in the same optimizer step (gradient accumulation,
        several forwards): the loop runs as written, as with DDP, its forward
        and backward graphed when this step's first call was (tier 2)."""
        self.loop.model_called(in_no_sync=not self.require_sync)
        if self.tier2.step_entry is not None:
            entry, leaves = self._guard_match(args, kwargs), None
            if entry is None:
                leaves, spec = _flatten((args, kwargs))
                entry = self.cache.find(*self.ignored.signature(args, kwargs, leaves, spec),
                                        autocast_state(self.device.type))
            out = (self.tier2.forward(entry, leaves, iteration=self.iteration, sync=self._call_sync)
                   if entry is not None else None)
            if out is not None:
                return out
            if leaves is None:  # matched, but not replayed: the guard lets the call's tensors go
                entry.guard.discard()
        return self._user_forward(args, kwargs, probe=self._phase == Phase.PROBE)

    @timed("launch")
    def _replay_owned(self, entry: GraphEntry):
        """Tier 1's steady state: the call matched ``entry``'s guard, and its
        graph replays in one C++ call (``C.replay_owned``: the parameters'
        state, input copies, .grad views, launch, loss hand-out) after the
        drift checks that are cheap in Python. None where anything differs
        from a plain tier-1 replay: the long path below makes every check and
        says why."""
        drift, result = entry.drift, entry.static_result
        if (entry.step_graph is not None or entry.graph is None or result is None
                or self.loop.split_reason
                or self.reducer.watch is None or not isinstance(drift.params, bytes)
                or drift.state_version != self.opt_state_version
                or entry.policy.phase != Phase.REPLAY or self._selecting(entry)
                or getattr(entry.graph, "_tracker", None) is not None
                or (entry.host_copies is not None and entry.host_copies.checking)
                or self.cache.hyperparams_drift(entry, self.optimizer, self.opt_plan.lr_tensors)):
            return None
        launch = self.runner.watchdog.fused()
        if launch is None:
            return None
        fresh = C.replay_owned(entry.guard, self.reducer.watch, drift.params, entry.graph, launch[0],
                               f"[{entry.description}] at iteration {self.iteration}",
                               entry.collectives or "", launch[1], result[0])
        if fresh is None:  # a parameter's storage or requires_grad changed
            return None
        entry.policy.begin_iteration()
        self._entry, self._phase = entry, Phase.REPLAY
        entry.last_used = self.iteration
        self.loop.mode = Mode.OWNED
        self.loop.handed_out(fresh)
        return hand_out_outputs(result[1], result[0], fresh)  # the loss, or (HF) the loss and logits

    def _guard_match(self, args: tuple, kwargs: dict) -> GraphEntry | None:
        """The entry replayed last, if this call has its signature (InputGuard)."""
        entry = self._guarded
        if entry is None or entry.guard is None or entry.guard_for is not entry.static_leaves:
            return None
        if not entry.guard.match(args, kwargs):
            return None
        if autocast_state(self.device.type) != entry.key[2]:
            entry.guard.discard()
            return None
        return entry

    def _guard(self, entry: GraphEntry, args: tuple, kwargs: dict, masked: list) -> None:
        """Make ``entry`` the one the next call is tried against, with a guard
        for its current static inputs (a capture replaces them)."""
        if entry.guard_for is not entry.static_leaves:
            entry.guard = build_guard(args, kwargs, masked, entry.static_leaves)
            entry.guard_for = entry.static_leaves
        self._guarded = entry

    def _drifted(self, entry: GraphEntry) -> bool:
        """Whether ``entry``'s graphs no longer fit the parameters, the optimizer's
        state or its baked hyperparameters (then they are released, and why said)."""
        drift = self.cache.drift(entry, self.reducer, self.optimizer,
                                 self.opt_plan.lr_tensors, self.opt_state_version)
        if drift:
            self._invalidate(entry, drift)
        return bool(drift)

    def _invalidate(self, entry: GraphEntry, drift: str) -> None:
        """Release ``entry``'s graphs for ``drift``; a hyperparameter the graphs
        bake in that changes again gets one warning with its line and the fix."""
        self.cache.invalidate(entry, self.iteration, drift)
        clip_route.structure_changed()  # a parameter replaced: the clip reads model.parameters() again
        m = _BAKED.match(drift)
        if not m:
            return
        key = m.group(2)
        n = self.baked_changes[key] = self.baked_changes.get(key, 0) + 1
        if n != 2 or self.rank != 0:
            return
        fix = ("use an optimizer whose lr is read on the device (Adam, AdamW, SGD, RMSprop, "
               "Adadelta)" if key == "lr" else
               "keep it constant while training (OneCycleLR: cycle_momentum=False; only the lr "
               "may change every step)")
        logger.warning("%s -- for the second time. The graphs bake this hyperparameter in, so every "
                       "change captures again, and after a few recaptures the loop trains eagerly. "
                       "To stay graphed, %s.", drift, fix)

    def _user_forward(self, args: tuple, kwargs: dict, *, probe: bool):
        """The forward as written (probe.py), with this call's sync and ignored arguments."""
        return self.probe.user_forward(args, kwargs, probe=probe, sync=self._call_sync, ignored=self.ignored)

    def _first_iteration(self) -> bool:
        return self.iteration <= 1

    def _selecting(self, entry: GraphEntry) -> bool:
        return self.runner.selecting(entry, self.graphs_possible)

    def _entry_for(self, leaves: list, spec) -> GraphEntry:
        entry, new = self.cache.lookup(leaves, spec, autocast_state(self.device.type))
        if not new:
            return entry
        if entry.key[0] != "unhashable":
            for i in self.varying.new_signature(entry.key[1], spec, entry.key[2]):
                self._warn_varying(entry, leaf_name(self.module, leaves, spec, i))
        probe = 0 if self.loop.probe_done else max(1, self.config.probe)
        # Once one signature has been captured, the lazy initialisation warm-up
        # exists for (optimizer state, cuBLAS workspaces on the capture stream,
        # NCCL communicators) is done: a new shape, such as the short last batch
        # of an epoch, needs one eager iteration, not the full warm-up.
        warmup = min(1, self.config.warmup) if self.cache.captured_any else self.config.warmup
        entry.policy = C.CapturePolicy(C.PolicyConfig(
            probe_iters=probe, warmup_iters=warmup, max_capture_attempts=2, max_recaptures=8,
        ))
        if entry.key[0] == "unhashable":
            entry.policy.disable("an argument of the model call is not hashable, so calls cannot be "
                                 "matched to graphs; pass tensors and plain Python values")
        elif self.loop.verdict:
            entry.policy.conformance_failed(self.loop.verdict)
        elif self.closed:
            entry.policy.disable(TORN_DOWN)
        elif probe == 0 and self.graphs_reason:
            entry.policy.disable(self.graphs_reason)
        return entry

    def _warn_varying(self, entry: GraphEntry, name: str) -> None:
        detail = varying_detail(name)
        self.cache.event(entry, self.iteration, "argument varies", detail)
        if self.rank == 0:
            logger.warning("%s.", detail)

    @timed("hand-out")
    def _hand_out(self, result):
        """The outputs of an iteration the engine ran: fresh tensors, since the
        graph's own are overwritten by the next replay. The loss requires grad so
        that the user's ``loss.backward()`` is valid; the monitor makes it a no-op."""
        loss, out = result
        # Not a leaf: the loop may scale it in place (transformers' compute_loss:
        # loss *= 1), which a leaf that requires grad refuses. A copy, with a
        # grad_fn that has nothing behind it (csrc/hand_out.cpp): one kernel.
        fresh = _hand_out_loss(loss)
        self.loop.handed_out(fresh)
        return hand_out_outputs(out, loss, fresh)

    def _on_backward_finished(self) -> None:
        if self._entry is not None:
            self._entry.unused_seen.add(self.reducer.last_unused)
        self.loop.backward_finished()

    # ================================================= the optimizer's calls
    @timed("step routing")
    def optimizer_step(self, closure=None):
        """``optimizer.step()`` of the wrapped optimizer."""
        if self.split.lane_run is not None:  # a loss still pending is computed now (loss_lane.py)
            self.split.end_lane("optimizer.step() came before backward() of the loss")
        adopt_assigned_lrs(self.optimizer, self.opt_plan.lr_tensors)
        self.accum.step()  # pending local sums reduced first; K learned at the first step
        probe = self._phase == Phase.PROBE and not self.loop.owned
        owned = self.loop.owned
        clips = self.loop.clip_calls
        seen = self.loop.step_called(closure, probe=probe)
        if owned:
            if self.step.routed_clip is not None and not clips:
                raise LoopConformanceError(
                    f"optimizer.step() without the clip_grad_norm_() of the probe iterations at "
                    f"{user_location()}, after graphs were captured: the graph's step clipped "
                    f"({self.step.routed_clip.describe()}). Call clip_grad_norm_ the same way every "
                    "step, or wrap(..., graphs=False).")
            return None  # the graph (or the owned iteration) already stepped
        split = self.tier2.end_step()  # tier 2: the step graph, unless this step is not the one captured
        if split is not None and self.tier2.step_ready(split, closure) and not self._drifted(split):
            self.tier2.replay_step(split, iteration=self.iteration)
            self._fill_norm_requests()
            return None
        self.reducer.finish_pending()
        with self.step.on_compute_stream():
            result = self.step.apply_step(closure)
        self._fill_norm_requests()
        if probe:
            self.probe.finish(self._entry, seen, iteration=self.iteration)
        return result

    def grad_norm_after_step(self) -> torch.Tensor:
        """What ``clip_grad_norm_`` returns when the step clips (``wrap(max_grad_norm=...)``):
        the global gradient norm before clipping. At once when this iteration's
        step already ran (tier 1 steps at the model call); otherwise a tensor that
        ``optimizer.step()`` fills, NaN until then."""
        norm = self.step.grad_norm
        if self.loop.owned:
            return norm.clone()
        out = torch.full_like(norm, float("nan"))
        self._norm_requests.append(out)
        return out

    def probing(self) -> bool:
        """A probe iteration: the loop runs as written (watched, unless wrap(monitor=False))."""
        return self._phase == Phase.PROBE and not self.loop.owned

    def _fill_norm_requests(self) -> None:
        if self._norm_requests:
            for out in self._norm_requests:
                out.copy_(self.step.grad_norm)
            self._norm_requests.clear()

    @timed("zero_grad routing")
    def optimizer_zero_grad(self, set_to_none: bool = True) -> None:
        self.reducer.finish_pending()  # a backward that raised: its round ends before the clearing
        self.accum.zero_grad()
        self.loop.zero_grad_called()
        if not self.loop.owned and not self._clear_grads(set_to_none):
            with self.loop.unwatched():  # zero_grad() itself is judged by zero_grad_called()
                self.step.optimizer_class.zero_grad(self.optimizer, set_to_none)

    # ==================================================== the engine off the step
    def owned_storages(self) -> set[int]:
        """Storages of parameters, gradient buckets, optimizer state and lr tensors
        (``LoopState``'s monitor: not the user's)."""
        # The views too: at world size 1 they may be a graph's gradients (grad_adoption.py).
        tensors = list(self.reducer.params) + [b for b in self.reducer.buffers if b is not None]
        tensors += [v for v in self.reducer.views if v is not None]
        for state in self.optimizer.state.values():
            tensors += [v for v in state.values() if isinstance(v, torch.Tensor)]
        tensors += [t for t in self.opt_plan.lr_tensors if t is not None]
        return {storage_ptr(t) for t in tensors} - {-1}

    def on_optimizer_state_loaded(self, extra) -> None:
        """``GraphedOptimizerMixin.load_state_dict``: the state tensors are new
        objects, so the optimizer is prepared again and the graphs see a new version."""
        self.opt_plan = prepare_optimizer(self.optimizer, device=self.device, amp=self.amp,
                                          skip_nonfinite=self.config.skip_nonfinite,
                                          sparse=bool(self.reducer.sparse_params))
        if extra and self.grad_scaler is not None and "grad_scaler" in extra:
            self.grad_scaler.load_state_dict(extra["grad_scaler"])
        self.opt_state_version += 1

    def describe(self):
        """This model's :class:`~pygraph_dist.reports.reporting.ModelReport` (report.py)."""
        return describe_model(
            module=self.module, rank=self.rank, world_size=self.world_size, device=self.device,
            config=self.config, amp=self.amp, opt_plan=self.opt_plan, graphs_possible=self.graphs_possible,
            graphs_reason=self.graphs_reason, fp_backend=self.fp_backend, compile_stats=self.compile_stats,
            compile_user=self.compile_user, loop=self.loop, step=self.step, reducer=self.reducer,
            cache=self.cache, runner=self.runner, split=self.split, split_clip=self.split_clip,
            accum=self.accum, probe=self.probe)

    def teardown(self) -> None:
        """Release every graph (and with it NCCL's references to the communicator).

        Also drops the engine's hold on the process group and the cycles through
        it (reducer hooks on the parameters, the optimizer's back-reference), so
        that the group's C++ objects are destroyed when the process group is,
        not during interpreter exit, where destroying them occasionally aborted
        the process. The optimizer keeps working as a plain optimizer.
        Caller: :mod:`~pygraph_dist.launch.lifetime`."""
        if self.closed:
            return
        self.closed = True
        self.watchdog.close()
        self.loop.stop()
        self.split_clip.release()
        if self.cache.release_all(TORN_DOWN) and torch.cuda.is_available():
            torch.cuda.synchronize(self.device)
        if self._release_stream is not None:
            self._release_stream()  # its graphs are destroyed: another model may capture on it
        self.reducer.remove_hooks()
        self.reducer.group = None
        self.group = None
        self.step.group = None
        self.runner.group = None
        self.accum.group = None
        self.fp_backend = None
        self.runner.fp_backend = None
        self.optimizer.__dict__.pop("_pgd_engine", None)
