"""PNG plots from a bench_scaling.py results JSON.

    python benchmarks/plots.py benchmarks/results/<name>.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

MODE_COLORS = {"ddp": "#7f7f7f", "ddp_graph": "#1f77b4", "compile": "#ff7f0e", "pgd": "#2ca02c"}
MODE_LABELS = {"ddp": "eager DDP", "ddp_graph": "hand-written graph + DDP",
               "compile": "torch.compile reduce-overhead", "pgd": "pygraph_dist"}


def _ok(cells, **match):
    return [c for c in cells if c["status"] == "ok" and all(c.get(k) == v for k, v in match.items())]


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

    def bars(key: str, ylabel: str, title: str, suffix: str, ref_line: float | None):
        fig, ax = plt.subplots(figsize=(1.8 + 1.6 * len(workloads), 4))
        width = 0.8 / max(1, len(modes))
        for i, m in enumerate(modes):
            ys = []
            for w in workloads:
                hit = _ok(cells, workload=w, mode=m, world_size=n_max, condition=cond)
                ys.append(hit[0].get(key, float("nan")) if hit else float("nan"))
            xs = [j + (i - (len(modes) - 1) / 2) * width for j in range(len(workloads))]
            ax.bar(xs, ys, width, label=MODE_LABELS[m], color=MODE_COLORS[m])
        if ref_line is not None:
            ax.axhline(ref_line, color="black", lw=0.8, ls="--")
        ax.set_xticks(range(len(workloads)), workloads)
        ax.set_ylabel(ylabel)
        ax.set_title(f"{title} (N={n_max}, {cond})\n{subtitle}", fontsize=9)
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=len(modes), frameon=False)
        fig.tight_layout()
        path = Path(f"{stem}-{suffix}.png")
        fig.savefig(path, dpi=120)
        plt.close(fig)
        out.append(path)

    if n_max > 1 and 1 in sizes:
        bars("scaling_efficiency", "weak-scaling efficiency T(1)/T(N)", "Scaling efficiency 1 -> N GPUs",
             "efficiency", 1.0)
    bars("speedup_vs_ddp", "speedup vs eager DDP", "Iteration speed relative to eager DDP", "speedup", 1.0)

    cdf_modes = [m for m in ("ddp", "pgd") if m in modes]
    cdf_workloads = [w for w in workloads if _ok(cells, workload=w, condition="jitter", world_size=n_max)]
    if cdf_workloads and cdf_modes:
        from matplotlib.ticker import LogLocator, NullFormatter, ScalarFormatter

        fig, axes = plt.subplots(1, len(cdf_workloads), figsize=(3.6 * len(cdf_workloads), 3.4), squeeze=False)
        for ax, w in zip(axes[0], cdf_workloads):
            for m in cdf_modes:
                for c_name, style in (("sync10", "-"), ("jitter", "--")):
                    hit = _ok(cells, workload=w, mode=m, world_size=n_max, condition=c_name)
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
        fig.suptitle(f"Iteration-time CDF with and without host jitter (p=0.05, 5 ms), N={n_max} — {subtitle}",
                     fontsize=9)
        fig.tight_layout()
        path = Path(f"{stem}-cdf.png")
        fig.savefig(path, dpi=120)
        plt.close(fig)
        out.append(path)
    return out


if __name__ == "__main__":
    src = Path(sys.argv[1])
    for p in plot_all(json.loads(src.read_text()), src.with_suffix("")):
        print(p)
