"""Weight averaging of a wrapped model: ``AveragedModel(model)`` / EMA.

``torch.optim.swa_utils.AveragedModel`` and timm's ``ModelEmaV3`` deep-copy
the model they are given. A deep copy of a wrapped model is a copy of the
plain module (``GraphedModule.__deepcopy__``): the averaged copy evaluates as
a plain module, and ``update_parameters(model)`` pairs the wrapper's
parameters and buffers with the copy's.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

import pygraph_dist as pgd
from common import flat_params


class BNNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU())
        self.head = nn.Linear(16, 3)

    def forward(self, x, y=None):
        out = self.head(self.body(x))
        return out if y is None else F.cross_entropy(out, y)


def ema_of_wrapped(steps=6, decay=0.9):
    pgd.init()
    rank = dist.get_rank()
    torch.manual_seed(0)
    net = BNNet()
    model, opt = pgd.wrap(net, torch.optim.AdamW(net.parameters(), lr=1e-2))
    ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(decay), use_buffers=True)
    def tracked(m):  # parameters and floating-point buffers (not the BatchNorm step counter)
        return [t.detach().float() for t in list(m.parameters()) + list(m.buffers()) if t.is_floating_point()]

    expected = None
    for step in range(steps):
        g = torch.Generator().manual_seed(100 * rank + step)
        x, y = torch.randn(8, 8, generator=g), torch.randint(0, 3, (8,), generator=g)
        opt.zero_grad(set_to_none=True)
        model(x, y).backward()
        opt.step()
        ema.update_parameters(model)
        current = [t.clone() for t in tracked(net)]
        # The first update copies; later ones average.
        expected = current if expected is None else [e * decay + c * (1 - decay) for e, c in zip(expected, current)]
    averaged = tracked(ema.module)
    ema.eval()
    with torch.no_grad():
        out = ema(torch.randn(4, 8))
    return {
        "copy_type": type(ema.module).__name__,
        "copy_shares_storage": any(a.data_ptr() == b.data_ptr() for a, b in zip(ema.module.parameters(),
                                                                                 net.parameters())),
        "max_diff": max(float((a - e).abs().max()) for a, e in zip(averaged, expected)),
        "eval_shape": list(out.shape),
        "plain_copy_of_module": type(copy.deepcopy(model)).__name__,
        "moved": float((flat_params(ema.module) - flat_params(BNNet())).abs().max()),
    }


def test_averaged_model_of_a_wrapped_model(ranks):
    for r in ranks("test_weight_averaging:ema_of_wrapped", timeout=120):
        assert r["copy_type"] == "BNNet" and r["plain_copy_of_module"] == "BNNet", r
        assert not r["copy_shares_storage"], r
        # The averages of the wrapper's own parameters and buffers, pair by pair.
        assert r["max_diff"] < 1e-5, r
        assert r["eval_shape"] == [4, 3]
