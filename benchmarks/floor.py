"""The floor: a lower bound on the time of one training iteration, per workload,
world size and gradient dtype, from peaks measured on the benchmark's own GPUs.

Measured once per world size, before the rows (measure_floor()):

  copy BW     device-to-device copy of 1 GiB fp32: (bytes read + bytes written) / time,
              GB/s (the unit the optimizer's traffic below is counted in); min over ranks
  matmul      bf16 8192 x 8192 x 8192 torch.mm: 2 n^3 / time, TFLOP/s; min over ranks
  algbw       all-reduce of one tensor of the gradient's S bytes over the benchmark's
              process group: S / time, GB/s; time = mean of 20, max over ranks
  busbw       algbw x 2(n-1)/n (nccl-tests, doc/PERFORMANCE.md); n = 1: no all-reduce

Per workload (on this rank's GPU, at the per-GPU batch, once):

  FLOPs       forward + backward of the module that returns the loss, counted by
              torch.utils.flop_counter.FlopCounterMode under bf16 autocast
              (matmuls, convolutions, attention; elementwise ops count 0)
  optimizer   AdamW traffic: fp32 param, grad, exp_avg, exp_avg_sq read (16 B) and
              param, exp_avg, exp_avg_sq written (12 B) = 28 B per parameter

Floor of a row (floor_for()), ms:

  compute     FLOPs / matmul peak: every FLOP at matmul speed
  optimizer   optimizer bytes / copy BW
  comm        the measured all-reduce time of the whole gradient (4 B per parameter,
              2 B for the *_bf16 modes) = S / algbw; 0 at N = 1
  floor       max(compute, comm) + optimizer: gradient all-reduce may overlap the
              forward/backward entirely; the optimizer step needs every reduced
              gradient, so it cannot (every mode steps once, after backward; accum4
              does the same FLOPs, one all-reduce and one step per iteration)

Not counted, so that the floor stays below what any mode can reach: activation
and weight-cast memory traffic, non-matmul kernels, launch latency, the loss.
On a CPU the sizes are tiny and the figures only exercise the code path.
"""

from __future__ import annotations

import gc
import math
import time

from workloads import autocast_bf16, build_on

ADAMW_BYTES_PER_PARAM = 28


def _time_ms(fn, reps: int, cuda: bool) -> float:
    """Mean ms per call of fn after 2 warm-up calls (CUDA events on the current stream)."""
    import torch

    for _ in range(2):
        fn()
    if cuda:
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / reps
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) * 1e3 / reps


def measure_device_peaks(dev) -> dict:
    """Copy bandwidth and bf16 matmul rate of this rank's device."""
    import torch

    cuda = dev.type == "cuda"
    copy_bytes, n, reps = ((1 << 30), 8192, 10) if cuda else ((16 << 20), 256, 3)
    mm_dtype = torch.bfloat16 if cuda else torch.float32
    src = torch.ones(copy_bytes // 4, dtype=torch.float32, device=dev)
    dst = torch.empty_like(src)
    copy_ms = _time_ms(lambda: dst.copy_(src), reps, cuda)
    del src, dst
    a = torch.randn(n, n, device=dev, dtype=mm_dtype)
    b = torch.randn(n, n, device=dev, dtype=mm_dtype)
    c = torch.empty(n, n, device=dev, dtype=mm_dtype)
    mm_ms = _time_ms(lambda: torch.mm(a, b, out=c), reps, cuda)
    del a, b, c
    if cuda:
        torch.cuda.empty_cache()
    return {"copy_gbps": 2 * copy_bytes / (copy_ms / 1e3) / 1e9, "copy_bytes": copy_bytes,
            "matmul_tflops": 2 * n ** 3 / (mm_ms / 1e3) / 1e12, "matmul_n": n,
            "matmul_dtype": str(mm_dtype).replace("torch.", "")}


def measure_allreduce(nbytes: int, dtype, dev, group, ws: int) -> dict:
    """All-reduce of one nbytes tensor over group: time (max over ranks), algbw, busbw."""
    import torch
    import torch.distributed as dist

    cuda = dev.type == "cuda"
    x = torch.zeros(max(1, nbytes // torch.tensor([], dtype=dtype).element_size()), dtype=dtype, device=dev)
    ms = _time_ms(lambda: dist.all_reduce(x, group=group), 20 if cuda else 3, cuda)
    t = torch.tensor([ms], dtype=torch.float64, device=dev)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    ms = float(t.item())
    algbw = nbytes / (ms / 1e3) / 1e9
    return {"bytes": nbytes, "ms": ms, "algbw_gbps": algbw, "busbw_gbps": algbw * 2 * (ws - 1) / ws}


def count_flops(w, batch: tuple, dev) -> tuple[int, int]:
    """(FLOPs of one forward + backward of the loss module at this batch, trainable parameters)."""
    from torch.utils.flop_counter import FlopCounterMode

    model = build_on(dev, w.build)
    params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    counter = FlopCounterMode(display=False)
    with counter:
        with autocast_bf16(dev):
            loss = model(*batch)
        loss.backward()
    return int(counter.get_total_flops()), params


def measure_floor(workloads: dict, dev, group, ws: int) -> dict:
    """workloads: name -> (Workload, batch on the device). Device peaks (min over
    ranks), and per workload: parameters, FLOPs per iteration, and the gradient
    all-reduce in fp32 and bf16. Collective: every rank calls it."""
    import torch
    import torch.distributed as dist

    peaks = measure_device_peaks(dev)
    every = [None] * ws
    dist.all_gather_object(every, peaks, group=group)
    device = dict(every[0])
    for k in ("copy_gbps", "matmul_tflops"):
        device[k] = min(p[k] for p in every)
        device[k + "_per_rank"] = [p[k] for p in every]
    out = {"world_size": ws, "device": device, "workloads": {}}
    for name, (w, batch) in workloads.items():
        try:
            flops, params = count_flops(w, batch, dev)
            info = {"params": params, "flops_per_it": flops, "optimizer_bytes": ADAMW_BYTES_PER_PARAM * params,
                    "grad_bytes": {"fp32": 4 * params, "bf16": 2 * params}, "allreduce": {}}
        except Exception as exc:  # noqa: BLE001 - no floor for this workload; its rows still run
            info = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
        # The all-reduces are collective: every rank runs them unless every rank failed above.
        ok = [None] * ws
        dist.all_gather_object(ok, "error" not in info, group=group)
        if ws > 1 and all(ok):
            for dt_name, dt in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
                info["allreduce"][dt_name] = measure_allreduce(info["grad_bytes"][dt_name], dt, dev, group, ws)
        elif not all(ok) and "error" not in info:
            info = {"error": "the FLOP count failed on another rank"}
        out["workloads"][name] = info
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return out


def floor_for(floor: dict | None, workload: str, comm_dtype: str) -> dict:
    """The floor of one row and its components, ms ({} without a measurement)."""
    info = (floor or {}).get("workloads", {}).get(workload)
    if not info or "error" in info:
        return {}
    dev = floor["device"]
    compute = info["flops_per_it"] / (dev["matmul_tflops"] * 1e12) * 1e3
    optimizer = info["optimizer_bytes"] / (dev["copy_gbps"] * 1e9) * 1e3
    ar = info["allreduce"].get(comm_dtype)
    comm = ar["ms"] if ar else 0.0
    return {"floor_ms": max(compute, comm) + optimizer, "floor_compute_ms": compute,
            "floor_optimizer_ms": optimizer, "floor_comm_ms": comm, "floor_comm_dtype": comm_dtype}


def _f(v, spec: str) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


def floor_table(floors: list[dict]) -> str:
    """The floor's measurements and components per workload and world size."""
    lines = ["# floor per workload and N (benchmarks/floor.py): compute = FLOPs / matmul peak; "
             "optimizer = 28 B/param / copy BW; comm = all-reduce time of the whole gradient; "
             "floor = max(compute, comm) + optimizer"]
    for f in sorted(floors, key=lambda f: f["world_size"]):
        d = f["device"]
        lines.append(f"# N={f['world_size']}: copy BW {d['copy_gbps']:.4g} GB/s ({d['copy_bytes'] >> 20} MiB D2D, "
                     f"read+write bytes / time), matmul {d['matmul_tflops']:.4g} TFLOP/s "
                     f"({d['matmul_n']}^3 {d['matmul_dtype']}); min over ranks")
    cols = ("workload", "N", "params", "GFLOP/it", "opt_bytes", "grad_fp32", "busbw_fp32", "busbw_bf16",
            "compute", "optimizer", "comm_fp32", "comm_bf16", "floor_fp32", "floor_bf16")
    units = ("", "", "(M)", "(GFLOP)", "(MB)", "(MB)", "(GB/s)", "(GB/s)", "(ms)", "(ms)", "(ms)", "(ms)",
             "(ms)", "(ms)")
    fmt = "{:<14} {:>2} {:>7} {:>9} {:>9} {:>9} {:>10} {:>10} {:>8} {:>9} {:>9} {:>9} {:>10} {:>10}"
    lines += ["# " + fmt.format(*cols), "# " + fmt.format(*units)]
    for f in sorted(floors, key=lambda f: f["world_size"]):
        for name, info in sorted(f["workloads"].items()):
            if "error" in info:
                lines.append(f"  {name:<14} {f['world_size']:>2}  error: {info['error']}")
                continue
            f32, b16 = floor_for(f, name, "fp32"), floor_for(f, name, "bf16")
            ar = info["allreduce"]
            lines.append("  " + fmt.format(
                name, f["world_size"], f"{info['params'] / 1e6:.1f}", f"{info['flops_per_it'] / 1e9:.1f}",
                f"{info['optimizer_bytes'] / 1e6:.0f}", f"{info['grad_bytes']['fp32'] / 1e6:.0f}",
                _f(ar.get("fp32", {}).get("busbw_gbps"), ".1f"), _f(ar.get("bf16", {}).get("busbw_gbps"), ".1f"),
                f"{f32['floor_compute_ms']:.3f}", f"{f32['floor_optimizer_ms']:.3f}", f"{f32['floor_comm_ms']:.3f}",
                f"{b16['floor_comm_ms']:.3f}", f"{f32['floor_ms']:.3f}", f"{b16['floor_ms']:.3f}"))
    return "\n".join(lines)
