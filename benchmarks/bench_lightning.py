"""Lightning's Trainer or Fabric, ms per optimizer step: ``strategy="ddp"`` against ``strategy="pgd"``.

The model is ``examples/lightning_gpt.py`` as written (AdamW with a per-step
schedule, ``self.log`` every step, ``accumulate_grad_batches=2``,
``gradient_clip_val=1.0``, bf16-mixed), launch-bound on one GPU by default:
a 6-layer, 384-wide GPT at batch 64 x 256 tokens. Each strategy trains in a
fresh process of its own, one after the other, in this one run; the clock
starts after ``--warmup-steps`` optimizer steps (probe, warm-up and capture
are over by then) and stops at the end of fit, with a CUDA synchronisation at
both ends only.

``--framework fabric``: the same GPT (``lightning_gpt.GPT``, its AdamW at 3e-4
without a schedule) trained by ``examples/fabric_loop.py``'s own loop
(``fabric_loop.train``: accumulation of 2 under ``no_backward_sync``,
``fabric.backward``, ``clip_gradients(max_norm=1.0)``, a loss read every 10
steps) under ``Fabric(strategy="ddp")`` and ``Fabric(strategy="pgd")``; the
clock starts after ``--warmup-steps`` and stops when the loop ends.

    python benchmarks/bench_lightning.py --out benchmarks/results/h100-lightning.json
    python benchmarks/bench_lightning.py --framework fabric --out benchmarks/results/h100-fabric.json
    python benchmarks/bench_lightning.py --smoke --out /tmp/smoke.json   # a few CPU steps
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def child(args: argparse.Namespace) -> dict:
    """One strategy, in this process: fit, and the timed part of it."""
    sys.path.insert(0, str(ROOT / "examples"))
    import torch

    import lightning as L
    import lightning_gpt as ex

    gpu = torch.cuda.is_available() and not args.smoke

    class Clock(L.Callback):
        def __init__(self) -> None:
            self.t0 = self.t1 = None
            self.step0 = self.step1 = 0

        def _sync(self) -> None:
            if gpu:
                torch.cuda.synchronize()

        def on_train_batch_end(self, trainer, *rest) -> None:
            if self.t0 is None and trainer.global_step >= args.warmup_steps:
                self._sync()
                self.t0, self.step0 = time.perf_counter(), trainer.global_step

        def on_train_end(self, trainer, pl_module) -> None:
            self._sync()
            self.t1, self.step1 = time.perf_counter(), trainer.global_step

    L.seed_everything(0)
    model = ex.LitGPT(vocab=256, seq=args.seq, layers=args.layers, width=args.width,
                      heads=max(1, args.width // 64))
    accumulate = 2
    train, _ = ex.loaders(args.batch, args.seq, 256, train_batches=args.steps * accumulate * args.devices)
    clock = Clock()
    trainer = L.Trainer(
        strategy=ex.strategy_for(args.child), accelerator="gpu" if gpu else "cpu", devices=args.devices,
        precision="bf16-mixed" if gpu else "32-true", accumulate_grad_batches=accumulate,
        gradient_clip_val=1.0, max_steps=args.steps, limit_val_batches=0, log_every_n_steps=10,
        enable_checkpointing=False, logger=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[clock])
    trainer.fit(model, train)
    timed = clock.step1 - clock.step0
    if trainer.global_rank != 0:
        return None  # rank 0 reports (Lightning's launcher started this process again for each rank)
    row = {"strategy": args.child, "devices": args.devices,
           "ms_per_step": 1e3 * (clock.t1 - clock.t0) / max(timed, 1),
           "steps_timed": timed, "steps": trainer.global_step,
           "final_loss": float(trainer.callback_metrics["train_loss"]),
           "device": torch.cuda.get_device_name() if gpu else "cpu",
           "precision": "bf16-mixed" if gpu else "32-true"}
    if args.child == "pgd":
        d = trainer.strategy.last_report  # before fit's teardown released the graphs
        row.update(tiers=sorted({g.tier for g in d.graphs}), replays=d.replays, loop=d.loop)
    return row


def fabric_child(args: argparse.Namespace) -> dict:
    """One strategy, in this process: examples/fabric_loop.py's loop, and the timed part of it."""
    sys.path.insert(0, str(ROOT / "examples"))
    import torch

    import fabric_loop
    import lightning as L
    from lightning_gpt import GPT, loaders

    gpu = torch.cuda.is_available() and not args.smoke
    if args.child == "pgd":
        import pygraph_dist.integrations.lightning  # noqa: F401 - registers strategy "pgd"
    fabric = L.Fabric(strategy=args.child, accelerator="gpu" if gpu else "cpu", devices=args.devices,
                      precision="bf16-mixed" if gpu else "32-true")
    fabric.launch()  # at --devices > 1, starts this script again for each other rank
    fabric.seed_everything(0)
    model = GPT(256, args.seq, layers=args.layers, width=args.width, heads=max(1, args.width // 64))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
    model, optimizer = fabric.setup(model, optimizer)
    accumulate = 2
    loader, _ = loaders(args.batch, args.seq, 256, train_batches=args.steps * accumulate, world=fabric.world_size)
    loader = fabric.setup_dataloaders(loader)

    def now() -> float:
        if gpu:
            torch.cuda.synchronize()
        return time.perf_counter()

    clock = {"t0": None, "step0": 0}

    def on_step(step: int, loss) -> None:
        if clock["t0"] is None and step >= args.warmup_steps:
            clock["t0"], clock["step0"] = now(), step
        clock["loss"] = loss  # read once, after the clock stopped

    steps = fabric_loop.train(fabric, model, optimizer, loader, accumulate, on_step)
    t1 = now()
    timed = steps - clock["step0"]
    if fabric.global_rank != 0:
        return None
    row = {"strategy": args.child, "devices": args.devices,
           "ms_per_step": 1e3 * (t1 - clock["t0"]) / max(timed, 1),
           "steps_timed": timed, "steps": steps, "final_loss": float(clock["loss"].detach()),
           "device": torch.cuda.get_device_name() if gpu else "cpu",
           "precision": "bf16-mixed" if gpu else "32-true"}
    if args.child == "pgd":
        import pygraph_dist as pgd

        d = pgd.report().models[-1]
        row.update(tiers=sorted({g.tier for g in d.graphs}), replays=d.replays, loop=d.loop)
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="JSON file to write")
    p.add_argument("--smoke", action="store_true", help="a few CPU steps of a tiny model")
    p.add_argument("--framework", choices=("trainer", "fabric"), default="trainer",
                   help="Lightning's Trainer (examples/lightning_gpt.py) or Fabric (examples/fabric_loop.py)")
    p.add_argument("--strategies", default="ddp,pgd")
    p.add_argument("--steps", type=int, default=80, help="optimizer steps (2 micro-batches each)")
    p.add_argument("--warmup-steps", type=int, default=20)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--width", type=int, default=384)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--devices", type=int, default=1, help="GPUs (Lightning starts one process per GPU)")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.smoke:
        args.steps, args.warmup_steps, args.layers, args.width, args.batch, args.seq = 4, 1, 2, 32, 4, 16
    if args.child:
        row = (fabric_child if args.framework == "fabric" else child)(args)
        if row is not None:
            Path(args.out).write_text(json.dumps(row))
        import torch.distributed as dist

        if dist.is_initialized():  # Lightning's DDP leaves its group open (torch warns at exit)
            dist.destroy_process_group()
        return

    rows = []
    for strategy in args.strategies.split(","):
        part = Path(f"{args.out}.{strategy}.part")
        cmd = [sys.executable, __file__, "--child", strategy, "--framework", args.framework, "--out", str(part),
               "--steps", str(args.steps),
               "--warmup-steps", str(args.warmup_steps), "--layers", str(args.layers), "--width",
               str(args.width), "--batch", str(args.batch), "--seq", str(args.seq), "--devices", str(args.devices)]
        env = dict(os.environ)
        # One process, no launcher: Lightning asks mpi4py whether this is an MPI job,
        # and an Open MPI singleton init aborts without an ssh/rsh agent; there is none
        # to reach here anyway (launch_env._mpi_comm does the same).
        env.setdefault("OMPI_MCA_plm_rsh_agent", "false")
        if any((ROOT / "python" / "pygraph_dist").glob("_C*.so")):  # built in place: this tree's
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "python"), env.get("PYTHONPATH")]))
        if args.smoke:
            cmd.append("--smoke")
            env["CUDA_VISIBLE_DEVICES"] = ""
        subprocess.run(cmd, check=True, env=env, timeout=1200)
        rows.append(json.loads(part.read_text()))
        part.unlink()
        r = rows[-1]
        print(f"{strategy:>4}: {r['ms_per_step']:8.2f} ms/step over {r['steps_timed']} steps "
              f"(loss {r['final_loss']:.4f}{', tiers ' + ','.join(r['tiers']) if 'tiers' in r else ''})",
              flush=True)
    by = {r["strategy"]: r["ms_per_step"] for r in rows}
    config = {k: getattr(args, k) for k in ("framework", "steps", "warmup_steps", "layers", "width", "batch", "seq",
                                            "devices", "smoke")}
    result = {"config": config | {"accumulate_grad_batches": 2, "gradient_clip_val": 1.0},
              "rows": rows}
    if "ddp" in by and "pgd" in by:
        result["speedup_pgd_vs_ddp"] = by["ddp"] / by["pgd"]
        print(f"pgd vs ddp: {result['speedup_pgd_vs_ddp']:.2f}x")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
