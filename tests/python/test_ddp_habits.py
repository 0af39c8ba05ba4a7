"""DDP's attributes and habits that scripts rely on (issue 25, item 2), on 2
Gloo ranks against torch DDP running the same loop.

* ``model.require_backward_grad_sync = (micro_step == k - 1)`` -- nanoGPT's way
  of accumulating -- behaves as ``no_sync()``: the last micro-batch's backward
  reduces the sum.
* ``GradScaler(enabled=False)`` with ``scale``/``unscale_``/``step``/``update``
  passes through.
* ``model.module`` is the module (checkpoints of ``model.module.state_dict()``).
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import nn

import pygraph_dist as pgd

from common import MLP, data, flat_params, ranks_agree

K = 4


def _loop(model, opt, steps, rank, *, attr: bool):
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    syncs = []
    for step in range(steps):
        x, y = data(step, rank)
        for micro in range(K):
            if attr:
                model.require_backward_grad_sync = (micro == K - 1)
            syncs.append(model.require_backward_grad_sync)
            lo = micro * (16 // K)
            loss = model(x[lo:lo + 16 // K], y[lo:lo + 16 // K]) / K
            scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
    return syncs


def require_backward_grad_sync(steps=5):
    pgd.init()
    rank = dist.get_rank()
    torch.manual_seed(0)
    base = MLP(width=32, depth=3)
    ref = nn.parallel.DistributedDataParallel(copy.deepcopy(base))
    ref_syncs = _loop(ref, torch.optim.AdamW(ref.parameters(), lr=1e-2), steps, rank, attr=True)
    # learn_accumulation=False: without the attribute every micro-batch would all-reduce.
    model, opt = pgd.wrap(base, torch.optim.AdamW(base.parameters(), lr=1e-2), learn_accumulation=False)
    assert model.require_backward_grad_sync is True
    with model.no_sync():
        inside = model.require_backward_grad_sync
    syncs = _loop(model, opt, steps, rank, attr=True)
    mine = flat_params(model.module)
    return {
        "diff": float((mine - flat_params(ref.module)).abs().max()),
        "ranks_agree": ranks_agree(mine, "cpu"),
        "syncs_as_ddp": syncs == ref_syncs,
        "inside_no_sync": inside,
        # one all-reduce round per step, as DDP's: the attribute kept the others local
        "rounds": model.engine.reducer.rounds,
        "module_keys_match": list(model.module.state_dict()) == list(ref.module.state_dict()),
        "report": str(pgd.report()),
    }


def test_require_backward_grad_sync_accumulates_like_ddp(ranks):
    for r in ranks("test_ddp_habits:require_backward_grad_sync", world_size=2, timeout=120):
        assert r["diff"] < 1e-5 and r["ranks_agree"], r["report"]
        assert r["syncs_as_ddp"] and r["inside_no_sync"] is False, r
        assert r["rounds"] == 5, r
        assert r["module_keys_match"], r
