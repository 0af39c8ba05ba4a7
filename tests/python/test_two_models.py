"""Two wrapped models trained in alternation: a GAN's generator and discriminator.

The generator's loss runs the discriminator, a second wrapped model, between
the generator's call and its ``optimizer.step()``. The loop must train as DDP
trains it (it runs eagerly, as written, and says why), and the two models'
probes must not leave their torch-function modes stacked on each other: left
there, each would be called for every torch function for the rest of the
process.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import nn

import pygraph_dist as pgd
from common import flat_params


def gan(steps=8):
    pgd.init()
    rank = dist.get_rank()
    torch.manual_seed(0)
    G0 = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 8))
    D0 = nn.Sequential(nn.Linear(8, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1))

    def run(kind):
        G, D = copy.deepcopy(G0), copy.deepcopy(D0)
        opt_g = torch.optim.Adam(G.parameters(), lr=2e-3, betas=(0.5, 0.999))
        opt_d = torch.optim.Adam(D.parameters(), lr=2e-3, betas=(0.5, 0.999))
        if kind == "pgd":
            g, opt_g = pgd.wrap(G, opt_g)
            d, opt_d = pgd.wrap(D, opt_d)
        else:
            g, d = nn.parallel.DistributedDataParallel(G), nn.parallel.DistributedDataParallel(D)
        bce = nn.BCEWithLogitsLoss()
        log, depth = [], []
        for step in range(steps):
            gen = torch.Generator().manual_seed(7 * step + rank)
            real, z = torch.randn(16, 8, generator=gen) + 2, torch.randn(16, 4, generator=gen)
            ones, zeros = torch.ones(16, 1), torch.zeros(16, 1)
            opt_d.zero_grad()
            fake = g(z)
            d_loss = bce(d(real), ones) + bce(d(fake.detach()), zeros)
            d_loss.backward()
            opt_d.step()
            opt_g.zero_grad()
            g_loss = bce(d(fake), ones)
            g_loss.backward()
            opt_g.step()
            log.append([d_loss.item(), g_loss.item()])
            depth.append(torch._C._len_torch_function_stack())
        return G, D, log, depth

    G, D, log, depth = run("pgd")
    report = pgd.report()
    Gr, Dr, ref_log, _ = run("ddp")
    return {
        "max_diff": max(float((flat_params(a) - flat_params(b)).abs().max()) for a, b in ((G, Gr), (D, Dr))),
        "logs_equal": log == ref_log,
        "depth": depth,
        "loops": [m.loop for m in report.models],
    }


def test_gan_trains_like_ddp_and_leaves_no_modes_behind(ranks):
    for r in ranks("test_two_models:gan", timeout=120):
        assert r["max_diff"] < 1e-6 and r["logs_equal"], r
        assert "another pygraph_dist-wrapped model was called" in r["loops"][0], r["loops"]
        # At most the discriminator's open accumulation window; never growing.
        assert max(r["depth"]) <= 1 and len(set(r["depth"])) == 1, r["depth"]
