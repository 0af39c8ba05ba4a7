"""A script forked by a rank server starts and ends as the same script run as a new Python.

The exit tests and the ecosystem scripts' launches fork their CPU processes
from a server that imported torch once (``conftest.popen_script``,
tests/python/rank_server.py). What they assert is how a script starts and
ends, so this checks, for one probe script run both ways, what the script
sees (``__main__``, argv, sys.path, environment, directory, signal
dispositions, its own ``__future__`` flags, fresh random seeds) and how it ends
(exit status of a return, ``sys.exit``, an exception, Ctrl-C and SIGTERM;
atexit handlers; output through a pipe and a file).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest

import rank_server
from conftest import ROOT, child_env, popen_script

PROBE = r'''
import atexit, gc, json, os, signal, sys, time
import torch

def annotated(x: int): pass  # the server's "from __future__ import annotations" must not leak here

mode = sys.argv[1]
facts = {
    "name": __name__, "file": __file__, "argv": sys.argv, "path0": sys.path[0],
    "path_tail": sys.path[-3:], "cwd": os.getcwd(), "env": os.environ.get("PROBE_VALUE"),
    "rank": os.environ.get("RANK"), "main_is_module": sys.modules["__main__"].__dict__ is globals(),
    "sigint": "python" if signal.getsignal(signal.SIGINT) is signal.default_int_handler else str(signal.getsignal(signal.SIGINT)),
    "sigterm": str(signal.getsignal(signal.SIGTERM)), "annotation": str(annotated.__annotations__["x"]),
    "seed": torch.initial_seed(), "session_leader": os.getsid(0) == os.getpid(),
    "spec": __spec__, "cached": __cached__,
}
print("FACTS " + json.dumps(facts), flush=True)
atexit.register(lambda: print("atexit ran", flush=True))
if mode == "return":
    pass
elif mode == "exit3":
    sys.exit(3)
elif mode == "raise":
    raise RuntimeError("probe failed")
elif mode in ("sigint", "sigterm"):
    open(sys.argv[2], "w").close()
    time.sleep(60)
'''

MODES = {"return": 0, "exit3": 3, "raise": 1, "sigint": -signal.SIGINT, "sigterm": -signal.SIGTERM}


@pytest.fixture(scope="module")
def pool():
    """One server for every mode: PROBE_VALUE, which differs, is set in the fork only."""
    servers = rank_server.ServerPool(limit=1)
    yield servers
    servers.close()


def _run(tmp_path, mode: str, forked: bool, pool=None):
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    ready = tmp_path / f"ready-{mode}"
    ready.unlink(missing_ok=True)
    args = [sys.executable, str(script), mode, str(ready)]
    env = child_env(PROBE_VALUE=f"v-{mode}", RANK="0", CUDA_VISIBLE_DEVICES="")
    kw = dict(env=env, cwd=str(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
              start_new_session=True)
    if forked:
        p = pool.get(pool.key(env, ("torch",), per_launch=("PROBE_VALUE",))).script(args, default_signals=True, **kw)
        out = _finish(p, mode, ready)
    else:  # PGD_TEST_FRESH_RANKS=1 (the caller's monkeypatch): a new Python
        p = popen_script(args, default_signals=True, **kw)
        assert isinstance(p, subprocess.Popen)
        out = _finish(p, mode, ready)
    facts = json.loads(next(line for line in out.splitlines() if line.startswith("FACTS "))[6:])
    return p.returncode, facts, out


def _finish(p, mode, ready):
    if mode in ("sigint", "sigterm"):
        deadline = time.monotonic() + 60
        while not ready.exists() and time.monotonic() < deadline and p.poll() is None:
            time.sleep(0.05)
        p.send_signal(signal.SIGINT if mode == "sigint" else signal.SIGTERM)
    return p.communicate(timeout=60)[0]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the rank servers are Linux only")
@pytest.mark.parametrize("mode", list(MODES))
def test_a_forked_script_starts_and_ends_as_a_new_python(tmp_path, mode, monkeypatch, pool):
    monkeypatch.setenv("PGD_TEST_FRESH_RANKS", "1")
    rc_new, new, out_new = _run(tmp_path, mode, forked=False)
    rc_fork, fork, out_fork = _run(tmp_path, mode, forked=True, pool=pool)
    assert rc_new == rc_fork == MODES[mode], (rc_new, rc_fork, out_new, out_fork)
    seeds = new.pop("seed"), fork.pop("seed")
    assert seeds[0] != seeds[1]  # a fresh default generator seed, not the server's
    assert fork == new, (fork, new)
    assert new["name"] == "__main__" and new["annotation"] == "<class 'int'>" and new["sigint"] == "python"
    # The same output after the facts: no traceback, or the same one (no frame of the server's).
    assert out_fork.split("\n", 1)[1] == out_new.split("\n", 1)[1], (out_fork, out_new)
    assert ("atexit ran" in out_new) == (mode != "sigterm"), out_new
    assert ("Traceback" in out_new) == (mode in ("raise", "sigint")), out_new
    if mode == "raise":
        assert 'raise RuntimeError("probe failed")\nRuntimeError: probe failed\natexit ran' in out_new, out_new


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the rank servers are Linux only")
def test_forked_scripts_write_to_files_and_get_seeds_of_their_own(tmp_path):
    script = tmp_path / "seed.py"
    script.write_text("import torch, sys\nprint(torch.initial_seed(), sys.argv[1])\n")
    env = child_env(CUDA_VISIBLE_DEVICES="")
    pool = rank_server.ServerPool(limit=1)
    try:
        server = pool.get(pool.key(env, ("torch",)))
        logs = []
        for i in range(2):
            log = open(tmp_path / f"seed{i}.log", "w")
            p = server.script([sys.executable, str(script), str(i)], env=env, cwd=str(ROOT), stdout=log,
                              stderr=subprocess.STDOUT)
            assert p.wait(timeout=60) == 0
            log.close()
            logs.append((tmp_path / f"seed{i}.log").read_text().split())
        with pytest.raises(ValueError, match="runs Python scripts"):
            server.script(["/bin/true"], env=env, cwd=str(ROOT))
    finally:
        pool.close()
    assert [log[1] for log in logs] == ["0", "1"]
    assert logs[0][0] != logs[1][0], logs
