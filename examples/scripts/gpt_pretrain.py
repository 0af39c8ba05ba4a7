"""Character-level GPT pretraining, written the way the most-copied GPT training scripts are.

Every habit of those scripts is here: the model returns ``(logits, loss)``;
the script's own bf16 autocast around the model call; AdamW with two param
groups (decay / no-decay) and ``fused=True`` on CUDA; a hand-written warmup +
cosine ``get_lr(it)`` assigned as a Python float to every ``param_group['lr']``
at the top of each iteration; gradient accumulation through
``model.require_backward_grad_sync``; the loss divided by the accumulation
count; ``torch.cuda.amp.GradScaler(enabled=False)`` with ``scale``/``unscale_``/
``step``/``update`` and ``clip_grad_norm_``; ``zero_grad(set_to_none=True)``
after the step; ``loss.item()`` every ``--log-interval`` steps; ``torch.compile``
before wrapping; ``estimate_loss()`` under ``model.eval()`` + ``torch.no_grad()``
on rank 0 only; a checkpoint of ``model.module.state_dict()`` and the
optimizer; an MFU estimate through ``model.module``.

The only lines that differ between DDP and pygraph_dist are where the process
group and DDP are created (``--mode``):

    torchrun --nproc-per-node=1 examples/scripts/gpt_pretrain.py --mode ddp
    torchrun --nproc-per-node=1 examples/scripts/gpt_pretrain.py --mode pgd
    torchrun --nproc-per-node=1 examples/scripts/gpt_pretrain.py --mode pgd_nographs

Data: a synthetic character corpus (words drawn from a fixed random lexicon),
so nothing is downloaded. ``--out-dir`` receives ``result_rank<r>.json``
(per-micro-step losses, eval losses, parameter checksum, ms/it, s per
evaluation, ``pgd.report()``), ``final_params.pt`` and ``ckpt.pt`` (rank 0).
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import os
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel as DDP


# ----------------------------------------------------------------------------- model
@dataclass
class GPTConfig:
    block_size: int = 256
    vocab_size: int = 65
    n_layer: int = 6
    n_head: int = 6
    n_embd: int = 384
    dropout: float = 0.2
    bias: bool = False


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        assert cfg.n_embd % cfg.n_head == 0
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.out = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.resid_drop = nn.Dropout(cfg.dropout)
        self.n_head, self.dropout = cfg.n_head, cfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        q, k, v = self.qkv(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=None, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_drop(self.out(y))


class FeedForward(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.up = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.down = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.down(F.gelu(self.up(x))))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = FeedForward(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.config = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.pos_emb = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.tok_emb.weight = self.lm_head.weight  # weight tying
        self.apply(self._init_weights)
        for name, p in self.named_parameters():  # scaled init of the residual projections
            if name.endswith("out.weight") or name.endswith("down.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def get_num_params(self, non_embedding: bool = True) -> int:
        n = sum(p.numel() for p in self.parameters())
        return n - self.pos_emb.weight.numel() if non_embedding else n

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        b, t = idx.size()
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        for block in self.blocks:
            x = block(x)
        x = self.ln_f(x)
        if targets is not None:
            logits = self.lm_head(x)
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        else:  # generation: only the last position
            logits, loss = self.lm_head(x[:, [-1], :]), None
        return logits, loss

    def configure_optimizers(self, weight_decay, learning_rate, betas, device_type):
        params = {n: p for n, p in self.named_parameters() if p.requires_grad}
        decay = [p for p in params.values() if p.dim() >= 2]      # matmul weights and embeddings
        no_decay = [p for p in params.values() if p.dim() < 2]    # biases and norms
        groups = [{"params": decay, "weight_decay": weight_decay},
                  {"params": no_decay, "weight_decay": 0.0}]
        use_fused = "fused" in inspect.signature(torch.optim.AdamW).parameters and device_type == "cuda"
        extra = dict(fused=True) if use_fused else dict()
        return torch.optim.AdamW(groups, lr=learning_rate, betas=betas, **extra)

    def estimate_mfu(self, fwdbwd_per_iter: int, dt: float, peak_flops: float) -> float:
        """Model FLOPs utilisation against ``peak_flops`` (PaLM appendix B's count)."""
        cfg = self.config
        N, L, H, Q, T = self.get_num_params(), cfg.n_layer, cfg.n_head, cfg.n_embd // cfg.n_head, cfg.block_size
        flops_per_iter = (6 * N + 12 * L * H * Q * T) * T * fwdbwd_per_iter
        return flops_per_iter / dt / peak_flops


# ----------------------------------------------------------------------------- data
def synthetic_corpus(vocab_size: int, n_chars: int, seed: int = 0) -> torch.Tensor:
    """Words of 2-8 characters from a fixed random lexicon, separated by token 0:
    the same "text" in every process, learnable well below log(vocab)."""
    g = torch.Generator().manual_seed(seed)
    words = [torch.randint(1, vocab_size, (int(torch.randint(2, 9, (1,), generator=g)),), generator=g)
             for _ in range(300)]
    picks = torch.randint(0, len(words), (n_chars // 4,), generator=g)
    sep = torch.zeros(1, dtype=torch.long)
    text = torch.cat([t for i in picks.tolist() for t in (words[i], sep)])
    return text[:n_chars].to(torch.long)


# ----------------------------------------------------------------------------- script
def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mode", choices=["ddp", "pgd", "pgd_nographs"], default="pgd")
    p.add_argument("--out-dir", default="out-gpt")
    p.add_argument("--n-layer", type=int, default=6)
    p.add_argument("--n-head", type=int, default=6)
    p.add_argument("--n-embd", type=int, default=384)
    p.add_argument("--block-size", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--vocab-size", type=int, default=65)
    p.add_argument("--dropout", type=float, default=0.2)
    p.add_argument("--grad-accum-steps", type=int, default=1, help="over all ranks (divided by world size)")
    p.add_argument("--max-iters", type=int, default=200)
    p.add_argument("--eval-interval", type=int, default=100)
    p.add_argument("--eval-iters", type=int, default=20, help="batches per split in estimate_loss()")
    p.add_argument("--log-interval", type=int, default=10)
    p.add_argument("--learning-rate", type=float, default=1e-3)
    p.add_argument("--min-lr", type=float, default=1e-4)
    p.add_argument("--warmup-iters", type=int, default=20)
    p.add_argument("--lr-decay-iters", type=int, default=None, help="default: --max-iters")
    p.add_argument("--weight-decay", type=float, default=1e-1)
    p.add_argument("--beta2", type=float, default=0.99)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                   help="autocast dtype (default bfloat16 on CUDA, float32 on CPU)")
    p.add_argument("--compile", action="store_true", help="torch.compile(model) before wrapping")
    p.add_argument("--compile-backend", default="inductor", help="torch.compile backend (eager: a CPU smoke test)")
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--time-from", type=int, default=10, help="first iteration timed for ms/it")
    p.add_argument("--peak-tflops", type=float, default=989.0, help="for the MFU estimate (H100 bf16 dense)")
    p.add_argument("--no-checkpoint", action="store_true")
    p.add_argument("--deterministic", action="store_true",
                   help="torch.use_deterministic_algorithms(True): flash attention's backward is otherwise "
                        "not bitwise reproducible from run to run (atomic adds), with or without graphs")
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    # Run as torchrun does; a bare `python gpt_pretrain.py` is a job of one process.
    for k, v in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                 "MASTER_PORT": "29517"}.items():
        os.environ.setdefault(k, v)
    cuda = torch.cuda.is_available()
    backend = "nccl" if cuda else "gloo"
    if args.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before the first cuBLAS call
        torch.use_deterministic_algorithms(True)

    # ---- the lines that differ: the process group ------------------------------------
    if args.mode == "ddp":
        dist.init_process_group(backend=backend)
    else:
        import pygraph_dist as pgd
        pgd.init()
    # -------------------------------------------------------------------------------------
    ddp_rank, ddp_local_rank, ddp_world_size = (int(os.environ[k]) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE"))
    device = f"cuda:{ddp_local_rank}" if cuda else "cpu"
    if cuda:
        torch.cuda.set_device(device)
    master_process = ddp_rank == 0
    seed_offset = ddp_rank  # each process its own batches and dropout masks
    assert args.grad_accum_steps % ddp_world_size == 0
    gradient_accumulation_steps = args.grad_accum_steps // ddp_world_size
    batch_size, block_size = args.batch_size, args.block_size
    tokens_per_iter = gradient_accumulation_steps * ddp_world_size * batch_size * block_size
    if master_process:
        print(f"mode {args.mode}; tokens per iteration {tokens_per_iter:,}")
        os.makedirs(args.out_dir, exist_ok=True)
    torch.manual_seed(args.seed + seed_offset)
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    device_type = "cuda" if "cuda" in device else "cpu"
    dtype = args.dtype or ("bfloat16" if cuda else "float32")
    ptdtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    ctx = nullcontext() if device_type == "cpu" else torch.amp.autocast(device_type=device_type, dtype=ptdtype)

    data = synthetic_corpus(args.vocab_size, 200_000)
    n = int(0.9 * len(data))
    train_data, val_data = data[:n], data[n:]

    def get_batch(split: str):
        src = train_data if split == "train" else val_data
        ix = torch.randint(len(src) - block_size, (batch_size,))
        x = torch.stack([src[i:i + block_size] for i in ix])
        y = torch.stack([src[i + 1:i + 1 + block_size] for i in ix])
        if device_type == "cuda":
            x, y = x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
        else:
            x, y = x.to(device), y.to(device)
        return x, y

    model_args = dict(n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd, block_size=block_size,
                      bias=False, vocab_size=args.vocab_size, dropout=args.dropout)
    model = GPT(GPTConfig(**model_args))
    model.to(device)
    scaler = torch.cuda.amp.GradScaler(enabled=(dtype == "float16"))
    optimizer = model.configure_optimizers(args.weight_decay, args.learning_rate, (0.9, args.beta2), device_type)
    if args.compile:
        if master_process:
            print("compiling the model...")
        model = torch.compile(model, backend=args.compile_backend)

    # ---- the lines that differ: DDP -------------------------------------------------------
    if args.mode == "ddp":
        model = DDP(model, device_ids=[ddp_local_rank] if cuda else None)
    else:
        model, optimizer = pgd.wrap(model, optimizer, graphs=args.mode == "pgd")
    # -------------------------------------------------------------------------------------

    @torch.no_grad()
    def estimate_loss() -> dict:
        out = {}
        model.eval()
        for split in ["train", "val"]:
            losses = torch.zeros(args.eval_iters)
            for k in range(args.eval_iters):
                X, Y = get_batch(split)
                with ctx:
                    logits, loss = model(X, Y)
                losses[k] = loss.item()
            out[split] = losses.mean().item()
        model.train()
        return out

    lr_decay_iters = args.lr_decay_iters or args.max_iters

    def get_lr(it: int) -> float:
        if it < args.warmup_iters:  # linear warmup
            return args.learning_rate * (it + 1) / (args.warmup_iters + 1)
        if it > lr_decay_iters:
            return args.min_lr
        decay_ratio = (it - args.warmup_iters) / (lr_decay_iters - args.warmup_iters)
        coeff = 0.5 * (1.0 + math.cos(math.pi * decay_ratio))  # 1 -> 0
        return args.min_lr + coeff * (args.learning_rate - args.min_lr)

    X, Y = get_batch("train")
    t0 = time.time()
    iter_num, local_iter_num, best_val_loss = 0, 0, 1e9
    raw_model = model.module  # unwrap the DDP container
    running_mfu = -1.0
    always_save_checkpoint = not args.no_checkpoint
    micro_losses: list[torch.Tensor] = []
    evals: list[dict] = []
    eval_seconds: list[float] = []
    timed_start, eval_in_window = None, 0.0
    while True:
        lr = get_lr(iter_num)
        for param_group in optimizer.param_groups:
            param_group["lr"] = lr

        if iter_num == args.time_from:
            if cuda:
                torch.cuda.synchronize()
            timed_start = time.perf_counter()
        if iter_num % args.eval_interval == 0 and master_process:
            if cuda:
                torch.cuda.synchronize()
            e0 = time.perf_counter()
            losses = estimate_loss()
            if cuda:
                torch.cuda.synchronize()
            eval_seconds.append(time.perf_counter() - e0)
            if timed_start is not None:
                eval_in_window += eval_seconds[-1]
            evals.append({"iter": iter_num, **losses})
            print(f"step {iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}")
            if losses["val"] < best_val_loss or always_save_checkpoint:
                best_val_loss = min(best_val_loss, losses["val"])
                if iter_num > 0 and not args.no_checkpoint:
                    checkpoint = {"model": raw_model.state_dict(), "optimizer": optimizer.state_dict(),
                                  "model_args": model_args, "iter_num": iter_num,
                                  "best_val_loss": best_val_loss, "config": vars(args)}
                    torch.save(checkpoint, os.path.join(args.out_dir, "ckpt.pt"))

        for micro_step in range(gradient_accumulation_steps):
            # Only the last micro-step all-reduces (what no_sync() toggles, set directly).
            model.require_backward_grad_sync = (micro_step == gradient_accumulation_steps - 1)
            with ctx:
                logits, loss = model(X, Y)
                loss = loss / gradient_accumulation_steps
            micro_losses.append(loss.detach())
            X, Y = get_batch("train")  # prefetch while the GPU runs forward
            scaler.scale(loss).backward()
        if args.grad_clip != 0.0:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)

        t1 = time.time()
        dt, t0 = t1 - t0, t1
        if iter_num % args.log_interval == 0 and master_process:
            lossf = loss.item() * gradient_accumulation_steps  # a host sync
            if local_iter_num >= 5:
                # (a compiled raw_model forwards the attribute to the module it compiled)
                mfu = raw_model.estimate_mfu(batch_size * gradient_accumulation_steps, dt, args.peak_tflops * 1e12)
                running_mfu = mfu if running_mfu == -1.0 else 0.9 * running_mfu + 0.1 * mfu
            print(f"iter {iter_num}: loss {lossf:.4f}, time {dt * 1000:.2f}ms, mfu {running_mfu * 100:.2f}%")
        iter_num += 1
        local_iter_num += 1
        if iter_num > args.max_iters:
            break

    if cuda:
        torch.cuda.synchronize()
    timed_iters = iter_num - args.time_from
    ms_per_iter = ((time.perf_counter() - timed_start - eval_in_window) * 1e3 / timed_iters
                   if timed_start is not None and timed_iters > 0 else None)
    write_result(args, raw_model, micro_losses, evals, eval_seconds, ms_per_iter, running_mfu, ddp_rank,
                 ddp_world_size, gradient_accumulation_steps)
    if args.mode != "ddp":
        pgd.shutdown()
    else:
        dist.destroy_process_group()


def write_result(args, raw_model, micro_losses, evals, eval_seconds, ms_per_iter, mfu, rank, world,
                 accum) -> None:
    """``result_rank<r>.json`` and, from rank 0, ``final_params.pt`` (for bitwise comparisons)."""
    flat = torch.cat([p.detach().float().reshape(-1).cpu() for p in raw_model.parameters()])
    result = {
        "mode": args.mode, "compile": args.compile, "rank": rank, "world_size": world,
        "grad_accum_steps_per_rank": accum,
        "losses": torch.stack(micro_losses).float().cpu().tolist(),
        "evals": evals, "eval_seconds": eval_seconds, "ms_per_iter": ms_per_iter, "mfu": mfu,
        "param_sum": float(flat.double().sum()), "param_abs_sum": float(flat.double().abs().sum()),
        "num_params": raw_model.get_num_params(non_embedding=False),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
    }
    if args.mode != "ddp":
        import pygraph_dist as pgd
        rep = pgd.report()
        result["report"] = asdict(rep.models[0]) if rep.models else None
        result["report_text"] = str(rep)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if rank == 0:
        torch.save(flat, out / "final_params.pt")
    (out / f"result_rank{rank}.json").write_text(json.dumps(result, indent=1, default=str))


if __name__ == "__main__":
    main()
