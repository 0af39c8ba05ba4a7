"""``wrap()``'s configuration, and every check of its arguments.

Errors here say what to change: a user meets them at ``wrap()``, before any
process-group traffic or graph, rather than as an ``AttributeError`` deep in
the first iteration.
"""

from __future__ import annotations

import textwrap
import warnings
from dataclasses import dataclass, field, fields
from typing import Any, Callable

import torch
from torch import nn

from .compiled import compile_kwargs


def option(default: Any, doc: str) -> Any:
    """A field of :class:`WrapConfig`: one ``wrap()`` option, its default and its documentation."""
    return field(default=default, metadata={"doc": doc})


@dataclass(frozen=True)
class WrapConfig:
    """Every option of ``wrap()``, in its order, with its default and what it does: the
    one place they are written. ``wrap()``'s keyword-only signature, its docstring's
    ``Args`` and the options table of docs/api.md are checked against these fields
    (tests/python/test_options.py); strategies and accelerators of the integrations
    take the same names.

    Construction checks every value (errors say what to change) and normalises it:
    sequences become tuples (``pad_batch_to`` sorted), ``grad_comm_dtype`` a torch
    dtype or None, ``compile`` the ``torch.compile`` arguments or None
    (``compiled.compile_kwargs``)."""

    loss_fn: Callable | None = option(None, """
        if given, the model is called as ``model(*inputs, target)`` and returns
        ``loss_fn(module(*inputs), target)``; otherwise the module itself must
        return the loss (or an object with ``.loss``).""")
    amp: str | torch.dtype | None = option(None, """
        ``None`` (fp32), ``"bf16"`` or ``"fp16"`` (with a device-side GradScaler).""")
    bucket_cap_mb: float = option(25.0, "gradient bucket size for the all-reduce.")
    warmup: int = option(3, "eager iterations on the capture stream before each capture.")
    probe: int = option(2, "iterations that run the loop as written while it is checked.")
    graphs: bool = option(True, "``False`` keeps the engine (reducer, AMP, checks) but never captures.")
    max_grad_norm: float | None = option(None, "clip the global gradient norm inside the iteration.")
    max_graphs: int = option(8, """
        input signatures that keep a graph at once (least recently used out; an
        evicted one captures again when it returns).""")
    graph_memory_mb: float | None = option(None, "cap on the graphs' memory (``None``: no cap).")
    broadcast_buffers: bool = option(True, "rank 0's buffers at every forward, like DDP.")
    replay_timeout: float | None = option(None, """
        seconds before a stuck replay ends the process (0 = off; default: the
        process group's timeout).""")
    process_group: Any = option(None, "the group whose ranks train this model (default: WORLD).")
    monitor: bool = option(True, """
        watch the user's code between the model call and ``optimizer.step()``, so
        that a loop a graph cannot replay is caught; ``False`` removes those checks.""")
    eager_params: tuple[str, ...] | list[str] = option((), """
        names of parameters (as in ``named_parameters()``) whose gradient
        all-reduce runs outside the graph, in a bucket of its own; the iteration
        is then captured as two graphs with that reduction between them. Sparse
        embedding weights (``nn.Embedding(sparse=True)``) are handled that way
        automatically, and their update runs eagerly.""")
    select: bool = option(True, """
        time the eager warm-up and the first replays, and keep a graph only if it
        is faster than eager by ``select_margin`` (maxima over ranks, so every rank
        decides alike). ``select=False`` keeps every graph that captures.""")
    select_margin: float = option(0.02, "the fraction a replay must beat eager by (0.02: 2%).")
    pad_batch_to: tuple[int, ...] | list[int] = option((), """
        batch sizes to pad dim 0 of the inputs up to (e.g. ``(32, 64)``), so that a
        short last batch reuses a graph. Off by default: padded rows change the
        loss unless they are masked, e.g. ``pad_value=(0, -100)`` fills targets
        with cross-entropy's ``ignore_index``. A batch above the largest size is
        not padded.""")
    pad_value: Any = option(0, "fill value, or one per positional argument.")
    skip_nonfinite: bool = option(False, """
        fp32/bf16: skip the optimizer update of a step whose reduced gradients
        hold inf or NaN, decided on the device inside the iteration (no host sync;
        every rank alike, gradients being all-reduced) and counted in
        ``report()``. Uses the fused optimizer kernel's ``found_inf`` input (Adam,
        AdamW, SGD).""")
    grad_comm_dtype: torch.dtype | str | None = option(None, """
        ``torch.bfloat16`` all-reduces the fp32 gradient buckets in bf16 (half the
        bytes), written back into the fp32 gradients, inside the graph -- what
        DDP's ``bf16_compress_hook`` does. Off by default: it rounds every
        gradient to bf16's 8 bits of mantissa. No effect at world size 1, where
        nothing is sent.""")
    compile: bool | dict | None = option(False, """
        ``True`` (or a dict of ``torch.compile`` arguments: mode, options, dynamic,
        fullgraph, backend) runs the module's call through ``torch.compile``
        inside the graphs: inductor's fused kernels, and pygraph_dist's capture
        instead of torch.compile's own CUDA graphs (``mode="reduce-overhead"`` is
        switched to the default mode with a warning). ``model.module`` and
        ``state_dict`` keys stay those of the uncompiled module. Compile time and
        recompiles are in ``report()``. A module already compiled by
        ``torch.compile`` in a mode without CUDA graphs works too; one compiled
        with them is refused.""")
    learn_accumulation: bool = option(True, """
        gradient accumulation without ``model.no_sync()`` (K model calls and
        backwards per ``optimizer.step()``): the first step shows K, all ranks
        agree, and from then on only the K-th micro-batch all-reduces -- the sum,
        as ``no_sync()`` would. A step that ends on another count, or gradients
        read before the last micro-batch, are reduced eagerly first (reported); a
        loop that reads gradients between micro-batches is not deferred.
        ``False``: every micro-batch all-reduces, as DDP.""")
    ignore_args: tuple[str, ...] | list[str] = option((), """
        names of ``forward`` arguments (int or float) that the forward does not
        read, such as Lightning's ``batch_idx``: calls that differ only in them
        share a graph. Without this, each value of a Python argument is a
        signature of its own, and an argument that changes every call never
        reaches a graph (pygraph_dist warns when one takes three values). While
        the loop is probed, the values reach the forward as watched stand-ins; a
        forward that reads one (arithmetic, comparison, printing, a torch call)
        keeps the loop eager, with the line that read it in ``report()``.""")
    eval_graphs: bool = option(True, """
        model calls with gradients disabled (``torch.no_grad()``,
        ``torch.inference_mode()``; evaluation after ``model.eval()``) replay a
        forward-only graph per input signature, after 2 eager warm-up calls;
        outputs are fresh tensors, bitwise equal to the eager forward. No
        collective decides anything, so evaluating on some ranks only is fine.
        ``False``: such calls run the module eagerly. Calls in eval mode with
        autograd on always run eagerly.""")
    loss_graphs: bool = option(True, """
        in a tier-2 loop (the loss computed outside the model), the loss the loop
        computes from the model's outputs is learned in the last warm-up step and
        replayed inside the backward graph: the loss is handed out pending and
        filled in by ``loss.backward()``. A step that reads the loss before
        ``backward()`` gets it computed eagerly and runs tier 2 as without this.
        Bitwise equal either way. ``False``: the loss and its backward always run
        eagerly.""")

    def __post_init__(self) -> None:
        """Normalise, then check: each error says what to change."""
        # compiled.compile_kwargs warns at wrap()'s caller: said again from here, whose
        # caller is the dataclass's __init__ (called by wrap()).
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            self._set("compile", compile_kwargs(self.compile))
        for w in said:
            warnings.warn(w.message, w.category, stacklevel=4)
        self._set("pad_batch_to", tuple(sorted(self.pad_batch_to)))
        if isinstance(self.pad_value, (list, tuple)):
            self._set("pad_value", tuple(self.pad_value))
        self._set("eager_params", tuple(self.eager_params))
        ignore_args = self.ignore_args
        self._set("ignore_args", (ignore_args,) if isinstance(ignore_args, str) else tuple(ignore_args))
        if not all(isinstance(n, str) and n for n in self.ignore_args):
            raise TypeError(f"ignore_args takes argument names of the module's forward (strings), got "
                            f"{ignore_args!r}")
        self._set("grad_comm_dtype", _comm_dtype(self.grad_comm_dtype))
        if not 0.0 <= self.select_margin < 1.0:
            raise ValueError(f"select_margin must be in [0, 1), got {self.select_margin}")
        if any(not isinstance(b, int) or b <= 0 for b in self.pad_batch_to):
            raise ValueError(f"pad_batch_to takes positive batch sizes, got {self.pad_batch_to}")
        if not self.bucket_cap_mb > 0:
            raise ValueError(f"bucket_cap_mb must be positive, got {self.bucket_cap_mb}")
        if self.warmup < 1:
            raise ValueError(f"warmup must be at least 1 (cuBLAS, NCCL and optimizer state initialise "
                             f"lazily outside the graph), got {self.warmup}")
        if self.probe < 0 or self.max_graphs < 1:
            raise ValueError(f"probe must be >= 0 and max_graphs >= 1, got probe={self.probe}, "
                             f"max_graphs={self.max_graphs}")
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            raise ValueError(f"max_grad_norm must be positive (or None), got {self.max_grad_norm}")
        if self.skip_nonfinite and str(self.amp).lower() in ("fp16", "float16", "half", "torch.float16"):
            raise ValueError("skip_nonfinite=True is for fp32 and bf16: with amp='fp16' the GradScaler "
                             "already skips steps with non-finite gradients. Drop skip_nonfinite.")
        if self.loss_fn is not None and not callable(self.loss_fn):
            raise TypeError(f"loss_fn must be callable, got {type(self.loss_fn).__name__}")

    def _set(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)  # frozen: only construction normalises


OPTIONS: tuple[str, ...] = tuple(f.name for f in fields(WrapConfig))  # wrap()'s keyword options, in order

COMM_DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "torch.bfloat16": torch.bfloat16}


def _comm_dtype(comm: Any) -> torch.dtype | None:
    if comm is None or comm in (torch.float32, "fp32", "float32"):
        return None  # the gradients' own dtype: nothing to compress
    key = comm.lower() if isinstance(comm, str) else str(comm)
    if key not in COMM_DTYPES:
        raise ValueError(f"grad_comm_dtype={comm!r} is not supported: use torch.bfloat16 (like DDP's "
                         "bf16_compress_hook) or None. fp16 all-reduce can overflow without a "
                         "scale; it is not offered.")
    return COMM_DTYPES[key]


def options_doc(indent: str = "        ") -> str:
    """The ``Args:`` entries of every option, from the fields' documentation (``wrap()``'s docstring)."""
    out = []
    for f in fields(WrapConfig):
        text = " ".join(f.metadata["doc"].split())
        out.append(textwrap.fill(f"{f.name}: {text}", 88, initial_indent=indent,
                                 subsequent_indent=indent + "    ", break_on_hyphens=False,
                                 break_long_words=False))
    return "\n".join(out)


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
