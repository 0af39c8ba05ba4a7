"""The native replay watchdog without a GPU: its threads, report, stack dump and exit.

Host replays (``arm_host``) stand in for CUDA events, so everything but the
event query runs here: the judge firing while the main thread blocks with the
GIL held, the report, the Python stacks, exit code 70, and the store
heartbeats that say which ranks were last seen alive. The GPU side is in
test_faults_watchdog.py.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import ROOT, child_env, free_port, popen_script
from rank_server import PRELOAD_PGD

WORKER = Path(__file__).with_name("faults_workers.py")


def _start(case: str, out: Path, *args: str, **env: str) -> subprocess.Popen:
    """The worker, with SIGINT as a terminal's Ctrl-C finds it (default_signals:
    a pytest run in the background ignores SIGINT, and so would the worker).
    It imports torch and pygraph_dist before its process group."""
    e = child_env(**env)  # the pygraph_dist this pytest imports: installed, or on PYTHONPATH
    return popen_script([sys.executable, str(WORKER), case, "--out", str(out), *args], env=e,
                        preload=PRELOAD_PGD, default_signals=True,
                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=str(ROOT))


def _finish(p: subprocess.Popen, timeout: float) -> tuple[int, str]:
    try:
        out, _ = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        out, _ = p.communicate()
        pytest.fail(f"did not exit within {timeout} s:\n{out[-4000:]}")
    return p.returncode, out


def test_exit_code_is_documented():
    from pygraph_dist.runtime._ext import C
    from pygraph_dist.launch.watchdog import EXIT_CODE

    assert EXIT_CODE == C.WATCHDOG_EXIT_CODE == 70


def test_python_stack_dumper_is_available():
    # CPython 3.11 and 3.12 export it; without it the report says so instead.
    from pygraph_dist.runtime._ext import C

    if sys.version_info[:2] in ((3, 11), (3, 12)):
        assert C.ReplayWatchdog.python_stacks_available()


def test_fires_while_the_main_thread_holds_the_gil(tmp_path):
    timeout = 2.0
    t0 = time.monotonic()
    code, out = _finish(_start("native_gil_held", tmp_path, "--replay-timeout", str(timeout)), 60)
    took = time.monotonic() - t0
    assert code == 70, out
    assert "rank 0 of 1 (gil test): graph replay #1 [(64, 256) float32] at iteration 212 has not completed" in out
    assert "collectives in the graph: all_reduce float32 x 68362" in out
    assert "exit code 70" in out
    assert "Python stacks of this process" in out
    # The main thread's stack shows where it was blocked.
    assert "in native_gil_held" in out, out
    assert "NOT REACHED" not in out
    assert took < 30, f"{took:.1f} s"  # interpreter start + timeout + a poll


def test_completed_replays_never_fire_and_close_is_prompt(tmp_path):
    code, out = _finish(_start("native_completes", tmp_path, "--replay-timeout", "0.5"), 60)
    assert code == 0, out
    r = json.loads((tmp_path / "rank0.json").read_text())
    assert r["armed"] > 20 and r["completed"] == r["armed"] and r["pending"] == 0, r
    assert r["close_s"] < 1.0, r


def _heartbeat_ranks(tmp_path, fault: str, *, replay_timeout: float, limit: float) -> tuple[int, str]:
    """faults_workers' native_heartbeats at 2 ranks: rank 0's exit status and output."""
    port = str(free_port())
    procs = [_start("native_heartbeats", tmp_path, "--replay-timeout", str(replay_timeout), "--fault", fault,
                    RANK=str(r), MASTER_PORT=port) for r in range(2)]
    try:
        return _finish(procs[0], limit)
    finally:
        procs[1].kill()
        procs[1].communicate()


@pytest.mark.parametrize("fault,needle", [
    ("kill", "rank 1: last heartbeat"),
    ("close", "rank 1: closed its watchdog"),
    ("alive", "running but not replaying"),
])
def test_heartbeats_say_which_ranks_were_last_seen_alive(tmp_path, fault, needle):
    code, out = _heartbeat_ranks(tmp_path, fault, replay_timeout=4, limit=60)
    assert code == 70, out
    assert "other ranks, by their watchdog heartbeats in the store" in out, out
    assert needle in out, out
    if fault == "kill":
        assert "(NOT ALIVE)" in out, out
    if fault == "alive":
        assert "rank 1: last heartbeat" in out and "(alive)" in out, out


def test_a_rank_that_left_ends_the_wait_before_the_timeout(tmp_path):
    """Rank 1 closes its watchdog (it left training: teardown at exit) while rank
    0's replay waits for its collectives: rank 0 ends after the departure grace
    (5 s here), not after its 120 s replay timeout. On 2xH200 a rank whose peer
    took Ctrl-C one step earlier waited in float(loss) for the whole timeout."""
    t0 = time.monotonic()
    code, out = _heartbeat_ranks(tmp_path, "close", replay_timeout=120, limit=90)
    took = time.monotonic() - t0
    assert code == 70, out
    assert "rank(s) 1 left training (closed their watchdog)" in out, out
    assert "does not wait out the replay timeout (120 s)" in out, out
    assert took < 60, f"{took:.0f} s: the wait was not ended early\n{out}"


def _interrupted(tmp_path, *args: str, case: str = "native_interrupted") -> tuple[int, str, dict, float]:
    """Start a faults_workers case, send it SIGINT once it waits; its exit
    status, output, JSON, and the seconds from the signal to its exit."""
    p = _start(case, tmp_path, "--replay-timeout", "120", *args)
    deadline = time.monotonic() + 60
    while not (tmp_path / "rank0.json").exists() and p.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.3)
    t0 = time.monotonic()
    p.send_signal(signal.SIGINT)
    code, out = _finish(p, 60)
    data = json.loads((tmp_path / "rank0.json").read_text())
    return code, out, data, time.monotonic() - t0


def test_ctrl_c_aborts_a_replay_that_waits_for_an_interrupted_peer(tmp_path):
    """The main thread is blocked (GIL held) in a replay armed before the Ctrl-C,
    as in float(loss) waiting for a peer that took the Ctrl-C one step earlier
    (2xH200: such ranks waited 24 s, or for good): the watchdog aborts the group
    about 2 s after the signal, long before the replay timeout (120 s) or the
    block's end (8 s), and says why; replaying after that raises."""
    code, out, data, took = _interrupted(tmp_path, "--leave-sleep", "8")
    assert "interrupted" in out and "Aborting the communicator so that this process can end" in out, out
    assert "this rank's last step is incomplete" in out and "communicator aborted" in out, out
    assert data["aborted"] is True, (data, out)
    assert "cannot replay again" in data["replay_raises"], (data, out)
    assert code == 0, out  # the worker caught the KeyboardInterrupt; the watchdog did not end it
    # The abort came ~2 s after the signal; on a GPU the blocked call then
    # returns, here _hold_gil_for_test blocks its 20 s regardless.
    line = next(ln for ln in out.splitlines() if "interrupted" in ln and "ago while graph replay" in ln)
    ago = float(line.split("interrupted ")[1].split(" s ago")[0])
    assert 1.9 <= ago < 5.0, line


def test_ctrl_c_the_script_handles_aborts_nothing(tmp_path):
    """The script handles SIGINT itself and trains on: the replay pending at the
    signal completes after it, the next (armed after it) is slow -- nothing is
    aborted."""
    code, out, data, _ = _interrupted(tmp_path, "--fault", "close", "--leave-sleep", "4")
    assert code == 0, out
    assert data.get("handler_ran") is True, (data, out)
    assert data["aborted"] is False and data["pending"] == 1, (data, out)
    assert "Aborting the communicator" not in out, out


def test_an_abort_that_waits_for_the_graphs_counts_once_the_replay_returns(tmp_path):
    """ncclCommAbort sets the flag its kernels poll, then waits until the graphs
    that captured the communicator are destroyed (2xH200: it never returned
    while they lived). The stuck replay completing is the abort's success: the
    process goes on to raise the interrupt and release its graphs."""
    code, out, data, _ = _interrupted(tmp_path, "--fault", "leave", "--leave-sleep", "6",
                                      case="native_interrupted_slow_abort")
    assert code == 0, out
    assert "communicator aborted" in out and "ending the process" not in out, out
    assert data["aborted"] is True and data["pending"] == 0, (data, out)


def test_an_abort_that_frees_nothing_ends_the_process_with_status_1(tmp_path):
    code, out, data, took = _interrupted(tmp_path, "--fault", "stop", "--leave-sleep", "30",
                                         case="native_interrupted_slow_abort")
    assert code == 1, out
    assert "the abort did not return within 2 s; ending the process now with exit status 1" in out, out
    assert "aborted" not in data and took < 15, (data, took, out)


def test_python_wrapper_disabled_and_lazy():
    from pygraph_dist.launch.watchdog import ReplayWatchdog

    off = ReplayWatchdog(0)
    assert not off.enabled
    off.after_replay("x")  # nothing to watch
    off.replay([])         # nothing to launch
    off.close()
    on = ReplayWatchdog(30, native=True, store=None)
    assert on.enabled and on._native is None  # threads start at the first replay
    on.close()
    on.close()  # idempotent


def test_std_terminate_names_the_thread():
    # Issue 13, item 4: an abort at exit must say which thread and where.
    code = ("import torch\nfrom pygraph_dist.runtime._ext import C\nC._terminate_for_test('pt_gloo_runloop')\n")
    e = child_env(PYTHONFAULTHANDLER="0")
    p = subprocess.run([sys.executable, "-c", code], env=e, capture_output=True, text=True, timeout=60)
    assert p.returncode in (-6, 134), p.stderr
    assert "[pygraph_dist] std::terminate in thread 'pt_gloo_runloop'" in p.stderr, p.stderr
    assert "without an active exception; native stack:" in p.stderr, p.stderr
    assert "terminate called without an active exception" in p.stderr, p.stderr  # the default line still follows
