"""One rank of a training script that ends in a given way, with graphs alive.

    RANK=.. WORLD_SIZE=.. LOCAL_RANK=.. MASTER_ADDR=.. MASTER_PORT=.. \\
        python tests/python/exit_paths.py --end imported_destroy --init pgd --out DIR

Written the way GPT pretraining scripts are: ``destroy_process_group`` and
``init_process_group`` are imported by name from ``torch.distributed`` at the
top, before pygraph_dist is imported or ``wrap()`` runs. Three models are
alive at the end: one at tier 1 (the module returns its loss), one at tier 2
(the loss in the loop) that is also evaluated under ``torch.no_grad()``
(forward-only graphs), each replaying (on a GPU) when the script ends.

``--init pgd``: ``pgd.init()`` (the graph-safe backend); ``--init stock``:
the script's own ``init_process_group()`` (torch's stock NCCL, or Gloo on a
CPU). Before it ends, each rank writes ``DIR/rank<r>.json`` with what was
graphed and the wall time of its last step (``t_last``); the test measures
from there to the process's exit.

The ends (``ENDS``: the exit status each rank should have):
  imported_destroy  ``destroy_process_group()``, the name imported at the top
  module_destroy    ``torch.distributed.destroy_process_group()``
  no_destroy        the script returns without destroying anything
  sys_exit          ``sys.exit(3)`` inside the training loop
  exception         an exception escapes the training loop
  sigterm, sigint   the ranks train until the test sends the signal
                    (``torchrun``/Slurm forward SIGTERM; Ctrl-C is SIGINT)
  subgroup_destroy  the tier-1 model reduces over a subgroup of all ranks;
                    ``destroy_process_group(sub)`` releases it, the tier-2
                    model goes on replaying over the world, then the world is
                    destroyed
  reinit            destroy, ``init_process_group`` again, wrap new models,
                    train them to replay, destroy again (``--cycles`` times)
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import destroy_process_group, init_process_group  # before wrap(), as GPT scripts do
from torch.nn import functional as F

ENDS = {"imported_destroy": 0, "module_destroy": 0, "no_destroy": 0, "sys_exit": 3, "exception": 1,
        "sigterm": -signal.SIGTERM, "sigint": -signal.SIGINT, "subgroup_destroy": 0, "reinit": 0}
SIGNALLED = ("sigterm", "sigint")
STEPS = 12  # probe (2) + warm-up (3) + capture, then replays


class Tier1(nn.Module):
    def __init__(self, width=64, classes=8):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.Linear(width, classes))

    def forward(self, x, y):
        return F.cross_entropy(self.net(x), y)


def make_models(dev: torch.device, seed: int):
    torch.manual_seed(seed)
    tier1 = Tier1().to(dev)
    tier2 = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 8)).to(dev)
    return tier1, tier2


def batch(step: int, rank: int, dev: torch.device):
    g = torch.Generator().manual_seed(100 * rank + step)
    return torch.randn(16, 64, generator=g).to(dev), torch.randint(0, 8, (16,), generator=g).to(dev)


class Run:
    """The models of one process group's lifetime, wrapped and trained."""

    def __init__(self, pgd, dev: torch.device, rank: int, seed: int, tier1_group=None, ddp: bool = False):
        self.dev, self.rank = dev, rank
        tier1, tier2 = make_models(dev, seed)
        if ddp:  # the reference: the same script with torch's DDP, no pygraph_dist
            from torch.nn.parallel import DistributedDataParallel as DDP

            ids = [dev.index] if dev.type == "cuda" else None
            self.m1 = DDP(tier1, device_ids=ids, process_group=tier1_group)
            self.m2 = DDP(tier2, device_ids=ids)
            self.o1 = torch.optim.AdamW(self.m1.parameters(), lr=1e-3)
            self.o2 = torch.optim.AdamW(self.m2.parameters(), lr=1e-3)
        else:
            self.m1, self.o1 = pgd.wrap(tier1, torch.optim.AdamW(tier1.parameters(), lr=1e-3),
                                        process_group=tier1_group)
            self.m2, self.o2 = pgd.wrap(tier2, torch.optim.AdamW(tier2.parameters(), lr=1e-3))
        self.step_no = 0

    def step(self, *, train1: bool = True) -> float:
        x, y = batch(self.step_no, self.rank, self.dev)
        if train1:
            self.o1.zero_grad(set_to_none=True)
            self.m1(x, y).backward()
            self.o1.step()
        self.o2.zero_grad(set_to_none=True)
        loss = F.cross_entropy(self.m2(x), y)  # the loss in the loop: tier 2
        loss.backward()
        self.o2.step()
        with torch.no_grad():
            self.m2(x)  # evaluation: forward-only graphs
        self.step_no += 1
        return float(loss)


def device() -> torch.device:
    if torch.cuda.is_available():
        dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(dev)
        return dev
    return torch.device("cpu")


def summary(pgd) -> dict:
    rep = pgd.report(as_dict=True)
    graphs = [g for m in rep.get("models", []) for g in m.get("graphs", [])] if "models" in rep \
        else rep.get("graphs", [])
    return {"phases": sorted({str(g.get("phase")) for g in graphs}),
            "replays": sum(int(g.get("replays", 0)) for g in graphs)}


def write(out: Path, rank: int, **fields) -> None:
    fields["t_last"] = time.time()
    tmp = out / f"rank{rank}.json.tmp"
    tmp.write_text(json.dumps(fields))
    tmp.replace(out / f"rank{rank}.json")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--end", choices=sorted(ENDS), required=True)
    ap.add_argument("--init", choices=("pgd", "stock", "ddp"), default="pgd",
                    help="ddp: the script's own init_process_group and torch DDP (the reference)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--cycles", type=int, default=2, help="reinit: process group lifetimes")
    args = ap.parse_args()
    # The test sends SIGUSR1 to a rank that did not end in time: every thread's stack, to its log.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    if args.init == "ddp" and args.end == "subgroup_destroy":
        ap.error("--init ddp has no engines to check for subgroup_destroy")

    import pygraph_dist as pgd  # after the imports above, as a script that swaps DDP for wrap() does

    dev = device()
    rank = int(os.environ["RANK"])

    def init() -> None:
        if args.init == "pgd":
            pgd.init()
        else:
            init_process_group("nccl" if dev.type == "cuda" else "gloo")

    init()
    world = dist.get_world_size()
    sub = dist.new_group(list(range(world))) if args.end == "subgroup_destroy" else None
    ddp = args.init == "ddp"
    run = Run(pgd, dev, rank, seed=0, tier1_group=sub, ddp=ddp)
    cycles = args.cycles if args.end == "reinit" else 1
    replays = []
    for cycle in range(cycles):
        if cycle:
            destroy_process_group()
            # A fresh rendezvous per lifetime where the launcher gave one
            # (PGD_EXIT_REINIT_PORTS): re-using one env:// store after a destroy
            # hangs now and then with torch DDP alone (Gloo, torch 2.13: 4 of 14
            # runs, and 4 of 10 under torchrun), which is torch's, not ours.
            ports = os.environ.get("PGD_EXIT_REINIT_PORTS", "").split(",")
            if len(ports) >= cycle and ports[cycle - 1]:
                os.environ["MASTER_PORT"] = ports[cycle - 1]
            init()
            run = Run(pgd, dev, rank, seed=cycle, ddp=ddp)
        for step in range(STEPS):
            run.step()
            if args.end == "sys_exit" and step == STEPS - 1:
                write(args.out, rank, **summary(pgd))
                sys.exit(3)
            if args.end == "exception" and step == STEPS - 1:
                write(args.out, rank, **summary(pgd))
                raise RuntimeError("exit_paths: an error in the training loop")
        replays.append(summary(pgd)["replays"])

    if args.end in SIGNALLED:
        write(args.out, rank, **summary(pgd))
        while True:  # train until the test's signal arrives
            run.step()
            if dev.type == "cuda":
                torch.cuda.synchronize()

    if args.end == "subgroup_destroy":
        destroy_process_group(sub)
        released = bool(run.m1._engine.closed)  # noqa: SLF001 - what the test checks
        kept = not run.m2._engine.closed  # noqa: SLF001
        before = summary(pgd)["replays"]
        for _ in range(4):
            run.step(train1=False)  # the world's model trains on
        after = summary(pgd)["replays"]
        write(args.out, rank, released_sub=released, kept_world=kept, replays_after_sub=after - before,
              **summary(pgd))
        destroy_process_group()
        return

    write(args.out, rank, cycle_replays=replays, **summary(pgd))
    if args.end in ("imported_destroy", "reinit"):
        destroy_process_group()
    elif args.end == "module_destroy":
        dist.destroy_process_group()
    if args.end in ("imported_destroy", "reinit", "module_destroy"):
        open_engines = [e for e in pgd.launch.lifetime.live_engines() if not e.closed]
        if open_engines:  # the destroy went past the hook: on a GPU it would have hung
            print(f"exit_paths: {len(open_engines)} engine(s) not released by destroy_process_group", flush=True)
            sys.exit(7)


if __name__ == "__main__":
    main()
