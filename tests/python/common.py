"""Helpers the per-rank cases share: a small MLP, deterministic batches, the
training loop the cases run, comparisons across ranks, and token models."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


class MLP(nn.Module):
    def __init__(self, width=32, depth=3, classes=5, dropout=0.0):
        super().__init__()
        layers = []
        for _ in range(depth):
            layers += [nn.Linear(width, width), nn.GELU(), nn.LayerNorm(width)]
            if dropout:
                layers.append(nn.Dropout(dropout))
        self.body = nn.Sequential(*layers)
        self.head = nn.Linear(width, classes)
        self.sync_on_capture_rank = -1  # test hook: a host sync only while capturing

    def forward(self, x, y):
        h = self.body(x)
        if self.sync_on_capture_rank == dist.get_rank() and torch.cuda.is_current_stream_capturing():
            h = h + 0 * h.sum().item()
        return nn.functional.cross_entropy(self.head(h), y)


class MLPLogits(MLP):
    """The MLP returning logits: the loss is computed in the loop (tier 2)."""

    def forward(self, x):
        return self.head(self.body(x))


def data(step, rank, batch=16, width=32, classes=5, device="cpu"):
    g = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randn(batch, width, generator=g)
    y = torch.randint(0, classes, (batch,), generator=g)
    return x.to(device), y.to(device)


def flat_params(model) -> torch.Tensor:
    return torch.cat([p.detach().float().reshape(-1).cpu() for p in model.parameters()])


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max())


def ranks_agree(t: torch.Tensor, device) -> bool:
    """Every rank holds bitwise the same tensor."""
    x = t.to(device).double()
    lo, hi = x.clone(), x.clone()
    dist.all_reduce(lo, op=dist.ReduceOp.MIN)
    dist.all_reduce(hi, op=dist.ReduceOp.MAX)
    return bool(torch.equal(lo, hi))


def device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def train(model, optimizer, steps, rank, *, clip=None, dev="cpu", variant="plain", scheduler=None,
           make_batch=None):
    """``make_batch(step) -> (inputs, target)`` replaces the default ``data(step, rank)``."""
    losses = []
    for step in range(steps):
        x, y = make_batch(step) if make_batch is not None else data(step, rank, device=dev)
        if variant == "accumulate":
            optimizer.zero_grad(set_to_none=True)
            model(x[:8], y[:8]).backward()
            loss = model(x[8:], y[8:])
            loss.backward()
        elif variant == "no_zero_grad":
            loss = model(x, y)
            loss.backward()
        elif variant == "zero_after_forward":  # a DDP loop: zero_grad() between forward and backward
            loss = model(x, y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
        else:
            optimizer.zero_grad(set_to_none=True)
            loss = model(x, y)
            if variant == "scaled":  # a scale that changes from step to step: no graph can seed it
                (loss * (0.5 if step % 2 else 0.25)).backward()
            elif variant == "scaled_const":  # the same scale every step: the graph's backward seed
                (loss * 0.5).backward()
            elif variant == "aux":
                (loss + 0.01 * sum(p.pow(2).sum() for p in model.parameters())).backward()
            else:
                loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        if variant == "grad_edit":
            for p in model.parameters():
                p.grad.mul_(0.5)
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        losses.append(float(loss.item()))
    return losses


def adamw(params, amp, lr):
    return torch.optim.AdamW(params, lr=lr, fused=(amp == "fp16") or None)


def gpu_model(seed, dropout):
    torch.manual_seed(seed)
    return MLP(width=32, depth=4, dropout=dropout).to(device())


class SparseLM(nn.Module):
    """A sparse embedding (its gradient is sparse) feeding dense layers."""

    def __init__(self, vocab=200, width=32, classes=5, sparse=True):
        super().__init__()
        self.emb = nn.Embedding(vocab, width, sparse=sparse)
        self.body = nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.LayerNorm(width))
        self.head = nn.Linear(width, classes)

    def forward(self, tokens, y):
        return nn.functional.cross_entropy(self.head(self.body(self.emb(tokens).sum(1))), y)


def token_data(step, rank, batch=16, seq=6, vocab=200, classes=5, device="cpu"):
    g = torch.Generator().manual_seed(7919 * rank + step)
    # A narrow range so that rows repeat within and across ranks (duplicate sparse indices).
    tokens = torch.randint(0, vocab // 4, (batch, seq), generator=g)
    return tokens.to(device), torch.randint(0, classes, (batch,), generator=g).to(device)


def count_ops() -> type:
    """A dispatch mode that counts the ops run under it, by name (``.ops``)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops: dict[str, int] = {}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = str(func.overloadpacket.__name__)
            self.ops[name] = self.ops.get(name, 0) + 1
            return func(*args, **(kwargs or {}))

    return Count
