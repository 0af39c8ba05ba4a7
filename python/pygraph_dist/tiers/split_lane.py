"""Tier 2's loss lane, as :class:`~pygraph_dist.tiers.split.SplitGraphs` runs it.

:mod:`~pygraph_dist.loop.loss_lane` learns the loop's loss and matches it step by
step; this mixin of ``SplitGraphs`` holds the rest: handing a warm-up's outputs
to the recorder, capturing the ``"lane"`` backward variant next to tier 2's
others, replaying it at ``loss.backward()``, ending a step's lane, and the
line ``report()`` prints about it.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from ..graphs.graph_cache import GraphEntry
from ..launch import agreement
from ..loop.loss_lane import COMMITTED, Recorder
from ..loop.loss_match import LaneRun
from ..loop.outputs import map_outputs


def _steps(n: int) -> str:
    return f"{n} step" if n == 1 else f"{n} steps"


class LaneCaptureError(RuntimeError):
    """The loss lane's graph could not be captured: tier 2 captures again without it."""


def output_tensors(out) -> list[torch.Tensor]:
    """The tensors of a model call's outputs, in :func:`map_outputs` order."""
    found: list[torch.Tensor] = []
    map_outputs(out, lambda t: found.append(t) or t)
    return found


class LaneGraphs:
    """The loss lane's part of ``SplitGraphs`` (reads ``runner``, ``step``,
    ``reducer``, ``on_backward_finished``)."""

    def _init_lane(self) -> None:
        self.lane_run: LaneRun | None = None  # this step's, until step() or the next call
        self.lane = ""  # the learned loss's calls, once captured
        self.lane_why = ""  # why no loss was learned or captured (the latest reason)
        self.lane_steps = 0  # steps whose loss the "lane" graph computed
        self.lane_misses: dict[str, int] = {}  # steps that computed it eagerly, by reason
        self.lane_failed = False  # a capture of it failed: not learned again
        self.lane_off = os.environ.get("PYGRAPH_DIST_LOSS_GRAPHS", "1") == "0"  # A/B (benchmarks)

    def record(self, entry: GraphEntry, out):
        """A warm-up call's outputs, handed out so that the loss computed from
        them is learned (loss_lane.Recorder); the last warm-up's trace is captured."""
        rec = Recorder(self.step.device)
        wrapped = iter(rec.wrap_outputs(output_tensors(out)))
        entry.lane_recorder = rec
        return map_outputs(out, lambda t: next(wrapped))

    def _lane_trace(self, entry: GraphEntry, *, agree: bool):
        """The loss learned for ``entry`` in its last warm-up step, if every rank
        learned one (``agree``: the capture may hold the lane at all)."""
        rec, entry.lane_recorder = entry.lane_recorder, None
        trace = None
        if rec is not None:
            rec.live = False
            trace = rec.trace
            if trace is None:
                self.lane_why = rec.why or "backward() was not called on a tensor computed from the outputs"
        group = self.runner.group
        if agree and dist.is_initialized() and dist.get_world_size(group) > 1:
            missing = agreement.agreed_max([int(trace is None)], group=group, device=self.runner.agree_device)[0]
            if missing and trace is not None:
                self.lane_why = "another rank did not learn the same kind of loss (its loss is computed differently)"
            trace = None if missing else trace
        return trace if agree else None

    def _capture_lane(self, entry: GraphEntry, graph, pool, tensors: list, roots: list, trace) -> None:
        """The "lane" backward variant: the learned loss on the static outputs,
        its gradient with respect to them, then the backward of the "fresh"
        variant (same call as there: bitwise the same gradients)."""
        runner = self.runner
        try:
            with torch.cuda.stream(self.step.stream):
                exts = trace.static_exts(self.step.device)
            # The trace reads the outputs as leaves of their own: its gradient with
            # respect to each output is the loss's alone, as _GraphedCall.backward
            # receives it (not also what flows from one output into another
            # inside the model, which the backward below adds).
            leaves = [t.detach().requires_grad_(t.requires_grad) for t in tensors]
            with runner.capturing(graph, pool):
                loss = trace.compute(leaves, exts)
                outs = torch.autograd.grad(loss, [t for t in leaves if t.requires_grad],
                                           allow_unused=True, materialize_grads=True)
                with runner.casts():
                    torch.autograd.backward(roots, list(outs), retain_graph=True)
        except Exception as exc:  # noqa: BLE001
            self.lane_why = f"capturing it failed ({type(exc).__name__}: {str(exc)[:200]})"
            self.lane_failed = True
            raise LaneCaptureError(f"the loss computed outside the model could not be captured "
                                   f"({self.lane_why}); tier 2 captures again without it") from exc
        entry.lane_loss = loss.detach()
        entry.lane_meta = (tuple(loss.shape), loss.dtype, loss.device)
        entry.lane_exts = exts
        entry.loss_trace = trace
        self.lane, self.lane_why = trace.describe(), ""

    def _lane_commit(self, run: LaneRun) -> bool:
        """``backward()`` of a pending loss: replay the "lane" graph (the loss,
        its backward, the all-reduces) when the state is the one it was
        captured in, and fill the loss in. False: the caller computes the loss
        eagerly and tier 2 goes on without the lane."""
        call, reducer = run.call, self.reducer
        entry = call.entry
        if entry.last_call is not call or "lane" not in entry.bwd_graphs:
            run.why = "the model was called again before backward()"
        elif reducer._finalize_queued or not reducer.all_grads_none():  # noqa: SLF001
            run.why = ("gradients were present at backward() (no zero_grad(set_to_none=True) before the "
                       "model call)")
        else:
            self.runner.watchdog.replay([entry.bwd_graphs["lane"]], call.label)
            run.fill(entry.lane_loss)
            reducer.expose_grads()
            reducer.rounds += 1
            self.lane_steps += 1
            self.on_backward_finished()
            return True
        return False

    def end_lane(self, why: str) -> None:
        """The step's model call is over: a loss still pending is computed eagerly."""
        run, self.lane_run = self.lane_run, None
        if run is None:
            return
        run.end(why)
        if run.state is not COMMITTED:
            self.lane_misses[run.why] = self.lane_misses.get(run.why, 0) + 1

    def describe_lane(self) -> str:
        """For the loop line of ``report()``: where the loop's loss ran."""
        if self.lane:
            counts = sorted(self.lane_misses.items(), key=lambda kv: -kv[1])
            eager = "".join(f"; {_steps(n)} eager: {why}" for why, n in counts[:2])
            return f"your loss ({self.lane}) inside the backward graph ({_steps(self.lane_steps)}{eager})"
        if self.lane_why:
            return f"your loss eager between the graphs ({self.lane_why})"
        return "your loss eager between the graphs (PYGRAPH_DIST_LOSS_GRAPHS=0)" if self.lane_off else ""

