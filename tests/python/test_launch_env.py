"""Launch environments: what init() reads, and how bad environments fail (fast, clearly)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

import pygraph_dist as pgd
from conftest import RANK_MAIN, ROOT, child_env, free_port, run_ranks
from pygraph_dist.launch.launch_env import LaunchError, detect, first_slurm_host


def test_torchrun_environment():
    e = detect({"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                "MASTER_ADDR": "n0", "MASTER_PORT": "1234", "TORCHELASTIC_RUN_ID": "x"})
    assert (e.launcher, e.rank, e.world_size, e.local_rank, e.local_world_size) == ("torchrun", 1, 4, 1, 2)
    assert (e.master_addr, e.master_port) == ("n0", 1234)


@pytest.mark.parametrize("env,missing", [
    ({"RANK": "0"}, "WORLD_SIZE, LOCAL_RANK"),
    ({"RANK": "0", "WORLD_SIZE": "2"}, "LOCAL_RANK"),
    ({"WORLD_SIZE": "2", "LOCAL_RANK": "0"}, "RANK"),
    ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}, "MASTER_ADDR, MASTER_PORT"),
    ({"OMPI_COMM_WORLD_RANK": "0"}, "OMPI_COMM_WORLD_SIZE, OMPI_COMM_WORLD_LOCAL_RANK"),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2"}, "SLURM_LOCALID"),
])
def test_incomplete_environment_names_the_missing_variable(env, missing):
    with pytest.raises(LaunchError) as info:
        detect(env)
    assert missing in str(info.value)


def test_pmi_without_local_rank():
    with pytest.raises(LaunchError, match="MPI_LOCALRANKID"):
        detect({"PMI_RANK": "0", "PMI_SIZE": "2"})


def test_stacked_launchers_disagree():
    env = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "a", "MASTER_PORT": "1",
           "OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2"}
    with pytest.raises(LaunchError, match="two launchers"):
        detect(env)


@pytest.mark.parametrize("env,match", [
    ({"RANK": "2", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "a", "MASTER_PORT": "1"}, "outside"),
    ({"RANK": "x", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}, "not an integer"),
    ({"RANK": "0", "WORLD_SIZE": "0", "LOCAL_RANK": "0"}, ">= 1"),
])
def test_invalid_values(env, match):
    with pytest.raises(LaunchError, match=match):
        detect(env)


def test_mpi_and_slurm_environments():
    o = detect({"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4",
                "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
                "SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_LOCALID": "0"})
    assert (o.launcher, o.rank, o.world_size, o.local_rank) == ("openmpi", 3, 4, 1)  # MPI beats Slurm
    m = detect({"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"})
    assert (m.launcher, m.rank, m.local_rank, m.single_host) == ("mpich", 1, 1, True)
    s = detect({"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1",
                "SLURM_NODELIST": "gpu[03-05,9],cpu1", "SLURM_JOB_ID": "123456"})
    assert (s.launcher, s.rank, s.master_addr, s.master_port) == ("slurm", 5, "gpu03", 15000 + 3456)
    assert detect({}).launcher == "single"


@pytest.mark.parametrize("nodelist,first", [("n1", "n1"), ("a[1-3]", "a1"), ("gpu[007,9]", "gpu007"),
                                             ("x,y", "x")])
def test_first_slurm_host(nodelist, first):
    assert first_slurm_host(nodelist) == first


def init_only(rendezvous_timeout=60):
    """One rank of the launch tests: init(), then one all-reduce; a LaunchError exits 3."""
    t0 = time.monotonic()
    import datetime

    try:
        env = pgd.init(rendezvous_timeout=datetime.timedelta(seconds=rendezvous_timeout))
    except pgd.LaunchError as exc:
        print(f"LaunchError after {time.monotonic() - t0:.1f}s: {exc}", flush=True)
        sys.exit(3)
    t = torch.tensor([dist.get_rank() + 1.0])
    dist.all_reduce(t)
    return {"rank": env.rank, "world": env.world_size, "launcher": env.launcher,
            "sum": float(t), "master_addr": os.environ.get("MASTER_ADDR")}


def _single(tmp_path, env: dict, timeout: float = 60) -> tuple[int, str, float]:
    """One rank of a world, alone: it must fail on its own within the timeout."""
    child = child_env(PYTHONPATH=str(ROOT / "tests" / "python"), **env)
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, str(RANK_MAIN), "test_launch_env:init_only", "--out",
                        str(tmp_path), "--rendezvous-timeout", "3"], env=child, capture_output=True, text=True,
                       timeout=timeout, cwd=str(ROOT))
    return p.returncode, p.stdout + p.stderr, time.monotonic() - t0


def test_unreachable_master_fails_within_bounded_time(tmp_path):
    # TEST-NET-1 (RFC 5737): routable nowhere, so the connection can only time out.
    code, out, took = _single(tmp_path, {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1",
                                         "MASTER_ADDR": "192.0.2.1", "MASTER_PORT": str(free_port())})
    assert code == 3, out
    assert "could not rendezvous at MASTER_ADDR=192.0.2.1" in out
    assert took < 45, f"took {took:.0f} s"


def test_unresolvable_master_fails_fast(tmp_path):
    code, out, took = _single(tmp_path, {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1",
                                         "MASTER_ADDR": "no-such-host.invalid", "MASTER_PORT": "29511"})
    assert code == 3, out
    assert "no-such-host.invalid" in out
    assert took < 45


def test_rank_without_world_size_fails_clearly(tmp_path):
    code, out, _ = _single(tmp_path, {"RANK": "0"})
    assert code != 0
    assert "WORLD_SIZE" in out and "LaunchError" in out


def _mpi4py_library() -> str:
    """The MPI library mpi4py loads (MPI_Get_library_version, callable before
    MPI_Init), asked in a child so that this process never initialises MPI;
    '' when mpi4py cannot load one. (PyPI's mpi4py loads whichever libmpi it
    finds, which need not be the mpirun on PATH.)"""
    code = ("import mpi4py; mpi4py.rc.initialize = False; from mpi4py import MPI; "
            "print(MPI.Get_library_version().splitlines()[0])")
    try:
        p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                           env=child_env())
    except subprocess.TimeoutExpired:
        return ""
    return p.stdout.strip() if p.returncode == 0 else ""


def _mpirun_flavour(mpirun: str) -> str:
    try:
        p = subprocess.run([mpirun, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    out = p.stdout + p.stderr
    return "Open MPI" if "Open MPI" in out or "OpenRTE" in out else ("MPICH" if "HYDRA" in out else out[:80])


def _need_open_mpi_mpi4py() -> str:
    """These tests use Open MPI's variables and mpirun: skip, naming what was
    found, where mpi4py is linked to another MPI (as Debian's python3-mpi4py is
    not, but a pip-installed mpi4py can be)."""
    pytest.importorskip("mpi4py")
    lib = _mpi4py_library()
    if "Open MPI" not in lib:
        pytest.skip(f"needs an mpi4py linked to Open MPI; this one loads {lib or 'no MPI library'!r}")
    return lib


def _path_without_remote_shell(tmp_path) -> str:
    """A PATH with Open MPI's mpirun and orted and coreutils' false but no ssh or
    rsh, as in a container without an ssh client (the GPU machine is one)."""
    bin_dir = tmp_path / "bin-without-ssh"
    bin_dir.mkdir()
    for program in ("mpirun", "orted", "false"):
        found = shutil.which(program)
        if found is None:
            pytest.skip(f"{program} is not on PATH")
        (bin_dir / program).symlink_to(found)
    return str(bin_dir)


REMOTE_SHELL = pytest.mark.parametrize("remote_shell", ["as installed", "no ssh or rsh"])


@pytest.mark.mpi
@REMOTE_SHELL
def test_mpi4py_linked_to_another_mpi(tmp_path, remote_shell):
    """An MPICH-style launch (PMI_* variables) of a process whose mpi4py is Open MPI's:
    mpi4py comes up as a singleton. init() must refuse instead of training as rank 0 of 1
    -- also where Open MPI's singleton start-up would abort for want of ssh."""
    _need_open_mpi_mpi4py()
    env = {"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1"}
    if remote_shell == "no ssh or rsh":
        env["PATH"] = _path_without_remote_shell(tmp_path)
    code, out, took = _single(tmp_path, env)
    assert code == 3, out
    assert "mpi4py is linked to a different MPI" in out
    assert took < 45


@pytest.mark.mpi
@REMOTE_SHELL
def test_mpirun_two_ranks(tmp_path, monkeypatch, remote_shell):
    """A real Open MPI launch of 2 ranks with pygraph-launch's command and no
    MASTER_ADDR: rendezvous through mpi4py's broadcast. Without ssh/rsh on PATH
    the launcher names a launch agent, without which mpirun does not start."""
    lib = _need_open_mpi_mpi4py()
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        pytest.skip("mpirun not installed")
    if _mpirun_flavour(mpirun) != "Open MPI":
        pytest.skip(f"needs Open MPI's mpirun (mpi4py loads {lib!r}); {mpirun} is {_mpirun_flavour(mpirun)!r}")
    import json

    from pygraph_dist.launch.cli import build_command, open_mpi_needs_agent, parse

    env = child_env(PYTHONPATH=str(ROOT / "tests" / "python"))
    if remote_shell == "no ssh or rsh":
        env["PATH"] = _path_without_remote_shell(tmp_path)
    for k in ("PATH", "PYTHONPATH"):
        monkeypatch.setenv(k, env[k])
    monkeypatch.delenv("OMPI_MCA_plm_rsh_agent", raising=False)
    cmd, extra = build_command(parse(["--launcher", "mpirun", "-n", "2", "--oversubscribe",
                                      "--python", sys.executable, str(RANK_MAIN), "test_launch_env:init_only",
                                      "--out", str(tmp_path)]))
    # As installed: an agent only where the machine has no ssh/rsh (the GPU machine).
    needs_agent = open_mpi_needs_agent()
    assert needs_agent or remote_shell == "as installed"
    assert ("plm_rsh_agent" in cmd) == needs_agent, cmd
    p = subprocess.run(cmd, env={**env, **extra}, capture_output=True, text=True, timeout=120, cwd=str(ROOT))
    assert p.returncode == 0, f"{cmd}\n{p.stdout}{p.stderr}"
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["rank"] for r in results] == [0, 1]
    assert all(r["launcher"] == "openmpi" and r["world"] == 2 for r in results)
    assert all(r["sum"] == 3.0 for r in results)  # 1 + 2 over both ranks


def test_torchrun_style_two_ranks(tmp_path):
    results = run_ranks("test_launch_env:init_only", tmp_path, timeout=60)
    assert [r["sum"] for r in results] == [3.0, 3.0]
    assert {r["launcher"] for r in results} == {"env"}


def one_rank_dies(wait_s=300):
    """Rank 1 fails at once; rank 0 waits as a rank blocked in a collective would."""
    if int(os.environ["RANK"]) == 1:
        raise RuntimeError("test: rank 1 fails")
    time.sleep(wait_s)
    return {}


def test_a_failed_rank_stops_its_peers_soon_with_their_stacks(tmp_path):
    """The test harness itself: one rank's failure does not leave the test waiting
    for the whole timeout behind a peer blocked on it, and the peer's stack is shown."""
    from conftest import PEER_GRACE_S, RankFailure

    t0 = time.monotonic()
    with pytest.raises(RankFailure) as info:
        run_ranks("test_launch_env:one_rank_dies", tmp_path, timeout=300)
    elapsed = time.monotonic() - t0
    assert elapsed < PEER_GRACE_S + 30, elapsed
    text = str(info.value)
    assert "rank(s) [1] failed and the others were stopped" in text
    assert "test: rank 1 fails" in text
    assert "one_rank_dies" in text.split("----- rank 1 -----")[0]  # rank 0's stack: where it waited


def test_a_launch_whose_port_was_taken_is_retried_on_another(tmp_path, monkeypatch):
    """The test harness itself: free_port() lets its port go before rank 0 binds it,
    and a parallel test can take it in between (seen on the GPU machine with xdist:
    EADDRINUSE at rank 0's store). Such a launch runs again on another port; a
    launch failing for any other reason is not retried."""
    import conftest

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    taken_port, handed = taken.getsockname()[1], []

    def port_taken_first():
        port = taken_port if not handed else free_port()
        handed.append(port)
        return port

    monkeypatch.setattr(conftest, "free_port", port_taken_first)
    try:
        results = run_ranks("test_launch_env:init_only", tmp_path, timeout=60)
    finally:
        taken.close()
    assert [r["sum"] for r in results] == [3.0, 3.0]
    assert len(handed) == 2 and handed[0] != handed[1], handed
    handed.append("the next launch")  # from here on, free ports only
    with pytest.raises(conftest.RankFailure, match="test: rank 1 fails"):
        run_ranks("test_launch_env:one_rank_dies", tmp_path, timeout=60, kwargs={"wait_s": 1})
    assert len(handed) == 4, handed  # not a taken port: one launch, no second


def test_free_port_stays_out_of_the_ephemeral_range():
    """The harness's rendezvous ports come from below the kernel's ephemeral range
    (no outgoing connection is handed one while rank 0 starts), away from torch's
    default 29500, and not from the random module's state, which a test may seed."""
    import random

    import conftest

    low = conftest._ephemeral_low()
    random.seed(0)
    first = [conftest.free_port() for _ in range(10)]
    random.seed(0)
    second = [conftest.free_port() for _ in range(10)]
    assert first != second  # SystemRandom: two workers that seeded random alike still differ
    for port in first + second:
        assert 10000 <= port < low and not 29000 <= port < 30000, port
    with socket.socket() as s:  # free when handed out
        s.bind(("127.0.0.1", first[-1]))
