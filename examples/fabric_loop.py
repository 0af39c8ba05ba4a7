"""A training loop written with Lightning Fabric, with ``strategy="pgd"`` or ``"ddp"``.

The loop is Fabric's own idiom -- ``fabric.setup(model, optimizer)``,
``fabric.backward(loss)``, accumulation under ``fabric.no_backward_sync``,
``fabric.clip_gradients`` -- and the only change for pygraph_dist is the
strategy name (the import registers it).

    python examples/fabric_loop.py --strategy pgd      # every visible GPU (or 2 CPU ranks)
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

import lightning as L

from lightning_gpt import GPT, loaders


def train(fabric: L.Fabric, model, optimizer, loader, accumulate: int, on_step=None) -> int:
    """The loop, on a set-up model, optimizer and loader; returns the optimizer steps
    taken. ``on_step(step, loss)`` after each optimizer step (the loss tensor, not
    read: ``benchmarks/bench_lightning.py`` times the loop with it)."""
    step = 0
    for i, (x, y) in enumerate(loader):
        last = (i + 1) % accumulate == 0
        with fabric.no_backward_sync(model, enabled=not last):  # all-reduce on the last micro-batch
            logits = model(x)
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))
            fabric.backward(loss / accumulate)
        if last:
            fabric.clip_gradients(model, optimizer, max_norm=1.0)
            optimizer.step()
            optimizer.zero_grad()
            step = (i + 1) // accumulate
            if step % 10 == 0:
                fabric.print(f"step {step}: loss {loss.item():.4f}")
            if on_step is not None:
                on_step(step, loss)
    return step


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--strategy", choices=("pgd", "ddp"), default="pgd")
    p.add_argument("--devices", type=int, default=0, help="0: every GPU, or 2 CPU ranks")
    p.add_argument("--steps", type=int, default=60, help="optimizer steps")
    p.add_argument("--accumulate", type=int, default=2)
    args = p.parse_args()

    if args.strategy == "pgd":
        import pygraph_dist.integrations.lightning  # noqa: F401 - registers strategy "pgd"
    gpu = torch.cuda.is_available()
    fabric = L.Fabric(strategy=args.strategy, accelerator="gpu" if gpu else "cpu",
                      devices=args.devices or (torch.cuda.device_count() if gpu else 2),
                      precision="bf16-mixed" if gpu else "32-true")
    fabric.launch()
    fabric.seed_everything(0)
    vocab, seq, batch = 256, (256 if gpu else 32), (32 if gpu else 8)
    model = GPT(vocab, seq, layers=6 if gpu else 2, width=384 if gpu else 64, heads=6 if gpu else 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
    model, optimizer = fabric.setup(model, optimizer)
    loader, _ = loaders(batch, seq, vocab, train_batches=args.steps * args.accumulate, world=fabric.world_size)
    loader = fabric.setup_dataloaders(loader)

    train(fabric, model, optimizer, loader, args.accumulate)
    if args.strategy == "pgd" and fabric.is_global_zero:
        import pygraph_dist as pgd

        print(pgd.report())


if __name__ == "__main__":
    main()
