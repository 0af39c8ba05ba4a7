"""Where an eager step's time goes: DDP against ``pygraph_dist.wrap(..., graphs=False)``
(issue 47: eager parity), per model of the coverage corpus.

    python benchmarks/eager_profile.py --models nn_transformer_lm,hf_gpt2 --out /tmp/eager.json
    torchrun --nproc-per-node 2 benchmarks/eager_profile.py --models hf_gpt2 --out /tmp/eager.json   (rank 0 writes)

Per model and mode (``ddp``, ``pgd_eager``; the corpus's loops, weights and
data, as ``coverage.py`` trains them), after setup and ``--warmup`` steps:

  ms/it      ``--steps`` steps timed around the whole loop, synchronised at both ends (mean)
  host       host ms per step, no synchronisation (median)
  kernels    GPU kernels per step and their summed time (torch.profiler over
             ``--profile-steps`` steps), by category: gemm, nccl, copy, optimizer,
             other; and the kernels pgd launches that DDP does not (by name)
  python     the functions with the most own host time per step under
             cProfile (``--profile-steps`` steps), pygraph_dist's own marked

The difference between the two modes' rows is what the eager path costs over
DDP, and where. ``--with-graphs`` adds pygraph_dist with graphs on to the
side-by-side rounds (for a model whose capture fails: its eager fallback).
cProfile's own times are rough: autograd runs backward on a
thread of its own, and its C++ time lands on whatever Python frame is open.

``--ab-rounds R`` (default 7) then times the two side by side: both models
built from the same weights and alive at once, ``--steps`` steps of one, then
of the other, alternating which goes first, ``R`` rounds; per round the ratio
ddp ms/it / pgd_eager ms/it. The row's ``ab`` gives the median ratio and its
spread: on a noisy host a single pass of each mode differs by more than the
two modes do.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import statistics
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from coverage import CorpusDDP, CorpusPGD, CorpusPGDEager, _memory_reset  # noqa: E402
from coverage_models import REGISTRY, select, to_device  # noqa: E402

MODES = (("ddp", CorpusDDP), ("pgd_eager", CorpusPGDEager))
CATEGORIES = (("nccl", ("nccl",)), ("gemm", ("gemm", "cutlass", "sm90", "sm80", "cublas")),
              ("optimizer", ("multi_tensor_apply", "adam", "foreach")),
              ("copy", ("copy", "memcpy", "memset", "cat", "fill")))


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def category(name: str) -> str:
    low = name.lower()
    for cat, keys in CATEGORIES:
        if any(k in low for k in keys):
            return cat
    return "other"


def kernels_per_step(mode, batches, steps: int) -> dict:
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        for i in range(steps):
            mode.step(batches[i % len(batches)])
        _sync()
    names, times, cats = Counter(), defaultdict(float), defaultdict(float)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            names[e.name] += 1
            us = e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
            times[e.name] += us
            cats[category(e.name)] += us
    return {"count": sum(names.values()) / steps, "gpu_ms": sum(times.values()) / steps / 1e3,
            "by_category_ms": {k: v / steps / 1e3 for k, v in sorted(cats.items())},
            "names": {k: v / steps for k, v in names.items()}}


def python_per_step(mode, batches, steps: int, top: int) -> list[dict]:
    prof = cProfile.Profile()
    prof.enable()
    for i in range(steps):
        mode.step(batches[i % len(batches)])
    prof.disable()
    stats = pstats.Stats(prof).stats  # (file, line, fn) -> (cc, nc, tottime, cumtime, callers)
    rows = sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]
    return [{"where": f"{Path(f).name}:{ln}({fn})", "ours": "pygraph_dist" in f,
             "calls": nc / steps, "own_us": tt / steps * 1e6, "cum_us": ct / steps * 1e6}
            for (f, ln, fn), (_, nc, tt, ct, _) in rows]


def started(cls, entry, batches, ctx: dict, args):
    """A mode of ``entry`` set up (coverage.py's setup) and ``--warmup`` steps on."""
    mode = cls(entry, "inside", batches, ctx["dev"], ctx["group"])
    mode.setup()
    for i in range(args.warmup):
        mode.step(batches[i % len(batches)])
    return mode


def run_model(name: str, ctx: dict, args) -> dict:
    entry = REGISTRY[name]
    g = torch.Generator().manual_seed(1000 * ctx["rank"])
    batches = [to_device(entry.make_batch(entry.batch, g), ctx["dev"]) for _ in range(2)]
    row = {"model": name, "what": entry.what, "world_size": ctx["ws"], "batch": entry.batch}
    import pygraph_dist as pgd

    cuda = ctx["dev"].type == "cuda"
    for mname, cls in MODES:
        _memory_reset(cuda)
        mode = started(cls, entry, batches, ctx, args)
        _sync()
        host = []
        t0 = time.perf_counter()
        for i in range(args.steps):
            t = time.perf_counter()
            mode.step(batches[i % 2])
            host.append((time.perf_counter() - t) * 1e3)
        _sync()
        out = {"ms_per_it": (time.perf_counter() - t0) * 1e3 / args.steps, "host_ms": statistics.median(host),
               "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30 if cuda else 0.0}
        out["kernels"] = kernels_per_step(mode, batches, args.profile_steps)
        out["python"] = python_per_step(mode, batches, args.profile_steps, args.top)
        if mname.startswith("pgd"):
            out["report"] = str(pgd.report())
        row[mname] = out
        mode.teardown()
        pgd.launch.lifetime.teardown_all()
        del mode
    if args.ab_rounds:
        row["ab"] = side_by_side(entry, batches, ctx, args)
    ddp, ours = row["ddp"]["kernels"]["names"], row["pgd_eager"]["kernels"]["names"]
    row["extra_kernels"] = {k: ours[k] - ddp.get(k, 0) for k in ours if ours[k] - ddp.get(k, 0) > 0.5}
    row["missing_kernels"] = {k: ddp[k] - ours.get(k, 0) for k in ddp if ddp[k] - ours.get(k, 0) > 0.5}
    return row


def side_by_side(entry, batches, ctx: dict, args) -> dict:
    """Both modes alive, ``--steps`` steps each in turn, ``--ab-rounds`` rounds."""
    import pygraph_dist as pgd

    modes = {}
    for mname, cls in MODES + ((("pgd", CorpusPGD),) if args.with_graphs else ()):
        modes[mname] = started(cls, entry, batches, ctx, args)
    per = {m: [] for m in modes}
    for r in range(args.ab_rounds):
        order = list(modes) if r % 2 == 0 else list(reversed(modes))
        for m in order:
            _sync()
            t0 = time.perf_counter()
            for i in range(args.steps):
                modes[m].step(batches[i % 2])
            _sync()
            per[m].append((time.perf_counter() - t0) * 1e3 / args.steps)
    report = str(pgd.report().models[-1]) if "pgd" in modes else ""
    for m in modes.values():
        m.teardown()
    pgd.launch.lifetime.teardown_all()
    out = {"rounds": args.ab_rounds, "steps": args.steps, "ms_per_it": per,
           "ddp_median_ms": statistics.median(per["ddp"])}
    for m in modes:
        if m != "ddp":
            ratios = sorted(d / e for d, e in zip(per["ddp"], per[m]))
            out[m] = {"median_ms": statistics.median(per[m]), "ratio_median": statistics.median(ratios),
                      "ratio_min": ratios[0], "ratio_max": ratios[-1]}
    if report:
        out["pgd"]["report"] = report
    return out


def text(row: dict) -> str:
    lines = [f"== {row['model']} ({row['what']}), N={row['world_size']}, batch {row['batch']}"]
    for m in ("ddp", "pgd_eager"):
        r = row[m]
        k = r["kernels"]
        cats = "  ".join(f"{c} {v:.3f}" for c, v in k["by_category_ms"].items())
        lines.append(f"  {m:<10} {r['ms_per_it']:8.3f} ms/it  host {r['host_ms']:7.3f} ms  "
                     f"{k['count']:6.1f} kernels {k['gpu_ms']:7.3f} GPU ms ({cats})  "
                     f"peak rsv {r['peak_reserved_gib']:.2f} GiB")
    lines.append(f"  ratio ddp/pgd_eager: {row['ddp']['ms_per_it'] / row['pgd_eager']['ms_per_it']:.3f}x (one pass each)")
    ab = row.get("ab")
    if ab:
        lines.append(f"  side by side, {ab['rounds']} rounds of {ab['steps']} steps: ddp {ab['ddp_median_ms']:.3f} ms")
        for m in ("pgd_eager", "pgd"):
            if m in ab:
                a = ab[m]
                lines.append(f"    {m:<10} {a['median_ms']:.3f} ms; ddp/{m} median {a['ratio_median']:.3f}x "
                             f"(rounds {a['ratio_min']:.3f}-{a['ratio_max']:.3f})")
        if "report" in ab.get("pgd", {}):
            lines += ["    " + line for line in ab["pgd"]["report"].splitlines()]
    for label, key in (("kernels pgd adds per step", "extra_kernels"), ("kernels DDP has and pgd not", "missing_kernels")):
        items = sorted(row[key].items(), key=lambda kv: -kv[1])[:8]
        if items:
            lines.append(f"  {label}: " + "; ".join(f"{n[:70]} x{c:.1f}" for n, c in items))
    for m in ("ddp", "pgd_eager"):
        lines.append(f"  host, {m}: top own time per step (us)")
        for p in row[m]["python"]:
            lines.append(f"    {'*' if p['ours'] else ' '} {p['own_us']:8.1f} own {p['cum_us']:8.1f} cum "
                         f"{p['calls']:7.1f} calls  {p['where']}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="nn_transformer_lm,hf_gpt2,tv_resnet18")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--profile-steps", type=int, default=5)
    p.add_argument("--top", type=int, default=20)
    p.add_argument("--ab-rounds", type=int, default=7, help="side-by-side rounds (0: none)")
    p.add_argument("--with-graphs", action="store_true", help="side by side also with pygraph_dist's default "
                   "(graphs on): for a model whose capture fails, what its users get")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    import torch.distributed as dist

    import pygraph_dist as pgd

    env = pgd.init()
    cuda = torch.cuda.is_available()  # on a CPU (Gloo): the host side only, no kernels
    dev = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    ctx = {"rank": env.rank, "ws": env.world_size, "dev": dev,
           "group": dist.new_group(backend="nccl" if cuda else "gloo")}
    rows = []
    for name in select(args.models):
        row = run_model(name, ctx, args)
        rows.append(row)
        if env.rank == 0:
            print(text(row), flush=True)
    if env.rank == 0:
        for m, what in (("pgd_eager", "graphs=False"), ("pgd", "pygraph_dist (graphs on)")):
            abs_ = [(r["model"], r["ab"][m]["ratio_median"]) for r in rows if m in r.get("ab", {})]
            if abs_:
                print(f"# side by side: {what} >= 0.98x DDP on {sum(a >= 0.98 for _, a in abs_)} of {len(abs_)} "
                      f"models ({', '.join(f'{n} {a:.3f}' for n, a in abs_)})", flush=True)
    if env.rank == 0 and args.out:
        Path(args.out).write_text(json.dumps({"rows": rows, "torch": torch.__version__,
                                              "gpu": torch.cuda.get_device_name() if cuda else "CPU",
                                              "world_size": env.world_size}, indent=1))
    pgd.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
