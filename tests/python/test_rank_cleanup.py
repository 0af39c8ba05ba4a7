"""The ranks a test starts die with it (rank_main.die_with_the_test).

A test process killed from outside (``timeout`` around pytest, SIGKILL) runs
none of its cleanup; its ranks used to run on, holding GPUs and ports while the
next command measured.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def sleeper(pidfile: str) -> dict:
    """A rank that writes its pid and waits to be killed."""
    Path(pidfile).write_text(str(os.getpid()))
    time.sleep(120)
    return {}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (not reaped yet) counts as gone.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_ranks_die_when_the_test_process_is_killed(tmp_path):
    pidfile = tmp_path / "rank.pid"
    driver = (
        "import sys; from pathlib import Path; sys.path.insert(0, sys.argv[1]); "
        "from conftest import run_ranks; "
        "run_ranks('test_rank_cleanup:sleeper', Path(sys.argv[2]), world_size=1, timeout=300, "
        "kwargs={'pidfile': sys.argv[3]})"
    )
    test = subprocess.Popen([sys.executable, "-c", driver, str(HERE), str(tmp_path), str(pidfile)],
                            cwd=str(HERE.parent.parent))
    try:
        deadline = time.monotonic() + 60
        while not pidfile.exists() or not pidfile.read_text():
            assert test.poll() is None, "the driver exited before its rank started"
            assert time.monotonic() < deadline, "the rank never started"
            time.sleep(0.1)
        rank = int(pidfile.read_text())
        assert _alive(rank)
        test.send_signal(signal.SIGKILL)  # no cleanup runs in the test process
        test.wait(timeout=30)
        deadline = time.monotonic() + 15
        while _alive(rank) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(rank), f"rank {rank} outlived the test process that started it"
    finally:
        if test.poll() is None:
            test.kill()
        if pidfile.exists() and pidfile.read_text():
            try:
                os.kill(int(pidfile.read_text()), signal.SIGKILL)
            except ProcessLookupError:
                pass
