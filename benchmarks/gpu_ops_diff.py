"""GPU work per step beyond the hand-written graph's: where the wall time goes (issue 26).

``host_cost.py`` measures the host. On a small model the loop is GPU-bound
(host_cost's 18-tensor MLP: ~19 us of host against ~187 us of GPU per step),
so a wall-time gap to the hand-written recipe is GPU work the recipe does not
do. For each mode (host_cost's models and loops, one process, one GPU) this
prints the wall time per step over back-to-back steps, then profiles a few
steps (torch.profiler) and lists, kernel by kernel, the GPU time per step that
differs from the first mode's (the hand recipe by default):

    == pgd_tier1 L=8: wall 196.0 us/step; GPU busy 179.4 us/step, 72.0 ops/step
       +3.2 us  +2.0 ops  CatArrayBatchedCopy_vectorized<...>

A mode ``NAME@VARIANT`` runs NAME with the bucket variables of ``VARIANTS``
(A/B of the bucket layout in one process: ``pgd_tier1@packed`` is the layout
before session 41, slots packed back to back and copied by foreach;
``@copies`` is session 41's, the gradients copied into the buckets at world
size 1 rather than kept where the graph computed them; ``@tensorwise`` the
graphed clip_grad_norm_ multiplying tensor by tensor, as before session 43).

    python benchmarks/gpu_ops_diff.py --layers 8,250 \
        --modes hand,pgd_tier1@copies,pgd_tier1,pgd_tier2@copies,pgd_tier2

JSON (per mode: wall, busy, ops and the per-kernel table) next to the text.
Profiled steps run slower than unprofiled ones; compare within a run.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

# PYGRAPH_DIST_BUCKET_ALIGN, PYGRAPH_DIST_BUCKET_CAT, PYGRAPH_DIST_ADOPT_GRADS,
# PYGRAPH_DIST_CLIP_SPANS per variant (read at wrap() and at the clip's capture).
# "copies": world size 1 copies the gradients into the buckets instead of keeping
# the graph's (grad_adoption.py; before session 42). "tensorwise": the graphed
# clip multiplies tensor by tensor as torch does (clip_route.clip_in_spans;
# before session 43).
VARIANTS = {"": ("16", "1", "1", "1"), "packed": ("1", "0", "0", "1"), "foreach": ("16", "0", "0", "1"),
            "copies": ("16", "1", "0", "1"), "tensorwise": ("16", "1", "1", "0")}
_GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def _short(name: str) -> str:
    return name.replace("void ", "").replace("at::native::", "").replace("(anonymous namespace)::", "")[:160]


def profile_mode(label: str, layers: int, dev, batches, *, steps: int, profiled: int, warmup: int) -> dict:
    import host_cost as hc
    import torch
    from torch.profiler import ProfilerActivity, profile

    name, _, variant = label.partition("@")
    if variant not in VARIANTS:
        raise SystemExit(f"unknown variant {variant!r} in {label!r}; choose from {sorted(VARIANTS)}")
    (os.environ["PYGRAPH_DIST_BUCKET_ALIGN"], os.environ["PYGRAPH_DIST_BUCKET_CAT"],
     os.environ["PYGRAPH_DIST_ADOPT_GRADS"], os.environ["PYGRAPH_DIST_CLIP_SPANS"]) = VARIANTS[variant]
    mode = hc.Mode(name, layers, dev, batches)
    mode.setup()
    try:
        for i in range(warmup):
            mode.step(*batches[i % len(batches)])
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for i in range(steps):
            mode.step(*batches[i % len(batches)])
        torch.cuda.synchronize()
        wall_us = (time.perf_counter() - t0) / steps * 1e6
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for i in range(profiled):
                mode.step(*batches[i % len(batches)])
            torch.cuda.synchronize()
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "trace.json"
            prof.export_chrome_trace(str(path))
            events = json.loads(path.read_text())["traceEvents"]
    finally:
        mode.teardown()
        del mode
        torch.cuda.empty_cache()
    gpu = sorted((e["ts"], e["ts"] + e.get("dur", 0), e["name"]) for e in events
                 if e.get("ph") == "X" and e.get("cat") in _GPU_CATS)
    busy, end = 0.0, None
    us: collections.Counter = collections.Counter()
    ops: collections.Counter = collections.Counter()
    for s, t, n in gpu:  # busy: the union of the ops' intervals
        busy += max(0.0, t - (s if end is None else max(s, end)))
        end = t if end is None else max(end, t)
        us[_short(n)] += (t - s) / profiled
        ops[_short(n)] += 1 / profiled
    return {"mode": label, "layers": layers, "wall_us": wall_us, "busy_us": busy / profiled,
            "ops": len(gpu) / profiled, "kernels": {k: {"us": us[k], "ops": ops[k]} for k in us}}


def diff_lines(row: dict, ref: dict, min_us: float) -> list[str]:
    keys = set(row["kernels"]) | set(ref["kernels"])
    zero = {"us": 0.0, "ops": 0.0}
    out = []
    for k in sorted(keys, key=lambda k: -abs(row["kernels"].get(k, zero)["us"] - ref["kernels"].get(k, zero)["us"])):
        a, b = ref["kernels"].get(k, zero), row["kernels"].get(k, zero)
        if abs(b["us"] - a["us"]) >= min_us or abs(b["ops"] - a["ops"]) > 0.05:
            out.append(f"   {b['us'] - a['us']:+7.1f} us {b['ops'] - a['ops']:+6.1f} ops  "
                       f"({a['us']:.1f} -> {b['us']:.1f} us)  {k}")
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="GPU time per step by kernel, against the first mode (one GPU).")
    p.add_argument("--layers", default="8", help="comma list of host_cost's hidden layers (8: 18 tensors)")
    p.add_argument("--modes", default="hand,pgd_tier1@packed,pgd_tier1,pgd_tier2@packed,pgd_tier2",
                   help="comma list of host_cost modes, each optionally @packed, @foreach or @copies; the first is the reference")
    p.add_argument("--steps", type=int, default=300, help="back-to-back steps timed for the wall time")
    p.add_argument("--profiled", type=int, default=30, help="steps profiled")
    p.add_argument("--warmup", type=int, default=60)
    p.add_argument("--min-us", type=float, default=0.8, help="kernels differing by less are not listed")
    p.add_argument("--out-dir", default=str(HERE / "results" / "tmp"))
    p.add_argument("--name", default=None)
    args = p.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("gpu_ops_diff needs a CUDA GPU")
    import host_cost as hc
    import pygraph_dist as pgd

    pgd.init()
    dev = torch.device("cuda", torch.cuda.current_device())
    batches = hc.make_batches(dev)
    header = (f"GPU work per step against the first mode; {torch.cuda.get_device_name()}; "
              f"torch {torch.__version__}; wall over {args.steps} back-to-back steps, "
              f"kernels over {args.profiled} profiled steps")
    rows, lines = [], [header]
    for layers in (int(s) for s in args.layers.split(",") if s):
        ref = None
        for label in (m for m in args.modes.split(",") if m):
            row = profile_mode(label, layers, dev, batches, steps=args.steps, profiled=args.profiled,
                               warmup=args.warmup)
            rows.append(row)
            if ref is None:
                ref = row
            block = [(f"== {label} L={layers}: wall {row['wall_us']:.1f} us/step; "
                      f"GPU busy {row['busy_us']:.1f} us/step, {row['ops']:.1f} ops/step")]
            block += diff_lines(row, ref, args.min_us) if row is not ref else []
            print("\n".join(block), flush=True)
            lines += block
    pgd.shutdown()
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{args.name or time.strftime('gpu-ops-diff-%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                "config": vars(args), "rows": rows}, indent=1))
    path.with_suffix(".txt").write_text("\n".join(lines) + "\n")
    print(f"[gpu_ops_diff] -> {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
