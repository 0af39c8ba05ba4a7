"""Coverage corpus: real model classes trained with eager DDP and with
pygraph_dist, side by side, one model after the other in the same ranks.

    python benchmarks/coverage.py --world-sizes 2 --out results/NAME.json    # all models at N=2 (~3 min on 2xH200)
    python benchmarks/coverage.py --world-sizes 1,2 --out results/NAME.json  # N=1, then N=2
    python benchmarks/coverage.py --models 'hf_*,tv_resnet18' --out /tmp/c.json
    python benchmarks/coverage.py --list                                      # the corpus, and what is installed
    torchrun --nproc-per-node=2 benchmarks/coverage.py --out /tmp/c.json      # under your own launcher
    python benchmarks/coverage.py --device cpu --models transformer_lm --steps 2 --out /tmp/c.json  # Gloo, no graphs
    python benchmarks/coverage.py --replot results/NAME.json                  # table and plot again

The corpus is ``coverage_models.py``: torchvision, timm and transformers classes
built from configs with random weights (nothing is downloaded; HF_HUB_OFFLINE=1
in the ranks), PyTorch's word-language-model patterns and Lightning's demo
Transformer, each trained as its users write the loop. A model whose package is
missing is skipped with that reason.

Per model and world size N, in one process group: eager DDP first, then
``pygraph_dist.wrap(model, AdamW, amp="bf16")``, the same loop, data and initial
weights (bench_scaling.py's ``ddp`` and ``pgd`` modes: fused AdamW(lr=1e-4),
DDP's loop inside ``torch.autocast(bf16)``, pygraph_dist's autocast left to
``wrap``). Each mode: its setup (DDP: 3 steps; pygraph_dist: probe, warm-up,
capture and selection until steady, at most 30 steps), ``--warmup`` more
steps, then ``--steps`` timed steps. Between modes and models every graph is
released (``teardown_all``), the caching allocator emptied and its peaks reset.

Columns (nccl-tests conventions: per-iteration values are the max over ranks):
  ddp, pgd    ms/it: median over 10-step windows of the window mean of
              t_max[i] = max_r t[r][i], t = CUDA events between steps (CPU: wall)
  x_ddp       ddp ms/it / pgd ms/it
  host        ms of host time per step (perf_counter around the loop's
              iteration, no synchronisation), median over steps, max over ranks
  rsv         peak torch.cuda.max_memory_reserved during the mode minus reserved
              at its start (after empty_cache: the data and what the process
              keeps, e.g. cuBLAS workspaces), max over ranks, GiB
  x_mem       rsv pgd / rsv ddp
  tier        pygraph_dist's report at the end: 1 or 2 (a graph held), eager
  replay      share of the timed steps that replayed a graph
  reason      the first capture failure, invalidation or eager reason of the
              report, with the file:line it names ("then captured; first ..."
              when a later capture succeeded)
Summary per N: graphed classes (tier 1 or 2), at >= 1.0x DDP, with rsv pgd <=
1.1 x rsv ddp, of those that ran. Writes OUT.json (every row, per-rank
samples, machine and versions), OUT.txt (the table) and OUT-coverage.png.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

os.environ.setdefault("HF_HUB_OFFLINE", "1")         # never a download, in the driver or the ranks
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from bench_scaling import (NO_NVLS, Condition, EagerDDP, PyGraphDist, _agree, _die_with_parent,  # noqa: E402
                           _error_text, _exit_on_signal, _fmt, _healthy, _kill_group, _read_part, environment,
                           summarize, timed_loop)
from coverage_models import REGISTRY, Entry, loop_vision, select, to_device  # noqa: E402

PACKAGES = ("torch", "torchvision", "timm", "transformers", "accelerate", "lightning", "numpy")
FAILURE_EVENTS = ("capture failed", "invalidated", "not selected", "not kept")
WHERE = re.compile(r"([\w./\\<>-]+\.py):(\d+)")
MEM_SLACK = 1.10   # issue 47: pgd's peak reserved within DDP's + 10%
EAGER_PARITY = 0.98  # issue 47: wrap(..., graphs=False) at >= 0.98x DDP


# =========================================================================== modes
class _Corpus:
    """bench_scaling's mode, training a corpus entry (the ``workload``) with the
    entry's own loop; the build is the entry's (``module()`` reads ``w.build``)."""

    def step(self, batch):
        return self.w.loop(self, batch)


class CorpusDDP(_Corpus, EagerDDP):
    pass


class CorpusPGD(_Corpus, PyGraphDist):
    pass


class CorpusPGDEager(CorpusPGD):
    """pygraph_dist with ``wrap(..., graphs=False)``: the engine (reducer, AMP,
    checks) without graphs, what every step of a model that does not capture
    runs (issue 47: eager parity with DDP)."""

    def wrap_kwargs(self) -> dict:
        return {"graphs": False}


MODES = (("ddp", CorpusDDP), ("pgd", CorpusPGD), ("pgd_eager", CorpusPGDEager))
DEFAULT_MODES = "ddp,pgd"


# =========================================================================== report
def _find_where(obj) -> str:
    """A ``where`` field anywhere in a report dict (capture failures name their line there)."""
    if isinstance(obj, dict):
        if isinstance(obj.get("where"), str) and obj["where"]:
            return obj["where"]
        obj = list(obj.values())
    if isinstance(obj, list):
        for v in obj:
            hit = _find_where(v)
            if hit:
                return hit
    return ""


def first_reason(m: dict) -> tuple[str, str]:
    """(reason, file:line) of a model's report dict: its first capture failure,
    invalidation or drop (prefixed "then captured; first" when a capture
    succeeded after it), else its first eager reason, else why graphs are not
    possible. The line is the report's ``where`` where it has one, else the
    first ``file.py:N`` the text names."""
    events = m.get("events", [])
    at = next((i for i, e in enumerate(events) if e.get("event") in FAILURE_EVENTS), None)
    event = events[at] if at is not None else None
    reasons = m.get("summary", {}).get("eager_reasons", [])
    if event is not None:
        text, where = f"{event['event']}: {event.get('detail', '')}", _find_where(event)
        if any(e.get("event") == "captured" for e in events[at + 1:]):  # e.g. a host copy learned, then graphed
            text = "then captured; first " + text
    elif reasons:
        text, where = reasons[0].get("short") or reasons[0].get("reason", ""), _find_where(reasons[0])
    elif not m.get("graphs_possible", True):
        text, where = m.get("graphs_reason", ""), ""
    else:
        return "", ""
    where = where or _find_where(m.get("graphs", []))
    if not where:
        hit = WHERE.search(text)
        where = f"{Path(hit.group(1)).name}:{hit.group(2)}" if hit else ""
    return text, where


def pgd_counts(engine_model_dict: dict | None) -> tuple[int, int]:
    s = (engine_model_dict or {}).get("summary", {})
    return s.get("steps", 0), s.get("replayed", 0)


def latest_report() -> dict | None:
    import pygraph_dist as pgd

    models = pgd.report(as_dict=True)["models"]
    return models[-1] if models else None


def pgd_fields(m: dict, before: tuple[int, int]) -> dict:
    s = m["summary"]
    steps, replayed = pgd_counts(m)
    timed = steps - before[0]
    tier = ",".join(s["tiers"]) or ("eager" if s["status"] in ("eager", "partly eager") or
                                    not m.get("graphs_possible", True) else s["status"])
    reason, where = first_reason(m)
    train = [g for g in m.get("graphs", []) if g.get("tier") != "eval"]
    return {"tier": tier, "was_tiers": s.get("was_tiers", []), "status": s["status"],
            "replayed": replayed, "steps": steps, "timed_steps": timed,
            "replay_share": (replayed - before[1]) / timed if timed > 0 else 0.0,
            "reason": reason, "where": where, "eager_reasons": [r.get("short", "") for r in s["eager_reasons"]],
            "tier1_needs": s.get("tier1_needs", [])[:1], "select_speedup": s.get("speedup"),
            "selection": [g.get("selection", "") for g in train], "signatures": len(train),
            "pool_mib": sum(g.get("pool_mib", 0.0) for g in m.get("graphs", [])),
            "pool_detail": next((g["pool_detail"] for g in train if g.get("pool_detail")), ""),
            "buckets": m.get("buckets", ""), "precision": s.get("precision", "")}


# =========================================================================== worker
def _memory_reset(cuda: bool) -> float:
    """Release what the last mode left, reset the peaks; reserved bytes now (GiB)."""
    gc.collect()
    if not cuda:
        return 0.0
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    return torch.cuda.memory_reserved() / 2**30


def run_mode(name: str, cls, entry: Entry, batches: list, ctx: dict, args) -> tuple[dict, bool]:
    """One mode of one model: setup, warm-up, timed steps, memory, report.
    Returns its fields (``<mode>_...``) and whether the process is still healthy."""
    import torch.distributed as dist

    import pygraph_dist as pgd

    rank, ws, dev, group, cuda = ctx["rank"], ctx["ws"], ctx["dev"], ctx["group"], ctx["cuda"]
    start = _memory_reset(cuda)
    mode = cls(entry, "inside", batches, dev, group)
    out, err, times, host, before = {}, "", [], [], None
    t0 = time.perf_counter()
    try:
        mode.setup()
        for i in range(args.warmup):
            mode.step(batches[i % len(batches)])
        if cuda:
            torch.cuda.synchronize()
        out["setup_s"] = time.perf_counter() - t0
        if name.startswith("pgd"):
            before = pgd_counts(latest_report())

        def step(batch):
            t = time.perf_counter()
            loss = mode.step(batch)
            host.append((time.perf_counter() - t) * 1e3)
            return loss

        times = timed_loop(step, batches, args.steps, Condition(), rank, cuda)
        if name.startswith("pgd"):
            out.update(pgd_fields(latest_report(), before))
    except Exception as exc:  # noqa: BLE001 - a failing mode is a result
        err = _error_text(exc)
    status, reason = _agree("error" if err else "ok", err, group, ws)
    healthy = status == "ok" or _healthy(dev, group)
    if status == "ok":
        every = [None] * ws
        dist.all_gather_object(every, (times, statistics.median(host) if host else 0.0), group=group)
        timing = summarize([t for t, _ in every], ws * entry_batch(entry, args))
        out.update({k: timing[k] for k in ("ms_per_it", "mean_ms", "p50_ms", "p99_ms", "cv", "skew_ms")},
                   host_ms=max(h for _, h in every), per_rank_ms=[t for t, _ in every])
    else:
        out["error"] = reason
    if healthy and cuda:
        peaks = [None] * ws
        mine = (torch.cuda.max_memory_reserved() / 2**30, start, torch.cuda.max_memory_allocated() / 2**30)
        dist.all_gather_object(peaks, mine, group=group)
        out.update(peak_reserved_gib=max(p[0] for p in peaks), reserved_start_gib=max(p[1] for p in peaks),
                   rsv_gib=max(p[0] - p[1] for p in peaks), peak_allocated_gib=max(p[2] for p in peaks))
    out["status"] = status
    try:
        mode.teardown()
        pgd.launch.lifetime.teardown_all()  # every live engine, also one a failed setup left behind
    except Exception:  # noqa: BLE001
        pass
    del mode  # its memory goes at the next mode's _memory_reset
    return {f"{name}_{k}": v for k, v in out.items()}, healthy


def entry_batch(entry: Entry, args) -> int:
    return args.batch or entry.batch


def run_model(entry: Entry, ctx: dict, args) -> tuple[dict, bool]:
    row = {"model": entry.name, "family": entry.family, "what": entry.what, "world_size": ctx["ws"],
           "batch": entry_batch(entry, args)}
    if entry.missing():
        return dict(row, status="skipped", reason=f"needs {', '.join(entry.missing())}"), True
    rank, t0 = ctx["rank"], time.perf_counter()
    gens = [torch.Generator().manual_seed(1000 * rank + i) for i in range(2)]
    try:
        batches = [to_device(entry.make_batch(row["batch"], g), ctx["dev"]) for g in gens]
    except Exception as exc:  # noqa: BLE001
        return dict(row, status="error", reason="batch: " + _error_text(exc)), True
    healthy = True
    modes = [(n, cls) for n, cls in MODES if n in args.modes.split(",")]
    for name, cls in modes:
        fields, healthy = run_mode(name, cls, entry, batches, ctx, args)
        row.update(fields)
        if not healthy:
            break
    del batches
    ok = [row.get(f"{n}_status") == "ok" for n, _ in modes]
    row["status"] = "ok" if all(ok) else "error"
    if not all(ok):
        row["reason"] = "; ".join(f"{n}: {row[f'{n}_error']}" for n, _ in modes if f"{n}_error" in row) or \
            "not run: the process was unhealthy"
    if all(ok):
        for name, suffix in (("pgd", ""), ("pgd_eager", "_eager")):
            if f"{name}_ms_per_it" in row:
                row["speedup" + suffix] = row["ddp_ms_per_it"] / row[f"{name}_ms_per_it"]
                if row.get("ddp_rsv_gib"):
                    row["mem_ratio" + suffix] = row[f"{name}_rsv_gib"] / row["ddp_rsv_gib"]
    row["wall_s"] = time.perf_counter() - t0
    return row, healthy


# Trained (both modes) before the corpus and not recorded: what a process pays
# once (NCCL communicators, cuBLAS workspaces of each stream) is not charged
# to the first model.
PRIME = Entry(name="prime", family="torch.nn", what="one-time process costs",
              build=lambda: torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10)),
              make_batch=lambda b, g: (torch.randn(b, 64, generator=g), torch.randint(0, 10, (b,), generator=g)),
              loop=loop_vision, batch=8)


def worker(args, part: Path) -> int:
    """Every model in turn, in this rank; rank 0 rewrites ``part`` after each one
    (the driver's heartbeat: ``current`` is the model running and since when)."""
    import torch.distributed as dist

    import pygraph_dist as pgd

    env = pgd.init()
    rank, ws = env.rank, env.world_size
    cuda = torch.cuda.is_available() and args.device != "cpu"
    dev = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    group = dist.new_group(backend="nccl" if cuda else "gloo")  # torch's own backend for DDP, as bench_scaling
    ctx = {"rank": rank, "ws": ws, "dev": dev, "group": group, "cuda": cuda}
    names = select(args.models)
    state = {"environment": {**environment(), "versions": versions()}, "rows": [], "current": None}

    def flush() -> None:
        if rank == 0:
            tmp = part.with_suffix(".tmp")
            tmp.write_text(json.dumps(state))
            os.replace(tmp, part)

    state["current"] = {"model": "prime", "since": time.time()}
    flush()
    run_model(PRIME, ctx, argparse.Namespace(**{**vars(args), "steps": 3, "warmup": 1, "batch": 0}))
    for k, name in enumerate(names):
        if time.time() > args.deadline:
            state["rows"].append({"model": name, "family": REGISTRY[name].family, "what": REGISTRY[name].what,
                                  "world_size": ws, "status": "skipped", "reason": "budget (--budget-s) spent"})
            continue
        state["current"] = {"model": name, "since": time.time()}
        flush()
        row, healthy = run_model(REGISTRY[name], ctx, args)
        state["rows"].append(row)
        state["current"] = None
        flush()
        if rank == 0:
            print(f"[coverage N={ws}] {k + 1:>2}/{len(names)} {progress(row)}", flush=True)
        if not healthy:
            print(f"[coverage] rank {rank}: unhealthy after {name}; exiting so that the driver restarts",
                  file=sys.stderr, flush=True)
            os._exit(3)
    flush()
    pgd.shutdown()
    return 0


def progress(row: dict) -> str:
    head = f"{row['model']:<26}"
    if row["status"] != "ok":
        return f"{head} {row['status']}: {row.get('reason', '')[:160]}"
    text = f"{head} ddp {row['ddp_ms_per_it']:7.2f} ms"
    if "speedup" in row:
        text += (f"  pgd {row['pgd_ms_per_it']:7.2f} ms  {row['speedup']:5.2f}x  tier {row.get('pgd_tier', '?'):<5} "
                 f"replayed {100 * row.get('pgd_replay_share', 0):3.0f}%")
    if "mem_ratio" in row:
        text += f"  mem {row['mem_ratio']:.2f}x"
    if "speedup_eager" in row:
        text += f"  graphs=False {row['pgd_eager_ms_per_it']:7.2f} ms  {row['speedup_eager']:5.2f}x"
        if "mem_ratio_eager" in row:
            text += f" mem {row['mem_ratio_eager']:.2f}x"
    if row.get("pgd_reason"):
        text += f"  [{row.get('pgd_where') or '-'}] {row['pgd_reason'][:120]}"
    return text


def versions() -> dict:
    from importlib import metadata

    out = {}
    for p in PACKAGES + ("pygraph_dist",):
        try:
            out[p] = metadata.version(p)
        except metadata.PackageNotFoundError:
            out[p] = None
    return out


# =========================================================================== results
COLUMNS = [  # (name, unit, width, row key, format)
    ("model", "", 24, "model", "{}"), ("family", "", 12, "family", "{}"), ("N", "", 2, "world_size", "{}"),
    ("batch", "", 5, "batch", "{}"), ("ddp", "ms", 8, "ddp_ms_per_it", "{:.3f}"),
    ("pgd", "ms", 8, "pgd_ms_per_it", "{:.3f}"), ("x_ddp", "x", 6, "speedup", "{:.2f}"),
    ("host_ddp", "ms", 8, "ddp_host_ms", "{:.3f}"), ("host_pgd", "ms", 8, "pgd_host_ms", "{:.3f}"),
    ("rsv_ddp", "GiB", 7, "ddp_rsv_gib", "{:.3f}"), ("rsv_pgd", "GiB", 7, "pgd_rsv_gib", "{:.3f}"),
    ("x_mem", "x", 5, "mem_ratio", "{:.2f}"), ("tier", "", 5, "pgd_tier", "{}"),
    ("replay", "%", 6, "pgd_replay_share", "{:.0%}"), ("setup", "s", 5, "pgd_setup_s", "{:.1f}"),
]
EAGER_COLUMNS = [  # --modes with pgd_eager: wrap(..., graphs=False) against DDP
    ("eager", "ms", 8, "pgd_eager_ms_per_it", "{:.3f}"), ("x_eager", "x", 7, "speedup_eager", "{:.2f}"),
    ("host_eag", "ms", 8, "pgd_eager_host_ms", "{:.3f}"), ("rsv_eag", "GiB", 7, "pgd_eager_rsv_gib", "{:.3f}"),
]


def columns(rows: list[dict]) -> list:
    """The table's columns: pygraph_dist's eager mode only when a row has it."""
    return COLUMNS + (EAGER_COLUMNS if any("pgd_eager_ms_per_it" in r for r in rows) else [])


def _line(values: list[str], cols: list = COLUMNS) -> str:
    return " ".join(f"{v:<{w}}" if i < 2 or name == "tier" else f"{v:>{w}}"
                    for i, ((name, _, w, _, _), v) in enumerate(zip(cols, values)))


def graphed(row: dict) -> bool:
    return row.get("pgd_tier") in ("1", "2") and row.get("pgd_replay_share", 0) > 0


def summarize_n(rows: list[dict]) -> dict:
    ran = [r for r in rows if r["status"] == "ok"]
    pgd = [r for r in ran if "speedup" in r]  # all of them, unless --modes left the pgd mode out
    mem = [r for r in ran if "mem_ratio" in r]
    return {"models": len(rows), "ran": len(ran), "pgd_ran": len(pgd),
            "skipped": [r["model"] for r in rows if r["status"] == "skipped"],
            "errors": [r["model"] for r in rows if r["status"] not in ("ok", "skipped")],
            "graphed": sum(graphed(r) for r in pgd), "not_graphed": [r["model"] for r in pgd if not graphed(r)],
            "at_least_ddp": sum(r["speedup"] >= 1.0 for r in pgd),
            "slower": [r["model"] for r in pgd if r["speedup"] < 1.0],
            "eager_measured": sum("speedup_eager" in r for r in ran),
            "eager_parity": sum(r.get("speedup_eager", 0) >= EAGER_PARITY for r in ran),
            "eager_slower": [r["model"] for r in ran if r.get("speedup_eager", EAGER_PARITY) < EAGER_PARITY],
            "memory_measured": len(mem), "memory_within": sum(r["mem_ratio"] <= MEM_SLACK for r in mem),
            "over_memory": [r["model"] for r in mem if r["mem_ratio"] > MEM_SLACK]}


def summary_text(n: int, s: dict) -> str:
    def share(k: int, of: int) -> str:
        return f"{k}/{of} ({100 * k / of:.1f}%)" if of else "0/0"

    text = (f"# summary N={n}: {s['models']} models, {s['ran']} ran, {len(s['skipped'])} skipped, "
            f"{len(s['errors'])} errors or timeouts")
    if s["pgd_ran"]:
        text += (f"; graphed (tier 1 or 2) {share(s['graphed'], s['pgd_ran'])}; "
                 f">= 1.0x DDP {share(s['at_least_ddp'], s['pgd_ran'])}; memory <= DDP+10% "
                 f"{share(s['memory_within'], s['memory_measured']) if s['memory_measured'] else 'not measured (CPU)'}")
    if s.get("eager_measured"):
        text += (f"; graphs=False >= {EAGER_PARITY}x DDP {share(s['eager_parity'], s['eager_measured'])}")
    for label, key in (("not graphed", "not_graphed"), ("slower than DDP", "slower"),
                       (f"graphs=False under {EAGER_PARITY}x DDP", "eager_slower"),
                       ("over DDP+10%", "over_memory"), ("errors or timeouts", "errors"), ("skipped", "skipped")):
        if s.get(key):
            text += f"\n#   {label}: {', '.join(s[key])}"
    return text


def table(result: dict) -> str:
    cols = columns(result["rows"])
    env = result.get("environment", {})
    ver = env.get("versions", {})
    head = [
        f"# pygraph_dist coverage corpus: {env.get('gpus_visible', 0)} x {env.get('gpu', 'CPU')}, "
        f"torch {env.get('torch')}, CUDA {env.get('cuda')}, NCCL {env.get('nccl', '-')}, "
        f"commit {env.get('commit', '?')}; "
        + ", ".join(f"{p} {ver[p]}" for p in ("pygraph_dist", "torchvision", "timm", "transformers", "lightning")
                    if ver.get(p)),
        "# definitions: benchmarks/coverage.py docstring. ddp/pgd: ms/it, median of 10-step window means of the "
        "per-step max over ranks; x_ddp: ddp/pgd; host: host ms per step (median, max over ranks);",
        "# rsv: peak reserved minus reserved at the mode's start (GiB, max over ranks); x_mem: rsv_pgd/rsv_ddp; "
        "tier: pgd report at the end; replay: timed steps replayed; then the first reason [file:line]",
        "# " + _line([c[0] for c in cols], cols),
        "# " + _line([f"({c[1]})" if c[1] else "" for c in cols], cols),
    ]
    lines = list(head)
    for r in result["rows"]:
        values = []
        for _, _, _, key, f in cols:
            v = r.get(key)
            values.append(_fmt(v, f) if isinstance(v, float) else "-" if v is None else str(v))
        note = ""
        if r["status"] != "ok":
            note = f"{r['status']}: {r.get('reason', '')}"
        elif r.get("pgd_reason"):
            note = f"[{r.get('pgd_where') or '-'}] {r['pgd_reason']}"
        lines.append("  " + _line(values, cols) + (f"  {note[:240]}" if note else ""))
    lines.append("")
    for n, s in sorted(result.get("summary", {}).items(), key=lambda kv: int(kv[0])):
        lines.append(summary_text(int(n), s))
    lines.extend(memory_notes(result["rows"]))
    return "\n".join(lines)


def memory_notes(rows: list[dict]) -> list[str]:
    """Per row over DDP + 10%: how much, and what pygraph_dist holds (the report's
    graph-pool line, ``report(verbose=True)``; for a row that ran eagerly, its buckets)."""
    over = [r for r in rows if r.get("status") == "ok" and r.get("mem_ratio", 0) > MEM_SLACK]
    if not over:
        return []
    out = ["# over DDP+10%: peak reserved beyond DDP's, and what pygraph_dist's memory holds (report(verbose=True))"]
    for r in over:
        extra = (r["pgd_rsv_gib"] - r["ddp_rsv_gib"]) * 1024
        held = r.get("pgd_pool_detail") or f"no graph (ran eagerly): {r.get('pgd_buckets') or 'its gradient buckets'}"
        out.append(f"#   {r['model']} N={r['world_size']}: +{extra:.0f} MiB; {held}")
    return out


def finish(result: dict, out: Path, plots: bool = True) -> None:
    """Summary per N, JSON, table (printed and .txt) and the plot."""
    by_n: dict[int, list] = {}
    for r in result["rows"]:
        by_n.setdefault(r["world_size"], []).append(r)
    result["summary"] = {str(n): summarize_n(rows) for n, rows in sorted(by_n.items())}
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(result, indent=1))
    os.replace(tmp, out)
    text = table(result)
    out.with_suffix(".txt").write_text(text + "\n")
    print(text, flush=True)
    if plots:
        try:
            from plots import plot_coverage

            for png in plot_coverage(result, out.with_suffix("")):
                print(f"[coverage] plot {png}", file=sys.stderr)
        except ImportError as exc:
            print(f"[coverage] no plot: {exc}", file=sys.stderr)
    print(f"[coverage] {len(result['rows'])} rows -> {out}, {out.with_suffix('.txt')}", file=sys.stderr)


# =========================================================================== driver
def launch(args, n: int, names: list[str], out: Path, result: dict) -> None:
    """The models at world size n in one torchrun; a model that hangs or kills the
    ranks (no progress within --model-timeout) is recorded as an error and a
    fresh torchrun goes on with the models after it."""
    env = dict(os.environ, **NO_NVLS)
    env["PYTHONPATH"] = str(HERE) + os.pathsep + env.get("PYTHONPATH", "")
    deadline = time.time() + args.budget_s
    todo, attempt = list(names), 0
    while todo:
        attempt += 1
        part = out.parent / f".{out.stem}.N{n}.{attempt}.part.json"
        part.unlink(missing_ok=True)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(n),
               str(Path(__file__)), "--worker", "--part", str(part), "--models", ",".join(todo),
               "--steps", str(args.steps), "--warmup", str(args.warmup), "--batch", str(args.batch),
               "--modes", args.modes,
               "--device", args.device, "--deadline", str(deadline)]
        proc = subprocess.Popen(cmd, env=env, start_new_session=True, preexec_fn=_die_with_parent)
        why = ""
        try:
            while proc.poll() is None:
                time.sleep(0.5)
                cur = (_read_part(part) or {}).get("current")
                if cur and time.time() - cur["since"] > args.model_timeout:
                    why = f"no progress for {args.model_timeout:.0f} s (--model-timeout)"
                    print(f"[coverage] N={n}: {why} in {cur['model']}; stopping the ranks", file=sys.stderr,
                          flush=True)
                    break
        finally:
            _kill_group(proc)
            state = _read_part(part) or {}
            part.unlink(missing_ok=True)
        result["exit_codes"].setdefault(str(n), []).append(proc.returncode)
        result["environment"] = result["environment"] or state.get("environment", {})
        rows = state.get("rows", [])
        result["rows"] += rows
        done = {r["model"] for r in rows}
        cur = (state.get("current") or {}).get("model")
        if cur in REGISTRY and cur not in done:
            entry = REGISTRY[cur]
            result["rows"].append({"model": cur, "family": entry.family, "what": entry.what, "world_size": n,
                                   "batch": args.batch or entry.batch, "status": "timeout" if why else "error",
                                   "reason": why or f"the ranks exited (code {proc.returncode}) during this model"})
            done.add(cur)
        elif not done:
            result["rows"] += [{"model": m, "family": REGISTRY[m].family, "what": REGISTRY[m].what, "world_size": n,
                                "status": "error", "reason": why or f"the ranks exited (code {proc.returncode}) "
                                "before the first model"} for m in todo]
            return
        todo = [m for m in todo if m not in done]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="Coverage corpus: real model classes, eager DDP against pygraph_dist "
                                "(see the module docstring and benchmarks/README.md).")
    p.add_argument("--models", default=None, help="comma list of names, globs (hf_*) or names without the "
                   "family prefix (resnet18); default: all")
    p.add_argument("--list", action="store_true", help="print the corpus and exit")
    p.add_argument("--world-sizes", default="1", help="comma list, e.g. 1,2 (one torchrun each; default 1)")
    p.add_argument("--modes", default=DEFAULT_MODES, help="comma list of ddp, pgd and pgd_eager "
                   "(wrap(..., graphs=False)); ddp is always run first, as the reference (default ddp,pgd)")
    p.add_argument("--steps", type=int, default=20, help="timed steps per mode (default 20)")
    p.add_argument("--warmup", type=int, default=5, help="steps after each mode's setup, before timing (default 5)")
    p.add_argument("--batch", type=int, default=0, help="per-GPU batch for every model (default: each model's)")
    p.add_argument("--device", choices=("cuda", "cpu"), default=None,
                   help="cpu: Gloo, no graphs (default: cuda when one is visible)")
    p.add_argument("--model-timeout", type=float, default=45, help="seconds one model may take before its ranks "
                   "are stopped and a fresh launch goes on with the next model (default 45)")
    p.add_argument("--budget-s", type=float, default=190, help="per world size: no model starts after this many "
                   "seconds (the rest: skipped; default 190)")
    p.add_argument("--out", default=str(HERE / "results" / f"coverage-{time.strftime('%Y%m%d-%H%M%S')}.json"),
                   help="results JSON; the table goes to .txt, the plot to -coverage.png beside it")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--replot", default=None, metavar="JSON", help="table and plot again from a results JSON")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--part", default="", help=argparse.SUPPRESS)
    p.add_argument("--deadline", type=float, default=float("inf"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    unknown = set(args.modes.split(",")) - {n for n, _ in MODES}
    if unknown:
        p.error(f"unknown --modes {sorted(unknown)}; choose from {[n for n, _ in MODES]}")
    args.modes = ",".join(n for n, _ in MODES if n == "ddp" or n in args.modes.split(","))
    names = select(args.models)

    if args.list:
        print(f"{'name':<26} {'family':<12} {'batch':>5}  {'installed':<18} class")
        for name in names:
            e = REGISTRY[name]
            have = "yes" if not e.missing() else f"needs {', '.join(e.missing())}"
            print(f"{name:<26} {e.family:<12} {e.batch:>5}  {have:<18} {e.what}")
        print(f"{len(names)} models, {sum(not REGISTRY[n].missing() for n in names)} installed")
        return 0
    if args.replot:
        src = Path(args.replot)
        finish(json.loads(src.read_text()), src, plots=not args.no_plots)
        return 0
    if args.worker:
        return worker(args, Path(args.part))
    out = Path(args.out)
    if "LOCAL_RANK" in os.environ:  # under the user's own torchrun: this is a rank
        part = out.parent / f".{out.stem}.part.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        if args.deadline == float("inf"):
            args.deadline = time.time() + args.budget_s
        worker(args, part)
        if int(os.environ.get("RANK", "0")) == 0:
            state = _read_part(part) or {}
            part.unlink(missing_ok=True)
            finish({"kind": "coverage", "environment": state.get("environment", {}), "config": vars(args),
                    "rows": state.get("rows", []), "exit_codes": {}}, out, plots=not args.no_plots)
        return 0

    for sig in (signal.SIGTERM, signal.SIGHUP):  # through SystemExit, so that the ranks are stopped
        signal.signal(sig, _exit_on_signal)
    sizes = [int(s) for s in args.world_sizes.split(",") if s]
    gpus = torch.cuda.device_count() if torch.cuda.is_available() and args.device == "cuda" else 0
    if args.device == "cuda" and max(sizes) > gpus:
        raise SystemExit(f"world size {max(sizes)} needs {max(sizes)} GPUs, {gpus} visible (--device cpu for Gloo)")
    out.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    result = {"kind": "coverage", "environment": {}, "rows": [], "exit_codes": {},
              "config": {k: v for k, v in vars(args).items() if k not in ("worker", "part", "deadline")}}
    try:
        for n in sizes:
            print(f"[coverage] N={n}: {len(names)} models", file=sys.stderr, flush=True)
            launch(args, n, names, out, result)
    finally:  # an interrupted run keeps what it measured
        result["wall_s"] = time.perf_counter() - t0
        finish(result, out, plots=not args.no_plots)
    return 0 if all(c == 0 for codes in result["exit_codes"].values() for c in codes) else 1


if __name__ == "__main__":
    sys.exit(main())
