"""Non-finite steps skipped inside the graph, checkpoint and resume with graphs
live, and wrap()'s answers to bad input."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

import pygraph_dist as pgd
from common import device, flat_params


class Net(nn.Module):
    def __init__(self, width=64):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.Linear(width, width), nn.GELU(),
                                 nn.Linear(width, 5))

    def forward(self, x, y):
        return F.cross_entropy(self.net(x), y)


def _batch(step, rank, dev, bad=False):
    g = torch.Generator().manual_seed(100 * rank + step)
    x = torch.randn(32, 64, generator=g)
    if bad:
        x[0, 0] = float("inf")
    return x.to(dev), torch.randint(0, 5, (32,), generator=g).to(dev)


def nonfinite(steps=30, bad_step=20, amp="fp32"):
    """Rank body: an inf in rank 1's input at ``bad_step`` (skipped on every
    rank), against a run that never sees that batch."""
    pgd.init()
    rank, dev = dist.get_rank(), device()
    amp = None if amp == "fp32" else amp

    def run(skip_batch):
        torch.manual_seed(0)
        base = Net().to(dev)
        model, opt = pgd.wrap(base, torch.optim.AdamW(base.parameters(), lr=1e-2), amp=amp,
                              skip_nonfinite=True, warmup=2)
        for step in range(steps):
            if step == bad_step and skip_batch:
                continue
            x, y = _batch(step, rank, dev, bad=(step == bad_step and rank == 1))
            opt.zero_grad(set_to_none=True)
            model(x, y).backward()
            opt.step()
        return base, pgd.report().models[-1]

    skipped_run, rep = run(False)
    clean_run, clean_rep = run(True)
    return {
        "bitwise": bool(torch.equal(flat_params(skipped_run), flat_params(clean_run))),
        "finite": bool(torch.isfinite(flat_params(skipped_run)).all()),
        "skipped": rep.skipped_steps,
        "clean_skipped": clean_rep.skipped_steps,
        "replays": rep.replays,
        "report": str(rep) if hasattr(rep, "__str__") else "",
    }


def resume(phase="full", n=20, m=20, amp="fp32", path=""):
    """Rank body: ``full`` trains n+m steps; ``first`` trains n and saves;
    ``resume`` loads in a new process and trains m more."""
    pgd.init()
    rank, dev = dist.get_rank(), device()
    amp = None if amp == "fp32" else amp
    torch.manual_seed(0)
    base = Net().to(dev)
    opt = torch.optim.AdamW(base.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=7, gamma=0.7)
    model, opt = pgd.wrap(base, opt, amp=amp, warmup=2)
    start = 0
    ckpt = os.path.join(path, f"ckpt-rank{rank}.pt")
    if phase == "resume":
        state = torch.load(ckpt, weights_only=False)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        sched.load_state_dict(state["scheduler"])
        start = state["step"]
    end = n if phase == "first" else n + m
    for step in range(start, end):
        x, y = _batch(step, rank, dev)
        opt.zero_grad(set_to_none=True)
        model(x, y).backward()
        opt.step()
        sched.step()
    if phase == "first":
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(),
                    "scheduler": sched.state_dict(), "step": end}, ckpt)
    rep = pgd.report().models[-1]
    return {"params": flat_params(base).tolist(), "replays": rep.replays}


def bad_input():
    """Rank body: wrap() and the call, given what users get wrong."""
    pgd.init()
    out = {}

    def attempt(key, fn):
        try:
            fn()
            out[key] = ""
        except Exception as exc:  # noqa: BLE001 - the message is the result
            out[key] = f"{type(exc).__name__}: {exc}"

    net = Net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    attempt("swapped", lambda: pgd.wrap(opt, net))
    attempt("not_module", lambda: pgd.wrap(lambda x: x, opt))
    attempt("not_optimizer", lambda: pgd.wrap(net, "adam"))
    attempt("ddp", lambda: pgd.wrap(nn.parallel.DistributedDataParallel(Net()), opt))
    model, opt2 = pgd.wrap(net, opt)
    attempt("model_twice", lambda: pgd.wrap(model, torch.optim.SGD(net.parameters(), lr=0.1)))
    attempt("optimizer_twice", lambda: pgd.wrap(Net(), opt2))
    attempt("no_params", lambda: pgd.wrap(nn.ReLU(), torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)))
    attempt("warmup0", lambda: pgd.wrap(Net(), torch.optim.SGD(Net().parameters(), lr=0.1), warmup=0))
    n2 = Net()
    attempt("fp16_skip", lambda: pgd.wrap(n2, torch.optim.AdamW(n2.parameters()), amp="fp16", skip_nonfinite=True))
    n3 = Net()
    attempt("amp_typo", lambda: pgd.wrap(n3, torch.optim.AdamW(n3.parameters()), amp="bfloat"))
    n4 = Net()
    m4, o4 = pgd.wrap(n4, torch.optim.SGD(n4.parameters(), lr=0.1))
    attempt("empty_batch", lambda: m4(torch.zeros(0, 64), torch.zeros(0, dtype=torch.long)).backward())
    attempt("wrong_width", lambda: m4(torch.zeros(4, 3), torch.zeros(4, dtype=torch.long)))
    return out


def test_bad_input_gets_an_error_that_names_the_fix(ranks):
    r = ranks("test_nonfinite_resume:bad_input", world_size=1, timeout=120)[0]
    assert "swapped" in r["swapped"] and "wrap(model, optimizer)" in r["swapped"], r
    assert "torch.nn.Module" in r["not_module"], r
    assert "torch.optim.Optimizer" in r["not_optimizer"], r
    assert "DistributedDataParallel" in r["ddp"] and ".module" in r["ddp"], r
    assert "already wrapped" in r["model_twice"], r
    assert "already wrapped" in r["optimizer_twice"], r
    assert "not parameters of the wrapped model" in r["no_params"], r
    assert "warmup" in r["warmup0"], r
    assert "skip_nonfinite" in r["fp16_skip"] and "GradScaler" in r["fp16_skip"], r
    assert "amp=" in r["amp_typo"] and "bf16" in r["amp_typo"], r
    # An empty batch is the user's to avoid; torch's own error is clear (NaN loss is not silent).
    assert "mat1 and mat2" in r["wrong_width"] or "shape" in r["wrong_width"], r


def test_skip_nonfinite_on_cpu(ranks):
    for r in ranks("test_nonfinite_resume:nonfinite", timeout=180, kwargs={"steps": 8, "bad_step": 5}):
        assert r["skipped"] == 1 and r["clean_skipped"] == 0, r
        assert r["finite"] and r["bitwise"], r


@pytest.mark.multigpu
@pytest.mark.parametrize("amp", ["fp32", "bf16"])
def test_skip_nonfinite_inside_the_graph(ranks, amp):
    for r in ranks("test_nonfinite_resume:nonfinite", timeout=240, kwargs={"amp": amp}):
        assert r["skipped"] == 1 and r["clean_skipped"] == 0, r
        assert r["finite"], r
        assert r["bitwise"], r
        assert r["replays"] >= 20, r  # the bad step was a replay, not an eager fallback


@pytest.mark.multigpu
@pytest.mark.parametrize("amp", ["fp32", "bf16", "fp16"])
def test_resume_from_checkpoint_is_bitwise(ranks, tmp_path, amp):
    full = ranks("test_nonfinite_resume:resume", timeout=240, kwargs={"phase": "full", "amp": amp, "path": tmp_path})
    ranks("test_nonfinite_resume:resume", timeout=240, kwargs={"phase": "first", "amp": amp, "path": tmp_path})
    resumed = ranks("test_nonfinite_resume:resume", timeout=240,
                    kwargs={"phase": "resume", "amp": amp, "path": tmp_path})
    for f, r in zip(full, resumed):
        assert f["params"] == r["params"], amp
        assert r["replays"] >= 10, r  # graphed after the resume
