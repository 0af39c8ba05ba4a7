"""Shared fixtures: multi-rank launches with timeouts, and GPU markers that skip cleanly."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import random
import signal
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import rank_server
from rank_server import PRELOAD_TORCH

ROOT = Path(__file__).resolve().parents[2]
RANK_MAIN = Path(__file__).with_name("rank_main.py")

# Never let a test touch NVLink multicast (see the device notes); inherited by every child.
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


# torch's stock Gloo aborting a DDP reference at exit: a pt_gloo_runloop worker
# releasing a finished Work's Python objects while the interpreter finalizes
# (libstdc++'s own words, and pygraph_dist's terminate handler's when it is
# imported). Only torch DDP controls may be excused for it, with a warning.
STOCK_GLOO_EXIT_ABORTS = ("terminate called without an active exception",
                          "std::terminate in thread 'pt_gloo_runloop'")


def stock_gloo_exit_abort(log: str) -> bool:
    return any(s in log for s in STOCK_GLOO_EXIT_ABORTS)


def cuda_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


# The CPU tests that take longest on the 2-core CI machine (--durations), by
# node id prefix, slowest first. In pytest-xdist workers (tests/run-all.sh) they
# are started first, each worker its share (_dealt), so that the run does not
# end on one of them alone.
SLOWEST_FIRST = (
    "tests/python/test_launch_and_tools.py::test_sweep_runs_each_variant_with_its_settings",
    "tests/python/test_faults_exit_stress.py::test_exits_never_abort",
    "tests/python/test_launch_and_tools.py::test_benchmark_harness_smoke",
    "tests/python/test_host_cost.py::test_host_cost_ab_alternates_base_and_this_tree",
    "tests/python/test_ecosystem_scripts.py::test_bench_scripts_smoke",
    "tests/python/test_ecosystem_scripts.py::test_imagenet_checkpoint_resume",
    "tests/python/test_coverage_corpus.py::test_two_cpu_ranks_write_rows_table_and_plot",
    "tests/python/test_multihost.py::",
    "tests/python/test_integration_lightning.py::test_benchmark_smoke_cpu",
    "tests/python/test_ecosystem_scripts.py::test_imagenet_reference_with_pgd",
    "tests/python/test_host_cost.py::test_host_cost_ab_keeps_the_rounds",
    "tests/python/test_coverage_corpus.py::test_list_and_model_filter",
    "tests/python/test_docs.py::test_docs_build_strict",
    "tests/python/test_launch_env.py::test_mpirun_two_ranks",
    "tests/python/test_integration_hf.py::test_bench_hf_smoke",
    "tests/python/test_launch_env.py::test_a_launch_whose_port_was_taken",
    "tests/python/test_host_cost.py::test_host_cost_smoke",
    "tests/python/test_compile.py::test_compile_option_trains_like_ddp_on_cpu",
    "tests/python/test_cpu_training.py::test_reducer_matches_ddp",
)


def _slow_rank(item) -> int:  # node ids are relative to the repository root (pyproject.toml)
    return next((i for i, prefix in enumerate(SLOWEST_FIRST) if item.nodeid.startswith(prefix)),
                len(SLOWEST_FIRST))


def _dealt(items: list, workers: int) -> list:
    """The order pytest-xdist's work stealing should see: it hands worker i the
    i-th of ``workers`` contiguous blocks (sizes as below), and a worker that
    runs dry steals from the end of another's block. So the slow tests are dealt
    round-robin to the blocks' starts, slowest first: sorted into one list they
    all went to the first block and ran one after another on one worker (the
    others stole its fast tail), the run ending on that worker. The other tests
    keep their order and fill the blocks, so a module's tests mostly stay on one
    worker, with its rank servers."""
    ranked = [(_slow_rank(it), it) for it in items]
    slow = [it for _, it in sorted((r for r in ranked if r[0] < len(SLOWEST_FIRST)), key=lambda r: r[0])]
    rest = [it for rank, it in ranked if rank == len(SLOWEST_FIRST)]
    blocks: list[list] = [[] for _ in range(workers)]
    for i, item in enumerate(slow):
        blocks[i % workers].append(item)
    left, pos = len(items), 0
    for i, block in enumerate(blocks):  # xdist: worker i gets len(pending) // (workers - i) of what is left
        size = left // (workers - i)
        left -= size
        take = max(0, size - len(block))
        block.extend(rest[pos:pos + take])
        pos += take
    blocks[-1].extend(rest[pos:])
    return [item for block in blocks for item in block]


@pytest.hookimpl(trylast=True)  # after -m/-k deselected: the blocks are of what runs
def pytest_collection_modifyitems(config, items):
    if hasattr(config, "workerinput"):  # a pytest-xdist worker: every worker orders alike
        items[:] = _dealt(items, int(config.workerinput.get("workercount", 1)))
    n = cuda_count()
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    skip_multi = pytest.mark.skip(reason=f"needs 2 CUDA GPUs, {n} visible")
    for item in items:
        if "multigpu" in item.keywords and n < 2:
            item.add_marker(skip_multi)
        elif "gpu" in item.keywords and n < 1:
            item.add_marker(skip_gpu)


def pytest_runtest_logreport(report):
    """With PGD_TEST_FAILURE_LOG=<file>, each failure's traceback is appended to
    <file> as it happens, not only in the summary at the end of the session: a
    GPU run cut off by its time limit still says why its failed tests failed."""
    path = os.environ.get("PGD_TEST_FAILURE_LOG")
    if path and report.failed and not os.environ.get("PYTEST_XDIST_WORKER"):  # xdist: the controller writes
        with open(path, "a", encoding="utf-8") as f:
            f.write(f"===== {report.nodeid} ({report.when})\n{report.longreprtext[-6000:]}\n")


@pytest.fixture(autouse=True)
def environment_as_before():
    """Whatever a test's in-process code sets in ``os.environ`` is undone after it.
    Libraries do set variables when a test runs them in the pytest process:
    importing Lightning sets PYTORCH_NVML_BASED_CUDA_CHECK, inductor's cache
    lookup TORCHINDUCTOR_CACHE_DIR. Left set, they would reach the processes of
    every later test in this worker, which then ran in an environment that
    depended on which tests ran before; and each change gave every environment
    new rank servers and zygotes (keyed by environment: rank_server.ServerPool):
    41 zygote roots (new Pythons importing torch) and 64 servers in a run of the
    CPU suite on the 2-core machine, against 31 and 47 with this fixture."""
    with environ_restored():
        yield


@contextlib.contextmanager
def environ_restored():
    """``os.environ`` as it was on entry, again on exit (but PYTEST_CURRENT_TEST, pytest's own)."""
    before = dict(os.environ)
    try:
        yield
    finally:
        for name in set(os.environ) - set(before) - {"PYTEST_CURRENT_TEST"}:
            del os.environ[name]
        for name, value in before.items():
            if name != "PYTEST_CURRENT_TEST" and os.environ.get(name) != value:
                os.environ[name] = value


@pytest.fixture(autouse=True)
def cpu_children_unless_gpu_test(request, monkeypatch):
    """Processes started by a test not marked gpu/multigpu see no GPU, so the CPU
    tests exercise Gloo on CPU on a GPU machine too (2 ranks on one GPU would
    otherwise share it, which NCCL refuses)."""
    if "gpu" not in request.keywords and "multigpu" not in request.keywords:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")


_LAUNCHER_PREFIXES = ("OMPI_", "PMI_", "PMIX_", "SLURM_", "TORCHELASTIC_")
_LAUNCHER_NAMES = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}


def child_env(**extra: str) -> dict:
    """This process's environment without any launcher's variables, with NVLink
    multicast off, one OpenMP thread and faulthandler on, plus ``extra``."""
    env = {k: v for k, v in os.environ.items()
           if k not in _LAUNCHER_NAMES and not k.startswith(_LAUNCHER_PREFIXES)}
    env.update(NO_MULTICAST)
    env.update({"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
                "PYTHONFAULTHANDLER": "1"})  # a crash or abort prints every thread's Python stack
    env.update(extra)
    return env


def free_port() -> int:
    """A port to rendezvous on, free when checked. Chosen at random below the
    kernel's ephemeral range, so that no outgoing connection (and no other
    test's bind(0)) is handed it between this check and rank 0's bind; the
    launch retries on another port if it was taken anyway (run_ranks)."""
    low = _ephemeral_low()
    for _ in range(50):
        port = _PORTS.randrange(10000, low)
        if 29000 <= port < 30000:  # torch's default 29500 and its neighbours: leave them to users
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # a crowded range: whatever the kernel gives
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_PORTS = random.SystemRandom()  # not the random module's state, which a test may seed


def _ephemeral_low() -> int:
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    return max(low, 12000)


class RankFailure(AssertionError):
    pass


PEER_GRACE_S = 15.0  # how long the other ranks get once one rank failed


def run_ranks(
    case: str,
    tmp_path: Path,
    *,
    world_size: int = 2,
    timeout: float = 120,
    kwargs: dict | None = None,
    env: dict | None = None,
    expect_success: bool = True,
) -> list[dict]:
    """Run ``case`` as ``world_size`` ranks (torchrun-style environment).

    ``case`` is ``"module:function"``: a function in a test module, run by
    ``rank_main.py`` with ``kwargs`` as keyword arguments.

    Every rank must finish within ``timeout`` seconds or all are killed and the
    test fails with their output. Returns each rank's JSON result (or, with
    ``expect_success=False``, dicts with returncode and output).
    """
    cap = os.environ.get("PGD_TEST_RANK_TIMEOUT")  # a shorter limit, to read a hang's stacks sooner
    if cap:
        timeout = min(timeout, float(cap))
    # free_port() lets the port go before rank 0 binds it: another process (a
    # parallel test's ranks) can take it in between, and rank 0's store then fails
    # at once with EADDRINUSE. Such a launch is retried on another port.
    for attempt in range(PORT_ATTEMPTS):
        try:
            return _run_ranks_once(case, tmp_path, world_size=world_size, timeout=timeout,
                                   kwargs=kwargs, env=env, expect_success=expect_success,
                                   port_taken_fails=attempt + 1 < PORT_ATTEMPTS)
        except _PortTaken:
            continue
    raise AssertionError("unreachable")


PORT_ATTEMPTS = 3
_PORT_TAKEN = ("EADDRINUSE", "Address already in use")  # torch's libuv store, the older one


def _port_taken(out_dir: Path, port: int) -> bool:
    """Rank 0's log says that it could not listen on ``port``."""
    log = (out_dir / "rank0.log").read_text(errors="replace")
    return str(port) in log and any(text in log for text in _PORT_TAKEN)


class _PortTaken(Exception):
    """Rank 0 could not listen on the port free_port() chose: launch again."""


def _run_ranks_once(case, tmp_path, *, world_size, timeout, kwargs, env, expect_success,
                    port_taken_fails) -> list[dict]:
    port = free_port()
    out_dir = tmp_path / f"{case.replace(':', '.')}-{port}"
    if ":" not in case:
        raise ValueError(f"run_ranks: case must be 'module:function', got {case!r}")
    command = [str(RANK_MAIN), case, "--out", str(out_dir)]
    for k, v in (kwargs or {}).items():
        command += [f"--{k}", str(v)]
    out_dir.mkdir(parents=True)
    procs = []
    for rank in range(world_size):
        env_r = child_env(
            RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
            LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
            PYTHONPATH=str(ROOT / "tests" / "python") + os.pathsep + os.environ.get("PYTHONPATH", ""),
            PGD_TEST_RANKS_PARENT=str(os.getpid()),  # rank_main.die_with_the_test
        )
        if env:
            env_r.update(env)
        log = open(out_dir / f"rank{rank}.log", "w")
        procs.append((_start_rank(case, command, env_r, log, expect_success), log))
    deadline = time.monotonic() + timeout
    timed_out = False
    # A rank that died leaves its peers blocked in a collective: give them a grace
    # period to fail on their own, then dump their stacks and stop them.
    while [p.poll() for p, _ in procs].count(None):  # every rank polled, no short cut
        if time.monotonic() > deadline:
            timed_out = True
            break
        if expect_success and any(p.returncode not in (None, 0) for p, _ in procs):
            deadline = min(deadline, time.monotonic() + PEER_GRACE_S)
            if port_taken_fails and procs[0][0].returncode not in (None, 0) and _port_taken(out_dir, port):
                break  # launched again on another port: its peers need not wait out their grace
        time.sleep(0.1)
    died = [r for r, (p, _) in enumerate(procs) if p.returncode not in (None, 0)]
    if [p.poll() for p, _ in procs].count(None) and not timed_out:  # rank 0 found its port taken
        for p, _ in procs:
            p.kill()
        for p, _ in procs:
            p.wait()
    if timed_out:
        for p, _ in procs:  # rank_main dumps every thread's stack on SIGUSR1: where each waited
            if p.poll() is None:
                p.send_signal(signal.SIGUSR1)
        time.sleep(2)
        for p, _ in procs:
            p.kill()
        for p, _ in procs:
            p.wait()
    for _, log in procs:
        log.close()
    logs = [(out_dir / f"rank{r}.log").read_text() for r in range(world_size)]
    failed = any(p.returncode != 0 for p, _ in procs)
    if port_taken_fails and failed and _port_taken(out_dir, port):
        shutil.rmtree(out_dir, ignore_errors=True)
        raise _PortTaken(port)
    if timed_out and died:
        raise RankFailure(f"{case}: rank(s) {died} failed and the others were stopped "
                          f"{PEER_GRACE_S:.0f} s later\n" + _fmt(logs))
    if timed_out:
        raise RankFailure(f"{case}: ranks did not finish within {timeout} s\n" + _fmt(logs))
    if not expect_success:
        return [{"returncode": p.returncode, "output": logs[r]} for r, (p, _) in enumerate(procs)]
    bad = [r for r, (p, _) in enumerate(procs) if p.returncode != 0]
    if bad:
        raise RankFailure(f"{case}: rank(s) {bad} failed\n" + _fmt(logs))
    results = []
    for r in range(world_size):
        results.append(json.loads((out_dir / f"rank{r}.json").read_text()))
    shutil.rmtree(out_dir, ignore_errors=True)
    return results


def _start_rank(case: str, command: list[str], env: dict, log, expect_success: bool):
    """One rank: forked by a rank server (rank_server.py says why and when), else a new Python."""
    if _use_rank_server(env, expect_success):
        key = _SERVERS.key(env)
        try:
            server = _SERVERS.get(key)
            # rank_main.die_with_the_test: the rank dies with the server that forked it (a
            # new Python instead, below, with the test process: env is left as it is).
            forked_env = dict(env, PGD_TEST_RANKS_PARENT=str(server.proc.pid))
            rank = server.spawn(case.split(":")[0], command[1:], forked_env, str(ROOT), log.name)
            _SERVER_STATS["ranks"] += 1
            return rank
        except rank_server.ServerGone as e:
            _SERVERS.drop(key)
            log.write(f"[run_ranks] no rank server ({e}); this rank is a new Python\n")
            log.flush()
    _SERVER_STATS["fresh"] += 1
    return subprocess.Popen([sys.executable, *command], env=env, stdout=log, stderr=subprocess.STDOUT,
                            cwd=str(ROOT))


def _use_rank_server(env: dict, expect_success: bool = True) -> bool:
    # CPU ranks only (CUDA_VISIBLE_DEVICES="" from cpu_children_unless_gpu_test): GPU
    # ranks and their timings keep new processes; so do ranks expected to fail.
    return (expect_success and env.get("CUDA_VISIBLE_DEVICES") == ""
            and os.environ.get("PGD_TEST_FRESH_RANKS") != "1" and sys.platform.startswith("linux"))


def popen_script(args: list, *, env: dict, preload: tuple[str, ...] = PRELOAD_TORCH, **kwargs):
    """``subprocess.Popen(args, env=env, **kwargs)`` for ``args = [sys.executable,
    SCRIPT, *ARGV]``, a process of a training script: forked by a rank server
    that imported ``preload`` where it is a CPU process (``ServerPool.popen``,
    whose other arguments it takes), else a new Python (GPU processes, other
    programs, PGD_TEST_FRESH_RANKS=1).

    ``preload`` is what the script itself imports before its process group
    exists, in the script's order (rank_server.PRELOAD_*): torch._dynamo only
    where pgd.init() imports it first (imported after the group, it pins the
    group, and the exit tests are about that), pygraph_dist only where the
    script imports it before its own init_process_group. rank_server.py says
    what a forked script shares with a new Python and what not;
    test_rank_server.py checks it."""
    fork = args[0] == sys.executable and _use_rank_server(env)
    proc = _SERVERS.popen(args, env=env, preload=preload, fork=fork, **kwargs)
    _SERVER_STATS["scripts" if isinstance(proc, rank_server.ForkedProcess) else "fresh"] += 1
    return proc


_SERVERS = rank_server.ServerPool(limit=8)
_SERVER_STATS = {"ranks": 0, "scripts": 0, "fresh": 0}


def pytest_sessionfinish(session, exitstatus):
    _SERVERS.close()


def pytest_terminal_summary(terminalreporter):
    if _SERVER_STATS["ranks"] or _SERVER_STATS["scripts"] or _SERVER_STATS["fresh"]:
        terminalreporter.write_line(
            f"run_ranks, popen_script: {_SERVER_STATS['ranks']} ranks and {_SERVER_STATS['scripts']} scripts "
            f"forked by {_SERVERS.started} rank server(s) (the servers and their zygotes: "
            f"{_SERVERS.new_pythons} new Pythons), {_SERVER_STATS['fresh']} started as new Pythons "
            f"(tests/python/rank_server.py)")


def _fmt(logs: list[str]) -> str:
    return "\n".join(f"----- rank {r} -----\n{log[-6000:]}" for r, log in enumerate(logs))


@pytest.fixture
def ranks(tmp_path):
    def run(case: str, **kwargs):
        return run_ranks(case, tmp_path, **kwargs)
    return run


@pytest.fixture(scope="session")
def made_once(request, tmp_path_factory):
    """``made_once(key, make)``: ``make(out_dir)``'s JSON result and ``out_dir``,
    made once per pytest session for every test that checks the same run (a
    script run is several new Pythons, seconds each on the 2-core CI machine).
    In pytest-xdist's workers too: they share their basetemp's parent, where a
    lock file per key makes the others wait for the first one's result (a
    module- or session-scoped fixture would be made once per worker). A
    ``make`` that raises is tried again by the next test that asks."""
    if hasattr(request.config, "workerinput"):
        root = tmp_path_factory.getbasetemp().parent / "made_once"
        root.mkdir(exist_ok=True)
    else:
        root = tmp_path_factory.mktemp("made_once")

    def get(key: str, make):
        out = root / key
        with open(root / f"{key}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            done = root / f"{key}.json"
            if not done.exists():
                shutil.rmtree(out, ignore_errors=True)
                out.mkdir()
                result = make(out)
                done.write_text(json.dumps(result))
            return json.loads(done.read_text()), out

    return get
