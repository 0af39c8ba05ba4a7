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
import os
import signal
import subprocess
import sys
import time

import pytest

import rank_server
from conftest import ROOT, child_env, environ_restored, popen_script

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

# What this module's ranks import in their server: a module that starts a
# thread, so that the server refuses to fork them (test below).
RANK_PRELOAD = ("thread_at_import",)


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


# What the zygotes import is imported once for environments that differ in
# rank_server.import_inert variables: a check that those modules never look
# one up by name while they import, in Python (os.environ) and, where a C
# compiler is at hand, in C (getenv, through an LD_PRELOAD shim).
ENV_SPY = r'''
import importlib, os, sys
names = set()
class Spy(type(os.environ)):
    def __getitem__(self, key):
        if sys._getframe(1).f_code.co_name != "__iter__":  # not a scan of every variable (tqdm's TQDM_*)
            names.add(key)
        return super().__getitem__(key)
    def __contains__(self, key):
        names.add(key)
        return super().__contains__(key)
e = os.environ
os.environ = Spy(e._data, e.encodekey, e.decodekey, e.encodevalue, e.decodevalue)
for name in sys.argv[1].split(","):
    importlib.import_module(name)
os.environ = e
sys.stderr.flush()
os.write(2, b"DONE\n")
print("\n".join(sorted(names)))
'''

GETENV_SHIM = r'''
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <unistd.h>
static void say(const char *name) { char b[512]; int n = snprintf(b, sizeof b, "GETENV %s\n", name); if (n > 0) write(2, b, n < (int)sizeof b ? n : (int)sizeof b - 1); }
char *getenv(const char *name) { static char *(*real)(const char *); if (!real) real = dlsym(RTLD_NEXT, "getenv"); say(name); return real(name); }
char *secure_getenv(const char *name) { static char *(*real)(const char *); if (!real) real = dlsym(RTLD_NEXT, "secure_getenv"); say(name); return real(name); }
'''


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the rank servers are Linux only")
def test_the_zygote_modules_read_no_inert_variable_at_import(tmp_path):
    import shutil

    env = child_env(CUDA_VISIBLE_DEVICES="")
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc:
        shim = tmp_path / "getenv_shim.so"
        (tmp_path / "shim.c").write_text(GETENV_SHIM)
        subprocess.run([cc, "-shared", "-fPIC", "-O1", "-o", str(shim), str(tmp_path / "shim.c"), "-ldl"],
                       check=True, timeout=120)
        env["LD_PRELOAD"] = str(shim)
    p = subprocess.run([sys.executable, "-c", ENV_SPY, ",".join(rank_server.ZYGOTE_MODULES)], env=env,
                       capture_output=True, text=True, timeout=180)
    assert p.returncode == 0, p.stderr[-3000:]
    in_python = set(p.stdout.split())
    before_done = p.stderr.split("\nDONE\n")[0] if "\nDONE\n" in p.stderr else p.stderr
    in_c = {line.split()[1] for line in before_done.splitlines() if line.startswith("GETENV ")}
    assert "TORCH_LOGS" in in_python, sorted(in_python)  # the spy sees torch's own lookups
    if cc:
        assert "OMP_NUM_THREADS" in in_c, sorted(in_c)  # and the shim libtorch's
    read = sorted(n for n in in_python | in_c if rank_server.import_inert(n))
    assert not read, f"{rank_server.ZYGOTE_MODULES} read {read} at import: not import_inert then"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the rank servers are Linux only")
def test_servers_forked_from_a_zygote_import_with_their_own_environment(tmp_path):
    """Two environments that differ only in an import_inert variable share a
    zygote (one new Python), and each server imports the rest of its preload
    list with its own value; another rank gets a zygote, and hash seed, of its own."""
    (tmp_path / "seen_at_import.py").write_text("import os\nSEEN = os.environ.get('PYGRAPH_DIST_PROBE')\n")
    script = tmp_path / "report.py"
    script.write_text("import json, os, seen_at_import\n"
                      "print(json.dumps([seen_at_import.SEEN, os.environ['PYGRAPH_DIST_PROBE'], hash('pgd')]))\n")
    preload = (*rank_server.PRELOAD_TORCH, "seen_at_import")
    pool = rank_server.ServerPool()
    got = []
    try:
        for rank, value in (("0", "a"), ("0", "b"), ("1", "a")):
            env = child_env(CUDA_VISIBLE_DEVICES="", RANK=rank, PYGRAPH_DIST_PROBE=value,
                            PYTHONPATH=f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
            p = pool.get(pool.key(env, preload)).script([sys.executable, str(script)], env=env, cwd=str(tmp_path),
                                                        stdout=subprocess.PIPE, text=True)
            out = p.communicate(timeout=120)[0]
            assert p.returncode == 0, out
            got.append(json.loads(out))
        assert (pool.started, pool.new_pythons) == (3, 2), (pool.started, pool.new_pythons)
    finally:
        pool.close()
    assert [g[:2] for g in got] == [["a", "a"], ["b", "b"], ["a", "a"]]
    assert got[0][2] == got[1][2] != got[2][2]  # one zygote for rank 0's two, another for rank 1


def test_what_a_test_sets_in_the_environment_is_undone_after_it():
    """conftest.environ_restored, around every test (the autouse
    environment_as_before): variables added, changed or removed in the pytest
    process are as before afterwards, so the next test's processes, and the
    rank servers keyed by their environment, are what they would have been."""
    os.environ["PGD_TEST_PROBE_CHANGED"] = "before"
    os.environ["PGD_TEST_PROBE_REMOVED"] = "before"
    try:
        key = rank_server.ServerPool().key(child_env())
        with environ_restored():
            os.environ["PGD_TEST_PROBE_ADDED"] = "during"  # as importing Lightning sets PYTORCH_NVML_BASED_CUDA_CHECK
            os.environ["PGD_TEST_PROBE_CHANGED"] = "during"
            del os.environ["PGD_TEST_PROBE_REMOVED"]
            assert rank_server.ServerPool().key(child_env()) != key
        assert "PGD_TEST_PROBE_ADDED" not in os.environ
        assert os.environ["PGD_TEST_PROBE_CHANGED"] == os.environ["PGD_TEST_PROBE_REMOVED"] == "before"
        assert rank_server.ServerPool().key(child_env()) == key
    finally:
        for name in ("PGD_TEST_PROBE_CHANGED", "PGD_TEST_PROBE_REMOVED", "PGD_TEST_PROBE_ADDED"):
            os.environ.pop(name, None)


def parent_of_the_rank(out) -> dict:
    """A rank body: what started this rank."""
    return {"parent": os.getppid(), "server_threads": "thread_at_import" in sys.modules}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the rank servers are Linux only")
def test_ranks_whose_server_cannot_fork_run_as_new_pythons(ranks):
    """A server that has a thread after its imports cannot fork (fork() would copy
    one thread): the ranks are then new Pythons of the test process, and run."""
    for r in ranks("test_rank_server:parent_of_the_rank", world_size=2, timeout=120):
        assert r["parent"] == os.getpid(), r
        assert not r["server_threads"], r  # a new Python imported only what the rank needs
