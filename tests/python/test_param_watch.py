"""The per-step parameter checks (drift, .grad views) keep their meaning, in C++
(csrc/param_watch.h, where the extension has it) and in the Python fallback."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import ROOT, child_env

# Runs in a child: a 1-rank process group, a wrapped CPU model (graphs=False),
# and the checks driven directly, once per implementation.
CASE = r"""
import json
import torch
import pygraph_dist as pgd
from pygraph_dist.runtime._ext import C
from pygraph_dist.graphs.graph_cache import GraphEntry
from pygraph_dist.loop.param_groups import snapshot_hyperparams
from pygraph_dist.graphs.graph_cache import decode_param_state

pgd.init()
out = {"native": hasattr(C, "ParamWatch")}
for impl in (["native"] if out["native"] else []) + ["python"]:
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.GELU(), torch.nn.Linear(4, 2))
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    model, opt = pgd.wrap(net, opt, graphs=False)
    eng = model.engine
    red = eng.reducer
    if impl == "python":
        red.watch = None
    params = red.params
    res = {}
    state = red.param_state()
    res["decoded"] = decode_param_state(state) == ([p.data_ptr() for p in params],
                                                   [p.requires_grad for p in params])
    entry = GraphEntry(key=("k",), description="test", policy=None)
    entry.graph = object()  # live
    entry.drift.params = state
    entry.drift.hyperparams = snapshot_hyperparams(opt)

    def drift(version=0):
        return eng.cache.drift(entry, red, opt, eng.opt_plan.lr_tensors, version) or ""

    res["unchanged"] = drift()
    with torch.no_grad():
        params[0].mul_(2.0)  # in place: same storage, no drift
    res["in_place"] = drift()
    params[1].requires_grad_(False)
    res["frozen"] = drift()
    params[1].requires_grad_(True)
    res["unfrozen_again"] = drift()
    params[2].data = params[2].data.clone()
    res["replaced"] = drift()
    entry.drift.params = red.param_state()
    res["resnapshot"] = drift()
    res["state_loaded"] = drift(version=1)
    opt.param_groups[0]["weight_decay"] = 0.5
    res["hyper"] = drift()
    opt.param_groups[0]["weight_decay"] = 0.01

    # .grad views: None -> every trainable parameter's view; a frozen one is left alone;
    # a replaced .grad becomes the view again.
    for p in params:
        p.grad = None
    res["none_before"] = red.all_grads_none()
    params[0].requires_grad_(False)
    red.expose_grads()
    res["views"] = [p.grad is v for p, v in zip(params, red.views)]
    res["frozen_grad_none"] = params[0].grad is None
    res["none_after"] = red.all_grads_none()
    params[0].requires_grad_(True)
    params[3].grad = torch.zeros_like(params[3])
    red.expose_grads()
    res["views_again"] = [p.grad is v for p, v in zip(params, red.views)]
    # attach_grads (tier 2, before a backward that accumulates): a None .grad becomes its
    # zeroed view, a replaced one is copied into its view; nothing moves when all are views.
    with torch.no_grad():
        red.views[1].fill_(5.0)
        params[1].grad = None
        params[2].grad = torch.full_like(params[2], 3.0)
        eng.split.attach_grads()
        eng.split.attach_grads()
    res["attached"] = [p.grad is v for p, v in zip(params, red.views)]
    res["attached_values"] = [float(params[1].grad.abs().max()), float(params[2].grad.min()),
                              float(params[2].grad.max())]
    out[impl] = res
    eng.teardown()
print(json.dumps(out))
"""


def run_case(prelude: str = "") -> dict:
    p = subprocess.run([sys.executable, "-c", prelude + CASE], cwd=ROOT, env=child_env(),
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def check(res: dict) -> None:
    assert res["decoded"]
    assert res["unchanged"] == "" and res["in_place"] == "" and res["unfrozen_again"] == ""
    assert "frozen or unfrozen" in res["frozen"]
    assert "storage was replaced" in res["replaced"]
    assert res["resnapshot"] == ""
    assert "optimizer state was loaded" in res["state_loaded"]
    assert "weight_decay" in res["hyper"]
    assert res["none_before"] and not res["none_after"]
    assert res["views"] == [False, True, True, True] and res["frozen_grad_none"]
    assert res["views_again"] == [True, True, True, True]
    assert res["attached"] == [True, True, True, True]
    assert res["attached_values"] == [0.0, 3.0, 3.0]


def test_param_checks_keep_their_meaning():
    out = run_case()
    check(out["python"])
    if out["native"]:  # an extension built with csrc/param_watch.cpp
        check(out["native"])


def replace_storage(graphs: int = 1, outside: int = 0, steps: int = 24) -> dict:
    """A weight's storage replaced at step 10 (``p.data = p.data.clone()``, same
    values): the graphs read the old storage, so they must be captured again."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn import functional as F

    import pygraph_dist as pgd
    from common import data, device, flat_params

    pgd.init()
    rank, dev = dist.get_rank(), device()
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4)).to(dev)

    class WithLoss(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = net

        def forward(self, x, y):
            return F.cross_entropy(self.net(x), y)

    opt = torch.optim.AdamW(net.parameters(), lr=1e-2, weight_decay=0.1)
    model, opt = pgd.wrap(net if outside else WithLoss(), opt, graphs=bool(graphs), warmup=1)
    for step in range(steps):
        if step == 10:
            net[0].weight.data = net[0].weight.data.clone()
        x, y = data(step, rank, batch=8, width=16, classes=4, device=dev)
        opt.zero_grad(set_to_none=True)
        (F.cross_entropy(model(x), y) if outside else model(x, y)).backward()
        opt.step()
    r = pgd.report().models[-1]
    out = {"params": flat_params(net).tolist(), "report": str(pgd.report()), "replays": r.replays,
           "events": [e["event"] + ": " + e["detail"] for e in r.events], "tiers": [g.tier for g in r.graphs]}
    return out


def replace_graphed_vs_eager(outside: int = 0) -> dict:
    graphed = replace_storage(graphs=1, outside=outside)
    eager = replace_storage(graphs=0, outside=outside)
    return {**graphed, "bitwise": graphed["params"] == eager["params"]}


@pytest.mark.gpu
@pytest.mark.parametrize("outside", [0, 1])  # tier 1 (loss inside), tier 2 (loss outside)
def test_a_replaced_parameter_storage_recaptures_on_gpu(ranks, outside):
    (r,) = ranks("test_param_watch:replace_graphed_vs_eager", world_size=1, timeout=300,
                 kwargs={"outside": outside})
    assert r["tiers"][:1] == [str(1 + outside)], r["report"]
    replaced = [e for e in r["events"] if "storage was replaced" in e]
    assert len(replaced) == 1, r["events"]  # invalidated once, then captured again
    assert sum(e.startswith("captured:") for e in r["events"]) == 2, r["events"]
    assert r["replays"] >= 10, r["report"]
    assert r["bitwise"], r["report"]  # the new storage trained exactly as eagerly
