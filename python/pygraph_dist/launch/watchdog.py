"""ReplayWatchdog: a timeout for collectives that live inside graphs.

ProcessGroupNCCL does not hand captured collectives to its watchdog ("Note
[cuda graph capture and workEnqueue]"), so a replayed all-reduce has no
timeout, no Flight Recorder entry and no async error handling: if another
rank dies or stops replaying, this rank waits forever.

The watchdog is native (``pygraph_dist._C.ReplayWatchdog``,
csrc/replay_watchdog.h): a CUDA event recorded after replays, polled by a C++
thread, judged by another from host timestamps, with store heartbeats saying
which ranks were last seen alive. None of it needs the GIL, because a hung
rank's main thread may hold it for good: torch's ``Event.record()`` and
``Event.query()`` call the CUDA runtime without releasing the GIL, and once
the GPU stops, the launch queue fills and such a call blocks (this is how the
previous, Python-thread watchdog never fired on 2xH200). On a timeout it
prints what it waited for, the ranks' heartbeats and every Python thread's
stack to stderr, and ends the process with exit code 70 (``EXIT_CODE``);
torchrun, mpirun and srun then stop the other ranks.

Ctrl-C reaches the ranks a step apart: a rank still inside a replay then waits
for collectives that its interrupted peer will never launch, in a CUDA call
where Python cannot raise KeyboardInterrupt (2xH200: 4 of 8 sigint runs of
test_exit_paths waited 24 s for the departure rule). Python's signal handler
also reports the signal to the extension (``signal.set_wakeup_fd``, a patch of
``runtime/patches.py``), and an engine's watchdog, given its group
(``interrupt_group``), aborts that group once such a replay has made no
progress for 2 s after the interrupt (or 3 times the longest step seen, if
longer): the kernels return, Python raises the KeyboardInterrupt, the process
ends as the script means it to. The message says that this rank's last step is
incomplete; a replay after the abort raises. ``ncclCommAbort`` returns only
once every graph that captured the communicator is destroyed (on 2xH200,
NCCL 2.28.9, it never returned while they lived), so the abort counts as done
when the waiting replay completes; the exit's release of the graphs lets it
finish. Where neither happens within 2 s, the process ends with status 1, as
the exit teardown's own last resort ends it: about 6 s after the Ctrl-C.

The engine calls ``replay(graphs, label)`` to launch (without the GIL, timed
as a launch: a launch that blocks on a full queue fires too) and
``after_replay(label, collectives=...)`` after an iteration's launches.

The Python-thread watchdog remains for ``native=False`` (diagnostics, and an
extension built without its CUDA code paths, where graphs are unavailable
anyway).
"""

from __future__ import annotations

import atexit
import collections
import faulthandler
import logging
import os
import sys
import threading
import time
import weakref
from typing import Iterable

import torch

from ..runtime._ext import C
from ..runtime.spans import timed

logger = logging.getLogger("pygraph_dist")

EXIT_CODE: int = C.WATCHDOG_EXIT_CODE  # 70, EX_SOFTWARE

_DEFAULT = object()
_OPEN: "weakref.WeakSet[ReplayWatchdog]" = weakref.WeakSet()


def raise_interrupt_aborted() -> None:
    raise RuntimeError(
        "pygraph_dist: this process was interrupted while a graph replay waited for collectives "
        "that other ranks never launched, and the replay watchdog aborted the communicator: this "
        "model cannot replay again, and this rank's last step is incomplete. End the process "
        "(catching KeyboardInterrupt to train on is not possible after such an abort).")


@atexit.register
def _close_all() -> None:
    # Stop the native threads before the interpreter and the CUDA runtime go
    # away: a poller still querying events during static destruction could crash.
    for wd in list(_OPEN):
        wd.close()


def _default_heartbeat_store():
    """(store, rank, world_size) of the default process group, or (None, 0, 1)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None, 0, 1
    try:
        store = dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - heartbeats are optional
        store = None
    return store, dist.get_rank(), dist.get_world_size()


class ReplayWatchdog:
    """Ends the process when a graph replay does not complete within ``timeout_s``.

    ``timeout_s <= 0`` disables it (``replay()`` then only launches). The native
    threads start at the first replay. ``store``: where heartbeats go (default:
    the default process group's store, when one is initialised; ``None``: no
    heartbeats). ``abort_backend``/``abort_wait_s``: abort that c10d backend
    (the communicator) before exiting, waiting at most that long.
    """

    def __init__(
        self,
        timeout_s: float,
        every: int | None = None,
        poll_s: float | None = None,
        *,
        native: bool | None = None,
        store=_DEFAULT,
        rank: int | None = None,
        world_size: int | None = None,
        context: str | None = None,
        heartbeat_s: float | None = None,
        abort_backend=None,
        abort_wait_s: float = 0.0,
        interrupt_group=None,
    ) -> None:
        self.timeout_s = float(timeout_s)
        self.native = bool(C.cuda_enabled) if native is None else bool(native)
        self.every = max(1, int(every if every is not None else (1 if self.native else 8)))
        self.poll_s = poll_s if poll_s is not None else min(1.0, max(0.05, self.timeout_s / 20))
        self._store = store
        self._rank = rank
        self._world_size = world_size
        self._context = context
        self._heartbeat_s = heartbeat_s
        self._abort_backend = abort_backend
        self._abort_wait_s = float(abort_wait_s)
        self._interrupt_group = interrupt_group
        self._count = 0
        self._closed = False
        self._native: C.ReplayWatchdog | None = None
        # Python-thread watchdog (native=False)
        self._pending: collections.deque = collections.deque()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def enabled(self) -> bool:
        return self.timeout_s > 0

    # ------------------------------------------------------------ the engine's calls
    @timed("launch")
    def replay(self, graphs: Iterable[torch.cuda.CUDAGraph], label: str = "", *,
               collectives: str | None = None, arm: bool = False) -> None:
        """Launch ``graphs`` in order on the current stream, without the GIL.

        With the native watchdog the launches are timed: one that blocks for
        ``timeout_s`` (the launch queue full, the GPU not draining it) fires.
        ``arm``: the launches end an iteration, so :meth:`after_replay`'s work
        follows them -- with the native watchdog inside the same call (one GIL
        release per replay instead of two)."""
        graphs = list(graphs)
        replay_graphs = getattr(C, "replay_graphs", None)
        # A graph captured with check_input_liveness has a Python-side check
        # in its replay(); keep it.
        if replay_graphs is None or any(getattr(g, "_tracker", None) is not None for g in graphs):
            for g in graphs:
                g.replay()
            if arm:
                self.after_replay(label, collectives)
            return
        if arm:  # counted as fused() counts; None: the Python-thread watchdog arms below
            wd, arm_now = self.fused() or (None, False)
        else:
            wd, arm_now = self._ensure_native() if self.enabled and self.native else None, False
            if wd is not None and wd.interrupt_aborted:
                raise_interrupt_aborted()
        replay_graphs(graphs, wd, label, collectives or "", arm_now)
        if arm and wd is None:  # the Python-thread watchdog (native=False), or none
            self.after_replay(label, collectives)

    def fused(self) -> tuple | None:
        """The arming schedule of a launch that ends an iteration (:meth:`replay`
        with ``arm=True``, or ``C.replay_owned`` called by the engine): the
        native watchdog or None, and whether to arm it after the launch (every
        ``every``-th). None with the Python-thread watchdog, which
        :meth:`after_replay` arms."""
        if not self.enabled:
            return None, False
        if not self.native:
            return None
        wd = self._ensure_native()
        if wd.interrupt_aborted:
            raise_interrupt_aborted()
        if self._closed:
            return wd, False
        self._count += 1
        return wd, self._count % self.every == 0

    @timed("watchdog")
    def after_replay(self, label: str, collectives: str | None = None) -> None:
        """Watch the work launched so far on the current stream (every ``every``-th call)."""
        if not self.enabled or self._closed:
            return
        self._count += 1
        if self._count % self.every:
            return
        if self.native:
            wd = self._ensure_native()
            if C.cuda_enabled:
                wd.arm(label, collectives or "")
            else:  # no CUDA paths: only the tests' host replays exist
                raise RuntimeError("ReplayWatchdog.after_replay: pygraph_dist._C has no CUDA code paths")
            return
        self._python_arm(label)

    @property
    def pending(self) -> int:
        """Replays armed and not yet seen complete (benchmarks/soak.py samples
        memory once this is 0: the native poller drains it once per poll)."""
        if self._native is not None:
            return int(self._native.pending)
        with self._lock:
            return len(self._pending)

    def clear(self) -> None:
        """Forget pending replays (after a synchronize, when graphs are released)."""
        if self._native is not None:
            self._native.clear()
        with self._lock:
            self._pending.clear()

    def close(self) -> None:
        """Stop watching (idempotent). A closed native watchdog tells the other ranks
        through its last heartbeat that this rank left on purpose."""
        self._closed = True
        _OPEN.discard(self)
        if self._native is not None:
            self._native.close()
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        with self._lock:
            self._pending.clear()

    # ------------------------------------------------------------ native
    def _ensure_native(self) -> "C.ReplayWatchdog":
        if self._native is None:
            if self._closed:
                raise RuntimeError("ReplayWatchdog used after close()")
            store, rank, world = (None, 0, 1)
            if self._store is _DEFAULT:
                store, rank, world = _default_heartbeat_store()
                if os.environ.get("PGD_WATCHDOG_HEARTBEATS", "1") == "0":
                    # Opt-out. (They were off by default until the SIGSEGV seen on
                    # the GPU machine was traced to iostream number parsing in
                    # decode_heartbeat, replaced by integer parsing.)
                    store = None
            else:
                store = self._store
            rank = self._rank if self._rank is not None else rank
            world = self._world_size if self._world_size is not None else world
            context = self._context or f"rank {rank} of {world}"
            self._native = C.ReplayWatchdog(
                self.timeout_s, exit_code=EXIT_CODE, poll_s=self.poll_s, context=context,
                store=store, rank=rank, world_size=world, heartbeat_s=self._heartbeat_s or 0.0,
                abort_backend=self._abort_backend, abort_wait_s=self._abort_wait_s,
                interrupt_group=self._interrupt_group,
            )
            _OPEN.add(self)
        return self._native

    # ------------------------------------------------------------ Python thread (native=False)
    def _python_arm(self, label: str) -> None:
        # Hazard (why the native watchdog exists): record() and, in the thread,
        # query() hold the GIL inside the CUDA runtime; a blocked one stops this
        # watchdog too.
        event = torch.cuda.Event()
        event.record()
        with self._lock:
            self._pending.append((event, time.monotonic(), label))
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="pygraph_dist-watchdog", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            with self._lock:
                while self._pending and self._pending[0][0].query():
                    self._pending.popleft()
                if not self._pending:
                    continue
                _, since, label = self._pending[0]
            waited = time.monotonic() - since
            if waited > self.timeout_s:
                self._fire(label, waited)

    def _fire(self, label: str, waited: float) -> None:
        msg = (
            f"pygraph_dist: graph replay {label} has not completed after {waited:.0f} s (replay "
            f"timeout {self.timeout_s:.0f} s; Python-thread watchdog). Collectives inside CUDA graphs "
            "are not covered by NCCL's own timeout; a rank has probably stopped, crashed or left the "
            f"training loop. Ending this process (exit code {EXIT_CODE}) so that the launcher stops "
            "the job instead of hanging."
        )
        logger.critical(msg)
        try:
            print(msg, file=sys.stderr, flush=True)
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        finally:
            for h in logging.getLogger().handlers + logger.handlers:
                try:
                    h.flush()
                except Exception:  # noqa: BLE001 - best effort before exiting
                    pass
            os._exit(EXIT_CODE)
