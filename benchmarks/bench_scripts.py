"""The GPT pretraining script, side by side: DDP, pygraph_dist, and each with the user's torch.compile.

Runs ``examples/scripts/gpt_pretrain.py`` (issue 25's 10.7M-parameter
character GPT: 6 layers x 384, 6 heads, block 256, batch 64, dropout 0.2,
its own bf16 autocast, fused AdamW, a float lr written every iteration) once
per mode, each in its own process under ``torchrun --nproc-per-node=1``, one
after the other:

    ddp            DistributedDataParallel(model)
    pgd            pygraph_dist.wrap(model, optimizer)
    ddp+compile    torch.compile(model), then DDP
    pgd+compile    torch.compile(model), then pygraph_dist.wrap
    pgd_nographs   pygraph_dist.wrap(..., graphs=False): the eager reference
                   the graphed evaluation must equal bitwise

One process per mode so that each starts cold and alike (no compile cache,
CUDA allocator state or graph pool carried over from another mode) and a
crash in one mode does not lose the others.

Definitions (as written in each row):
    ms/it      wall time per training iteration, mean over --steps iterations
               after --warmup iterations (probe, capture, compilation), with
               the device synchronised at both ends and evaluation time
               taken out.
    x DDP      ms/it of the ddp row / ms/it of this row (higher is faster);
               x DDP+compile likewise against the ddp+compile row.
    s/eval     one ``estimate_loss()`` (model.eval() + torch.no_grad(),
               --eval-batches batches over the train and val splits, one
               ``loss.item()`` per batch), synchronised; the median over the
               evaluations after the first (the first warms up and captures).

Writes ``bench_scripts.json`` and ``bench_scripts.txt`` (the table, and
issue 25's acceptance checks: pgd >= 2.5x DDP, pgd+compile >= 2.5x
DDP+compile, graphed evaluation >= 2x DDP's, bitwise equal to graphs=False;
``--strict`` exits 1 unless all hold) to ``--out-dir``. ``--smoke``: a tiny model for a few steps on the CPU (compile
with the eager backend), to test the harness.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "scripts" / "gpt_pretrain.py"
MODES = {  # name -> gpt_pretrain.py arguments
    "ddp": ["--mode", "ddp"],
    "pgd": ["--mode", "pgd"],
    "ddp+compile": ["--mode", "ddp", "--compile"],
    "pgd+compile": ["--mode", "pgd", "--compile"],
    "pgd_nographs": ["--mode", "pgd_nographs"],
}
ISSUE_SHAPE = ["--n-layer", "6", "--n-embd", "384", "--n-head", "6", "--block-size", "256", "--batch-size", "64",
               "--dropout", "0.2", "--dtype", "bfloat16", "--grad-accum-steps", "1"]
SMOKE_SHAPE = ["--n-layer", "2", "--n-embd", "32", "--n-head", "2", "--block-size", "32", "--batch-size", "8",
               "--dropout", "0.2", "--compile-backend", "eager"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def schedule(warmup: int, steps: int, eval_batches: int, evaluations: int) -> list[str]:
    """gpt_pretrain.py arguments for ``warmup`` + ``steps`` iterations (it runs
    iterations 0..max_iters) with ``evaluations`` evaluations spread over them."""
    total = warmup + steps
    interval = max(1, (total - 1) // max(1, evaluations - 1))
    return ["--max-iters", str(total - 1), "--time-from", str(warmup), "--eval-interval", str(interval),
            "--eval-iters", str(max(1, eval_batches // 2)), "--log-interval", str(max(10, total)),
            "--warmup-iters", str(min(100, total // 4)), "--lr-decay-iters", str(total), "--no-checkpoint"]


def run_mode(mode: str, shape: list[str], sched: list[str], out_dir: Path, timeout: float) -> dict:
    """One mode in its own torchrun process; its result JSON (or the failure)."""
    mode_dir = out_dir / mode.replace("+", "_")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=1", "--master-addr=127.0.0.1",
           f"--master-port={free_port()}", str(SCRIPT), *MODES[mode], *shape, *sched, "--out-dir", str(mode_dir)]
    env = dict(os.environ, NCCL_NVLS_ENABLE="0", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    mode_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with open(mode_dir / "log.txt", "w") as log:
        try:
            p = subprocess.run(cmd, cwd=str(ROOT), env=env, stdout=log, stderr=subprocess.STDOUT, timeout=timeout)
            rc = p.returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    if rc != 0:
        tail = (mode_dir / "log.txt").read_text()[-3000:]
        return {"mode": mode, "error": f"exit {rc}", "log_tail": tail}
    result = json.loads((mode_dir / "result_rank0.json").read_text())
    result["mode"], result["wall_s"] = mode, time.perf_counter() - t0
    return result


def is_eval_record(g: dict) -> bool:
    """An evaluation (forward-only) signature's record in ``pgd.report()`` (evaluation.py)."""
    return g.get("tier") == "eval"


def summarize(results: list[dict], eval_batches: int) -> dict:
    ok = {r["mode"]: r for r in results if "error" not in r}
    base, base_c = ok.get("ddp"), ok.get("ddp+compile")
    train, evals = [], []
    for r in results:
        if "error" in r:
            train.append({"mode": r["mode"], "error": r["error"]})
            continue
        ms = r["ms_per_iter"]
        row = {"mode": r["mode"], "ms_per_iter": ms,
               "x_vs_ddp": base["ms_per_iter"] / ms if base else None,
               "x_vs_ddp_compile": base_c["ms_per_iter"] / ms if base_c else None,
               "final_loss": r["losses"][-1] * r["grad_accum_steps_per_rank"],
               "mfu": r["mfu"], "wall_s": r["wall_s"]}
        rep = r.get("report")
        if rep:
            train_graphs = [g for g in rep["graphs"] if not is_eval_record(g)]
            eval_graphs = [g for g in rep["graphs"] if is_eval_record(g)]
            row["eval_replays"] = sum(g["replays"] for g in eval_graphs)
            row["tier"] = next((g["tier"] for g in train_graphs if g["tier"]), "")
            row["replays"] = sum(g["replays"] for g in train_graphs)
            row["iterations"] = sum(g["iterations"] for g in train_graphs)
            row["invalidations"] = sum(e["event"] == "invalidated" for e in rep["events"])
        train.append(row)
        timed = r["eval_seconds"][1:]
        if timed:
            s = statistics.median(timed)
            evals.append({"mode": r["mode"], "s_per_eval": s, "ms_per_batch": s * 1e3 / (2 * (eval_batches // 2)),
                          "evaluations": len(timed), "graph_replays": row.get("eval_replays")})
    eager_eval = next((e["s_per_eval"] for e in evals if e["mode"] == "ddp"), None)
    for e in evals:
        e["x_vs_ddp"] = eager_eval / e["s_per_eval"] if eager_eval else None
    bitwise = None
    if "pgd" in ok and "pgd_nographs" in ok:
        bitwise = {"eval": ok["pgd"]["evals"] == ok["pgd_nographs"]["evals"],
                   "losses": ok["pgd"]["losses"] == ok["pgd_nographs"]["losses"]}
    any_ok = next(iter(ok.values()), {})
    return {"device": any_ok.get("device"), "torch": any_ok.get("torch"), "num_params": any_ok.get("num_params"),
            "train": train, "eval": evals, "pgd_vs_graphs_false_bitwise": bitwise}


# Issue 25's acceptance at the issue's shape: (what, numerator row, denominator row, at least).
ACCEPTANCE = [("train: pgd x DDP", "pgd", "ddp", 2.5),
              ("train: pgd+compile x DDP+compile", "pgd+compile", "ddp+compile", 2.5),
              ("eval: pgd (graphed) x DDP (eager)", "pgd", "ddp", 2.0)]


def acceptance(summary: dict) -> list[dict]:
    """Each acceptance row: the measured ratio and whether it holds (None: a row is missing)."""
    train = {r["mode"]: r.get("ms_per_iter") for r in summary["train"]}
    evals = {e["mode"]: e["s_per_eval"] for e in summary["eval"]}
    out = []
    for what, fast, slow, need in ACCEPTANCE:
        times = evals if what.startswith("eval") else train
        ratio = times[slow] / times[fast] if times.get(slow) and times.get(fast) else None
        out.append({"check": what, "ratio": ratio, "need": need, "ok": None if ratio is None else ratio >= need})
    bitwise = summary["pgd_vs_graphs_false_bitwise"]
    out.append({"check": "pgd bitwise equal to pgd_nographs (losses, evaluation)", "ratio": None, "need": None,
                "ok": None if bitwise is None else bitwise["losses"] and bitwise["eval"]})
    return out


def _x(v) -> str:
    return f"{v:.2f}" if v is not None else "-"


def table(summary: dict, args: argparse.Namespace) -> str:
    n = summary["num_params"]
    lines = [
        f"# gpt_pretrain.py, {n / 1e6:.1f}M parameters ({' '.join(args.shape_args)}); {summary['device']}; "
        f"torch {summary['torch']}",
        f"# ms/it: mean over {args.steps} iterations after {args.warmup} warm-up ones, evaluation excluded; "
        "x DDP, x DDP+compile: that row's ms/it / this row's",
        f"{'mode':<14} {'ms/it':>8} {'x DDP':>7} {'x DDP+compile':>14} {'tier':>5} {'replays/iters':>14} "
        f"{'invalidated':>12}",
    ]
    for r in summary["train"]:
        if "error" in r:
            lines.append(f"{r['mode']:<14} failed: {r['error']}")
            continue
        rep = f"{r['replays']}/{r['iterations']}" if "replays" in r else "-"
        lines.append(f"{r['mode']:<14} {r['ms_per_iter']:>8.2f} {_x(r['x_vs_ddp']):>7} "
                     f"{_x(r['x_vs_ddp_compile']):>14} {r.get('tier', '-') or '-':>5} {rep:>14} "
                     f"{r.get('invalidations', '-'):>12}")
    lines += [
        "",
        f"# s/eval: estimate_loss() of {2 * (args.eval_batches // 2)} batches under model.eval() + no_grad(), "
        "median over the evaluations after the first; x DDP: DDP's s/eval / this row's",
        f"{'mode':<14} {'s/eval':>8} {'ms/batch':>9} {'x DDP':>7} {'evals':>6} {'eval graph replays':>19}",
    ]
    for e in summary["eval"]:
        replays = "-" if e["graph_replays"] is None else e["graph_replays"]
        lines.append(f"{e['mode']:<14} {e['s_per_eval']:>8.3f} {e['ms_per_batch']:>9.3f} {_x(e['x_vs_ddp']):>7} "
                     f"{e['evaluations']:>6} {replays:>19}")
    if summary["pgd_vs_graphs_false_bitwise"] is not None:
        b = summary["pgd_vs_graphs_false_bitwise"]
        lines.append(f"# pgd vs pgd_nographs bitwise: losses {b['losses']}, evaluation {b['eval']}")
    lines += ["", "# issue 25 acceptance (meaningful at the issue's shape on a GPU only)"]
    for a in summary["acceptance"]:
        verdict = {True: "PASS", False: "FAIL", None: "n/a"}[a["ok"]]
        measured = f"{a['ratio']:.2f}x (need {a['need']}x)" if a["ratio"] is not None else ""
        lines.append(f"{verdict:<5} {a['check']} {measured}".rstrip())
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out-dir", default="benchmarks/results/scripts")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)}")
    p.add_argument("--warmup", type=int, default=40, help="untimed iterations (probe, capture, compile)")
    p.add_argument("--steps", type=int, default=300, help="timed iterations")
    p.add_argument("--eval-batches", type=int, default=200, help="batches per evaluation (half per split)")
    p.add_argument("--evaluations", type=int, default=4, help="evaluations per run, the first untimed")
    p.add_argument("--timeout", type=float, default=900, help="seconds per mode")
    p.add_argument("--smoke", action="store_true", help="a tiny model for a few steps (CPU harness test)")
    p.add_argument("--strict", action="store_true", help="exit 1 unless every acceptance check passes")
    args = p.parse_args(argv)
    if args.smoke:
        args.warmup, args.steps, args.eval_batches, args.evaluations = 3, 4, 4, 3
        args.timeout = min(args.timeout, 200)
    args.shape_args = SMOKE_SHAPE if args.smoke else ISSUE_SHAPE
    modes = [m for m in args.modes.split(",") if m]
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        p.error(f"unknown mode(s) {unknown}; choose from {list(MODES)}")
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    sched = schedule(args.warmup, args.steps, args.eval_batches, args.evaluations)
    results = []
    for mode in modes:
        print(f"[bench_scripts] {mode} ...", flush=True)
        results.append(run_mode(mode, args.shape_args, sched, out, args.timeout))
        if "error" in results[-1]:
            print(f"[bench_scripts] {mode} failed: {results[-1]['error']}\n{results[-1]['log_tail']}", flush=True)
    summary = summarize(results, args.eval_batches)
    summary["config"] = {"shape": args.shape_args, "warmup": args.warmup, "steps": args.steps,
                         "eval_batches": args.eval_batches, "evaluations": args.evaluations, "modes": modes}
    summary["acceptance"] = acceptance(summary)
    (out / "bench_scripts.json").write_text(json.dumps(summary, indent=1))
    text = table(summary, args)
    (out / "bench_scripts.txt").write_text(text)
    print(text)
    failed = any("error" in r for r in results)
    if args.strict:
        failed = failed or not all(a["ok"] for a in summary["acceptance"])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
