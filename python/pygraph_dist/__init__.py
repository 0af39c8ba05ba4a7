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

# No ``from __future__ import annotations`` here: it would bind the public name
# ``annotations`` in the package (every annotation below evaluates at import).
import contextlib as _contextlib
import copy as _copy
import logging as _logging

import torch as _torch  # loads libtorch before the extension

from .engine.engine import Engine as _Engine
from .launch import lifetime as _lifetime
from .launch.backend import graph_safe_backend
from .launch.launch_env import LaunchEnvironment, LaunchError, detect, init
from .loop import compiled as _compiled
from .loop import config as _config
from .loop.accumulation import AccumulationReadError
from .loop.conformance import LoopConformanceError
from .reports import reporting as _reporting
from .reports.reporting import Report
from .runtime._ext import C as _C  # noqa: F401 - the extension, loaded (and its torch version checked) first
from .runtime._ext import graphs_available
from .step import clip_route as _clip_route

# The public names; everything else here is a subpackage (pygraph_dist.reports,
# pygraph_dist.loop, ...; the layers: docs/design.md) or private
# (tests/python/test_options.py checks it).
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

_logging.getLogger("pygraph_dist").addHandler(_logging.NullHandler())


class GraphedModule(_torch.nn.Module):
    """The wrapped model. Calling it in training runs one training iteration (or
    its forward, when the loop trains eagerly) and returns what the module
    returns — a loss, a tuple, a dict, a Hugging Face output.

    Returned tensors are fresh each iteration (they never alias a graph's static
    outputs, which the next replay overwrites). ``.module`` is the original
    module; its ``state_dict`` keys carry the ``module.`` prefix, as with DDP.
    """

    def __init__(self, module: _torch.nn.Module, engine: _Engine) -> None:
        super().__init__()
        self.module = module
        object.__setattr__(self, "_engine", engine)

    def forward(self, *args, **kwargs):
        return self._engine.run(args, kwargs)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._engine.optimizer_zero_grad(set_to_none)

    @_contextlib.contextmanager
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
    def engine(self) -> _Engine:
        return self._engine

    def __deepcopy__(self, memo):
        """A deep copy of the wrapped model is a copy of the plain module.

        Copies are made for evaluation and weight averaging --
        ``torch.optim.swa_utils.AveragedModel(model)``, timm's ``ModelEmaV3`` --
        not to train a second time through the same engine (its process group
        cannot be copied, and its graphs belong to the original). The copy's
        parameters and buffers are in the same order as the wrapper's, so
        ``update_parameters(model)`` pairs them up; wrap the copy to train it."""
        logger = _logging.getLogger("pygraph_dist")
        if not getattr(GraphedModule, "_deepcopy_said", False):
            GraphedModule._deepcopy_said = True
            logger.info("copy.deepcopy of a pygraph_dist-wrapped model returns a copy of the plain "
                        "module (model.module), not a second wrapped model")
        return _copy.deepcopy(self.module, memo)


def wrap(
    model: _torch.nn.Module,
    optimizer: _torch.optim.Optimizer,
    *,
    loss_fn=None,
    amp: str | _torch.dtype | None = None,
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
    grad_comm_dtype: _torch.dtype | str | None = None,
    compile: bool | dict = False,
    learn_accumulation: bool = True,
    ignore_args: tuple[str, ...] | list[str] = (),
    eval_graphs: bool = True,
    loss_graphs: bool = True,
) -> tuple[GraphedModule, _torch.optim.Optimizer]:
    """Wrap a model and its optimizer for graphed data-parallel training.

    Every option is keyword-only; they are the fields of
    ``pygraph_dist.loop.config.WrapConfig``, which checks them.

    Args:
{options}

    Returns ``(GraphedModule, optimizer)``; the optimizer is the same object,
    made capturable and routed through the engine.
    """
    options = dict(locals())  # the arguments, before anything else is bound here
    del options["model"], options["optimizer"]
    _config.check_wrap_targets(model, optimizer)
    _compiled.check_compiled_module(model, compile)
    # The engine gets the group on its own: teardown() drops every reference to
    # it so that its C++ objects die with destroy_process_group(), not at
    # interpreter exit, so the settings the engine keeps must not hold it.
    group = options.pop("process_group")
    settings = _config.WrapConfig(**options)
    engine = _Engine(model, optimizer, settings, group)
    _reporting.warn_stock_backend(engine)
    wrapper = GraphedModule(model, engine)
    _clip_route.remember(wrapper)  # clip_grad_norm_(model.parameters()) without the generator's walk
    return wrapper, optimizer


if wrap.__doc__:  # None under python -OO
    wrap.__doc__ = wrap.__doc__.replace("{options}", _config.options_doc())  # WrapConfig's fields


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
    r = Report([_reporting.model_report(e) for e in _lifetime.live_engines()], verbose=verbose)  # creation order
    if print_report:
        print(r)
    return r.as_dict() if as_dict else r


def shutdown() -> None:
    """Release every graph, then destroy the default process group, and undo
    what ``wrap()`` changed in torch (``patches.py``: the process group
    shutdown hook, the ``clip_grad_norm_`` router, process-wide flags)."""
    import gc

    import torch.distributed as dist

    from .runtime import patches

    _lifetime.teardown_all()
    if dist.is_initialized():
        dist.destroy_process_group()
    _lifetime.uninstall()
    patches.undo_all()
    gc.collect()  # destroy what held the group now, not during interpreter exit
