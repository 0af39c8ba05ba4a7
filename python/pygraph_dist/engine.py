"""The engine: whole training iterations captured as one CUDA graph, and replayed.

The user's loop stays as written::

    optimizer.zero_grad(set_to_none=True)
    loss = model(x, y)          # model = GraphedModule
    loss.backward()
    optimizer.step()

Per input signature (shapes, dtypes, devices, non-tensor arguments) an
iteration goes through the phases of the core's ``CapturePolicy``:

* **probe** (first iterations of the first signature): the loop runs exactly
  as written — forward in the model call, backward and step where the user
  calls them — while :class:`~pygraph_dist.monitor.LoopMonitor` checks that
  nothing in the user's code would be lost or repeated by a replay. The
  verdict is agreed by all ranks.
* **warmup**: the model call runs the *whole* iteration eagerly on the
  capture stream (forward, ``loss.backward()``, reduction, clipping, step);
  the user's ``backward()`` and ``step()`` then do nothing. Warm-up on the
  capture stream lets cuBLAS and friends allocate their workspaces outside the
  graph pool.
* **capture**: the same iteration recorded with ``torch.cuda.graph`` into the
  model's single memory pool, in thread-local capture mode, with the
  collective fingerprint recorded by the graph-safe backend; then every rank
  agrees (success flag, fingerprint, configuration digest). Agreed: the graph
  is replayed once to perform this iteration. Not agreed: every rank resets
  its graph, restores the CUDA RNG state, and runs this iteration eagerly.
* **replay**: inputs copied into the static buffers (no copy when the caller
  passes them), one ``graph.replay()``, and a fresh tensor holding the loss.
* **eager**: training as written, for good; the reason is in ``report()``.

Segments: when some gradient buckets cannot be reduced inside a graph
(sparse embedding gradients, ``eager_params``, a bucket whose all-reduce
failed capture), the iteration is captured as two graphs sharing the pool —
forward + backward with the other buckets' all-reduces, then clipping + the
optimizer step — and those buckets are reduced eagerly between them (sparse
parameters are also stepped eagerly, after the step graph). Every rank runs
the same split: it follows from the bucket plan, and the split is part of the
configuration digest the ranks agree on before the first replay.

Selection (``select=True``): warm-up iterations and the first replays are
timed (synchronised); the maxima over ranks are compared, and a graph that
is not faster than eager by ``select_margin`` is dropped on every rank.

Numerics: warm-up, eager and replay run the same kernels in the same order,
so graphed training is bitwise identical to the engine's eager mode
(``graphs=False``); tests check that against a 2-rank reference.
"""

from __future__ import annotations

import atexit
import contextlib
import enum
import hashlib
import logging
import threading
import time
import warnings
import weakref
from collections import OrderedDict, defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch import nn

from . import agreement
from ._ext import C, NOT_CAPTURABLE_TAG, graphs_available
from .amp import ScaleGrad, ensure_scale_initialised, make_grad_scaler, parse_amp
from .backend import graph_safe_backend
from .monitor import LoopMonitor, storage_ptr, user_location
from .optim import hyperparams_drift, make_graph_aware, prepare_optimizer, snapshot_hyperparams
from .reducer import SPARSE, BucketCaptureError, GradientReducer
from .watchdog import ReplayWatchdog

logger = logging.getLogger("pygraph_dist")

Phase = C.Phase


class LoopConformanceError(RuntimeError):
    """The training loop changed after graphs were captured, in a way a replay cannot honour."""


class Stage(enum.Enum):
    IDLE = "idle"          # between optimizer.step() and the next model call
    FORWARD = "forward"    # the model call returned; backward() expected
    BACKWARD = "backward"  # backward() done; optimizer.step() expected


@dataclass(frozen=True)
class WrapConfig:
    loss_fn: Callable | None = None
    amp: str | torch.dtype | None = None
    bucket_cap_mb: float = 25.0
    warmup: int = 3
    probe: int = 2
    graphs: bool = True
    max_grad_norm: float | None = None
    max_graphs: int = 8
    graph_memory_mb: float | None = None
    broadcast_buffers: bool = True
    replay_timeout: float | None = None
    monitor: bool = True
    eager_params: tuple[str, ...] = ()
    select: bool = True
    select_margin: float = 0.02
    pad_batch_to: tuple[int, ...] = ()
    pad_value: Any = 0


SELECT_REPLAYS = 3  # timed replays before the keep-or-drop decision


@dataclass
class GraphEntry:
    """Everything about one input signature of one wrapped model."""

    key: tuple
    description: str
    policy: Any  # C.CapturePolicy
    graph: torch.cuda.CUDAGraph | None = None  # the whole iteration, or forward + backward
    step_graph: torch.cuda.CUDAGraph | None = None  # segmented: clipping + optimizer step
    eager_buckets: tuple = ()  # buckets reduced between the two graphs
    sparse_grads: dict = field(default_factory=dict)  # param index -> captured local sparse grad
    unused_seen: set = field(default_factory=set)  # sets of params without a gradient, per iteration
    eager_times: list = field(default_factory=list)  # seconds per timed warm-up iteration
    replay_times: list = field(default_factory=list)  # seconds per timed replay
    selection: str = ""  # "kept: ..." / "dropped: ..." once decided
    eager_ms: float = 0.0  # agreed timings the selection used
    replay_ms: float = 0.0
    static: Any = None  # (args, kwargs) with device tensors the graph reads
    static_leaves: list = field(default_factory=list)
    static_loss: torch.Tensor | None = None
    collectives: str = ""
    n_collectives: int = 0
    first_seen_s: float = 0.0
    setup_s: float = 0.0      # first warm-up iteration -> capture agreed (synchronised)
    capture_s: float = 0.0
    pool_bytes: int = 0
    hyper_snapshot: list = field(default_factory=list)
    param_ptrs: list = field(default_factory=list)
    state_version: int = 0
    last_used: int = 0
    warmups: int = 0


_LIVE: "weakref.WeakSet[Engine]" = weakref.WeakSet()
_SERIAL = iter(range(1, 1 << 62))
_atexit_registered = False
_lock = threading.Lock()


def teardown_all() -> None:
    """Reset every live graph and synchronise, so that destroying the process
    group cannot hang (NCCL >= 2.26 waits for graphs that reference the
    communicator; pytorch#115388). Registered with atexit and run before
    ``torch.distributed.destroy_process_group``."""
    for engine in list(_LIVE):
        engine.teardown()


def _register_teardown() -> None:
    global _atexit_registered
    with _lock:
        if _atexit_registered:
            return
        # Registered at the first wrap(), i.e. after init_process_group, so it
        # runs before any exit handler registered earlier (atexit is LIFO).
        atexit.register(teardown_all)
        original = dist.destroy_process_group
        if not getattr(original, "_pgd_patched", False):
            def destroy_process_group(*args, **kwargs):
                teardown_all()
                return original(*args, **kwargs)

            destroy_process_group._pgd_patched = True  # type: ignore[attr-defined]
            destroy_process_group.__doc__ = original.__doc__
            dist.destroy_process_group = destroy_process_group
            dist.distributed_c10d.destroy_process_group = destroy_process_group
        _atexit_registered = True


def _leaf_key(leaf) -> tuple:
    if isinstance(leaf, torch.Tensor):
        return ("T", tuple(leaf.shape), leaf.dtype, leaf.device.type, leaf.requires_grad)
    hash(leaf)  # TypeError for unhashable arguments
    return ("V", type(leaf).__name__, leaf)


def _describe_leaves(leaves) -> str:
    parts = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            parts.append(f"{tuple(leaf.shape)} {str(leaf.dtype).replace('torch.', '')}")
        else:
            parts.append(repr(leaf))
    return ", ".join(parts) if parts else "no inputs"


def _extract_loss(out, source: str) -> torch.Tensor:
    loss = out
    if not isinstance(loss, torch.Tensor):
        if isinstance(out, dict) and "loss" in out:
            loss = out["loss"]
        elif getattr(out, "loss", None) is not None:
            loss = out.loss
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.is_floating_point():
        shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(out).__name__
        raise TypeError(
            f"pygraph_dist.wrap(): {source} must produce the scalar loss, got {shape}. Either make "
            "the module return the loss (a one-element tensor, or an object with a .loss such as "
            "Hugging Face outputs), or pass loss_fn=...: the model is then called as "
            "model(*inputs, target) and returns loss_fn(module(*inputs), target)."
        )
    return loss


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
        if getattr(optimizer, "_pgd_engine", None) is not None:
            raise ValueError("this optimizer is already wrapped by pygraph_dist.wrap()")
        if not 0.0 <= config.select_margin < 1.0:
            raise ValueError(f"select_margin must be in [0, 1), got {config.select_margin}")
        if any(not isinstance(b, int) or b <= 0 for b in config.pad_batch_to):
            raise ValueError(f"pad_batch_to takes positive batch sizes, got {config.pad_batch_to}")
        self.module = module
        self.optimizer = optimizer
        self.config = config
        self.group = group if group is not None else dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        self.world_size = dist.get_world_size(self.group)

        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
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

        reasons = []
        if not config.graphs:
            reasons.append("graphs are disabled (wrap(..., graphs=False))")
        ok, why = graphs_available()
        if not ok:
            reasons.append(why)
        if len(devices) > 1:
            reasons.append(f"parameters span several devices ({', '.join(devices)})")
        elif self.device.type != "cuda" and ok:
            reasons.append(f"the model is on {self.device}, not on a CUDA device")
        self.opt_plan = prepare_optimizer(optimizer, device=self.device, amp=self.amp)
        if not self.opt_plan.graphable and self.device.type == "cuda" and len(devices) == 1:
            reasons.append(self.opt_plan.reason)
        self.graphs_reason = reasons[0] if reasons else ""
        self.graphs_possible = not reasons and self.device.type == "cuda"

        self.grad_scaler = make_grad_scaler(self.device.type) if self.amp.needs_grad_scaler else None
        if self.grad_scaler is not None:
            ensure_scale_initialised(self.grad_scaler, self.device)
        self._base_cls = type(optimizer)
        self.delegating_step = False
        sparse = _sparse_param_names(module, {n for n, _ in named})
        if sparse:
            _check_sparse_support(sparse, optimizer, self.amp, config)
        self.reducer = GradientReducer(named, self.group, config.bucket_cap_mb,
                                       sparse=sparse, eager=config.eager_params)
        self.reducer.on_finalize = self._on_backward_finished
        self._sparse_ids = {id(p) for p in self.reducer.sparse_params}
        self._sync_module_states()
        make_graph_aware(optimizer, self)

        cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(self.device) if cuda else None
        self.pool = torch.cuda.graph_pool_handle() if self.graphs_possible else None
        self.fp_backend = graph_safe_backend(self.group, "cuda") if cuda else None
        self.agree_device = self.device if cuda else torch.device("cpu")
        self.monitor = LoopMonitor(self) if config.monitor else None
        timeout = config.replay_timeout
        if timeout is None:
            timeout = _group_timeout_s(self.group)
        self.watchdog = ReplayWatchdog(timeout if self.graphs_possible else 0)

        self.entries: OrderedDict[tuple, GraphEntry] = OrderedDict()
        self.captured_any = False
        self.sync_sites: list[str] = []  # host syncs the probe saw in forward (a hint)
        self.loop_violation: str | None = None
        self.probe_done = False
        self.stage = Stage.IDLE
        self.mode: str | None = None  # "user" or "owned": who runs backward/step this iteration
        self.zeroed_since_step = True
        self.iteration = 0
        self.opt_state_version = 0
        self.closed = False
        self.events: list[dict] = []
        self._entry: GraphEntry | None = None
        self._phase = None
        self._returned_loss: torch.Tensor | None = None
        self._buffers = [b for b in module.buffers()] if config.broadcast_buffers and self.world_size > 1 else []

        if self.opt_plan.changes and self.rank == 0:
            logger.info("optimizer %s reconfigured for capture: %s", self._base_cls.__name__,
                        ", ".join(self.opt_plan.changes))
        if self.graphs_reason and self.rank == 0:
            logger.info("graphs unavailable (%s); training runs eagerly", self.graphs_reason)
        self.serial = next(_SERIAL)  # creation order, for report()
        _LIVE.add(self)
        _register_teardown()

    # ================================================================ entry
    def run(self, args: tuple, kwargs: dict):
        """The wrapped model's call: one training iteration (or an evaluation)."""
        if not (self.module.training and torch.is_grad_enabled()) or self.closed:
            # Evaluation, or after teardown (no process group left): the module as is.
            return self._evaluate(args, kwargs)
        self._begin_iteration()
        if self.config.pad_batch_to:
            args, kwargs = _pad_batch(args, kwargs, self.config.pad_batch_to, self.config.pad_value)
        leaves, spec = pytree.tree_flatten((args, kwargs))
        entry = self._entry_for(leaves, spec)
        if entry.policy.phase == Phase.REPLAY:
            drift = self._graph_drift(entry)
            if drift:
                self._invalidate(entry, drift)
        elif entry.policy.phase == Phase.WARMUP and self.captured_any:
            entry.policy.cap_warmup(0 if entry.warmups else 1)
        phase = entry.policy.begin_iteration()
        self._entry, self._phase = entry, phase
        entry.last_used = self.iteration

        if phase == Phase.PROBE:
            return self._user_forward(entry, args, kwargs, probe=True)
        if phase == Phase.EAGER:
            return self._user_forward(entry, args, kwargs, probe=False)
        if phase == Phase.WARMUP:
            if not entry.first_seen_s:
                entry.first_seen_s = time.perf_counter()
            entry.warmups += 1
            with self._timed(entry.eager_times, self._selecting(entry)):
                loss = self._run_owned(self._to_device(args, kwargs))
            return self._hand_out(loss)
        if phase == Phase.CAPTURE:
            return self._capture(entry, args, kwargs)
        if self._selecting(entry):
            with self._timed(entry.replay_times, True):
                out = self._replay(entry, leaves)
            if len(entry.replay_times) >= SELECT_REPLAYS:
                self._select(entry)
            return out
        return self._replay(entry, leaves)

    # ========================================================== selection
    def _selecting(self, entry: GraphEntry) -> bool:
        return self.config.select and self.graphs_possible and not entry.selection

    @contextlib.contextmanager
    def _timed(self, into: list, enabled: bool):
        """Wall time of the block, synchronised before and after, appended to ``into``."""
        if not enabled:
            yield
            return
        torch.cuda.synchronize(self.device)
        t0 = time.perf_counter()
        yield
        torch.cuda.synchronize(self.device)
        into.append(time.perf_counter() - t0)

    def _select(self, entry: GraphEntry) -> None:
        """Keep the graph only if its replay beats the eager iteration by the margin.

        Every rank uses the maxima over ranks (an iteration takes as long as its
        slowest rank), so every rank takes the same decision."""
        # The first warm-up iteration carries lazy initialisation: leave it out when there are others.
        eager_local = min(entry.eager_times[1:] or entry.eager_times or [0.0])
        replay_local = min(entry.replay_times)
        t = torch.tensor([int(eager_local * 1e6), int(replay_local * 1e6)], dtype=torch.int64,
                         device=self.agree_device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        eager_us, replay_us = t.tolist()
        entry.eager_ms, entry.replay_ms = eager_us / 1e3, replay_us / 1e3
        if eager_us == 0:
            entry.selection = "kept (no eager iteration was timed)"
            return
        margin = self.config.select_margin
        text = (f"replay {replay_us / 1e3:.2f} ms vs eager {eager_us / 1e3:.2f} ms "
                f"({eager_us / max(replay_us, 1):.2f}x, max over ranks, synchronised)")
        if replay_us <= eager_us * (1.0 - margin):
            entry.selection = f"kept: {text}"
            self._event(entry, "selected", entry.selection)
            return
        entry.selection = f"dropped: {text}"
        self._release(entry)
        entry.policy.reject(f"the graph is not faster than eager by {margin:.0%} "
                            f"(select_margin): {text}")
        self._event(entry, "not selected", entry.policy.reason)
        if self.rank == 0:
            logger.info("graph for [%s] dropped: %s", entry.description, entry.policy.reason)

    def _begin_iteration(self) -> None:
        if self.stage is not Stage.IDLE:
            what = (
                "the wrapped model was called again before optimizer.step() (gradient "
                "accumulation, or a second forward pass in one training step)"
            )
            if self.mode == "owned":
                self._stop_monitor()
                raise LoopConformanceError(
                    f"{what} at {user_location()}, after graphs were captured: each graph replay "
                    "is one full optimizer step. Use one model call per optimizer.step(), or "
                    "wrap(..., graphs=False)."
                )
            if self.monitor is not None and self.monitor.active:
                self.monitor.record(what, "One model call per optimizer.step() can be graphed.")
            self.reducer.finish_pending()
        self.iteration += 1

    def _entry_for(self, leaves: list, spec) -> GraphEntry:
        try:
            key = (spec, tuple(_leaf_key(x) for x in leaves))
            hash(key)
        except TypeError:
            key = ("unhashable", id(self))
        entry = self.entries.get(key)
        if entry is not None:
            self.entries.move_to_end(key)
            return entry
        probe = 0 if self.probe_done else max(1, self.config.probe)
        # Once one signature has been captured, the lazy initialisation warm-up
        # exists for (optimizer state, cuBLAS workspaces on the capture stream,
        # NCCL communicators) is done: a new shape, such as the short last batch
        # of an epoch, needs one eager iteration, not the full warm-up.
        warmup = min(1, self.config.warmup) if self.captured_any else self.config.warmup
        policy = C.CapturePolicy(C.PolicyConfig(
            probe_iters=probe, warmup_iters=warmup,
            max_capture_attempts=2, max_recaptures=8,
        ))
        description = _describe_leaves(leaves)
        if key[0] == "unhashable":
            policy.disable("an argument of the model call is not hashable, so calls cannot be "
                           "matched to graphs; pass tensors and plain Python values")
        elif self.loop_violation:
            policy.conformance_failed(self.loop_violation)
        elif self.closed:
            policy.disable("pygraph_dist was torn down (destroy_process_group or exit)")
        elif probe == 0 and self.graphs_reason:
            policy.disable(self.graphs_reason)
        entry = GraphEntry(key=key, description=description, policy=policy)
        self.entries[key] = entry
        return entry

    # ========================================================== user mode
    def _user_forward(self, entry: GraphEntry, args, kwargs, *, probe: bool):
        """Forward as written; the user's backward() and step() do the rest."""
        if self.mode == "owned" and self.zeroed_since_step:
            self._clear_grads()  # the user's zero_grad() was a no-op during owned iterations
        if probe and self.iteration > 1 and not self.zeroed_since_step:
            if any(p.grad is not None for p in self.reducer.params) and self.monitor is not None:
                self.monitor.start("before the model call")
                self.monitor.record(
                    "optimizer.zero_grad() was not called since the previous optimizer.step(), so "
                    "gradients accumulate across iterations",
                    "A graph overwrites gradients every iteration; call zero_grad() once per step.",
                )
        self.mode = "user"
        self.reducer.enabled = True
        args, kwargs = self._to_device(args, kwargs)
        sync_sites: list[str] = []
        with self._on_compute_stream(), self._sync_watch(probe, sync_sites):
            self._broadcast_buffers()
            with self.amp.autocast():
                loss = self._loss(args, kwargs)
        # A sync seen in eager forward is only a hint: libraries such as
        # transformers skip theirs while a stream is capturing. Capture decides;
        # if it fails on a sync, its message cites these sites.
        for site in sync_sites:
            if site not in self.sync_sites:
                self.sync_sites.append(site)
        out = ScaleGrad.apply(loss, self.grad_scaler._scale) if self.grad_scaler is not None else loss
        self._returned_loss = out
        self.stage = Stage.FORWARD
        if probe and self.monitor is not None:
            self.monitor.start("between the model call and optimizer.step()")
        return out

    @contextlib.contextmanager
    def _sync_watch(self, enabled: bool, sites: list[str]):
        """On CUDA probes, turn host syncs in forward into warnings and collect where they happen."""
        if not (enabled and self.device.type == "cuda"):
            yield
            return
        previous = torch.cuda.get_sync_debug_mode()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                yield
            finally:
                torch.cuda.set_sync_debug_mode(previous)
        for w in caught:
            if "called a synchronizing CUDA operation" in str(w.message):
                sites.append(f"{w.filename}:{w.lineno}")
            elif "prototype feature" not in str(w.message):  # torch's notice about the debug mode
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)

    def monitor_backward(self, target, func, kwargs) -> bool:
        """Called by the LoopMonitor for every backward() in the user's window."""
        if isinstance(target, (list, tuple)) and len(target) == 1:
            target = target[0]
        extra = any(
            kwargs.get(k) is not None for k in ("gradient", "grad_tensors", "inputs")
        ) or bool(kwargs.get("create_graph"))
        expected = target is self._returned_loss and not extra and self.stage is Stage.FORWARD
        problem = (
            "backward() was called on a tensor other than the loss returned by the model call "
            "(for example loss / accumulation_steps, a sum with another loss, or "
            "scaler.scale(loss)), or with extra arguments"
            if target is not self._returned_loss or extra
            else "backward() was called twice in one training step"
        )
        fix = (
            "A graph applies the backward of the returned loss. Compute the full loss inside the "
            "model or loss_fn=..., and use amp='fp16' instead of your own GradScaler."
        )
        if self.mode == "user":
            if not expected and self.monitor is not None:
                self.monitor.record(problem, fix)
            if self.monitor is not None:
                self.monitor.set_window("between loss.backward() and optimizer.step()")
            return True
        if not expected:
            self._stop_monitor()
            raise LoopConformanceError(f"{problem} at {user_location()}, after graphs were captured. {fix}")
        self.stage = Stage.BACKWARD
        if self.monitor is not None:
            self.monitor.set_window("between loss.backward() and optimizer.step()")
        return False  # the graph (or the owned iteration) already ran it

    def _on_backward_finished(self) -> None:
        if self._entry is not None:
            self._entry.unused_seen.add(self.reducer.last_unused)
        if self.mode == "user":
            self.stage = Stage.BACKWARD

    def optimizer_step(self, closure=None):
        """``optimizer.step()`` of the wrapped optimizer."""
        if self.mode == "owned":
            violations = self._stop_monitor()
            if violations or closure is not None:
                why = str(violations[0]) if violations else "optimizer.step(closure) re-evaluates the model"
                raise LoopConformanceError(
                    f"{why} — after graphs were captured, the optimizer step already ran inside "
                    "the graph. Change the loop back, or wrap(..., graphs=False)."
                )
            if self.stage is Stage.FORWARD and self.monitor is not None:
                raise LoopConformanceError(
                    f"optimizer.step() without loss.backward() at {user_location()}, after graphs "
                    "were captured: the graph always runs backward. Call loss.backward()."
                )
            self.stage = Stage.IDLE
            self.zeroed_since_step = False
            return None

        probe = self._phase == Phase.PROBE and self.mode == "user"
        if probe and self.monitor is not None:
            if closure is not None:
                self.monitor.record("optimizer.step(closure)", "Closures re-evaluate the model; a graph cannot.")
            if self.stage is Stage.FORWARD:
                self.monitor.record(
                    "optimizer.step() was called without loss.backward()",
                    "A graph always runs backward before the step.",
                )
        violations = self._stop_monitor()
        self.reducer.finish_pending()
        with self._on_compute_stream():
            result = self._apply_step(closure)
        self.stage = Stage.IDLE
        self.zeroed_since_step = False
        if probe:
            self._finish_probe(self._entry, violations)
        return result

    def optimizer_zero_grad(self, set_to_none: bool = True) -> None:
        if self.stage is Stage.BACKWARD:
            what = "zero_grad() between loss.backward() and optimizer.step() discards the gradients"
            if self.mode == "owned":
                self._stop_monitor()
                raise LoopConformanceError(f"{what} at {user_location()}, after graphs were captured.")
            if self.monitor is not None and self.monitor.active:
                self.monitor.record(what, "Call zero_grad() before the model call or after step().")
        self.zeroed_since_step = True
        if self.mode != "owned":
            self._base_cls.zero_grad(self.optimizer, set_to_none)

    def _finish_probe(self, entry: GraphEntry, violations) -> None:
        verdict = agreement.agree(
            ok=not violations,
            reason="; ".join(str(v) for v in violations),
            digests=[],
            group=self.group,
            device=self.agree_device,
        )
        if not verdict.agreed:
            self.loop_violation = verdict.reason
            entry.policy.conformance_failed(verdict.reason)
            self._event(entry, "loop not graphable", verdict.reason)
            if self.rank == 0:
                logger.warning(
                    "pygraph_dist: this training loop cannot be replayed as a CUDA graph: %s. "
                    "Training continues eagerly, exactly as written.", verdict.reason,
                )
            return
        if entry.policy.phase != Phase.PROBE:  # last probe iteration done
            self.probe_done = True
            if self.graphs_reason:
                entry.policy.disable(self.graphs_reason)

    # ========================================================= owned mode
    @contextlib.contextmanager
    def _on_compute_stream(self):
        """Run on the capture stream, ordered after and before the caller's stream.

        Every iteration computes there, probe and eager ones included, so that
        the AccumulateGrad nodes autograd caches per parameter (kept alive by
        any loss the user still holds) always carry the capture stream; a node
        created on another stream makes capture fail (torch warns "The
        AccumulateGrad node's stream does not match", input_buffer.cpp)."""
        if self.stream is None:
            yield
            return
        current = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(current)
        with torch.cuda.stream(self.stream):
            yield
        current.wait_stream(self.stream)

    def _run_owned(self, inputs) -> torch.Tensor:
        """One whole iteration, eagerly, on the capture stream."""
        self.mode = "owned"
        with self._on_compute_stream():
            self._clear_grads()
            loss = self._body(inputs)
        return loss

    def _body(self, inputs) -> torch.Tensor:
        """What a graph contains: forward, loss, backward + reduction, clipping, step."""
        loss = self._forward_backward(inputs)
        self._apply_step(None)
        return loss

    def _forward_backward(self, inputs) -> torch.Tensor:
        args, kwargs = inputs
        self.reducer.enabled = True
        self._broadcast_buffers()
        with self.amp.autocast():
            loss = self._loss(args, kwargs)
        scaled = ScaleGrad.apply(loss, self.grad_scaler._scale) if self.grad_scaler is not None else loss
        scaled.backward()
        self.reducer.finish_pending()
        return loss.detach()

    def _capture_segments(self, entry: GraphEntry, graph, static):
        """Record the iteration: one graph, or forward+backward and step graphs."""
        if not entry.eager_buckets:
            with torch.cuda.graph(graph, pool=self.pool, stream=self.stream,
                                  capture_error_mode="thread_local"):
                return self._body(static), None
        self.reducer.defer_eager = True
        try:
            with torch.cuda.graph(graph, pool=self.pool, stream=self.stream,
                                  capture_error_mode="thread_local"):
                loss = self._forward_backward(static)
        finally:
            self.reducer.defer_eager = False
        entry.sparse_grads = {i: self.reducer.params[i].grad
                              for i, s in enumerate(self.reducer.is_sparse) if s}
        step_graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(step_graph, pool=self.pool, stream=self.stream,
                                  capture_error_mode="thread_local"):
                self._apply_step(None, part="graphed")
        except BaseException:
            _discard(step_graph)
            raise
        return loss, step_graph

    def _launch(self, entry: GraphEntry) -> None:
        """Run one captured iteration on the current stream: the graph, or the
        segments with the eager reductions (and sparse steps) between them."""
        entry.graph.replay()
        if entry.step_graph is None:
            return
        self.reducer.reduce_eager(entry.eager_buckets, entry.sparse_grads)
        entry.step_graph.replay()
        if self._sparse_ids:
            self._apply_step(None, part="sparse")

    def _capture(self, entry: GraphEntry, args, kwargs):
        self.mode = "owned"
        static = pytree.tree_map(self._static_copy, self._to_device(args, kwargs))
        entry.static = static
        entry.static_leaves = pytree.tree_leaves(static)
        torch.cuda.synchronize(self.device)
        generator = torch.cuda.default_generators[self.device.index or 0]
        rng_snapshot = generator.clone_state()
        graph = torch.cuda.CUDAGraph()
        step_graph = None
        entry.eager_buckets = self.reducer.eager_buckets
        self._clear_grads()
        if not any(e.graph is not None for e in self.entries.values()):
            # Once every graph captured into a pool id has been released, the
            # allocator keeps the id with use_count 0 and asserts on the next
            # capture into it ("it->second->use_count > 0", CUDACachingAllocator
            # create_or_incref_pool): after a failed capture, an invalidation
            # or eviction of the last graph, start a fresh pool.
            self.pool = torch.cuda.graph_pool_handle()
        # torch.cuda.graph empties the cache on entry; do it first so that the
        # growth of reserved memory measures this graph's new pool segments.
        torch.cuda.empty_cache()
        if self.fp_backend is not None:
            self.fp_backend.start_recording()
        reserved0 = torch.cuda.memory_reserved(self.device)
        t0 = time.perf_counter()
        error: BaseException | None = None
        static_loss = None
        try:
            static_loss, step_graph = self._capture_segments(entry, graph, static)
        except Exception as exc:  # noqa: BLE001 - every failure becomes an agreed fallback
            error = exc
        finally:
            fingerprint = self.fp_backend.stop_recording() if self.fp_backend is not None else None
        entry.capture_s = time.perf_counter() - t0
        if error is not None:
            self.reducer.abandon()
            self._restore_after_failed_capture(generator, rng_snapshot)
        reason, retryable = _describe_capture_error(error)
        if error is not None and "host synchronisation" in reason and self.sync_sites:
            reason += f"; the probe saw host syncs in forward at {', '.join(self.sync_sites[:3])}"
        paths = _varying_paths(entry.unused_seen) if error is None else ""
        if paths:
            reason, retryable = paths, False
        config_text = self._config_text(entry)
        verdict = agreement.agree(
            ok=error is None and not paths,
            reason=reason,
            digests=[fingerprint.digest if fingerprint is not None else 0, _digest(config_text)],
            group=self.group,
            device=self.agree_device,
            details={"collectives": fingerprint.records() if fingerprint is not None else [],
                     "config": config_text},
            explain=_explain_mismatch,
            retryable=retryable,
        )
        if not verdict.agreed:
            if error is None:
                self._restore_after_failed_capture(generator, rng_snapshot)
            _discard(graph)
            _discard(step_graph)
            entry.sparse_grads = {}
            # A bucket whose all-reduce failed capture on any rank leaves the
            # graph on every rank (agreed), and the next capture is segmented.
            failed = self._agreed_failed_buckets(error)
            for b in failed:
                self.reducer.set_eager(b, f"its all-reduce failed capture: {verdict.reason}")
            entry.policy.capture_failed(verdict.reason, bool(failed) or not verdict.final)
            nxt = "will retry after warm-up" if entry.policy.phase != Phase.EAGER else "running eagerly"
            self._event(entry, "capture failed", f"{verdict.reason} ({nxt})")
            if self.rank == 0 or error is not None:
                logger.warning("pygraph_dist: capture for inputs [%s] failed on %s: %s",
                               entry.description, "this rank" if error is not None else "another rank",
                               f"{verdict.reason}; {nxt}")
            return self._hand_out(self._run_owned(static))

        pool_bytes = self._agreed_max(torch.cuda.memory_reserved(self.device) - reserved0)
        entry.graph = graph
        entry.step_graph = step_graph
        entry.static_loss = static_loss
        entry.collectives = fingerprint.describe(4) if fingerprint is not None else "not recorded (stock backend)"
        entry.n_collectives = len(fingerprint) if fingerprint is not None else -1
        entry.pool_bytes = max(0, pool_bytes)
        entry.hyper_snapshot = snapshot_hyperparams(self.optimizer)
        entry.param_ptrs = [p.data_ptr() for p in self.reducer.params]
        entry.state_version = self.opt_state_version
        entry.policy.capture_succeeded()
        self.captured_any = True
        self._enforce_cache_limits(entry)
        if entry.graph is None:  # did not fit the memory cap
            return self._hand_out(self._run_owned(static))
        with torch.cuda.stream(self.stream):
            self._launch(entry)  # capture records without running: this performs the iteration
        torch.cuda.synchronize(self.device)
        entry.setup_s = time.perf_counter() - (entry.first_seen_s or t0)
        self._event(entry, "captured", f"{entry.collectives}; {self._describe_segments(entry)}; capture "
                    f"{entry.capture_s * 1e3:.0f} ms, pool {entry.pool_bytes / 2**20:.1f} MiB")
        if self.rank == 0:
            logger.info("captured [%s]: %s, capture %.0f ms, setup %.2f s",
                        entry.description, entry.collectives, entry.capture_s * 1e3, entry.setup_s)
        return self._hand_out(static_loss)

    def _replay(self, entry: GraphEntry, leaves: list):
        """``leaves``: the call's flattened (args, kwargs), in the order of entry.static_leaves."""
        self.mode = "owned"
        for static, leaf in zip(entry.static_leaves, leaves):
            if isinstance(leaf, torch.Tensor) and leaf is not static:
                static.copy_(leaf, non_blocking=True)
        for p, view in zip(self.reducer.params, self.reducer.views):
            if p.grad is not view and view is not None:
                p.grad = view  # the user set it to None; the graph writes the view
        self._launch(entry)
        self.watchdog.after_replay(f"[{entry.description}] at iteration {self.iteration}")
        return self._hand_out(entry.static_loss)

    def _hand_out(self, loss: torch.Tensor) -> torch.Tensor:
        """A fresh tensor with this iteration's loss: the static one is overwritten by
        the next replay. It requires grad so that the user's ``loss.backward()`` is
        valid; the monitor turns that call into a no-op."""
        out = loss.detach().clone()
        out.requires_grad_(True)
        self._returned_loss = out
        self.stage = Stage.FORWARD
        if self.monitor is not None:
            self.monitor.start("between the model call and optimizer.step()")
        return out

    # ============================================================ helpers
    def _loss(self, args, kwargs) -> torch.Tensor:
        loss_fn = self.config.loss_fn
        if loss_fn is None:
            return _extract_loss(self.module(*args, **kwargs), "the wrapped module")
        if not args:
            raise TypeError(
                "with loss_fn=..., call the wrapped model as model(*inputs, target): the last "
                "positional argument is the target"
            )
        out = self.module(*args[:-1], **kwargs)
        return _extract_loss(loss_fn(out, args[-1]), "loss_fn")

    def _apply_step(self, closure, part: str = "all"):
        """Clip (if configured), then step — through GradScaler for fp16.

        With sparse parameters the step is split, always in the same way:
        ``part="graphed"`` steps the dense parameters (the step graph),
        ``part="sparse"`` the sparse ones (eagerly: sparse updates sync), and
        ``"all"`` does both in that order, so eager and graphed training
        run the same kernels. wrap() refuses clipping and fp16 with sparse
        gradients, so both parts are plain optimizer steps."""
        self.delegating_step = True
        try:
            ids = self._sparse_ids
            if ids:
                result = None
                if part in ("all", "graphed"):
                    with _only_params(self.optimizer, lambda p: id(p) not in ids):
                        result = self.optimizer.step(closure) if closure is not None else self.optimizer.step()
                if part in ("all", "sparse"):
                    with _only_params(self.optimizer, lambda p: id(p) in ids):
                        self.optimizer.step()
                return result
            if self.config.max_grad_norm is not None:
                if self.grad_scaler is not None:
                    self.grad_scaler.unscale_(self.optimizer)
                grads = [p for p in self.reducer.params if p.grad is not None]
                torch.nn.utils.clip_grad_norm_(grads, self.config.max_grad_norm)
            if self.grad_scaler is not None:
                result = self.grad_scaler.step(self.optimizer)
                self.grad_scaler.update()
                return result
            return self.optimizer.step(closure) if closure is not None else self.optimizer.step()
        finally:
            self.delegating_step = False

    def _clear_grads(self) -> None:
        for p in self.reducer.params:
            p.grad = None

    def _to_device(self, args, kwargs):
        if self.device.type != "cuda":
            return args, kwargs

        def move(x):
            if isinstance(x, torch.Tensor) and x.device != self.device:
                return x.to(self.device, non_blocking=True)
            return x

        return pytree.tree_map(move, (args, kwargs))

    def _static_copy(self, x):
        if isinstance(x, torch.Tensor):
            s = torch.empty_like(x, device=self.device)
            s.copy_(x)
            return s
        return x

    def _broadcast_buffers(self) -> None:
        """Rank 0's buffers at the start of every forward, as DDP(broadcast_buffers=True)."""
        if not self._buffers:
            return
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = defaultdict(list)
        for b in self._buffers:
            by_dtype[b.dtype].append(b)
        for tensors in by_dtype.values():
            flat = torch._utils._flatten_dense_tensors(tensors)
            dist.broadcast(flat, src=dist.get_global_rank(self.group, 0), group=self.group)
            if self.rank != 0:
                torch._foreach_copy_(tensors, torch._utils._unflatten_dense_tensors(flat, tensors))

    def _sync_module_states(self) -> None:
        """Start every rank from rank 0's parameters and buffers, as DDP does."""
        if self.world_size == 1:
            return
        src = dist.get_global_rank(self.group, 0)
        with torch.no_grad():
            for t in list(self.module.parameters()) + list(self.module.buffers()):
                dist.broadcast(t.data, src=src, group=self.group)

    def _agreed_max(self, value: int) -> int:
        t = torch.tensor([value], dtype=torch.int64, device=self.agree_device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return int(t.item())

    def _config_text(self, entry: GraphEntry) -> str:
        hyper = [{k: (float(v.item()) if isinstance(v, torch.Tensor) and v.numel() == 1 else
                      (repr(v) if not isinstance(v, torch.Tensor) else "tensor"))
                  for k, v in g.items()} for g in snapshot_hyperparams(self.optimizer)]
        split = [(b, self.reducer.kinds[b]) for b in entry.eager_buckets]
        return repr((entry.description, self.amp.name, self.config.max_grad_norm, hyper, split))

    def _agreed_failed_buckets(self, error: BaseException | None) -> list[int]:
        """Buckets whose all-reduce failed capture on any rank (MAX over ranks).
        Called by every rank after a failed agreement, so the collective matches."""
        n = len(self.reducer.buffers)
        if n == 0:
            return []
        flags = torch.zeros(n, dtype=torch.int64, device=self.agree_device)
        bucket_error = _bucket_error(error)
        if bucket_error is not None:
            flags[bucket_error.bucket] = 1
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group)
        return [b for b, f in enumerate(flags.tolist()) if f]

    def _describe_segments(self, entry: GraphEntry) -> str:
        if entry.graph is None and entry.step_graph is None:
            return "no graph"
        if entry.step_graph is None:
            return "1 graph (whole iteration)"
        kinds = [self.reducer.kinds[b] for b in entry.eager_buckets]
        sparse = kinds.count(SPARSE)
        parts = [f"bucket{'s' if len(kinds) > 1 else ''} {', '.join(map(str, entry.eager_buckets))} "
                 f"reduced eagerly between them"]
        if sparse:
            parts.append(f"{sparse} sparse parameter{'s' if sparse > 1 else ''} stepped eagerly after")
        return "2 graphs (forward+backward, step); " + "; ".join(parts)

    def _restore_after_failed_capture(self, generator, rng_snapshot) -> None:
        """Undo what a failed capture leaves behind. A capture that dies before
        ``capture_end`` leaves the CUDA generator in capture mode, and the next
        eager dropout fails with 'Offset increment outside graph capture
        encountered unexpectedly': give the generator its pre-capture state back."""
        generator.graphsafe_set_state(rng_snapshot)
        self._clear_grads()
        if self.grad_scaler is not None:
            from torch.amp.grad_scaler import _refresh_per_optimizer_state

            self.grad_scaler._per_optimizer_states = defaultdict(_refresh_per_optimizer_state)
        with torch.cuda.stream(self.stream):
            if C.current_stream_is_capturing():
                raise RuntimeError("pygraph_dist: the capture stream is still capturing after a "
                                   "failed capture; cannot continue safely")
        torch.cuda.synchronize(self.device)

    # ============================================================ graphs
    def _graph_drift(self, entry: GraphEntry) -> str | None:
        if entry.graph is None:
            return "the graph was released"
        if entry.state_version != self.opt_state_version:
            return "the optimizer state was loaded (its tensors moved)"
        if [p.data_ptr() for p in self.reducer.params] != entry.param_ptrs:
            return "a parameter's storage was replaced (for example load_state_dict(assign=True) or p.data = ...)"
        return hyperparams_drift(self.optimizer, entry.hyper_snapshot, self.opt_plan.lr_tensors)

    def _release(self, entry: GraphEntry) -> None:
        _discard(entry.graph)
        _discard(entry.step_graph)
        entry.graph = None
        entry.step_graph = None
        entry.sparse_grads = {}
        entry.static_loss = None

    def _invalidate(self, entry: GraphEntry, reason: str) -> None:
        self._release(entry)
        entry.first_seen_s = 0.0
        entry.policy.invalidate(reason)
        nxt = "capturing again after warm-up" if entry.policy.phase != Phase.EAGER else "running eagerly"
        self._event(entry, "invalidated", f"{reason} ({nxt})")
        if self.rank == 0:
            logger.info("graph for [%s] invalidated: %s; %s", entry.description, reason, nxt)

    def _enforce_cache_limits(self, newest: GraphEntry) -> None:
        """LRU out beyond max_graphs or graph_memory_mb. Deterministic on every rank:
        the key sequence is the same everywhere and pool sizes are agreed (max)."""
        live = [e for e in self.entries.values() if e.graph is not None]
        cap = self.config.graph_memory_mb
        cap_bytes = None if cap is None else int(cap * 2**20)
        if cap_bytes is not None and newest.pool_bytes > cap_bytes:
            self._release(newest)
            newest.policy.reject(
                f"its graph needs {newest.pool_bytes / 2**20:.0f} MiB, above graph_memory_mb={cap:g}"
            )
            self._event(newest, "not kept", newest.policy.reason)
            return
        live.sort(key=lambda e: e.last_used)
        while live and (
            len(live) > self.config.max_graphs
            or (cap_bytes is not None and sum(e.pool_bytes for e in live) > cap_bytes)
        ):
            victim = live.pop(0)
            if victim is newest:
                continue
            self._invalidate(victim, f"evicted from the graph cache (least recently used; "
                                     f"max_graphs={self.config.max_graphs})")

    # ======================================================== lifecycle
    def on_optimizer_state_loaded(self, extra) -> None:
        self.opt_plan = prepare_optimizer(self.optimizer, device=self.device, amp=self.amp)
        if extra and self.grad_scaler is not None and "grad_scaler" in extra:
            self.grad_scaler.load_state_dict(extra["grad_scaler"])
        self.opt_state_version += 1

    def owned_storages(self) -> set[int]:
        tensors = list(self.reducer.params) + [b for b in self.reducer.buffers if b is not None]
        for state in self.optimizer.state.values():
            tensors += [v for v in state.values() if isinstance(v, torch.Tensor)]
        tensors += [t for t in self.opt_plan.lr_tensors if t is not None]
        return {storage_ptr(t) for t in tensors} - {-1}

    def _stop_monitor(self):
        if self.monitor is None:
            return []
        return self.monitor.stop()

    def _evaluate(self, args, kwargs):
        """Eval mode or no_grad: the module's own output (or loss_fn's), no graphs."""
        args, kwargs = self._to_device(args, kwargs)
        with self.amp.autocast():
            if self.config.loss_fn is None:
                return self.module(*args, **kwargs)
            return self.config.loss_fn(self.module(*args[:-1], **kwargs), args[-1])

    def _event(self, entry: GraphEntry | None, what: str, detail: str) -> None:
        self.events.append({
            "iteration": self.iteration,
            "inputs": entry.description if entry is not None else "",
            "event": what,
            "detail": detail,
        })

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
        self._stop_monitor()
        released = False
        for entry in self.entries.values():
            if entry.graph is not None:
                self._release(entry)
                entry.policy.disable("pygraph_dist was torn down (destroy_process_group or exit)")
                released = True
        if released and torch.cuda.is_available():
            torch.cuda.synchronize(self.device)
        self.reducer.remove_hooks()
        self.reducer.group = None
        self.group = None
        self.fp_backend = None
        self.optimizer.__dict__.pop("_pgd_engine", None)


def _sparse_param_names(module: nn.Module, trainable: set[str]) -> list[str]:
    """Weights of nn.Embedding / nn.EmbeddingBag(sparse=True): their gradients are sparse."""
    names = []
    for prefix, m in module.named_modules():
        if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse:
            name = f"{prefix}.weight" if prefix else "weight"
            if name in trainable:
                names.append(name)
    return names


def _check_sparse_support(sparse: list[str], optimizer, amp, config: WrapConfig) -> None:
    what = f"sparse gradients ({', '.join(sparse[:3])})"
    if amp.needs_grad_scaler:
        raise ValueError(f"amp='fp16' with {what} is not supported: loss scaling would have to "
                         "unscale sparse gradients outside the graph. Use amp='bf16' or fp32, or "
                         "nn.Embedding(sparse=False).")
    if config.max_grad_norm is not None:
        raise ValueError(f"max_grad_norm with {what} is not supported: the global norm needs the "
                         "sparse gradients, which are reduced outside the graph. Clip without "
                         "sparse embeddings, or use nn.Embedding(sparse=False).")
    if not isinstance(optimizer, (torch.optim.SGD, torch.optim.Adagrad)):
        raise ValueError(f"{type(optimizer).__name__} does not take {what}; use torch.optim.SGD "
                         "or Adagrad, or nn.Embedding(sparse=False).")


@contextlib.contextmanager
def _only_params(optimizer: torch.optim.Optimizer, keep: Callable[[torch.Tensor], bool]):
    """Let ``optimizer.step()`` see only the parameters ``keep`` selects.
    Per-parameter optimizers (all that wrap() accepts with sparse gradients)
    update each parameter from its own state, so a split step is the same step."""
    saved = [g["params"] for g in optimizer.param_groups]
    try:
        for g in optimizer.param_groups:
            g["params"] = [p for p in g["params"] if keep(p)]
        yield
    finally:
        for g, params in zip(optimizer.param_groups, saved):
            g["params"] = params


def _pad_batch(args: tuple, kwargs: dict, sizes: tuple[int, ...], value) -> tuple[tuple, dict]:
    """Pad dim 0 of every tensor with the call's batch size up to the next size in ``sizes``.

    ``value`` is one fill value, or one per positional argument (e.g. ``(0, -100)``:
    targets filled with cross-entropy's ignore_index, so padded rows add nothing
    to a mean loss). Keyword tensors are filled with 0 (or the scalar value)."""
    tensors = [a for a in args if isinstance(a, torch.Tensor) and a.dim() > 0]
    if not tensors:
        return args, kwargs
    batch = tensors[0].shape[0]
    target = min((s for s in sizes if s >= batch), default=None)
    if target is None or target == batch:
        return args, kwargs
    per_arg = isinstance(value, (tuple, list))

    def pad(t, fill):
        if not isinstance(t, torch.Tensor) or t.dim() == 0 or t.shape[0] != batch:
            return t
        extra = t.new_full((target - batch, *t.shape[1:]), fill)
        return torch.cat([t, extra], dim=0)

    new_args = tuple(pad(a, value[i] if per_arg and i < len(value) else (0 if per_arg else value))
                     for i, a in enumerate(args))
    new_kwargs = {k: pad(v, 0 if per_arg else value) for k, v in kwargs.items()}
    return new_args, new_kwargs


def _varying_paths(unused_seen: set) -> str:
    """Non-empty when the set of parameters without a gradient changed between iterations."""
    if len(unused_seen) <= 1:
        return ""
    sets = list(unused_seen)
    varying = sorted(set().union(*sets) - set.intersection(*map(set, sets)))
    shown = ", ".join(varying[:4]) + (f" +{len(varying) - 4}" if len(varying) > 4 else "")
    return (f"parameter(s) {shown} received gradients in some iterations and not in others: the "
            "forward pass takes data- or step-dependent paths, and a graph would replay one path "
            "for ever. Make the forward take the same path every iteration (a bucket cannot leave "
            "the graph for this: the forward itself would be frozen)")


def _bucket_error(error: BaseException | None) -> BucketCaptureError | None:
    """The BucketCaptureError in ``error``'s chain, if a bucket's all-reduce caused it."""
    e, seen = error, 0
    while e is not None and seen < 6:
        if isinstance(e, BucketCaptureError):
            return e
        e, seen = e.__cause__ or e.__context__, seen + 1
    return None


def _discard(graph: torch.cuda.CUDAGraph | None) -> None:
    if graph is None:
        return
    try:
        graph.reset()
    except RuntimeError as exc:  # a capture that never ended may refuse; nothing else to free
        logger.debug("graph.reset() after a failed capture: %s", exc)


def _describe_capture_error(error: BaseException | None) -> tuple[str, bool]:
    """(reason, retryable) for a local capture failure."""
    if error is None:
        return "", True
    bucket_error = _bucket_error(error)
    if bucket_error is not None:
        return str(bucket_error), True
    # torch.cuda.graph.__exit__ ends the capture even when the body raised, so
    # the error we catch may be capture_end's; the cause is in the chain.
    chain, e = [], error
    while e is not None and len(chain) < 4:
        chain.append(f"{type(e).__name__}: {e}".strip())
        e = e.__cause__ or e.__context__
    text = "\n".join(chain)
    first = chain[-1].splitlines()[0][:400] if chain else ""
    if NOT_CAPTURABLE_TAG in text:
        return first.replace(NOT_CAPTURABLE_TAG, "").strip(), False
    lowered = text.lower()
    if "not permitted when stream is capturing" in lowered or (
        "capture" in lowered and ("invalidated" in lowered or "unsupported" in lowered)
    ):
        return (
            "a host synchronisation happened during capture (e.g. .item(), .cpu(), nonzero, "
            "boolean-mask indexing, a blocking copy, printing a tensor) in the model, the loss "
            f"or the optimizer; CUDA said: {first}"
        ), False
    if "capturable is false" in lowered:
        return f"the optimizer is not capturable: {first}", False
    return first, True


def _digest(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


def _explain_mismatch(everyone: list[dict]) -> str:
    """Which ranks captured what, for a fingerprint or configuration mismatch."""
    first = everyone[0]
    for other in everyone[1:]:
        if other["digests"][0] != first["digests"][0]:
            a, b = first["details"]["collectives"], other["details"]["collectives"]
            i = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))

            def show(seq):
                if i >= len(seq):
                    return "nothing"
                r = seq[i]
                return f"{r['kind']} {r['dtype']} x{r['numel']}"

            return (
                f"ranks captured different collective sequences: rank {first['rank']} captured "
                f"{len(a)}, rank {other['rank']} captured {len(b)}; first difference at #{i}: "
                f"rank {first['rank']} {show(a)} vs rank {other['rank']} {show(b)}"
            )
        if other["digests"][1] != first["digests"][1]:
            return (
                f"rank {first['rank']} and rank {other['rank']} captured different "
                f"configurations (inputs, amp, clipping or optimizer hyperparameters): "
                f"{first['details']['config']} vs {other['details']['config']}"
            )
    return "ranks disagree"


def _group_timeout_s(group) -> float:
    """The collective timeout of ``group`` (what init() was given), for the replay watchdog."""
    from . import launch_env

    return launch_env.last_timeout_s()
