"""Per-rank test cases, run as separate processes by conftest.run_ranks.

    python tests/python/workers.py <case> --out DIR [case args]

Each case returns a JSON-able dict, written to DIR/rank<R>.json; the pytest
side asserts on it. Cases that exercise failures print what they saw and
exit non-zero instead.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import pygraph_dist as pgd

from common import MLP, data, device, flat_params, max_diff, ranks_agree
from common import adamw as _opt
from common import gpu_model as _gpu_model
from common import train as _train

CASES = {}


def case(fn):
    CASES[fn.__name__] = fn
    return fn


# ----------------------------------------------------------------- CPU cases
@case
def init_only(args):
    t0 = time.monotonic()
    import datetime

    try:
        env = pgd.init(rendezvous_timeout=datetime.timedelta(seconds=args.rendezvous_timeout))
    except pgd.LaunchError as exc:
        print(f"LaunchError after {time.monotonic() - t0:.1f}s: {exc}", flush=True)
        sys.exit(3)
    t = torch.tensor([dist.get_rank() + 1.0])
    dist.all_reduce(t)
    return {"rank": env.rank, "world": env.world_size, "launcher": env.launcher,
            "sum": float(t), "master_addr": os.environ.get("MASTER_ADDR")}


# ----------------------------------------------------------------- GPU cases
@case
def gpu_equivalence(args):
    """Graphed pgd vs eager pgd (bitwise) vs torch DDP (fp32 rounding), 50 steps."""
    amp = None if args.amp == "fp32" else args.amp
    pgd.init()
    rank = dist.get_rank()
    dev = device()
    steps = args.steps

    def run_pgd(graphs):
        torch.manual_seed(123)  # dropout masks: same RNG stream in both runs
        base = _gpu_model(0, args.dropout)
        model, opt = pgd.wrap(base, _opt(base.parameters(), amp, 1e-3), amp=amp, graphs=graphs)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.05 * s))
        losses = _train(model, opt, steps, rank, dev=dev, scheduler=sched)
        return model, opt, losses

    graphed, g_opt, g_losses = run_pgd(True)
    g_report = pgd.report().models[-1]
    eager, e_opt, e_losses = run_pgd(False)

    # torch DDP with the same optimizer configuration pgd uses (capturable, tensor lr).
    torch.manual_seed(123)
    base = _gpu_model(0, args.dropout)
    ddp = nn.parallel.DistributedDataParallel(base, device_ids=[dev.index])
    ref_opt = torch.optim.AdamW(ddp.parameters(), lr=torch.tensor(1e-3, device=dev), capturable=True,
                                fused=(amp == "fp16") or None)
    sched = torch.optim.lr_scheduler.LambdaLR(ref_opt, lambda s: 1.0 / (1 + 0.05 * s))
    scaler = torch.amp.GradScaler("cuda") if amp == "fp16" else None
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(args.amp)
    for step in range(steps):
        x, y = data(step, rank, device=dev)
        ref_opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=dtype, enabled=dtype is not None, cache_enabled=False):
            loss = ddp(x, y)
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(ref_opt)
            scaler.update()
        else:
            loss.backward()
            ref_opt.step()
        sched.step()

    pg, pe, pd = flat_params(graphed.module), flat_params(eager.module), flat_params(ddp.module)
    g = g_report.graphs[0]
    return {
        "graphed_vs_eager_max_diff": max_diff(pg, pe),
        "graphed_vs_eager_bitwise": bool(torch.equal(pg, pe)),
        "losses_equal": g_losses == e_losses,
        "graphed_vs_ddp_max_diff": max_diff(pg, pd),
        "param_scale": float(pd.abs().max()),
        "ranks_agree": ranks_agree(pg, dev),
        "replays": g.replays,
        "phase": g.phase,
        "reason": g.reason,
        "n_collectives": g.n_collectives,
        "changes": g_report.optimizer_changes,
        "report": str(pgd.report()),
        "scale": float(g_opt.__dict__["_pgd_engine"].grad_scaler.get_scale()) if amp == "fp16" else None,
    }


@case
def gpu_asymmetric_failure(args):
    """Rank 1 alone fails capture; both ranks must fall back together, keep training
    correctly (dropout included: the CUDA RNG must be usable again) and exit cleanly."""
    pgd.init()
    rank = dist.get_rank()
    dev = device()

    def run(graphs, sync_rank):
        torch.manual_seed(123)
        base = _gpu_model(0, 0.1)
        base.sync_on_capture_rank = sync_rank
        model, opt = pgd.wrap(base, _opt(base.parameters(), None, 1e-3), graphs=graphs)
        losses = _train(model, opt, args.steps, rank, dev=dev)
        return model, losses

    failed, f_losses = run(True, 1)
    r = pgd.report().models[-1]
    ref, r_losses = run(False, -1)
    pf, pr = flat_params(failed.module), flat_params(ref.module)
    return {
        "phase": r.graphs[0].phase,
        "reason": r.graphs[0].reason,
        "events": r.events,
        "replays": r.graphs[0].replays,
        "bitwise_vs_eager": bool(torch.equal(pf, pr)),
        "max_diff": max_diff(pf, pr),
        "ranks_agree": ranks_agree(pf, dev),
        "losses_finite": all(math.isfinite(v) for v in f_losses),
    }


@case
def gpu_exit_with_graphs(args):
    """Leave graphs alive and either exit or destroy the process group directly."""
    pgd.init()
    rank = dist.get_rank()
    base = _gpu_model(0, 0.0)
    model, opt = pgd.wrap(base, _opt(base.parameters(), "bf16", 1e-3), amp="bf16")
    _train(model, opt, 10, rank, dev=device())
    replays = pgd.report().models[0].replays
    result = {"replays": replays}
    Path(args.out, f"rank{rank}.json").write_text(json.dumps(result))
    if args.how == "destroy":
        dist.destroy_process_group()
    # "exit": return with graphs and the process group alive; atexit must clean up.
    os._exit(0) if args.how == "hard" else sys.exit(0)


@case
def gpu_shapes(args):
    """A short last batch and three sequence lengths: one graph each, no eager fallback."""
    pgd.init()
    rank = dist.get_rank()
    dev = device()
    torch.manual_seed(0)
    emb = nn.Sequential(nn.Embedding(100, 32), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 100)).to(dev)

    class LM(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = emb

        def forward(self, tokens):
            logits = self.net(tokens[:, :-1])
            return nn.functional.cross_entropy(logits.reshape(-1, 100), tokens[:, 1:].reshape(-1))

    def run(graphs, **kw):
        torch.manual_seed(0)
        m = LM().to(dev)
        model, opt = pgd.wrap(m, torch.optim.AdamW(m.parameters(), lr=1e-3), graphs=graphs, warmup=2, **kw)
        for step in range(60):
            seq = (16, 32, 64)[step % 3]
            batch = 8 if step % 10 != 9 else 5  # a short batch every 10th step
            g = torch.Generator().manual_seed(step * 10 + rank)
            tokens = torch.randint(0, 100, (batch, seq), generator=g).to(dev)
            opt.zero_grad(set_to_none=True)
            model(tokens).backward()
            opt.step()
        return m

    graphed = run(True)
    rep = pgd.report().models[-1]
    eager = run(False)
    # The same with a memory cap of half what the six graphs took: the live graphs
    # stay within it (LRU out), training stays exact.
    total_mib = sum(g.pool_mib for g in rep.graphs)
    cap = total_mib / 2
    capped = run(True, graph_memory_mb=cap)
    live_mib = sum(g.pool_mib for g in pgd.report().models[-1].graphs if g.live)
    cap_rep = pgd.report().models[-1]
    # Padding the short batch to 8 rows: 3 signatures instead of 6.
    padded = run(True, pad_batch_to=(8,))
    pad_rep = pgd.report().models[-1]
    padded_eager = run(False, pad_batch_to=(8,))
    return {
        "graphs": [(g.inputs, g.phase, g.replays, g.eager_iterations) for g in rep.graphs],
        "bitwise": bool(torch.equal(flat_params(graphed), flat_params(eager))),
        "max_diff": max_diff(flat_params(graphed), flat_params(eager)),
        "total_mib": total_mib, "cap_mib": cap, "capped_live_mib": live_mib,
        "capped_events": [e["event"] for e in cap_rep.events],
        "capped_bitwise": bool(torch.equal(flat_params(capped), flat_params(eager))),
        "padded_graphs": [(g.inputs, g.phase, g.replays) for g in pad_rep.graphs],
        "padded_bitwise": bool(torch.equal(flat_params(padded), flat_params(padded_eager))),
    }


@case
def gpu_loop_checks(args):
    """What the monitor does on a GPU: a host sync in forward is found at the probe;
    a loop that changes after capture raises instead of training differently."""
    pgd.init()
    rank = dist.get_rank()
    dev = device()
    out = {}

    class Syncing(MLP):
        def forward(self, x, y):
            loss = super().forward(x, y)
            if loss.item() > 1e9:  # a host sync in forward
                loss = loss * 0
            return loss

    torch.manual_seed(0)
    base = Syncing().to(dev)
    model, opt = pgd.wrap(base, torch.optim.AdamW(base.parameters(), lr=1e-3))
    _train(model, opt, 8, rank, dev=dev)
    rep = pgd.report().models[-1]
    out["sync_loop"] = rep.loop
    out["sync_phase"] = rep.graphs[0].phase
    out["sync_reason"] = rep.graphs[0].reason

    base = _gpu_model(0, 0.0)
    model, opt = pgd.wrap(base, torch.optim.AdamW(base.parameters(), lr=1e-3), warmup=1)
    _train(model, opt, 8, rank, dev=dev)
    out["replays_before_change"] = pgd.report().models[-1].replays
    try:
        _train(model, opt, 1, rank, dev=dev, clip=1.0)
        out["after_capture_error"] = ""
    except pgd.LoopConformanceError as exc:
        out["after_capture_error"] = str(exc)

    # SGD's lr is baked into the graph: changing it releases the only graph and
    # captures again (into a fresh pool: the released pool id is dead).
    base = _gpu_model(0, 0.0)
    model, opt = pgd.wrap(base, torch.optim.SGD(base.parameters(), lr=0.1), warmup=1)
    _train(model, opt, 8, rank, dev=dev)
    for g in opt.param_groups:
        g["lr"] = 0.05
    _train(model, opt, 8, rank, dev=dev)
    g = pgd.report().models[-1].graphs[0]
    out["sgd_lr_change"] = [g.phase, g.recaptures, g.replays, g.reason]
    return out


# ----------------------------------------------------------------- main
def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("case", choices=sorted(CASES))
    parser.add_argument("--out", required=True)
    parser.add_argument("--variant", default="plain")
    parser.add_argument("--amp", default="fp32")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--how", default="exit")
    parser.add_argument("--rendezvous-timeout", type=float, default=60)
    args = parser.parse_args()
    result = CASES[args.case](args)
    rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", 0))
    Path(args.out, f"rank{rank}.json").write_text(json.dumps(result, default=str))
    pgd.shutdown()


if __name__ == "__main__":
    main()
