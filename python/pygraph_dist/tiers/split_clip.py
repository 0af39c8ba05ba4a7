"""Tier 2: the loop's own ``clip_grad_norm_`` as a graph of its own.

In a tier-2 loop the user's code runs between the graphs, and so does their
clip::

    loss = F.cross_entropy(model(x), y)    # forward graph
    loss.backward()                        # backward graph
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()                       # step graph

Eagerly, torch's ``clip_grad_norm_`` costs host time in proportion to the
parameter count (a norm per gradient, each moved and stacked, then a foreach
multiply): 0.6 ms per step at 18 parameter tensors on an H200 host, 5 ms at
500 (issue 26). The gradients of a tier-2 step are always the same tensors
(the reducer's bucket views), so the call can be a graph: the first call that
:func:`~pygraph_dist.step.clip_route.routable` accepts is captured --
:func:`~pygraph_dist.step.clip_route.clip_in_spans` with the call's parameters,
``max_norm`` and ``foreach``: torch's norm, its multiply over the buckets'
spans, bitwise equal to ``graphs=False`` -- and
every later identical call replays it and returns a copy of its norm, as
torch returns a fresh tensor.

It is a local decision: the graph holds no collective, and replaying it or
running torch's function gives the same gradients and norm, so ranks need not
agree. A call runs torch's function instead (nothing else changes) when:

* it is not the captured call (other ``max_norm``, parameters or order,
  ``foreach``), or :func:`~pygraph_dist.step.clip_route.routable` refuses it
  (``error_if_nonfinite=True``, another norm, part of the parameters...);
* a gradient is not its bucket view (the loop replaced one), a frozen
  parameter passed has a ``.grad``, accumulated micro-batches still wait for
  their all-reduce (learned accumulation, ``accumulation.py``), or a
  torch-function or dispatch mode is active;
* ``requires_grad``, a parameter's storage or autocast changed since the
  capture: the call is captured again (at most 8 times, then torch's for good);
* the extension that checks the gradients in one C++ pass is missing, the
  capture failed (said once in the log and in ``report()``), or
  ``PYGRAPH_DIST_CLIP_GRAPH=0`` is set (for A/B measurements).
"""

from __future__ import annotations

import logging
import os

import torch

from ..graphs.capture_guard import end_failed_capture
from ..graphs.graph_cache import discard
from ..loop.amp import autocast_state
from ..runtime import patches
from ..runtime.spans import timed
from ..step import clip_route

logger = logging.getLogger("pygraph_dist")


class SplitClip:
    """One wrapped model's clip graph (``Engine.split_clip``)."""

    MAX_RECAPTURES = 8

    def __init__(self, step, runner, accum, *, clip_param_ids: frozenset[int]) -> None:
        """``step``: the model's :class:`~pygraph_dist.step.step.IterationStep`
        (its reducer, device, rank and side stream); ``runner``: its
        :class:`~pygraph_dist.tiers.capture.GraphRunner` (the capture and the
        watchdog); ``accum``: its learned accumulation (sums still pending);
        ``clip_param_ids``: every parameter of the model (``routable``)."""
        self.step = step
        self.runner = runner
        self.accum = accum
        self.clip_param_ids = clip_param_ids
        self.plan: clip_route.ClipPlan | None = None
        self.graph: torch.cuda.CUDAGraph | None = None
        self.norm: torch.Tensor | None = None
        self.state = None  # reducer.param_state() at capture: requires_grad unchanged
        self.replays = 0
        self.eager_calls = 0
        self.failed = ""  # why there is no graph for good (then every call runs torch's)
        self._refused: tuple | None = None  # the last call routable() refused
        self.off = os.environ.get("PYGRAPH_DIST_CLIP_GRAPH", "1") == "0"  # A/B (benchmarks)
        self.ambient = None  # autocast_state() at capture
        self.recaptures = 0
        self.frozen: tuple = ()  # parameters passed that did not require grad at capture
        self.eager_why: dict[str, int] = {}  # calls that ran torch's, by reason found at the call

    @timed("clip graph")
    def call(self, params: list, max_norm, norm_type, error_if_nonfinite, foreach) -> torch.Tensor | None:
        """The norm, clipped by the graph; None: the caller runs torch's function."""
        reducer = self.step.reducer
        if self.off or self.failed or reducer.watch is None or self.step.device.type != "cuda":
            return self._eager()
        if self.graph is not None:
            if not self.plan.same_call(params, max_norm, norm_type, error_if_nonfinite, foreach):
                return self._eager()
        elif not self._routable(params, max_norm, norm_type, error_if_nonfinite, foreach):
            return self._eager()
        accum = self.accum
        if not accum.decided or accum.pending or reducer.watch.not_views():
            return self._eager("the gradients were still accumulating or not the buckets' at the call")
        # What the graph bakes in besides the gradients: autocast (a half-precision
        # norm runs in fp32 under it), and any torch-function or dispatch mode
        # (a user's, or one of ours) that would see or change torch's ops.
        ambient = autocast_state(self.step.device.type)
        if patches.any_mode_active():
            return self._eager("a torch-function or dispatch mode was active at the call; a graph "
                               "would bake it in or leave it out")
        if self.graph is not None and (ambient != self.ambient or reducer.param_state() != self.state):
            # requires_grad (or a parameter's storage) changed since the capture, or autocast
            # differs: capture again, a few times at most.
            self._drop()
            if self.recaptures >= self.MAX_RECAPTURES:
                self.failed = (f"captured {self.recaptures + 1} times; requires_grad, a parameter's storage "
                               "or autocast keeps changing")
                return self._eager()
            self.recaptures += 1
        # Frozen parameters passed (fine-tuning): torch's clip skips them while their
        # .grad is None, and so does the graph captured then.
        frozen = self.frozen if self.graph is not None else [p for p in params if not p.requires_grad]
        if any(p.grad is not None for p in frozen):
            return self._eager("a parameter passed that does not require grad had a .grad")
        if self.graph is None:
            self.frozen = tuple(frozen)
            self._capture(params, float(max_norm), foreach, ambient)
            if self.graph is None:
                return self._eager()
        self.runner.watchdog.replay([self.graph], "clip_grad_norm_ graph")
        self.replays += 1
        return self.norm.clone()

    def _eager(self, why: str = "") -> None:
        self.eager_calls += 1
        if why:
            self.eager_why[why] = self.eager_why.get(why, 0) + 1
        return None

    def _routable(self, params, max_norm, norm_type, error_if_nonfinite, foreach) -> bool:
        key = self._key(params, max_norm, norm_type, error_if_nonfinite, foreach)
        if self._refused is not None and self._refused == key:
            return False
        why = clip_route.routable(self.step, self.clip_param_ids, params, max_norm, norm_type,
                                  error_if_nonfinite, foreach)
        if why:  # the probe's reason (split_reason) says why, in report()
            self._refused = key
            return False
        return True

    @staticmethod
    def _key(params, max_norm, norm_type, error_if_nonfinite, foreach) -> tuple:
        """What tells a refused call from another without checking it again."""
        return (len(params), id(params[0]) if params else 0, repr(max_norm), repr(norm_type),
                bool(error_if_nonfinite), foreach)

    def _capture(self, params: list, max_norm: float, foreach, ambient) -> None:
        step = self.step
        graph = torch.cuda.CUDAGraph()
        generator = torch.cuda.default_generators[step.device.index or 0]
        rng_snapshot = generator.clone_state()
        try:
            # A pool of its own: the graph lives as long as the model, whatever
            # the tier-2 entries' graphs (and their pool) do.
            with self.runner.capturing(graph, None):
                norm = clip_route.clip_in_spans(params, max_norm, foreach)
        except Exception as exc:  # noqa: BLE001 - the clip stays torch's, eager
            self.failed = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
            # The generator out of capture mode (the next eager dropout would fail), the
            # graph's memory freed. Unlike an iteration's failed capture the gradients
            # stay: they hold this step's values, which the caller clips eagerly.
            discard(graph)
            end_failed_capture(generator, rng_snapshot, step.stream, step.device)
            if step.rank == 0:
                logger.warning("clip_grad_norm_ could not be captured as a graph (%s); it runs eagerly "
                               "between the graphs, as written.", self.failed)
            return
        self.plan = clip_route.ClipPlan(max_norm, tuple(params), foreach)
        self.graph, self.norm, self.ambient = graph, norm, ambient
        self.state = step.reducer.param_state()
        if step.rank == 0:
            logger.info("tier 2: clip_grad_norm_(max_norm=%g) captured as a graph of its own", max_norm)

    def describe(self) -> str:
        """For the loop line of ``report()`` ("" when the loop never clipped in tier 2)."""
        if self.off and self.eager_calls:
            return "your clip_grad_norm_ eager between the graphs (PYGRAPH_DIST_CLIP_GRAPH=0)"
        if self.failed:
            return f"your clip_grad_norm_ eager between the graphs (no graph: {self.failed})"
        if self.plan is not None:  # captured (released at teardown: the counts stay)
            eager = f", {self.eager_calls} calls eager" if self.eager_calls else ""
            return (f"your clip_grad_norm_(max_norm={self.plan.max_norm:g}) a graph of its own "
                    f"({self.replays} replays{eager})")
        if self.eager_why:  # never captured, for reasons found at the call (after the probe)
            counts = sorted(self.eager_why.items(), key=lambda kv: -kv[1])
            why = "; ".join(f"{n} calls: {reason}" for reason, n in counts[:2])
            k = len(counts) - 2
            more = f"; {k} more reason{'s' if k > 1 else ''}" if k > 0 else ""
            return f"your clip_grad_norm_ eager between the graphs ({why}{more})"
        return ""  # never clipped in tier 2, or refused: the probe's reason (split_reason) says why

    def _drop(self) -> None:
        discard(self.graph)
        self.graph = self.norm = None

    def release(self) -> None:
        """Teardown: the graph and its pool go; the plan and counts stay for report()."""
        self._drop()
