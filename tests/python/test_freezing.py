"""Freezing and unfreezing parameters during training, as fine-tuning schedules do.

A parameter trainable at ``wrap()`` and frozen later (``requires_grad_(False)``)
must be left out of the optimizer step, as DDP(find_unused_parameters=True)
leaves it: AdamW's weight decay would otherwise still shrink the frozen
weights. Unfreezing it again trains it again. A parameter frozen *at*
``wrap()`` has no gradient bucket; unfreezing it later is refused with what
to change (its gradient would never be all-reduced). The graphed side (a
recapture when requires_grad changes) runs in ``test_gpu.py``.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

import pygraph_dist as pgd
from common import data, device, flat_params


class Backbone(nn.Module):
    def __init__(self):
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 32))
        self.head = nn.Linear(32, 4)

    def forward(self, x, y=None):
        logits = self.head(self.backbone(x))
        return logits if y is None else F.cross_entropy(logits, y)


def _batch(step, rank, dev):
    return data(step, rank, batch=8, width=16, classes=4, device=dev)


def freeze_schedule(how="pgd", graphs=1, steps=18, outside=0):
    """Backbone frozen for steps 6-11, trained before and after; AdamW with weight decay.
    ``outside``: the loss computed outside the model (tier 2 on a GPU)."""
    pgd.init()
    rank = dist.get_rank()
    dev = device()
    torch.manual_seed(0)
    net = Backbone().to(dev)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2, weight_decay=0.1)
    if how == "pgd":
        model, opt = pgd.wrap(net, opt, graphs=bool(graphs), warmup=1, select=False)
    else:
        model = nn.parallel.DistributedDataParallel(
            net, find_unused_parameters=True, device_ids=[dev.index] if dev.type == "cuda" else None)
        if dev.type == "cuda":  # the same kernels as pgd's capturable AdamW
            for g in opt.param_groups:
                g["capturable"] = True
                g["lr"] = torch.tensor(g["lr"], device=dev)
    frozen_values = None
    for step in range(steps):
        if step in (6, 12):
            net.backbone.requires_grad_(step == 12)
        if step == 6:
            frozen_values = flat_params(net.backbone).clone()
        if step == 12:
            frozen_moved = float((flat_params(net.backbone) - frozen_values).abs().max())
        x, y = _batch(step, rank, dev)
        opt.zero_grad(set_to_none=True)
        (F.cross_entropy(model(x), y) if outside else model(x, y)).backward()
        opt.step()
    out = {"params": flat_params(net).tolist(), "frozen_moved": frozen_moved,
           "moved_after": float((flat_params(net.backbone) - frozen_values).abs().max())}
    if how == "pgd":
        r = pgd.report().models[-1]
        out["report"] = str(pgd.report(verbose=True))
        out["events"] = [e["event"] + ": " + e["detail"] for e in r.events]
        out["replays"] = r.replays
        out["tiers"] = [g.tier for g in r.graphs]
    return out


def freeze_vs_ddp():
    ours = freeze_schedule("pgd")
    theirs = freeze_schedule("ddp")
    a, b = torch.tensor(ours["params"]), torch.tensor(theirs["params"])
    return {**ours, "max_diff": float((a - b).abs().max()), "ddp_frozen_moved": theirs["frozen_moved"]}


def test_a_parameter_frozen_during_training_is_left_out_of_the_step(ranks):
    for r in ranks("test_freezing:freeze_vs_ddp", timeout=120):
        assert r["frozen_moved"] == 0.0 and r["ddp_frozen_moved"] == 0.0, r  # weight decay did not touch it
        assert r["moved_after"] > 1e-3, r  # trained again once unfrozen
        assert r["max_diff"] < 1e-6, r["max_diff"]
        assert "received no gradient" not in r["report"], r["report"]  # frozen is not "unused"


def unfreeze_after_wrap():
    pgd.init()
    dev = device()
    net = Backbone().to(dev)
    net.backbone.requires_grad_(False)
    model, opt = pgd.wrap(net, torch.optim.AdamW(net.parameters(), lr=1e-2))
    x, y = _batch(0, dist.get_rank(), dev)
    model(x, y).backward()
    opt.step()
    net.backbone.requires_grad_(True)
    try:
        model(x, y)
        return {"error": ""}
    except RuntimeError as exc:
        return {"error": str(exc)}


def test_unfreezing_a_parameter_frozen_at_wrap_is_refused(ranks):
    for r in ranks("test_freezing:unfreeze_after_wrap", timeout=120):
        assert "'backbone.0.weight', 'backbone.0.bias', 'backbone.2.weight', 'backbone.2.bias'" in r["error"], r
        assert "did not require grad when pygraph_dist.wrap() was called" in r["error"], r
        assert "freeze with requires_grad_(False) afterwards" in r["error"], r


def freeze_graphed_vs_eager(outside=0):
    graphed = freeze_schedule("pgd", graphs=1, steps=24, outside=outside)
    eager = freeze_schedule("pgd", graphs=0, steps=24, outside=outside)
    theirs = freeze_schedule("ddp", steps=24, outside=outside)
    g = torch.tensor(graphed["params"])
    return {**graphed, "bitwise": graphed["params"] == eager["params"],
            "max_diff_ddp": float((g - torch.tensor(theirs["params"])).abs().max())}


@pytest.mark.gpu
@pytest.mark.parametrize("outside", [0, 1])  # tier 1 (loss inside), tier 2 (loss outside)
def test_freezing_recaptures_and_trains_like_eager_on_gpu(ranks, outside):
    (r,) = ranks("test_freezing:freeze_graphed_vs_eager", world_size=1, timeout=300,
                 kwargs={"outside": outside})
    assert r["tiers"][:1] == [str(1 + outside)], r["report"]
    invalidated = [e for e in r["events"] if "frozen or unfrozen" in e]
    assert len(invalidated) == 2, r["events"]  # once when frozen, once when unfrozen
    assert r["replays"] >= 10, r["report"]
    assert r["frozen_moved"] == 0.0 and r["moved_after"] > 1e-3, r
    assert r["bitwise"], r["report"]
    assert r["max_diff_ddp"] < 1e-5, r["max_diff_ddp"]
