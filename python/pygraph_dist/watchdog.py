"""ReplayWatchdog: a timeout for collectives that live inside graphs.

ProcessGroupNCCL does not hand captured collectives to its watchdog ("Note
[cuda graph capture and workEnqueue]"), so a replayed all-reduce has no
timeout, no Flight Recorder entry and no async error handling: if another
rank dies or stops replaying, this rank waits forever at its next host sync.

The engine records a CUDA event after every ``every``-th replay; a daemon
thread polls the oldest pending event and, when one has not completed within
``timeout_s``, logs what it was waiting for, dumps every thread's stack and
ends the process with exit code 70. torchrun, mpirun and srun then stop the
other ranks: a clear error instead of a silent hang. Polling happens from its
own thread while the main thread may be capturing, which is why captures use
``capture_error_mode="thread_local"``.
"""

from __future__ import annotations

import collections
import faulthandler
import logging
import os
import sys
import threading
import time

import torch

logger = logging.getLogger("pygraph_dist")

EXIT_CODE = 70


class ReplayWatchdog:
    def __init__(self, timeout_s: float, every: int = 8, poll_s: float | None = None) -> None:
        self.timeout_s = float(timeout_s)
        self.every = max(1, int(every))
        self.poll_s = poll_s if poll_s is not None else min(1.0, max(0.05, self.timeout_s / 20))
        self._pending: collections.deque = collections.deque()
        self._lock = threading.Lock()
        self._count = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def enabled(self) -> bool:
        return self.timeout_s > 0

    def after_replay(self, label: str) -> None:
        if not self.enabled:
            return
        self._count += 1
        if self._count % self.every:
            return
        event = torch.cuda.Event()
        event.record()
        with self._lock:
            self._pending.append((event, time.monotonic(), label))
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="pygraph_dist-watchdog", daemon=True)
            self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        with self._lock:
            self._pending.clear()

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
        logger.critical(
            "pygraph_dist: graph replay %s has not completed after %.0f s (replay timeout %.0f s). "
            "Collectives inside CUDA graphs are not covered by NCCL's own timeout; a rank has "
            "probably stopped, crashed or left the training loop. Ending this process (exit code "
            "%d) so that the launcher stops the job instead of hanging.",
            label, waited, self.timeout_s, EXIT_CODE,
        )
        try:
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        finally:
            for h in logging.getLogger().handlers + logger.handlers:
                try:
                    h.flush()
                except Exception:  # noqa: BLE001 - best effort before exiting
                    pass
            os._exit(EXIT_CODE)
