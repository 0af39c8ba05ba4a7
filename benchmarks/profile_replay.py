"""Where the time of a replayed iteration goes (torch.profiler over replays).

    python benchmarks/profile_replay.py --workloads mlp,gpt2 --out benchmarks/results/profile.json
    torchrun --nproc-per-node 2 benchmarks/profile_replay.py ...   (rank 0 writes)

Each workload is wrapped as the benchmark wraps it (``pgd.wrap(model, AdamW,
amp="bf16")``, loss inside: one graph per iteration; ``--compile`` adds
``compile=True``, ``--grad-comm-dtype bf16`` the bf16 gradient all-reduce), trained until it replays, then ``--iters`` replays run
under torch.profiler with CUDA activities. From the kernel timeline, per
iteration:

  kernels      GPU kernels per iteration (and per category: gemm, nccl,
               optimizer, copy (Memcpy/Memset), elementwise/other)
  span         first kernel start to last kernel end
  busy         union of all kernel intervals
  gaps         span - busy: the GPU idle between kernels inside the graph
  nccl         union of NCCL kernel intervals
  exposed      NCCL time with no compute kernel running at the same time
  top          the kernels with the largest total time

and names the largest of gaps / exposed all-reduce / optimizer / gemm as the
item to act on.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import pygraph_dist as pgd  # noqa: E402
from workloads import REGISTRY, build_on  # noqa: E402

OPTIMIZER_HINTS = ("multi_tensor_apply", "adam", "foreach")  # not triton_*_fused_*: inductor's own
GEMM_HINTS = ("gemm", "sm90", "sm80", "cutlass", "cublas", "nvjet", "xmma", "ampere", "hopper")


def category(name: str) -> str:
    n = name.lower()
    if n.startswith(("memcpy", "memset")):  # device-to-device copies and fills
        return "copy"
    if "nccl" in n:
        return "nccl"
    if not n.startswith("triton_") and any(h in n for h in OPTIMIZER_HINTS):
        return "optimizer"
    if any(h in n for h in GEMM_HINTS):
        return "gemm"
    return "other"


def union(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def exposed(comm: list[tuple[float, float]], compute: list[tuple[float, float]]) -> float:
    """Time inside ``comm`` intervals not covered by any ``compute`` interval."""
    merged: list[list[float]] = []
    for a, b in sorted(compute):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    total = 0.0
    for a, b in comm:
        covered = 0.0
        for c, d in merged:
            if d <= a:
                continue
            if c >= b:
                break
            covered += min(b, d) - max(a, c)
        total += (b - a) - covered
    return total


def profile_workload(name: str, batch: int | None, iters: int, compile_: bool, dev, rank: int,
                     comm_dtype=None) -> dict:
    w = REGISTRY[name]
    missing = w.missing()
    if missing:
        return {"workload": name, "status": f"skipped: {', '.join(missing)} not installed"}
    b = batch or w.default_batch
    module = build_on(dev, w.build)
    opt = torch.optim.AdamW(module.parameters(), lr=1e-4, fused=True)
    model, opt = pgd.wrap(module, opt, amp="bf16", compile=compile_, grad_comm_dtype=comm_dtype)
    batch_t = tuple(t.to(dev) for t in w.make_batch(b, torch.Generator().manual_seed(rank)))

    def step():
        opt.zero_grad(set_to_none=True)
        model(*batch_t).backward()
        opt.step()

    for _ in range(40):
        step()
    torch.cuda.synchronize()
    r = pgd.report().models[-1]
    if r.replays == 0:
        model.engine.teardown()
        return {"workload": name, "status": "not replaying", "report": str(pgd.report())}
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        for _ in range(iters):
            step()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
               and getattr(e, "time_range", None) is not None and e.time_range.elapsed_us() > 0]
    ivals = [(e.time_range.start, e.time_range.end) for e in kernels]
    by_cat: dict[str, list] = defaultdict(list)
    totals: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    for e in kernels:
        c = category(e.name)
        by_cat[c].append((e.time_range.start, e.time_range.end))
        totals[e.name] += e.time_range.elapsed_us()
        counts[e.name] += 1
    span = (max(b for _, b in ivals) - min(a for a, _ in ivals)) if ivals else 0.0
    busy = union(ivals)
    compute = [iv for c, lst in by_cat.items() if c != "nccl" for iv in lst]
    per = lambda x: x / iters  # noqa: E731
    result = {
        "workload": name, "status": "ok", "batch": b, "compile": compile_, "iters_profiled": iters,
        "grad_comm_dtype": str(comm_dtype).replace("torch.", "") if comm_dtype else None,
        "tiers": sorted({g.tier for g in r.graphs}),
        "kernels_per_iter": per(len(kernels)),
        "kernels_per_iter_by_category": {c: per(len(v)) for c, v in by_cat.items()},
        "us_per_iter": {
            "span": per(span), "busy": per(busy), "gaps": per(span - busy),
            "nccl": per(union(by_cat.get("nccl", []))),
            "exposed_allreduce": per(exposed(by_cat.get("nccl", []), compute)),
            "optimizer": per(union(by_cat.get("optimizer", []))),
            "gemm": per(union(by_cat.get("gemm", []))),
            "other": per(union(by_cat.get("other", []))),
            "copy": per(union(by_cat.get("copy", []))),
        },
        "top_kernels": [{"name": n[:120], "us_per_iter": per(t), "calls_per_iter": per(counts[n]),
                         "category": category(n)}
                        for n, t in sorted(totals.items(), key=lambda kv: -kv[1])[:12]],
    }
    u = result["us_per_iter"]
    items = {"GPU idle between kernels (gaps)": u["gaps"], "exposed all-reduce": u["exposed_allreduce"],
             "optimizer kernels": u["optimizer"], "matmuls": u["gemm"], "other kernels": u["other"],
             "copies": u["copy"]}
    result["largest_item"] = max(items, key=items.get)
    model.engine.teardown()
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workloads", default="mlp,gpt2")
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--compile", action="store_true", help="wrap(..., compile=True)")
    ap.add_argument("--grad-comm-dtype", choices=["bf16"], default=None,
                    help="wrap(..., grad_comm_dtype=torch.bfloat16)")
    ap.add_argument("--out", default="profile.json")
    args = ap.parse_args()
    pgd.init()
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    if not torch.cuda.is_available():
        print("profile_replay.py needs a CUDA GPU", file=sys.stderr)
        return 2
    dev = torch.device("cuda", torch.cuda.current_device())
    results = []
    for name in args.workloads.split(","):
        res = profile_workload(name, args.batch, args.iters, args.compile, dev, rank,
                               torch.bfloat16 if args.grad_comm_dtype else None)
        res["world_size"] = world
        results.append(res)
        if rank == 0:
            if res["status"] != "ok":
                print(f"{name}: {res['status']}")
                continue
            u = res["us_per_iter"]
            print(f"{name} (batch {res['batch']}, {world} rank(s){', compiled' if args.compile else ''}"
                  f"{', bf16 all-reduce' if args.grad_comm_dtype else ''}): "
                  f"{res['kernels_per_iter']:.0f} kernels/iter "
                  + ", ".join(f"{c} {n:.0f}" for c, n in sorted(res["kernels_per_iter_by_category"].items()))
                  + f"; span {u['span']:.0f} us, busy {u['busy']:.0f}, gaps {u['gaps']:.0f}, "
                  f"all-reduce {u['nccl']:.0f} (exposed {u['exposed_allreduce']:.0f}), optimizer "
                  f"{u['optimizer']:.0f}, matmul {u['gemm']:.0f}, other {u['other']:.0f}, "
                  f"copies {u['copy']:.0f}; "
                  f"largest: {res['largest_item']}")
            for k in res["top_kernels"][:6]:
                print(f"    {k['us_per_iter']:8.1f} us  x{k['calls_per_iter']:<5.0f} {k['category']:<9} {k['name'][:90]}")
    if rank == 0:
        meta = {"device": torch.cuda.get_device_name(dev), "torch": torch.__version__,
                "nccl": ".".join(map(str, torch.cuda.nccl.version())), "results": results}
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(meta, indent=1))
        print(f"wrote {args.out}")
    pgd.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
