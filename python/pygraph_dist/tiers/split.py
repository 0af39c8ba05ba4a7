"""Tier 2: the loop's own code between graphs.

When the probe finds a loop that a whole-iteration graph cannot replay but
that keeps the shape "model calls, backward, optimizer step" — the loss
computed outside the model, ``loss / k`` and gradient accumulation (with or
without ``no_sync()``), sums of losses, ``clip_grad_norm_`` or a GradScaler
between ``backward()`` and ``step()``, ``.item()`` logging — each micro-batch
gets graphs of its own and the user's code runs eagerly between them:

* a **forward graph** (static inputs -> static outputs, buffers broadcast as
  in tier 1) replayed at the model call; the call returns fresh copies of the
  outputs, attached to autograd through :class:`_GraphedCall`;
* a **backward graph** replayed by ``_GraphedCall.backward`` when the user's
  ``backward()`` reaches the outputs: it copies the incoming output gradients
  into static buffers and replays ``autograd.backward`` of the static
  outputs, which accumulates straight into the persistent ``.grad`` buffers
  (views of the reducer's buckets) with the bucket all-reduces inside,
  overlapped as in tier 1. Micro-batches called inside ``no_sync()`` replay
  a variant without the all-reduces. No per-parameter work leaves the graph;
* a **step graph** (clipping if configured, the optimizer step, fp16's
  scaler update) replayed at ``optimizer.step()``.

Gradients, as eager training computes them: the first synchronised backward
after ``zero_grad(set_to_none=True)`` replays a variant captured with every
``.grad`` None, so autograd hands each gradient over and the reducer scales it
into its bucket view (the kernels of an eager backward, no zeroing pass); any
other backward accumulates into the bucket views (a ``.grad`` the user set to
None becomes its zeroed view first, 0 + g == g). Either way tier 2 is bitwise
equal to ``graphs=False``.

Memory: the forward graph's saved activations are needed only from its replay
to its backward graph's, as in eager training. The last backward capture runs
without ``retain_graph`` and frees them as it goes, into the graphs' shared
pool, so that the step graph and graphs captured later use that memory for
their temporaries, as an eager step reuses freed activations. This is safe
because in a loop tier 2 accepts no other graph runs between a forward replay
and its backward (several forwards into one loss stay eager, and a backward
through a superseded replay raises); the static outputs stay allocated (they
are copied out at each call).
"""

from __future__ import annotations

import logging
import time

import torch
import torch.utils._pytree as pytree
from torch.autograd import Variable

from ..graphs import host_copies
from ..graphs.capture_guard import _bucket_error, describe_capture_error
from ..graphs.graph_cache import GraphEntry, discard
from ..graphs.pool_account import PoolAccount
from ..launch import agreement
from ..loop.loss_match import LaneRun
from ..loop.outputs import fresh_copy, map_outputs
from ..reduce.reducer import OutsideGradientError
from ..runtime import patches
from ..runtime.spans import timed
from .capture import copy_inputs, varying_paths
from .split_lane import LaneCaptureError, LaneGraphs, output_tensors

logger = logging.getLogger("pygraph_dist")


class _GraphedCall(torch.autograd.Function):
    """Fresh copies of a forward graph's outputs whose backward replays the
    backward graph. ``dummy`` (a 0-dim leaf requiring grad) makes autograd
    record the node; it never receives a gradient."""

    @staticmethod
    @timed("autograd.Function")
    def forward(ctx, call, dummy):  # noqa: ARG004 - dummy only connects the node
        ctx.call = call
        outs = tuple(fresh_copy(t) for t in call.entry.static_outs)
        if call.lane is not None:  # loss_lane.py: the loss's calls on them are watched
            outs = tuple(call.lane.wrap_outputs(outs))
        frozen = [o for o, d in zip(outs, call.entry.diff_mask) if not d]
        if frozen:
            ctx.mark_non_differentiable(*frozen)
        return outs

    @staticmethod
    @timed("autograd.Function")
    def backward(ctx, *grads):
        ctx.call.backward(grads)
        return None, None


def _current_stream() -> tuple:
    """The current CUDA stream of the current device, as torch.cuda.current_stream()
    describes it to its Stream: (stream id, device index, device type)."""
    return patches.current_stream_key()


class _Call:
    """One replayed micro-batch: which backward graph its backward replays."""

    __slots__ = ("split", "entry", "sync", "label", "stream", "done", "lane")

    def __init__(self, split: SplitGraphs, entry: GraphEntry, sync: bool, label: str) -> None:
        self.split, self.entry, self.sync, self.label = split, entry, sync, label
        # (stream id, device, type): torch.cuda.current_stream() builds a Stream
        # object through device lookups (~10 us, twice per micro-batch; issue 26).
        self.stream = _current_stream()
        self.done = False
        self.lane: LaneRun | None = None

    def backward(self, grads) -> None:
        self.split.backward(self, grads)


class SplitGraphs(LaneGraphs):
    """Capture and replay of tier 2's forward, backward and step graphs (and
    the loss lane's, split_lane.py)."""

    def __init__(self, runner, on_backward_finished) -> None:
        self.runner = runner  # the GraphRunner: step, reducer, cache, watchdog, agreement
        self.on_backward_finished = on_backward_finished
        self.dummy = None
        self.graph_round = False  # a backward graph ran in the current autograd backward
        self._init_lane()

    @property
    def step(self):
        return self.runner.step

    @property
    def reducer(self):
        return self.runner.reducer

    # ------------------------------------------------------------ gradients
    @timed("grad views")
    def attach_grads(self) -> None:
        """Every gradient becomes its bucket view again; a gradient that was
        None is zero (what accumulating into a fresh gradient computes), one
        the user replaced is copied into the view."""
        params, views = self.reducer.params, self.reducer.views
        watch = self.reducer.watch
        if watch is not None:  # one C++ pass (csrc/param_watch.h): nothing to do, usually
            missing = watch.not_views()
            if not missing:
                return
        trainable = [i for i, p in enumerate(params) if p.requires_grad]  # frozen: .grad left alone
        if watch is None:
            missing = [i for i in trainable if params[i].grad is not views[i]]
        if not missing:
            return
        if len(missing) == len(trainable):
            if all(params[i].grad is None for i in missing):
                self.reducer.zero_views()
                for i in trainable:
                    params[i].grad = views[i]
                return
        for i in missing:
            p, v = params[i], views[i]
            if p.grad is None:
                v.zero_()
            else:
                v.copy_(p.grad)
            p.grad = v

    # -------------------------------------------------------------- capture
    def capture(self, entry: GraphEntry, args, kwargs, *, iteration: int, state_version: int,
                no_sync_variant: bool) -> bool:
        """Capture the forward, backward (one or two variants) and step graphs
        for ``entry`` and agree on them. Returns whether they are live; on
        False every rank runs this micro-batch eagerly."""
        runner, step, reducer = self.runner, self.step, self.reducer
        device = step.device
        static = pytree.tree_map(step.static_copy, step.to_device(args, kwargs))
        entry.static = static
        entry.static_leaves = pytree.tree_leaves(static)
        torch.cuda.synchronize(device)
        grads_were_none = reducer.all_grads_none()  # zero_grad(set_to_none=True) before this call
        generator = torch.cuda.default_generators[device.index or 0]
        rng_snapshot = generator.clone_state()
        pool = runner.cache.pool_for_capture()
        torch.cuda.empty_cache()
        # loss_lane.py: every rank learned the loss, or none captures it (a collective
        # outside the capture, made by every rank: all capture this signature now).
        lane = self._lane_trace(entry, agree=not no_sync_variant and step.grad_scaler is None)
        if self.dummy is None:
            self.dummy = torch.zeros((), device=device, requires_grad=True)
        with torch.no_grad():
            self.attach_grads()  # so that the backward graph accumulates into the views
        graphs: dict = {}
        fwd = torch.cuda.CUDAGraph()
        if runner.fp_backend is not None:
            runner.fp_backend.start_recording()
        reserved0 = torch.cuda.memory_reserved(device)
        account = PoolAccount(device)  # tier 2's gradients are the bucket views, outside the pool
        t0 = time.perf_counter()
        error: BaseException | None = None

        try:
            with runner.capturing(fwd, pool), runner.casts(), \
                    host_copies.substituting(runner.host_watch, entry):
                args_, kwargs_ = static
                loss, out = step.forward(args_, kwargs_, sync=True, need_loss=False)
            account.mark("forward")
            tensors = output_tensors(out)
            diff = [t.requires_grad for t in tensors]
            if not any(diff):
                raise RuntimeError("no output of the model call requires grad")
            with torch.cuda.stream(step.stream):
                static_grads = [torch.zeros_like(t) for t, d in zip(tensors, diff) if d]
            roots = [t for t, d in zip(tensors, diff) if d]
            # amp="fp16": the scale multiplies the loss's gradient when the module
            # returns a loss, every output's otherwise (as the eager path does).
            scaled = [loss is None or t is loss for t in roots] if step.grad_scaler is not None else None
            # True/False: accumulate into the existing .grad, with/without the
            # all-reduces. "fresh": the first synchronised backward after
            # zero_grad(set_to_none=True), captured with every .grad None, so that
            # autograd hands each gradient over (no zeroing, no accumulation pass),
            # exactly as in eager training. "fresh" is captured last and without
            # retain_graph: its saved activations are freed as its backward runs,
            # as in an eager backward, instead of all staying live next to the
            # gradients it allocates (see "Memory").
            # "lane" (loss_lane.py): the loop's own loss, learned in the warm-up,
            # replayed on the outputs, then the "fresh" backward.
            keys = ((False, True) if no_sync_variant else (True,)) + (("lane",) if lane else ()) + ("fresh",)
            for key in keys:
                g = torch.cuda.CUDAGraph()
                graphs[key] = g
                reducer.enabled = key is not False
                with torch.no_grad():
                    if key in ("fresh", "lane"):
                        for p in reducer.params:
                            p.grad = None
                    else:
                        self.attach_grads()
                if key == "lane":
                    self._capture_lane(entry, g, pool, tensors, roots, lane)
                    continue
                with runner.capturing(g, pool), runner.casts():
                    grads = static_grads
                    if scaled is not None:
                        scale = step.grad_scaler._scale  # noqa: SLF001
                        grads = [s * scale if m else s for s, m in zip(static_grads, scaled)]
                    torch.autograd.backward(roots, grads, retain_graph=key != "fresh")
            account.mark("backward")
            step_graph = torch.cuda.CUDAGraph()
            graphs["step"] = step_graph
            with runner.capturing(step_graph, pool):
                step.apply_step(None)
            account.mark("step")
        except Exception as exc:  # noqa: BLE001 - every failure becomes an agreed fallback
            error = exc
        finally:
            reducer.enabled = True
            fingerprint = runner.fp_backend.stop_recording() if runner.fp_backend is not None else None
        entry.capture_s = time.perf_counter() - t0
        if error is not None:
            reducer.abandon()
        reason, retryable = describe_capture_error(error)
        reason, retryable = host_copies.capture_failed(runner.host_watch, entry, error, reason, retryable)
        if isinstance(error, LaneCaptureError):
            reason, retryable = str(error), True
        paths = varying_paths(entry.unused_seen) if error is None else ""
        if paths:
            reason, retryable = paths, False
        config_text = runner._config_text(entry) + " split"  # noqa: SLF001
        verdict = agreement.agree(
            ok=error is None and not paths, reason=reason,
            digests=[fingerprint.digest if fingerprint is not None else 0,
                     agreement.config_digest(config_text)],
            group=runner.group, device=runner.agree_device,
            details={"collectives": fingerprint.records() if fingerprint is not None else [],
                     "config": config_text},
            explain=agreement.explain_mismatch, retryable=retryable,
        )
        if not verdict.agreed:
            runner._restore_after_failed_capture(generator, rng_snapshot)  # noqa: SLF001
            discard(fwd)
            for g in graphs.values():
                discard(g)
            if _bucket_error(error) is not None:
                verdict_reason = f"{verdict.reason} (tier 2 keeps every bucket in the graph)"
            else:
                verdict_reason = verdict.reason
            runner.capture_failed(entry, iteration, verdict_reason, not verdict.final,
                                  local_error=error is not None, what="tier-2 capture")
            return False

        entry.tier = 2
        entry.graph = fwd
        entry.step_graph = graphs.pop("step")
        entry.bwd_graphs = graphs
        detached = map_outputs(out, lambda t: t.detach())  # no autograd graph kept
        entry.out_template = detached
        entry.static_outs = output_tensors(detached)
        entry.diff_mask = diff
        entry.static_grads = static_grads
        entry.selection = "kept (tier 2 is not timed against eager)"
        if grads_were_none:
            # The capture left .grad as the bucket views; None again, as the loop
            # left it: this step's backward starts from no gradients like every
            # later step's (the "fresh" or "lane" graph, or autograd when the
            # memory cap refuses the graphs), not from zeroed views, and its
            # loss can run in the lane (computed eagerly, its memory would stay
            # cached by the allocator next to the graphs' pool).
            step.clear_grads()
        if not runner.accept_capture(entry, fingerprint, reserved0, state_version, iteration):
            return False
        entry.pool_detail = account.describe(entry.pool_bytes)
        entry.setup_s = time.perf_counter() - (entry.first_seen_s or t0)
        runner.captured_event(entry, iteration)
        if runner.rank == 0:
            logger.info("captured tier 2 [%s]: %s, capture %.0f ms", entry.description,
                        entry.collectives, entry.capture_s * 1e3)
        return True

    # --------------------------------------------------------------- replay
    @timed("tier-2 forward")
    def forward(self, entry: GraphEntry, leaves: list, *, sync: bool, label: str):
        """Replay the forward graph for this call; the module's outputs, as fresh
        tensors whose backward replays the backward graph."""
        if self.lane_run is not None:
            self.end_lane("the model was called again before backward() of the loss")
        copy_inputs(entry, leaves)
        self.reducer.enabled = sync
        self.graph_round = False  # a backward that raised never reached its callback
        self.reducer.outside_grad_error = None
        self.runner.watchdog.replay([entry.graph], label)
        call = _Call(self, entry, sync, label)
        entry.last_call = call
        if sync and "lane" in entry.bwd_graphs:
            call.lane = self.lane_run = LaneRun(entry.loss_trace, entry.lane_exts,
                                                entry.lane_meta, self._lane_commit)
            call.lane.call = call
        outs = iter(_GraphedCall.apply(call, self.dummy))
        return map_outputs(entry.out_template, lambda t: next(outs))

    def backward(self, call: _Call, grads) -> None:
        """``_GraphedCall.backward``: the output gradients into the static
        buffers, then the backward graph (on the stream of the model call)."""
        if self.reducer._finalize_queued:  # noqa: SLF001
            raise OutsideGradientError(_OUTSIDE)
        entry = call.entry
        if entry.last_call is not call:
            from ..loop.conformance import LoopConformanceError

            raise LoopConformanceError(
                "backward() reached the outputs of a model call after a later call with the same "
                "inputs replayed the forward graph again (several forward passes into one loss), "
                "so the saved activations are the later call's. Call backward() after each model "
                "call, or wrap(..., graphs=False).")
        fresh = call.sync and self.reducer.all_grads_none()
        with torch.no_grad():
            if not fresh:
                self.attach_grads()
            for static, g in zip(entry.static_grads, (g for g, d in zip(grads, entry.diff_mask) if d)):
                if g is None:
                    static.zero_()
                else:
                    static.copy_(g)
        self.runner.watchdog.replay([entry.bwd_graphs["fresh" if fresh else call.sync]], call.label)
        if fresh:
            self.reducer.expose_grads()
        if not self.graph_round:
            self.graph_round = True
            self.reducer.outside_grad_error = _OUTSIDE
            Variable._execution_engine.queue_callback(lambda: self._backward_done(call))

    @timed("autograd.Function")
    def _backward_done(self, call: _Call) -> None:
        """End of the user's backward: the caller's stream after the graphs."""
        self.graph_round = False
        self.reducer.outside_grad_error = None
        if _current_stream() != call.stream:
            sid, index, kind = call.stream
            torch.cuda.current_stream().wait_stream(
                torch.cuda.Stream(stream_id=sid, device_index=index, device_type=kind))
        if call.sync:
            self.reducer.rounds += 1
        self.on_backward_finished()

    def replay_step(self, entry: GraphEntry, label: str) -> None:
        """``optimizer.step()``: the step graph, and the watchdog armed behind it:
        the event follows the backward graphs' all-reduces on the stream, so a
        peer that never joins them fires it (tier 1 arms at every replay)."""
        self.runner.watchdog.replay([entry.step_graph], label, collectives=entry.collectives, arm=True)


_OUTSIDE = ("the loss's backward reached parameters directly, not only through the outputs of "
            "the model call (for example a regulariser computed from model.parameters() outside "
            "the model); a tier-2 backward graph cannot add those gradients to the reduction. "
            "Compute that term inside the module's forward, or wrap(..., graphs=False).")
