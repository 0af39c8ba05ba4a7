"""``wrap()``'s configuration, and every check of its arguments.

Errors here say what to change: a user meets them at ``wrap()``, before any
process-group traffic or graph, rather than as an ``AttributeError`` deep in
the first iteration.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn


@dataclass(frozen=True)
class WrapConfig:
    loss_fn: Callable | None = None
    amp: str | torch.dtype | None = None
    bucket_cap_mb: float = 25.0
    warmup: int = 3
    probe: int = 2
    graphs: bool = True
    max_grad_norm: float | None = None
    max_graphs: int = 8
    graph_memory_mb: float | None = None
    broadcast_buffers: bool = True
    replay_timeout: float | None = None
    monitor: bool = True
    eager_params: tuple[str, ...] = ()
    select: bool = True
    select_margin: float = 0.02
    pad_batch_to: tuple[int, ...] = ()
    pad_value: Any = 0
    skip_nonfinite: bool = False
    grad_comm_dtype: torch.dtype | None = None
    compile: dict | None = None  # torch.compile arguments (compiled.compile_kwargs)
    learn_accumulation: bool = True  # accumulation.py
    ignore_args: tuple[str, ...] = ()  # arguments.py
    eval_graphs: bool = True  # evaluation.py
    loss_graphs: bool = True  # loss_lane.py


COMM_DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "torch.bfloat16": torch.bfloat16}


def make_config(**kwargs: Any) -> WrapConfig:
    """A checked :class:`WrapConfig` from ``wrap()``'s keyword arguments."""
    pad_batch_to = kwargs.get("pad_batch_to", ())
    pad_value = kwargs.get("pad_value", 0)
    kwargs["pad_batch_to"] = tuple(sorted(pad_batch_to))
    kwargs["pad_value"] = tuple(pad_value) if isinstance(pad_value, (list, tuple)) else pad_value
    kwargs["eager_params"] = tuple(kwargs.get("eager_params", ()))
    ignore_args = kwargs.get("ignore_args", ())
    kwargs["ignore_args"] = (ignore_args,) if isinstance(ignore_args, str) else tuple(ignore_args)
    if not all(isinstance(n, str) and n for n in kwargs["ignore_args"]):
        raise TypeError(f"ignore_args takes argument names of the module's forward (strings), got "
                        f"{ignore_args!r}")
    comm = kwargs.get("grad_comm_dtype")
    if comm is not None:
        key = comm.lower() if isinstance(comm, str) else str(comm)
        if comm in (torch.float32, "fp32", "float32"):
            comm = None  # the gradients' own dtype: nothing to compress
        elif key not in COMM_DTYPES:
            raise ValueError(f"grad_comm_dtype={comm!r} is not supported: use torch.bfloat16 (like DDP's "
                             "bf16_compress_hook) or None. fp16 all-reduce can overflow without a "
                             "scale; it is not offered.")
        else:
            comm = COMM_DTYPES[key]
        kwargs["grad_comm_dtype"] = comm
    config = WrapConfig(**kwargs)
    if not 0.0 <= config.select_margin < 1.0:
        raise ValueError(f"select_margin must be in [0, 1), got {config.select_margin}")
    if any(not isinstance(b, int) or b <= 0 for b in config.pad_batch_to):
        raise ValueError(f"pad_batch_to takes positive batch sizes, got {config.pad_batch_to}")
    if not config.bucket_cap_mb > 0:
        raise ValueError(f"bucket_cap_mb must be positive, got {config.bucket_cap_mb}")
    if config.warmup < 1:
        raise ValueError(f"warmup must be at least 1 (cuBLAS, NCCL and optimizer state initialise "
                         f"lazily outside the graph), got {config.warmup}")
    if config.probe < 0 or config.max_graphs < 1:
        raise ValueError(f"probe must be >= 0 and max_graphs >= 1, got probe={config.probe}, "
                         f"max_graphs={config.max_graphs}")
    if config.max_grad_norm is not None and not config.max_grad_norm > 0:
        raise ValueError(f"max_grad_norm must be positive (or None), got {config.max_grad_norm}")
    if config.skip_nonfinite and str(config.amp).lower() in ("fp16", "float16", "half", "torch.float16"):
        raise ValueError("skip_nonfinite=True is for fp32 and bf16: with amp='fp16' the GradScaler "
                         "already skips steps with non-finite gradients. Drop skip_nonfinite.")
    if config.loss_fn is not None and not callable(config.loss_fn):
        raise TypeError(f"loss_fn must be callable, got {type(config.loss_fn).__name__}")
    return config


def check_wrap_targets(model: Any, optimizer: Any) -> None:
    """``wrap(model, optimizer)`` with a module and an optimizer, neither wrapped yet."""
    if isinstance(model, torch.optim.Optimizer) and isinstance(optimizer, nn.Module):
        raise TypeError("pygraph_dist.wrap() takes (model, optimizer): the arguments are swapped. "
                        "Call model, optimizer = pygraph_dist.wrap(model, optimizer).")
    if getattr(model, "_pgd_engine", None) is not None or type(model).__name__ == "GraphedModule":
        raise ValueError("this model is already wrapped by pygraph_dist.wrap(); wrap the original "
                         "module once (its wrapper's .module is the original).")
    if isinstance(model, nn.parallel.DistributedDataParallel):
        raise TypeError("the model is a torch DistributedDataParallel: pygraph_dist reduces "
                        "gradients itself, and DDP's reducer would all-reduce them a second time. "
                        "Pass the plain module: pygraph_dist.wrap(ddp_model.module, optimizer).")
    if not isinstance(model, nn.Module):
        raise TypeError(f"pygraph_dist.wrap(): model must be a torch.nn.Module, got "
                        f"{type(model).__name__}.")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"pygraph_dist.wrap(): optimizer must be a torch.optim.Optimizer, got "
                        f"{type(optimizer).__name__}.")
    if optimizer.__dict__.get("_pgd_engine") is not None:
        raise ValueError("this optimizer is already wrapped by pygraph_dist.wrap(); create one "
                         "optimizer per wrapped model.")


def sparse_param_names(module: nn.Module, trainable: set[str]) -> list[str]:
    """Weights of nn.Embedding / nn.EmbeddingBag(sparse=True): their gradients are sparse."""
    names = []
    for prefix, m in module.named_modules():
        if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse:
            name = f"{prefix}.weight" if prefix else "weight"
            if name in trainable:
                names.append(name)
    return names


def check_sparse_support(sparse: list[str], optimizer, amp, config: WrapConfig) -> None:
    what = f"sparse gradients ({', '.join(sparse[:3])})"
    if amp.needs_grad_scaler:
        raise ValueError(f"amp='fp16' with {what} is not supported: loss scaling would have to "
                         "unscale sparse gradients outside the graph. Use amp='bf16' or fp32, or "
                         "nn.Embedding(sparse=False).")
    if config.max_grad_norm is not None:
        raise ValueError(f"max_grad_norm with {what} is not supported: the global norm needs the "
                         "sparse gradients, which are reduced outside the graph. Clip without "
                         "sparse embeddings, or use nn.Embedding(sparse=False).")
    if not isinstance(optimizer, (torch.optim.SGD, torch.optim.Adagrad)):
        raise ValueError(f"{type(optimizer).__name__} does not take {what}; use torch.optim.SGD "
                         "or Adagrad, or nn.Embedding(sparse=False).")
