"""pygraph_dist: whole training iterations of data-parallel PyTorch as CUDA graphs.

    import pygraph_dist as pgd
    pgd.init()                                   # torchrun, mpirun or srun
    model, optimizer = pgd.wrap(model.cuda(), optimizer, amp="bf16")
    for x, y in loader:
        optimizer.zero_grad(set_to_none=True)
        loss = model(x, y)
        loss.backward()
        optimizer.step()
    print(pgd.report())
"""

from __future__ import annotations

import contextlib
import copy
import logging

import torch  # noqa: F401 - loads libtorch before the extension

from ._ext import C as _C
from . import clip_route
from .accumulation import AccumulationReadError
from ._ext import graphs_available
from .backend import graph_safe_backend
from .compiled import check_compiled_module, compile_kwargs
from .config import WrapConfig, check_wrap_targets, make_config
from .conformance import LoopConformanceError
from .engine import Engine
from .lifetime import live_engines, teardown_all
from .launch_env import LaunchEnvironment, LaunchError, detect, init
from .reporting import Report, model_report, warn_stock_backend

__all__ = [
    "AccumulationReadError",
    "GraphedModule",
    "LaunchEnvironment",
    "LaunchError",
    "LoopConformanceError",
    "Report",
    "detect",
    "graph_safe_backend",
    "graphs_available",
    "init",
    "report",
    "shutdown",
    "wrap",
]
__version__ = "0.1.0"

logging.getLogger("pygraph_dist").addHandler(logging.NullHandler())


class GraphedModule(torch.nn.Module):
    """The wrapped model. Calling it in training runs one training iteration (or
    its forward, when the loop trains eagerly) and returns what the module
    returns — a loss, a tuple, a dict, a Hugging Face output.

    Returned tensors are fresh each iteration (they never alias a graph's static
    outputs, which the next replay overwrites). ``.module`` is the original
    module; its ``state_dict`` keys carry the ``module.`` prefix, as with DDP.
    """

    def __init__(self, module: torch.nn.Module, engine: Engine) -> None:
        super().__init__()
        self.module = module
        object.__setattr__(self, "_engine", engine)

    def forward(self, *args, **kwargs):
        return self._engine.run(args, kwargs)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._engine.optimizer_zero_grad(set_to_none)

    @contextlib.contextmanager
    def no_sync(self):
        """As ``DistributedDataParallel.no_sync()``: backward passes of model calls
        made inside accumulate gradients locally, without all-reduce; the first
        backward of a call made outside reduces the accumulated gradients."""
        engine = self._engine
        previous, engine.require_sync = engine.require_sync, False
        try:
            yield
        finally:
            engine.require_sync = previous

    @property
    def require_backward_grad_sync(self) -> bool:
        """As on ``DistributedDataParallel``: False makes the backward passes of the
        next model calls accumulate locally, exactly as inside :meth:`no_sync`
        (which sets it); True again makes the next call's backward all-reduce.
        Scripts that accumulate with
        ``model.require_backward_grad_sync = (micro_step == steps - 1)`` work as
        with DDP. Read at the model call, as DDP reads it in forward."""
        return self._engine.require_sync

    @require_backward_grad_sync.setter
    def require_backward_grad_sync(self, value: bool) -> None:
        self._engine.require_sync = bool(value)

    def static_inputs(self):
        """The (args, kwargs) buffers the most recently captured graph reads, or None.

        Writing the next batch into them (``copy_``) and passing them to the
        model call saves the staging copy."""
        return self._engine.cache.latest_static_inputs()

    @property
    def engine(self) -> Engine:
        return self._engine

    def __deepcopy__(self, memo):
        """A deep copy of the wrapped model is a copy of the plain module.

        Copies are made for evaluation and weight averaging --
        ``torch.optim.swa_utils.AveragedModel(model)``, timm's ``ModelEmaV3`` --
        not to train a second time through the same engine (its process group
        cannot be copied, and its graphs belong to the original). The copy's
        parameters and buffers are in the same order as the wrapper's, so
        ``update_parameters(model)`` pairs them up; wrap the copy to train it."""
        logger = logging.getLogger("pygraph_dist")
        if not getattr(GraphedModule, "_deepcopy_said", False):
            GraphedModule._deepcopy_said = True
            logger.info("copy.deepcopy of a pygraph_dist-wrapped model returns a copy of the plain "
                        "module (model.module), not a second wrapped model")
        return copy.deepcopy(self.module, memo)


def wrap(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    loss_fn=None,
    amp: str | torch.dtype | None = None,
    bucket_cap_mb: float = 25.0,
    warmup: int = 3,
    probe: int = 2,
    graphs: bool = True,
    max_grad_norm: float | None = None,
    max_graphs: int = 8,
    graph_memory_mb: float | None = None,
    broadcast_buffers: bool = True,
    replay_timeout: float | None = None,
    process_group=None,
    monitor: bool = True,
    eager_params: tuple[str, ...] | list[str] = (),
    select: bool = True,
    select_margin: float = 0.02,
    pad_batch_to: tuple[int, ...] | list[int] = (),
    pad_value=0,
    skip_nonfinite: bool = False,
    grad_comm_dtype: torch.dtype | str | None = None,
    compile: bool | dict = False,
    learn_accumulation: bool = True,
    ignore_args: tuple[str, ...] | list[str] = (),
    eval_graphs: bool = True,
    loss_graphs: bool = True,
) -> tuple[GraphedModule, torch.optim.Optimizer]:
    """Wrap a model and its optimizer for graphed data-parallel training.

    Args:
        loss_fn: if given, the model is called as ``model(*inputs, target)`` and
            returns ``loss_fn(module(*inputs), target)``; otherwise the module
            itself must return the loss (or an object with ``.loss``).
        amp: ``None`` (fp32), ``"bf16"`` or ``"fp16"`` (with a device-side GradScaler).
        bucket_cap_mb: gradient bucket size for the all-reduce.
        warmup: eager iterations on the capture stream before each capture.
        probe: iterations that run the loop as written while it is checked.
        graphs: ``False`` keeps the engine (reducer, AMP, checks) but never captures.
        max_grad_norm: clip the global gradient norm inside the iteration.
        max_graphs: input signatures that keep a graph at once (least
            recently used out; an evicted one captures again when it returns).
        graph_memory_mb: cap on the graphs' memory (``None``: no cap).
        broadcast_buffers: rank 0's buffers at every forward, like DDP.
        replay_timeout: seconds before a stuck replay ends the process (0 = off;
            default: the process group's timeout).
        process_group: the group whose ranks train this model (default: WORLD).
        monitor: watch the user's code between the model call and
            ``optimizer.step()``, so that a loop a graph cannot replay is
            caught; ``False`` removes those checks.
        eager_params: names of parameters (as in ``named_parameters()``) whose
            gradient all-reduce runs outside the graph, in a bucket of its own;
            the iteration is then captured as two graphs with that reduction
            between them. Sparse embedding weights (``nn.Embedding(sparse=True)``)
            are handled that way automatically, and their update runs eagerly.
        select: time the eager warm-up and the first replays, and keep a
            graph only if it is faster than eager by ``select_margin`` (maxima
            over ranks, so every rank decides alike). ``select=False`` keeps
            every graph that captures.
        select_margin: the fraction a replay must beat eager by (0.02: 2%).
        pad_batch_to: batch sizes to pad dim 0 of the inputs up to (e.g.
            ``(32, 64)``), so that a short last batch reuses a graph. Off by
            default: padded rows change the loss unless they are masked, e.g.
            ``pad_value=(0, -100)`` fills targets with cross-entropy's
            ``ignore_index``. A batch above the largest size is not padded.
        pad_value: fill value, or one per positional argument.
        skip_nonfinite: fp32/bf16: skip the optimizer update of a step whose
            reduced gradients hold inf or NaN, decided on the device inside the
            iteration (no host sync; every rank alike, gradients being
            all-reduced) and counted in ``report()``. Uses the fused optimizer
            kernel's ``found_inf`` input (Adam, AdamW, SGD).
        grad_comm_dtype: ``torch.bfloat16`` all-reduces the fp32 gradient buckets
            in bf16 (half the bytes), written back into the fp32 gradients, inside
            the graph — what DDP's ``bf16_compress_hook`` does. Off by default: it
            rounds every gradient to bf16's 8 bits of mantissa. No effect at world
            size 1, where nothing is sent.
        compile: ``True`` (or a dict of ``torch.compile`` arguments: mode,
            options, dynamic, fullgraph, backend) runs the module's call through
            ``torch.compile`` inside the graphs: inductor's fused kernels, and
            pygraph_dist's capture instead of torch.compile's own CUDA graphs
            (``mode="reduce-overhead"`` is switched to the default mode with a
            warning). ``model.module`` and ``state_dict`` keys stay those of the
            uncompiled module. Compile time and recompiles are in ``report()``.
            A module already compiled by ``torch.compile`` in a mode without
            CUDA graphs works too; one compiled with them is refused.
        learn_accumulation: gradient accumulation without ``model.no_sync()``
            (K model calls and backwards per ``optimizer.step()``): the first
            step shows K, all ranks agree, and from then on only the K-th
            micro-batch all-reduces — the sum, as ``no_sync()`` would. A step
            that ends on another count, or gradients read before the last
            micro-batch, are reduced eagerly first (reported); a loop that
            reads gradients between micro-batches is not deferred.
            ``False``: every micro-batch all-reduces, as DDP.
        ignore_args: names of ``forward`` arguments (int or float) that the
            forward does not read, such as Lightning's ``batch_idx``: calls
            that differ only in them share a graph. Without this, each value
            of a Python argument is a signature of its own, and an argument
            that changes every call never reaches a graph (pygraph_dist warns
            when one takes three values). While the loop is probed, the values
            reach the forward as watched stand-ins; a forward that reads one
            (arithmetic, comparison, printing, a torch call) keeps the loop
            eager, with the line that read it in ``report()``.
        eval_graphs: model calls with gradients disabled (``torch.no_grad()``,
            ``torch.inference_mode()``; evaluation after ``model.eval()``)
            replay a forward-only graph per input signature, after 2 eager
            warm-up calls; outputs are fresh tensors, bitwise equal to the
            eager forward. No collective decides anything, so evaluating on
            some ranks only is fine. ``False``: such calls run the module
            eagerly. Calls in eval mode with autograd on always run eagerly.
        loss_graphs: in a tier-2 loop (the loss computed outside the model),
            the loss the loop computes from the model's outputs is learned in
            the last warm-up step and replayed inside the backward graph: the
            loss is handed out pending and filled in by ``loss.backward()``.
            A step that reads the loss before ``backward()`` gets it computed
            eagerly and runs tier 2 as without this. Bitwise equal either way.
            ``False``: the loss and its backward always run eagerly.

    Returns ``(GraphedModule, optimizer)``; the optimizer is the same object,
    made capturable and routed through the engine.
    """
    check_wrap_targets(model, optimizer)
    check_compiled_module(model, compile)
    config = make_config(
        loss_fn=loss_fn, amp=amp, bucket_cap_mb=bucket_cap_mb, warmup=warmup, probe=probe,
        graphs=graphs, max_grad_norm=max_grad_norm, max_graphs=max_graphs,
        graph_memory_mb=graph_memory_mb, broadcast_buffers=broadcast_buffers,
        replay_timeout=replay_timeout, monitor=monitor, eager_params=eager_params,
        select=select, select_margin=select_margin, pad_batch_to=pad_batch_to, pad_value=pad_value,
        skip_nonfinite=skip_nonfinite, grad_comm_dtype=grad_comm_dtype,
        compile=compile_kwargs(compile), learn_accumulation=learn_accumulation,
        ignore_args=ignore_args, eval_graphs=eval_graphs, loss_graphs=loss_graphs,
    )
    engine = Engine(model, optimizer, config, process_group)
    warn_stock_backend(engine)
    wrapper = GraphedModule(model, engine)
    clip_route.remember(wrapper)  # clip_grad_norm_(model.parameters()) without the generator's walk
    return wrapper, optimizer


def report(print_report: bool = False, *, verbose: bool = False, as_dict: bool = False) -> Report | dict:
    """What ran for each wrapped model on this rank, and why anything ran eagerly.

    ``print(pgd.report())`` shows a few lines per model: steps replayed and eager
    (with the tier, and ms per step where the graph was timed against eager),
    each reason for eager steps with its fix, repeated events counted, the
    precision that ran (your own autocast included) and what a stock process
    group backend costs. ``verbose=True``: every input signature, setting and
    event. ``as_dict=True`` returns :meth:`Report.as_dict` (plain JSON types,
    keys documented there) for loggers; ``Report.scalars()`` gives per-model
    numbers for TensorBoard or Weights & Biases.
    """
    r = Report([model_report(e) for e in live_engines()], verbose=verbose)  # creation order
    if print_report:
        print(r)
    return r.as_dict() if as_dict else r


def shutdown() -> None:
    """Release every graph, then destroy the default process group, and take
    back the process group shutdown hook that ``wrap()`` installed."""
    import gc

    import torch.distributed as dist

    from . import lifetime

    teardown_all()
    if dist.is_initialized():
        dist.destroy_process_group()
    lifetime.uninstall()
    gc.collect()  # destroy what held the group now, not during interpreter exit
