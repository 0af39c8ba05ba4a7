"""Lifetime of wrapped models: the live engines, and their teardown before the
process group goes away.

NCCL >= 2.26 makes ``ncclCommDestroy`` wait for every CUDA graph that still
references the communicator, so destroying the process group (or exiting,
which destroys it) while a graph is alive hangs (pytorch#115388). Every
engine therefore releases its graphs first: at ``destroy_process_group()``
(which is patched once, at the first ``wrap()``) and at exit.
"""

from __future__ import annotations

import atexit
import itertools
import threading
import weakref
from typing import Protocol

import torch.distributed as dist


class Closable(Protocol):
    serial: int

    def teardown(self) -> None: ...


_LIVE: "weakref.WeakSet[Closable]" = weakref.WeakSet()
_SERIAL = itertools.count(1)
_lock = threading.Lock()
_hooks_installed = False


def register(engine: Closable) -> int:
    """Track ``engine`` until it is garbage; returns its creation serial (report order)."""
    _install_hooks()
    with _lock:
        serial = next(_SERIAL)
        _LIVE.add(engine)
    return serial


def live_engines() -> list:
    """The live engines of this process, in creation order."""
    return sorted(_LIVE, key=lambda e: e.serial)


def teardown_all() -> None:
    """Release every live graph and synchronise, so that destroying the process
    group cannot hang. Runs at exit and before ``destroy_process_group``."""
    for engine in live_engines():
        engine.teardown()


def _install_hooks() -> None:
    global _hooks_installed
    with _lock:
        if _hooks_installed:
            return
        # Installed at the first wrap(), i.e. after init_process_group, so the
        # atexit handler runs before any registered earlier (atexit is LIFO).
        atexit.register(teardown_all)
        original = dist.destroy_process_group
        if not getattr(original, "_pgd_patched", False):
            def destroy_process_group(*args, **kwargs):
                teardown_all()
                return original(*args, **kwargs)

            destroy_process_group._pgd_patched = True  # type: ignore[attr-defined]
            destroy_process_group.__doc__ = original.__doc__
            dist.destroy_process_group = destroy_process_group
            dist.distributed_c10d.destroy_process_group = destroy_process_group
        _hooks_installed = True
