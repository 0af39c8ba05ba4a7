"""A hand-written Hugging Face Accelerate loop on pygraph_dist: only the line that
creates the Accelerator changes (``PGDAccelerator`` for ``Accelerator``).

    torchrun --nproc-per-node=2 examples/accelerate_loop.py            # pygraph_dist
    torchrun --nproc-per-node=2 examples/accelerate_loop.py --plain    # stock Accelerate (DDP)
    python examples/accelerate_loop.py --steps 40                      # one process

A small GPT-2 (built from a config: nothing is downloaded) learns synthetic
token sequences, with gradient accumulation through ``accelerator.accumulate``,
``accelerator.clip_grad_norm_``, a linear warm-up schedule, the loss logged
every few steps (``accelerator.reduce``) and an evaluation through the prepared
model (``accelerator.gather_for_metrics``). bf16 on CUDA, fp32 on the CPU
(Gloo ranks with ``cpu=True``).
"""

from __future__ import annotations

import argparse
import math
import time
from typing import Callable

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader, TensorDataset
from transformers import GPT2Config, GPT2LMHeadModel, get_linear_schedule_with_warmup

import pygraph_dist as pgd
from pygraph_dist.integrations.hf import PGDAccelerator


def tokens(n: int, seq: int, vocab: int, seed: int) -> TensorDataset:
    """Sequences that repeat a random motif, so the loss has something to learn."""
    g = torch.Generator().manual_seed(seed)
    motif = torch.randint(0, vocab, (n, 8), generator=g)
    return TensorDataset(motif.repeat(1, seq // 8 + 1)[:, :seq].contiguous())


def make_model(layers: int, width: int, vocab: int, seq: int, seed: int = 0) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=vocab, n_positions=seq, n_embd=width, n_layer=layers,
                        n_head=max(1, width // 64), bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                        use_cache=False)  # training: no key/value cache built every step
    return GPT2LMHeadModel(config)


def run(accelerator: Accelerator, *, steps: int = 20, batch: int = 8, seq: int = 64, layers: int = 2,
        width: int = 128, vocab: int = 512, lr: float = 1e-3, log_every: int = 5,
        on_step: Callable[[int], None] | None = None) -> dict:
    """Train and evaluate; returns the logged losses, the eval loss and the final parameters.
    ``on_step(n)`` after the n-th optimizer step (``benchmarks/bench_hf.py`` times the loop with it)."""
    accum = accelerator.gradient_accumulation_steps
    model = make_model(layers, width, vocab, seq)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    train = DataLoader(tokens(steps * accum * batch * accelerator.num_processes, seq, vocab, seed=1),
                       batch_size=batch, shuffle=False)
    evaluation = DataLoader(tokens(4 * batch * accelerator.num_processes, seq, vocab, seed=2), batch_size=batch)
    # Accelerate's prepared scheduler steps once per process per optimizer step (its
    # AcceleratedScheduler, split_batches=False), so the schedule is counted that way.
    n = accelerator.num_processes
    scheduler = get_linear_schedule_with_warmup(optimizer, num_warmup_steps=2 * n, num_training_steps=steps * n)
    model, optimizer, train, evaluation, scheduler = accelerator.prepare(
        model, optimizer, train, evaluation, scheduler)

    model.train()
    logged, done, first, started = [], 0, None, time.perf_counter()
    for (ids,) in train:
        with accelerator.accumulate(model):
            loss = model(input_ids=ids, labels=ids).loss
            first = loss.detach().clone() if first is None else first
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        if accelerator.sync_gradients:
            done += 1
            if done % log_every == 0:
                mean = accelerator.reduce(loss.detach(), reduction="mean").item()
                logged.append(mean)
                accelerator.print(f"step {done:4d}  loss {mean:.4f}  lr {scheduler.get_last_lr()[0]:.2e}")
            if on_step is not None:
                on_step(done)
    elapsed = time.perf_counter() - started

    model.eval()
    losses = []
    with torch.no_grad():
        for (ids,) in evaluation:
            losses.append(accelerator.gather_for_metrics(model(input_ids=ids, labels=ids).loss.reshape(1)))
    eval_loss = torch.cat(losses).float().mean().item()
    accelerator.print(f"eval loss {eval_loss:.4f} ({math.exp(eval_loss):.1f} perplexity), "
                      f"{1000 * elapsed / max(done, 1):.2f} ms/step")
    params = torch.cat([p.detach().float().reshape(-1).cpu() for p in accelerator.unwrap_model(model).parameters()])
    return {"logged": logged, "eval_loss": eval_loss, "params": params, "steps": done, "first_loss": first.item(),
            "prepared": type(model).__name__}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plain", action="store_true", help="stock accelerate.Accelerator (DDP)")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--accum", type=int, default=2, help="gradient accumulation steps")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    options = dict(mixed_precision="bf16" if cuda else "no", gradient_accumulation_steps=args.accum, cpu=not cuda)
    accelerator = Accelerator(**options) if args.plain else PGDAccelerator(**options)  # the one changed line
    run(accelerator, steps=args.steps)
    if not args.plain and accelerator.is_main_process:
        print(pgd.report())
    accelerator.end_training()


if __name__ == "__main__":
    main()
