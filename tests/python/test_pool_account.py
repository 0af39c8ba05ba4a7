"""What a graph's private pool holds, phase by phase (``pool_account.py``, issue 47).

CPU: the line ``report(verbose=True)`` prints from given phase figures, and
which gradients count as the pool's. GPU (``-m gpu``): a tier-1 and a tier-2
capture at world size 1 name their pool's parts, and tier 1's gradients are
exactly the parameters' fp32 bytes (the graph's own ``.grad``).
"""

from __future__ import annotations

import re

import pytest
import torch

import pygraph_dist as pgd
from common import MLP, MLPLogits, data, device

MIB = 2**20


def test_the_line_names_each_phase_and_the_rest(monkeypatch):
    from pygraph_dist.graphs import pool_account

    allocated = iter([100 * MIB, 900 * MIB, 164 * MIB, 164 * MIB])  # start, forward, backward, step
    monkeypatch.setattr(pool_account.torch.cuda, "memory_allocated", lambda device=None: next(allocated))
    account = pool_account.PoolAccount(torch.device("cpu"), held_grads=lambda: 64 * MIB)
    for phase in ("forward", "backward", "step"):
        account.mark(phase)
    text = account.describe(1000 * MIB)
    assert text == ("pool 1000 MiB: 800 MiB kept by forward for backward (saved activations, outputs, "
                    "autocast's weight copies); 64 MiB left after backward, 64 MiB of it the gradients "
                    "(.grad is the graph's own); 64 MiB after the step; 200 MiB temporaries at the peak, "
                    "workspaces and segment rounding"), text
    assert pool_account.PoolAccount.describe(account, 0) == ""  # no pool grown: nothing to say


def test_only_gradients_outside_the_buckets_are_the_pools():
    from pygraph_dist.graphs.pool_account import held_grad_bytes

    bucket = torch.zeros(8)
    a, b, c = (torch.nn.Parameter(torch.zeros(4)) for _ in range(3))
    a.grad = bucket[:4]           # a bucket view: the buckets' memory
    b.grad = torch.zeros(4)       # autograd's own: the pool's
    assert held_grad_bytes([a, b, c], [bucket[:4], bucket[4:], None]) == 16
    sparse = torch.nn.Parameter(torch.zeros(4, 2))
    sparse.grad = torch.zeros(4, 2).to_sparse()  # an nn.Embedding(sparse=True)'s: all-gathered, not the pool's
    assert held_grad_bytes([b, sparse], [None, None]) == 16  # no raise: a raise here failed the capture


def test_an_accounting_error_never_reaches_the_capture(monkeypatch):
    from pygraph_dist.graphs import pool_account

    monkeypatch.setattr(pool_account.torch.cuda, "memory_allocated", lambda device=None: 0)
    account = pool_account.PoolAccount(torch.device("cpu"), held_grads=lambda: 1 // 0)
    account.mark("forward")
    account.mark("backward")  # raises inside: dropped
    assert account.describe(10 * MIB) == ""


def test_the_verbose_report_prints_it_for_a_live_graph():
    from pygraph_dist.reports.reporting import GraphReport
    from pygraph_dist.reports.report_text import _table

    fields = dict(inputs="x", phase="replay", reason="", iterations=10, replays=8, eager_iterations=2,
                  capture_attempts=1, recaptures=0, collectives="-", n_collectives=0, capture_ms=1.0,
                  setup_s=0.1, pool_mib=10.0, live=True, tier="1",
                  pool_detail="pool 10 MiB: 8 MiB kept by forward for backward; 2 MiB temporaries")

    class M:
        graphs = [GraphReport(**fields)]
        graphs_reason = loop = ""
        world_size = 1

    lines, _ = _table(M)
    assert any("8 MiB kept by forward for backward" in line for line in lines), lines


# ----------------------------------------------------------------------- GPU
def pool_detail_on_gpu(width=1024, steps=8):
    pgd.init()
    dev = device()
    out = {}
    for tier, cls in (("1", MLP), ("2", MLPLogits)):
        torch.manual_seed(0)
        net = cls(width=width, depth=4).to(dev)
        model, opt = pgd.wrap(net, torch.optim.AdamW(net.parameters(), lr=1e-4, fused=True), select=False)
        for step in range(steps):
            x, y = data(step, 0, batch=64, width=width, device=dev)
            opt.zero_grad(set_to_none=True)
            loss = model(x, y) if tier == "1" else torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
        rep = pgd.report(as_dict=True)["models"][-1]
        out[tier] = {"tiers": rep["summary"]["tiers"], "detail": rep["graphs"][0]["pool_detail"],
                     "param_mib": sum(p.numel() * p.element_size() for p in net.parameters()) / MIB,
                     "verbose": str(pgd.report(verbose=True))}
        model.engine.teardown()
    pgd.shutdown()
    return out


@pytest.mark.gpu
def test_a_capture_names_what_its_pool_holds(ranks):
    (r,) = ranks("test_pool_account:pool_detail_on_gpu", world_size=1, timeout=240)
    for tier in ("1", "2"):
        o = r[tier]
        assert o["tiers"] == [tier], o
        assert o["detail"].startswith("pool ") and "kept by forward for backward" in o["detail"], o
        assert "temporaries at the peak" in o["detail"] and "kept by forward" in o["verbose"], o
    grads = re.search(r"(\d+) MiB of it the gradients", r["1"]["detail"])
    assert grads and int(grads.group(1)) == round(r["1"]["param_mib"]), r["1"]  # adopted: all in the pool
    assert "of it the gradients" not in r["2"]["detail"], r["2"]  # tier 2: .grad is the bucket views
