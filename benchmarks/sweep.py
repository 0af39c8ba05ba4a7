"""Sweep settings over the same benchmark rows: which NCCL variable, allocator
setting or wrap() option moves ms/it and weak scaling, measured in one sitting.

    python benchmarks/sweep.py --workloads mlp --modes pgd_bf16 --world-sizes 2,1 \\
        --variant base \\
        --variant 'ctas4:NCCL_MAX_CTAS=4' \\
        --variant 'simple:NCCL_PROTO=Simple' \\
        --variant 'casts_off:PYGRAPH_DIST_FAST_CASTS=0' \\
        --variant 'bucket50:{"bucket_cap_mb": 50}' \\
        --variant 'both:NCCL_MAX_CTAS=4,NCCL_PROTO=Simple:{"bucket_cap_mb": 50}'

A variant is ``NAME[:VAR=VALUE,...][:{wrap() keyword arguments as JSON}]``. Each
variant is one run of bench_scaling.py with those environment variables (the
ranks inherit them; the results record them in environment["settings"]) and
``--wrap-kwargs``; every other flag after the sweep's own goes to every run.
The first variant is the reference, and it runs again at the end
(``<name>-again``): how far the two reference runs differ is the noise any
other difference has to beat.

Writes ``<out-dir>/<name>.json`` (every variant's cells and settings), the
table as ``<name>.txt`` and, with matplotlib, ``<name>.png``: ms/it per variant
and world size, with the weak-scaling efficiency T(1)/T(N) where both ran.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def parse_variant(spec: str) -> dict:
    """``NAME[:VAR=VALUE,...][:{json}]`` -> {"name", "env", "wrap_kwargs"}."""
    head, brace, tail = spec.partition("{")
    wrap = {}
    if brace:
        try:
            wrap = json.loads(brace + tail)
        except json.JSONDecodeError as exc:
            raise SystemExit(f"--variant {spec!r}: the wrap() arguments are not JSON ({exc})") from None
        if not isinstance(wrap, dict):
            raise SystemExit(f"--variant {spec!r}: the wrap() arguments must be a JSON object")
        if not head.endswith(":"):
            raise SystemExit(f"--variant {spec!r}: write NAME:VAR=VALUE:{{...}} or NAME:{{...}}")
        head = head[:-1]
    name, _, env_part = head.partition(":")
    if not name or not name.replace("_", "").replace("-", "").isalnum():
        raise SystemExit(f"--variant {spec!r}: the name must be letters, digits, '_' or '-'")
    env = {}
    for kv in filter(None, env_part.split(",")):
        var, eq, value = kv.partition("=")
        if not eq or not var:
            raise SystemExit(f"--variant {spec!r}: {kv!r} is not VAR=VALUE")
        env[var.strip()] = value.strip()
    return {"name": name, "env": env, "wrap_kwargs": wrap}


def run_variant(v: dict, bench_args: list[str], out_dir: Path, stem: str, log) -> dict:
    name = f"{stem}-{v['name']}"
    cmd = [sys.executable, str(HERE / "bench_scaling.py"), *bench_args, "--out-dir", str(out_dir),
           "--name", name, "--no-plots"]
    if v["wrap_kwargs"]:
        cmd += ["--wrap-kwargs", json.dumps(v["wrap_kwargs"])]
    env = {**os.environ, **v["env"]}
    t0 = time.perf_counter()
    p = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    log.write(f"==== {v['name']}: {' '.join(f'{k}={x}' for k, x in v['env'].items())} {cmd}\n{p.stdout}\n")
    log.flush()
    path = out_dir / f"{name}.json"
    result = json.loads(path.read_text()) if path.exists() else {"cells": [], "environment": {}}
    return {**v, "returncode": p.returncode, "wall_s": round(time.perf_counter() - t0, 1),
            "settings": result.get("environment", {}).get("settings", {}),
            "cells": result["cells"], "results_file": path.name}


def _row(c: dict) -> tuple:
    """A cell's row across variants and world sizes: (workload, mode, loop)."""
    return c["workload"], c["mode"], c.get("loop", "inside")


def table(variants: list[dict]) -> str:
    """One line per variant, workload, mode and loop: ms/it per world size, efficiency, vs the reference."""
    ref = {}
    lines = []
    sizes = sorted({c["world_size"] for v in variants for c in v["cells"]})
    head = f"{'variant':<14} {'workload':<10} {'mode':<12} {'loop':<8} " + " ".join(
        f"{'N=' + str(n) + ' ms':>9}" for n in sizes) + f" {'eff':>6} {'vs ref':>7}"
    lines += [head, "-" * len(head)]
    for i, v in enumerate(variants):
        rows: dict[tuple, dict] = {}
        for c in v["cells"]:
            if c["status"] == "ok" and c.get("condition", "baseline") == "baseline":
                rows.setdefault(_row(c), {})[c["world_size"]] = c
        for k, per_n in sorted(rows.items()):
            top = per_n[max(per_n)]
            eff = top.get("scaling_efficiency") if max(per_n) > 1 else None
            if i == 0:
                ref[k] = top["ms_per_it"]
            vs = f"{top['ms_per_it'] / ref[k]:.3f}" if k in ref and i else ""
            cols = " ".join(f"{per_n[n]['ms_per_it']:>9.3f}" if n in per_n else f"{'-':>9}" for n in sizes)
            lines.append(f"{v['name']:<14} {k[0]:<10} {k[1]:<12} {k[2]:<8} {cols} "
                         f"{(f'{100 * eff:.1f}%' if eff else '-'):>6} {vs:>7}")
        bad = [c for c in v["cells"] if c["status"] != "ok"]
        if bad or v["returncode"]:
            lines.append(f"{v['name']:<14} exit {v['returncode']}; {len(bad)} cells not ok: "
                         + "; ".join(f"{c['workload']}/{c['mode']}/N={c['world_size']}: {c.get('reason', c['status'])}"
                                     for c in bad[:3]))
    lines.append("eff = T(N=1)/T(N) at the largest N; vs ref = ms/it at the largest N over the first variant's")
    return "\n".join(lines)


def plot(variants: list[dict], png: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    keys = sorted({_row(c) for v in variants for c in v["cells"]
                   if c["status"] == "ok"})
    sizes = sorted({c["world_size"] for v in variants for c in v["cells"] if c["status"] == "ok"})
    if not keys or not sizes:
        return None
    fig, axes = plt.subplots(len(keys), 1, figsize=(8, 1.2 + 0.45 * len(variants) * len(keys)), squeeze=False)
    for ax, k in zip(axes[:, 0], keys):
        names = [v["name"] for v in variants]
        h = 0.8 / len(sizes)
        for j, n in enumerate(sizes):
            ys, xs, effs = [], [], []
            for i, v in enumerate(variants):
                c = next((c for c in v["cells"] if c["status"] == "ok" and c["world_size"] == n
                          and _row(c) == k), None)
                if c:
                    ys.append(i + j * h)
                    xs.append(c["ms_per_it"])
                    effs.append(c.get("scaling_efficiency"))
            bars = ax.barh(ys, xs, height=h, label=f"N={n}")
            for b, e in zip(bars, effs):
                if e and n == max(sizes) and n > 1:
                    ax.text(b.get_width(), b.get_y() + h / 2, f" {100 * e:.1f}%", va="center", fontsize=8)
        ax.set_yticks([i + h * (len(sizes) - 1) / 2 for i in range(len(names))], names)
        ax.invert_yaxis()
        ax.set_xlabel("ms per iteration (lower is better); % = weak-scaling efficiency")
        ax.set_title(" / ".join(k), fontsize=10)
        ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return png


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                 usage="%(prog)s --variant SPEC [--variant SPEC ...] [--name N] [--out-dir D] "
                                       "[--no-repeat] [bench_scaling.py flags]")
    ap.add_argument("--variant", action="append", required=True, help="NAME[:VAR=VALUE,...][:{json}]")
    ap.add_argument("--name", default=None, help="results stem (default: sweep-<date>)")
    ap.add_argument("--out-dir", default=str(HERE / "results"))
    ap.add_argument("--no-repeat", action="store_true", help="do not run the first variant again at the end")
    args, bench_args = ap.parse_known_args(argv)
    for flag in ("--name", "--out-dir", "--wrap-kwargs", "--worker", "--plan", "--part"):
        if any(a == flag or a.startswith(flag + "=") for a in bench_args):
            raise SystemExit(f"{flag} is the sweep's to set: give it to sweep.py itself, or as a variant")
    variants = [parse_variant(s) for s in args.variant]
    names = [v["name"] for v in variants]
    if len(set(names)) != len(names):
        raise SystemExit(f"variant names repeat: {names}")
    if not args.no_repeat and len(variants) > 1:
        variants.append({**variants[0], "name": variants[0]["name"] + "-again"})
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = args.name or time.strftime("sweep-%Y%m%d-%H%M%S")
    done = []
    with open(out_dir / f"{stem}.log", "w") as log:
        for i, v in enumerate(variants, 1):
            print(f"[sweep] {i}/{len(variants)} {v['name']} "
                  f"{' '.join(f'{k}={x}' for k, x in v['env'].items())} {json.dumps(v['wrap_kwargs']) if v['wrap_kwargs'] else ''}",
                  file=sys.stderr, flush=True)
            r = run_variant(v, bench_args, out_dir, stem, log)
            done.append(r)
            print(f"[sweep]   exit {r['returncode']}, {sum(c['status'] == 'ok' for c in r['cells'])} cells ok "
                  f"in {r['wall_s']:.0f} s", file=sys.stderr, flush=True)
            result = {"bench_args": bench_args, "variants": done, "complete": len(done) == len(variants)}
            (out_dir / f"{stem}.json").write_text(json.dumps(result, indent=1))
    text = table(done)
    (out_dir / f"{stem}.txt").write_text(text + "\n")
    print(text)
    png = plot(done, out_dir / f"{stem}.png")
    print(f"[sweep] {out_dir / (stem + '.json')}" + (f", plot {png}" if png else ""), file=sys.stderr)
    return 0 if all(r["returncode"] == 0 for r in done) else 1


if __name__ == "__main__":
    sys.exit(main())
