"""Host cost per training step: pygraph_dist against the hand-written graph (issue 26).

One process, one GPU, world size 1 (a 1-rank process group from
``pygraph_dist.init()``). Models: ``L x (Linear(256, 256) + GELU)``, then
``Linear(256, 10)``, cross-entropy, AdamW(lr=1e-4, fused), fp32, batch 8;
``--layers 8,32,250`` gives 18, 66 and 502 parameter tensors, GPU work small
enough that the host decides the step time. Every mode builds a fresh model
from the same seed.

Modes (the user's loop; each row is (mode, layers)):

  hand          the recipe of PyTorch's CUDA-graph notes, written by hand: static
                x and y, 3 eager warm-ups on a side stream, AdamW(fused,
                capturable), forward + cross-entropy + backward + step captured
                in one torch.cuda.graph; a step is x.copy_(new_x); y.copy_(new_y);
                g.replay()
  pgd_tier1     pygraph_dist.wrap(module returning the loss); loss = model(x, y)
  pgd_tier2     pygraph_dist.wrap(bare net); loss = F.cross_entropy(model(x), y)
                (the loss computed inside the backward graph: loss_lane.py)
  pgd_tier2_eager_loss
                pgd_tier2 with wrap(loss_graphs=False): the loss and its
                backward eager between the graphs, as before the loss lane
  pgd_clip      pgd_tier2 + torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                between backward and step (tier 2: the clip a graph of its own,
                replayed at the call; split_clip.py). The table's footer says
                what the loop's model.parameters() costs where it is walked
                (eager, DDP): the router reads a wrapped model's cached tuple
                instead (clip_route.parameters_of)
  pgd_clip_in   pgd_tier1 + the same clip_grad_norm_ between backward and step
                (tier 1: the clip moves into the step graph)
  pgd_accum4    pgd_tier2 over 4 micro-batches of 2 rows, the first 3 inside
                model.no_sync(), loss / 4
  hand_tier2    tier 2's floor, written by hand: a forward graph, a backward
                graph and a step graph (AdamW fused, capturable) sharing one
                pool, the forward's output handed out (a clone) through a
                minimal autograd.Function whose backward copies the gradient in
                and replays the backward graph; the pgd_tier2 loop around it
                (the user's cross-entropy and loss.backward() eager), the step
                graph at optimizer.step(). What any tier 2 pays besides
                pygraph_dist's own bookkeeping: the user's loss, autograd's
                backward call, three launches
  callables     torch's own tier-2 recipe, by hand: the bare net through
                torch.cuda.make_graphed_callables (a forward and a backward graph
                behind an autograd.Function), the pgd_tier2 loop, AdamW(fused)
                stepping eagerly. The floor of any loop that computes its loss
                outside the graphs: the user's loss, autograd's backward pass and
                the step's launches are all in it
  eager         the bare net, plain (no DDP: one process, nothing to reduce),
                the pgd_tier2 loop; AdamW fused

Columns (times per optimizer step, after --warmup steps):

  params      parameter tensors of the model
  wall ms     (t_end - t_start) / --steps over --steps back-to-back steps,
              synchronised before and after only (what a training loop gets)
  host us     mean over --steps of perf_counter() around one step's Python calls,
              the GPU synchronised (untimed) between steps, so no launch waits
              for the GPU: the host's own cost of a step
  host p50    median of the same samples, us
  +hand us    host us minus the hand recipe's, same model (the issue's budget:
              tier 1 <= +15 us, tier 2 <= tier 1 + 150 us, clip <= tier 1 + 250 us)
  +floor us   the tier-2 modes' host us minus hand_tier2's, same model: what
              pygraph_dist adds to what any loop with its loss outside pays
  tier        pygraph_dist's report: 1 (one graph per iteration), 2 (forward,
              backward and step graphs), 3 (eager); with its phase
  kernels     --kernels only: GPU operations (kernels, memcpy, memset) per step
              and their summed GPU time (us), torch.profiler over 5 steps

By user call (every mode but hand; a third pass, spans off): the host p50 of
the model call, optimizer.step() and zero_grad() each, through thin proxies
around the loop's model and optimizer, and of the rest of the step (the
user's loss, backward(), a clip: the step minus those calls). It says where
a loop's time goes without a profiler (session 37: the model call is most of
tier 1's, backward() most of tier 2's).

Breakdown (pgd modes; a second process with PYGRAPH_DIST_HOST_SPANS=1, see
python/pygraph_dist/runtime/spans.py): each phase's *exclusive* host time per step,
in us, measured with perf_counter_ns spans around the engine's functions
during the host pass; "outside spans" is the spans-on host time minus the
phases (the user's loop itself, nn.Module.__call__, torch's ops and autograd).
Spans cost about ``span_ns`` each (measured, in the JSON), so the spans-on
total is above the spans-off "host us".

Usage:
  python benchmarks/host_cost.py                          # GPU: 3 sizes x 6 modes, 1000 steps
  python benchmarks/host_cost.py --layers 8 --steps 300 --kernels
  python benchmarks/host_cost.py --smoke                  # CPU: eager and pgd (graphs=False), tiny
Writes <out-dir>/<name>.json, <name>.txt (the table) and <name>.png (host time
per step, stacked by phase, one panel per model size).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

WIDTH, CLASSES, BATCH, ACCUM, CLIP_NORM, LR, BATCHES = 256, 10, 8, 4, 1.0, 1e-4, 8
ALL_MODES = ["hand", "pgd_tier1", "pgd_clip_in", "hand_tier2", "callables", "pgd_tier2", "pgd_tier2_eager_loss",
             "pgd_clip", "pgd_accum4", "eager"]
GPU_ONLY = {"hand", "hand_tier2", "callables"}
LABELS = {
    "hand": "hand-written whole-iteration graph",
    "pgd_tier1": "pygraph_dist, loss in the module",
    "hand_tier2": "hand-written forward, backward and step graphs, loss outside",
    "callables": "torch.cuda.make_graphed_callables, loss outside, eager fused step",
    "pgd_tier2": "pygraph_dist, loss outside",
    "pgd_tier2_eager_loss": "pygraph_dist, loss outside, loss_graphs=False",
    "pgd_clip": "pygraph_dist, loss outside + clip_grad_norm_",
    "pgd_clip_in": "pygraph_dist, loss in the module + clip_grad_norm_",
    "pgd_accum4": "pygraph_dist, loss outside, 4 micro-batches (no_sync)",
    "eager": "eager (no DDP, one process)",
}
# What each phase of the breakdown holds (the functions carrying spans.timed).
PHASES = {
    "model call": "Engine.run/_train_call/_split_* own code: routing, capture policy, bookkeeping",
    "signature": "pytree flatten of the call, the signature key and cache lookup, autocast state",
    "drift": "GraphCache.drift: optimizer state version, parameter storages and requires_grad, hyperparameters",
    "input copies": "the call's tensors copied into the static inputs",
    "grad views": "reducer.expose_grads / SplitGraphs.attach_grads: .grad back to the bucket views",
    "launch": "ReplayWatchdog.replay: the graph launches (C++, GIL released); tier 1's steady replay "
              "(Engine._replay_owned): its checks, input copies, .grad views, launch and loss hand-out, "
              "one C++ call",
    "watchdog": "ReplayWatchdog.after_replay: the watchdog's event after a tier-1 replay",
    "hand-out": "Engine._hand_out: fresh loss and outputs of a tier-1 replay",
    "tier-2 forward": "SplitGraphs.forward's own code: reducer flags, the call record, the output structure",
    "autograd.Function": "_GraphedCall forward/backward, SplitGraphs.backward, the end-of-backward callback",
    "loop state": "LoopState transitions: model_called, handed_out, backward_called, step_called, zero_grad_called",
    "monitor": "LoopMonitor start/stop, and __torch_function__ per user op while it watches",
    "accumulation": "LearnedAccumulation bookkeeping and its .grad read guard",
    "step routing": "Engine.optimizer_step's own code (tier 2: drift check and step graph routing)",
    "zero_grad routing": "Engine.optimizer_zero_grad's own code",
    "clip graph": "SplitClip.call: tier 2's clip_grad_norm_ checked, its graph launched, its norm copied",
    "torch zero_grad": "torch's Optimizer.zero_grad, where the loop runs it (tier 2)",
    "outside spans": "spans-on host time minus the phases: the loop itself, nn.Module.__call__, torch ops, autograd",
}


# ============================================================ models and loops
def build_net(layers: int):
    from torch import nn

    mods: list = []
    for _ in range(layers):
        mods += [nn.Linear(WIDTH, WIDTH), nn.GELU()]
    mods.append(nn.Linear(WIDTH, CLASSES))
    return nn.Sequential(*mods)


def with_loss(net):
    import torch.nn.functional as F
    from torch import nn

    class WithLoss(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = net

        def forward(self, x, y):
            return F.cross_entropy(self.net(x), y)

    return WithLoss()


def loop_inside(model, opt, x, y, clip: bool = False):
    import torch

    opt.zero_grad(set_to_none=True)
    loss = model(x, y)
    loss.backward()
    if clip:
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP_NORM)
    opt.step()
    return loss


def loop_outside(model, opt, x, y, clip: bool = False):
    import torch
    import torch.nn.functional as F

    opt.zero_grad(set_to_none=True)
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    if clip:
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP_NORM)
    opt.step()
    return loss


def loop_accum(model, opt, x, y):
    import torch.nn.functional as F

    opt.zero_grad(set_to_none=True)
    xs, ys = x.chunk(ACCUM), y.chunk(ACCUM)
    for k in range(ACCUM):
        ctx = contextlib.nullcontext() if k == ACCUM - 1 else model.no_sync()
        with ctx:
            loss = F.cross_entropy(model(xs[k]), ys[k]) / ACCUM
        loss.backward()
    opt.step()
    return loss


class Mode:
    """One (mode, model size): ``setup()``, then ``step(x, y)`` per optimizer step."""

    def __init__(self, name: str, layers: int, dev, batches) -> None:
        self.name, self.layers, self.dev, self.batches = name, layers, dev, batches
        self.cuda = dev.type == "cuda"
        self.info: dict = {}

    def net(self):
        import torch

        torch.manual_seed(0)
        return build_net(self.layers).to(self.dev)

    def adamw(self, params, **kw):
        import torch

        return torch.optim.AdamW(params, lr=LR, fused=self.cuda, **kw)

    def setup(self) -> None:
        if self.name == "hand":
            return self._setup_hand()
        if self.name == "hand_tier2":
            return self._setup_hand_tier2()
        net = self.net()
        self.n_params = len(list(net.parameters()))
        opt = self.adamw(net.parameters())
        if self.name == "eager":
            self.model, self.opt, self.fn = net, opt, loop_outside
            return
        if self.name == "callables":
            import torch

            graphed = torch.cuda.make_graphed_callables(net, (self.batches[0][0].clone(),))
            self.model, self.opt, self.fn = graphed, opt, loop_outside
            return
        import pygraph_dist as pgd

        module = with_loss(net) if self.name in ("pgd_tier1", "pgd_clip_in") else net
        self.model, self.opt = pgd.wrap(module, opt, loss_graphs=self.name != "pgd_tier2_eager_loss")
        self.fn = {"pgd_tier1": loop_inside, "pgd_tier2": loop_outside, "pgd_accum4": loop_accum,
                   "pgd_tier2_eager_loss": loop_outside,
                   "pgd_clip": lambda m, o, x, y: loop_outside(m, o, x, y, clip=True),
                   "pgd_clip_in": lambda m, o, x, y: loop_inside(m, o, x, y, clip=True)}[self.name]

    def _setup_hand(self) -> None:
        import torch

        model = with_loss(self.net())
        self.n_params = len(list(model.parameters()))
        opt = self.adamw(model.parameters(), capturable=True)
        sx, sy = (t.clone() for t in self.batches[0])
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                loop_inside(model, opt, sx, sy)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        opt.zero_grad(set_to_none=True)
        with torch.cuda.graph(graph):
            loss = model(sx, sy)
            loss.backward()
            opt.step()
        self.model, self.opt, self.graph, self.static = model, opt, graph, (sx, sy, loss)

    def _setup_hand_tier2(self) -> None:
        import torch

        net = self.net()
        self.n_params = len(list(net.parameters()))
        opt = self.adamw(net.parameters(), capturable=True)
        sx = self.batches[0][0].clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                loop_outside(net, opt, sx, self.batches[0][1])
        torch.cuda.current_stream().wait_stream(side)
        opt.zero_grad(set_to_none=True)  # backward's gradients are allocated in the pool, then static
        fwd, bwd, step = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        with torch.cuda.graph(fwd):
            out = net(sx)
        grad_out = torch.zeros_like(out)
        with torch.cuda.graph(bwd, pool=fwd.pool()):
            out.backward(grad_out)
        with torch.cuda.graph(step, pool=fwd.pool()):
            opt.step()

        class Forward(torch.autograd.Function):
            @staticmethod
            def forward(ctx, anchor):  # noqa: ARG004 - anchor: an input requiring grad
                return out.detach().clone()

            @staticmethod
            def backward(ctx, g):  # noqa: ARG004
                grad_out.copy_(g)
                bwd.replay()
                return None

        anchor = torch.zeros((), device=self.dev, requires_grad=True)

        def model(x):
            sx.copy_(x, non_blocking=True)
            fwd.replay()
            return Forward.apply(anchor)

        class Step:
            def zero_grad(self, set_to_none=True):  # noqa: ARG002 - the graphs own the gradients
                pass

            def step(self):
                step.replay()

        self.model, self.opt, self.fn = model, Step(), loop_outside
        self.graphs = (fwd, bwd, step)

    def step(self, x, y):
        if self.name == "hand":
            sx, sy, loss = self.static
            sx.copy_(x, non_blocking=True)
            sy.copy_(y, non_blocking=True)
            self.graph.replay()
            return loss
        return self.fn(self.model, self.opt, x, y)

    def describe(self) -> None:
        """pygraph_dist's report of this model: tier and phase of its graph."""
        engine = getattr(self.model, "engine", None)
        if engine is None:
            return
        graphs = engine.describe().graphs
        g = graphs[-1] if graphs else None
        self.info = {"tier": g.tier if g else "", "phase": g.phase if g else "",
                     "loop": engine.describe().loop}

    def teardown(self) -> None:
        for graph in (getattr(self, "graph", None), *getattr(self, "graphs", ())):
            if graph is not None:
                graph.reset()
        engine = getattr(self.model, "engine", None)
        if engine is not None:
            engine.teardown()
        self.__dict__.pop("model", None)
        self.__dict__.pop("opt", None)
        self.__dict__.pop("static", None)


# ============================================================ measurement
def sync(dev) -> None:
    import torch

    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def wall_per_step(mode: Mode, steps: int, start: int = 0) -> float:
    """Seconds per step of ``steps`` back-to-back steps from batch ``start`` on,
    the GPU synchronised at both ends (also ``wall_ab.py``'s blocks)."""
    batches = mode.batches
    sync(mode.dev)
    t0 = time.perf_counter()
    for i in range(start, start + steps):
        mode.step(*batches[i % len(batches)])
    sync(mode.dev)
    return (time.perf_counter() - t0) / steps


def host_times(mode: Mode, steps: int, start: int = 0) -> list[float]:
    """Seconds of host time of each of ``steps`` steps, from batch ``start`` on:
    perf_counter around one step, the GPU synchronised (untimed) between steps."""
    batches, out = mode.batches, []
    for i in range(start, start + steps):
        x, y = batches[i % len(batches)]
        t = time.perf_counter()
        mode.step(x, y)
        out.append(time.perf_counter() - t)
        sync(mode.dev)
    return out


def measure(mode: Mode, steps: int, warmup: int, spans=None, calls: bool = True) -> dict:
    """Wall and host time per step of one mode (see the module docstring)."""
    batches, dev = mode.batches, mode.dev
    for i in range(warmup):
        mode.step(*batches[i % len(batches)])
    sync(dev)
    mode.describe()
    wall = wall_per_step(mode, steps)
    if spans is not None:
        spans.reset()
    host = host_times(mode, steps)
    row = {"wall_ms": wall * 1e3, "host_us": statistics.fmean(host) * 1e6,
           "host_p50_us": statistics.median(host) * 1e6}
    if getattr(mode, "fn", None) is not None and spans is None and calls:
        row["calls_us"] = by_call(mode, steps)
    if spans is not None:
        snap = spans.snapshot()
        phases = {p: v["ns"] / steps / 1e3 for p, v in snap.items() if v["calls"]}
        row["phases_us"] = phases
        row["phase_calls"] = {p: v["calls"] / steps for p, v in snap.items() if v["calls"]}
        row["phases_us"]["outside spans"] = max(0.0, row["host_us"] - sum(phases.values()))
    return row


class _Timed:
    """A thin proxy around the loop's model or optimizer: the host time of each
    call of ``timed`` (its name -> a list in ``into``), every other attribute
    passed through (model.parameters(), model.no_sync(), ...)."""

    def __init__(self, target, into: dict, **timed: str) -> None:
        self._target, self._into, self._timed = target, into, timed

    def __call__(self, *args, **kwargs):
        return self._time("__call__", self._target, args, kwargs)

    def __getattr__(self, name):
        attr = getattr(self._target, name)
        if name not in self._timed:
            return attr
        return lambda *args, **kwargs: self._time(name, attr, args, kwargs)

    def _time(self, name, fn, args, kwargs):
        t = time.perf_counter_ns()
        try:
            return fn(*args, **kwargs)
        finally:
            self._into.setdefault(self._timed[name], []).append(time.perf_counter_ns() - t)


CALLS = ("model call", "optimizer.step()", "zero_grad()", "the rest")


def by_call(mode: Mode, steps: int) -> dict:
    """Host us per step of each user call of the loop (the p50 over ``steps``
    steps of each step's sum, GPU synchronised between steps, as the host
    pass): the model call (all micro-batches' calls), the optimizer's step()
    and zero_grad(), and the rest of the step (the user's loss, backward(), a
    clip), which is the step's time minus those calls. A third pass, through
    :class:`_Timed` proxies (well under 1 us a call)."""
    times: dict[str, list[int]] = {}  # every call's ns, by name
    per_step: dict[str, list[int]] = {c: [] for c in CALLS}  # each step's sum, by name
    model = _Timed(mode.model, times, __call__="model call")
    opt = _Timed(mode.opt, times, step="optimizer.step()", zero_grad="zero_grad()")
    batches, dev = mode.batches, mode.dev
    for i in range(steps):
        x, y = batches[i % len(batches)]
        before = {k: len(v) for k, v in times.items()}
        t = time.perf_counter_ns()
        mode.fn(model, opt, x, y)
        total = time.perf_counter_ns() - t
        for c in CALLS[:-1]:  # a call made k times a step (micro-batches): the k calls' sum
            per_step[c].append(sum(times.get(c, [])[before.get(c, 0):]))
        per_step["the rest"].append(total - sum(per_step[c][-1] for c in CALLS[:-1]))
        sync(dev)
    return {c: statistics.median(v) / 1e3 for c, v in per_step.items() if any(v)}


def gpu_ops(mode: Mode, n: int = 5) -> dict:
    """GPU operations per step and their summed GPU time (torch.profiler)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:  # as profile_replay.py
        for i in range(n):
            mode.step(*mode.batches[i % len(mode.batches)])
        torch.cuda.synchronize(mode.dev)
    ops = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
           and getattr(e, "time_range", None) is not None]
    by_name: dict[str, list[float]] = {}
    for e in ops:  # which kernels a mode runs that another does not (JSON only), by full name:
        by_name.setdefault(e.name, []).append(e.time_range.elapsed_us())  # foreach kernels differ at the end
    top = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:15]
    return {"gpu_ops": len(ops) / n, "gpu_ops_us": sum(e.time_range.elapsed_us() for e in ops) / n,
            "gpu_ops_by_name": [{"name": k[:400], "per_step": len(v) / n, "us_per_step": sum(v) / n}
                                for k, v in top]}


def make_batches(dev) -> list:
    """The ``BATCHES`` (inputs, targets) pairs every mode trains on, seeded."""
    import torch

    torch.manual_seed(1)
    return [(torch.randn(BATCH, WIDTH, device=dev), torch.randint(0, CLASSES, (BATCH,), device=dev))
            for _ in range(BATCHES)]


def run_all(args, modes: list[str], spans=None) -> list[dict]:
    import torch

    import pygraph_dist as pgd

    dev = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    pgd.init()
    batches = make_batches(dev)
    rows = []
    for layers in args.layers:
        for name in modes:
            if name in GPU_ONLY and dev.type != "cuda":
                continue
            mode = Mode(name, layers, dev, batches)
            row = {"mode": name, "label": LABELS[name], "layers": layers}
            try:
                mode.setup()
                row["params"] = mode.n_params
                row.update(measure(mode, args.steps, args.warmup, spans, calls=not args.no_calls))
                if name in ("pgd_clip", "pgd_clip_in"):  # the clip modes' own model.parameters()
                    row["parameters_us"] = parameters_us(mode.model)
                if args.kernels and dev.type == "cuda":
                    row.update(gpu_ops(mode))
                row.update(mode.info)
                row["status"] = "ok"
            except Exception as exc:  # noqa: BLE001 - one failing mode must not lose the others
                row.update(status="error", reason=f"{type(exc).__name__}: {exc}")
            finally:
                mode.teardown()
                del mode
                if dev.type == "cuda":
                    torch.cuda.empty_cache()
            rows.append(row)
            print(f"[host_cost] {name:<11} L={layers:<4} " + (
                f"wall {row['wall_ms']:.3f} ms  host {row['host_us']:.1f} us" if row["status"] == "ok"
                else row["reason"]), file=sys.stderr, flush=True)
    return rows


def parameters_us(model, n: int = 200) -> float:
    """Host us of ``list(model.parameters())``: the generator the clip modes'
    loop builds every step (its clip_grad_norm_(model.parameters(), ...)),
    paid by that loop under DDP or eager alike."""
    t0 = time.perf_counter()
    for _ in range(n):
        list(model.parameters())
    return (time.perf_counter() - t0) / n * 1e6


# ============================================================ output
# Issue 26's bars in wall time: a mode's allowance over the hand recipe, as
# (mode it is measured from, allowance in us); the hand recipe's own row is 0.
WALL_BARS = {"pgd_tier1": ("hand", 15.0), "pgd_tier2": ("pgd_tier1", 150.0), "pgd_clip": ("pgd_tier1", 250.0)}


def add_deltas(rows: list[dict]) -> None:
    ref = {(r["layers"], r["mode"]): r for r in rows if r["status"] == "ok"}
    for r in rows:
        if r["status"] != "ok":
            continue
        hand = ref.get((r["layers"], "hand"))
        if hand is not None:
            r["host_vs_hand_us"] = r["host_us"] - hand["host_us"]
            r["wall_vs_hand_ms"] = r["wall_ms"] - hand["wall_ms"]
        t1 = ref.get((r["layers"], "pgd_tier1"))
        if t1 is not None and (r["mode"].startswith("pgd") or r["mode"] in ("callables", "hand_tier2")):
            r["host_vs_tier1_us"] = r["host_us"] - t1["host_us"]
        floor = ref.get((r["layers"], "hand_tier2"))  # what a loss-outside loop pays anyway
        if floor is not None and r["mode"] in ("pgd_tier2", "pgd_tier2_eager_loss", "pgd_clip", "pgd_accum4"):
            r["host_vs_floor_us"] = r["host_us"] - floor["host_us"]
        bar = WALL_BARS.get(r["mode"])
        base = ref.get((r["layers"], bar[0])) if bar is not None else None
        if hand is not None and base is not None:  # issue 26's bar, in wall time
            r["wall_bar_us"] = (base["wall_ms"] - hand["wall_ms"]) * 1e3 + bar[1]
            r["wall_bar_met"] = r["wall_vs_hand_ms"] * 1e3 <= r["wall_bar_us"]


def table(rows: list[dict], env: dict) -> str:
    head = (f"{'mode':<11} {'params':>6} {'wall ms':>8} {'host us':>8} {'host p50':>8} {'+hand us':>8} "
            f"{'+tier1 us':>9} {'+floor us':>9} {'tier':>4} {'phase':<7} {'kernels':>8} {'kern us':>8}")
    lines = [f"host cost per step; {env.get('device', '')}; torch {env.get('torch', '')}; "
             f"steps {env.get('steps')} after {env.get('warmup')} warm-up", head, "-" * len(head)]
    fmt = lambda v, f: format(v, f) if isinstance(v, (int, float)) else "-"  # noqa: E731
    for r in rows:
        if r["status"] != "ok":
            lines.append(f"{r['mode']:<11} L={r['layers']}: {r['status']}: {r.get('reason', '')}")
            continue
        lines.append(f"{r['mode']:<11} {r['params']:>6} {r['wall_ms']:>8.3f} {r['host_us']:>8.1f} "
                     f"{r['host_p50_us']:>8.1f} {fmt(r.get('host_vs_hand_us'), '>8.1f'):>8} "
                     f"{fmt(r.get('host_vs_tier1_us'), '>9.1f'):>9} {fmt(r.get('host_vs_floor_us'), '>9.1f'):>9} "
                     f"{str(r.get('tier', '')):>4} "
                     f"{str(r.get('phase', '')):<7} {fmt(r.get('gpu_ops'), '>8.0f'):>8} "
                     f"{fmt(r.get('gpu_ops_us'), '>8.1f'):>8}")
    barred = [r for r in rows if "wall_bar_us" in r]
    if barred:
        lines.append("issue 26's bars, wall us over the hand recipe (tier 1 <= +15; tier 2 <= tier 1 + 150; "
                     "tier 2 + clip <= tier 1 + 250): " + ", ".join(
                         f"{r['mode']}/{r['params']} {r['wall_vs_hand_ms'] * 1e3:+.0f} "
                         f"{'<=' if r['wall_bar_met'] else '>'} {r['wall_bar_us']:.0f}" for r in barred))
    own = [r for r in rows if r.get("parameters_us") is not None]
    if own:
        lines.append("the clip modes' model.parameters() walked, as eager and DDP pay it every step "
                     "(pygraph_dist reads its cached tuple instead): "
                     + ", ".join(f"{r['mode']}/{r['params']} {r['parameters_us']:.0f} us" for r in own))
    broken = [r for r in rows if r.get("phases_us")]
    if broken:
        lines += ["", "host us per step by phase (exclusive; spans on, second process):"]
        order = [p for p in PHASES if any(p in r["phases_us"] for r in broken)]
        lines.append(f"{'phase':<18}" + "".join(f"{r['mode'][4:] + '/' + str(r['params']):>14}" for r in broken))
        for p in order + ["total (spans on)"]:
            vals = [r["phases_us"].get(p) if p != "total (spans on)" else r.get("spans_host_us", r["host_us"])
                    for r in broken]
            lines.append(f"{p:<18}" + "".join(f"{fmt(v, '>14.1f'):>14}" for v in vals))
    called = [r for r in rows if r.get("calls_us")]
    if called:
        lines += ["", "host us per step by user call (p50; a third pass through thin proxies; the rest = "
                  "the step minus those calls: the user's loss, backward(), a clip):"]
        lines.append(f"{'call':<18}" + "".join(f"{r['mode'] + '/' + str(r['params']):>14}" for r in called))
        for c in CALLS:
            lines.append(f"{c:<18}" + "".join(f"{fmt(r['calls_us'].get(c), '>14.1f'):>14}" for r in called))
    lines += ["", "columns: params = parameter tensors; wall ms = back-to-back steps, synchronised at the ends; "
              "host us = mean perf_counter around one step, GPU synchronised (untimed) between steps; "
              "+hand/+tier1 = host us minus the hand recipe's / tier 1's (same model); +floor = tier 2's "
              "host us minus hand_tier2's (what pygraph_dist adds to a loss-outside loop); tier/phase = "
              "pygraph_dist's report; kernels = GPU ops per step (--kernels)."]
    return "\n".join(lines)


def plot(result: dict, path: Path) -> Path | None:
    """Top row: host time per step by phase; bottom row (when the hand recipe
    ran): wall time per step over the hand recipe's, with issue 26's bars."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    rows = [r for r in result["rows"] if r["status"] == "ok"]
    sizes = sorted({r["layers"] for r in rows})
    phases = list(PHASES)
    cmap = plt.get_cmap("tab20")
    walls = any(r["mode"] == "hand" for r in rows)
    fig, axes = plt.subplots(2 if walls else 1, len(sizes), squeeze=False,
                             figsize=(max(10.0, 5.5 * len(sizes)), 9.5 if walls else 5.5))
    for ax, layers in zip(axes[0], sizes):
        rs = [r for r in rows if r["layers"] == layers]
        xs = range(len(rs))
        for x, r in zip(xs, rs):
            bottom = 0.0
            split = r.get("phases_us")
            if split:
                for i, p in enumerate(phases):
                    v = split.get(p, 0.0)
                    if v > 0:
                        ax.bar(x, v, bottom=bottom, color=cmap(i % 20), width=0.7,
                               label=p if (layers == sizes[0] and p not in ax.get_legend_handles_labels()[1]) else None)
                        bottom += v
            else:
                ax.bar(x, r["host_us"], color="0.6", width=0.7)
            ax.plot([x - 0.35, x + 0.35], [r["host_us"]] * 2, color="k", lw=1.5)
        ax.set_xticks(list(xs), [r["mode"] for r in rs], rotation=30, ha="right")
        ax.set_title(f"{layers} layers ({rs[0].get('params', '?')} parameter tensors)")
        ax.set_ylabel("host us per step")
    if walls:
        for ax, layers in zip(axes[1], sizes):
            _wall_panel(ax, [r for r in rows if r["layers"] == layers])
    handles, labels = [], []
    for ax in axes[0]:
        h, lab = ax.get_legend_handles_labels()
        for hh, ll in zip(h, lab):
            if ll not in labels:
                handles.append(hh)
                labels.append(ll)
    if handles:
        fig.legend(handles, labels, loc="upper center", ncol=min(6, max(1, len(labels))), fontsize=7)
    fig.suptitle("top: host time per step, bars = phases (spans on; grey = not broken down), black line = spans off"
                 + ("; bottom: wall time over the hand recipe, dashes = issue 26's bar" if walls else ""),
                 y=0.01, fontsize=8)
    fig.tight_layout(rect=(0, 0.03, 1, 0.9 if handles else 0.98))
    out = path.with_suffix(".png")
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def _wall_panel(ax, rs: list[dict]) -> None:
    """Wall us per step over the hand recipe's, one bar per mode; a mode with a
    bar in WALL_BARS (add_deltas: ``wall_bar_us``) is green within it, red over
    it, the bar drawn as a dash."""
    hand = next(r["wall_ms"] for r in rs if r["mode"] == "hand") * 1e3
    others = [r for r in rs if r["mode"] != "hand"]
    names = [r["mode"] for r in others]
    for x, r in enumerate(others):
        delta = r["wall_ms"] * 1e3 - hand
        color = "0.6"
        if "wall_bar_us" in r:  # add_deltas
            color = "tab:green" if r["wall_bar_met"] else "tab:red"
            ax.plot([x - 0.4, x + 0.4], [r["wall_bar_us"]] * 2, color="k", lw=1.2, ls="--")
        ax.bar(x, delta, color=color, width=0.7)
        ax.annotate(f"{delta:+.0f}", (x, max(delta, 0.0)), ha="center", va="bottom", fontsize=7)
    ax.axhline(0, color="k", lw=0.8)
    ax.set_xticks(list(range(len(names))), names, rotation=30, ha="right")
    ax.set_ylabel("wall us per step over the hand recipe")


def environment(args) -> dict:
    import torch

    import pygraph_dist

    dev = torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU ({platform.processor() or 'cpu'})"
    # package and cpus: which pygraph_dist this run imported, on which CPUs
    # (host_cost_ab.py checks that its --base side took effect and was pinned)
    return {"device": dev, "torch": torch.__version__, "python": platform.python_version(),
            "package": pygraph_dist.__file__, "cpus": ",".join(map(str, sorted(os.sched_getaffinity(0)))),
            "host": platform.node(), "steps": args.steps, "warmup": args.warmup,
            "settings": {k: v for k, v in os.environ.items() if k.startswith("PYGRAPH_DIST_")}}


# A launcher's variables, left out of the child processes' environment (one process each).
LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def spans_child(args, modes: list[str]) -> list[dict]:
    """The breakdown: the pgd modes again in a process with spans on."""
    import tempfile

    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    env["PYGRAPH_DIST_HOST_SPANS"] = "1"
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "spans.json"
        cmd = [sys.executable, str(Path(__file__)), "--spans-child", str(out), "--modes", ",".join(modes),
               "--layers", ",".join(map(str, args.layers)), "--steps", str(args.steps),
               "--warmup", str(args.warmup)]
        p = subprocess.run(cmd, env=env, timeout=args.timeout)
        if p.returncode != 0 or not out.exists():
            raise RuntimeError(f"the spans process failed (exit code {p.returncode})")
        return json.loads(out.read_text())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="Host cost per step of pygraph_dist vs the hand-written graph "
                                "and eager training (issue 26); see the module docstring for the columns.")
    p.add_argument("--layers", default="8,32,250", help="comma list of hidden Linear(256,256)+GELU layers")
    p.add_argument("--modes", default=",".join(ALL_MODES), help=f"comma list of {', '.join(ALL_MODES)}")
    p.add_argument("--steps", type=int, default=1000, help="timed steps per pass (wall and host)")
    p.add_argument("--warmup", type=int, default=20, help="steps before timing (pgd: probe, warm-up, capture)")
    p.add_argument("--kernels", action="store_true", help="also count GPU ops per step (torch.profiler, CUDA)")
    p.add_argument("--no-spans", action="store_true", help="skip the per-phase breakdown (second process)")
    p.add_argument("--no-calls", action="store_true", help="skip the by-user-call pass (a third pass per mode)")
    p.add_argument("--smoke", action="store_true",
                   help="CPU check of the harness: eager and pgd (graphs unavailable), 2 layers, 5 steps")
    p.add_argument("--out-dir", default=str(HERE / "results" / "tmp"))
    p.add_argument("--name", default=None, help="results file stem (default: host-cost-<date>)")
    p.add_argument("--timeout", type=float, default=1200, help="seconds the spans process may take")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--spans-child", default="", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.smoke:
        args.layers, args.steps, args.warmup = "2", min(args.steps, 5), min(args.warmup, 6)
    args.layers = [int(s) for s in str(args.layers).split(",") if s]
    modes = [m for m in args.modes.split(",") if m]
    unknown = set(modes) - set(ALL_MODES)
    if unknown:
        raise SystemExit(f"unknown modes {sorted(unknown)}; choose from {ALL_MODES}")

    if args.spans_child:
        from pygraph_dist.runtime import spans

        if not spans.ENABLED:
            raise SystemExit("--spans-child needs PYGRAPH_DIST_HOST_SPANS=1 before pygraph_dist is imported")
        import torch

        # torch's own zero_grad, which the tier-2 loop runs, as a phase of its own.
        torch.optim.Optimizer.zero_grad = spans.timed("torch zero_grad")(torch.optim.Optimizer.zero_grad)
        rows = run_all(args, modes, spans)
        for r in rows:
            r["span_ns"] = spans.overhead_ns()
        Path(args.spans_child).write_text(json.dumps(rows))
        _shutdown()
        return 0

    import torch

    if not torch.cuda.is_available() and not args.smoke:
        raise SystemExit("host_cost needs a CUDA GPU (use --smoke for the CPU check of the harness)")
    t0 = time.perf_counter()
    rows = run_all(args, modes)
    _shutdown()
    pgd_modes = [m for m in modes if m.startswith("pgd")]
    if pgd_modes and not args.no_spans:
        broken = {(r["mode"], r["layers"]): r for r in spans_child(args, pgd_modes)}
        for r in rows:
            b = broken.get((r["mode"], r["layers"]))
            if b is not None and b["status"] == "ok":
                r["phases_us"], r["phase_calls"] = b["phases_us"], b["phase_calls"]
                r["spans_host_us"], r["span_ns"] = b["host_us"], b["span_ns"]
    add_deltas(rows)
    env = environment(args)
    result = {"environment": env, "config": {k: v for k, v in vars(args).items() if k != "spans_child"},
              "columns": {"wall_ms": "ms per step, back-to-back steps", "host_us": "us per step, host only",
                          "phases_us": "us per step per phase (exclusive, spans on)"},
              "phases": PHASES, "wall_s": time.perf_counter() - t0, "rows": rows}
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    name = args.name or time.strftime("host-cost-%Y%m%d-%H%M%S")
    path = out_dir / f"{name}.json"
    path.write_text(json.dumps(result, indent=1))
    text = table(rows, env)
    path.with_suffix(".txt").write_text(text + "\n")
    print(text)
    if not args.no_plot:
        png = plot(result, path)
        print(f"[host_cost] plot {png}" if png else "[host_cost] no plot: matplotlib missing", file=sys.stderr)
    print(f"[host_cost] {len(rows)} rows -> {path}", file=sys.stderr)
    return 0 if all(r["status"] == "ok" for r in rows) else 1


def _shutdown() -> None:
    import pygraph_dist as pgd

    pgd.shutdown()


if __name__ == "__main__":
    sys.exit(main())
