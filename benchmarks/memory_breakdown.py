"""Where the GPU memory of each training mode goes, phase by phase, at world size 1.

Issue 26 asks for pygraph_dist's peak reserved memory at N=1 to be at most
1.05x the hand-written whole-iteration recipe's. This script shows where the
difference is: each mode runs in a process of its own (nothing cached by an
earlier mode: the caching allocator's segments, cuBLAS workspaces of other
streams), on the same model, data and seed, and records the allocator after
every phase.

Modes (each: AdamW(lr=1e-4, fused), bf16 autocast, the module returns the loss):

  ddp_graph  bench_scaling.py's recipe, step by step (GraphedDDP): DDP built on
             a side stream, 11 eager warm-ups there, AdamW(capturable), the
             iteration captured with torch.cuda.graph(stream=side), replays
  graph      PyTorch's "whole network capture" example without DDP (notes/cuda):
             3 warm-ups on a side stream, torch.cuda.graph with its own stream
  pgd        pygraph_dist.wrap(model, opt, amp="bf16"), default options, stepped
             as bench_scaling steps it (until every signature replays)
  ddp        eager DDP, for reference

Columns (MiB = 2**20 bytes; every figure from torch.cuda of the mode's process):

  peak rsv     torch.cuda.max_memory_reserved over the whole run (the acceptance
               figure), counted from after the data batches were made
  peak alloc   torch.cuda.max_memory_allocated, the same window
  rsv / alloc  torch.cuda.memory_reserved / memory_allocated after the phase
  cache D/S    reserved in the allocator's ordinary pool by blocks of the default
               stream (D) and of the mode's side stream (S) (memory_snapshot())
  graph pools  reserved by CUDA-graph private pools
  inactive     inactive_split_bytes: free pieces of split segments (fragmentation)

Usage:
  python benchmarks/memory_breakdown.py --model resnet18 --out /tmp/resnet18.json
  python benchmarks/memory_breakdown.py --model bert_base --batch 8
  python benchmarks/memory_breakdown.py --model gpt2          # any bench_scaling workload
  python benchmarks/memory_breakdown.py --smoke               # CPU: the models and the table, nothing measured
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn import functional as F  # noqa: E402

from workloads import REGISTRY, Workload, autocast_bf16, build_on  # noqa: E402

MODES = ("ddp_graph", "graph", "pgd", "ddp")
MiB = 2**20


# =========================================================================== models
class _Block(nn.Module):
    """ResNet's BasicBlock (torchvision.models.resnet.BasicBlock)."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.down = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
                     if stride != 1 or cin != cout else nn.Identity())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(y)) + self.down(x))


def resnet18(classes: int = 1000) -> nn.Module:
    """torchvision's ResNet-18 when installed, else the same network (11.7M parameters)."""
    try:
        from torchvision.models import resnet18 as tv_resnet18

        return tv_resnet18(num_classes=classes)
    except ImportError:
        pass
    layers, cin = [nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(3, 2, 1)], 64
    for cout, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
        layers += [_Block(cin, cout, stride), _Block(cout, cout, 1)]
        cin = cout
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(512, classes))


class BertLike(nn.Module):
    """BERT-base's shape from torch.nn only (no download): token, position and type
    embeddings, 12 post-norm encoder layers (768 wide, 12 heads, FFN 3072, GELU,
    dropout 0.1), the MLM head with its decoder tied to the token embedding
    (110M parameters). Returns the logits over the vocabulary."""

    def __init__(self, vocab: int = 30522, width: int = 768, layers: int = 12, heads: int = 12,
                 ffn: int = 3072, positions: int = 512) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, width)
        self.pos = nn.Embedding(positions, width)
        self.typ = nn.Embedding(2, width)
        self.norm = nn.LayerNorm(width, eps=1e-12)
        self.drop = nn.Dropout(0.1)
        layer = nn.TransformerEncoderLayer(width, heads, ffn, dropout=0.1, activation="gelu",
                                           batch_first=True, layer_norm_eps=1e-12)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.LayerNorm(width, eps=1e-12))
        self.decoder = nn.Linear(width, vocab)
        self.decoder.weight = self.tok.weight  # tied, as BERT's MLM head

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(ids.shape[1], device=ids.device)
        x = self.drop(self.norm(self.tok(ids) + self.pos(pos) + self.typ(torch.zeros_like(ids))))
        return self.decoder(self.head(self.encoder(x)))


def mlm_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().flatten(0, 1), ids.flatten())


def workload(name: str, small: bool = False) -> Workload:
    """``name``: resnet18, bert_base or a bench_scaling workload. ``small``: a
    pocket-size variant for --smoke on a CPU."""
    if name == "resnet18":
        pixels = 32 if small else 128
        return Workload("resnet18", f"ResNet-18 at {pixels} px, 1000 classes", 32,
                        lambda: resnet18(10 if small else 1000),
                        lambda b, g: (torch.randn(b, 3, pixels, pixels, generator=g),
                                      torch.randint(0, 10 if small else 1000, (b,), generator=g)))
    if name == "bert_base":
        vocab, seq = (1000, 16) if small else (30522, 128)
        net = (lambda: BertLike(vocab, 64, 2, 2, 128, 64)) if small else BertLike
        return Workload("bert_base", f"BERT-base shape (torch.nn), seq {seq}, dropout 0.1", 8, net,
                        lambda b, g: (torch.randint(0, vocab, (b, seq), generator=g),),
                        loss_fn=mlm_loss, split=lambda batch: (tuple(batch), batch[0]))
    if name not in REGISTRY:
        raise SystemExit(f"--model {name!r}: use resnet18, bert_base or one of {sorted(REGISTRY)}")
    return REGISTRY[name]


# =========================================================================== one mode (child)
class Recorder:
    """The allocator after each phase, with the reserved memory split by pool and stream."""

    def __init__(self, dev: torch.device) -> None:
        self.dev, self.rows, self.side = dev, [], None

    def pools(self) -> dict:
        default = torch.cuda.current_stream(self.dev).cuda_stream
        side = self.side.cuda_stream if self.side is not None else None
        out = {"cache_D": 0, "cache_S": 0, "cache_other": 0, "graph_pools": 0, "graph_pools_alloc": 0}
        for seg in torch.cuda.memory_snapshot():
            if seg.get("device", self.dev.index) != self.dev.index:
                continue
            pool = tuple(seg.get("segment_pool_id", (0, 0)))
            if pool != (0, 0):
                out["graph_pools"] += seg["total_size"]
                out["graph_pools_alloc"] += seg["allocated_size"]
            elif seg.get("stream") == default:
                out["cache_D"] += seg["total_size"]
            elif side is not None and seg.get("stream") == side:
                out["cache_S"] += seg["total_size"]
            else:
                out["cache_other"] += seg["total_size"]
        return out

    def __call__(self, phase: str) -> None:
        torch.cuda.synchronize(self.dev)
        stats = torch.cuda.memory_stats(self.dev)
        self.rows.append({"phase": phase,
                          "reserved": torch.cuda.memory_reserved(self.dev),
                          "allocated": torch.cuda.memory_allocated(self.dev),
                          "max_reserved": torch.cuda.max_memory_reserved(self.dev),
                          "max_allocated": torch.cuda.max_memory_allocated(self.dev),
                          "inactive_split": stats.get("inactive_split_bytes.all.current", 0),
                          "segments": stats.get("segment.all.current", 0),
                          **self.pools()})


def _bytes(tensors) -> int:
    seen, n = set(), 0
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.device.type == "cuda" and t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            n += t.numel() * t.element_size()
    return n


def _held_bytes(tensors) -> int:
    """Bytes of each distinct storage as it is now (0 once resized away)."""
    seen, n = set(), 0
    for t in tensors:
        st = t.untyped_storage()
        if t.device.type == "cuda" and st.nbytes() and st.data_ptr() not in seen:
            seen.add(st.data_ptr())
            n += st.nbytes()
    return n


def _state_bytes(opt) -> int:
    return _bytes(v for s in opt.state.values() for v in s.values())


def step_inside(model, opt, batch, autocast) -> torch.Tensor:
    """bench_scaling's inside loop."""
    opt.zero_grad(set_to_none=True)
    with autocast():
        loss = model(*batch)
    loss.backward()
    opt.step()
    return loss


def run_mode(mode: str, w: Workload, batch: int, replays: int, time_steps: int) -> dict:
    import contextlib

    import torch.distributed as dist

    import pygraph_dist as pgd

    pgd.init()
    dev = torch.device("cuda", torch.cuda.current_device())
    stock = dist.new_group(backend="nccl")  # as bench_scaling: torch's own group for the baselines
    gens = [torch.Generator().manual_seed(i) for i in range(4)]
    batches = [tuple(t.to(dev) for t in w.make_batch(batch, g)) for g in gens]
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(dev)
    rec = Recorder(dev)
    rec("start")
    bf16 = lambda: autocast_bf16(dev)  # noqa: E731
    buffers: dict = {}
    side = torch.cuda.Stream() if mode in ("ddp_graph", "graph") else None
    # The recipes build the model on their side stream (bench_scaling's GraphedDDP);
    # pgd's and DDP's users build it on the default stream.
    with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
        module = build_on(dev, w.build)
    params = [p for p in module.parameters()]
    buffers["parameters"] = _bytes(params)

    if mode == "pgd":
        opt = torch.optim.AdamW(params, lr=1e-4, fused=True)
        model, opt = pgd.wrap(module, opt, amp="bf16")
        engine = model.engine
        rec.side = engine.step.stream
        rec("after wrap")
        from pygraph_dist import _C

        for i in range(30):  # bench_scaling's PyGraphDist.setup
            step_inside(model, opt, batches[0], contextlib.nullcontext)
            phase = _C.phase_name(engine._phase) if engine._phase is not None else "?"  # noqa: SLF001
            rec(f"step {i + 1} ({phase})")
            phases = {_C.phase_name(e.policy.phase) for e in engine.entries.values()}
            decided = all(e.selection or _C.phase_name(e.policy.phase) == "eager"
                          for e in engine.entries.values())
            if i >= 2 and phases <= {"replay", "eager"} and decided:
                break
        r = engine.reducer
        # Storage actually held: at world size 1 a tier-1 graph's gradients become
        # the .grad tensors and the flat buckets are freed (grad_adoption.py).
        buffers["gradient buckets"] = _held_bytes(b for b in r.buffers if b is not None)
        bucket_ptrs = {b.untyped_storage().data_ptr() for b in r.buffers if b is not None}
        buffers["gradients owned by the graph (adopted)"] = _bytes(
            v for v in r.views if v is not None and v.untyped_storage().data_ptr() not in bucket_ptrs)
        buffers["bf16 comm buffers"] = _bytes(c for c in r.comm if c is not None)
        buffers["optimizer state"] = _state_bytes(opt)
        buffers["lr tensors"] = _bytes(t for t in engine.opt_plan.lr_tensors if t is not None)
        entries = list(engine.entries.values())
        buffers["static inputs"] = _bytes(t for e in entries for t in (e.static_leaves or []))
        buffers["static outputs"] = _bytes(t for e in entries if e.static_result is not None
                                           for t in torch.utils._pytree.tree_leaves(e.static_result))
        buffers["graph pools (pool_bytes, as captured)"] = sum(e.pool_bytes for e in entries)
        buffers["grads that are not bucket views"] = _bytes(
            p.grad for p, v in zip(r.params, r.views) if p.grad is not None and p.grad is not v)
        extra = {"report": str(pgd.report())}

        def run(b):
            return step_inside(model, opt, b, contextlib.nullcontext)
    elif mode in ("ddp_graph", "graph"):
        rec.side = side
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            static = [t.clone() for t in batches[0]]
            if mode == "ddp_graph":
                from torch.nn.parallel import DistributedDataParallel as DDP

                model = DDP(module, device_ids=[dev.index], process_group=stock)
            else:
                model = module
            opt = torch.optim.AdamW(params, lr=1e-4, fused=True, capturable=True)
            rec("after setup")
            for i in range(11 if mode == "ddp_graph" else 3):
                step_inside(model, opt, static, bf16)
                rec(f"warm-up {i + 1}")
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        opt.zero_grad(set_to_none=True)
        # bench_scaling captures on the side stream; torch's example lets
        # torch.cuda.graph use a capture stream of its own.
        with torch.cuda.graph(graph, **({"stream": side} if mode == "ddp_graph" else {})):
            static_loss = step_inside(model, opt, static, bf16)
        rec("after capture")

        def run(b):
            for s, x in zip(static, b):
                s.copy_(x, non_blocking=True)
            graph.replay()
            return static_loss

        buffers["optimizer state"] = _state_bytes(opt)
        buffers["static inputs"] = _bytes(static)
        buffers["p.grad (in the graph's pool)"] = _bytes(p.grad for p in params if p.grad is not None)
        if mode == "ddp_graph":
            buffers["DDP gradient buckets (estimate: the gradients' size)"] = _bytes(params)
        extra = {}
    else:
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(module, device_ids=[dev.index], process_group=stock)
        opt = torch.optim.AdamW(params, lr=1e-4, fused=True)
        rec("after setup")
        for i in range(3):
            step_inside(model, opt, batches[0], bf16)
            rec(f"step {i + 1}")
        buffers["optimizer state"] = _state_bytes(opt)
        extra = {}

        def run(b):
            return step_inside(model, opt, b, bf16)

    for i in range(replays):
        run(batches[i % len(batches)])
    rec(f"after {replays} more steps")
    events = [torch.cuda.Event(enable_timing=True) for _ in range(time_steps + 1)]
    events[0].record()
    for i in range(time_steps):
        run(batches[i % len(batches)])
        events[i + 1].record()
    torch.cuda.synchronize()
    ms = [events[i].elapsed_time(events[i + 1]) for i in range(time_steps)]
    rec("end")
    out = {"mode": mode, "phases": rec.rows, "buffers": buffers, **extra,
           "peak_reserved": torch.cuda.max_memory_reserved(dev),
           "peak_allocated": torch.cuda.max_memory_allocated(dev),
           "ms_per_it": statistics.median(ms) if ms else None}
    if mode == "pgd":
        model.engine.teardown()
    pgd.shutdown()
    return out


# =========================================================================== driver
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_child(args, mode: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        part = Path(tmp) / f"{mode}.json"
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0",
                   WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
        cmd = [sys.executable, str(Path(__file__).resolve()), "--model", args.model, "--child", mode,
               "--child-out", str(part), "--replays", str(args.replays), "--time-steps", str(args.time_steps)]
        if args.batch:
            cmd += ["--batch", str(args.batch)]
        try:
            p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
        except subprocess.TimeoutExpired:
            return {"mode": mode, "error": f"timed out after {args.timeout} s"}
        if p.returncode != 0 or not part.exists():
            return {"mode": mode, "error": f"exit {p.returncode}: {(p.stderr or p.stdout)[-1500:]}"}
        return json.loads(part.read_text())


def _m(x) -> str:
    return f"{x / MiB:.1f}" if isinstance(x, (int, float)) else "-"


def table(result: dict) -> str:
    runs = [r for r in result["modes"] if "error" not in r]
    base = next((r for r in runs if r["mode"] == "ddp_graph"), None)
    lines = [f"{result['model']} ({result['description']}), batch {result['batch']}, {result['device']}, "
             f"torch {result['torch']}",
             f"{'mode':10} {'peak rsv':>9} {'x ddp_graph':>11} {'peak alloc':>10} {'end rsv':>8} "
             f"{'graph pools':>11} {'cache D':>8} {'cache S':>8} {'inactive':>8} {'ms/it':>7}"]
    for r in runs:
        end = r["phases"][-1]
        ratio = f"{r['peak_reserved'] / base['peak_reserved']:.3f}" if base else "-"
        ms = f"{r['ms_per_it']:.3f}" if r.get("ms_per_it") else "-"
        lines.append(f"{r['mode']:10} {_m(r['peak_reserved']):>9} {ratio:>11} {_m(r['peak_allocated']):>10} "
                     f"{_m(end['reserved']):>8} {_m(end['graph_pools']):>11} {_m(end['cache_D']):>8} "
                     f"{_m(end['cache_S']):>8} {_m(end['inactive_split']):>8} {ms:>7}")
    for r in result["modes"]:
        if "error" in r:
            lines.append(f"{r['mode']:10} ERROR {r['error'].splitlines()[-1] if r['error'] else ''}")
    for r in runs:
        lines += ["", f"{r['mode']}: phase by phase (MiB)",
                  f"  {'phase':28} {'rsv':>8} {'alloc':>8} {'max rsv':>8} {'graph':>8} {'cache D':>8} "
                  f"{'cache S':>8} {'inactive':>8}"]
        for p in r["phases"]:
            lines.append(f"  {p['phase']:28} {_m(p['reserved']):>8} {_m(p['allocated']):>8} "
                         f"{_m(p['max_reserved']):>8} {_m(p['graph_pools']):>8} {_m(p['cache_D']):>8} "
                         f"{_m(p['cache_S']):>8} {_m(p['inactive_split']):>8}")
        lines.append("  buffers: " + ", ".join(f"{k} {_m(v)}" for k, v in r["buffers"].items()))
    return "\n".join(lines)


def smoke() -> int:
    """On a CPU: build both models small, one forward and backward each, and the
    table from a made-up result (nothing is measured)."""
    for name in ("resnet18", "bert_base"):
        w = workload(name, small=True)
        torch.manual_seed(0)
        net = w.build()
        loss = net(*w.make_batch(2, torch.Generator().manual_seed(0)))
        loss.backward()
        assert torch.isfinite(loss), name
    row = {"phase": "end", **{k: 0 for k in ("reserved", "allocated", "max_reserved", "max_allocated",
                                             "inactive_split", "segments", "cache_D", "cache_S",
                                             "cache_other", "graph_pools", "graph_pools_alloc")}}
    fake = {"model": "resnet18", "description": "smoke", "batch": 2, "device": "cpu", "torch": torch.__version__,
            "modes": [{"mode": m, "phases": [row], "buffers": {"parameters": 1}, "peak_reserved": MiB,
                       "peak_allocated": MiB, "ms_per_it": 1.0} for m in ("ddp_graph", "pgd")]}
    print(table(fake))
    print("smoke ok")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="resnet18", help="resnet18, bert_base, or a bench_scaling workload")
    ap.add_argument("--batch", type=int, default=0, help="per-GPU batch (default: the workload's)")
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)}")
    ap.add_argument("--replays", type=int, default=10, help="steps after the setup before the memory is read")
    ap.add_argument("--time-steps", type=int, default=50, help="timed steps at the end (ms/it)")
    ap.add_argument("--timeout", type=int, default=600, help="seconds per mode")
    ap.add_argument("--out", default="", help="write the JSON here")
    ap.add_argument("--smoke", action="store_true", help="CPU check of the models and the table; measures nothing")
    ap.add_argument("--child", default="", help=argparse.SUPPRESS)
    ap.add_argument("--child-out", default="", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    bad = [m for m in modes if m not in MODES]
    if bad:
        ap.error(f"unknown mode(s) {bad}; choose from {', '.join(MODES)}")
    if args.smoke:
        return smoke()
    w = workload(args.model)
    if w.missing():
        print(f"--model {w.name} needs {', '.join(w.missing())} (pip install it)", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("memory_breakdown.py measures CUDA memory and needs a CUDA GPU: torch.cuda.is_available() "
              "is False here. Nothing was measured (--smoke checks the script on a CPU).", file=sys.stderr)
        return 2
    if args.child:
        result = run_mode(args.child, w, args.batch or w.default_batch, args.replays, args.time_steps)
        Path(args.child_out).write_text(json.dumps(result))
        return 0
    result = {"model": w.name, "description": w.description, "batch": args.batch or w.default_batch,
              "device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "modes": [run_child(args, m) for m in modes]}
    text = table(result)
    print(text)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
        print(f"wrote {args.out}")
    return 0 if all("error" not in r for r in result["modes"]) else 1


if __name__ == "__main__":
    sys.exit(main())
