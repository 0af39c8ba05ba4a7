"""Soak: many replays of one graph, memory sampled as they go; and what the replay
watchdog costs per replay.

    python benchmarks/soak.py --replays 10000 --out benchmarks/results/soak.json
    torchrun --nproc-per-node 2 benchmarks/soak.py ...   (every rank; rank 0 writes)

Two models of the same shape are wrapped in one process: one with the native
replay watchdog on (the default, ``replay_timeout`` = the group's timeout) and
one with it off (``replay_timeout=0``). They replay in alternating blocks, so
both see the same machine state; the ratio of their medians is the watchdog's
cost per replay.

Memory: every ``--sample-every`` replays of the watched model, after a device
sync: ``torch.cuda.memory_allocated``, ``memory_reserved`` and host RSS
(``/proc/self/statm``), and the Python heap's block count
(``sys.getallocatedblocks``). Host values are read at a quiet point:
``gc.collect()``, the watched model's replay watchdog drained (its poller drops
completed replays once per ``poll_s``, up to 1 s, so up to a second of replays'
labels and events are queued at any moment), then ``malloc_trim(0)`` (freed heap
pages back to the OS: a queue that once ran longer leaves its high-water mark
in RSS otherwise). Live memory is never trimmed, so a leak still shows; the
raw RSS before quieting is kept as ``rss_raw``. Flat means allocated, reserved
and RSS each moved by at most ``--flat-mib`` (1 MiB), and the Python heap by at
most ``--flat-blocks`` blocks (a leak of one object per step is ~18k), between
the sample at 1k replays and the last one; the JSON says which moved and by how
much, and the exit code is 1 if one did (``--check``). A PNG of the curves is
written next to the JSON when matplotlib is installed.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import pygraph_dist as pgd

MIB = 1024 * 1024


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _malloc_trim():
    try:
        return ctypes.CDLL(None).malloc_trim  # glibc; absent elsewhere (musl, macOS)
    except (OSError, AttributeError):
        return None


MALLOC_TRIM = _malloc_trim()


def watchdog_pending(model) -> int:
    """Replays the model's native watchdog still holds (0 without one)."""
    watchdog = getattr(model.engine, "watchdog", None)
    return watchdog.pending if watchdog is not None else 0


def host_sample(model, wait_s: float = 3.0) -> dict:
    """Host memory at a quiet point (the device already synchronised): RSS as
    found, then after a GC, the watchdog's queue drained and malloc_trim."""
    raw, pending = rss_bytes(), watchdog_pending(model)
    gc.collect()
    deadline = time.perf_counter() + wait_s  # the poller wakes every poll_s <= 1 s
    while watchdog_pending(model) and time.perf_counter() < deadline:
        time.sleep(0.01)
    if MALLOC_TRIM is not None:
        MALLOC_TRIM(0)
    return {"rss": rss_bytes(), "py_blocks": sys.getallocatedblocks(), "rss_raw": raw,
            "watchdog_pending": pending, "watchdog_pending_after": watchdog_pending(model)}


class MLP(nn.Module):
    def __init__(self, width: int, depth: int, classes: int = 10, logits: bool = False) -> None:
        super().__init__()
        self.body = nn.Sequential(*[m for _ in range(depth) for m in (nn.Linear(width, width), nn.GELU())])
        self.head = nn.Linear(width, classes)
        self.logits = logits

    def forward(self, x, y=None):
        out = self.head(self.body(x))
        return out if self.logits else F.cross_entropy(out, y)


def make(args, dev, replay_timeout):
    torch.manual_seed(0)
    m = MLP(args.width, args.depth, logits=args.loop == "outside").to(dev)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-4)
    kw = {} if replay_timeout is None else {"replay_timeout": replay_timeout}
    return pgd.wrap(m, opt, amp="bf16", **kw)


def step(model, opt, x, y, loop):
    opt.zero_grad(set_to_none=True)
    loss = model(x, y) if loop == "inside" else F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    return loss


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--replays", type=int, default=10_000)
    ap.add_argument("--sample-every", type=int, default=500)
    ap.add_argument("--block", type=int, default=250, help="replays per block when alternating the two models")
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--loop", choices=["inside", "outside"], default="inside",
                    help="loss inside the model (tier 1) or outside (tier 2)")
    ap.add_argument("--flat-mib", type=float, default=1.0)
    ap.add_argument("--flat-blocks", type=int, default=2000,
                    help="Python heap blocks (sys.getallocatedblocks) allowed to grow from 1k replays")
    ap.add_argument("--check", action="store_true", help="exit 1 unless memory stayed flat")
    ap.add_argument("--out", default="soak.json")
    args = ap.parse_args()

    pgd.init()
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    if not torch.cuda.is_available():
        print("soak.py needs a CUDA GPU (it measures graph replays)", file=sys.stderr)
        return 2
    dev = torch.device("cuda", torch.cuda.current_device())
    g = torch.Generator(device=dev).manual_seed(rank)
    x = torch.randn(args.batch, args.width, device=dev, generator=g)
    y = torch.randint(0, 10, (args.batch,), device=dev, generator=g)

    watched = make(args, dev, None)    # native watchdog on (the default)
    unwatched = make(args, dev, 0)     # replay_timeout=0: no watchdog
    for model, opt in (watched, unwatched):  # probe, warm-up, capture, selection
        for _ in range(40):
            step(model, opt, x, y, args.loop)
    torch.cuda.synchronize()
    reps = {name: pgd.report().models[i].replays for i, name in enumerate(("watched", "unwatched"))}
    if min(reps.values()) == 0:
        print(pgd.report(), file=sys.stderr)
        print("soak.py: a model is not replaying; nothing to soak", file=sys.stderr)
        return 2

    samples, times = [], {"watched": [], "unwatched": []}
    gc.collect()
    done = 0
    t_start = time.perf_counter()
    next_print = time.perf_counter() + 10
    while done < args.replays:
        for name, (model, opt) in (("watched", watched), ("unwatched", unwatched)):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(args.block):
                step(model, opt, x, y, args.loop)
            torch.cuda.synchronize()
            times[name].append((time.perf_counter() - t0) / args.block * 1e3)
        before = done
        done += args.block
        if done // args.sample_every != before // args.sample_every or done >= args.replays:
            samples.append({"replays": done, "allocated": torch.cuda.memory_allocated(dev),
                            "reserved": torch.cuda.memory_reserved(dev), **host_sample(watched[0])})
        if rank == 0 and time.perf_counter() > next_print:
            print(f"soak: {done}/{args.replays} replays per model, "
                  f"{time.perf_counter() - t_start:.0f} s", flush=True)
            next_print += 10

    r = pgd.report()
    base = next((s for s in samples if s["replays"] >= 1000), samples[0])
    last = samples[-1]
    growth = {k: (last[k] - base[k]) / MIB for k in ("allocated", "reserved", "rss")}
    flat = {k: abs(v) <= args.flat_mib for k, v in growth.items()}
    growth_blocks = last["py_blocks"] - base["py_blocks"]
    flat["py_blocks"] = abs(growth_blocks) <= args.flat_blocks
    med_w, med_u = statistics.median(times["watched"]), statistics.median(times["unwatched"])
    result = {
        "device": torch.cuda.get_device_name(dev), "torch": torch.__version__, "world_size": world,
        "model": f"MLP width {args.width} depth {args.depth}, batch {args.batch}, bf16, AdamW, loop {args.loop}",
        "replays_per_model": {"watched": r.models[0].replays, "unwatched": r.models[1].replays},
        "tiers": sorted({gr.tier for gr in r.models[0].graphs}),
        "samples": samples, "growth_mib_from_1k": growth, "flat": flat, "flat_mib": args.flat_mib,
        "growth_blocks_from_1k": growth_blocks, "flat_blocks": args.flat_blocks,
        "rss_raw_growth_mib_from_1k": (last["rss_raw"] - base["rss_raw"]) / MIB,
        "malloc_trim": MALLOC_TRIM is not None,
        "all_flat": all(flat.values()),
        "ms_per_replay": {"watched_median": med_w, "unwatched_median": med_u,
                          "watched_blocks": times["watched"], "unwatched_blocks": times["unwatched"]},
        "watchdog_cost_ratio": med_w / med_u,
        "watchdog_cost_us_per_replay": (med_w - med_u) * 1e3,
    }
    if rank == 0:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1))
        png = plot(result, out.with_suffix(".png"))
        print(f"soak: {args.replays} replays per model on {world} rank(s), {result['device']}")
        for k, v in growth.items():
            print(f"  {k:<9} {base[k] / MIB:10.1f} MiB at {base['replays']} -> {last[k] / MIB:10.1f} MiB at "
                  f"{last['replays']}: {v:+.2f} MiB ({'flat' if flat[k] else 'NOT FLAT'})")
        print(f"  py_blocks {base['py_blocks']:10d} at {base['replays']} -> {last['py_blocks']:10d} at "
              f"{last['replays']}: {growth_blocks:+d} blocks "
              f"({'flat' if flat['py_blocks'] else 'NOT FLAT'}, limit {args.flat_blocks})")
        print(f"  rss before GC, watchdog drain and malloc_trim: {result['rss_raw_growth_mib_from_1k']:+.2f} MiB; "
              f"watchdog queue at the samples: {[s['watchdog_pending'] for s in samples]}")
        print(f"  ms/replay: watchdog on {med_w:.4f}, off {med_u:.4f} (x{med_w / med_u:.3f}, "
              f"{(med_w - med_u) * 1e3:+.1f} us per replay)")
        print(f"  wrote {out}" + (f" and {png}" if png else ""))
    pgd.shutdown()
    return 0 if (result["all_flat"] or not args.check) else 1


def plot(result: dict, path: Path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    s = result["samples"]
    xs = [p["replays"] for p in s]
    fig, ax = plt.subplots(figsize=(7, 3.6))
    for k, label in (("allocated", "CUDA allocated"), ("reserved", "CUDA reserved"), ("rss", "host RSS")):
        ax.plot(xs, [(p[k] - s[0][k]) / MIB for p in s], marker=".", label=label)
    ax.axhspan(-result["flat_mib"], result["flat_mib"], color="0.9", zorder=0, label="±1 MiB")
    ax.set_xlabel("replays")
    ax.set_ylabel("MiB relative to the first sample")
    ax.set_title(f"soak: {result['model']}\n{result['device']}, torch {result['torch']}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


if __name__ == "__main__":
    sys.exit(main())
