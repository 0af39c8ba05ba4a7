"""Hugging Face Trainer: ms per optimizer step, stock ``Trainer`` (DDP) against
``PGDTrainer`` (pygraph_dist), side by side in one process.

    torchrun --nproc-per-node=1 benchmarks/bench_hf.py --out benchmarks/results/h100-hf.json  # one GPU
    torchrun --nproc-per-node=2 benchmarks/bench_hf.py --out results/hf-n2.json
    python benchmarks/bench_hf.py --smoke --out /tmp/hf.json                   # the harness on a CPU

Workload: a GPT-2 built from a config (nothing downloaded; default 6 layers,
384 wide, 6 heads, vocabulary 8192, per-device batch 32 x 128 tokens — small
enough that an eager step is bound by kernel launches), bf16 on CUDA
(``TrainingArguments(bf16=True)``), AdamW, ``max_grad_norm=1.0``, a linear
schedule, the loss logged every ``--logging-steps``. Both trainers get the same
``TrainingArguments``, model initialisation and data; the stock one runs first.

Columns:
  trainer      Trainer (stock: DDP at N>1, the plain module at N=1) or PGDTrainer
  ms/step      median over windows of --window optimizer steps of (wall time of the
               window / its steps), the window bounded by torch.cuda.synchronize()
               on every rank (so it is GPU-inclusive); the first --warmup steps are
               not timed; max over ranks
  steps        timed optimizer steps
  tier / replays   pygraph_dist.report() for PGDTrainer: the tier of the first
               input signature, and graph replays
  speedup      Trainer ms/step / PGDTrainer ms/step
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

if "WORLD_SIZE" not in os.environ and "CUDA_VISIBLE_DEVICES" not in os.environ:
    # One process without a launcher: one GPU. With several visible, the stock Trainer
    # would use nn.DataParallel (not the DDP baseline) and PGDTrainer refuses to.
    os.environ["CUDA_VISIBLE_DEVICES"] = "0"

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

import pygraph_dist as pgd  # noqa: E402


class StepTimer:
    """A TrainerCallback timing windows of optimizer steps after a warm-up."""

    def __init__(self, warmup: int, window: int) -> None:
        self.warmup, self.window = warmup, window
        self.windows: list[float] = []  # ms per step of each window
        self._t0 = None

    def _sync(self) -> float:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        step = state.global_step
        if step < self.warmup or (step - self.warmup) % self.window:
            return control
        now = self._sync()
        if self._t0 is not None:
            self.windows.append(1000 * (now - self._t0) / self.window)
        self._t0 = now
        return control


def _callback(timer: StepTimer):
    from transformers import TrainerCallback

    class Timed(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            return timer.on_step_end(args, state, control, **kwargs)

    return Timed()


def _max_over_ranks(x: float) -> float:
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return x
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    t = torch.tensor([x], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def bench_one(plain: bool, cfg: dict, out_dir: str) -> dict:
    from hf_trainer import run

    timer = StepTimer(cfg["warmup"], cfg["window"])
    extra = {} if cfg["nan_filter"] else {"logging_nan_inf_filter": False}
    started = time.perf_counter()
    run(plain, out_dir, steps=cfg["steps"], batch=cfg["batch"], seq=cfg["seq"], layers=cfg["layers"],
        width=cfg["width"], vocab=cfg["vocab"], accum=cfg["accum"], logging_steps=cfg["logging_steps"],
        eval_steps=None, callbacks=(_callback(timer),), **extra)
    total_s = time.perf_counter() - started
    ms = statistics.median(timer.windows) if timer.windows else float("nan")
    row = {"trainer": "Trainer" if plain else "PGDTrainer", "ms_per_step": _max_over_ranks(ms),
           "steps_timed": len(timer.windows) * cfg["window"], "windows_ms": timer.windows,
           "total_s": total_s}
    if not plain:
        rep = pgd.report().models[-1]
        row.update(tier=rep.graphs[0].tier if rep.graphs else "", replays=rep.replays, loop=rep.loop,
                   report=str(pgd.report()))
    return row


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="JSON file to write")
    parser.add_argument("--smoke", action="store_true", help="a few steps of a tiny model on the CPU")
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--width", type=int, default=384)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=32, help="per-device batch (sequences)")
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--accum", type=int, default=1, help="gradient_accumulation_steps")
    parser.add_argument("--warmup", type=int, default=20, help="optimizer steps before timing")
    parser.add_argument("--window", type=int, default=10)
    parser.add_argument("--windows", type=int, default=8)
    parser.add_argument("--logging-steps", type=int, default=50)
    parser.add_argument("--no-nan-filter", dest="nan_filter", action="store_false",
                        help="logging_nan_inf_filter=False (the Trainer's default checks every loss on the host)")
    args = parser.parse_args(argv)
    if args.smoke:
        args.layers, args.width, args.vocab, args.batch, args.seq = 2, 64, 128, 4, 32
        args.warmup, args.window, args.windows, args.logging_steps = 2, 2, 2, 2
    cfg = {k: getattr(args, k) for k in ("layers", "width", "vocab", "batch", "seq", "accum", "warmup",
                                          "window", "logging_steps", "nan_filter")}
    cfg["steps"] = args.warmup + args.window * args.windows

    pgd.init()  # before TrainingArguments: both trainers use this process group
    import accelerate
    import transformers

    with tempfile.TemporaryDirectory() as out_dir:
        rows = [bench_one(True, cfg, out_dir), bench_one(False, cfg, out_dir)]
    stock, ours = rows
    result = {
        "benchmark": "bench_hf", "config": cfg, "world_size": dist.get_world_size(),
        "bf16": torch.cuda.is_available(),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu",
        "torch": torch.__version__, "transformers": transformers.__version__,
        "accelerate": accelerate.__version__, "rows": rows,
        "speedup": stock["ms_per_step"] / ours["ms_per_step"],
    }
    if dist.get_rank() == 0:
        print(f"{'trainer':<12} {'ms/step':>9} {'steps':>6} {'tier':>5} {'replays':>8}")
        for r in rows:
            print(f"{r['trainer']:<12} {r['ms_per_step']:9.2f} {r['steps_timed']:6d} {r.get('tier', ''):>5} "
                  f"{r.get('replays', ''):>8}")
        print(f"speedup (Trainer / PGDTrainer): {result['speedup']:.2f}x")
        print(ours["report"])
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1))
    pgd.shutdown()


if __name__ == "__main__":
    main()
