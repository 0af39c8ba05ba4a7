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
:func:`~pygraph_dist.clip_route.routable` accepts is captured -- torch's own
``clip_grad_norm_`` with the call's parameters, ``max_norm`` and ``foreach``,
the same kernels, so training stays bitwise equal to ``graphs=False`` -- and
every later identical call replays it and returns a copy of its norm, as
torch returns a fresh tensor.

It is a local decision: the graph holds no collective, and replaying it or
running torch's function gives the same gradients and norm, so ranks need not
agree. A call runs torch's function instead (nothing else changes) when:

* it is not the captured call (other ``max_norm``, parameters or order,
  ``foreach``), or :func:`~pygraph_dist.clip_route.routable` refuses it
  (``error_if_nonfinite=True``, another norm, part of the parameters...);
* a gradient is not its bucket view (the loop replaced one), a parameter's
  ``requires_grad`` changed since the capture, or accumulated micro-batches
  still wait for their all-reduce (learned accumulation, ``accumulation.py``);
* the extension that checks the gradients in one C++ pass is missing, the
  capture failed (said once in the log and in ``report()``), or
  ``PYGRAPH_DIST_CLIP_GRAPH=0`` is set (for A/B measurements).
"""

from __future__ import annotations

import logging
import os

import torch

from . import clip_route
from .spans import timed

logger = logging.getLogger("pygraph_dist")


class SplitClip:
    """One wrapped model's clip graph (``Engine.split_clip``)."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.plan: clip_route.ClipPlan | None = None
        self.graph: torch.cuda.CUDAGraph | None = None
        self.norm: torch.Tensor | None = None
        self.state = None  # reducer.param_state() at capture: requires_grad unchanged
        self.replays = 0
        self.eager_calls = 0
        self.failed = ""  # why the capture failed (then every call runs torch's)
        self._refused: tuple | None = None  # the last call routable() refused, and why
        self.refused_why = ""
        self.off = os.environ.get("PYGRAPH_DIST_CLIP_GRAPH", "1") == "0"  # A/B (benchmarks)

    @timed("clip graph")
    def call(self, params: list, max_norm, norm_type, error_if_nonfinite, foreach) -> torch.Tensor | None:
        """The norm, clipped by the graph; None: the caller runs torch's function."""
        engine = self.engine
        reducer = engine.reducer
        if self.off or self.failed or reducer.watch is None or engine.device.type != "cuda":
            return self._eager()
        if self.graph is not None:
            if not self.plan.same_call(params, max_norm, norm_type, error_if_nonfinite, foreach):
                return self._eager()
        elif not self._routable(params, max_norm, norm_type, error_if_nonfinite, foreach):
            return self._eager()
        accum = engine.accum
        if not accum.decided or accum.pending or reducer.watch.not_views():
            return self._eager()
        if self.graph is None:
            if not all(p.requires_grad for p in params):  # a frozen one: its .grad is not a view
                self._refused = self._key(params, max_norm, norm_type, error_if_nonfinite, foreach)
                self.refused_why = "a parameter passed is frozen"
                return self._eager()
            self._capture(params, float(max_norm), foreach)
            if self.graph is None:
                return self._eager()
        elif reducer.param_state() != self.state:
            return self._eager()
        engine.watchdog.replay([self.graph], "clip_grad_norm_ graph")
        self.replays += 1
        return self.norm.clone()

    def _eager(self) -> None:
        self.eager_calls += 1
        return None

    def _routable(self, params, max_norm, norm_type, error_if_nonfinite, foreach) -> bool:
        key = self._key(params, max_norm, norm_type, error_if_nonfinite, foreach)
        if self._refused is not None and self._refused == key:
            return False
        why = clip_route.routable(self.engine, params, max_norm, norm_type, error_if_nonfinite, foreach)
        if why:
            self._refused, self.refused_why = key, why
            return False
        return True

    @staticmethod
    def _key(params, max_norm, norm_type, error_if_nonfinite, foreach) -> tuple:
        """What tells a refused call from another without checking it again."""
        return (len(params), id(params[0]) if params else 0, repr(max_norm), repr(norm_type),
                bool(error_if_nonfinite), foreach)

    def _capture(self, params: list, max_norm: float, foreach) -> None:
        engine = self.engine
        graph = torch.cuda.CUDAGraph()
        try:
            # A pool of its own: the graph lives as long as the model, whatever
            # the tier-2 entries' graphs (and their pool) do.
            with engine.runner.capturing(graph, None):
                norm = clip_route.ORIGINAL(params, max_norm, 2.0, error_if_nonfinite=False, foreach=foreach)
        except Exception as exc:  # noqa: BLE001 - the clip stays torch's, eager
            self.failed = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
            if engine.rank == 0:
                logger.warning("clip_grad_norm_ could not be captured as a graph (%s); it runs eagerly "
                               "between the graphs, as written.", self.failed)
            return
        self.plan = clip_route.ClipPlan(max_norm, tuple(params), foreach)
        self.graph, self.norm = graph, norm
        self.state = engine.reducer.param_state()
        if engine.rank == 0:
            logger.info("tier 2: clip_grad_norm_(max_norm=%g) captured as a graph of its own", max_norm)

    def describe(self) -> str:
        """For the loop line of ``report()`` ("" when the loop never clipped in tier 2)."""
        if self.off and self.eager_calls:
            return "your clip_grad_norm_ eager between the graphs (PYGRAPH_DIST_CLIP_GRAPH=0)"
        if self.failed:
            return f"your clip_grad_norm_ eager between the graphs (its capture failed: {self.failed})"
        if self.graph is not None:
            eager = f", {self.eager_calls} calls eager" if self.eager_calls else ""
            return (f"your clip_grad_norm_(max_norm={self.plan.max_norm:g}) a graph of its own "
                    f"({self.replays} replays{eager})")
        return ""  # never clipped in tier 2, or refused: the probe's reason (split_reason) says why

    def release(self) -> None:
        self.graph = self.norm = None
