"""Fabric's strategy ``"pgd"``: ``fabric.setup(model, optimizer)`` wraps both with
``pygraph_dist.wrap``. Imported (and registered) by
``pygraph_dist.integrations.lightning``; what the two strategies share is in
``_lightning_shared.py``."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies import DDPStrategy as FabricDDPStrategy
from lightning.fabric.strategies.strategy import _BackwardSyncControl

import pygraph_dist as pgd

from ._lightning_shared import NAME, check_wrap_options, default_backend, init_process_group


class _GraphedBackwardSyncControl(_BackwardSyncControl):
    def no_backward_sync(self, module: torch.nn.Module, enabled: bool):
        if not enabled:
            return contextlib.nullcontext()
        if not isinstance(module, pgd.GraphedModule):
            raise TypeError(f"fabric.no_backward_sync needs a model set up by Fabric(strategy='pgd') "
                            f"together with its optimizer; got {type(module).__name__}.")
        return module.no_sync()


class PGDFabricStrategy(FabricDDPStrategy):
    """Fabric's DDP strategy with ``pygraph_dist.wrap`` instead of DDP:
    ``fabric.setup(model, optimizer)`` wraps both (one optimizer per model).
    Fabric's precision plugin stays in charge (its autocast around the model
    call, its GradScaler in ``fabric.backward``); keyword arguments are
    ``wrap()`` options."""

    def __init__(self, accelerator=None, parallel_devices=None, cluster_environment=None,
                 checkpoint_io=None, precision=None, process_group_backend: str | None = None,
                 timeout=default_pg_timeout, start_method: str = "popen", **wrap_options: Any) -> None:
        check_wrap_options(wrap_options, {})
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io,
                         precision=precision, process_group_backend=process_group_backend,
                         timeout=timeout, start_method=start_method)
        self._backward_sync_control = _GraphedBackwardSyncControl()
        self._wrap_options = wrap_options
        self.engines: list = []

    def _get_process_group_backend(self) -> str:
        return self._process_group_backend or default_backend(self.root_device)

    def _setup_distributed(self) -> None:
        self._set_world_ranks()
        self._process_group_backend = self._get_process_group_backend()
        init_process_group(self.cluster_environment, self._process_group_backend, self._timeout)

    def setup_module_and_optimizers(self, module, optimizers, scheduler=None):
        if len(optimizers) != 1:
            raise ValueError(f"Fabric(strategy='pgd'): set up each model with its one optimizer, "
                             f"fabric.setup(model, optimizer); got {len(optimizers)} optimizers.")
        graphed, optimizer = pgd.wrap(module, optimizers[0], **self._wrap_options)
        self.engines.append(graphed.engine)
        return graphed, [optimizer], scheduler

    def teardown(self) -> None:
        for engine in self.engines:
            engine.teardown()
        super().teardown()

    @classmethod
    def register_strategies(cls, strategy_registry) -> None:
        if NAME not in strategy_registry:
            strategy_registry.register(NAME, cls, description="pygraph_dist: DDP training as CUDA graphs")
