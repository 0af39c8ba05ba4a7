"""What Lightning's two strategies ``"pgd"`` share: the name, the check of their
``wrap()`` options, the process group backend and its creation. The Trainer's
strategy (``lightning.py``) and Fabric's (``_lightning_fabric.py``) both build
on this module; it imports only Lightning Fabric."""

from __future__ import annotations

import torch
import torch.distributed as dist
from lightning.fabric.utilities.distributed import _init_dist_connection

from ..launch import backend as _backend
from ..launch import launch_env
from ..loop.config import OPTIONS

NAME = "pgd"
_WRAP_OPTIONS = frozenset(OPTIONS) - {"process_group"}  # the strategy's own group


def check_wrap_options(options: dict, reserved: dict[str, str]) -> None:
    unknown = sorted(set(options) - _WRAP_OPTIONS)
    if unknown:
        raise TypeError(f"unknown option(s) {', '.join(unknown)} for strategy 'pgd': its keyword arguments "
                        f"are pygraph_dist.wrap()'s options ({', '.join(sorted(_WRAP_OPTIONS))}).")
    for name, instead in reserved.items():
        if name in options:
            raise ValueError(f"with Trainer(strategy='pgd'), {name}= comes from {instead}; drop {name}=.")


def default_backend(device: torch.device) -> str:
    """On CUDA what ``pygraph_dist.init()`` picks: the graph-safe NCCL
    (fingerprints of captured collectives) and Gloo for CPU tensors. On a CPU
    plain Gloo, not ``pgd_gloo``: no graph is ever captured there, and
    Lightning's ``sync_dist`` mean (``fabric/utilities/distributed.py:
    _sync_ddp``) replaces ``ReduceOp.AVG`` by a sum only for a group whose
    backend is named "gloo"."""
    return _backend.resolve("auto", cuda=True) if device.type == "cuda" else "gloo"


def init_process_group(environment, backend: str, timeout) -> None:
    """Lightning's ``_init_dist_connection`` as ``pygraph_dist.init()`` does it.
    No ``device_id`` (which binds the group to a device and eagerly connects a
    backend that supports splitting; ``init()`` does not either)."""
    existed = dist.is_initialized()
    launch_env._import_dynamo_first()  # noqa: SLF001 - same reason as init(): see its docstring
    _init_dist_connection(environment, backend, timeout=timeout)
    if not existed and backend.startswith("cpu:gloo,cuda:pgd"):
        try:  # as launch_env.init(): torch misses our plugin name when it picks the default type
            dist.group.WORLD._set_default_backend(dist.ProcessGroup.BackendType.CUSTOM)  # noqa: SLF001
        except (AttributeError, RuntimeError):
            pass
