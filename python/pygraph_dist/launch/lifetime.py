"""Lifetime of wrapped models: the live engines, and their teardown before the
process group goes away.

NCCL >= 2.26 makes ``ncclCommDestroy`` wait for every CUDA graph that still
references the communicator, so destroying the process group (or exiting,
which destroys it) while a graph is alive hangs (pytorch#115388). Every
engine therefore releases its graphs first, from two places:

* **the process group's own shutdown** -- ``ProcessGroup.shutdown()``. From
  torch 2.9 on, ``destroy_process_group`` shuts a group down by calling
  ``pg.shutdown()`` on the group object (``distributed_c10d.py``: every group
  of the world, in reverse creation order, or the one subgroup given), and
  ``ProcessGroup.shutdown`` runs each backend's ``shutdown()`` -- for NCCL,
  the communicator's destruction. The hook sits on that method of the class,
  so it runs however the script reached ``destroy_process_group``: the module
  attribute, a name imported with ``from torch.distributed import
  destroy_process_group`` before ``wrap()`` (which a rebound module attribute
  missed: a GPT script hung at its last line), Lightning's or Accelerate's
  teardown, or ``pgd.shutdown()``; with ``pgd.init()``'s backend and with
  torch's stock NCCL alike. Why not in our C++ backend's ``shutdown()``: it
  runs inside the same call, after the hook, and would have to call back into
  Python for graphs that Python owns; the stock backend has no such override.
* **interpreter exit** -- ``atexit``, registered at the first ``wrap()``
  (after ``init_process_group``), so it runs before torch's own exit handlers
  and before the group objects are destroyed (ProcessGroupNCCL's destructor
  shuts its communicator down when the script never did).

Destroying a subgroup releases the graphs of the engines that reduce over it;
destroying the world (or the default group) releases every engine's graphs.
A released engine runs its module as is: there is no group left to reduce over.

Before graphs are released the device is drained, with a bound
(``PYGRAPH_DIST_EXIT_DRAIN_S``, 5 s): work still queued can only fail to
finish when it waits for a collective that a peer never launched -- the peer
was interrupted (Ctrl-C reaches the ranks a step apart) or died. Waiting for
it would hang the exit for ever, so the communicators of the live engines are
aborted instead (``ProcessGroup.abort()``, ``ncclCommAbort``: NCCL's kernels
poll its flag) and the exit goes on, with an error on stderr. The abort itself
is bounded (2 s, on a native thread): with torch's stock NCCL it blocked for
good now and then while a graph's all-reduce waited for the exited peer. When
the abort does not return, or the device still does not drain after it, the
process ends there with status 1 and says why (``os._exit``: torch's exit
handlers would wait on the same device). And releasing live graphs at exit,
once the device has drained, has a deadline (``PYGRAPH_DIST_EXIT_DEADLINE_S``,
5 s), kept by a native thread: past it, the process prints its Python stacks
and ends with status 1 -- a graph's destruction blocked for good after the
drain had succeeded, with the peer gone (2xH200, torch's stock NCCL: 1 run
in 5 of a sigint repeat loop). The deadline is cancelled when the release
returns, so the script's own exit handlers after it are not cut short.

:func:`uninstall` puts ``ProcessGroup.shutdown`` back (``pgd.shutdown()``); the
hook and its undo are ``patches.py``'s (entry ``ProcessGroup.shutdown``).
"""

from __future__ import annotations

import atexit
import itertools
import logging
import os
import sys
import threading
import weakref
from typing import Any, Protocol

import torch.distributed as dist

from ..runtime import patches
from ..runtime._ext import C

logger = logging.getLogger("pygraph_dist")


class Closable(Protocol):
    serial: int
    group: Any

    def teardown(self) -> None: ...


_LIVE: "weakref.WeakSet[Closable]" = weakref.WeakSet()
_SERIAL = itertools.count(1)
_lock = threading.RLock()
_installed = False


def register(engine: Closable) -> int:
    """Track ``engine`` until it is garbage; returns its creation serial (report order)."""
    install()
    with _lock:
        serial = next(_SERIAL)
        _LIVE.add(engine)
    return serial


def live_engines() -> list:
    """The live engines of this process, in creation order."""
    return sorted(_LIVE, key=lambda e: e.serial)


def _at_exit() -> None:
    """Interpreter exit: release every live graph. The drain and the abort
    before it are bounded on their own; the release after them has the exit
    deadline. Exit handlers the script registered before ``wrap()`` run after
    this, and take the time they need."""
    _release(live_engines(), deadline_s=exit_deadline_s())


def exit_deadline_s() -> float:
    """How long releasing live graphs at exit may take, once the device has
    drained, before the process is ended (``PYGRAPH_DIST_EXIT_DEADLINE_S``,
    5 s; 0 turns it off)."""
    try:
        return max(0.0, float(os.environ.get("PYGRAPH_DIST_EXIT_DEADLINE_S", "5")))
    except ValueError:
        return 5.0


def teardown_all() -> None:
    """Release every live graph and synchronise, so that destroying the process
    group cannot hang. Runs at exit and when the default group shuts down."""
    _release(live_engines())


def _release(engines: list, *, deadline_s: float = 0.0) -> None:
    """Drain the device (aborting the engines' groups if it does not drain),
    then tear the engines down -- within ``deadline_s`` when > 0 (at exit)."""
    engines = [e for e in engines if not getattr(e, "closed", False)]
    if not engines:
        return
    if not _drain(drain_seconds()):
        _abort_groups(engines)
    deadline = None
    if deadline_s > 0:
        deadline = C.ExitDeadline(deadline_s, (
            f"pygraph_dist: rank {_rank()}: releasing the graphs at exit has not finished after "
            f"{deadline_s:.0f} s (the device had drained: it waits on a peer that is gone, or on the "
            f"driver); ending the process now with exit status {STUCK_EXIT_CODE}. "
            "PYGRAPH_DIST_EXIT_DEADLINE_S sets the limit (0: none).\n"), STUCK_EXIT_CODE)
    try:
        for engine in engines:
            engine.teardown()
    finally:
        if deadline is not None:
            deadline.cancel()


def drain_seconds() -> float:
    """How long a teardown waits for the device's queued work (``PYGRAPH_DIST_EXIT_DRAIN_S``)."""
    try:
        return max(0.0, float(os.environ.get("PYGRAPH_DIST_EXIT_DRAIN_S", "5")))
    except ValueError:
        return 5.0


def _drain(timeout_s: float) -> bool:
    """Wait at most ``timeout_s`` for the current device's queued work; True
    when it finished (or there is no CUDA work to wait for)."""
    import torch

    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return True
    done = threading.Event()

    def synchronize() -> None:
        try:
            torch.cuda.synchronize()  # releases the GIL while it waits
        except Exception:  # noqa: BLE001 - a broken context cannot be drained; teardown says so
            logger.debug("synchronize during teardown failed", exc_info=True)
        finally:
            done.set()

    threading.Thread(target=synchronize, name="pygraph_dist-drain", daemon=True).start()
    return done.wait(timeout_s)


def _abort_groups(engines: list) -> None:
    """Abort the communicators the engines' graphs wait on, so that their
    kernels return and the process can end."""
    groups = []
    for engine in engines:
        group = getattr(engine, "group", None)
        if group is not None and not any(_same_group(group, g) for g in groups):
            groups.append(group)
    _error(
        "rank %s: work queued on the GPU did not finish within %.0f s of teardown: it waits for "
        "a collective that another rank never launched (that rank was interrupted or died). "
        "Aborting %d communicator(s) so that this process can end; the last step's update may "
        "be incomplete on this rank. PYGRAPH_DIST_EXIT_DRAIN_S sets the wait.",
        _rank(), drain_seconds(), len(groups))
    for group in groups:
        returned, error = _abort_within(group, ABORT_WAIT_S)
        if error:
            logger.warning("aborting the process group failed: %s", error)
        if not returned:  # ncclCommAbort blocked (a graph waits on the communicator)
            _end_now(f"aborting the communicator did not return within {ABORT_WAIT_S:.0f} s either")
    if not _drain(drain_seconds()):  # teardown would wait on the device for ever
        _end_now(f"the GPU's queued work still did not finish {drain_seconds():.0f} s after the abort")


# How long an abort may take. It sets a flag and frees the communicator; one
# still running after this blocks for good (seen with torch's stock NCCL), and
# the process is past saving either way: a peer is gone.
ABORT_WAIT_S = 2.0


# The exit status of a process whose teardown cannot free the GPU: 1, as an
# uncaught error (and as torch DDP's ranks end on Ctrl-C on the GPU machine).
STUCK_EXIT_CODE = 1


def _end_now(why: str) -> None:
    """Nothing else can end this process: the device waits for a peer that is
    gone and aborting did not free it. Say so and exit now (``os._exit``:
    torch's own exit handlers would wait on the same device)."""
    _error("rank %s: %s; ending the process now with exit status %d.", _rank(), why, STUCK_EXIT_CODE)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(STUCK_EXIT_CODE)


def _abort_within(group, wait_s: float) -> tuple[bool, str]:
    """``group.abort()``, bounded: on a native thread without the GIL (the
    extension's ``abort_group_within``), as the replay watchdog aborts. With
    torch's stock NCCL the abort blocked for good on 2xH200 (torch 2.11, NCCL
    2.28.9, about 1 run in 5 of test_exit_paths' sigint-stock), while a replayed
    graph's all-reduce waited for a peer that had exited."""
    return C.abort_group_within(group, float(wait_s))


def _error(msg: str, *args) -> None:
    """An error at teardown, which the user must see: to the ``pygraph_dist``
    logger, and to stderr as well where logging is not configured (the package's
    NullHandler would otherwise swallow it, as it does the last resort)."""
    logger.error(msg, *args)
    if not _configured(logger):
        print(f"pygraph_dist: {msg % args}", file=sys.stderr, flush=True)


def _configured(log: logging.Logger) -> bool:
    """Whether a record of ``log`` reaches a handler other than a NullHandler."""
    node: logging.Logger | None = log
    while node is not None:
        if any(not isinstance(h, logging.NullHandler) for h in node.handlers):
            return True
        node = node.parent if node.propagate else None
    return False


def _rank() -> str:
    try:
        return str(dist.get_rank()) if dist.is_initialized() else "?"
    except (RuntimeError, ValueError):
        return "?"


def _same_group(a, b) -> bool:
    if a is None or b is None:
        return False
    if a is b:
        return True
    try:  # another Python handle of the same C++ group
        return a.group_name == b.group_name
    except (AttributeError, RuntimeError):
        return False


def release_for(group) -> None:
    """Release the graphs that ``group``'s shutdown would hang on: every
    engine's when it is the default group, else those reducing over it."""
    if group is None:
        return
    try:
        world = dist.group.WORLD if dist.is_initialized() else None
    except (AssertionError, RuntimeError, ValueError):
        world = None
    if _same_group(group, world):
        teardown_all()
        return
    _release([e for e in live_engines() if _same_group(getattr(e, "group", None), group)])


def install() -> None:
    """Register the exit handler (once) and hook the process group's shutdown
    (``patches.hook_process_group_shutdown``: again after ``patches.undo_all()``)."""
    global _installed
    with _lock:
        if not _installed:
            atexit.register(_at_exit)
            _installed = True
        patches.hook_process_group_shutdown(lambda group: release_for(group), logger)
        # Ctrl-C reaches the replay watchdogs too (ReplayWatchdog's interrupt_group)
        patches.watch_interrupt_signals(C.watch_interrupts)


def uninstall() -> None:
    """Undo :func:`install` (after the engines are torn down)."""
    global _installed
    with _lock:
        if _installed:
            atexit.unregister(_at_exit)
            _installed = False
        patches.undo("ProcessGroup.shutdown")
        patches.undo("signal.wakeup_fd")


def installed() -> bool:
    """Whether the shutdown hook is in place (for tests and ``report()``)."""
    return _installed and patches.process_group_shutdown_hooked()
