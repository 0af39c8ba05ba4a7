"""Scaling, loop, floor and jitter benchmark.

Side by side, in one invocation, on the same models, data and process group.

Modes (what trains the model; all AdamW(lr=1e-4), fused on CUDA, bf16 autocast):

  ddp          eager torch DDP
  ddp_bf16     eager DDP with the bf16 gradient compression hook
               (torch.distributed.algorithms.ddp_comm_hooks.default_hooks.bf16_compress_hook)
  ddp_graph    the hand-written whole-iteration recipe of PyTorch's CUDA notes:
               DDP built on a side stream, 11 eager warm-ups, AdamW(fused,
               capturable), the loop's iteration captured with torch.cuda.graph
  compile      torch.compile(DDP(model), mode="reduce-overhead")
  pgd          pygraph_dist.wrap(model, AdamW, amp="bf16")
  pgd_bf16     pygraph_dist.wrap(..., grad_comm_dtype=torch.bfloat16): bf16 all-reduce
  pgd_compile  pygraph_dist.wrap(model, ..., compile=True): default compile mode (no
               cudagraphs of its own); compilation happens in the first steps, so
               its time is in the setup column

Loops (how the user's loop is written; each (workload, mode, loop) is a row):

  inside       loss = model(*batch); loss.backward(); opt.step()  (the module returns the loss)
  outside      out = model(*inputs); loss = loss_fn(out, target) in the loop
  accum4       4 micro-batches of per-GPU batch / 4 each (samples per step unchanged):
               loss = model(*micro) / 4; loss.backward() 4 times, the first 3 inside
               model.no_sync(); then opt.step()
  accum4_sync  the same without no_sync(): DDP all-reduces every micro-batch; pgd
               learns the 4 in the first step and all-reduces the last one only
  clip         inside + torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
               between backward and step

  Every loop calls the mode's model and optimizer the way a user would; nothing
  is special-cased per mode except the autocast region, which pgd modes leave to
  wrap(amp="bf16") as its users do. ddp_graph captures inside/outside/clip only
  (no_sync inside a capture is not part of PyTorch's recipe); a model without
  no_sync() (pgd before it has one) and wrap() without grad_comm_dtype are
  recorded as status "unsupported"; a mode that raises is recorded as status
  "error" with the exception text, and the run goes on with the next row.

Conditions (all with per-rank seeds):

  baseline   no noise, no host sync inside the timed loop
  sync1      loss.item() every iteration
  sync10     loss.item() every 10 iterations (realistic logging)
  jitter     sync10 plus, each iteration with probability 0.05, a host-side
             sleep of 5 ms before the iteration starts (rank-local noise)
  pinned     every thread of every rank pinned (os.sched_setaffinity) to the
             --noisy-cores last cores the rank may use, no other load (control)
  noisy      pinned, plus --noisy-procs busy-loop processes on the same cores
             (noisy neighbours), started by local rank 0 right before the timed
             loop and stopped right after; each one also exits by itself after
             --noisy-max-s seconds or when its parent dies

World sizes 1..N on one host (weak scaling: per-GPU batch fixed).

Definitions (nccl-tests conventions, NVIDIA/nccl-tests doc/PERFORMANCE.md):
  t[r][i]     time of iteration i on rank r: CUDA events recorded on the
              rank's current stream between iterations (GPU time, so a GPU
              left idle by a slow host counts), ms
  t_max[i]    max over ranks of t[r][i]: the job moves at its slowest rank
  ms/it       median over 10-iteration windows of the window mean of t_max
  p50/p95/p99 nearest-rank percentiles of t_max; CV = stdev/mean of t_max
  samples/s   world size x per-GPU batch / mean(t_max)
  speedup     ms/it of eager DDP / ms/it of the mode (same workload, loop, N, condition)
  efficiency  weak scaling, ms/it at N=1 / ms/it at N (same mode, loop, condition)
  vs_inside   ms/it of this loop / ms/it of the inside loop (same mode, workload, N, condition)
  skew        mean over iterations of max_r t[r][i] - min_r t[r][i]
  straggler   per rank, mean of t[r][i] - min_r t[r][i] (DeepSpeed's comms
              logger definition); the table shows the largest
  jitter loss 1 - samples/s(jitter) / samples/s(sync10)
  noise loss  1 - samples/s(noisy) / samples/s(baseline)
  setup       wall time of the mode's setup: model build, wrap/compile, warm-up
              and capture until steady state, synchronised, s
  memory      peak torch.cuda.max_memory_allocated during the row (setup and
              timed iterations), max over ranks, GiB; mem_start_gib: what was
              allocated when the row started (the data batches, and anything an
              earlier row left behind); mem_own_gib: peak - start per rank,
              the largest: the mode's own peak
  rsv         peak torch.cuda.max_memory_reserved during the row (what the
              caching allocator held from the driver: graph pools, cached
              blocks and fragmentation included), max over ranks, GiB;
              reserved_start_gib: reserved when the row started, after
              empty_cache() (the data, and what earlier rows left: e.g. the
              cuBLAS workspaces of every stream an earlier row computed on,
              which torch keeps for the life of the process); rsv_own
              (reserved_own_gib): peak - start per rank, the largest: the
              mode's own peak, comparable between rows of one process. For
              a fresh process per mode at N=1 see memory_breakdown.py

The floor (benchmarks/floor.py, measured once per world size before the rows):
  floor       max(compute, comm) + optimizer, a lower bound on ms/it: compute =
              FLOPs of forward + backward / bf16 matmul peak; comm = measured
              all-reduce time of the whole gradient (algbw = bytes / time, busbw =
              algbw x 2(n-1)/n; 0 at N=1); optimizer = AdamW's 28 B/param / D2D copy BW
  x floor     ms/it / floor

Usage:
  python benchmarks/bench_scaling.py --quick                 # the quick preset (< 4 min on 2 GPUs)
  python benchmarks/bench_scaling.py --preset issue14        # modes, loops, noisy, floor (~8 min on 2xH200)
  python benchmarks/bench_scaling.py --world-sizes 1,2 --workloads mlp,gpt2 --modes ddp,pgd --loops inside,outside
  python benchmarks/bench_scaling.py --smoke                 # CPU/Gloo smoke test of the harness (tiny, 3 its)
Writes benchmarks/results/<name>.json (every sample, the floor and the
environment), prints the table (also to <name>.txt), and draws PNG plots next
to the JSON.
See benchmarks/README.md for every flag.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import random
import signal
import statistics
import subprocess
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

from floor import floor_for, floor_table, measure_floor  # noqa: E402
from noise import noisy_cpus, pin_threads, start_busy, stop_busy, unpin_threads  # noqa: E402
from workloads import autocast_bf16, build_on  # noqa: E402

# Environment variables recorded in the results' environment["settings"].
SETTING_PREFIXES = ("PYGRAPH_DIST_", "NCCL_", "TORCH_NCCL_", "PYTORCH_CUDA_ALLOC_CONF", "CUDA_DEVICE_MAX_CONNECTIONS")
NO_NVLS = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
# --wrap-kwargs, set in each worker from its plan: added to every pgd mode's wrap() call.
WRAP_EXTRA: dict = {}
ALL_MODES = ["ddp", "ddp_bf16", "ddp_graph", "compile", "pgd", "pgd_bf16", "pgd_compile"]
ALL_LOOPS = ["inside", "outside", "accum4", "accum4_sync", "clip"]
ACCUM = 4              # micro-batches of the accum4 loop
CLIP_NORM = 1.0        # max_norm of the clip loop
DEFAULT_WORKLOADS = "mlp,gpt2,resnet50,vit_tiny"
DEFAULT_CONDITIONS = "baseline,sync1,sync10,jitter"  # pinned and noisy when asked for


@dataclass(frozen=True)
class Condition:
    p: float = 0.0         # probability of a host stall per iteration
    stall_ms: float = 0.0
    sync_every: int = 0    # loss.item() every k iterations (0: never)
    pin: bool = False      # all threads of the rank pinned to the noisy cores
    busy: bool = False     # busy-loop processes on those cores


CONDITIONS = {
    "baseline": Condition(),
    "sync1": Condition(sync_every=1),
    "sync10": Condition(sync_every=10),
    "jitter": Condition(p=0.05, stall_ms=5.0, sync_every=10),
    "pinned": Condition(pin=True),
    "noisy": Condition(pin=True, busy=True),
}

# Presets: groups of (workloads x modes x loops x conditions x world sizes); the
# union of their rows is run, one torchrun per world size. Flags given with a
# preset keep only the matching rows. "max" is every visible GPU.
PRESETS = {
    "quick": {"iters": 60, "groups": [
        dict(workloads=DEFAULT_WORKLOADS, modes="ddp,ddp_graph,pgd", loops="inside",
             conditions="baseline,sync10,jitter", world_sizes="1,max"),
    ]},
    # Issues 12 and 14 on 2 GPUs in one call of ~8 minutes. N=2 first (loops,
    # noisy and modes); compile rows last in each world size (the slowest).
    "issue14": {"iters": 60, "groups": [
        dict(workloads=DEFAULT_WORKLOADS, modes="ddp,ddp_graph,pgd,pgd_bf16,ddp_bf16,pgd_compile",
             loops="inside", conditions="baseline", world_sizes="2,1"),
        dict(workloads="resnet50,gpt2", modes="ddp,pgd", loops="inside", conditions="baseline,noisy",
             world_sizes="2"),
        dict(workloads="mlp,gpt2", modes="ddp,pgd", loops="inside,outside,accum4,accum4_sync,clip", conditions="baseline",
             world_sizes="2"),
    ]},
    # The harness on a CPU (Gloo, no CUDA modes): every loop, ddp and pgd, noisy.
    "smoke": {"iters": 3, "groups": [
        dict(workloads="tiny", modes="ddp,ddp_bf16,pgd,pgd_bf16", loops=",".join(ALL_LOOPS),
             conditions="baseline,noisy", world_sizes="1,2"),
    ]},
}
SLOW_MODES = ("compile", "pgd_compile")  # run last within a world size
# Under --budget-s a row starts only with this much time left (s): compilation
# takes 25-60 s per workload on 2xH200, other rows take seconds.
MIN_LEFT_S = {"compile": 75.0, "pgd_compile": 75.0}


# =========================================================================== loops
# The training loops as users write them. ``m`` is the mode: m.model, m.opt,
# m.autocast() (a no-op for pgd modes, whose wrap(amp=...) autocasts) and m.w,
# the workload (its split() and loss_fn for the outside loop). Each returns the
# loss, which the timed loop may .item().
def loop_inside(m, batch):
    m.opt.zero_grad(set_to_none=True)
    with m.autocast():
        loss = m.model(*batch)
    loss.backward()
    m.opt.step()
    return loss


def loop_outside(m, batch):
    inputs, target = m.w.split(batch)
    m.opt.zero_grad(set_to_none=True)
    with m.autocast():
        out = m.model(*inputs)
        loss = m.w.loss_fn(out, target)
    loss.backward()
    m.opt.step()
    return loss


def loop_accum4(m, batch, no_sync=True):
    micro = list(zip(*(t.chunk(ACCUM) for t in batch)))  # views, per-GPU batch / ACCUM rows each
    m.opt.zero_grad(set_to_none=True)
    for k, mb in enumerate(micro):
        sync = contextlib.nullcontext() if k == len(micro) - 1 or not no_sync else m.model.no_sync()
        with sync:
            with m.autocast():
                loss = m.model(*mb) / ACCUM
            loss.backward()
    m.opt.step()
    return loss


def loop_clip(m, batch):
    import torch

    m.opt.zero_grad(set_to_none=True)
    with m.autocast():
        loss = m.model(*batch)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(m.model.parameters(), CLIP_NORM)
    m.opt.step()
    return loss


LOOPS = {"inside": loop_inside, "outside": loop_outside, "accum4": loop_accum4,
         "accum4_sync": lambda m, batch: loop_accum4(m, batch, no_sync=False), "clip": loop_clip}


# =========================================================================== modes
class Unsupported(Exception):
    """The mode cannot run this loop: a row with status "unsupported", not an error."""


class Mode:
    name = ""
    needs_cuda = False
    loops: tuple[str, ...] = tuple(ALL_LOOPS)
    comm_dtype = "fp32"   # gradient all-reduce dtype, for the floor

    def __init__(self, workload, loop: str, batches, dev, stock_group):
        self.w, self.loop, self.batches, self.dev, self.group = workload, loop, batches, dev, stock_group
        self.cuda = dev.type == "cuda"
        self.loop_fn = LOOPS[loop]

    def module(self):
        """The user's module on the device: the net alone for the outside loop, the
        net with its loss otherwise."""
        return build_on(self.dev, self.w.build_net if self.loop == "outside" else self.w.build)

    def adamw(self, params):
        import torch

        return torch.optim.AdamW(params, lr=1e-4, fused=self.cuda)

    def autocast(self):
        return autocast_bf16(self.dev)

    def check_loop(self) -> None:
        """Raise Unsupported for a loop this mode cannot run (before any step)."""
        if self.loop not in self.loops:
            raise Unsupported(f"{self.name} runs the {', '.join(self.loops)} loops only")
        if self.loop == "accum4" and not hasattr(self.model, "no_sync"):
            raise Unsupported(f"the {type(self.model).__name__} has no no_sync()")

    def setup(self) -> None: ...

    def step(self, batch):
        return self.loop_fn(self, batch)

    def teardown(self) -> None: ...

    def extras(self) -> dict:
        return {}


class EagerDDP(Mode):
    name = "ddp"

    def ddp(self, module):
        from torch.nn.parallel import DistributedDataParallel as DDP

        return DDP(module, device_ids=[self.dev.index] if self.cuda else None, process_group=self.group)

    def setup(self):
        module = self.module()
        self.model = self.ddp(module)
        self.opt = self.adamw(module.parameters())
        self.check_loop()
        for _ in range(3):
            self.step(self.batches[0])

    def teardown(self):
        self.__dict__.pop("model", None)
        self.__dict__.pop("opt", None)


class EagerDDPBF16(EagerDDP):
    """DDP whose gradient buckets are all-reduced in bf16 (the stock compression hook)."""

    name = "ddp_bf16"
    comm_dtype = "bf16"

    def ddp(self, module):
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        model = super().ddp(module)
        model.register_comm_hook(state=self.group, hook=default_hooks.bf16_compress_hook)
        return model


class GraphedDDP(Mode):
    """PyTorch's documented whole-network capture with DDP (notes/cuda, 'Usage with
    DistributedDataParallel'): DDP built on the side stream that warms up and
    captures, >= 11 warm-up iterations, a capturable fused optimizer; the
    captured iteration is the loop function itself, run on static inputs."""

    name = "ddp_graph"
    needs_cuda = True
    loops = ("inside", "outside", "clip")

    def setup(self):
        import torch
        from torch.nn.parallel import DistributedDataParallel as DDP

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            module = self.module()
            self.model = DDP(module, device_ids=[self.dev.index], process_group=self.group)
            self.opt = torch.optim.AdamW(module.parameters(), lr=1e-4, fused=True, capturable=True)
            self.check_loop()
            self.static = [t.clone() for t in self.batches[0]]
            for _ in range(11):
                self.loop_fn(self, self.static)
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        self.opt.zero_grad(set_to_none=True)
        with torch.cuda.graph(self.graph, stream=side):
            self.static_loss = self.loop_fn(self, self.static)

    def step(self, batch):
        for s, b in zip(self.static, batch):
            s.copy_(b, non_blocking=True)
        self.graph.replay()
        return self.static_loss

    def teardown(self):
        g = getattr(self, "graph", None)
        if g is not None:
            g.reset()
        for a in ("graph", "model", "opt", "static", "static_loss"):
            self.__dict__.pop(a, None)


class Compiled(EagerDDP):
    """The user's loop around torch.compile(DDP(model), mode="reduce-overhead")."""

    name = "compile"
    needs_cuda = True

    def setup(self):
        import torch

        module = self.module()
        self.model = torch.compile(self.ddp(module), mode="reduce-overhead")
        self.opt = self.adamw(module.parameters())
        self.check_loop()
        for _ in range(5):  # compile, cudagraph warm-up, record
            self.step(self.batches[0])

    def step(self, batch):
        import torch

        torch.compiler.cudagraph_mark_step_begin()  # outputs of the previous step may be overwritten
        return super().step(batch)

    def teardown(self):
        super().teardown()
        _reset_compile()


def _reset_compile() -> None:
    import torch

    torch._dynamo.reset()
    try:
        from torch._inductor import cudagraph_trees

        cudagraph_trees.reset_cudagraph_trees()
    except (ImportError, AttributeError):
        pass


class PyGraphDist(Mode):
    name = "pgd"

    def wrap_kwargs(self) -> dict:
        return {}

    def prepare(self, module):
        return module

    def autocast(self):
        return contextlib.nullcontext()  # wrap(amp="bf16") autocasts the model call

    def setup(self):
        import pygraph_dist as pgd

        module = self.module()
        opt = self.adamw(module.parameters())
        kwargs = {**self.wrap_kwargs(), **WRAP_EXTRA}
        try:
            self.model, self.opt = pgd.wrap(self.prepare(module), opt, amp="bf16" if self.cuda else None, **kwargs)
        except TypeError as exc:
            unknown = [k for k in kwargs if k in str(exc)]
            if unknown:
                raise Unsupported(f"pygraph_dist.wrap() does not take {unknown[0]}= ({exc})") from exc
            raise
        self.check_loop()
        engine = getattr(self.model, "engine", None)
        for i in range(30):  # probe, warm-up, capture, selection; stops once steady
            self.step(self.batches[0])
            if i >= 2 and engine is not None and _pgd_steady(engine):
                break
        try:
            self.report = pgd.report().models[-1]
        except Exception:  # noqa: BLE001 - the report is extra information
            self.report = None

    def extras(self) -> dict:
        r = getattr(self, "report", None)
        if r is None:
            return {}
        try:
            return {"pgd_phase": [g.phase for g in r.graphs], "pgd_reason": [g.reason for g in r.graphs],
                    "pgd_loop": r.loop, "pgd_collectives": [g.n_collectives for g in r.graphs],
                    "pgd_selection": [g.selection for g in r.graphs],
                    "pgd_buckets": len(self.model.engine.reducer.plan.buckets)}
        except AttributeError:
            return {}

    def teardown(self):
        engine = getattr(getattr(self, "model", None), "engine", None)
        if engine is not None:
            engine.teardown()
        self.__dict__.pop("model", None)
        self.__dict__.pop("opt", None)


class PyGraphDistBF16(PyGraphDist):
    name = "pgd_bf16"
    comm_dtype = "bf16"

    def wrap_kwargs(self):
        import torch

        return {"grad_comm_dtype": torch.bfloat16}


class PyGraphDistCompiled(PyGraphDist):
    """pygraph_dist with wrap(..., compile=True): the module's call compiled by
    torch.compile in its default mode (inductor kernels, no CUDA graphs of its
    own) inside pygraph_dist's graphs. Compile time is in the setup column."""

    name = "pgd_compile"

    def wrap_kwargs(self):
        return {"compile": True}

    def teardown(self):
        super().teardown()
        _reset_compile()


def _pgd_steady(engine) -> bool:
    """Every input signature replays or runs eagerly for good, and selection has
    decided. Reads engine internals only to end the warm-up early: if they
    change, the warm-up simply runs its 30 steps."""
    try:
        from pygraph_dist import _C

        entries = list(engine.entries.values())
        phases = {_C.phase_name(e.policy.phase) for e in entries}
        decided = all(e.selection or _C.phase_name(e.policy.phase) == "eager" for e in entries)
        return bool(entries) and phases <= {"replay", "eager"} and (decided or not engine.config.select)
    except Exception:  # noqa: BLE001
        return False


MODES = {m.name: m for m in (EagerDDP, EagerDDPBF16, GraphedDDP, Compiled, PyGraphDist, PyGraphDistBF16,
                             PyGraphDistCompiled)}
assert list(MODES) == ALL_MODES


# =========================================================================== timing
def timed_loop(step, batches, iters: int, cond: Condition, rank: int, cuda: bool) -> list[float]:
    import torch

    rng = random.Random(4242 + 7919 * rank)
    if cuda:
        events = [torch.cuda.Event(enable_timing=True) for _ in range(iters + 1)]
        events[0].record()
    else:
        stamps = [time.perf_counter()]
    for i in range(iters):
        if cond.p and rng.random() < cond.p:
            time.sleep(cond.stall_ms / 1e3)
        loss = step(batches[i % len(batches)])
        if cond.sync_every and (i + 1) % cond.sync_every == 0:
            loss.item()
        if cuda:
            events[i + 1].record()
        else:
            stamps.append(time.perf_counter())
    if cuda:
        torch.cuda.synchronize()
        return [events[i].elapsed_time(events[i + 1]) for i in range(iters)]
    return [(stamps[i + 1] - stamps[i]) * 1e3 for i in range(iters)]


def summarize(per_rank: list[list[float]], samples_per_iter: int) -> dict:
    from pygraph_dist import _C

    x = _C.summarize_across_ranks(per_rank)
    tmax = list(x.iteration_max)
    windows = [statistics.fmean(tmax[i:i + 10]) for i in range(0, len(tmax) - 9, 10)] or [statistics.fmean(tmax)]
    mean = statistics.fmean(tmax)
    return {
        "iteration_max_ms": tmax,
        "ms_per_it": statistics.median(windows),
        "mean_ms": mean,
        "p50_ms": x.max_over_ranks.p50,
        "p95_ms": x.max_over_ranks.p95,
        "p99_ms": x.max_over_ranks.p99,
        "cv": x.max_over_ranks.cv,
        "samples_per_s": samples_per_iter / (mean / 1e3),
        "skew_ms": x.skew.mean,
        "straggler_ms": list(x.straggler_wait_mean),
    }


# =========================================================================== worker
def _error_text(exc: BaseException) -> str:
    """Type, message (first lines) and where it was raised: enough to act on."""
    msg = " | ".join(line for line in str(exc).splitlines()[:4] if line.strip())[:500]
    tb = traceback.extract_tb(exc.__traceback__)
    where = f" [at {Path(tb[-1].filename).name}:{tb[-1].lineno} in {tb[-1].name}]" if tb else ""
    return f"{type(exc).__name__}: {msg}{where}"


def _agree(status: str, reason: str, group, ws: int) -> tuple[str, str]:
    """All ranks' (status, reason) -> the worst status with its reasons, the same
    on every rank ("error" > "unsupported" > "ok")."""
    import torch.distributed as dist

    every = [None] * ws
    dist.all_gather_object(every, (status, reason), group=group)
    for worst in ("error", "unsupported"):
        hits = [(r, why) for r, (s, why) in enumerate(every) if s == worst]
        if hits:
            if len(hits) == ws and len({why for _, why in hits}) == 1:
                return worst, hits[0][1]
            return worst, "; ".join(f"rank {r}: {why}" for r, why in hits)
    return "ok", ""


def _agree_all(ok: bool, dev, group) -> bool:
    import torch
    import torch.distributed as dist

    t = torch.tensor([1 if ok else 0], device=dev)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return bool(t.item())


def _healthy(dev, group) -> bool:
    """After an error: can this process still run collectives and kernels? (A
    sticky CUDA error or a dangling capture says no: the driver then restarts
    the world size for the remaining rows.)"""
    import torch
    import torch.distributed as dist

    try:
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t = torch.ones(1, device=dev)
        dist.all_reduce(t, group=group)
        return bool(t.item() == dist.get_world_size(group))
    except Exception:  # noqa: BLE001
        return False


def run_row(row: dict, plan: dict, ctx: dict) -> tuple[list[dict], bool]:
    """One (workload, mode, loop): setup once, then every condition. Returns the
    cells and whether the process is still healthy."""
    import torch
    import torch.distributed as dist

    from workloads import REGISTRY

    rank, ws, dev, group, cuda = ctx["rank"], ctx["ws"], ctx["dev"], ctx["group"], ctx["cuda"]
    w, cls = REGISTRY[row["workload"]], MODES[row["mode"]]
    batch = int(plan["batch"].get(w.name, w.default_batch))
    base = {"workload": w.name, "mode": cls.name, "loop": row["loop"], "world_size": ws, "batch": batch,
            **floor_for(ctx["floor"], w.name, cls.comm_dtype)}
    conditions = row["conditions"]

    def all_cells(status: str, reason: str, **extra) -> list[dict]:
        return [dict(base, condition=c, status=status, reason=reason, **extra) for c in conditions]

    if w.missing():
        return all_cells("skipped", f"needs {', '.join(w.missing())}"), True
    if cls.needs_cuda and not cuda:
        return all_cells("skipped", "needs CUDA"), True
    if row["loop"] not in cls.loops:
        return all_cells("unsupported", f"{cls.name} runs the {', '.join(cls.loops)} loops only"), True
    if row["loop"].startswith("accum4") and batch % ACCUM:
        return all_cells("unsupported", f"per-GPU batch {batch} is not a multiple of {ACCUM}"), True
    batches = ctx["batches"].get((w.name, batch))
    if batches is None:
        gens = [torch.Generator().manual_seed(1000 * rank + i) for i in range(4)]
        batches = ctx["batches"][(w.name, batch)] = [tuple(t.to(dev) for t in w.make_batch(batch, g)) for g in gens]

    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated(dev) / 2**30 if cuda else 0.0
    start_reserved = torch.cuda.memory_reserved(dev) / 2**30 if cuda else 0.0
    mode = cls(w, row["loop"], batches, dev, group)
    status, reason = "ok", ""
    t0 = time.perf_counter()
    try:
        _inject_fault(row_id(row), rank)
        mode.setup()
        if cuda:
            torch.cuda.synchronize()
    except Unsupported as exc:
        status, reason = "unsupported", str(exc)
    except Exception as exc:  # noqa: BLE001 - a failing mode is a result, not a crash
        status, reason = "error", "setup: " + _error_text(exc)
        ctx["note"](reason)  # in case the agreement below cannot complete
    setup_s = time.perf_counter() - t0
    status, reason = _agree(status, reason, group, ws)
    if status != "ok":
        _safe_teardown(mode)
        return all_cells(status, reason, setup_s=setup_s), status != "error" or _healthy(dev, group)

    extra = mode.extras()
    cells, healthy = [], True
    for cname in conditions:
        cond = CONDITIONS[cname]
        busy, saved = [], None
        err = ""
        try:
            if cond.busy and ctx["local_rank"] == 0:
                busy = start_busy(ctx["noisy_cpus"], plan["noisy_procs"], plan["noisy_max_s"])
            dist.barrier(group=group)
            if cond.pin:
                saved = pin_threads(ctx["noisy_cpus"])
            times = timed_loop(mode.step, batches, plan["iters"], cond, rank, cuda)
        except Exception as exc:  # noqa: BLE001
            times, err = [], _error_text(exc)
            ctx["note"](f"{cname}: {err}")
        finally:
            if saved is not None:
                unpin_threads(saved, ctx["affinity"])
            stop_busy(busy)
        status, reason = _agree("error" if err else "ok", err, group, ws)
        cell = dict(base, condition=cname, setup_s=setup_s, **extra)
        if cond.pin:
            cell.update(noisy_cpus=ctx["noisy_cpus"], noisy_procs=plan["noisy_procs"] if cond.busy else 0)
        if status == "ok":
            per_rank = [None] * ws
            dist.all_gather_object(per_rank, times, group=group)
            cell.update(status="ok", per_rank_ms=per_rank, **summarize(per_rank, ws * batch))
        else:
            cell.update(status="error", reason=reason)
            healthy = _healthy(dev, group)
        cells.append(cell)
        if not healthy:
            break
    peak = torch.cuda.max_memory_allocated(dev) / 2**30 if cuda else 0.0
    peak_reserved = torch.cuda.max_memory_reserved(dev) / 2**30 if cuda else 0.0
    peaks = [None] * ws
    if healthy:
        dist.all_gather_object(peaks, (peak, start, peak_reserved, start_reserved), group=group)
        for c in cells:
            c["peak_mem_gib"] = max(p[0] for p in peaks)
            c["mem_start_gib"] = max(p[1] for p in peaks)
            c["mem_own_gib"] = max(p[0] - p[1] for p in peaks)  # per rank, then the largest
            c["peak_reserved_gib"] = max(p[2] for p in peaks)
            c["reserved_start_gib"] = max(p[3] for p in peaks)
            c["reserved_own_gib"] = max(p[2] - p[3] for p in peaks)  # per rank, then the largest
    done = {c["condition"] for c in cells}
    cells += [dict(base, condition=c, status="error", reason="not run: the process was unhealthy after an error")
              for c in conditions if c not in done]
    _safe_teardown(mode)
    del mode
    return cells, healthy


def _inject_fault(rid: str, rank: int) -> None:
    """BENCH_FAULT=ROW:KIND:RANK (e.g. tiny/outside/ddp:hang:1) makes one rank
    hang, crash or raise at the start of that row's setup: how the harness's
    error rows, --row-timeout and restarts are tested without a broken mode."""
    spec = os.environ.get("BENCH_FAULT", "")
    if not spec:
        return
    where, kind, who = spec.rsplit(":", 2)
    if where != rid or int(who) != rank:
        return
    if kind == "hang":
        time.sleep(3600)
    elif kind == "crash":
        os._exit(9)
    raise RuntimeError(f"fault injected by BENCH_FAULT={spec}")


def _safe_teardown(mode) -> None:
    try:
        mode.teardown()
    except Exception:  # noqa: BLE001
        pass
    gc.collect()


def worker(args) -> None:
    import torch
    import torch.distributed as dist

    import pygraph_dist as pgd
    from workloads import REGISTRY

    plan = json.loads(Path(args.plan).read_text())
    WRAP_EXTRA.update(plan.get("wrap_kwargs", {}))
    env = pgd.init()
    rank, ws = env.rank, env.world_size
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    group = dist.new_group(backend="nccl" if cuda else "gloo")  # torch's own backend for the baselines and the floor
    affinity = os.sched_getaffinity(0)
    ctx = {"rank": rank, "ws": ws, "dev": dev, "group": group, "cuda": cuda, "local_rank": env.local_rank,
           "affinity": affinity, "noisy_cpus": noisy_cpus(plan["noisy_cores"]), "batches": {},
           "floor": plan.get("floor")}
    part = Path(args.part)

    def note(text: str) -> None:  # this rank's errors in the row, for the driver if the row kills the ranks
        with open(f"{part}.rank{rank}.err", "a") as f:
            f.write(f"rank {rank}: {text}\n")

    ctx["note"] = note
    state = {"environment": environment(), "cells": [], "done": [], "current": None, "floor": ctx["floor"]}

    def flush() -> None:  # rank 0, atomically: the driver reads it as the row heartbeat
        if rank == 0:
            tmp = part.with_suffix(".tmp")
            tmp.write_text(json.dumps(state))
            os.replace(tmp, part)

    flush()
    if plan["floor_enabled"] and ctx["floor"] is None:
        state["current"] = {"row": "floor", "since": time.time()}
        flush()
        names = sorted({r["workload"] for r in plan["rows"]})
        todo = {}
        for n in names:
            w = REGISTRY[n]
            b = int(plan["batch"].get(n, w.default_batch))
            if not w.missing():
                todo[n] = (w, tuple(t.to(dev) for t in w.make_batch(b, torch.Generator().manual_seed(rank))))
        ctx["floor"] = state["floor"] = measure_floor(todo, dev, group, ws)
        state["current"] = None
        flush()

    bar = _progress(len(plan["rows"]), f"N={ws}", disable=rank != 0)
    for row in plan["rows"]:
        rid = row_id(row)
        bar.describe(rid)
        if not _agree_all(time.time() + MIN_LEFT_S.get(row["mode"], 0.0) < plan["deadline"], dev, group):
            state["cells"] += [dict(workload=row["workload"], mode=row["mode"], loop=row["loop"], world_size=ws,
                                    condition=c, status="skipped", reason="budget (--budget-s) spent")
                               for c in row["conditions"]]
            state["done"].append(rid)
            bar.update(1)
            continue
        state["current"] = {"row": rid, "since": time.time()}
        flush()
        try:
            cells, healthy = run_row(row, plan, ctx)
        except Exception as exc:  # noqa: BLE001 - the harness's own collectives failed: the ranks disagree
            note(f"{rid}: {_error_text(exc)}")
            raise
        for n in range(ws):
            Path(f"{part}.rank{n}.err").unlink(missing_ok=True)
        state["cells"] += cells
        state["done"].append(rid)
        state["current"] = None
        flush()
        bar.update(1)
        if not healthy:
            bar.close()
            print(f"[bench] rank {rank}: unhealthy after {rid}; exiting so that the driver restarts N={ws}",
                  file=sys.stderr, flush=True)
            os._exit(3)  # no teardown: it could hang on a broken communicator
    bar.close()
    flush()
    pgd.shutdown()


def row_id(row: dict) -> str:
    return f"{row['workload']}/{row['loop']}/{row['mode']}"


def environment() -> dict:
    import platform

    import torch

    env = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "cpu_affinity": len(os.sched_getaffinity(0)),
        "nvls_disabled": os.environ.get("NCCL_NVLS_ENABLE") == "0",
        # what the ranks ran with (sweep.py varies these)
        "settings": {k: v for k, v in sorted(os.environ.items()) if k.startswith(SETTING_PREFIXES)},
    }
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name()
        env["gpus_visible"] = torch.cuda.device_count()
        env["nccl"] = ".".join(str(v) for v in torch.cuda.nccl.version())
    try:
        import pygraph_dist as pgd

        env["pygraph_dist"] = getattr(pgd, "__version__", "")
        env["wrap_takes"] = _wrap_keywords(pgd.wrap)
        env["pgd_has_no_sync"] = hasattr(pgd.GraphedModule, "no_sync")
    except Exception:  # noqa: BLE001
        pass
    try:
        env["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                       text=True, timeout=10).stdout.strip()
        # Tracked files that differ from HEAD: local edits, or a shipped copy whose
        # .git is older than its files (it said f09dd59 for a 1d36a32 tree once).
        changed = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".",
                                  ":!benchmarks/results"], cwd=ROOT,  # results are data, not code
                                 capture_output=True, text=True, timeout=30).stdout.strip()
        if env["commit"] and changed:
            env["commit"] += "+modified"
    except (OSError, subprocess.SubprocessError):
        env["commit"] = ""
    # A copy of the tree without .git (e.g. shipped to a GPU host) can say which commit it is.
    # PGD_COMMIT wins: a shipped copy may carry a stale .git.
    env["commit"] = os.environ.get("PGD_COMMIT", "") or env["commit"]
    return env


def _wrap_keywords(fn) -> list[str]:
    import inspect

    try:
        return [p for p in inspect.signature(fn).parameters if p not in ("model", "optimizer")]
    except (TypeError, ValueError):
        return []


class _progress:
    """tqdm when it is installed, a line per step otherwise."""

    def __init__(self, total: int, desc: str, disable: bool):
        self.disable, self.total, self.done, self.desc = disable, total, 0, desc
        self.bar, self.what = None, ""
        if not disable:
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total, desc=desc, unit="row", file=sys.stderr, dynamic_ncols=True)
            except ImportError:
                pass

    def describe(self, what: str) -> None:
        self.what = what
        if self.bar is not None:
            self.bar.set_postfix_str(what)

    def update(self, n: int) -> None:
        self.done += n
        if self.bar is not None:
            self.bar.update(n)
        elif not self.disable:
            print(f"[{self.desc}] {self.done}/{self.total} {self.what}", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


# =========================================================================== driver
def key(c: dict) -> tuple:
    """A cell's identity (results written before loops existed ran the inside loop)."""
    return c["workload"], c["mode"], c.get("loop", "inside"), c["world_size"], c["condition"]


def derive(cells: list[dict]) -> None:
    """Speedup vs eager DDP, weak-scaling efficiency, loop cost, ratio to the
    floor, jitter and noise loss, in place."""
    for c in cells:
        c.setdefault("loop", "inside")
    ok = {key(c): c for c in cells if c["status"] == "ok"}
    for (w, m, lp, n, cond), c in ok.items():
        ref = ok.get((w, "ddp", lp, n, cond))
        if ref:
            c["speedup_vs_ddp"] = ref["ms_per_it"] / c["ms_per_it"]
        one = ok.get((w, m, lp, 1, cond))
        if one:
            c["scaling_efficiency"] = one["ms_per_it"] / c["ms_per_it"]
        inside = ok.get((w, m, "inside", n, cond))
        if inside and lp != "inside":
            c["vs_inside"] = c["ms_per_it"] / inside["ms_per_it"]
        if c.get("floor_ms"):
            c["ratio_to_floor"] = c["ms_per_it"] / c["floor_ms"]
        calm = {"jitter": "sync10", "noisy": "baseline"}.get(cond)
        if calm and (w, m, lp, n, calm) in ok:
            loss = 1 - c["samples_per_s"] / ok[(w, m, lp, n, calm)]["samples_per_s"]
            c["jitter_throughput_loss" if cond == "jitter" else "noise_throughput_loss"] = loss


COLUMNS = [  # (name, unit, width): the one header of the table
    ("workload", "", 14), ("mode", "", 11), ("loop", "", 7), ("N", "", 2), ("cond", "", 8),
    ("ms/it", "ms", 8), ("p50", "ms", 8), ("p99", "ms", 8), ("CV", "%", 5), ("samples/s", "1/s", 9),
    ("speedup", "x", 7), ("eff", "%", 4), ("vs_in", "x", 5), ("skew", "ms", 6), ("floor", "ms", 7),
    ("x_floor", "x", 7), ("setup", "s", 6), ("mem", "GiB", 6),
    ("start", "GiB", 6), ("rsv", "GiB", 6), ("rsv_own", "GiB", 7),
]


def _row_text(values: list[str]) -> str:
    """One line of the table, without its 2-character prefix ("# " or "  ")."""
    out = []
    for (name, _, width), v in zip(COLUMNS, values):
        out.append(f"{v:<{width}}" if name in ("workload", "mode", "loop", "cond") else f"{v:>{width}}")
    return " ".join(out)


def table(cells: list[dict], env: dict, floors: list[dict] | None = None) -> str:
    head = [f"# pygraph_dist scaling benchmark: {env.get('gpus_visible', 0)} x {env.get('gpu', 'CPU')}, "
            f"torch {env.get('torch')}, NCCL {env.get('nccl', '-')}, CUDA {env.get('cuda')}, "
            f"commit {env.get('commit', '?')}, NVLS {'off' if env.get('nvls_disabled') else 'on'}",
            "# definitions: benchmarks/bench_scaling.py docstring and benchmarks/README.md. ms/it: median of "
            "10-iteration window means of the per-iteration max over ranks;",
            "# speedup: ddp ms/it / ms/it (same loop, N, cond); eff: T(1)/T(N); vs_in: ms/it / inside-loop ms/it; "
            "skew: mean max-min over ranks; floor: max(compute, comm) + optimizer; x_floor: ms/it / floor; "
            "mem: peak allocated in the row; start: allocated when it started; rsv: peak reserved in the row; rsv_own: rsv - reserved at its start",
            "# " + _row_text([n for n, _, _ in COLUMNS]),
            "# " + _row_text([f"({u})" if u else "" for _, u, _ in COLUMNS])]
    lines = head
    order = {m: i for i, m in enumerate(ALL_MODES)}
    loops = {lp: i for i, lp in enumerate(ALL_LOOPS)}
    for c in sorted(cells, key=lambda c: (c["workload"], c["world_size"], c["condition"],
                                          loops.get(c.get("loop", "inside"), 9), order.get(c["mode"], 99))):
        ident = [c["workload"], c["mode"], c.get("loop", "inside"), str(c["world_size"]), c["condition"]]
        if c["status"] != "ok":
            lines.append("  " + _row_text(ident + ["-"] + [""] * (len(COLUMNS) - 6)) +
                         f"  {c['status']}: {c.get('reason', '')}")
            continue
        note = []
        if c["mode"].startswith("pgd") and c.get("pgd_phase") and set(c["pgd_phase"]) != {"replay"}:
            note.append(f"pgd: {c['pgd_phase']} {'; '.join(r for r in c.get('pgd_reason', []) if r)[:100]}")
        if "jitter_throughput_loss" in c:
            note.append(f"jitter loss {c['jitter_throughput_loss'] * 100:.1f}%")
        if "noise_throughput_loss" in c:
            note.append(f"noise loss {c['noise_throughput_loss'] * 100:.1f}%")
        lines.append("  " + _row_text(ident + [
            f"{c['ms_per_it']:.3f}", f"{c['p50_ms']:.3f}", f"{c['p99_ms']:.3f}", f"{c['cv'] * 100:.1f}",
            f"{c['samples_per_s']:.0f}", _fmt(c.get("speedup_vs_ddp"), "{:.2f}"),
            _fmt(c.get("scaling_efficiency"), "{:.0f}", 100), _fmt(c.get("vs_inside"), "{:.2f}"),
            f"{c['skew_ms']:.2f}", _fmt(c.get("floor_ms"), "{:.3f}"), _fmt(c.get("ratio_to_floor"), "{:.2f}"),
            f"{c['setup_s']:.1f}", f"{c.get('peak_mem_gib', 0):.2f}",
            _fmt(c.get("mem_start_gib"), "{:.2f}"), _fmt(c.get("peak_reserved_gib"), "{:.2f}"),
            _fmt(c.get("reserved_own_gib"), "{:.2f}")]) + ("  " + "; ".join(note) if note else ""))
    if floors:
        lines += ["", floor_table(floors)]
    return "\n".join(lines)


def _fmt(v, f, scale=1.0):
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else f.format(v * scale)


def summary_line(cells: list[dict]) -> str:
    counts = {}
    for c in cells:
        counts[c["status"]] = counts.get(c["status"], 0) + 1
    return ", ".join(f"{n} {s}" for s, n in sorted(counts.items()))


# ----------------------------------------------------------------- the plan
def _split(s: str | None) -> list[str] | None:
    return [x for x in s.split(",") if x] if s else None


def build_plan(args, gpus: int) -> dict[int, list[dict]]:
    """World size -> rows {workload, mode, loop, conditions} in run order: the
    union of the preset's groups (or of the one group the flags describe),
    filtered by the flags; conditions of one row merged; compile rows last."""
    n_max = gpus if gpus >= 2 else 2
    if args.preset:
        groups = PRESETS[args.preset]["groups"]
        keep = {k: _split(getattr(args, k)) for k in ("workloads", "modes", "loops", "conditions", "world_sizes")}
    else:
        groups = [dict(workloads=args.workloads or DEFAULT_WORKLOADS, modes=args.modes or ",".join(ALL_MODES),
                       loops=args.loops or "inside", conditions=args.conditions or DEFAULT_CONDITIONS,
                       world_sizes=args.world_sizes or "1,max")]
        keep = {}
    from workloads import REGISTRY

    known = {"workloads": list(REGISTRY), "modes": ALL_MODES, "loops": ALL_LOOPS, "conditions": list(CONDITIONS)}
    for g in groups + [{k: ",".join(v) for k, v in keep.items() if v}]:
        for k, names in known.items():
            bad = [x for x in _split(g.get(k)) or [] if x not in names]
            if bad:
                raise SystemExit(f"unknown {k[:-1]} {', '.join(bad)} (choose from {', '.join(names)})")
    plan: dict[int, dict[tuple, dict]] = {}
    for g in groups:
        sel = {k: [x for x in _split(g[k]) if keep.get(k) is None or x in keep[k] or
                   (k == "world_sizes" and x == "max" and str(n_max) in keep[k])] for k in g}
        for n in [n_max if s == "max" else int(s) for s in sel["world_sizes"]]:
            rows = plan.setdefault(n, {})
            for wname in sel["workloads"]:
                for lp in sel["loops"]:
                    for m in sel["modes"]:
                        r = rows.setdefault((wname, lp, m), {"workload": wname, "loop": lp, "mode": m,
                                                             "conditions": []})
                        r["conditions"] += [c for c in sel["conditions"] if c not in r["conditions"]]
    return {n: sorted((r for r in rows.values() if r["conditions"]), key=lambda r: r["mode"] in SLOW_MODES)
            for n, rows in plan.items() if rows}


# ----------------------------------------------------------------- running a world size
def _kill_group(proc) -> None:
    """End the torchrun we started and its ranks (its own process group)."""
    for sig, wait in ((signal.SIGTERM, 15), (signal.SIGKILL, 10)):
        if proc.poll() is not None:
            return
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            pass


def _die_with_parent() -> None:
    """In the torchrun child before exec: SIGTERM it when the driver dies, even by
    SIGKILL (Linux prctl PR_SET_PDEATHSIG), so no ranks outlive the benchmark."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _exit_on_signal(signum, frame) -> None:
    """SIGTERM/SIGHUP end the driver through SystemExit, so that every finally runs
    (and stops the torchrun it started: that one is in its own session and does
    not see the signal)."""
    raise SystemExit(128 + signum)


def _read_part(part: Path) -> dict | None:
    try:
        return json.loads(part.read_text())
    except (OSError, ValueError):
        return None


def _cells(rows: list[dict], n: int, status: str, reason: str) -> list[dict]:
    return [dict(workload=r["workload"], mode=r["mode"], loop=r["loop"], world_size=n, condition=c,
                 status=status, reason=reason) for r in rows for c in r["conditions"]]


def run_world_size(args, n: int, rows: list[dict], plan_common: dict, out_dir: Path, name: str,
                   deadline: float, out: dict) -> None:
    """Run the rows at world size n, adding to out["cells"], out["codes"],
    out["environment"] and out["floor"] as it goes (so that an interrupted driver
    still has them). A row that kills or hangs the ranks (no progress within
    --row-timeout) is recorded as an error, and a fresh torchrun goes on with
    the rows after it."""
    env = dict(os.environ)
    env.update(NO_NVLS)
    env["PYTHONPATH"] = str(HERE) + os.pathsep + env.get("PYTHONPATH", "")
    todo = list(rows)
    attempt = 0
    while todo:
        attempt += 1
        part = out_dir / f".{name}.N{n}.{attempt}.part.json"
        plan_path = out_dir / f".{name}.N{n}.{attempt}.plan.json"
        plan_path.write_text(json.dumps(dict(plan_common, rows=todo, floor=out["floor"], deadline=deadline)))
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(n),
               str(Path(__file__)), "--worker", "--part", str(part), "--plan", str(plan_path)]
        # Own session: stopping it stops every rank and busy loop (os.killpg).
        proc = subprocess.Popen(cmd, env=env, start_new_session=True, preexec_fn=_die_with_parent)
        hard_stop = deadline + args.grace_s
        why = ""
        try:
            while proc.poll() is None:
                time.sleep(1.0)
                cur = (_read_part(part) or {}).get("current")
                limit = args.row_timeout * (3 if cur and cur["row"].endswith(SLOW_MODES) else 1)
                if cur and time.time() - cur["since"] > limit:
                    why = f"no progress for {limit:.0f} s (--row-timeout) in {cur['row']}"
                elif time.time() > hard_stop:
                    why = f"--budget-s + --grace-s spent during {cur['row'] if cur else 'start-up'}"
                if why:
                    print(f"[bench] N={n}: {why}; stopping the ranks", file=sys.stderr, flush=True)
                    break
        finally:  # also when the driver itself is interrupted: stop the ranks, keep what they wrote
            if proc.poll() is None:
                _kill_group(proc)
            rc = proc.returncode if proc.returncode is not None else -9
            out["codes"].append(rc)
            state = _read_part(part) or {}
            notes = []
            for err in sorted(out_dir.glob(f"{part.name}.rank*.err")):
                notes += err.read_text().strip().splitlines()
                err.unlink()
            plan_path.unlink(missing_ok=True)
            part.unlink(missing_ok=True)
            out["cells"] += state.get("cells", [])
            out["environment"] = out["environment"] or state.get("environment", {})
            out["floor"] = out["floor"] or state.get("floor")
        done = set(state.get("done", []))
        cur = (state.get("current") or {}).get("row")
        if cur == "floor":  # the floor measurement itself failed: go on without it
            out["floor"] = {"world_size": n, "device": {}, "workloads": {}, "error": why or f"exit code {rc}"}
            plan_common = dict(plan_common, floor_enabled=False)
        elif cur:
            r = next(r for r in todo if row_id(r) == cur)
            reason = (why or f"the ranks exited (code {rc}) during this row") + \
                (f"; last errors: {' | '.join(notes)}" if notes else "; see stderr")
            out["cells"] += _cells([r], n, "error", reason)
            done.add(cur)
        elif not done and todo:  # died before its first row: a restart would do the same
            print(f"[bench] N={n}: the ranks exited (code {rc}) before any row; giving up on N={n}",
                  file=sys.stderr)
            out["cells"] += _cells(todo, n, "error", why or f"the ranks exited (code {rc}) before this row")
            return
        todo = [r for r in todo if row_id(r) not in done]
        if todo and time.time() > hard_stop:
            out["cells"] += _cells(todo, n, "skipped", "budget (--budget-s) spent")
            return
        if todo:
            print(f"[bench] N={n}: restarting for the {len(todo)} rows left", file=sys.stderr, flush=True)


def _write_result(args, out_dir: Path, name: str, env: dict, codes: dict, cells: list, floors: list,
                  plan: dict, t0: float, complete: bool) -> tuple[dict, Path]:
    derive(cells)
    result = {"environment": env, "config": {k: v for k, v in vars(args).items() if k not in ("worker", "part", "plan")},
              "conditions": {k: asdict(v) for k, v in CONDITIONS.items()}, "exit_codes": codes,
              "plan": {str(n): rows for n, rows in plan.items()}, "complete": complete,
              "wall_s": time.perf_counter() - t0, "floor": floors, "cells": cells}
    path = out_dir / f"{name}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(result, indent=1))
    os.replace(tmp, path)
    return result, path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="Scaling, loop, floor and jitter benchmark of pygraph_dist vs DDP, "
                                "the hand-written graph recipe and torch.compile (see benchmarks/README.md).")
    p.add_argument("--preset", choices=sorted(PRESETS), default=None,
                   help="a set of row groups; the selection flags then keep only matching rows")
    p.add_argument("--quick", action="store_true", help="same as --preset quick")
    p.add_argument("--smoke", action="store_true", help="same as --preset smoke (CPU/Gloo harness check)")
    p.add_argument("--workloads", default=None, help=f"comma list (default: {DEFAULT_WORKLOADS})")
    p.add_argument("--modes", default=None, help=f"comma list of {', '.join(ALL_MODES)} (default: all)")
    p.add_argument("--loops", default=None, help=f"comma list of {', '.join(ALL_LOOPS)} (default: inside)")
    p.add_argument("--conditions", default=None,
                   help=f"comma list of {', '.join(CONDITIONS)} (default: {DEFAULT_CONDITIONS})")
    p.add_argument("--world-sizes", default=None, help="e.g. 1,2 or 1,max (default: 1 and all GPUs)")
    p.add_argument("--iters", type=int, default=None, help="timed iterations per condition (default 200; presets set theirs)")
    p.add_argument("--batch", default="", help="per-GPU batch overrides, e.g. gpt2=16,mlp=128")
    p.add_argument("--no-floor", action="store_true", help="skip the floor measurements")
    p.add_argument("--wrap-kwargs", default="",
                   help='extra pygraph_dist.wrap() arguments for the pgd modes, as JSON, e.g. '
                        '\'{"bucket_cap_mb": 50}\' (recorded in the results config)')
    p.add_argument("--noisy-cores", type=int, default=4, help="cores the ranks are pinned to in pinned/noisy")
    p.add_argument("--noisy-procs", type=int, default=4, help="busy-loop processes on those cores in noisy")
    p.add_argument("--noisy-max-s", type=float, default=300, help="a busy-loop process exits after this at the latest")
    p.add_argument("--name", default=None, help="results file stem (default: scaling-<date>)")
    p.add_argument("--out-dir", default=str(HERE / "results"))
    p.add_argument("--budget-s", type=float, default=None,
                   help="no row starts after this many seconds from the start (rows left: status skipped)")
    p.add_argument("--grace-s", type=float, default=60, help="after the budget, a running row gets this long")
    p.add_argument("--row-timeout", type=float, default=180,
                   help="seconds one row may run (3x for compile modes) before its ranks are stopped, "
                   "the row recorded as an error, and the rest run in a fresh torchrun")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--dry-run", action="store_true", help="print the rows per world size and exit")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--part", default="", help=argparse.SUPPRESS)
    p.add_argument("--plan", default="", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _exit_on_signal)

    if args.quick or args.smoke:
        if args.preset:
            raise SystemExit("--quick/--smoke are presets: give one of --preset, --quick, --smoke")
        args.preset = "quick" if args.quick else "smoke"
    if args.smoke:  # small noise on a small machine
        args.noisy_cores = min(args.noisy_cores, 1)
        args.noisy_procs = min(args.noisy_procs, 1)
        args.noisy_max_s = min(args.noisy_max_s, 60)
    args.iters = args.iters or (PRESETS[args.preset]["iters"] if args.preset else 200)

    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    plan = build_plan(args, gpus)
    if not plan:
        raise SystemExit("the selection leaves no rows")
    if args.dry_run:
        for n, rows in plan.items():
            print(f"N={n}: {len(rows)} rows, {sum(len(r['conditions']) for r in rows)} cells, "
                  f"{args.iters} timed iterations per cell")
            for r in rows:
                print(f"  {row_id(r):<32} {','.join(r['conditions'])}")
        return 0
    if gpus and max(plan) > gpus:
        raise SystemExit(f"world size {max(plan)} needs {max(plan)} GPUs, {gpus} visible")
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    name = args.name or time.strftime("scaling-%Y%m%d-%H%M%S")
    batch_over = dict(kv.split("=") for kv in args.batch.split(",") if kv) if args.batch else {}
    try:
        wrap_extra = json.loads(args.wrap_kwargs) if args.wrap_kwargs else {}
    except json.JSONDecodeError as exc:
        raise SystemExit(f"--wrap-kwargs is not JSON: {exc}") from None
    if not isinstance(wrap_extra, dict):
        raise SystemExit("--wrap-kwargs must be a JSON object, e.g. '{\"bucket_cap_mb\": 50}'")
    common = {"iters": args.iters, "batch": batch_over, "floor_enabled": not args.no_floor,
              "wrap_kwargs": wrap_extra,
              "noisy_cores": args.noisy_cores, "noisy_procs": args.noisy_procs, "noisy_max_s": args.noisy_max_s}
    t0 = time.perf_counter()
    deadline = time.time() + (args.budget_s if args.budget_s else 1e9)
    cells, env, codes, floors = [], {}, {}, []
    interrupted = None
    for n, rows in plan.items():
        if time.time() > deadline:
            print(f"[bench] world size {n}: budget spent, {len(rows)} rows skipped", file=sys.stderr, flush=True)
            cells += _cells(rows, n, "skipped", "budget (--budget-s) spent")
            continue
        print(f"[bench] world size {n}: {len(rows)} rows", file=sys.stderr, flush=True)
        out = {"cells": [], "codes": [], "environment": {}, "floor": None}
        try:
            run_world_size(args, n, rows, common, out_dir, name, deadline, out)
        except (KeyboardInterrupt, SystemExit) as exc:  # SIGINT, or SIGTERM/SIGHUP via _exit_on_signal
            interrupted = exc
        cells += out["cells"]
        codes[n] = out["codes"]
        env = env or out["environment"]
        if out["floor"]:
            floors.append(out["floor"])
        # Written after every world size, so that a run cut short keeps what it measured.
        result, path = _write_result(args, out_dir, name, env, codes, cells, floors, plan, t0,
                                     complete=interrupted is None and n == list(plan)[-1])
        if interrupted is not None:
            print(f"[bench] interrupted ({type(interrupted).__name__}); results so far -> {path}",
                  file=sys.stderr, flush=True)
            raise interrupted
    result, path = _write_result(args, out_dir, name, env, codes, cells, floors, plan, t0, complete=True)
    text = table(cells, env, [f for f in floors if f.get("device")])
    path.with_suffix(".txt").write_text(text + "\n")
    print(text)
    print(f"[bench] {len(cells)} cells ({summary_line(cells)}) in {result['wall_s']:.0f} s -> {path}",
          file=sys.stderr)
    if not args.no_plots:
        try:
            from plots import plot_all

            for png in plot_all(result, out_dir / name):
                print(f"[bench] plot {png}", file=sys.stderr)
        except ImportError as exc:
            print(f"[bench] no plots: {exc}", file=sys.stderr)
    return 0 if all(c == 0 for rcs in codes.values() for c in rcs) else 1


if __name__ == "__main__":
    sys.exit(main())
