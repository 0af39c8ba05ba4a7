"""Warm-up, capture, agreement, replay and selection of one signature's graphs.

The life of a graph, as the engine drives it (each a visible branch of
``Engine.run``):

1. **warm-up** — :meth:`GraphRunner.run_owned`: the whole iteration, eagerly,
   on the capture stream, so that cuBLAS workspaces, optimizer state and NCCL
   communicators are created outside the graph's pool.
2. **capture** — :meth:`GraphRunner.capture`: the same iteration recorded with
   ``torch.cuda.graph`` into the model's pool (thread-local capture mode and
   the RNG guards of :func:`capture_guard.capture_into`, the graph-safe
   backend recording the collective fingerprint); one graph, or two segments
   with eager bucket reductions between them. A capture that raised becomes a
   reason through :func:`capture_guard.describe_capture_error`.
3. **agree** — success, fingerprint and configuration digest, via
   :func:`pygraph_dist.launch.agreement.agree`. Agreed: the graph is launched once to
   perform this iteration. Not agreed: every rank discards its graphs,
   restores the CUDA RNG state and runs this iteration eagerly; a bucket whose
   all-reduce failed capture on any rank leaves the graph on every rank.
4. **replay** — :meth:`GraphRunner.replay`: inputs copied into the static
   buffers, the graphs launched, the watchdog armed.
5. **select** — :meth:`GraphRunner.select`: timed warm-up iterations against the
   first replays (maxima over ranks); a graph not faster than eager by the
   margin is dropped on every rank.
"""

from __future__ import annotations

import contextlib
import logging
import time

import torch
import torch.utils._pytree as pytree

from ..graphs import host_copies
from ..graphs.capture_guard import _bucket_error, capture_into, describe_capture_error, end_failed_capture
from ..graphs.graph_cache import GraphCache, GraphEntry, discard
from ..graphs.pool_account import PoolAccount, held_grad_bytes
from ..launch import agreement
from ..loop.param_groups import group_versions, snapshot_hyperparams
from ..reduce.reducer import GradientReducer
from ..runtime import kernels
from ..runtime._ext import C
from ..runtime.spans import timed
from ..step.step import IterationStep

logger = logging.getLogger("pygraph_dist")

Phase = C.Phase
SELECT_REPLAYS = 3  # timed replays before the keep-or-drop decision


class GraphRunner:
    def __init__(self, step: IterationStep, reducer: GradientReducer, cache: GraphCache, *,
                 optimizer: torch.optim.Optimizer, group, agree_device: torch.device,
                 fp_backend, watchdog, select: bool, select_margin: float) -> None:
        self.step = step
        self.reducer = reducer
        self.cache = cache
        self.optimizer = optimizer
        self.group = group
        self.rank = step.rank
        self.device = step.device
        self.agree_device = agree_device
        self.fp_backend = fp_backend
        self.watchdog = watchdog
        self.select_enabled = select
        self.select_margin = select_margin
        self.sync_sites: list[str] = []  # host syncs the probe saw in forward (a hint)
        self.widening = False  # set by the engine: kernels.WideningCasts around captures
        # Set by the engine: watch the torch calls of captures for other CUDA
        # generators (capture_into). Not around compiled modules: a
        # torch-function mode would meet dynamo.
        self.watch_generators = False
        # host_copies.py: host tensors copied in forward, graphed once a capture
        # met one (the engine enables it where a dispatch mode may run).
        self.host_watch = host_copies.HostWatch()

    # ----------------------------------------------------------- warm-up
    def run_owned(self, inputs):
        """One whole iteration, eagerly, on the capture stream; ``(loss, outputs)``."""
        with self.step.on_compute_stream():
            self.step.clear_grads()
            return self.step.body(inputs)

    # ----------------------------------------------------------- capture
    def capture(self, entry: GraphEntry, args, kwargs, *, iteration: int,
                state_version: int):
        """Capture, agree, and perform this iteration (by a first launch, or
        eagerly when the ranks did not agree). Returns ``(loss, outputs)``."""
        try:
            return self._capture(entry, args, kwargs, iteration=iteration, state_version=state_version)
        finally:
            # Gradients kept by the capture outlive it only once committed
            # (grad_adoption.py), whatever left it: an error, Ctrl-C.
            self.reducer.adoption.drop()

    def _capture(self, entry: GraphEntry, args, kwargs, *, iteration: int, state_version: int):
        step = self.step
        static = pytree.tree_map(step.static_copy, step.to_device(args, kwargs))
        entry.static = static
        entry.static_leaves = pytree.tree_leaves(static)
        torch.cuda.synchronize(self.device)
        generator = torch.cuda.default_generators[self.device.index or 0]
        rng_snapshot = generator.clone_state()
        graph = torch.cuda.CUDAGraph()
        step_graph = None
        entry.eager_buckets = self.reducer.eager_buckets
        step.clear_grads()
        pool = self.cache.pool_for_capture()
        # torch.cuda.graph empties the cache on entry; do it first so that the
        # growth of reserved memory measures this graph's new pool segments.
        torch.cuda.empty_cache()
        if self.fp_backend is not None:
            self.fp_backend.start_recording()
        reserved0 = torch.cuda.memory_reserved(self.device)
        t0 = time.perf_counter()
        error: BaseException | None = None
        static_result = None
        account = PoolAccount(self.device, lambda: held_grad_bytes(self.reducer.params, self.reducer.views))
        step.mark = account.mark
        try:
            with host_copies.substituting(self.host_watch, entry):
                static_result, step_graph = self._record(entry, graph, static, pool)
            account.mark("step")
        except Exception as exc:  # noqa: BLE001 - every failure becomes an agreed fallback
            error = exc
        finally:
            step.mark = None
            fingerprint = self.fp_backend.stop_recording() if self.fp_backend is not None else None
        entry.capture_s = time.perf_counter() - t0
        if error is not None:
            self.reducer.abandon()
            self._restore_after_failed_capture(generator, rng_snapshot)
        reason, retryable = describe_capture_error(error)
        reason, retryable = host_copies.capture_failed(self.host_watch, entry, error, reason, retryable)
        if error is not None and "host synchronisation" in reason and self.sync_sites:
            reason += f"; the probe saw host syncs in forward at {', '.join(self.sync_sites[:3])}"
        paths = varying_paths(entry.unused_seen) if error is None else ""
        if paths:
            reason, retryable = paths, False
        config_text = self._config_text(entry)
        verdict = agreement.agree(
            ok=error is None and not paths,
            reason=reason,
            digests=[fingerprint.digest if fingerprint is not None else 0,
                     agreement.config_digest(config_text)],
            group=self.group,
            device=self.agree_device,
            details={"collectives": fingerprint.records() if fingerprint is not None else [],
                     "config": config_text},
            explain=agreement.explain_mismatch,
            retryable=retryable,
        )
        if not verdict.agreed:
            if error is None:
                self._restore_after_failed_capture(generator, rng_snapshot)
            discard(graph)
            discard(step_graph)
            entry.sparse_grads = {}
            # A bucket whose all-reduce failed capture on any rank leaves the
            # graph on every rank (agreed), and the next capture is segmented.
            bucket_error = _bucket_error(error)
            failed = agreement.agreed_failed_buckets(
                len(self.reducer.buffers), bucket_error.bucket if bucket_error is not None else None,
                group=self.group, device=self.agree_device)
            self.reducer.adoption.drop()
            for b in failed:
                self.reducer.set_eager(b, f"its all-reduce failed capture: {verdict.reason}")
            self.capture_failed(entry, iteration, verdict.reason, bool(failed) or not verdict.final,
                                local_error=error is not None)
            return self.run_owned(static)

        entry.graph = graph
        entry.step_graph = step_graph
        entry.static_result = static_result
        if not self.accept_capture(entry, fingerprint, reserved0, state_version, iteration):
            self.reducer.adoption.drop()
            return self.run_owned(static)  # did not fit the memory cap
        entry.pool_detail = account.describe(entry.pool_bytes)
        self.reducer.commit_adoption()  # world size 1: the graph's gradients are .grad
        with torch.cuda.stream(step.stream):
            self.launch(entry)  # capture records without running: this performs the iteration
        torch.cuda.synchronize(self.device)
        entry.setup_s = time.perf_counter() - (entry.first_seen_s or t0)
        self.captured_event(entry, iteration)
        if self.rank == 0:
            logger.info("captured [%s]: %s, capture %.0f ms, setup %.2f s",
                        entry.description, entry.collectives, entry.capture_s * 1e3, entry.setup_s)
        return static_result

    # Bookkeeping both tiers share (split.SplitGraphs.capture is the other caller).
    def accept_capture(self, entry: GraphEntry, fingerprint, reserved0: int, state_version: int,
                       iteration: int) -> bool:
        """A capture every rank agreed on: its collectives, pool size (max over
        ranks), the drift snapshot, the policy, the cache's limits. False when
        the entry did not fit the memory cap (it then runs eagerly)."""
        pool_bytes = agreement.agreed_max([torch.cuda.memory_reserved(self.device) - reserved0],
                                          group=self.group, device=self.agree_device)[0]
        entry.collectives = (fingerprint.describe(4) if fingerprint is not None
                             else "not recorded (stock backend)")
        if fingerprint is not None and not len(fingerprint) and self.reducer.world_size == 1:
            entry.collectives = "none (world size 1: nothing to all-reduce)"
        entry.n_collectives = len(fingerprint) if fingerprint is not None else -1
        entry.pool_bytes = max(0, pool_bytes)
        entry.drift.hyperparams = snapshot_hyperparams(self.optimizer)
        entry.drift.versions = group_versions(self.optimizer)
        entry.drift.params = self.reducer.param_state()
        entry.drift.state_version = state_version
        entry.policy.capture_succeeded()
        self.cache.captured_any = True
        self.cache.enforce_limits(entry, iteration)
        return entry.live

    def captured_event(self, entry: GraphEntry, iteration: int) -> None:
        self.cache.event(entry, iteration, "captured",
                         f"{entry.collectives}; {entry.segments(self.reducer.kinds)}; capture "
                         f"{entry.capture_s * 1e3:.0f} ms, pool {entry.pool_bytes / 2**20:.1f} MiB"
                         f"{host_copies.describe(entry)}")

    def capture_failed(self, entry: GraphEntry, iteration: int, reason: str, retry: bool, *,
                       local_error: bool, what: str = "capture") -> None:
        """A capture that failed on some rank (agreed): the policy, the event
        log, and one warning (rank 0, or the rank where it failed)."""
        entry.policy.capture_failed(reason, retry)
        nxt = "will retry after warm-up" if entry.policy.phase != Phase.EAGER else "running eagerly"
        self.cache.event(entry, iteration, "capture failed", f"{reason} ({nxt})")
        if self.rank == 0 or local_error:
            logger.warning("%s for inputs [%s] failed on %s: %s; %s", what, entry.description,
                           "this rank" if local_error else "another rank", reason, nxt)

    def casts(self):
        """Narrow-to-fp32 copies as the widen kernel while recording (kernels.WideningCasts)."""
        return kernels.WideningCasts() if self.widening else contextlib.nullcontext()

    def capturing(self, graph, pool):
        """Record into ``graph`` as every capture of this model does (capture_into,
        on the capture stream)."""
        return capture_into(graph, pool=pool, stream=self.step.stream, watch_generators=self.watch_generators)

    def _record(self, entry: GraphEntry, graph, static, pool):
        """Record the iteration: one graph, or forward+backward and step graphs."""
        step = self.step
        if not entry.eager_buckets:
            # World size 1, no other graph reading the gradient views: this
            # graph's gradients may become them (grad_adoption.py).
            if self.reducer.adoption.enabled and not any(e.live for e in self.cache.entries.values()):
                self.reducer.adoption.begin()
            with self.capturing(graph, pool), self.casts():
                return step.body(static), None
        self.reducer.defer_eager = True
        try:
            with self.capturing(graph, pool), self.casts():
                result = step.forward_backward(static)
        finally:
            self.reducer.defer_eager = False
        entry.sparse_grads = {i: self.reducer.params[i].grad
                              for i, s in enumerate(self.reducer.is_sparse) if s}
        step_graph = torch.cuda.CUDAGraph()
        try:
            with self.capturing(step_graph, pool):
                step.apply_step(None, part="graphed", owned=True)
        except BaseException:
            discard(step_graph)
            raise
        return result, step_graph

    def _config_text(self, entry: GraphEntry) -> str:
        """What every rank must have captured alike besides the collectives."""
        hyper = [{k: (float(v.item()) if isinstance(v, torch.Tensor) and v.numel() == 1 else
                      (repr(v) if not isinstance(v, torch.Tensor) else "tensor"))
                  for k, v in g.items()} for g in snapshot_hyperparams(self.optimizer)]
        split = [(b, self.reducer.kinds[b]) for b in entry.eager_buckets]
        clip = self.step.routed_clip
        return repr((entry.description, self.step.amp.name, self.step.max_grad_norm, hyper, split,
                     str(self.reducer.comm_dtype), clip.max_norm if clip is not None else None))

    def _restore_after_failed_capture(self, generator, rng_snapshot) -> None:
        """Undo what a failed iteration capture leaves behind: the generator and
        capture stream (:func:`~pygraph_dist.graphs.capture_guard.end_failed_capture`),
        and the iteration's gradients and scaler round, which the eager rerun
        computes again."""
        self.step.clear_grads()
        self.step.reset_grad_scaler_round()
        end_failed_capture(generator, rng_snapshot, self.step.stream, self.device)

    # ------------------------------------------------------------ replay
    def launch(self, entry: GraphEntry, label: str = "") -> None:
        """Run one captured iteration on the current stream: the graph, or the
        segments with the eager reductions (and sparse steps) between them.
        Launches go through the watchdog, which releases the GIL and times them
        (a launch blocked by a full queue behind a dead peer is a timeout too)."""
        self.watchdog.replay([entry.graph], label)
        if entry.step_graph is None:
            return
        self.reducer.reduce_eager(entry.eager_buckets, entry.sparse_grads)
        self.watchdog.replay([entry.step_graph], label)
        if self.step.sparse_ids:
            self.step.apply_step(None, part="sparse")

    def replay(self, entry: GraphEntry, leaves: list, *, iteration: int):
        """``leaves``: the call's flattened (args, kwargs), in the order of entry.static_leaves."""
        copy_inputs(entry, leaves)
        self.reducer.expose_grads()  # the user set them to None; the graph writes the views
        label = f"[{entry.description}] at iteration {iteration}"
        if entry.step_graph is None:  # one graph: launched and watched in one call
            self.watchdog.replay([entry.graph], label, collectives=entry.collectives, arm=True)
        else:
            self.launch(entry, label)
            self.watchdog.after_replay(label, collectives=entry.collectives)
        return entry.static_result

    # --------------------------------------------------------- selection
    def selecting(self, entry: GraphEntry, graphs_possible: bool) -> bool:
        return self.select_enabled and graphs_possible and not entry.selection

    @contextlib.contextmanager
    def timed(self, into: list, enabled: bool):
        """Wall time of the block, synchronised before and after, appended to ``into``."""
        if not enabled:
            yield
            return
        torch.cuda.synchronize(self.device)
        t0 = time.perf_counter()
        yield
        torch.cuda.synchronize(self.device)
        into.append(time.perf_counter() - t0)

    def select(self, entry: GraphEntry, *, iteration: int) -> None:
        """Keep the graph only if its replay beats the eager iteration by the margin.

        Every rank uses the maxima over ranks (an iteration takes as long as its
        slowest rank), so every rank takes the same decision."""
        # The first warm-up iteration carries lazy initialisation: leave it out when there are others.
        eager_local = min(entry.eager_times[1:] or entry.eager_times or [0.0])
        replay_local = min(entry.replay_times)
        eager_us, replay_us = agreement.agreed_max(
            [int(eager_local * 1e6), int(replay_local * 1e6)], group=self.group, device=self.agree_device)
        entry.eager_ms, entry.replay_ms = eager_us / 1e3, replay_us / 1e3
        if eager_us == 0:
            entry.selection = "kept (no eager iteration was timed)"
            return
        margin = self.select_margin
        text = (f"replay {replay_us / 1e3:.2f} ms vs eager {eager_us / 1e3:.2f} ms "
                f"({eager_us / max(replay_us, 1):.2f}x, max over ranks, synchronised)")
        if replay_us <= eager_us * (1.0 - margin):
            entry.selection = f"kept: {text}"
            self.cache.event(entry, iteration, "selected", entry.selection)
            return
        entry.selection = f"dropped: {text}"
        self.cache.release(entry)
        entry.policy.reject(f"the graph is not faster than eager by {margin:.0%} "
                            f"(select_margin): {text}")
        self.cache.event(entry, iteration, "not selected", entry.policy.reason)
        if self.rank == 0:
            logger.info("graph for [%s] dropped: %s", entry.description, entry.policy.reason)


@timed("input copies")
def copy_inputs(entry: GraphEntry, leaves: list | None) -> None:
    """The call's tensors into the graph's static inputs (a tensor that is
    already the static buffer, as ``GraphedModule.static_inputs()`` hands out, is
    not copied). ``leaves`` None: the call was matched by the entry's InputGuard,
    which holds its tensors (fast_lane.py)."""
    if leaves is None:
        entry.guard.copy_pending()
        return
    for static, leaf in zip(entry.static_leaves, leaves):
        if isinstance(leaf, torch.Tensor) and leaf is not static:
            static.copy_(leaf, non_blocking=True)


def varying_paths(unused_seen: set) -> str:
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
