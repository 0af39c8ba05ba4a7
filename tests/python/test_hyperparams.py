"""Hyperparameters set the way training scripts set them (issue 25, item 1).

A number assigned to ``param_group['lr']`` -- every step (nanoGPT's warmup +
cosine), by a timm-style scheduler, by ``*=`` -- is written into the device lr
tensor the graphs read: the loop keeps replaying, bitwise equal to
``graphs=False``. A hyperparameter the graphs bake in (betas, momentum, weight
decay) that changes every step gets one warning naming the script line, and
is counted among the invalidations.

Why this was broken (the GPT script of the issue): the script assigns the float
at the top of each iteration, before the model call. The drift check that
turned floats into the tensor ran only on replays, so the warm-up steps and
the capture ran with the float: the capture baked that float into the fused
AdamW kernel and into the drift snapshot. In tier 1 the next replays then
stepped with the capture's lr (the check filled the tensor, which that graph
never read); in tier 2 the check runs twice a step (model call, step), and the
second saw the tensor it had itself put back against the snapshot's float:
"'lr' was replaced by another object", nine recaptures, then eager.
"""

from __future__ import annotations

import logging
import math

import numpy as np
import pytest
import torch
import torch.distributed as dist

import pygraph_dist as pgd
from pygraph_dist.loop.param_groups import WatchedParamGroup, adopt_assigned_lrs, write_lr

from common import MLP, MLPLogits, data, device, flat_params


# ----------------------------------------------------------------- CPU units
def test_numbers_assigned_to_lr_are_written_into_the_device_tensor():
    t = torch.zeros(())
    g = WatchedParamGroup({"lr": t, "betas": (0.9, 0.999), "params": []}, t)
    for value, want in [(0.5, 0.5), (3, 3.0), (np.float32(0.25), 0.25), (np.float64(0.125), 0.125),
                        (torch.tensor(0.75), 0.75), (torch.tensor([0.5]), 0.5)]:
        g["lr"] = value
        assert g["lr"] is t and float(t) == want, (value, t)
    g["lr"] *= 2  # in place on the tensor
    assert g["lr"] is t and float(t) == 1.0
    g["betas"] = (0.8, 0.999)  # baked: the line that set it is recorded
    assert g.set_at["betas"].startswith("test_hyperparams.py:"), g.set_at
    g["betas"] = (0.8, 0.999)  # the same value again: no change recorded
    assert write_lr(t, "not a number") is False


def test_an_lr_that_bypassed_setitem_is_adopted():
    t = torch.zeros(())
    opt = torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.1)
    opt.param_groups[0] = WatchedParamGroup(opt.param_groups[0], t)
    dict.update(opt.param_groups[0], lr=0.3)  # bypasses __setitem__ (WatchedParamGroup.update does not)
    adopt_assigned_lrs(opt, [t])
    assert opt.param_groups[0]["lr"] is t and math.isclose(float(t), 0.3, rel_tol=1e-6)
    opt.param_groups[0].update(lr=0.4)  # through __setitem__: written at once
    assert opt.param_groups[0]["lr"] is t and math.isclose(float(t), 0.4, rel_tol=1e-6)


def test_watched_groups_pickle_as_plain_dicts():
    import copy
    import pickle
    t = torch.zeros(())
    g = WatchedParamGroup({"lr": t, "params": []}, t)
    assert type(copy.deepcopy(g)) is dict and type(pickle.loads(pickle.dumps(g))) is dict


# ------------------------------------------------------------------ GPU cases
def _get_lr(it, base=1e-3, warmup=4, total=40, min_lr=1e-4):
    """nanoGPT-style warmup + cosine, a Python float."""
    if it < warmup:
        return base * (it + 1) / (warmup + 1)
    ratio = (it - warmup) / max(1, total - warmup)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * min(1.0, ratio))) * (base - min_lr)


def _groups(model):
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]


def _assign(opt, it, how):
    lr = _get_lr(it)
    for g in opt.param_groups:
        if how == "float":
            g["lr"] = lr
        elif how == "mixed":  # every way a script writes a number
            kind = it % 4
            g["lr"] = (lr if kind == 0 else np.float32(lr) if kind == 1 else
                       torch.tensor(lr) if kind == 2 else int(lr == 0))  # 3: an int (0)
        elif how == "update":
            g.update(lr=lr)


def gpu_float_lr(loop="inside", how="float", opt_name="adamw_fused", steps=24):
    """pgd graphed vs graphs=False (bitwise) with an lr assigned every iteration."""
    pgd.init()
    rank = dist.get_rank()
    dev = device()
    F = torch.nn.functional

    def run(graphs):
        torch.manual_seed(0)
        base = (MLP if loop == "inside" else MLPLogits)(width=32, depth=4).to(dev)
        make = {
            "adamw_fused": lambda: torch.optim.AdamW(_groups(base), lr=1e-3, betas=(0.9, 0.95), fused=True),
            "adam": lambda: torch.optim.Adam(_groups(base), lr=1e-3),
            "rmsprop": lambda: torch.optim.RMSprop(_groups(base), lr=1e-3, momentum=0.9),
            "adadelta": lambda: torch.optim.Adadelta(_groups(base), lr=1.0),
        }[opt_name]
        model, opt = pgd.wrap(base, make(), graphs=graphs)
        losses = []
        for it in range(steps):
            _assign(opt, it, how)
            x, y = data(it, rank, device=dev)
            if loop == "inside":
                loss = model(x, y)
                loss.backward()
            else:
                loss = F.cross_entropy(model(x), y)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(float(loss.item()))
        lrs = [float(g["lr"]) for g in opt.param_groups]
        return flat_params(base), losses, pgd.report().models[-1], lrs

    p_g, l_g, rep, lrs = run(True)
    p_e, l_e, _, _ = run(False)
    g = rep.graphs[0]
    return {"phase": g.phase, "tier": g.tier, "replays": g.replays, "recaptures": g.recaptures,
            "invalidations": [e for e in rep.events if e["event"] == "invalidated"],
            "bitwise": bool(torch.equal(p_g, p_e)), "losses_equal": l_g == l_e,
            "lr_last": lrs, "lr_want": _get_lr(steps - 1), "report": str(pgd.report())}


@pytest.mark.gpu
@pytest.mark.parametrize("loop,how,opt_name", [
    ("inside", "float", "adamw_fused"),   # tier 1
    ("outside", "float", "adamw_fused"),  # tier 2 (the GPT script's loop)
    ("inside", "mixed", "adam"),
    ("outside", "update", "adam"),
    ("inside", "float", "rmsprop"),
    ("inside", "float", "adadelta"),
])
def test_an_lr_assigned_every_step_replays_bitwise(ranks, loop, how, opt_name):
    (r,) = ranks("test_hyperparams:gpu_float_lr", world_size=1, timeout=300,
                 kwargs={"loop": loop, "how": how, "opt_name": opt_name})
    assert r["phase"] == "replay" and r["recaptures"] == 0 and not r["invalidations"], r["report"]
    assert r["tier"] == ("1" if loop == "inside" else "2"), r["report"]
    assert r["replays"] >= 24 - 8, r["report"]  # probe 2 + warm-up 3 + capture 1 (+ tier 2's own)
    assert r["bitwise"] and r["losses_equal"], r["report"]
    if how == "float":
        assert all(math.isclose(v, r["lr_want"], rel_tol=1e-6) for v in r["lr_last"]), r


def gpu_baked_change(steps=16):
    """OneCycleLR's default cycle_momentum=True changes Adam's betas every step:
    each change captures again; one warning names the line and the fix."""
    pgd.init()
    rank = dist.get_rank()
    dev = device()
    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    logging.getLogger("pygraph_dist").addHandler(Keep(level=logging.WARNING))
    torch.manual_seed(0)
    base = MLP(width=32, depth=2).to(dev)
    model, opt = pgd.wrap(base, torch.optim.Adam(base.parameters(), lr=1e-3), warmup=1)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-2, total_steps=steps + 1)
    for it in range(steps):
        x, y = data(it, rank, device=dev)
        opt.zero_grad(set_to_none=True)
        model(x, y).backward()
        opt.step()
        sched.step()  # the line a baked-hyperparameter warning must name
    rep = pgd.report().models[-1]
    return {"warnings": [m for m in records if "for the second time" in m],
            "invalidations": [e["detail"] for e in rep.events if e["event"] == "invalidated"],
            "report": str(pgd.report())}


@pytest.mark.gpu
def test_a_baked_hyperparameter_changing_every_step_is_named_once(ranks):
    (r,) = ranks("test_hyperparams:gpu_baked_change", world_size=1, timeout=300)
    assert len(r["warnings"]) == 1, r
    w = r["warnings"][0]
    assert "'betas'" in w and "test_hyperparams.py:" in w and "cycle_momentum=False" in w, w
    assert len(r["invalidations"]) >= 2 and all("'betas'" in d for d in r["invalidations"]), r["report"]
