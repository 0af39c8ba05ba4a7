"""Evaluation graphs: forward passes without autograd, replayed per input signature.

A call of the wrapped model with gradients disabled -- ``torch.no_grad()`` or
``torch.inference_mode()``, usually after ``model.eval()`` -- is an evaluation
(or a no-grad forward for logging). Evaluation loops are launch-bound like
training loops, and have no backward, all-reduce or step: one forward graph
per signature replaces every kernel launch of the call.

The life of an evaluation graph, each a branch of :meth:`EvalGraphs.call`:

* **warm-up** (``EVAL_WARMUP`` calls): the forward as written, on the capture
  stream, so that cuBLAS workspaces and lazy initialisation happen outside
  the graph;
* **capture**: the forward recorded into the model's memory pool (the one its
  training graphs use: the two never run at the same time, and what one hands
  out is copied before the other runs), then launched once;
* **replay**: inputs copied into the static buffers, one launch, the outputs
  handed out as fresh tensors (copies: the next replay overwrites the graph's);
* **eager**: the forward as written, with the reason in ``report()``.

No decision here takes a collective: evaluation often runs on some ranks only
(``if rank == 0: evaluate()``). The one collective is DDP's: the first call
without autograd after a synchronised training forward broadcasts rank 0's
buffers (BatchNorm statistics), eagerly, before anything else -- DDP's
``require_forward_param_sync``, so that every rank evaluates with rank 0's
statistics, as under DDP. A model without buffers (or ``broadcast_buffers=
False``, or one rank) issues nothing; a model with buffers evaluated on some
ranks only must be called as ``model.module`` there, exactly as with DDP,
whose wrapper would wait for the other ranks too. A forward that issues
collectives of its own is not captured (the graph-safe backend sees them while
recording), so every rank keeps running it eagerly, alike. The signature includes ``model.training``,
whether inference mode is on, and the caller's autocast, so train- and
eval-mode forwards of one shape get graphs of their own; switching between
them captures nothing new. Bitwise equal to the eager forward: the graph runs
the kernels the warm-up ran, on the same weights (read in place).
"""

from __future__ import annotations

import logging
import time
import torch
import torch.utils._pytree as pytree

from ..graphs import host_copies
from ..graphs.capture_guard import describe_capture_error
from ..graphs.graph_cache import GraphCache, GraphEntry, discard
from ..loop.amp import autocast_state
from ..loop.arguments import IgnoredArgs
from ..loop.outputs import map_outputs
from ..runtime._ext import C
from ..step.step import IterationStep
from .capture import GraphRunner

logger = logging.getLogger("pygraph_dist")

Phase = C.Phase
EVAL_WARMUP = 2  # eager forwards on the capture stream before the capture
EVAL_TIER = "eval"


class EvalGraphs:
    """Forward-only graphs of one wrapped model (entries of its graph cache)."""

    def __init__(self, module: torch.nn.Module, step: IterationStep, cache: GraphCache, runner: GraphRunner,
                 *, enabled: bool, graphs_possible: bool, graphs_reason: str) -> None:
        """The model's parts the training graphs use too: ``step`` (the forward,
        the buffers' broadcast, the device and rank), ``cache`` (entries, pool,
        events), ``runner`` (capture, host copies, the graph-safe backend);
        ``enabled``: ``wrap(eval_graphs=...)``; why the model has no graphs, if so."""
        self.module = module
        self.step = step
        self.cache = cache
        self.runner = runner
        self.enabled = enabled
        self.graphs_possible = graphs_possible
        self.graphs_reason = graphs_reason

    def call(self, args: tuple, kwargs: dict, *, iteration: int, ignored: IgnoredArgs, sync_buffers: bool):
        """The model call with grad disabled: warm-up, capture, replay or eager.
        ``iteration``: the engine's (for the events); ``ignored``: the arguments
        left out of the signature; ``sync_buffers``: the first call after a
        synchronised training forward broadcasts rank 0's buffers first."""
        step, cache = self.step, self.cache
        if sync_buffers and step.buffers:
            with torch.no_grad(), step.on_compute_stream():
                step.broadcast_buffers()
        leaves, spec = pytree.tree_flatten((args, kwargs))
        entry = self._entry_for(args, kwargs, leaves, spec, ignored)
        if entry.policy.phase == Phase.REPLAY:
            moved = self._moved(entry)
            if moved:
                cache.invalidate(entry, iteration, moved)
        phase = entry.policy.begin_iteration()
        entry.last_used = iteration
        if phase == Phase.REPLAY:
            if entry.host_copies is not None and host_copies.check_due(entry):  # check mode: this rank alone
                return host_copies.run_checked(entry, lambda: step.evaluate(args, kwargs), cache=cache,
                                               iteration=iteration, collective=False, rank=step.rank)
            return self._replay(entry, leaves)
        if phase == Phase.CAPTURE:
            out = self._capture(entry, args, kwargs, iteration)
            if out is not None:
                return out
            phase = Phase.EAGER  # this call, after a failed capture
        if phase == Phase.WARMUP:
            if not entry.first_seen_s:
                entry.first_seen_s = time.perf_counter()
            entry.warmups += 1
            with step.on_compute_stream(), host_copies.observing(self.runner.host_watch, entry):
                return step.evaluate(args, kwargs)
        return step.evaluate(args, kwargs)

    # ------------------------------------------------------------ signature
    def _entry_for(self, args, kwargs, leaves, spec, ignored: IgnoredArgs) -> GraphEntry:
        sig_leaves, sig_spec = ignored.signature(args, kwargs, leaves, spec)
        ambient = ((EVAL_TIER, self.module.training, torch.is_inference_mode_enabled())
                   + autocast_state(self.step.device.type))
        entry, new = self.cache.lookup(sig_leaves, sig_spec, ambient)
        if not new:
            return entry
        entry.tier = EVAL_TIER
        mode = "train mode" if self.module.training else "eval mode"
        grad = "inference mode" if torch.is_inference_mode_enabled() else "no grad"
        entry.description = f"eval: {entry.description} ({mode}, {grad})"
        entry.policy = C.CapturePolicy(C.PolicyConfig(
            probe_iters=0, warmup_iters=EVAL_WARMUP, max_capture_attempts=2, max_recaptures=8))
        if not self.enabled:
            entry.policy.disable("evaluation graphs are off (wrap(..., eval_graphs=False))")
        elif entry.key[0] == "unhashable":
            entry.policy.disable("an argument of the model call is not hashable, so calls cannot be "
                                 "matched to graphs; pass tensors and plain Python values")
        elif not self.graphs_possible:
            entry.policy.disable(self.graphs_reason or "graphs are unavailable")
        return entry

    def _weights(self) -> list[int]:
        module = self.module
        return [t.data_ptr() for t in module.parameters()] + [b.data_ptr() for b in module.buffers()]

    def _moved(self, entry: GraphEntry) -> str | None:
        """Why the graph no longer reads the module's weights, or None."""
        if not entry.live:
            return "the graph was released"
        if self._weights() != entry.drift.param_ptrs:
            return ("a parameter's or buffer's storage was replaced (for example "
                    "load_state_dict(assign=True) or p.data = ...)")
        return None

    # -------------------------------------------------------------- capture
    def _capture(self, entry: GraphEntry, args, kwargs, iteration: int):
        """Record the forward, launch it once; its outputs, or None (then eager)."""
        step, runner, cache = self.step, self.runner, self.cache
        device, fp_backend = step.device, runner.fp_backend  # the graph-safe backend (None: stock)
        static = pytree.tree_map(step.static_copy, step.to_device(args, kwargs))
        torch.cuda.synchronize(device)
        generator = torch.cuda.default_generators[device.index or 0]
        rng_snapshot = generator.clone_state()
        graph = torch.cuda.CUDAGraph()
        pool = cache.pool_for_capture()
        torch.cuda.empty_cache()  # as torch.cuda.graph does: the growth below is this graph's
        reserved0 = torch.cuda.memory_reserved(device)
        if fp_backend is not None:
            fp_backend.start_recording()
        t0 = time.perf_counter()
        error: BaseException | None = None
        out = None
        try:
            with runner.capturing(graph, pool), host_copies.substituting(runner.host_watch, entry):
                out = step.evaluate(*static)
        except Exception as exc:  # noqa: BLE001 - every failure runs this call eagerly
            error = exc
        finally:
            fingerprint = fp_backend.stop_recording() if fp_backend is not None else None
        entry.capture_s = time.perf_counter() - t0
        reason, retryable = describe_capture_error(error)
        reason, retryable = host_copies.capture_failed(runner.host_watch, entry, error, reason, retryable)
        if error is None and fingerprint is not None and len(fingerprint):
            reason, retryable = (f"the forward issues collectives ({fingerprint.describe(4)}); an "
                                 "evaluation graph could replay them on some ranks only"), False
        if reason:
            discard(graph)
            generator.graphsafe_set_state(rng_snapshot)
            torch.cuda.synchronize(device)
            entry.policy.capture_failed(reason, retryable)
            nxt = "will retry after warm-up" if entry.policy.phase != Phase.EAGER else "running eagerly"
            cache.event(entry, iteration, "capture failed", f"{reason} ({nxt})")
            if step.rank == 0:
                logger.warning("evaluation graph for [%s] not captured: %s; %s",
                               entry.description, reason, nxt)
            return None
        entry.graph = graph
        entry.static = static
        entry.static_leaves = pytree.tree_leaves(static)
        entry.static_result = out
        entry.pool_bytes = max(0, torch.cuda.memory_reserved(device) - reserved0)
        entry.collectives = "none"
        entry.n_collectives = 0
        entry.drift.param_ptrs = self._weights()
        entry.policy.capture_succeeded()
        cache.enforce_limits(entry, iteration)
        if not entry.live:  # above graph_memory_mb
            return None
        graph.replay()  # capture records without running: this performs the call
        entry.setup_s = time.perf_counter() - (entry.first_seen_s or t0)
        cache.event(entry, iteration, "captured",
                    f"forward only; capture {entry.capture_s * 1e3:.0f} ms, pool "
                    f"{entry.pool_bytes / 2**20:.1f} MiB{host_copies.describe(entry)}")
        if step.rank == 0:
            logger.info("captured [%s], capture %.0f ms", entry.description, entry.capture_s * 1e3)
        return map_outputs(out, _fresh)

    # --------------------------------------------------------------- replay
    def _replay(self, entry: GraphEntry, leaves: list):
        for static, leaf in zip(entry.static_leaves, leaves):
            if isinstance(leaf, torch.Tensor) and leaf is not static:
                static.copy_(leaf, non_blocking=True)
        entry.graph.replay()
        return map_outputs(entry.static_result, _fresh)


def _fresh(t: torch.Tensor) -> torch.Tensor:
    """A copy the caller owns: the graph's output is overwritten by its next replay."""
    return t.clone()
