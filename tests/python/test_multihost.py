"""Two hosts on one machine: every launcher across a real host boundary.

Two network namespaces joined by a veth pair are the two hosts, each with its
own hostname (UTS namespace) and an /etc/hosts naming both (``ip netns exec``
mounts /etc/netns/<ns>/hosts over /etc/hosts). Nothing but the veth link joins
them, so a job that trains has really crossed the host boundary. Each launcher
starts 2 ranks per host (4 in all), Gloo on CPU, a tiny model through
``pgd.wrap`` (the eager engine: graphs are unavailable on CPU):

* torchrun ``--nnodes 2 --nproc-per-node 2`` with c10d rendezvous (via pygraph-launch);
* Open MPI ``mpirun`` with a launch agent that enters the other namespace
  instead of ssh, ``pgd.init()`` from the OMPI_* variables, the rendezvous
  address broadcast by rank 0 through mpi4py;
* MPICH's ``mpiexec`` (hydra) the same way, with an mpi4py built against MPICH;
* Slurm: slurmctld and a slurmd per host (munge for authentication), ``srun -N2 -n4``.

Every rank's rank, world size and local rank must be right, and its losses and
final parameters bitwise equal to those of the same 4 ranks on one host.

Needs root (namespaces; CI runs as root), ``ip`` and ``unshare``; each launcher
is skipped, with the reason, where it is not installed (``tests/run-all.sh``
installs them). Namespaces, veths and daemons are removed whatever happens.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import ROOT, child_env, free_port
from pygraph_dist.launch.launch_env import first_slurm_host

WORKER = Path(__file__).with_name("multihost_worker.py")
WORLD, PER_HOST = 4, 2
LAUNCH_TIMEOUT = 120  # seconds for one 4-rank job (2 shared cores in CI)

pytestmark = [pytest.mark.multihost, pytest.mark.timeout(300)]


def _cannot_run() -> str | None:
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "needs root to create network namespaces (CI runs as root)"
    for tool, pkg in (("ip", "iproute2"), ("unshare", "util-linux"), ("nsenter", "util-linux")):
        if shutil.which(tool) is None:
            return f"needs `{tool}` ({pkg})"
    return None


def _sh(*cmd: str, timeout: float = 30) -> str:
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({p.returncode}): {p.stderr.strip()}")
    return p.stdout


# ----------------------------------------------------------------- two hosts
@dataclass
class Host:
    name: str   # its hostname
    ns: str     # its network namespace
    addr: str   # its address on the veth link
    enter: Path  # `enter CMD...` runs CMD on this host

    def cmd(self, *argv: str) -> list[str]:
        return [str(self.enter), *argv]

    def daemon_cmd(self, *argv: str) -> list[str]:
        """Like cmd(), but with the machine's /sys (see _ENTER_KEEP_SYS)."""
        return [str(self.enter.with_name(self.enter.name + "-keep-sys")), *argv]


@dataclass
class TwoHosts:
    a: Host
    b: Host
    subnet: str
    dir: Path
    agent: Path  # stands in for ssh: `agent [options] HOST COMMAND...`

    @property
    def all(self) -> tuple[Host, Host]:
        return (self.a, self.b)


_ENTER = """#!/bin/sh
# Run a command on host {name}: network namespace {ns}, hostname {name} (its
# own UTS namespace), /etc/hosts from /etc/netns/{ns}/hosts.
exec ip netns exec {ns} unshare --uts /bin/sh -c 'hostname "$0" && exec "$@"' {name} "$@"
"""

# slurmd needs the cgroup file systems under /sys/fs/cgroup, which the fresh
# /sys of `ip netns exec` lacks: the same host without remounting /sys.
_ENTER_KEEP_SYS = """#!/bin/sh
exec nsenter --net=/run/netns/{ns} unshare --uts --mount /bin/sh -c \
  'hostname "$0" && mount --bind /etc/netns/{ns}/hosts /etc/hosts && exec "$@"' {name} "$@"
"""

_AGENT = """#!/bin/sh
# Stands in for ssh (Open MPI's plm_rsh_agent, hydra's -launcher-exec):
#   agent [options] HOST COMMAND...
# runs COMMAND with a shell on HOST. Like ssh, nothing of the caller's
# environment goes along: what the ranks need must be forwarded by the launcher.
while [ $# -gt 0 ]; do case "$1" in -*) shift ;; *) break ;; esac; done
host=$1; shift
case "$host" in
{cases}
  *) echo "agent: unknown host $host" >&2; exit 255 ;;
esac
exec env -i PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME="$HOME" "$enter" /bin/sh -c "$*"
"""


@pytest.fixture(scope="module")
def hosts(tmp_path_factory):
    why = _cannot_run()
    if why:
        pytest.skip(why)
    tag = secrets.token_hex(3)  # unique per test run: several runs may share the machine
    third = secrets.randbelow(250) + 1
    subnet = f"10.231.{third}.0/24"
    d = tmp_path_factory.mktemp("hosts")
    a = Host(f"pgd{tag}n1", f"pgd-{tag}-1", f"10.231.{third}.1", d / "enter-1")
    b = Host(f"pgd{tag}n2", f"pgd-{tag}-2", f"10.231.{third}.2", d / "enter-2")
    hosts_file = "127.0.0.1 localhost\n" + "".join(f"{h.addr} {h.name}\n" for h in (a, b))
    created: list[str] = []
    made_etc_netns = not Path("/etc/netns").exists()
    try:
        for h in (a, b):
            try:
                _sh("ip", "netns", "add", h.ns)
            except RuntimeError as exc:
                pytest.skip(f"cannot create network namespaces here: {exc}")
            created.append(h.ns)
            etc = Path("/etc/netns") / h.ns
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "hosts").write_text(hosts_file)
            h.enter.write_text(_ENTER.format(name=h.name, ns=h.ns))
            h.enter.chmod(0o755)
            keep_sys = h.enter.with_name(h.enter.name + "-keep-sys")
            keep_sys.write_text(_ENTER_KEEP_SYS.format(name=h.name, ns=h.ns))
            keep_sys.chmod(0o755)
        # One veth pair, named pgd0 on both ends, created directly inside the
        # namespaces: nothing appears in the machine's own network.
        _sh("ip", "link", "add", "pgd0", "netns", a.ns, "type", "veth", "peer", "name", "pgd0", "netns", b.ns)
        for h in (a, b):
            _sh("ip", "-n", h.ns, "addr", "add", f"{h.addr}/24", "dev", "pgd0")
            _sh("ip", "-n", h.ns, "link", "set", "pgd0", "up")
            _sh("ip", "-n", h.ns, "link", "set", "lo", "up")
        cases = "\n".join(f"  {h.name}|{h.addr}) enter={h.enter} ;;" for h in (a, b))
        agent = d / "agent"
        agent.write_text(_AGENT.format(cases=cases))
        agent.chmod(0o755)
        hosts = TwoHosts(a, b, subnet, d, agent)
        # Each host sees its own name and reaches the other's address.
        probe = "import socket; print(socket.gethostname(), socket.gethostbyname(socket.gethostname()))"
        for h in (a, b):
            assert _sh(*h.cmd(sys.executable, "-c", probe)).split() == [h.name, h.addr]
        yield hosts
    finally:
        for ns in created:
            _kill_namespace(ns)
            shutil.rmtree(Path("/etc/netns") / ns, ignore_errors=True)
        if made_etc_netns:
            try:
                Path("/etc/netns").rmdir()
            except OSError:
                pass


def _kill_namespace(ns: str) -> None:
    """End what this test left running in ``ns`` (by pid), then delete ``ns`` (and its veth end)."""
    try:
        pids = [int(p) for p in _sh("ip", "netns", "pids", ns).split()]
    except (RuntimeError, ValueError, subprocess.TimeoutExpired):
        pids = []
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)


# ----------------------------------------------------------------- running jobs
def _env(**extra: str) -> dict:
    """The ranks' environment: Gloo on CPU even where GPUs are (4 ranks per host
    in the reference would need 4 GPUs; launching is what is tested here)."""
    pythonpath = [str(ROOT / "tests" / "python")]
    if os.environ.get("PYTHONPATH"):
        pythonpath.append(os.environ["PYTHONPATH"])
    return child_env(PYTHONPATH=os.pathsep.join(pythonpath), CUDA_VISIBLE_DEVICES="", **extra)


def _worker(out: Path) -> list[str]:
    return [sys.executable, str(WORKER), "--out", str(out)]


def _launch(jobs: list[tuple[str, list[str], dict]], out: Path, timeout: float = LAUNCH_TIMEOUT) -> list[dict]:
    """Run ``(label, command, env)`` jobs together; every one must exit 0 within
    ``timeout``; returns the WORLD ranks' results. Whatever is still running at
    the end (a timeout, a failure, pytest's own timeout) is stopped: SIGTERM
    first, which the launchers pass on to their ranks, then SIGKILL."""
    procs = []
    try:
        for label, cmd, env in jobs:
            log = out / f"{label}.log"
            with open(log, "w") as f:
                procs.append((label, log, subprocess.Popen(cmd, env=env, cwd=str(ROOT), stdout=f,
                                                           stderr=subprocess.STDOUT, start_new_session=True)))
        deadline = time.monotonic() + timeout
        timed_out = False
        for _, _, p in procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                timed_out = True
                break
    finally:
        _stop([p for _, _, p in procs])

    def logs() -> str:
        return "\n".join(f"----- {label} (exit {p.returncode}) -----\n{log.read_text()[-5000:]}"
                         for label, log, p in procs)

    if timed_out:
        pytest.fail(f"the job did not finish within {timeout:.0f} s\n{logs()}")
    if any(p.returncode != 0 for _, _, p in procs):
        pytest.fail(f"the job failed\n{logs()}")
    missing = [r for r in range(WORLD) if not (out / f"rank{r}.json").exists()]
    if missing:
        pytest.fail(f"ranks {missing} wrote no result\n{logs()}")
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]


def _stop(procs: list[subprocess.Popen], grace: float = 10) -> None:
    """SIGTERM to each still running process group, SIGKILL after ``grace`` seconds."""
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + grace
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()


def _one_host(out: Path) -> list[dict]:
    port = str(free_port())
    jobs = [(f"rank{r}", _worker(out), _env(RANK=str(r), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(r),
                                           LOCAL_WORLD_SIZE=str(WORLD), MASTER_ADDR="127.0.0.1", MASTER_PORT=port))
            for r in range(WORLD)]
    return _launch(jobs, out)


@pytest.fixture
def reference(made_once):
    """The same 4 ranks on one host (torchrun's variables, loopback): the bits to
    match. Made once per session (4 new Pythons), for every launcher's test."""
    results, _ = made_once("multihost_one_host", _one_host)
    assert [r["rank"] for r in results] == list(range(WORLD))
    assert len({r["params_sha256"] for r in results}) == 1, "ranks disagree on one host"
    return results


def _check(results: list[dict], reference: list[dict], hosts: TwoHosts, launcher: str) -> None:
    assert [r["rank"] for r in results] == list(range(WORLD))
    for r in results:
        assert (r["world"], r["dist_world"], r["dist_rank"]) == (WORLD, WORLD, r["rank"]), r
        assert r["launcher"] == launcher, r
        assert r["local_world"] in (None, PER_HOST), r
    by_host: dict[str, list[dict]] = {}
    for r in results:
        by_host.setdefault(r["host"], []).append(r)
    assert set(by_host) == {h.name for h in hosts.all}, f"ranks ran on {sorted(by_host)}"
    for host, rs in by_host.items():
        # Two consecutive ranks per host, local ranks 0 and 1 in rank order.
        ranks = sorted(r["rank"] for r in rs)
        assert ranks in ([0, 1], [2, 3]), f"{host} ran ranks {ranks}"
        assert [r["local_rank"] for r in sorted(rs, key=lambda r: r["rank"])] == [0, 1], rs
    assert {r["backend"] for r in results} == {reference[0]["backend"]}
    assert all(r["all_digests"] == [r["params_sha256"]] * WORLD for r in results), "ranks disagree"
    for r in results:
        ref = reference[r["rank"]]
        assert r["losses"] == ref["losses"], f"rank {r['rank']}: losses differ from one host"
        assert r["params_sha256"] == ref["params_sha256"], f"rank {r['rank']}: parameters differ from one host"
    assert results[0]["graphs_possible"] is False  # CPU: the eager engine trained


def _need(*programs: str) -> dict[str, str]:
    found = {p: shutil.which(p) for p in programs}
    missing = [p for p, path in found.items() if path is None]
    if missing:
        pytest.skip(f"{', '.join(missing)} not installed (tests/run-all.sh installs it)")
    return found  # type: ignore[return-value]


# ----------------------------------------------------------------- launchers
def test_torchrun_two_hosts(hosts, reference, tmp_path):
    """torchrun on each host, c10d rendezvous at host 1 (pygraph-launch's --nodes form)."""
    endpoint = f"{hosts.a.name}:29400"
    jobs = []
    for h in hosts.all:
        cmd = [sys.executable, "-m", "pygraph_dist.launch", "-n", str(PER_HOST), "--nodes", "2",
               "--rdzv-endpoint", endpoint, *_worker(tmp_path)[1:]]
        jobs.append((f"torchrun-{h.name}", h.cmd(*cmd), _env()))
    results = _launch(jobs, tmp_path)
    _check(results, reference, hosts, "torchrun")
    assert {r["variables"]["MASTER_ADDR"] for r in results} == {hosts.a.name}


def test_openmpi_two_hosts(hosts, reference, tmp_path):
    """Open MPI's mpirun on host 1 starts host 2's ranks through the agent (ssh's
    place); no MASTER_ADDR: rank 0 broadcasts its address through mpi4py."""
    progs = _need("mpirun")
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        pytest.skip("mpi4py not installed (setup builds it against Open MPI)")
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("".join(f"{h.name} slots={PER_HOST}\n" for h in hosts.all))
    cmd = [progs["mpirun"], "--allow-run-as-root", "-np", str(WORLD), "--hostfile", str(hostfile),
           "--map-by", "slot", "--bind-to", "none",
           "--mca", "plm_rsh_agent", str(hosts.agent),
           "--mca", "oob_tcp_if_include", hosts.subnet, "--mca", "btl_tcp_if_include", hosts.subnet,
           "-x", "PYTHONPATH", "-x", "OMP_NUM_THREADS", "-x", "PYTHONUNBUFFERED", "-x", "CUDA_VISIBLE_DEVICES",
           *_worker(tmp_path)]
    results = _launch([("mpirun", hosts.a.cmd(*cmd), _env())], tmp_path)
    _check(results, reference, hosts, "openmpi")
    assert all("MASTER_ADDR" not in r["variables"] for r in results)


def test_mpich_two_hosts(hosts, reference, tmp_path):
    """MPICH's mpiexec (hydra) on host 1, the agent as its ssh, mpi4py built against MPICH."""
    progs = _need("mpiexec.mpich")
    mpich_mpi4py = Path(sys.prefix) / "mpich-mpi4py"
    if not (mpich_mpi4py / "mpi4py").is_dir():
        pytest.skip(f"no mpi4py built against MPICH in {mpich_mpi4py} (tests/run-all.sh builds it: "
                    f"MPICC=mpicc.mpich pip install --no-binary mpi4py --target {mpich_mpi4py} mpi4py)")
    env = _env()
    env["PYTHONPATH"] = os.pathsep.join([str(mpich_mpi4py), env["PYTHONPATH"]])
    cmd = [progs["mpiexec.mpich"], "-n", str(WORLD), "-hosts", ",".join(f"{h.name}:{PER_HOST}" for h in hosts.all),
           "-launcher", "ssh", "-launcher-exec", str(hosts.agent), "-bind-to", "none",
           *_worker(tmp_path)]
    results = _launch([("mpiexec", hosts.a.cmd(*cmd), env)], tmp_path)
    _check(results, reference, hosts, "mpich")
    assert all("MASTER_ADDR" not in r["variables"] for r in results)


# ----------------------------------------------------------------- Slurm
_SLURM_CONF = """\
# A two-node cluster for the test: slurmctld and one slurmd on host 1, a slurmd on host 2.
ClusterName=pgdtest
SlurmctldHost={a.name}({a.addr})
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={d}/munge.socket
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool-%n
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd-%n.pid
SlurmctldLogFile={d}/slurmctld.log
SlurmdLogFile={d}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
KillWait=5
NodeName={a.name} NodeAddr={a.addr} CPUs={per_host} State=UNKNOWN
NodeName={b.name} NodeAddr={b.addr} CPUs={per_host} State=UNKNOWN
PartitionName=pgd Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""


@pytest.fixture(scope="module")
def slurm(hosts):
    """slurmctld + slurmd on host 1, slurmd on host 2, munge for authentication:
    returns the environment (SLURM_CONF) for srun on host 1."""
    progs = _need("munged", "slurmctld", "slurmd", "srun", "sinfo")
    d = hosts.dir / "slurm"
    (d / "state").mkdir(parents=True)
    for h in hosts.all:
        (d / f"spool-{h.name}").mkdir()
    d.chmod(0o700)  # munged refuses a socket directory others can write to
    key = d / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o600)
    conf = d / "slurm.conf"
    conf.write_text(_SLURM_CONF.format(a=hosts.a, b=hosts.b, d=d, per_host=PER_HOST))
    env = dict(_env(), SLURM_CONF=str(conf))
    procs: list[subprocess.Popen] = []

    def start(label: str, host: Host, *cmd: str) -> None:
        with open(d / f"{label}.out", "w") as f:
            procs.append(subprocess.Popen(host.daemon_cmd(*cmd), env=env, stdout=f, stderr=subprocess.STDOUT,
                                          start_new_session=True))

    def logs() -> str:
        return "\n".join(f"----- {p.name} -----\n{p.read_text()[-3000:]}"
                         for p in sorted(d.glob("*.out")) + sorted(d.glob("*.log")))

    try:
        start("munged", hosts.a, progs["munged"], "--foreground", "--force", f"--socket={d}/munge.socket",
              f"--key-file={key}", f"--pid-file={d}/munged.pid", f"--log-file={d}/munged.log",
              f"--seed-file={d}/munged.seed")
        deadline = time.monotonic() + 20
        while not (d / "munge.socket").exists():
            if time.monotonic() > deadline or procs[0].poll() is not None:
                pytest.fail(f"munged did not start\n{logs()}")
            time.sleep(0.2)
        start("slurmctld", hosts.a, progs["slurmctld"], "-D", "-i", "-f", str(conf))
        for h in hosts.all:
            start(f"slurmd-{h.name}", h, progs["slurmd"], "-D", "-f", str(conf), "-N", h.name)
        deadline = time.monotonic() + 60
        state = ""
        while True:
            info = subprocess.run(hosts.a.cmd(progs["sinfo"], "-h", "-N", "-o", "%N %T"), env=env,
                                  capture_output=True, text=True, timeout=30)
            state = info.stdout + info.stderr
            if info.returncode == 0 and sorted(state.split()) == sorted([hosts.a.name, hosts.b.name, "idle", "idle"]):
                break
            if time.monotonic() > deadline or any(proc.poll() is not None for proc in procs):
                pytest.fail(f"the Slurm cluster did not come up (sinfo: {state.strip()!r})\n{logs()}")
            time.sleep(0.5)
        yield env
    finally:
        _stop(procs)


def test_slurm_two_hosts(hosts, slurm, reference, tmp_path):
    """srun -N2 -n4 from host 1 (pygraph-launch's srun form); the master is the
    first host of SLURM_NODELIST, the port derived from the job id."""
    cmd = [sys.executable, "-m", "pygraph_dist.launch", "--launcher", "srun", "-n", str(WORLD), "--nodes", "2",
           *_worker(tmp_path)[1:]]
    results = _launch([("srun", hosts.a.cmd(*cmd), slurm)], tmp_path)
    _check(results, reference, hosts, "slurm")
    nodelists = {r["variables"].get("SLURM_JOB_NODELIST", r["variables"].get("SLURM_NODELIST")) for r in results}
    assert len(nodelists) == 1 and "MASTER_ADDR" not in results[0]["variables"], results[0]["variables"]
    assert first_slurm_host(nodelists.pop()) == hosts.a.name  # where init() found rank 0's store
