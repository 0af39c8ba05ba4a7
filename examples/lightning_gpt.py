"""A small GPT trained by Lightning's Trainer, with ``strategy="pgd"`` or ``"ddp"``.

The LightningModule is written the standard way -- automatic optimization,
``configure_optimizers`` with AdamW and a per-step warm-up schedule,
``self.log``, a validation loop -- and the Trainer accumulates 2 batches and
clips the gradient norm at 1.0, in bf16-mixed on a GPU (32-bit on a CPU).

    python examples/lightning_gpt.py --strategy pgd               # every visible GPU (or 2 CPU ranks)
    python examples/lightning_gpt.py --strategy ddp --devices 1   # Lightning's own DDP, to compare
    torchrun --nproc-per-node=2 examples/lightning_gpt.py         # torchrun starts the ranks instead

With ``--strategy pgd`` the only change is the strategy name (and the import
that registers it); pygraph_dist's report is printed at the end.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

import lightning as L


class Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, c // self.heads).unbind(2)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab: int, seq: int, layers: int, width: int, heads: int) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, width), nn.Embedding(seq, width)
        self.blocks = nn.Sequential(*[Block(width, heads) for _ in range(layers)])
        self.ln, self.head = nn.LayerNorm(width), nn.Linear(width, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        return self.head(self.ln(self.blocks(self.tok(idx) + self.pos(pos))))


class LitGPT(L.LightningModule):
    def __init__(self, vocab: int = 256, seq: int = 256, layers: int = 6, width: int = 384, heads: int = 6,
                 lr: float = 3e-4, warmup: int = 10, schedule: str = "step") -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = GPT(vocab, seq, layers, width, heads)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(idx)

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))
        self.log("train_loss", loss, on_step=True, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        self.log("val_loss", F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1)), sync_dist=True)

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=0.1)
        if self.hparams.schedule == "epoch":
            scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "epoch"}}
        warmup = self.hparams.warmup
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warmup))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class Counting(Dataset):
    """Sequences that count up from a random start (mod vocab): learnable, so the loss falls."""

    def __init__(self, n: int, seq: int, vocab: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        start = torch.randint(0, vocab, (n, 1), generator=g)
        step = torch.randint(1, 4, (n, 1), generator=g)
        self.data = (start + step * torch.arange(seq + 1)) % vocab

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int):
        return self.data[i, :-1], self.data[i, 1:]


def loaders(batch: int, seq: int, vocab: int, train_batches: int, val_batches: int = 2, world: int = 1):
    """Train and validation loaders; ``train_batches`` per rank (Lightning shards them)."""
    train = Counting(batch * train_batches * world, seq, vocab, seed=0)
    val = Counting(batch * val_batches * world, seq, vocab, seed=1)
    return (DataLoader(train, batch_size=batch, drop_last=True),
            DataLoader(val, batch_size=batch, drop_last=True))


def strategy_for(name: str, **pgd_options):
    """``"pgd"`` registers pygraph_dist's strategy (one import); pass options as an instance."""
    if name == "pgd":
        from pygraph_dist.integrations.lightning import PGDStrategy

        return PGDStrategy(**pgd_options) if pgd_options else "pgd"
    return name


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--strategy", choices=("pgd", "ddp"), default="pgd")
    p.add_argument("--devices", type=int, default=0, help="0: every GPU, or 2 CPU ranks")
    p.add_argument("--steps", type=int, default=60, help="optimizer steps")
    p.add_argument("--batch", type=int, default=0, help="default 64 on a GPU, 8 on a CPU")
    p.add_argument("--seq", type=int, default=0, help="default 256 on a GPU, 32 on a CPU")
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--width", type=int, default=384)
    args = p.parse_args()

    gpu = torch.cuda.is_available()
    batch, seq = args.batch or (64 if gpu else 8), args.seq or (256 if gpu else 32)
    width, layers = (args.width, args.layers) if gpu else (min(args.width, 64), min(args.layers, 2))
    devices = args.devices or (torch.cuda.device_count() if gpu else 2)
    L.seed_everything(0)
    model = LitGPT(vocab=256, seq=seq, layers=layers, width=width, heads=max(1, width // 64))
    accumulate = 2
    train, val = loaders(batch, seq, 256, train_batches=args.steps * accumulate, world=devices)
    trainer = L.Trainer(
        strategy=strategy_for(args.strategy), accelerator="gpu" if gpu else "cpu", devices=devices,
        precision="bf16-mixed" if gpu else "32-true", accumulate_grad_batches=accumulate,
        gradient_clip_val=1.0, max_steps=args.steps, limit_val_batches=2, val_check_interval=0.5,
        log_every_n_steps=10, enable_checkpointing=False, logger=False, enable_progress_bar=False)
    trainer.fit(model, train, val)
    if trainer.is_global_zero:
        print(f"train_loss {float(trainer.callback_metrics['train_loss']):.4f}, "
              f"val_loss {float(trainer.callback_metrics['val_loss']):.4f}")
        if args.strategy == "pgd":
            import pygraph_dist as pgd

            print(pgd.report())


if __name__ == "__main__":
    main()
