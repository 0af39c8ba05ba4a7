"""Benchmark workloads: random weights, synthetic data, no downloads.

Each workload builds a module whose ``forward(*batch)`` returns the loss, and
makes batches of a given per-GPU size. Adding one is one ``register(...)``.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class Workload:
    name: str
    description: str
    default_batch: int
    build: Callable[[], nn.Module]
    make_batch: Callable[[int, torch.Generator], tuple]  # (batch size, generator) -> CPU tensors
    requires: tuple[str, ...] = ()

    def missing(self) -> list[str]:
        return [m for m in self.requires if importlib.util.find_spec(m) is None]


REGISTRY: dict[str, Workload] = {}


def register(w: Workload) -> Workload:
    REGISTRY[w.name] = w
    return w


class ClassifierLoss(nn.Module):
    """``model(x)`` logits -> cross-entropy against ``y``: a module that returns its loss."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(self.model(x), y)


# --------------------------------------------------------------- deep MLP
class DeepMLP(nn.Module):
    def __init__(self, width: int = 1024, depth: int = 32, classes: int = 10) -> None:
        super().__init__()
        blocks = []
        for _ in range(depth):
            blocks += [nn.Linear(width, width), nn.GELU(), nn.LayerNorm(width)]
        self.body = nn.Sequential(*blocks)
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


register(Workload(
    name="mlp",
    description="deep MLP: 32 x (Linear-GELU-LayerNorm), width 1024, 10 classes",
    default_batch=64,
    build=lambda: ClassifierLoss(DeepMLP()),
    make_batch=lambda b, g: (torch.randn(b, 1024, generator=g), torch.randint(0, 10, (b,), generator=g)),
))


# --------------------------------------------------------------- GPT-2 small
class GPT2Loss(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config(n_layer=12, n_embd=768, n_head=12, n_positions=1024, vocab_size=50257,
                            attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0)
        try:
            self.model = GPT2LMHeadModel._from_config(config, attn_implementation="sdpa")
        except (TypeError, ValueError):
            self.model = GPT2LMHeadModel(config)
        self.model.config.use_cache = False

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids, labels=ids, use_cache=False).loss


def _gpt2_workload(name: str, seq: int, batch: int, description: str) -> Workload:
    return register(Workload(
        name=name,
        description=description,
        default_batch=batch,
        build=GPT2Loss,
        make_batch=lambda b, g: (torch.randint(0, 50257, (b, seq), generator=g),),
        requires=("transformers",),
    ))


_gpt2_workload("gpt2", 128, 8, "GPT-2-small shape (transformers GPT2Config: 12 layers, 768 wide), seq 128")
# A GPU-bound configuration: the same GPT-2-small shape at 16 x 512 tokens per GPU,
# where kernels, not launches, take the time. Selective deployment must keep
# pygraph_dist from being slower than eager here (issue 5).
_gpt2_workload("gpt2_gpu_bound", 512, 16, "GPT-2-small shape, seq 512, batch 16 per GPU (GPU-bound)")


# --------------------------------------------------------------- timm models
def _timm(name: str, **kwargs) -> nn.Module:
    import timm

    return ClassifierLoss(timm.create_model(name, pretrained=False, num_classes=1000, **kwargs))


def _timm_workload(name: str, timm_name: str, pixels: int, description: str) -> Workload:
    return register(Workload(
        name=name,
        description=description,
        default_batch=32,
        build=lambda: _timm(timm_name),
        make_batch=lambda b, g: (torch.randn(b, 3, pixels, pixels, generator=g),
                                 torch.randint(0, 1000, (b,), generator=g)),
        requires=("timm",),
    ))


_timm_workload("resnet50", "resnet50", 128, "ResNet-50 (timm) at 128 px, 1000 classes")
_timm_workload("vit_tiny", "vit_tiny_patch16_224", 224, "ViT-tiny/16 (timm) at 224 px, 1000 classes")

# A tiny workload for smoke tests of the benchmark itself (CPU CI).
register(Workload(
    name="tiny",
    description="tiny MLP (smoke tests of the benchmark harness)",
    default_batch=8,
    build=lambda: ClassifierLoss(DeepMLP(width=32, depth=2)),
    make_batch=lambda b, g: (torch.randn(b, 32, generator=g), torch.randint(0, 10, (b,), generator=g)),
))
