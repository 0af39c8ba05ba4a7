"""Gradient accumulation without no_sync(): the micro-batch count, learned (accumulation.py).

Two Gloo ranks on the CPU, each case against torch DDP running the same loop:
the all-reduce runs once per step instead of once per micro-batch, a step that
ends early or late is still reduced correctly, and gradients read before the
last micro-batch (clip_grad_norm_ in a short step, one rank logging) are
reduced before they are read. The GPU matrix in test_loops.py covers the
graphed path (bitwise equal to graphs=False).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

import pygraph_dist as pgd
from common import flat_params, ranks_agree

K = 4


class Net(nn.Module):
    def __init__(self, width=32, classes=5):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.Linear(width, width))
        self.head = nn.Linear(width, classes)

    def forward(self, x, y):
        return F.cross_entropy(self.head(self.body(x)), y)


def _batch(step, rank, n=16, width=32, classes=5):
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(n, width, generator=g), torch.randint(0, classes, (n,), generator=g)


def _train(model, opt, steps, rank, *, calls, clip=None, read=None):
    """``calls(step)``: micro-batches in that step; ``read(step, i, rank)``: read
    .grad after micro-batch i (i == calls: after the last, before clipping)."""
    for step in range(steps):
        x, y = _batch(step, rank)
        opt.zero_grad(set_to_none=True)
        k = calls(step)
        for i in range(k):
            lo = (16 // k) * i
            loss = model(x[lo:lo + 16 // k], y[lo:lo + 16 // k]) / k
            loss.backward()
            if read is not None and read(step, i + 1, rank):
                float(sum(p.grad.norm() for p in model.parameters()))  # logging a gradient norm
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()


def accumulate(steps=6, calls="4", clip=None, read="", learn=1):
    """pgd.wrap (graphs=False: the CPU) against DDP on the same loop."""
    pgd.init()
    rank = dist.get_rank()
    calls_fn = {
        "4": lambda s: K,
        "short_last": lambda s: 3 if s == steps - 1 else K,
        "long_3": lambda s: 5 if s == 3 else K,
    }[calls]
    read_fn = {
        "": None,
        "rank0_end_of_short": lambda s, i, r: r == 0 and s == steps - 1 and i == 3,
        "mid_from_start": lambda s, i, r: i == 2,
        "mid_later": lambda s, i, r: s == 3 and i == 2,
    }[read]
    torch.manual_seed(0)
    base = Net()
    ref = nn.parallel.DistributedDataParallel(copy.deepcopy(base))
    _train(ref, torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9), steps, rank, calls=calls_fn,
           clip=clip, read=read_fn)
    model, opt = pgd.wrap(base, torch.optim.SGD(base.parameters(), lr=0.1, momentum=0.9),
                          learn_accumulation=bool(learn))
    error = ""
    try:
        _train(model, opt, steps, rank, calls=calls_fn, clip=clip, read=read_fn)
    except pgd.AccumulationReadError as exc:
        error = str(exc)
    mine = flat_params(model.module)
    rep = pgd.report().models[-1]
    return {
        "diff": float((mine - flat_params(ref.module)).abs().max()),
        "ranks_agree": ranks_agree(mine, "cpu"),
        "rounds": model.engine.reducer.rounds,
        "accumulation": rep.accumulation,
        "report": str(pgd.report(verbose=True)),
        "error": error,
    }


TOL = 1e-5  # DDP sums reduced micro-batches, pgd reduces the sum: rounding apart


def test_learned_count_reduces_once_per_step(ranks):
    for r in ranks("test_accumulation:accumulate", timeout=180):
        assert r["diff"] < TOL and r["ranks_agree"], r
        # First step: every micro-batch reduces (it is how K is learned); then one per step.
        assert r["rounds"] == K + 5, r
        assert r["accumulation"].startswith(f"learned: {K} micro-batches"), r["accumulation"]
        assert "15 micro-batch all-reduces skipped" in r["accumulation"], r["accumulation"]
        assert "gradient accumulation: learned" in r["report"]


def test_learning_can_be_switched_off(ranks):
    for r in ranks("test_accumulation:accumulate", timeout=180, kwargs={"learn": 0}):
        assert r["diff"] < TOL and r["ranks_agree"], r
        assert r["rounds"] == 6 * K, r
        assert r["accumulation"].startswith("off (wrap(..., learn_accumulation=False))"), r


@pytest.mark.parametrize("calls", ["short_last", "long_3"])
def test_a_step_on_another_count_is_still_reduced(ranks, calls):
    for r in ranks("test_accumulation:accumulate", timeout=180, kwargs={"calls": calls}):
        assert r["diff"] < TOL and r["ranks_agree"], r
        want = "the step ended early" if calls == "short_last" else "the step made more micro-batches"
        assert want in r["accumulation"], r["accumulation"]


def test_clipping_a_short_step_sees_reduced_gradients(ranks):
    """clip_grad_norm_ after a step that ended early reads the gradients before
    optimizer.step(): they must be reduced by then, or each rank clips its own
    partial sum and the ranks drift apart."""
    for r in ranks("test_accumulation:accumulate", timeout=180, kwargs={"calls": "short_last", "clip": 0.05}):
        assert r["diff"] < TOL and r["ranks_agree"], r
        assert "gradients read before the last micro-batch" in r["accumulation"], r["accumulation"]


def test_one_rank_reading_a_short_step_keeps_the_collectives_paired(ranks):
    """Rank 0 alone logs a gradient norm after a short step: it reduces there,
    rank 1 at its clip; one reduction each, so the all-reduces still pair."""
    for r in ranks("test_accumulation:accumulate", timeout=180,
                   kwargs={"calls": "short_last", "clip": 0.05, "read": "rank0_end_of_short"}):
        assert r["diff"] < TOL and r["ranks_agree"], r


def test_reads_between_micro_batches_in_the_first_step_keep_ddp_behaviour(ranks):
    for r in ranks("test_accumulation:accumulate", timeout=180, kwargs={"read": "mid_from_start"}):
        assert r["diff"] < TOL and r["ranks_agree"], r
        assert r["accumulation"].startswith("off: gradients are read between micro-batches"), r
        assert "test_accumulation.py" in r["accumulation"], r["accumulation"]  # where
        assert r["rounds"] == 6 * K, r


def test_reads_between_micro_batches_later_raise_a_clear_error(ranks):
    for r in ranks("test_accumulation:accumulate", timeout=180, kwargs={"read": "mid_later"}):
        assert "between micro-batches" in r["error"] and "model.no_sync()" in r["error"], r
        assert "learn_accumulation=False" in r["error"] and "test_accumulation.py" in r["error"], r
