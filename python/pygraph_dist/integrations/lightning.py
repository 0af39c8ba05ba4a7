"""Lightning: ``Trainer(strategy="pgd")`` and ``Fabric(strategy="pgd")``.

    import pygraph_dist.integrations.lightning   # registers "pgd" with Lightning
    trainer = L.Trainer(strategy="pgd", accelerator="gpu", devices=2, precision="bf16-mixed",
                        accumulate_grad_batches=2, gradient_clip_val=1.0)
    trainer.fit(lit_module, loader)

Lightning looks strategies up in a registry filled from its own classes when it
is imported; it has no entry point for third-party strategies (its only entry
points, ``lightning.pytorch.callbacks_factory``, are read after the strategy
is chosen). So the name exists once this module is imported; passing
``strategy=PGDStrategy(graphs=True, ...)`` needs no registration. Keyword
arguments of either strategy are ``pygraph_dist.wrap()``'s options.

:class:`PGDStrategy` is Lightning's DDP strategy with ``pygraph_dist.wrap`` in
place of ``DistributedDataParallel``. What it changes, and why:

* **Order**: DDP wraps the module, then Lightning creates the optimizers;
  ``wrap()`` needs the optimizer, so ``configure_optimizers`` runs first (one
  optimizer; schedulers work unchanged: the learning rate becomes a device
  tensor they update in place).
* **The closure**: Lightning's automatic optimization calls
  ``optimizer.step(closure)``, which pygraph_dist can only train eagerly
  (tier 3). The strategy runs the closure (training_step, zero_grad,
  backward, Lightning's hooks and clipping) and then ``optimizer.step()``.
  Lightning divides the loss by ``accumulate_grad_batches`` (by 1 too), so
  the loop is tier 2: forward and backward graphs per micro-batch, the step
  graph at ``step()``, Lightning's Python between them.
* **Accumulation**: ``block_backward_sync`` is ``GraphedModule.no_sync()``.
* **Precision**: ``bf16-mixed`` and ``16-mixed`` are handed to
  ``wrap(amp=...)``: the same autocast over ``training_step`` that Lightning's
  plugin applies (without the weight cache, which graphs must not hold; the
  casts are the same), and for fp16 the engine's device-side GradScaler (the
  defaults Lightning's plugin uses) instead of the plugin's, whose
  ``unscale_``/``step`` would synchronise the host every step.
* **Clipping**: ``gradient_clip_val`` with the norm algorithm (and no custom
  ``configure_gradient_clipping``) becomes ``wrap(max_grad_norm=...)``: the
  same ``clip_grad_norm_`` after unscaling, inside the step graph.
  ``clip_in_graph=False`` leaves it to Lightning's plugin: its
  ``torch.nn.utils.clip_grad_norm_`` over every parameter still moves into the
  step graph of a tier-1 loop (``clip_route.py``); value clipping runs between
  the graphs.
* **batch_idx**: left out of the graphs' signatures (``ignore_args``, read
  from ``training_step``'s own parameters); a step that reads it trains
  eagerly, with the line in ``pygraph_dist.report()``.
* **self.log**: see ``_lightning_logs.py`` -- the values keep flowing on replays.
* **Manual optimization** (``automatic_optimization = False``): the step method
  runs backward and step itself, so it cannot be the model call. It runs as
  written, and the module's own ``forward`` (``self(x)`` inside it) is routed
  through the wrapper: the model call is the forward, the loss is computed
  outside it, ``manual_backward`` and ``opt.step()`` are the loop's -- tier 2.
  Lightning's precision plugin stays in charge there (its autocast covers the
  whole step, loss included, and its GradScaler serves ``manual_backward``),
  and so does ``self.clip_gradients``.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from typing import Any, Callable

import torch

import pygraph_dist as pgd

from ..loop.arguments import IgnoredArgs

try:
    import lightning.pytorch as pl
    from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
    from lightning.fabric.strategies import STRATEGY_REGISTRY as FABRIC_REGISTRY
    from lightning.fabric.utilities.optimizer import _optimizers_to_device
    from lightning.fabric.utilities.seed import reset_seed
    from lightning.pytorch.core.optimizer import LightningOptimizer
    from lightning.pytorch.plugins.precision import MixedPrecision
    from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
    from lightning.pytorch.strategies.ddp import _DDPForwardRedirection
    from lightning.pytorch.trainer.states import TrainerFn
    from lightning.pytorch.utilities.model_helpers import is_overridden
except ImportError as exc:  # pragma: no cover - exercised by a subprocess test
    raise ImportError(
        "pygraph_dist.integrations.lightning needs Lightning (lightning>=2.4): "
        "pip install pygraph_dist[lightning]") from exc

from ._lightning_fabric import PGDFabricStrategy
from ._lightning_logs import LoggedCalls, call_key
from ._lightning_shared import NAME, check_wrap_options, default_backend, init_process_group

logger = logging.getLogger("pygraph_dist")


def _step_ignored_args(step: Callable) -> tuple[str, ...]:
    """Positional parameters of ``training_step`` after the batch (``batch_idx``)."""
    try:
        params = list(inspect.signature(step).parameters.values())
    except (TypeError, ValueError):
        return ()
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return tuple(p.name for p in positional[1:])


def _algorithm(algorithm) -> str:
    """``"norm"`` or ``"value"`` from a ``GradClipAlgorithmType`` (a str enum whose
    ``str()`` is its qualified name on Python 3.11) or a string."""
    return str(getattr(algorithm, "value", algorithm) or "norm").lower()


def _set_forward(module: torch.nn.Module, own: Callable | None) -> None:
    if own is None:
        module.__dict__.pop("forward", None)
    else:
        module.__dict__["forward"] = own


@contextlib.contextmanager
def _closure_first(optimizer: torch.optim.Optimizer):
    """``optimizer.step(closure)`` becomes ``closure(); optimizer.step()`` --
    what torch's optimizers do, with the step called without the closure, so
    that pygraph_dist sees the loop as written rather than a closure it cannot
    graph. Instance-level, like the LR scheduler's own patch (and marked as
    such, so a scheduler created meanwhile does not wrap it again)."""
    had = "step" in optimizer.__dict__
    previous = optimizer.__dict__.get("step")

    def step(closure=None, **kwargs):
        result = None
        if closure is not None:
            with torch.enable_grad():
                result = closure()
        if previous is not None:
            previous(**kwargs)
        else:
            optimizer._opt_called = True  # noqa: SLF001 - what the scheduler's wrapper records
            type(optimizer).step(optimizer, **kwargs)
        return result

    step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    optimizer.__dict__["step"] = step
    try:
        yield
    finally:
        if had:
            optimizer.__dict__["step"] = previous
        else:
            optimizer.__dict__.pop("step", None)


class _Redirection:
    """Lightning's forward redirection (``strategy.py: _ForwardRedirection``):
    ``training_step(batch, batch_idx)`` runs as the forward of the wrapped
    model. Unlike Lightning's, the patched ``forward`` survives the call (the
    engine may run the body more than once in one call: a capture redone
    eagerly) and is removed after it even when the body never ran (a replay);
    and ``self.log`` inside the body is recorded (``_lightning_logs.py``)."""

    def __init__(self, strategy: "PGDStrategy") -> None:
        self._strategy = strategy

    def __call__(self, wrapper: torch.nn.Module, module: "pl.LightningModule", method_name: str,
                 *args: Any, **kwargs: Any):
        if not isinstance(wrapper, pgd.GraphedModule):  # not wrapped by us: Lightning's own
            return _DDPForwardRedirection()(wrapper, module, method_name, *args, **kwargs)
        method = getattr(module, method_name)
        logged = self._strategy.logged
        own = module.__dict__.get("forward")

        def body(*a: Any, **kw: Any):
            _set_forward(module, own)  # the step may call self(x): the real forward
            try:
                with logged.recording(module):
                    return method(*a, **kw)
            finally:
                module.__dict__["forward"] = body

        module.__dict__["forward"] = body
        logged.begin_call()
        try:
            out = wrapper(*args, **kwargs)
        finally:
            _set_forward(module, own)
        logged.end_call(module, call_key(method_name, args, kwargs, self._strategy.ignored_positions))
        return out


class PGDStrategy(DDPStrategy):
    """Lightning's DDP strategy with ``pygraph_dist.wrap`` instead of DDP.

    Keyword arguments other than DDPStrategy's own are ``pygraph_dist.wrap()``
    options (``graphs=False``, ``bucket_cap_mb``, ``ignore_args`` naming
    ``training_step``'s arguments, ...); ``amp`` and ``max_grad_norm`` come from
    the Trainer's ``precision`` and ``gradient_clip_val``. ``fit`` ends with a
    teardown that releases the graphs; ``strategy.last_report`` is
    ``pygraph_dist``'s report of this model just before it (tiers, replays): a
    :class:`~pygraph_dist.reports.reporting.ModelReport`, which ``print()`` shows as the
    text of ``pygraph_dist.report()``."""

    strategy_name = NAME

    def __init__(self, accelerator=None, parallel_devices=None, cluster_environment=None,
                 checkpoint_io=None, precision_plugin=None, process_group_backend: str | None = None,
                 timeout=default_pg_timeout, start_method: str = "popen", clip_in_graph: bool = True,
                 **wrap_options: Any) -> None:
        check_wrap_options(wrap_options, {"amp": "Trainer(precision=...)",
                                           "max_grad_norm": "Trainer(gradient_clip_val=...)"})
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io,
                         precision_plugin=precision_plugin, process_group_backend=process_group_backend,
                         timeout=timeout, start_method=start_method)
        self._wrap_options = wrap_options
        self._clip_in_graph = clip_in_graph
        self._forward_redirection = _Redirection(self)
        self.logged = LoggedCalls(pl.LightningModule.log)
        self.graphed: pgd.GraphedModule | None = None
        self.engine = None  # kept after teardown, so that report() still lists this model
        self.last_report = None  # engine.describe() just before teardown (end of fit); prints as text
        self.ignored_positions: set[int] = set()
        self._amp_in_engine = False
        self._manual = False  # automatic_optimization = False (_route_forward)
        self._undo: list[Callable[[], None]] = []

    # ------------------------------------------------------------ process group
    def _get_process_group_backend(self) -> str:
        return self._process_group_backend or default_backend(self.root_device)

    def setup_distributed(self) -> None:
        reset_seed()
        self.set_world_ranks()
        self._process_group_backend = self._get_process_group_backend()
        init_process_group(self.cluster_environment, self._process_group_backend, self._timeout)

    # -------------------------------------------------------------------- setup
    def setup(self, trainer: "pl.Trainer") -> None:
        module = self.lightning_module
        if trainer.state.fn != TrainerFn.FITTING:
            return super().setup(trainer)  # nothing to reduce: DDP's setup does not wrap either
        self.accelerator.setup(trainer)
        if self._layer_sync:
            self.model = self._layer_sync.apply(self.model)
        self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self.setup_optimizers(trainer)  # before wrapping, unlike DDP: wrap() takes the optimizer
        _optimizers_to_device(self.optimizers, self.root_device)
        self.model = self._wrap(trainer, module)
        self.setup_precision_plugin()

    def _wrap(self, trainer: "pl.Trainer", module: "pl.LightningModule") -> pgd.GraphedModule:
        if len(self.optimizers) != 1:
            raise ValueError(
                f"strategy='pgd' trains a LightningModule with one optimizer; configure_optimizers "
                f"returned {len(self.optimizers)}. Return one optimizer (with its schedulers), or use "
                "strategy='ddp' for this module.")
        options = dict(self._wrap_options)
        self._manual = not module.automatic_optimization
        if self._manual:  # the model call is the forward: wrap()'s options as they are
            graphed, _ = pgd.wrap(module, self.optimizers[0], **options)
            self._route_forward(module, graphed)
            self.graphed, self.engine = graphed, graphed.engine
            return graphed
        amp = self._take_precision()
        max_grad_norm = self._take_clipping(trainer, module, amp)
        names = options.pop("ignore_args", None)
        names = tuple([names] if isinstance(names, str) else names) if names is not None else \
            _step_ignored_args(module.training_step)
        graphed, _ = pgd.wrap(module, self.optimizers[0], amp=amp, max_grad_norm=max_grad_norm, **options)
        if names:
            # The model call runs training_step, not forward: positions come from its signature.
            graphed.engine.ignored = IgnoredArgs(names, module, forward=module.training_step)
            self.ignored_positions = set(graphed.engine.ignored.positions)
        self.graphed, self.engine = graphed, graphed.engine
        return graphed

    def _route_forward(self, module: "pl.LightningModule", graphed: pgd.GraphedModule) -> None:
        """Manual optimization: ``self(x)`` in the step goes through the wrapper,
        whose engine calls the module again -- then the real forward."""
        own = module.__dict__.get("forward")
        real = own if own is not None else type(module).forward.__get__(module)
        inside = [False]

        def forward(*args: Any, **kwargs: Any):
            if inside[0]:
                return real(*args, **kwargs)
            inside[0] = True
            try:
                return graphed(*args, **kwargs)
            finally:
                inside[0] = False

        module.__dict__["forward"] = forward
        self._undo.append(lambda: _set_forward(module, own))

    def _take_precision(self) -> str | None:
        plugin = self.precision_plugin
        precision = str(getattr(plugin, "precision", "32-true"))
        if precision in ("32-true", "32"):
            return None
        amp = {"bf16-mixed": "bf16", "16-mixed": "fp16"}.get(precision)
        if amp is None or not isinstance(plugin, MixedPrecision):
            raise ValueError(f"strategy='pgd' supports precision '32-true', 'bf16-mixed' and '16-mixed', "
                             f"got {precision!r} ({type(plugin).__name__}).")
        self._amp_in_engine = True
        scaler = getattr(plugin, "scaler", None)
        if scaler is not None:  # the engine's scaler scales and unscales; the plugin's must not too
            plugin.scaler = None
            self._undo.append(lambda: setattr(plugin, "scaler", scaler))
        return amp

    def _take_clipping(self, trainer: "pl.Trainer", module: "pl.LightningModule", amp) -> float | None:
        value = trainer.gradient_clip_val
        if not value:
            return None
        algorithm = _algorithm(trainer.gradient_clip_algorithm)
        custom = is_overridden("configure_gradient_clipping", module, pl.LightningModule)
        if not (self._clip_in_graph and algorithm == "norm" and not custom):
            if amp == "fp16":
                raise ValueError(
                    "with precision='16-mixed', strategy='pgd' clips inside the optimizer step, after "
                    "unscaling: use gradient_clip_algorithm='norm', no custom configure_gradient_clipping, "
                    "and clip_in_graph=True (or precision='bf16-mixed').")
            return None
        plugin = self.precision_plugin
        original = plugin.clip_gradients
        clip = float(value)

        def clip_gradients(optimizer, clip_val=0.0, gradient_clip_algorithm="norm"):
            if _algorithm(gradient_clip_algorithm) == "norm" and float(clip_val or 0.0) == clip:
                return None  # done inside the optimizer step: wrap(max_grad_norm=gradient_clip_val)
            return original(optimizer, clip_val, gradient_clip_algorithm)

        plugin.clip_gradients = clip_gradients
        self._undo.append(lambda: plugin.__dict__.pop("clip_gradients", None))
        return clip

    # ---------------------------------------------------------------- the loop
    def training_step(self, *args: Any, **kwargs: Any):
        if self.graphed is None:
            return super().training_step(*args, **kwargs)
        if self._manual:  # as written; its self(x) reaches the wrapper (_route_forward)
            with self.precision_plugin.train_step_context():
                return self.lightning_module.training_step(*args, **kwargs)
        # With amp handed to wrap(), the engine autocasts the same call (inside the graph).
        context = contextlib.nullcontext() if self._amp_in_engine else self.precision_plugin.train_step_context()
        with context:
            return self._forward_redirection(self.model, self.lightning_module, "training_step", *args, **kwargs)

    def validation_step(self, *args: Any, **kwargs: Any):
        if self.graphed is not None and self._manual:  # its self(x) reaches the wrapper, in eval mode
            with self.precision_plugin.val_step_context():
                return self.lightning_module.validation_step(*args, **kwargs)
        return super().validation_step(*args, **kwargs)

    @contextlib.contextmanager
    def block_backward_sync(self):
        if self.graphed is None:
            with super().block_backward_sync():
                yield None
            return
        with self.graphed.no_sync():
            yield None

    def optimizer_step(self, optimizer, closure: Callable[[], Any], model=None, **kwargs: Any) -> Any:
        raw = optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer  # noqa: SLF001
        if self.graphed is None or isinstance(raw, torch.optim.LBFGS):  # LBFGS re-evaluates the closure
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        with _closure_first(raw):
            return super().optimizer_step(optimizer, closure, model, **kwargs)

    # ----------------------------------------------------------------- teardown
    def teardown(self) -> None:
        if self.graphed is not None:
            # What was graphed, as it stood: torn down, every graph is released and reads as eager.
            self.last_report = self.graphed.engine.describe()
            self.graphed.engine.teardown()  # graphs released before Lightning moves the module to CPU
            self.logged.forget()
            self.model = self.lightning_module
            self.graphed = None
        while self._undo:
            self._undo.pop()()
        self._amp_in_engine = self._manual = False
        super().teardown()

    @classmethod
    def register_strategies(cls, strategy_registry) -> None:
        if NAME not in strategy_registry:
            strategy_registry.register(NAME, cls, description="pygraph_dist: DDP training as CUDA graphs")


# Importing this module registers both names (Fabric's strategy: _lightning_fabric.py).
PGDStrategy.register_strategies(StrategyRegistry)
PGDFabricStrategy.register_strategies(FABRIC_REGISTRY)
