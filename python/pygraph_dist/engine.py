"""The engine: the wiring of a wrapped model, and the life of one iteration.

The user's loop stays as written::

    optimizer.zero_grad(set_to_none=True)
    loss = model(x, y)          # model = GraphedModule -> Engine.run
    loss.backward()
    optimizer.step()            # -> Engine.optimizer_step

Per input signature (shapes, dtypes, devices, non-tensor arguments) an
iteration goes through the phases of the core's ``CapturePolicy``, each one
branch of :meth:`Engine.run`:

* **probe** (first iterations of the first signature): the loop runs exactly
  as written, watched by the :class:`~pygraph_dist.monitor.LoopMonitor`; the
  verdict is agreed by all ranks (:mod:`~pygraph_dist.conformance`).
* **warmup**: the model call runs the *whole* iteration eagerly on the capture
  stream; the user's ``backward()`` and ``step()`` then do nothing.
* **capture**: the same iteration recorded and agreed
  (:mod:`~pygraph_dist.capture`), then launched once.
* **replay**: inputs copied into static buffers, one launch, a fresh loss.
* **eager**: training as written, for good; the reason is in ``report()``.

Module map: :mod:`config` (wrap()'s arguments), :mod:`step` (what an
iteration does), :mod:`capture` (warm-up → capture → agree → replay →
select), :mod:`graph_cache` (signatures, graphs, drift, limits),
:mod:`conformance` (the loop's state and its rule), :mod:`agreement` (every
decision all ranks share), :mod:`lifetime` (teardown before the process group
goes), :mod:`reducer`, :mod:`optim`, :mod:`amp`, :mod:`monitor`,
:mod:`watchdog`, :mod:`report`.

Numerics: warm-up, eager and replay run the same kernels in the same order,
so graphed training is bitwise identical to the engine's eager mode
(``graphs=False``); tests check that against a 2-rank reference.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import time
import weakref

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch import nn

from . import agreement, kernels, lifetime
from .accumulation import LearnedAccumulation
from ._ext import C, graphs_available
from .amp import ensure_scale_initialised, make_grad_scaler, parse_amp
from .arguments import IgnoredArgs, VaryingScalars, leaf_name
from .backend import graph_safe_backend
from .compiled import TIMER as COMPILE_TIMER
from .compiled import CompileStats, disable_donated_buffers, is_compiled
from .compiled import describe as describe_compile
from .capture import SELECT_REPLAYS, GraphRunner
from .evaluation import EvalGraphs
from .fast_lane import ClearGrads, build_guard
from .config import WrapConfig, check_sparse_support, sparse_param_names
from .conformance import LoopConformanceError, LoopState, Mode, Stage  # noqa: F401 - re-exported
from .graph_cache import GraphCache, GraphEntry
from .monitor import storage_ptr, watch_host_syncs
from .optim import make_graph_aware, prepare_optimizer
from .param_groups import adopt_assigned_lrs
from .reducer import GradientReducer
from .spans import timed
from .split import SplitGraphs, output_tensors
from .step import IterationStep, find_loss, map_outputs, release_side_stream
from .watchdog import ReplayWatchdog

logger = logging.getLogger("pygraph_dist")

Phase = C.Phase
_BAKED = re.compile(r"param group (\d+): '([^']+)'")  # param_groups.hyperparams_drift's reasons
TORN_DOWN = "pygraph_dist was torn down (destroy_process_group or exit)"
_flatten = timed("signature")(pytree.tree_flatten)  # spans.py: identity unless PYGRAPH_DIST_HOST_SPANS=1


class Engine:
    def __init__(
        self,
        module: nn.Module,
        optimizer: torch.optim.Optimizer,
        config: WrapConfig,
        group: dist.ProcessGroup | None = None,
    ) -> None:
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

        cuda = self.device.type == "cuda"
        self.fp_backend = graph_safe_backend(self.group, "cuda") if cuda else None
        self.agree_device = self.device if cuda else torch.device("cpu")
        self.loop = LoopState(self.owned_storages, monitor=config.monitor)
        self.loop.param_ids = {id(p) for p in self.reducer.params}
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
        self.runner.widening = (self.graphs_possible and not self.compiled
                                and os.environ.get("PYGRAPH_DIST_FAST_CASTS", "1") != "0"
                                and kernels.widening_ready(self.device))
        self.split = SplitGraphs(self.runner, self.loop.backward_finished)
        self.accum = LearnedAccumulation(self, enabled=config.learn_accumulation)
        self.evals = EvalGraphs(self)
        self._call_sync = True  # this model call's backward all-reduces (accumulation.py)
        self._split_step: GraphEntry | None = None  # tier 2: the entry graphed this step
        self.iteration = 0  # optimizer steps begun (model calls that start a step)
        self.require_sync = True  # False inside GraphedModule.no_sync()
        self.opt_state_version = 0
        self.buffers_sync_due = False  # see run()
        self.baked_changes: dict[str, int] = {}  # invalidations per baked hyperparameter key
        self.closed = False
        self._entry: GraphEntry | None = None
        self._phase = None
        # fast_lane.py: the entry whose InputGuard the next call is tried against
        # (the last one replayed), and zero_grad in one C++ call.
        self._guarded: GraphEntry | None = None
        self._guards = not config.pad_batch_to
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
        self.serial = lifetime.register(self)

    def _why_no_graphs(self, devices: list[str]) -> str:
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

    @property
    def grad_scaler(self):
        return self.step.grad_scaler

    @property
    def delegating_step(self) -> bool:
        return self.step.delegating

    @property
    def entries(self):
        return self.cache.entries

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
            return self.evals.call(args, kwargs)
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
            # Another model call in the same optimizer step (gradient accumulation,
            # several forwards): the loop runs as written, as with DDP, its
            # forward and backward graphed when this step's first call was (tier 2).
            self.loop.model_called(in_no_sync=not self.require_sync)
            if self._split_step is not None:
                entry, leaves = self._guard_match(args, kwargs), None
                if entry is None:
                    leaves, spec = _flatten((args, kwargs))
                    entry = self.cache.find(*self._signature(args, kwargs, leaves, spec), self._ambient())
                out = self._split_forward(entry, leaves) if entry is not None else None
                if out is not None:
                    return out
            return self._user_forward(args, kwargs, probe=self._phase == Phase.PROBE)
        self.loop.model_called(in_no_sync=not self.require_sync)
        self.iteration += 1
        # The entry replayed last accepts this call (its InputGuard: fast_lane.py),
        # or the call's key is built and looked up. leaves None: the guard holds
        # the call's tensors, copied by the replay.
        entry, leaves = self._guard_match(args, kwargs), None
        if entry is None:
            args, kwargs = self.cache.pad(args, kwargs)
            leaves, spec = _flatten((args, kwargs))
            masked, spec = self._signature(args, kwargs, leaves, spec)
            entry = self._entry_for(masked, spec)
            if entry.policy.phase == Phase.REPLAY and self._guards:
                self._guard(entry, args, kwargs, masked)
        if entry.policy.phase == Phase.REPLAY:
            drift = self.cache.drift(entry, self.reducer, self.optimizer,
                                     self.opt_plan.lr_tensors, self.opt_state_version)
            if drift:
                self._invalidate(entry, drift)
        elif entry.policy.phase == Phase.WARMUP and self.cache.captured_any:
            entry.policy.cap_warmup(0 if entry.warmups else 1)
        phase = entry.policy.begin_iteration()
        self._entry, self._phase = entry, phase
        entry.last_used = self.iteration
        if leaves is None and phase != Phase.REPLAY:  # drift: the long way from here
            leaves, _ = _flatten((args, kwargs))

        if phase in (Phase.PROBE, Phase.EAGER):
            return self._user_forward(args, kwargs, probe=phase == Phase.PROBE)
        if self.loop.split_reason:
            return self._split_call(entry, phase, args, kwargs, leaves)
        self.loop.mode = Mode.OWNED
        if phase == Phase.WARMUP:
            if not entry.first_seen_s:
                entry.first_seen_s = time.perf_counter()
            entry.warmups += 1
            with self.runner.timed(entry.eager_times, self._selecting(entry)):
                loss = self.runner.run_owned(self.step.to_device(args, kwargs))
            return self._hand_out(loss)
        if phase == Phase.CAPTURE:
            return self._hand_out(self.runner.capture(entry, args, kwargs, iteration=self.iteration,
                                                      state_version=self.opt_state_version))
        if not self._selecting(entry):
            return self._hand_out(self.runner.replay(entry, leaves, iteration=self.iteration))
        with self.runner.timed(entry.replay_times, True):
            loss = self.runner.replay(entry, leaves, iteration=self.iteration)
        if len(entry.replay_times) >= SELECT_REPLAYS:
            self.runner.select(entry, iteration=self.iteration)
        return self._hand_out(loss)

    def _guard_match(self, args: tuple, kwargs: dict) -> GraphEntry | None:
        """The entry replayed last, if this call has its signature (InputGuard)."""
        entry = self._guarded
        if entry is None or entry.guard is None or entry.guard_for is not entry.static_leaves:
            return None
        if not entry.guard.match(args, kwargs) or self._ambient() != entry.key[2]:
            return None
        return entry

    def _guard(self, entry: GraphEntry, args: tuple, kwargs: dict, masked: list) -> None:
        """Make ``entry`` the one the next call is tried against, with a guard
        for its current static inputs (a capture replaces them)."""
        if entry.guard_for is not entry.static_leaves:
            entry.guard = build_guard(args, kwargs, masked, entry.static_leaves)
            entry.guard_for = entry.static_leaves
        self._guarded = entry

    def _invalidate(self, entry: GraphEntry, drift: str) -> None:
        """Release ``entry``'s graphs for ``drift``; a hyperparameter the graphs
        bake in that changes again gets one warning with its line and the fix."""
        self.cache.invalidate(entry, self.iteration, drift)
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

    def _first_iteration(self) -> bool:
        return self.iteration <= 1

    def _selecting(self, entry: GraphEntry) -> bool:
        return self.runner.selecting(entry, self.graphs_possible)

    @timed("signature")
    def _ambient(self) -> tuple:
        """State outside the arguments that a graph bakes in: the caller's autocast."""
        kind = self.device.type
        return (torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind))

    def _signature(self, args: tuple, kwargs: dict, leaves: list, spec) -> tuple[list, object]:
        """The leaves and structure a call's signature is made of: the call's
        own, with the ``ignore_args`` values masked (each is one leaf, so the
        positions of the tensors do not move)."""
        if not self.ignored:
            return leaves, spec
        return pytree.tree_flatten(self.ignored.mask(args, kwargs))

    def _entry_for(self, leaves: list, spec) -> GraphEntry:
        entry, new = self.cache.lookup(leaves, spec, self._ambient())
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
        nested = name.endswith("]")  # a value inside a container argument: batch['step']
        fix = ("ignore_args takes whole arguments: pass it as an argument of its own, or as a tensor, "
               "or leave it out of the call" if nested else
               f"if the forward does not use it (like Lightning's batch_idx), pass "
               f"wrap(..., ignore_args=[{name}]); if it does, pass it as a tensor or leave it out "
               "of the call")
        detail = (f"argument {name} of the model call has taken {VaryingScalars.THRESHOLD} different "
                  "values in calls with the same tensor shapes: graphs are captured per value of a "
                  "Python argument (the forward may read it), so calls with a new value run eagerly; "
                  + fix)
        self.cache.event(entry, self.iteration, "argument varies", detail)
        if self.rank == 0:
            logger.warning("%s.", detail)

    # ---------------------------------------------------------------- tier 2
    def _split_call(self, entry: GraphEntry, phase, args, kwargs, leaves):
        """A step's first model call in a tier-2 loop: warm up eagerly, capture
        the forward/backward/step graphs, or replay the forward graph."""
        if phase == Phase.WARMUP:
            if not entry.first_seen_s:
                entry.first_seen_s = time.perf_counter()
            entry.warmups += 1
            return self._user_forward(args, kwargs, probe=False)
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
        out = self._split_forward(entry, leaves)
        return out if out is not None else self._user_forward(args, kwargs, probe=False)

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
        self.loop.handed_out(find_loss(out), watch=False)
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

    def _user_forward(self, args, kwargs, *, probe: bool):
        """Forward as written; the user's backward() and step() do the rest.
        Returns what the module returns."""
        if self.loop.owned and self.loop.zeroed_since_step:
            self.step.clear_grads()  # the user's zero_grad() was a no-op during owned iterations
        self.loop.user_forward(probe=probe,
                               grads_present=any(p.grad is not None for p in self.reducer.params))
        args, kwargs = self.step.to_device(args, kwargs)
        watcher = None
        if probe and self.ignored and not self.compiled:
            args, kwargs, watcher = self.ignored.watch(args, kwargs)
        with self.step.on_compute_stream(), watch_host_syncs(
                probe and self.device.type == "cuda", self.runner.sync_sites), \
                watcher if watcher is not None else contextlib.nullcontext():
            loss, out = self.step.forward(args, kwargs, sync=self._call_sync, need_loss=False)
        if watcher is not None:
            watcher.on = False
            for name, how, where in watcher.uses:
                self.loop.forward_violation(
                    f"the forward reads {name!r} ({how}), which wrap(ignore_args=...) leaves out of the "
                    "graphs' signatures", where,
                    f"A graph would replay the value it was captured with. Remove {name!r} from "
                    "ignore_args (each value then gets its own graph), or stop reading it in forward.")
        if self.grad_scaler is not None:
            # amp="fp16": the scale is applied in backward. To the loss when the
            # module returns one; otherwise to every output, so that whatever
            # loss the user computes from them is scaled exactly once.
            if loss is not None:
                scaled = self.step.scaled(loss)
                out = map_outputs(out, lambda t: scaled if t is loss else t)
                loss = scaled
            else:
                out = map_outputs(out, lambda t: self.step.scaled(t) if t.requires_grad else t)
        if probe:
            self.loop.output_nodes |= {t.grad_fn for t in output_tensors(out) if t.grad_fn is not None}
        self.loop.handed_out(loss, watch=probe)
        return out

    @timed("hand-out")
    def _hand_out(self, result):
        """The outputs of an iteration the engine ran: fresh tensors, since the
        graph's own are overwritten by the next replay. The loss requires grad so
        that the user's ``loss.backward()`` is valid; the monitor makes it a no-op."""
        loss, out = result
        fresh = loss.detach().clone()
        fresh.requires_grad_(True)
        self.loop.handed_out(fresh)
        if out is loss:
            return fresh
        return map_outputs(out, lambda t: fresh if t is loss else t.detach().clone())

    def _on_backward_finished(self) -> None:
        if self._entry is not None:
            self._entry.unused_seen.add(self.reducer.last_unused)
        self.loop.backward_finished()

    # ================================================= the optimizer's calls
    @timed("step routing")
    def optimizer_step(self, closure=None):
        """``optimizer.step()`` of the wrapped optimizer."""
        adopt_assigned_lrs(self.optimizer, self.opt_plan.lr_tensors)
        self.accum.step()  # pending local sums reduced first; K learned at the first step
        probe = self._phase == Phase.PROBE and not self.loop.owned
        owned = self.loop.owned
        seen = self.loop.step_called(closure, probe=probe)
        if owned:
            return None  # the graph (or the owned iteration) already stepped
        split, self._split_step = self._split_step, None
        if split is not None and self._split_step_now(split, closure):
            return None
        self.reducer.finish_pending()
        with self.step.on_compute_stream():
            result = self.step.apply_step(closure)
        if probe:
            self._finish_probe(self._entry, seen)
        return result

    @timed("zero_grad routing")
    def optimizer_zero_grad(self, set_to_none: bool = True) -> None:
        self.accum.zero_grad()
        self.loop.zero_grad_called()
        if not self.loop.owned and not self._clear_grads(set_to_none):
            with self.loop.unwatched():  # zero_grad() itself is judged by zero_grad_called()
                self.step.optimizer_class.zero_grad(self.optimizer, set_to_none)

    def _finish_probe(self, entry: GraphEntry, violations) -> None:
        whats: set[str] = set()
        unique = [v for v in violations if not (v.what in whats or whats.add(v.what))]  # each once
        verdict = agreement.agree(
            ok=not violations,
            reason="; ".join(str(v) for v in unique),
            digests=[],
            group=self.group,
            device=self.agree_device,
        )
        if not verdict.agreed:
            # Not one graph per iteration. Tier 2 if every rank's deviations
            # are ones forward/backward graphs with the user's code between them
            # still run as written (every rank takes this branch alike).
            blocking = [v for v in unique if not v.split_ok]
            split = agreement.agree(
                ok=not blocking, reason="; ".join(str(v) for v in blocking),
                digests=[], group=self.group, device=self.agree_device,
            )
            if split.agreed and self.graphs_possible:
                if not self.loop.split_reason and self.rank == 0:
                    logger.info("graphed per micro-batch (tier 2: forward and backward graphs, "
                                "your code between them, the step graph at optimizer.step()). "
                                "One graph per iteration (tier 1) would need: %s", verdict.reason)
                self.loop.split_reason = verdict.reason
                if entry.policy.phase != Phase.PROBE:
                    self.loop.probe_done = True
                return
            self.loop.split_reason = ""
            if not split.agreed:
                verdict = split
            self.loop.verdict = verdict.reason
            entry.policy.conformance_failed(verdict.reason)
            self.cache.event(entry, self.iteration, "loop not graphable", verdict.reason)
            if self.rank == 0:
                logger.warning("this training loop cannot be replayed as a CUDA graph: %s. "
                               "Training continues eagerly, exactly as written.", verdict.reason)
            return
        if entry.policy.phase != Phase.PROBE:  # last probe iteration done
            self.loop.probe_done = True
            if self.graphs_reason:
                entry.policy.disable(self.graphs_reason)

    def on_optimizer_state_loaded(self, extra) -> None:
        self.opt_plan = prepare_optimizer(self.optimizer, device=self.device, amp=self.amp,
                                          skip_nonfinite=self.config.skip_nonfinite,
                                          sparse=bool(self.reducer.sparse_params))
        if extra and self.grad_scaler is not None and "grad_scaler" in extra:
            self.grad_scaler.load_state_dict(extra["grad_scaler"])
        self.opt_state_version += 1

    def owned_storages(self) -> set[int]:
        """Storages of parameters, gradient buckets, optimizer state and lr tensors."""
        tensors = list(self.reducer.params) + [b for b in self.reducer.buffers if b is not None]
        for state in self.optimizer.state.values():
            tensors += [v for v in state.values() if isinstance(v, torch.Tensor)]
        tensors += [t for t in self.opt_plan.lr_tensors if t is not None]
        return {storage_ptr(t) for t in tensors} - {-1}

    # ================================================================== report
    def describe(self):
        """This model's :class:`~pygraph_dist.report.ModelReport`."""
        from dataclasses import asdict

        from .report import ModelReport

        if self.loop.verdict:
            loop = f"not graphable: {self.loop.verdict}"
        elif self.loop.probe_done and self.loop.split_reason:
            # What the check found; what ran is the signatures' (report.summarize).
            loop = (f"fits tier 2 (graphs per micro-batch, your code between them); not tier 1 "
                    f"because: {self.loop.split_reason}")
        elif self.loop.probe_done:
            loop = f"conforms (checked over {self.config.probe} probe iterations)"
        else:
            loop = "not checked yet"
        stock = self.device.type == "cuda" and self.fp_backend is None and self.graphs_possible
        backend = "graph-safe (pgd_nccl, fingerprints on)" if self.fp_backend is not None else (
            "stock (collective fingerprints off)" if self.device.type == "cuda" else "cpu")
        return ModelReport(
            model=type(self.module).__name__, rank=self.rank, world_size=self.world_size,
            graphs_possible=self.graphs_possible, graphs_reason=self.graphs_reason, loop=loop,
            amp=self.amp.name + (" (fp32 casts in graphs: Triton)" if self.runner.widening
                                 and self.amp.enabled else ""),
            optimizer=self.step.optimizer_class.__name__,
            optimizer_changes=list(self.opt_plan.changes), buckets=self.reducer.describe(),
            backend=backend, eager_buckets=self.reducer.describe_eager(),
            graphs=self.cache.describe(self.reducer.kinds),
            skipped_steps=int(self.step.skipped.item()) if self.step.skipped is not None else None,
            compile=describe_compile(self.config.compile, self.compile_stats, self.compile_user),
            events=[asdict(e) for e in self.cache.events],
            accumulation=self.accum.describe(), stock_backend=stock,
            tier1_needs=self.loop.split_reason if self.loop.probe_done else "",
        )

    # ================================================================ teardown
    def teardown(self) -> None:
        """Release every graph (and with it NCCL's references to the communicator).

        Also drops the engine's hold on the process group and the cycles through
        it (reducer hooks on the parameters, the optimizer's back-reference), so
        that the group's C++ objects are destroyed when the process group is,
        not during interpreter exit, where destroying them occasionally aborted
        the process. The optimizer keeps working as a plain optimizer."""
        if self.closed:
            return
        self.closed = True
        self.watchdog.close()
        self.loop.stop()
        if self.cache.release_all(TORN_DOWN) and torch.cuda.is_available():
            torch.cuda.synchronize(self.device)
        if self._release_stream is not None:
            self._release_stream()  # its graphs are destroyed: another model may capture on it
        self.reducer.remove_hooks()
        self.reducer.group = None
        self.group = None
        self.step.group = None
        self.runner.group = None
        self.fp_backend = None
        self.runner.fp_backend = None
        self.optimizer.__dict__.pop("_pgd_engine", None)


def _group_timeout_s(group) -> float:
    """The collective timeout the process group was created with (what init() was
    given), for the replay watchdog; torch keeps it on the group's backend options."""
    try:
        backend = group._get_backend(torch.device("cuda" if torch.cuda.is_available() else "cpu"))
        timeout = getattr(getattr(backend, "options", None), "_timeout", None)
        if timeout is not None:
            return float(timeout.total_seconds())
    except (RuntimeError, AttributeError, ValueError):
        pass
    from . import launch_env

    return launch_env.last_timeout_s()
