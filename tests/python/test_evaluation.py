"""Evaluation graphs (issue 25, item 3): model calls without autograd replay a
forward-only graph per signature, bitwise equal to the eager forward, beside
the training graphs; evaluating on some ranks only never hangs."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

import pygraph_dist as pgd

from common import data, device, flat_params, ranks_agree


class Net(nn.Module):
    """Dropout and BatchNorm: both differ between train and eval mode."""

    def __init__(self, width=32, classes=5, sync=False):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(width, width), nn.BatchNorm1d(width), nn.GELU(),
                                  nn.Dropout(0.2), nn.Linear(width, width), nn.GELU())
        self.head = nn.Linear(width, classes)
        self.sync = sync

    def forward(self, x, y):
        logits = self.head(self.body(x))
        loss = nn.functional.cross_entropy(logits, y)
        if self.sync and not self.training:
            loss = loss + 0 * loss.item()  # a host sync: not capturable
        return logits, loss


def _train_and_evaluate(model, opt, rank, dev, *, steps=12, every=4, evaluating=lambda r: True,
                        evaluator=None):
    """``evaluator``: what evaluates (default: ``model``)."""
    evals = []
    ev = evaluator if evaluator is not None else model
    for step in range(steps):
        x, y = data(step, rank, device=dev)
        opt.zero_grad(set_to_none=True)
        _, loss = model(x, y)
        loss.backward()
        opt.step()
        if (step + 1) % every == 0 and evaluating(rank):
            model.eval()
            with torch.no_grad():
                outs = [ev(*data(100 + b, rank, device=dev)) for b in range(5)]
            first = outs[0][0].clone()
            evals.append([float(l) for _, l in outs])
            evals.append(bool(torch.equal(first, outs[0][0])))  # not overwritten by later replays
            with torch.inference_mode():
                evals.append([float(ev(*data(200 + b, rank, device=dev))[1]) for b in range(3)])
            model.train()
            with torch.no_grad():  # train mode (dropout on), no grad: a graph of its own
                evals.append([float(ev(*data(300 + b, rank, device=dev))[1]) for b in range(3)])
    return evals


class NoBuffers(Net):
    """Net without BatchNorm: nothing for DDP to broadcast in evaluation."""

    def __init__(self):
        super().__init__()
        self.body[1] = nn.LayerNorm(32)


def eval_vs_ddp(who="all", steps=12):
    """CPU, 2 ranks, training with evaluations between steps, against DDP.

    ``all``: every rank evaluates through the wrapper (BatchNorm): the first
    no-grad call after training broadcasts rank 0's buffers, as DDP's wrapper
    does, so evaluations match DDP's on every rank. ``rank0``: rank 0 alone
    evaluates a model without buffers through the wrapper: nothing is
    collective, nothing waits for rank 1."""
    pgd.init()
    rank = dist.get_rank()
    torch.manual_seed(0)
    base = Net() if who == "all" else NoBuffers()
    evaluating = (lambda r: True) if who == "all" else (lambda r: r == 0)
    ref = nn.parallel.DistributedDataParallel(copy.deepcopy(base))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    torch.manual_seed(1)
    ref_evals = _train_and_evaluate(ref, ref_opt, rank, "cpu", steps=steps, evaluating=evaluating)
    model, opt = pgd.wrap(base, torch.optim.SGD(base.parameters(), lr=0.1, momentum=0.9))
    torch.manual_seed(1)
    evals = _train_and_evaluate(model, opt, rank, "cpu", steps=steps, evaluating=evaluating)
    mine = flat_params(model.module)
    bufs = torch.cat([b.float().reshape(-1) for b in model.module.buffers()] or [torch.zeros(1)])
    ref_bufs = torch.cat([b.float().reshape(-1) for b in ref.module.buffers()] or [torch.zeros(1)])
    rep = pgd.report().models[-1]
    return {"diff": float((mine - flat_params(ref.module)).abs().max()), "ranks_agree": ranks_agree(mine, "cpu"),
            "buffers_diff": float((bufs - ref_bufs).abs().max()),
            "evals": evals, "ref_evals": ref_evals, "eval_calls": rep.eval_calls,
            "report": str(pgd.report())}


@pytest.mark.parametrize("who", ["all", "rank0"])
def test_evaluation_matches_ddp_and_one_rank_may_evaluate_alone(ranks, who):
    results = ranks("test_evaluation:eval_vs_ddp", world_size=2, timeout=120, kwargs={"who": who})
    for rank, r in enumerate(results):
        assert r["diff"] < 1e-5 and r["ranks_agree"] and r["buffers_diff"] < 1e-5, r["report"]
        evaluates = who == "all" or rank == 0
        assert r["eval_calls"] == (33 if evaluates else 0), r["report"]  # 3 evaluations x 11 calls
        assert len(r["evals"]) == len(r["ref_evals"]) == (12 if evaluates else 0)
        for mine, ref in zip(r["evals"], r["ref_evals"]):
            if isinstance(mine, list):
                assert max(abs(a - b) for a, b in zip(mine, ref)) < 1e-4, (rank, mine, ref)


def gpu_eval_graphs(steps=12):
    """One GPU: graphed (train + eval graphs) vs graphs=False, bitwise."""
    pgd.init()
    rank = dist.get_rank()
    dev = device()
    out = {}
    for graphs in (True, False):
        torch.manual_seed(0)
        base = Net().to(dev)
        model, opt = pgd.wrap(base, torch.optim.AdamW(base.parameters(), lr=1e-3), graphs=graphs)
        torch.manual_seed(1)
        evals = _train_and_evaluate(model, opt, rank, dev, steps=steps)
        with torch.no_grad():
            module_call = model.module(*data(0, rank, device=dev))  # DDP-style: eager, no entry
        rep = pgd.report().models[-1]
        out["graphed" if graphs else "eager"] = {
            "params": flat_params(base).tolist(), "evals": evals, "module_call_ok": module_call[1].numel() == 1,
            "graphs": [{"inputs": g.inputs, "tier": g.tier, "phase": g.phase, "replays": g.replays,
                        "iterations": g.iterations, "reason": g.reason} for g in rep.graphs],
            "captured": [e["inputs"] for e in rep.events if e["event"] == "captured"],
            "eval_replays": rep.eval_replays, "train_replays": rep.replays, "report": str(pgd.report())}
    # A forward that syncs the host in eval mode: not captured, eager with the reason.
    torch.manual_seed(0)
    base = Net(sync=True).to(dev)
    model, opt = pgd.wrap(base, torch.optim.AdamW(base.parameters(), lr=1e-3))
    model.eval()
    with torch.no_grad():
        losses = [float(model(*data(b, rank, device=dev))[1]) for b in range(5)]
        ref = [float(base(*data(b, rank, device=dev))[1]) for b in range(5)]
    g = pgd.report().models[-1].graphs[0]
    out["sync"] = {"phase": g.phase, "reason": g.reason, "equal": losses == ref}
    return out


@pytest.mark.gpu
def test_evaluation_replays_forward_graphs_bitwise(ranks):
    (r,) = ranks("test_evaluation:gpu_eval_graphs", world_size=1, timeout=300)
    g, e = r["graphed"], r["eager"]
    assert g["params"] == e["params"], g["report"]  # training unchanged by the eval graphs
    assert g["evals"] == e["evals"], (g["evals"], e["evals"])  # eval outputs bitwise, not overwritten
    evals = [x for x in g["graphs"] if x["tier"] == "eval"]
    assert len(evals) == 3, g["report"]  # eval mode no_grad, inference mode, train mode no_grad
    assert all(x["phase"] == "replay" for x in evals), g["report"]
    # 3 evaluations: no_grad 5 calls each (2 warm-up, 1 capture) -> 12 replays; the others 3 calls each.
    assert g["eval_replays"] >= 12 + 6 + 6 - 6, g["report"]
    # Switching between training and evaluation captured nothing new: one capture per signature.
    assert len(g["captured"]) == len(set(g["captured"])) == 4, g["report"]
    assert g["train_replays"] >= 12 - 7, g["report"]
    assert g["module_call_ok"] and len(g["graphs"]) == 4, g["report"]  # model.module(x) made no entry
    s = r["sync"]
    assert s["phase"] == "eager" and "host" in s["reason"] and s["equal"], s
