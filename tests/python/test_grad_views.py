"""A gradient lives in one place: once the reducer has its value in the bucket,
``.grad`` is the bucket view, during backward already (issue 26: autograd's
fresh gradients stayed live next to the buckets until the end of backward, a
second copy of every gradient at the peak of each backward)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

import pygraph_dist as pgd
from common import data, device


class Three(nn.Module):
    def __init__(self):
        super().__init__()
        self.first = nn.Linear(16, 32)
        self.mid = nn.Linear(32, 32)
        self.head = nn.Linear(32, 4)

    def forward(self, x, y):
        return F.cross_entropy(self.head(F.gelu(self.mid(F.gelu(self.first(x))))), y)


def grads_are_views_during_backward(steps=4):
    """In the first layer's gradient hook (the last to run in backward), the head's
    and the middle layer's ``.grad`` must already be their bucket views."""
    pgd.init()
    rank = dist.get_rank()
    dev = device()
    torch.manual_seed(0)
    net = Three().to(dev)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    model, opt = pgd.wrap(net, opt, warmup=1)
    reducer = model.engine.reducer
    view_of = {id(p): v for p, v in zip(reducer.params, reducer.views)}
    seen: list[list[bool]] = []

    def check(_param):
        seen.append([p.grad is view_of[id(p)] for p in (net.head.weight, net.head.bias, net.mid.weight)])

    # Registered after wrap(): runs after the reducer's own hook on this parameter.
    net.first.weight.register_post_accumulate_grad_hook(check)
    for step in range(steps):
        x, y = data(step, rank, batch=8, width=16, classes=4, device=dev)
        opt.zero_grad(set_to_none=True)
        loss = model(x, y)
        loss.backward()
        opt.step()
    after = all(p.grad is view_of[id(p)] for p in net.parameters())
    pgd.shutdown()
    return {"seen": seen, "after": after}


@pytest.mark.parametrize("world_size", [1, 2])
def test_grad_is_its_bucket_view_as_soon_as_it_is_reduced(ranks, world_size):
    for r in ranks("test_grad_views:grads_are_views_during_backward", world_size=world_size, timeout=120):
        assert r["seen"], "the first layer's hook never ran"
        assert all(all(step) for step in r["seen"]), r["seen"]
        assert r["after"]
