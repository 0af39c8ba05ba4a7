"""Benchmark workloads: random weights, synthetic data, no downloads.

Each workload gives two views of the same network, so that the benchmark can
train it with the loops users write:

* ``build_net()``: the network alone, ``net(*inputs) -> output`` (logits), and
  ``loss_fn(output, target) -> loss``, with ``split(batch) -> (inputs, target)``:
  the ``outside`` loop computes the loss in the training loop;
* ``build()``: a module whose ``forward(*batch)`` returns the loss, i.e. the
  same net and the same ``loss_fn`` inside the module (the ``inside`` loop).

Losses upcast the output to fp32 themselves (``.float()``), so the loss is the
same arithmetic inside or outside an autocast region (autocast runs
cross-entropy in fp32 anyway). Batches are CPU tensors of a given per-GPU size.
Adding a workload is one ``register(...)``.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F


def _last_is_target(batch: tuple) -> tuple[tuple, torch.Tensor]:
    return tuple(batch[:-1]), batch[-1]


def classification_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float(), target)


@dataclass(frozen=True)
class Workload:
    name: str
    description: str
    default_batch: int
    build_net: Callable[[], nn.Module]
    make_batch: Callable[[int, torch.Generator], tuple]  # (batch size, generator) -> CPU tensors
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = classification_loss
    split: Callable[[tuple], tuple[tuple, torch.Tensor]] = _last_is_target
    requires: tuple[str, ...] = ()

    def build(self) -> nn.Module:
        """The net with its loss inside: ``module(*batch)`` returns the loss."""
        return WithLoss(self.build_net(), self.loss_fn, self.split)

    def missing(self) -> list[str]:
        return [m for m in self.requires if importlib.util.find_spec(m) is None]


class WithLoss(nn.Module):
    """``net`` plus its loss: ``forward(*batch)`` splits the batch into inputs and
    target and returns ``loss_fn(net(*inputs), target)``. Parameter names carry
    the ``net.`` prefix."""

    def __init__(self, net: nn.Module, loss_fn: Callable, split: Callable) -> None:
        super().__init__()
        self.net = net
        self.loss_fn = loss_fn
        self.split = split

    def forward(self, *batch: torch.Tensor) -> torch.Tensor:
        inputs, target = self.split(batch)
        return self.loss_fn(self.net(*inputs), target)


REGISTRY: dict[str, Workload] = {}


def register(w: Workload) -> Workload:
    REGISTRY[w.name] = w
    return w


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
    build_net=DeepMLP,
    make_batch=lambda b, g: (torch.randn(b, 1024, generator=g), torch.randint(0, 10, (b,), generator=g)),
))


# --------------------------------------------------------------- GPT-2 small
class GPT2Logits(nn.Module):
    """Hugging Face GPT2LMHeadModel returning the logits tensor (no cache, no loss)."""

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
        return self.model(input_ids=ids, use_cache=False).logits


def causal_lm_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy, computed as Hugging Face's ForCausalLMLoss does
    (labels shifted by padding with -100, so the logits are not copied; fp32)."""
    labels = F.pad(ids, (0, 1), value=-100)[:, 1:]
    return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=-100)


def _gpt2_workload(name: str, seq: int, batch: int, description: str) -> Workload:
    return register(Workload(
        name=name,
        description=description,
        default_batch=batch,
        build_net=GPT2Logits,
        make_batch=lambda b, g: (torch.randint(0, 50257, (b, seq), generator=g),),
        loss_fn=causal_lm_loss,
        split=lambda batch: (tuple(batch), batch[0]),  # the tokens are input and target
        requires=("transformers",),
    ))


_gpt2_workload("gpt2", 128, 8, "GPT-2-small shape (transformers GPT2Config: 12 layers, 768 wide), seq 128")
# A GPU-bound configuration: the same GPT-2-small shape at 16 x 512 tokens per GPU,
# where kernels, not launches, take the time. Selective deployment must keep
# pygraph_dist from being slower than eager here (issue 5).
_gpt2_workload("gpt2_gpu_bound", 512, 16, "GPT-2-small shape, seq 512, batch 16 per GPU (GPU-bound)")


# --------------------------------------------------------------- timm models
def _timm_net(name: str) -> nn.Module:
    import timm

    return timm.create_model(name, pretrained=False, num_classes=1000)


def _timm_workload(name: str, timm_name: str, pixels: int, description: str) -> Workload:
    return register(Workload(
        name=name,
        description=description,
        default_batch=32,
        build_net=lambda: _timm_net(timm_name),
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
    build_net=lambda: DeepMLP(width=32, depth=2),
    make_batch=lambda b, g: (torch.randn(b, 32, generator=g), torch.randint(0, 10, (b,), generator=g)),
))


# --------------------------------------------------------------- helpers
def build_on(dev: torch.device, build: Callable[[], nn.Module]) -> nn.Module:
    """build() with seed 0 (every mode starts from the same weights), on the device
    (faster initialisation), on the CPU if a constructor insists, then moved."""
    torch.manual_seed(0)
    try:
        with torch.device(dev):
            module = build()
    except Exception:  # noqa: BLE001
        torch.manual_seed(0)
        module = build()
    return module.to(dev)


def autocast_bf16(dev: torch.device):
    """bf16 autocast on CUDA (no weight cache: graphs replay it), a no-op elsewhere."""
    return torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda", cache_enabled=False)
