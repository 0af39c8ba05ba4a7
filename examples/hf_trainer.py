"""A Hugging Face ``Trainer`` on pygraph_dist: ``PGDTrainer`` where ``Trainer`` was.

    torchrun --nproc-per-node=2 examples/hf_trainer.py            # pygraph_dist
    torchrun --nproc-per-node=2 examples/hf_trainer.py --plain    # stock Trainer (DDP)
    python examples/hf_trainer.py --steps 40                      # one process

A small GPT-2 (built from a config: nothing is downloaded) trained on synthetic
token sequences with gradient accumulation, gradient clipping, a linear
schedule with warm-up, logging every few steps and evaluation every few
steps, all through ``TrainingArguments``. bf16 on CUDA, fp32 on the CPU.
"""

from __future__ import annotations

import argparse
import tempfile

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

import pygraph_dist as pgd
from pygraph_dist.integrations.hf import PGDTrainer


class TokenDataset(torch.utils.data.Dataset):
    """Sequences that repeat a random motif (so the loss has something to learn)."""

    def __init__(self, n: int, seq: int, vocab: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        motif = torch.randint(0, vocab, (n, 8), generator=g)
        self.ids = motif.repeat(1, seq // 8 + 1)[:, :seq].contiguous()

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def make_model(layers: int, width: int, vocab: int, seq: int, seed: int = 0) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=vocab, n_positions=seq, n_embd=width, n_layer=layers,
                        n_head=max(1, width // 64), bos_token_id=0, eos_token_id=0,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                        use_cache=False)  # training: no key/value cache built every step
    return GPT2LMHeadModel(config)


def training_arguments(output_dir: str, *, steps: int, batch: int, accum: int = 2, logging_steps: int = 5,
                       eval_steps: int | None = 10, lr: float = 1e-3, **extra) -> TrainingArguments:
    cuda = torch.cuda.is_available()
    evaluation = {"eval_strategy": "steps", "eval_steps": eval_steps} if eval_steps else {"eval_strategy": "no"}
    options = dict(
        output_dir=output_dir, max_steps=steps, per_device_train_batch_size=batch,
        per_device_eval_batch_size=batch, gradient_accumulation_steps=accum, max_grad_norm=1.0,
        learning_rate=lr, lr_scheduler_type="linear", warmup_steps=2, weight_decay=0.01,
        logging_steps=logging_steps, bf16=cuda, use_cpu=not cuda, report_to="none", save_strategy="no",
        seed=0, disable_tqdm=True, dataloader_pin_memory=cuda, **evaluation)
    return TrainingArguments(**{**options, **extra})


def run(plain: bool, output_dir: str, *, steps: int = 20, batch: int = 8, seq: int = 64, layers: int = 2,
        width: int = 128, vocab: int = 512, accum: int = 2, logging_steps: int = 5, eval_steps: int | None = 10,
        callbacks: tuple[TrainerCallback, ...] = (), wrap_options: dict | None = None, **extra) -> dict:
    """Train with ``Trainer`` (``plain``) or ``PGDTrainer``; returns the log history and final parameters."""
    model = make_model(layers, width, vocab, seq)
    args = training_arguments(output_dir, steps=steps, batch=batch, accum=accum, logging_steps=logging_steps,
                              eval_steps=eval_steps, **extra)
    world = max(1, args.world_size)
    train = TokenDataset(steps * accum * batch * world, seq, vocab, seed=1)
    evaluation = TokenDataset(4 * batch * world, seq, vocab, seed=2)
    kwargs = dict(model=model, args=args, train_dataset=train, eval_dataset=evaluation, callbacks=list(callbacks))
    trainer = Trainer(**kwargs) if plain else PGDTrainer(**kwargs, **(wrap_options or {}))
    trainer.train()
    params = torch.cat([p.detach().float().reshape(-1).cpu() for p in model.parameters()])
    return {"log_history": trainer.state.log_history, "params": params,
            "prepared": type(trainer.model_wrapped).__name__}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plain", action="store_true", help="stock transformers.Trainer (DDP)")
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    if not args.plain:
        pgd.init()  # before TrainingArguments, so that Accelerate uses pygraph_dist's process group
    with tempfile.TemporaryDirectory() as out:
        result = run(args.plain, out, steps=args.steps)
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        for entry in result["log_history"]:
            if "loss" in entry or "eval_loss" in entry:
                print({k: round(v, 4) if isinstance(v, float) else v for k, v in entry.items()})
        if not args.plain:
            print(pgd.report())
    pgd.shutdown()


if __name__ == "__main__":
    main()
