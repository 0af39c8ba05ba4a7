"""``pygraph-launch``: run a training script under torchrun, mpirun (Open MPI or
MPICH) or srun, with process placement that does not add host jitter.

    pygraph-launch -n 2 examples/train_mlp.py --steps 100            # torchrun
    pygraph-launch --launcher mpirun -n 2 examples/train_mlp.py      # Open MPI
    pygraph-launch --launcher mpich -n 2 examples/train_mlp.py       # MPICH / Intel MPI
    pygraph-launch --launcher srun -n 8 --nodes 2 train.py            # Slurm

Binding: Open MPI binds every rank to ONE core when np <= 2 (and to a socket
above that; mpirun(1), Open MPI 4.1). A rank's main thread, NCCL's proxy
thread, the PyTorch watchdog and data-loader workers then share one core,
which is exactly the host jitter graphs are meant to remove. This launcher
passes ``--bind-to none`` (or ``--bind-to numa`` with ``--bind numa``) to Open
MPI, ``-bind-to none`` to MPICH, and ``--cpu-bind=none`` (or ``cores`` with
``--cpus-per-rank``) to srun. ``--dry-run`` prints the command.

NVLink SHARP / multicast is switched off in the children's environment
(``NCCL_NVLS_ENABLE=0``, ``TORCH_SYMM_MEM_DISABLE_MULTICAST=1``,
``NVSHMEM_DISABLE_NVLS=1``) unless ``--allow-nvls`` is given: graph capture
gains nothing from it, and on shared hosts a failure there can take the GPUs
out of service.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import sys

NO_NVLS = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def build_command(args: argparse.Namespace) -> tuple[list[str], dict[str, str]]:
    """The launcher command line and the extra environment for the children."""
    env = {} if args.allow_nvls else dict(NO_NVLS)
    py = [args.python, args.script, *args.script_args]
    n = args.nproc
    if args.launcher == "torchrun":
        cmd = [args.python, "-m", "torch.distributed.run"]
        if args.nodes > 1:
            if not args.rdzv_endpoint:
                raise SystemExit("pygraph-launch: --nodes > 1 with torchrun needs --rdzv-endpoint HOST:PORT")
            cmd += ["--nnodes", str(args.nodes), "--rdzv-backend", "c10d", "--rdzv-endpoint", args.rdzv_endpoint]
        else:
            cmd += ["--standalone"]
        cmd += ["--nproc-per-node", str(n), args.script, *args.script_args]
        return cmd, env
    if args.launcher == "mpirun":
        cmd = [_require("mpirun"), "-np", str(n), "--bind-to", args.bind, "--map-by", "slot"]
        if os.geteuid() == 0:
            cmd.append("--allow-run-as-root")
        if args.oversubscribe:
            cmd.append("--oversubscribe")
        if open_mpi_needs_agent():
            # Open MPI refuses to start even on one host without ssh or rsh
            # ("plm_rsh_agent: ssh : rsh ... could not be found"); this launcher
            # starts ranks on this host only, which needs no remote shell.
            cmd += ["--mca", "plm_rsh_agent", "false"]
        for k in sorted(env) + ["PYTHONPATH", "MASTER_ADDR", "MASTER_PORT", "CUDA_VISIBLE_DEVICES"]:
            if k in env or k in os.environ:
                cmd += ["-x", k]
        return cmd + py, env
    if args.launcher == "mpich":
        cmd = [_require("mpiexec"), "-n", str(n), "-bind-to", "none" if args.bind == "none" else args.bind]
        for k, v in env.items():
            cmd += ["-genv", k, v]
        return cmd + py, env
    if args.launcher == "srun":
        cmd = [_require("srun"), "--ntasks", str(n), "--nodes", str(args.nodes)]
        if args.cpus_per_rank:
            cmd += ["--cpus-per-task", str(args.cpus_per_rank), "--cpu-bind=cores"]
        else:
            cmd += ["--cpu-bind=none"]
        cmd += ["--export=ALL"]
        return cmd + py, env
    raise SystemExit(f"pygraph-launch: unknown launcher {args.launcher!r}")


_AGENT_VARIABLES = ("OMPI_MCA_plm_rsh_agent", "OMPI_MCA_orte_rsh_agent", "PRTE_MCA_plm_ssh_agent")
_HOSTFILE_VARIABLES = ("OMPI_MCA_orte_default_hostfile", "OMPI_MCA_rmaps_default_hostfile", "PRTE_MCA_hostfile")


def _params_files() -> list[str]:
    """Open MPI's MCA parameter files: the user's, and the installation's."""
    files = [os.path.expanduser("~/.openmpi/mca-params.conf"), "/etc/openmpi/openmpi-mca-params.conf"]
    if os.environ.get("OPAL_PREFIX"):
        files.append(os.path.join(os.environ["OPAL_PREFIX"], "etc", "openmpi-mca-params.conf"))
    return files


def _configured_in_params_files(names: tuple[str, ...]) -> bool:
    for path in _params_files():
        try:
            with open(path) as f:
                if any(line.split("=", 1)[0].strip() in names for line in f if "=" in line
                       and not line.lstrip().startswith("#")):
                    return True
        except OSError:
            continue
    return False


def open_mpi_needs_agent() -> bool:
    """Neither ssh nor rsh on PATH, no launch agent chosen, and no hostfile
    configured (other hosts): Open MPI's rsh launcher then fails its start-up,
    also for ranks on this host only (and so does MPI_Init in a process that
    mpirun did not start, which starts its own daemon). Containers and minimal
    images often have no ssh client. An agent or hostfile set in the environment
    or in an MCA parameter file is left alone."""
    if shutil.which("ssh") is not None or shutil.which("rsh") is not None:
        return False
    if any(v in os.environ for v in _AGENT_VARIABLES + _HOSTFILE_VARIABLES):
        return False
    return not _configured_in_params_files(("plm_rsh_agent", "orte_rsh_agent", "orte_default_hostfile",
                                            "rmaps_default_hostfile"))


def _require(program: str) -> str:
    path = shutil.which(program)
    if path is None:
        raise SystemExit(f"pygraph-launch: {program} is not on PATH (install it, or pick another --launcher)")
    return path


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="pygraph-launch", description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Everything after the script is passed to it.",
    )
    p.add_argument("--launcher", choices=["torchrun", "mpirun", "mpich", "srun"], default="torchrun")
    p.add_argument("-n", "--nproc", type=int, default=None,
                   help="ranks in all (mpirun/mpich/srun) or per node (torchrun); default: GPUs on this host, else 2")
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--rdzv-endpoint", default=None, help="torchrun with several nodes: HOST:PORT")
    p.add_argument("--bind", choices=["none", "numa", "socket"], default="none",
                   help="Open MPI/MPICH process binding (default none; never one core per rank)")
    p.add_argument("--cpus-per-rank", type=int, default=0, help="srun: give each rank this many cores")
    p.add_argument("--oversubscribe", action="store_true", help="Open MPI: allow more ranks than cores")
    p.add_argument("--allow-nvls", action="store_true", help="do not switch NVLink multicast off")
    p.add_argument("--python", default=sys.executable)
    p.add_argument("--dry-run", action="store_true", help="print the command instead of running it")
    p.add_argument("script")
    p.add_argument("script_args", nargs=argparse.REMAINDER)
    args = p.parse_args(argv)
    if args.nproc is None:
        args.nproc = _default_nproc()
    return args


def _default_nproc() -> int:
    try:
        import torch

        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    except ImportError:
        n = 0
    return n if n > 0 else 2


def main(argv: list[str] | None = None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    cmd, env = build_command(args)
    if args.dry_run:
        prefix = " ".join(f"{k}={v}" for k, v in env.items())
        print((prefix + " " if prefix else "") + shlex.join(cmd))
        return 0
    child_env = dict(os.environ)
    child_env.update(env)
    os.execvpe(cmd[0], cmd, child_env)
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
