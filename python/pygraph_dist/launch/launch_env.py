"""Where am I? Rank, world size and rendezvous from whatever launched the job.

Resolution order (see ../shared/reference/jitter-scaling-mpi.md §3.5):

1. torchrun (``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/``MASTER_ADDR``/``MASTER_PORT``);
2. Open MPI (``OMPI_COMM_WORLD_*``);
3. MPICH / Intel MPI / Cray PALS (``PMI_RANK``, ``PMI_SIZE``, ``MPI_LOCALRANKID``);
4. Slurm (``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_LOCALID``, master from the node list);
5. nothing: a single process, said so in the log.

Launcher-specific variables win over Slurm's because ``mpirun`` or ``torchrun``
inside an allocation inherit the allocation's ``SLURM_*`` values, which then
describe the wrong thing (``SLURM_PROCID`` is 0 in every torchrun worker).
An incomplete or contradictory environment raises :class:`LaunchError` naming
the variable, never a silent rank-0-of-1 run.
"""

from __future__ import annotations

import datetime
import ipaddress
import logging
import os
import re
import socket
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..runtime import patches

logger = logging.getLogger("pygraph_dist")

DEFAULT_MASTER_PORT = 29500  # outside the ephemeral range; see mlperf-common PR #9
_DEFAULT_TIMEOUT = datetime.timedelta(minutes=10)
_last_timeout = _DEFAULT_TIMEOUT


def last_timeout_s() -> float:
    """The collective timeout given to the last init() (10 minutes by default)."""
    return _last_timeout.total_seconds()


class LaunchError(RuntimeError):
    """The launch environment is incomplete, contradictory or unreachable."""


@dataclass(frozen=True)
class LaunchEnvironment:
    launcher: str  # "torchrun", "openmpi", "mpich", "slurm" or "single"
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int | None
    master_addr: str | None
    master_port: int | None
    variables: Mapping[str, str] = field(default_factory=dict)  # what was read

    @property
    def single_host(self) -> bool:
        return self.local_world_size is not None and self.local_world_size == self.world_size


def _int(environ: Mapping[str, str], name: str) -> int:
    raw = environ[name]
    try:
        return int(raw)
    except ValueError:
        raise LaunchError(f"{name}={raw!r} is not an integer") from None


def _require(environ: Mapping[str, str], launcher: str, present: str, names: list[str]) -> None:
    missing = [n for n in names if n not in environ]
    if missing:
        raise LaunchError(
            f"{present} is set ({launcher} launch) but {', '.join(missing)} "
            f"{'is' if len(missing) == 1 else 'are'} not: set "
            f"{' and '.join(missing)}, or launch with `torchrun`, `mpirun` or `srun` "
            "(see launch/README.md or `pygraph-launch --help`)."
        )


def first_slurm_host(nodelist: str) -> str:
    """First host of a Slurm node list such as ``gpu[03-05,9],cpu1`` (-> ``gpu03``)."""
    nodelist = nodelist.strip()
    if not nodelist:
        raise LaunchError("SLURM_NODELIST is empty")
    m = re.match(r"([^,\[]+)(\[([^\]]+)\])?", nodelist)
    if m is None:
        raise LaunchError(f"cannot parse SLURM_NODELIST={nodelist!r}")
    prefix, bracket = m.group(1), m.group(3)
    if bracket is None:
        return prefix
    first = bracket.split(",")[0].split("-")[0]
    return prefix + first


def _slurm_port(environ: Mapping[str, str]) -> int:
    # Lightning's convention: derive the port from the job id so that two jobs
    # sharing a node do not race for one port.
    job = environ.get("SLURM_JOB_ID", "")
    if job.isdigit():
        return 15000 + int(job[-4:])
    return DEFAULT_MASTER_PORT


def detect(environ: Mapping[str, str] | None = None) -> LaunchEnvironment:
    """Read the launch environment without side effects."""
    env = dict(os.environ if environ is None else environ)
    torchrun_vars = ("RANK", "WORLD_SIZE", "LOCAL_RANK")

    if any(v in env for v in torchrun_vars):
        present = next(v for v in torchrun_vars if v in env)
        _require(env, "torchrun-style", present, list(torchrun_vars))
        rank, world = _int(env, "RANK"), _int(env, "WORLD_SIZE")
        _check_against_mpi(env, rank, world)
        launcher = "torchrun" if "TORCHELASTIC_RUN_ID" in env else "env"
        if world > 1:
            _require(env, launcher, present, ["MASTER_ADDR", "MASTER_PORT"])
        result = LaunchEnvironment(
            launcher=launcher,
            rank=rank,
            world_size=world,
            local_rank=_int(env, "LOCAL_RANK"),
            local_world_size=_int(env, "LOCAL_WORLD_SIZE") if "LOCAL_WORLD_SIZE" in env else None,
            master_addr=env.get("MASTER_ADDR"),
            master_port=_int(env, "MASTER_PORT") if "MASTER_PORT" in env else None,
            variables={k: env[k] for k in (*torchrun_vars, "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k in env},
        )
    elif "OMPI_COMM_WORLD_RANK" in env or "OMPI_COMM_WORLD_SIZE" in env:
        names = ["OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"]
        _require(env, "Open MPI", next(n for n in names if n in env), names)
        result = LaunchEnvironment(
            launcher="openmpi",
            rank=_int(env, names[0]),
            world_size=_int(env, names[1]),
            local_rank=_int(env, names[2]),
            local_world_size=_int(env, "OMPI_COMM_WORLD_LOCAL_SIZE")
            if "OMPI_COMM_WORLD_LOCAL_SIZE" in env
            else None,
            master_addr=env.get("MASTER_ADDR"),
            master_port=_int(env, "MASTER_PORT") if "MASTER_PORT" in env else None,
            variables={k: env[k] for k in (*names, "OMPI_COMM_WORLD_LOCAL_SIZE", "MASTER_ADDR", "MASTER_PORT") if k in env},
        )
    elif "PMI_RANK" in env or "PMI_SIZE" in env:
        _require(env, "MPICH/Intel MPI", "PMI_RANK" if "PMI_RANK" in env else "PMI_SIZE", ["PMI_RANK", "PMI_SIZE"])
        local_var = next(
            (v for v in ("MPI_LOCALRANKID", "PALS_LOCAL_RANKID", "PMI_LOCAL_RANK") if v in env), None
        )
        if local_var is None:
            raise LaunchError(
                "PMI_RANK is set (MPICH/Intel MPI launch) but none of MPI_LOCALRANKID, "
                "PALS_LOCAL_RANKID or PMI_LOCAL_RANK is: the local rank (GPU index on this "
                "host) is unknown. Launch with mpiexec from MPICH/Intel MPI, or export LOCAL_RANK."
            )
        result = LaunchEnvironment(
            launcher="mpich",
            rank=_int(env, "PMI_RANK"),
            world_size=_int(env, "PMI_SIZE"),
            local_rank=_int(env, local_var),
            local_world_size=_int(env, "MPI_LOCALNRANKS") if "MPI_LOCALNRANKS" in env else None,
            master_addr=env.get("MASTER_ADDR"),
            master_port=_int(env, "MASTER_PORT") if "MASTER_PORT" in env else None,
            variables={k: env[k] for k in ("PMI_RANK", "PMI_SIZE", local_var, "MPI_LOCALNRANKS", "MASTER_ADDR", "MASTER_PORT") if k in env},
        )
    elif "SLURM_PROCID" in env:
        names = ["SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"]
        _require(env, "Slurm", "SLURM_PROCID", names)
        if "MASTER_ADDR" in env:
            addr = env["MASTER_ADDR"]
        else:
            nodelist = env.get("SLURM_JOB_NODELIST", env.get("SLURM_NODELIST"))
            if nodelist is None:
                raise LaunchError(
                    "SLURM_PROCID is set but neither MASTER_ADDR nor SLURM_NODELIST is: "
                    "cannot find rank 0's host. Export MASTER_ADDR."
                )
            addr = first_slurm_host(nodelist)
        result = LaunchEnvironment(
            launcher="slurm",
            rank=_int(env, names[0]),
            world_size=_int(env, names[1]),
            local_rank=_int(env, names[2]),
            local_world_size=None,
            master_addr=addr,
            master_port=_int(env, "MASTER_PORT") if "MASTER_PORT" in env else _slurm_port(env),
            variables={k: env[k] for k in (*names, "SLURM_NODELIST", "SLURM_JOB_NODELIST", "SLURM_JOB_ID", "MASTER_ADDR", "MASTER_PORT") if k in env},
        )
    else:
        result = LaunchEnvironment("single", 0, 1, 0, 1, env.get("MASTER_ADDR"), None, {})

    _validate(result)
    return result


def _check_against_mpi(env: Mapping[str, str], rank: int, world: int) -> None:
    """torchrun variables and MPI variables in one process must agree."""
    for rank_var, size_var in (("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"), ("PMI_RANK", "PMI_SIZE")):
        if rank_var in env and size_var in env:
            other_rank, other_world = _int(env, rank_var), _int(env, size_var)
            if (other_rank, other_world) != (rank, world):
                raise LaunchError(
                    f"RANK={rank} WORLD_SIZE={world} disagree with {rank_var}={other_rank} "
                    f"{size_var}={other_world}: two launchers are stacked. Launch with one of "
                    "torchrun or mpirun, not both."
                )


def _validate(e: LaunchEnvironment) -> None:
    if e.world_size < 1:
        raise LaunchError(f"world size must be >= 1, got {e.world_size} (from {dict(e.variables)})")
    if not 0 <= e.rank < e.world_size:
        raise LaunchError(f"rank {e.rank} is outside [0, {e.world_size}) (from {dict(e.variables)})")
    if e.local_rank < 0:
        raise LaunchError(f"local rank {e.local_rank} is negative (from {dict(e.variables)})")
    if e.local_world_size is not None and not 0 <= e.local_rank < e.local_world_size:
        raise LaunchError(
            f"local rank {e.local_rank} is outside [0, {e.local_world_size}) (from {dict(e.variables)})"
        )


# ---------------------------------------------------------------------------
# MPI bootstrap: only used when an MPI launcher gave no MASTER_ADDR.


def _mpi_comm(e: LaunchEnvironment):
    """COMM_WORLD from mpi4py, checked against the launcher's view of the world."""
    from .cli import open_mpi_needs_agent

    set_agent = "mpi4py.MPI" not in sys.modules and open_mpi_needs_agent()
    # An Open MPI mpi4py in a process its mpirun did not start (an MPICH
    # launch) initialises as a singleton, which starts a daemon and fails
    # without ssh/rsh -- an abort instead of the error below. Nothing here
    # can reach another host without them anyway. Only for MPI_Init.
    with patches.open_mpi_without_agent(set_agent):
        from mpi4py import MPI  # lazy: MPI_Init at import, so only when needed

    comm = MPI.COMM_WORLD
    if comm.Get_size() != e.world_size or comm.Get_rank() != e.rank:
        raise LaunchError(
            f"mpi4py sees rank {comm.Get_rank()} of {comm.Get_size()}, but the launcher "
            f"({e.launcher}: {dict(e.variables)}) says rank {e.rank} of {e.world_size}. "
            f"mpi4py is linked to a different MPI than the launcher "
            f"(mpi4py uses: {MPI.Get_library_version().splitlines()[0].strip()}). "
            "Rebuild mpi4py against the launcher's MPI (`MPICC=<launcher's mpicc> pip install "
            "--no-binary mpi4py --force-reinstall mpi4py`), or export MASTER_ADDR and "
            "MASTER_PORT so that mpi4py is not needed."
        )
    return comm


def _own_address() -> str:
    """An address of this host that other hosts can reach (never loopback if avoidable)."""
    try:
        addr = socket.gethostbyname(socket.gethostname())
        if not ipaddress.ip_address(addr).is_loopback:
            return addr
    except OSError:
        pass
    # Debian-style /etc/hosts maps the hostname to 127.0.1.1: ask the routing
    # table which source address an outbound packet would use instead.
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))
            return s.getsockname()[0]
        except OSError:
            return "127.0.0.1"


def resolve_rendezvous(e: LaunchEnvironment) -> tuple[str, int]:
    """MASTER_ADDR/MASTER_PORT for this job, bootstrapping through MPI if needed."""
    port = e.master_port or DEFAULT_MASTER_PORT
    if e.master_addr:
        if e.launcher in ("openmpi", "mpich"):
            _check_mpi_if_present(e)
        return e.master_addr, port
    if e.world_size == 1:
        return "127.0.0.1", port if e.master_port else _free_port()
    if e.launcher in ("openmpi", "mpich"):
        try:
            comm = _mpi_comm(e)
        except ImportError:
            if e.single_host:
                return "127.0.0.1", port
            raise LaunchError(
                f"MASTER_ADDR is not set and mpi4py is not installed ({e.launcher} launch across "
                "hosts): export MASTER_ADDR=<rank 0's host> and MASTER_PORT, or "
                "`pip install mpi4py` built against the launcher's MPI."
            ) from None
        addr = comm.bcast(_own_address() if e.rank == 0 else None, root=0)
        return addr, port
    raise LaunchError(f"MASTER_ADDR is not set ({e.launcher} launch with world size {e.world_size})")


def _check_mpi_if_present(e: LaunchEnvironment) -> None:
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return
    _mpi_comm(e)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------------


def _pick_device(e: LaunchEnvironment) -> torch.device | None:
    if not torch.cuda.is_available():
        return None
    count = torch.cuda.device_count()
    index = 0 if count == 1 else e.local_rank
    if index >= count:
        raise LaunchError(
            f"local rank {e.local_rank} has no GPU: only {count} CUDA device(s) are visible on "
            "this host. Launch at most that many ranks per host (torchrun --nproc-per-node, "
            "mpirun -npernode) or set CUDA_VISIBLE_DEVICES per rank."
        )
    return torch.device("cuda", index)


def _import_dynamo_first() -> None:
    """Import torch._dynamo before the default process group exists.

    The first optimizer (or torch.compile) imports it lazily; imported after
    init_process_group it keeps references to the default group (10, torch
    2.13 and 2.14), so destroy_process_group() -- and shutdown() -- no longer
    destroy the group: its Gloo worker threads live on into interpreter exit,
    and one still dropping a finished Work's tensors then takes the GIL and
    aborts the process ("terminate called without an active exception", seen
    in test_slurm_two_hosts after all_gather_object). Imported first, it holds
    none. Costs nothing overall: every training loop creates an optimizer."""
    try:
        import torch._dynamo  # noqa: F401
    except Exception:  # noqa: BLE001 - only a mitigation; a broken dynamo must not stop init()
        logger.debug("torch._dynamo could not be imported", exc_info=True)


def init(
    backend: str = "auto",
    *,
    timeout: datetime.timedelta = _DEFAULT_TIMEOUT,
    rendezvous_timeout: datetime.timedelta = datetime.timedelta(seconds=120),
    environ: Mapping[str, str] | None = None,
) -> LaunchEnvironment:
    """Initialise the default process group from the launch environment.

    ``backend="auto"`` picks the graph-safe NCCL wrapper (``cuda:pgd_nccl``,
    with Gloo for CPU tensors) when CUDA is available, and the Gloo wrapper
    (``cpu:pgd_gloo``) otherwise; ``"nccl"``/``"gloo"`` select torch's stock
    backends. The CUDA device is set from the local rank. ``rendezvous_timeout``
    bounds how long a rank waits for rank 0's store, so an unreachable
    MASTER_ADDR ends in a :class:`LaunchError` rather than a 30-minute hang;
    ``timeout`` is the collective timeout of the process group.
    """
    from . import backend as _backend

    e = detect(environ)
    if dist.is_initialized():
        if dist.get_world_size() != e.world_size or dist.get_rank() != e.rank:
            raise LaunchError(
                f"torch.distributed is already initialised as rank {dist.get_rank()} of "
                f"{dist.get_world_size()}, but the environment says {e.rank} of {e.world_size}"
            )
        return e
    if e.launcher == "single":
        logger.info("no launcher environment found: running as a single process (rank 0 of 1)")

    device = _pick_device(e)
    if device is not None:
        torch.cuda.set_device(device)

    addr, port = resolve_rendezvous(e)
    env = os.environ if environ is None else environ
    # torchrun's agent already serves the store at MASTER_PORT; workers join it
    # as clients (what torch's env:// rendezvous does).
    agent_store = env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    try:
        # multi_tenant like torch's own env:// rendezvous: the server is shared
        # per process and outlives the Python object. A private server torn
        # down during interpreter exit occasionally aborted the process
        # ("terminate called without an active exception") on torch 2.13.
        store = dist.TCPStore(
            addr, port, e.world_size, is_master=e.rank == 0 and not agent_store,
            timeout=rendezvous_timeout, wait_for_workers=True, multi_tenant=True,
        )
    except (RuntimeError, OSError) as exc:  # DistNetworkError, DistStoreError, gaierror
        raise LaunchError(
            f"rank {e.rank} could not rendezvous at MASTER_ADDR={addr} MASTER_PORT={port} within "
            f"{rendezvous_timeout.total_seconds():.0f} s ({type(exc).__name__}: {exc}). Check that "
            "rank 0 is running, that the address resolves and is reachable from this host, and "
            "that the port is free on rank 0's host."
        ) from exc

    global _last_timeout
    _last_timeout = timeout
    chosen = _backend.resolve(backend, cuda=device is not None)
    _import_dynamo_first()
    dist.init_process_group(
        backend=chosen, store=store, rank=e.rank, world_size=e.world_size, timeout=timeout
    )
    if chosen.startswith("cpu:gloo,cuda:pgd"):
        # torch matches plugin names case-sensitively when it picks the default
        # backend type of a multi-backend group and misses ours; without a default
        # type, destroy_process_group warns "No backend of type 0 found".
        patches.set_default_backend_custom(dist.group.WORLD)
    logger.info(
        "initialised rank %d/%d (local %d) via %s, backend %s, device %s",
        e.rank, e.world_size, e.local_rank, e.launcher, chosen, device or "cpu",
    )
    return e
