"""Data-parallel training of a deep MLP with pygraph_dist: the project's main job.

Launch with any launcher (see launch/):

    torchrun --nproc-per-node=2 examples/train_mlp.py --steps 60
    mpirun -np 2 python examples/train_mlp.py
    srun -n 2 python examples/train_mlp.py

On a CPU-only machine it trains with Gloo and says why graphs are
unavailable; on CUDA machines it trains with NCCL and replays whole
iterations as CUDA graphs once warm-up and capture are done. It prints one
line per logged iteration and a one-line summary at the end (rank 0).
"""

from __future__ import annotations

import argparse
import logging
import time

import torch
from torch import nn

import pygraph_dist as pgd


class DeepMLP(nn.Module):
    """Linear-GELU-LayerNorm blocks with a classification loss."""

    def __init__(self, width: int = 256, depth: int = 8, classes: int = 10) -> None:
        super().__init__()
        layers = []
        for _ in range(depth):
            layers += [nn.Linear(width, width), nn.GELU(), nn.LayerNorm(width)]
        self.body = nn.Sequential(*layers)
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(self.head(self.body(x)), y)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch", type=int, default=64, help="per-rank batch size")
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--amp", choices=["none", "bf16", "fp16"], default=None,
                        help="default: bf16 on CUDA, none on CPU")
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--no-graphs", action="store_true", help="train eagerly (same numerics)")
    args = parser.parse_args()

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    env = pgd.init()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    amp = args.amp or ("bf16" if cuda else "none")

    torch.manual_seed(0)  # same initial weights everywhere (wrap() also broadcasts rank 0's)
    model = DeepMLP(args.width, args.depth).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.steps)
    model, optimizer = pgd.wrap(model, optimizer, amp=None if amp == "none" else amp,
                                graphs=not args.no_graphs)

    # A fixed synthetic task: labels from a random linear teacher, per-rank data.
    gen = torch.Generator().manual_seed(1234 + env.rank)
    teacher = torch.randn(args.width, 10, generator=torch.Generator().manual_seed(7))
    batches = []
    for _ in range(8):
        x = torch.randn(args.batch, args.width, generator=gen)
        batches.append((x.to(device), (x @ teacher).argmax(dim=1).to(device)))

    first_loss = None
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        x, y = batches[step % len(batches)]
        optimizer.zero_grad(set_to_none=True)
        loss = model(x, y)
        loss.backward()
        optimizer.step()
        scheduler.step()
        if step == 1 or step % args.log_every == 0 or step == args.steps:
            value = loss.item()
            first_loss = value if first_loss is None else first_loss
            if env.rank == 0:
                elapsed = time.perf_counter() - start
                print(f"step {step:4d}/{args.steps}  loss {value:.4f}  lr {scheduler.get_last_lr()[0]:.2e}"
                      f"  {elapsed / step * 1e3:7.2f} ms/step", flush=True)
    if cuda:
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start

    r = pgd.report()
    if env.rank == 0:
        m = r.models[0]
        graphed = (f"{m.replays} of {args.steps} steps replayed as CUDA graphs"
                   if m.graphs_possible else f"graphs unavailable ({m.graphs_reason})")
        print(f"summary: {env.world_size} ranks ({env.launcher}, "
              f"{'cuda' if cuda else 'cpu'}), {args.steps} steps in {elapsed:.2f} s "
              f"({elapsed / args.steps * 1e3:.2f} ms/step), loss {first_loss:.4f} -> {value:.4f}, "
              f"{graphed}", flush=True)
    pgd.shutdown()


if __name__ == "__main__":
    main()
