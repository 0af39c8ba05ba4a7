"""Hugging Face Trainer or Accelerate: ms per optimizer step, stock ``Trainer`` (DDP)
against ``PGDTrainer`` (pygraph_dist), or stock ``Accelerator`` against
``PGDAccelerator``, side by side in one process.

    torchrun --nproc-per-node=1 benchmarks/bench_hf.py --out benchmarks/results/h100-hf.json  # one GPU
    torchrun --nproc-per-node=2 benchmarks/bench_hf.py --out results/hf-n2.json
    torchrun --nproc-per-node=1 benchmarks/bench_hf.py --framework accelerate --out results/h100-accelerate.json
    python benchmarks/bench_hf.py --smoke --out /tmp/hf.json                   # the harness on a CPU

Workload: a GPT-2 built from a config (nothing downloaded; default 6 layers,
384 wide, 6 heads, vocabulary 8192, per-device batch 32 x 128 tokens — small
enough that an eager step is bound by kernel launches), bf16 on CUDA
(``TrainingArguments(bf16=True)``), AdamW, ``max_grad_norm=1.0``, a linear
schedule, the loss logged every ``--logging-steps``. Both trainers get the same
``TrainingArguments``, model initialisation and data; the stock one runs first.
``--framework accelerate``: ``examples/accelerate_loop.py``'s hand-written loop
(``run``: the same GPT-2 and data, ``accelerator.accumulate``, ``clip_grad_norm_``,
a linear schedule, ``accelerator.reduce`` of the loss every ``--logging-steps``,
then a short evaluation, untimed) with ``Accelerator(mixed_precision="bf16",
gradient_accumulation_steps=--accum)`` and then ``PGDAccelerator`` with the same
arguments; the same clock through the loop's per-step hook.

Columns:
  trainer      Trainer (stock: DDP at N>1, the plain module at N=1) or PGDTrainer;
               with --framework accelerate, Accelerator (likewise) or PGDAccelerator
  ms/step      median over windows of --window optimizer steps of (wall time of the
               window / its steps), the window bounded by torch.cuda.synchronize()
               on every rank (so it is GPU-inclusive); the first --warmup steps are
               not timed; max over ranks
  steps        timed optimizer steps
  tier / replays   pygraph_dist.report() for PGDTrainer (PGDAccelerator): the tier of
               the first training input signature, and graph replays
  speedup      Trainer ms/step / PGDTrainer ms/step (Accelerator / PGDAccelerator)
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

    def tick(self, step: int) -> None:
        """After optimizer step ``step`` (1, 2, ...)."""
        if step < self.warmup or (step - self.warmup) % self.window:
            return
        now = self._sync()
        if self._t0 is not None:
            self.windows.append(1000 * (now - self._t0) / self.window)
        self._t0 = now

    def on_step_end(self, args, state, control, **kwargs):
        self.tick(state.global_step)
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
    return _row("Trainer" if plain else "PGDTrainer", plain, timer, cfg, time.perf_counter() - started)


def _row(label: str, plain: bool, timer: StepTimer, cfg: dict, total_s: float) -> dict:
    """One table row: the median window, max over ranks; pygraph_dist's report for ours."""
    ms = statistics.median(timer.windows) if timer.windows else float("nan")
    row = {"trainer": label, "ms_per_step": _max_over_ranks(ms), "steps_timed": len(timer.windows) * cfg["window"],
           "windows_ms": timer.windows, "total_s": total_s}
    if not plain:
        row.update(_pgd_columns())
    return row


def _pgd_columns() -> dict:
    rep = pgd.report().models[-1]
    train = [g for g in rep.graphs if g.tier != "eval"]  # the Accelerate loop's evaluation has graphs too
    return dict(tier=train[0].tier if train else "", replays=rep.replays, loop=rep.loop, report=str(pgd.report()))


def bench_accelerate(plain: bool, cfg: dict) -> dict:
    """examples/accelerate_loop.py's run() with Accelerator (plain) or PGDAccelerator.
    No end_training(): it would destroy the process group both share."""
    from accelerate import Accelerator
    from accelerate_loop import run

    from pygraph_dist.integrations.hf import PGDAccelerator

    timer = StepTimer(cfg["warmup"], cfg["window"])
    cuda = torch.cuda.is_available()
    options = dict(mixed_precision="bf16" if cuda else "no", gradient_accumulation_steps=cfg["accum"], cpu=not cuda)
    accelerator = Accelerator(**options) if plain else PGDAccelerator(**options)
    started = time.perf_counter()
    run(accelerator, steps=cfg["steps"], batch=cfg["batch"], seq=cfg["seq"], layers=cfg["layers"],
        width=cfg["width"], vocab=cfg["vocab"], log_every=cfg["logging_steps"], on_step=timer.tick)
    return _row("Accelerator" if plain else "PGDAccelerator", plain, timer, cfg, time.perf_counter() - started)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="JSON file to write")
    parser.add_argument("--smoke", action="store_true", help="a few steps of a tiny model on the CPU")
    parser.add_argument("--framework", choices=("trainer", "accelerate"), default="trainer",
                        help="transformers.Trainer (examples/hf_trainer.py) or an Accelerate loop "
                             "(examples/accelerate_loop.py)")
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
    cfg = {k: getattr(args, k) for k in ("framework", "layers", "width", "vocab", "batch", "seq", "accum",
                                          "warmup", "window", "logging_steps", "nan_filter")}
    cfg["steps"] = args.warmup + args.window * args.windows

    pgd.init()  # before TrainingArguments: both trainers use this process group
    import accelerate
    import transformers

    if args.framework == "accelerate":
        rows = [bench_accelerate(True, cfg), bench_accelerate(False, cfg)]
    else:
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
        print(f"{'trainer':<14} {'ms/step':>9} {'steps':>6} {'tier':>5} {'replays':>8}")
        for r in rows:
            print(f"{r['trainer']:<14} {r['ms_per_step']:9.2f} {r['steps_timed']:6d} {r.get('tier', ''):>5} "
                  f"{r.get('replays', ''):>8}")
        print(f"speedup ({stock['trainer']} / {ours['trainer']}): {result['speedup']:.2f}x")
        print(ours["report"])
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1))
    pgd.shutdown()


if __name__ == "__main__":
    main()
