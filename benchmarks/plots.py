"""PNG plots from a bench_scaling.py results JSON.

    python benchmarks/plots.py benchmarks/results/<name>.json

  <stem>-efficiency.png  weak-scaling efficiency T(1)/T(N) per mode (inside loop)
  <stem>-speedup.png     speedup over eager DDP per mode (inside loop)
  <stem>-floor.png       ms/it / floor per mode (inside loop; log scale; 1 = the floor)
  <stem>-loops.png       ms/it per loop and mode, per workload
  <stem>-memory.png      peak GPU memory per loop and mode (minus what the row started with), per workload
  <stem>-noisy.png       p50 and p99 ms/it at baseline and under noisy neighbours, per mode
  <stem>-cdf.png         iteration-time CDF with and without host jitter (ddp vs pgd)

plot_coverage() draws coverage.py's results (<stem>-coverage.png: speed and
memory against DDP per model, coloured by tier); coverage.py --replot redraws it.

All at the largest world size of the results; a plot whose cells are missing is
not drawn. Cells written before loops existed count as the inside loop.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

MODE_COLORS = {"ddp": "#7f7f7f", "ddp_bf16": "#c7c7c7", "ddp_graph": "#1f77b4", "compile": "#ff7f0e",
               "pgd": "#2ca02c", "pgd_bf16": "#98df8a", "pgd_compile": "#17becf"}
MODE_LABELS = {"ddp": "eager DDP", "ddp_bf16": "eager DDP, bf16 all-reduce", "ddp_graph": "hand-written graph + DDP",
               "compile": "torch.compile reduce-overhead", "pgd": "pygraph_dist",
               "pgd_bf16": "pygraph_dist, bf16 all-reduce", "pgd_compile": "pygraph_dist + torch.compile"}
LOOPS = ["inside", "outside", "accum4", "accum4_sync", "clip"]


def _get(c: dict, k: str):
    return c.get(k, "inside") if k == "loop" else c.get(k)


def _ok(cells, **match):
    return [c for c in cells if c["status"] == "ok" and all(_get(c, k) == v for k, v in match.items())]


def plot_all(result: dict, stem: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = result["cells"]
    env = result.get("environment", {})
    sizes = sorted({c["world_size"] for c in cells})
    n_max = max(sizes) if sizes else 1
    workloads = sorted({c["workload"] for c in cells})
    modes = [m for m in MODE_COLORS if any(c["mode"] == m for c in cells)]
    cond = "baseline" if _ok(cells, condition="baseline") else "sync10"
    subtitle = f"{env.get('gpu', 'CPU')}, torch {env.get('torch')}, NCCL {env.get('nccl', '-')}"
    out: list[Path] = []

    def save(fig, suffix: str) -> None:
        fig.tight_layout()
        path = Path(f"{stem}-{suffix}.png")
        fig.savefig(path, dpi=120)
        plt.close(fig)
        out.append(path)

    def bars(key: str, ylabel: str, title: str, suffix: str, ref_line: float | None, log: bool = False):
        shown = [m for m in modes
                 if any(key in c for c in _ok(cells, mode=m, world_size=n_max, condition=cond, loop="inside"))]
        if not shown:
            return
        fig, ax = plt.subplots(figsize=(max(6.0, 1.8 + 1.6 * len(workloads)), 4))
        width = 0.8 / len(shown)
        for i, m in enumerate(shown):
            ys = []
            for w in workloads:
                hit = _ok(cells, workload=w, mode=m, world_size=n_max, condition=cond, loop="inside")
                ys.append(hit[0].get(key, float("nan")) if hit else float("nan"))
            xs = [j + (i - (len(shown) - 1) / 2) * width for j in range(len(workloads))]
            ax.bar(xs, ys, width, label=MODE_LABELS[m], color=MODE_COLORS[m])
            if log:  # ratios: the value on each bar
                for x, y in zip(xs, ys):
                    if y == y:
                        ax.text(x, y, f"{y:.2g}", ha="center", va="bottom", fontsize=6)
        if ref_line is not None:
            ax.axhline(ref_line, color="black", lw=0.8, ls="--")
        if log:
            ax.set_yscale("log")
        ax.set_xticks(range(len(workloads)), workloads)
        ax.set_ylabel(ylabel)
        ax.set_title(f"{title} (N={n_max}, {cond}, inside loop)\n{subtitle}", fontsize=9)
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=min(4, len(shown)), frameon=False)
        save(fig, suffix)

    if n_max > 1 and 1 in sizes:
        bars("scaling_efficiency", "weak-scaling efficiency T(1)/T(N)", "Scaling efficiency 1 -> N GPUs",
             "efficiency", 1.0)
    bars("speedup_vs_ddp", "speedup vs eager DDP", "Iteration speed relative to eager DDP", "speedup", 1.0)
    bars("ratio_to_floor", "ms/it / floor (1 = the floor)",
         "Distance to the floor max(compute, comm) + optimizer", "floor", 1.0, log=True)

    # Loops: ms/it and memory per loop and mode, one panel per workload that ran more than one loop.
    loop_wl = [w for w in workloads
               if len({_get(c, "loop") for c in _ok(cells, workload=w, world_size=n_max, condition=cond)}) > 1]

    def loop_panels(value, ylabel: str, title: str, suffix: str) -> None:
        fig, axes = plt.subplots(1, len(loop_wl), figsize=(max(6.0, 4.2 * len(loop_wl) + 2.0), 3.8), squeeze=False)
        for ax, w in zip(axes[0], loop_wl):
            here = _ok(cells, workload=w, world_size=n_max, condition=cond)
            loops = [lp for lp in LOOPS if any(_get(c, "loop") == lp for c in here)]
            ms = [m for m in modes if any(c["mode"] == m for c in here)]
            width = 0.8 / len(ms)
            for i, m in enumerate(ms):
                ys = []
                for lp in loops:
                    hit = [c for c in here if c["mode"] == m and _get(c, "loop") == lp]
                    ys.append(value(hit[0]) if hit else float("nan"))
                xs = [j + (i - (len(ms) - 1) / 2) * width for j in range(len(loops))]
                ax.bar(xs, ys, width, label=MODE_LABELS[m], color=MODE_COLORS[m])
            for j, lp in enumerate(loops):  # rows that did not run: say why in one word
                for i, m in enumerate(ms):
                    bad = [c for c in cells if c["workload"] == w and c["mode"] == m and _get(c, "loop") == lp
                           and c["world_size"] == n_max and c["condition"] == cond and c["status"] != "ok"]
                    if bad:
                        ax.text(j + (i - (len(ms) - 1) / 2) * width, 0, bad[0]["status"], rotation=90,
                                ha="center", va="bottom", fontsize=6)
            ax.set_xticks(range(len(loops)), loops)
            ax.set_ylabel(ylabel)
            ax.set_title(w, fontsize=9)
        axes[0][-1].legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # beside, not over, the bars
        fig.suptitle(f"{title} (N={n_max}, {cond})\n{subtitle}", fontsize=9)
        save(fig, suffix)

    if loop_wl:
        loop_panels(lambda c: c["ms_per_it"], "ms/it", "Training loops as users write them", "loops")
        if any("mem_start_gib" in c and c.get("peak_mem_gib")
               for w in loop_wl for c in _ok(cells, workload=w, world_size=n_max)):
            # The row's own peak: what was allocated when it started (batches,
            # leftovers of earlier rows) taken off; results without the start
            # (older files) are not drawn.
            def own(c):
                if "mem_own_gib" in c:
                    return c["mem_own_gib"]
                if "mem_start_gib" in c:
                    return c["peak_mem_gib"] - c["mem_start_gib"]
                return float("nan")

            loop_panels(own, "peak GiB (row's own)", "Peak GPU memory per loop, max over ranks", "memory")

    # Noisy neighbours: p50 (bars) and p99 (markers), baseline vs noisy, per mode.
    noisy_wl = [w for w in workloads if _ok(cells, workload=w, condition="noisy", world_size=n_max)]
    if noisy_wl:
        fig, axes = plt.subplots(1, len(noisy_wl), figsize=(max(6.0, 4.2 * len(noisy_wl)), 3.8), squeeze=False)
        for ax, w in zip(axes[0], noisy_wl):
            ms = [m for m in modes if _ok(cells, workload=w, mode=m, condition="noisy", world_size=n_max)]
            for j, m in enumerate(ms):
                for k, (c_name, hatch) in enumerate((("baseline", ""), ("noisy", "//"))):
                    hit = _ok(cells, workload=w, mode=m, condition=c_name, world_size=n_max, loop="inside")
                    if not hit:
                        continue
                    x = j + (k - 0.5) * 0.38
                    ax.bar(x, hit[0]["p50_ms"], 0.36, color=MODE_COLORS[m], hatch=hatch, edgecolor="black",
                           lw=0.5, label=f"p50, {c_name}" if j == 0 else None)
                    ax.plot([x], [hit[0]["p99_ms"]], "v", color="black", ms=5,
                            label="p99" if j == 0 and k == 0 else None)
            ax.set_xticks(range(len(ms)), [MODE_LABELS[m] for m in ms], fontsize=7, rotation=15)
            ax.set_ylabel("iteration time, max over ranks (ms)")
            ax.set_title(w, fontsize=9)
            ax.grid(axis="y", alpha=0.3)
        axes[0][0].legend(fontsize=6)
        noisy = _ok(cells, condition="noisy")[0]
        fig.suptitle(f"Noisy neighbours: ranks pinned to {len(noisy.get('noisy_cpus', []))} cores shared with "
                     f"{noisy.get('noisy_procs', '?')} busy loops, N={n_max}\n{subtitle}", fontsize=9)
        save(fig, "noisy")

    cdf_modes = [m for m in ("ddp", "pgd") if m in modes]
    cdf_workloads = [w for w in workloads if _ok(cells, workload=w, condition="jitter", world_size=n_max)]
    if cdf_workloads and cdf_modes:
        from matplotlib.ticker import LogLocator, NullFormatter, ScalarFormatter

        fig, axes = plt.subplots(1, len(cdf_workloads), figsize=(3.6 * len(cdf_workloads), 3.4), squeeze=False)
        for ax, w in zip(axes[0], cdf_workloads):
            for m in cdf_modes:
                for c_name, style in (("sync10", "-"), ("jitter", "--")):
                    hit = _ok(cells, workload=w, mode=m, world_size=n_max, condition=c_name, loop="inside")
                    if not hit:
                        continue
                    xs = sorted(hit[0]["iteration_max_ms"])
                    ys = [(k + 1) / len(xs) for k in range(len(xs))]
                    ax.plot(xs, ys, style, color=MODE_COLORS[m], label=f"{MODE_LABELS[m]}, {c_name}")
            ax.set_xscale("log")
            ax.xaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
            ax.xaxis.set_major_formatter(ScalarFormatter())
            ax.xaxis.set_minor_formatter(NullFormatter())
            ax.set_xlabel("iteration time, max over ranks (ms)")
            ax.set_title(w, fontsize=9)
            ax.grid(alpha=0.3)
        axes[0][0].set_ylabel("CDF")
        axes[0][-1].legend(fontsize=6, loc="lower right")
        fig.suptitle(f"Iteration-time CDF with and without host jitter (p=0.05, 5 ms), N={n_max}\n{subtitle}",
                     fontsize=9)
        save(fig, "cdf")
    return out


TIER_COLORS = {"1": "#2ca02c", "2": "#98df8a", "eager": "#d62728"}  # coverage.py rows; other states grey
TIER_LABELS = {"1": "tier 1 (one graph per step)", "2": "tier 2 (graphs per phase)", "eager": "eager"}


def plot_coverage(result: dict, stem: Path) -> list[Path]:
    """``coverage.py``'s results: per world size, pygraph_dist's speed over eager
    DDP per model (log scale, bars from 1 = DDP, coloured by the tier that ran)
    and its peak reserved memory over DDP's (dashed: DDP + 10%). Models that did
    not run are labelled with their status. Writes ``<stem>-coverage.png``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch
    from matplotlib.ticker import LogLocator, NullFormatter, ScalarFormatter

    rows = result.get("rows", [])
    sizes = sorted({r["world_size"] for r in rows})
    if not sizes:
        return []
    env = result.get("environment", {})
    models = list(dict.fromkeys(r["model"] for r in rows))
    fig, axes = plt.subplots(1, 2 * len(sizes), figsize=(4.6 * len(sizes) + 3.0, max(3.0, 1.4 + 0.19 * len(models))),
                             squeeze=False, sharey=True, gridspec_kw={"width_ratios": [3, 2] * len(sizes)})
    for k, n in enumerate(sizes):
        here = {r["model"]: r for r in rows if r["world_size"] == n}
        for ax, key, ref, title in ((axes[0][2 * k], "speedup", 1.0, f"N={n}: speed over eager DDP (x)"),
                                    (axes[0][2 * k + 1], "mem_ratio", 1.1, f"N={n}: peak reserved / DDP's")):
            values = [here[m][key] for m in models if m in here and key in here[m]]
            for y, m in enumerate(models):
                r = here.get(m)
                if r is None or key not in r:
                    why = "not run" if r is None else r["status"] if r["status"] != "ok" else "not measured"
                    ax.text(ref, y, f" {why}", va="center", fontsize=6, color="#555555")
                    continue
                color = TIER_COLORS.get(r.get("pgd_tier"), "#999999")
                if key == "speedup":  # from 1 (DDP) to the value: right is faster, left slower
                    ax.barh(y, r[key] - 1.0, left=1.0, color=color, height=0.75)
                else:
                    ax.barh(y, r[key], color=color, height=0.75)
                ax.text(r[key], y, f" {r[key]:.2f}", va="center", fontsize=6,
                        ha="left" if r[key] >= ref or key != "speedup" else "right")
            ax.axvline(ref, color="black", lw=0.8, ls="--")
            if key == "speedup":
                ax.set_xscale("log")
                lo, hi = min(values + [0.8]), max(values + [1.25])
                ax.set_xlim(lo / 1.3, hi * 1.5)
                ax.xaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
                ax.xaxis.set_major_formatter(ScalarFormatter())
                ax.xaxis.set_minor_formatter(NullFormatter())
            else:
                ax.set_xlim(0, max(values + [1.2]) * 1.25)
            ax.set_title(title, fontsize=8)
            ax.tick_params(axis="x", labelsize=7)
            ax.grid(axis="x", alpha=0.3)
    axes[0][0].set_yticks(range(len(models)), models, fontsize=7)
    axes[0][0].set_ylim(len(models) - 0.5, -0.5)
    handles = [Patch(color=c, label=TIER_LABELS[t]) for t, c in TIER_COLORS.items()] + \
        [Patch(color="#999999", label="other (warming up, no steps)")]
    fig.legend(handles=handles, loc="lower center", ncol=4, fontsize=7, frameon=False)
    fig.suptitle(f"Coverage corpus: {len(models)} model classes, {env.get('gpu', 'CPU')}, torch {env.get('torch')}",
                 fontsize=9)
    fig.tight_layout(rect=(0, 0.04, 1, 0.97))
    path = Path(f"{stem}-coverage.png")
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return [path]

if __name__ == "__main__":
    src = Path(sys.argv[1])
    for p in plot_all(json.loads(src.read_text()), src.with_suffix("")):
        print(p)
