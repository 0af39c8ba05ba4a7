"""Ranks for the fault tests (test_faults_*.py), run as separate processes.

    python tests/python/faults_workers.py <case> --out DIR [options]

GPU case ``train`` trains a small MLP through ``pgd.wrap(..., replay_timeout=T)``
on NCCL; rank ``--fault-rank`` injects ``--fault`` at ``--fault-step``:

  kill    SIGKILL itself
  stop    SIGSTOP itself (frozen: alive to the OS, silent to everyone)
  leave   leave the training loop and sleep (alive, its watchdog still beating)
  raise   raise an exception (exits 1 through the normal error path)
  none    no fault

The other ranks train on (up to ``--steps``): they must be ended by the replay
watchdog (exit 70) or, with ``--graphs 0``, by NCCL's own timeout. Each rank
writes DIR/rank<R>.json at start (pid) and, for the faulty rank, the wall time
of the fault just before injecting it.

CPU cases exercise the native watchdog without CUDA (host replays).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
from torch import nn


def _write(out: str, who: int, **fields) -> None:
    path = Path(out, f"rank{who}.json")
    data = json.loads(path.read_text()) if path.exists() else {}
    data.update(fields)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data))
    tmp.replace(path)


# ----------------------------------------------------------------- GPU
class MLP(nn.Module):
    def __init__(self, width: int = 256, depth: int = 4, classes: int = 10) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        for _ in range(depth):
            layers += [nn.Linear(width, width), nn.GELU()]
        self.body = nn.Sequential(*layers)
        self.head = nn.Linear(width, classes)

    def forward(self, x, y):
        return nn.functional.cross_entropy(self.head(self.body(x)), y)


def train(args) -> None:
    import pygraph_dist as pgd

    pgd.init(timeout=datetime.timedelta(seconds=args.nccl_timeout))
    import torch.distributed as dist

    rank = dist.get_rank()
    _write(args.out, rank, pid=os.getpid(), rank=rank, started=time.time())
    # CPU only to smoke-test the fault harness itself; the tests need CUDA.
    dev = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    torch.manual_seed(0)
    base = MLP().to(dev)
    opt = torch.optim.AdamW(base.parameters(), lr=1e-3)
    # select=False: keep the graph whatever the timings, so that the fault
    # always meets a replayed iteration (graphs=0 trains eagerly instead).
    model, opt = pgd.wrap(base, opt, replay_timeout=args.replay_timeout, graphs=bool(args.graphs),
                          select=False)
    if args.python_watchdog:
        # Diagnostics: the Python-thread watchdog alongside the native one,
        # with a shorter timeout. If it fires first, Python could run; if the
        # native one fires, its stack dump shows where each thread was.
        from pygraph_dist.launch.watchdog import ReplayWatchdog

        py_wd = ReplayWatchdog(args.python_watchdog, native=False, every=1)
        native_after = model.engine.watchdog.after_replay

        def both(label, *a, **kw):
            native_after(label, *a, **kw)
            py_wd.after_replay(label)

        model.engine.watchdog.after_replay = both
    g = torch.Generator(device=dev).manual_seed(rank)
    x = torch.randn(64, 256, device=dev, generator=g)
    y = torch.randint(0, 10, (64,), device=dev, generator=g)
    faulty = rank == args.fault_rank and args.fault != "none"
    for step in range(args.steps):
        if faulty and step == args.fault_step:
            _write(args.out, rank, fault=args.fault, fault_time=time.time(), fault_step=step)
            print(f"faults_workers: rank {rank} injects '{args.fault}' at step {step}", flush=True)
            if args.fault == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            elif args.fault == "stop":
                os.kill(os.getpid(), signal.SIGSTOP)
            elif args.fault == "leave":
                time.sleep(args.leave_sleep)
                return
            elif args.fault == "raise":
                raise RuntimeError(f"faults_workers: rank {rank} raises at step {step}")
        opt.zero_grad(set_to_none=True)
        loss = model(x, y)
        loss.backward()
        opt.step()
        # Progress lines sync the host (.item()); none after the fault step, so
        # that the survivor keeps launching until the launch queue is full, as
        # in the hang seen on 2xH200 (main thread blocked inside a launch).
        if step % 50 == 0 and step < args.fault_step:
            replays = pgd.report().models[0].replays if args.graphs else 0
            print(f"faults_workers: rank {rank} step {step} loss {loss.detach().item():.4f} replays {replays}",
                  flush=True)
    _write(args.out, rank, finished=True)
    pgd.shutdown()


# ----------------------------------------------------------------- CPU
def native_gil_held(args) -> None:
    """A pending host replay that never completes, while the main thread blocks
    with the GIL held: the native watchdog must still fire, report, dump the
    Python stacks and exit with code 70."""
    from pygraph_dist.runtime._ext import C

    wd = C.ReplayWatchdog(args.replay_timeout, context="rank 0 of 1 (gil test)")
    wd.arm_host("[(64, 256) float32] at iteration 212", "all_reduce float32 x 68362")
    _write(args.out, 0, armed_at=time.time(), pid=os.getpid())
    print("faults_workers: blocking with the GIL held", flush=True)
    C._hold_gil_for_test(120.0)
    print("faults_workers: NOT REACHED", flush=True)


def _interrupt_watchdog(args, group):
    """The interrupt cases' start: the wakeup fd (as the first wrap() installs
    it), an engine-like native watchdog given ``group``, one host replay armed
    before the signal. Returns the Python watchdog and its native one."""
    from pygraph_dist.launch import lifetime
    from pygraph_dist.launch.watchdog import ReplayWatchdog

    lifetime.install()
    wd = ReplayWatchdog(args.replay_timeout, native=True, store=None, poll_s=0.05, interrupt_group=group)
    native = wd._ensure_native()
    native.arm_host("[(16, 64) float32] step at iteration 9", "allreduce Float x4688")
    return wd, native


def native_interrupted(args) -> None:
    """Ctrl-C while a host replay waits (armed before it) and the main thread is
    blocked with the GIL held, as in float(loss) waiting for a peer's collective:
    the engine's watchdog (interrupt_group, the signal through lifetime's
    wakeup fd) aborts the group, then Python raises the KeyboardInterrupt when
    the block returns, and a replay after that raises. ``--fault close``: the
    replay completes after the interrupt and the next, armed after it, waits:
    the script handled the Ctrl-C and trains on, so nothing is aborted."""
    import torch.distributed as dist

    from pygraph_dist.runtime._ext import C

    dist.init_process_group("gloo", init_method=f"file://{Path(args.out, 'store')}", rank=0, world_size=1)
    wd, native = _interrupt_watchdog(args, dist.group.WORLD)
    handled = args.fault == "close"
    if handled:  # the script's own handler: it stops at the next checkpoint, say
        signal.signal(signal.SIGINT, lambda *a: _write(args.out, 0, handler_ran=True))
    _write(args.out, 0, pid=os.getpid())
    print("faults_workers: waiting for the signal", flush=True)
    if handled:
        deadline = time.monotonic() + 30
        while not C.interrupted_at() and time.monotonic() < deadline:
            time.sleep(0.01)
        native.complete_host()
        time.sleep(0.3)
        native.arm_host("after", "")  # a slow step, armed after the interrupt
        time.sleep(args.leave_sleep)
        _write(args.out, 0, aborted=native.interrupt_aborted, pending=native.pending)
        return
    start = time.monotonic()
    try:
        C._hold_gil_for_test(args.leave_sleep)  # the main thread stuck in a CUDA call when the signal comes
    except KeyboardInterrupt:
        pass
    else:  # raised on the next bytecode after the block, or never
        try:
            time.sleep(0.5)
        except KeyboardInterrupt:
            pass
    try:
        wd.fused()
        replay_raises = ""
    except RuntimeError as e:
        replay_raises = str(e)
    _write(args.out, 0, aborted=native.interrupt_aborted, blocked_s=time.monotonic() - start,
           interrupted=C.interrupted_at() > 0, replay_raises=replay_raises)


def native_interrupted_slow_abort(args) -> None:
    """Ctrl-C while a host replay armed before it waits, the group's abort never
    returning, as ncclCommAbort waits for the graphs that captured its
    communicator. ``--fault leave``: the abort first frees the replay (its
    kernels saw the abort flag) -- a success, the process goes on. ``--fault
    stop``: it frees nothing -- the watchdog ends the process with status 1."""
    import threading

    import torch.distributed as dist

    frees = args.fault == "leave"

    class NcclLikeAbort(dist.ProcessGroup):
        def __init__(self) -> None:
            super().__init__(0, 1)

        def abort(self) -> None:
            if frees:
                native.complete_host()
            threading.Event().wait()  # until the graphs are gone: never, here

    _, native = _interrupt_watchdog(args, NcclLikeAbort())
    signal.signal(signal.SIGINT, lambda *a: None)  # the main thread sleeps on, GIL released
    _write(args.out, 0, pid=os.getpid())
    print("faults_workers: waiting for the signal", flush=True)
    time.sleep(args.leave_sleep)
    _write(args.out, 0, aborted=native.interrupt_aborted, pending=native.pending)


def native_completes(args) -> None:
    """Host replays armed and completed for a while: the watchdog must not fire,
    and close() must return promptly."""
    from pygraph_dist.runtime._ext import C

    wd = C.ReplayWatchdog(args.replay_timeout, poll_s=0.02)
    t_end = time.monotonic() + 3 * args.replay_timeout
    while time.monotonic() < t_end:
        wd.arm_host("ok", "")
        time.sleep(0.01)
        wd.complete_host()
    deadline = time.monotonic() + 2 * args.replay_timeout
    while wd.pending and time.monotonic() < deadline:
        time.sleep(0.02)
    t0 = time.monotonic()
    wd.close()
    _write(args.out, 0, armed=wd.armed, completed=wd.completed, pending=wd.pending,
           close_s=time.monotonic() - t0)


def native_heartbeats(args) -> None:
    """Two ranks sharing a TCPStore. Rank 0 arms a host replay that never
    completes; rank 1 starts its watchdog, then does ``--fault``: kill (dies
    without a word), close (closes its watchdog), alive (keeps beating)."""
    rank = int(os.environ["RANK"])
    from pygraph_dist.runtime._ext import C

    store = torch.distributed.TCPStore("127.0.0.1", int(os.environ["MASTER_PORT"]), 2, rank == 0,
                                       timeout=datetime.timedelta(seconds=30))
    wd = C.ReplayWatchdog(args.replay_timeout, store=store, rank=rank, world_size=2, heartbeat_s=0.5)
    _write(args.out, rank, pid=os.getpid())
    store.set(f"test/ready/{rank}", "1")
    store.wait([f"test/ready/{1 - rank}"])
    if rank == 1:
        wd.arm_host("r", "")
        wd.complete_host()
        time.sleep(1.5)  # a few heartbeats
        if args.fault == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if args.fault == "close":
            wd.close()
        time.sleep(3 * args.replay_timeout)  # rank 0's watchdog ends the test
        return
    time.sleep(1.5)
    wd.arm_host("[x] at iteration 9", "all_reduce float32 x 10")
    time.sleep(3 * args.replay_timeout)
    print("faults_workers: NOT REACHED", flush=True)


def _stash_obj_in_tls(key: str, obj) -> None:
    """torch._C._stash_obj_in_tls that owns a reference to ``obj``. torch 2.11's
    steals the caller's (it wraps the pointer in a SafePyObject without an
    incref; later versions incref), so the map's release would free an object
    still in use: give it a reference of its own there."""
    import ctypes
    import sys as _sys

    before = _sys.getrefcount(obj)
    torch._C._stash_obj_in_tls(key, obj)
    if _sys.getrefcount(obj) == before:
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(obj))


def mode_capture(args) -> None:
    """Does the Work of an async all-reduce issued under a TorchFunctionMode
    hold that mode (in its captured thread-local state)? ``--backend`` picks
    the wrapped Gloo (``pgd``) or torch's stock one (``gloo``); ``--collectives``
    issues them through torch.distributed (``dist``) or through
    pygraph_dist.launch.collectives (``pgd``), as pygraph_dist issues its own."""
    import sys as _sys

    from torch.overrides import TorchFunctionMode

    import pygraph_dist as pgd

    pgd.init(backend="auto" if args.backend == "pgd" else "gloo")
    import torch.distributed as dist

    if args.collectives == "pgd":
        from pygraph_dist.launch import collectives as coll

        def all_reduce(t, async_op):
            return coll.all_reduce(t, async_op=async_op)

        def all_gather(outs, t, async_op):
            return coll.all_gather(outs, t, async_op=async_op)
    else:
        def all_reduce(t, async_op):
            return dist.all_reduce(t, async_op=async_op)

        def all_gather(outs, t, async_op):
            return dist.all_gather(outs, t, async_op=async_op)

    class Watching(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    t = torch.ones(1000)
    # 1. A TorchFunctionMode on the stack (pygraph_dist's LoopMonitor is, during backward).
    mode = Watching()
    base = _sys.getrefcount(mode)
    with mode:
        work = all_reduce(t, async_op=True)
    held_mode = _sys.getrefcount(mode) - base  # the Work is alive: what it captured is too
    work.wait()
    del work
    # 2. A Python object in C++ thread-local storage, as torch's backward stashes
    # contextvars.copy_context() there (torch/autograd/graph.py, _engine_run_backward).
    obj = object()
    base = _sys.getrefcount(obj)
    _stash_obj_in_tls("pgd-test", obj)
    work = all_reduce(t, async_op=True)
    if hasattr(torch._C, "_remove_obj_from_tls"):
        torch._C._remove_obj_from_tls("pgd-test")
    else:  # torch 2.11 has no remove: overwriting drops the map's reference to obj
        _stash_obj_in_tls("pgd-test", None)
    held_tls = _sys.getrefcount(obj) - base
    work.wait()
    del work
    # 3. The collective's own tensors. Where a C++ reference to a tensor keeps
    # its Python object alive (torch 2.13: ``tracks`` is 1), a Work holding the
    # caller's tensor makes the Gloo thread that drops it take the GIL.
    probe = torch.ones(4)
    base = _sys.getrefcount(probe)
    view = probe.view(-1)  # a C++ reference (the view's base)
    tracks = _sys.getrefcount(probe) - base
    del view
    rank, ws = dist.get_rank(), dist.get_world_size()
    # A stock Gloo Work drops the tensors when it completes, which can be before
    # they are counted (the control failed so on the 2-core CI machine): the
    # most any of 5 rounds saw held. For pygraph_dist's backend every round must see 0.
    held_tensor, values_ok = 0, True
    for _ in range(5):
        x = torch.full((1000,), float(rank + 1))
        outs = [torch.zeros(1000) for _ in range(ws)]
        work = all_reduce(x, async_op=True)
        gather = all_gather(outs, torch.full((1000,), float(rank)), async_op=True)
        in_flight = [_sys.getrefcount(t) for t in [x, *outs]]
        work.wait()
        gather.wait()
        del work, gather
        # What the Works held: the counts with them alive, less the counts without.
        after = [_sys.getrefcount(t) for t in [x, *outs]]
        held_tensor = max(held_tensor, *(a - b for a, b in zip(in_flight, after)))
        values_ok = values_ok and bool((x == ws * (ws + 1) / 2).all()) and all(
            bool((o == r).all()) for r, o in enumerate(outs))
    _write(args.out, rank, held_mode=held_mode, held_tls=held_tls, backend=dist.get_backend(),
           tracks=tracks, held_tensor=held_tensor, values_ok=values_ok,
           gather_versions=[o._version for o in outs], input_version=x._version)
    dist.destroy_process_group()


def shutdown_joins(args) -> None:
    """After wrap(), training and shutdown(), how many Gloo worker threads are
    left? Every one left runs on into interpreter exit (issue 13)."""
    import pygraph_dist as pgd

    pgd.init(backend="auto" if args.backend == "pgd" else "gloo")
    import torch.distributed as dist

    torch.manual_seed(0)
    model = MLP(width=16, depth=1)
    # The optimizer is created after init, as in every training script: its
    # first creation imports torch._dynamo.
    model, opt = pgd.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    for _ in range(2):
        opt.zero_grad(set_to_none=True)
        model(torch.randn(8, 16), torch.randint(0, 10, (8,))).backward()
        opt.step()
    rank = dist.get_rank()
    pgd.shutdown()

    def gloo_threads() -> int:
        n = 0
        for tid in os.listdir("/proc/self/task"):
            try:
                n += Path(f"/proc/self/task/{tid}/comm").read_text().startswith("pt_gloo")
            except OSError:
                pass
        return n

    _write(args.out, rank, gloo_threads=gloo_threads())


CASES = {f.__name__: f for f in (train, native_gil_held, native_interrupted, native_interrupted_slow_abort,
                                 native_completes, native_heartbeats,
                                 mode_capture, shutdown_joins)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("case", choices=sorted(CASES))
    ap.add_argument("--out", required=True)
    ap.add_argument("--fault", default="none", choices=["none", "kill", "stop", "leave", "raise", "close",
                                                        "alive"])
    ap.add_argument("--fault-rank", type=int, default=1)
    ap.add_argument("--fault-step", type=int, default=200)
    ap.add_argument("--steps", type=int, default=100_000)
    ap.add_argument("--replay-timeout", type=float, default=10.0)
    ap.add_argument("--nccl-timeout", type=float, default=600.0)
    ap.add_argument("--graphs", type=int, default=1)
    ap.add_argument("--leave-sleep", type=float, default=120.0)
    ap.add_argument("--python-watchdog", type=float, default=0.0)
    ap.add_argument("--backend", default="pgd", choices=["pgd", "gloo"])
    ap.add_argument("--collectives", default="dist", choices=["dist", "pgd"])
    args = ap.parse_args()
    CASES[args.case](args)


if __name__ == "__main__":
    sys.exit(main())
