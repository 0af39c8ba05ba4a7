"""Image classification training, written the way timm's ``train.py`` is.

The habits of that script family, in our own small classes: a scheduler
object that writes a float into ``param_group['lr']`` at every update
(``step_update(num_updates)``, base values taken from ``initial_lr``); a
GradScaler wrapper with clipping called as ``loss_scaler(loss, optimizer,
clip_grad=..., parameters=...)``; an EMA of the weights (a deep copy of the
model made before the DDP wrapper, updated from the wrapped model's
``state_dict()`` after every update, validated each epoch); channels_last
memory format for the model and the inputs; the script's own autocast;
``model.no_sync()`` on micro-batches that do not update; ``zero_grad()``
after the update; the loss all-reduced for logging every few updates.

Only the line that creates DDP differs (``--mode``); the process group is the
script's own ``init_process_group`` (env:// as torchrun sets it):

    torchrun --nproc-per-node=1 examples/scripts/timm_style.py --mode ddp
    torchrun --nproc-per-node=1 examples/scripts/timm_style.py --mode pgd

``--out-dir`` receives ``result_rank<r>.json`` (per-micro-batch losses, the
all-reduced losses logged, validation of the model and of its EMA per
epoch, checksums, ``pgd.report()``) and ``final_params.pt`` (rank 0).
"""

from __future__ import annotations

import argparse
import json
import math
import os
from contextlib import suppress
from copy import deepcopy
from dataclasses import asdict
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


# ----------------------------------------------------------------------------- scheduler
class CosineUpdateScheduler:
    """Warmup then cosine, in updates: writes ``param_group[field] = value`` (a
    float) at construction and at every ``step_update``. Base values come from
    ``initial_<field>`` (set here if absent), as timm's schedulers take them."""

    def __init__(self, optimizer, t_initial: int, lr_min: float = 1e-5, warmup_t: int = 0,
                 warmup_lr_init: float = 0.0, param_group_field: str = "lr") -> None:
        self.optimizer, self.field = optimizer, param_group_field
        self.initial_field = f"initial_{param_group_field}"
        for i, group in enumerate(optimizer.param_groups):
            if param_group_field not in group:
                raise KeyError(f"{param_group_field} missing from param_groups[{i}]")
            group.setdefault(self.initial_field, group[param_group_field])
        self.base_values = [group[self.initial_field] for group in optimizer.param_groups]
        self.t_initial, self.lr_min = t_initial, lr_min
        self.warmup_t, self.warmup_lr_init = warmup_t, warmup_lr_init
        if warmup_t:
            self.warmup_steps = [(v - warmup_lr_init) / warmup_t for v in self.base_values]
            self.update_groups(warmup_lr_init)
        else:
            self.warmup_steps = [1 for _ in self.base_values]

    def _get_lr(self, t: int) -> list[float]:
        if t < self.warmup_t:
            return [self.warmup_lr_init + t * s for s in self.warmup_steps]
        t = t - self.warmup_t
        if t >= self.t_initial:
            return [self.lr_min for _ in self.base_values]
        return [self.lr_min + 0.5 * (lr_max - self.lr_min) * (1 + math.cos(math.pi * t / self.t_initial))
                for lr_max in self.base_values]

    def step(self, epoch: int, metric: float | None = None) -> None:
        """Per epoch: nothing, this schedule counts updates."""

    def step_update(self, num_updates: int, metric: float | None = None) -> None:
        self.update_groups(self._get_lr(num_updates))

    def update_groups(self, values) -> None:
        if not isinstance(values, (list, tuple)):
            values = [values] * len(self.optimizer.param_groups)
        for param_group, value in zip(self.optimizer.param_groups, values):
            if "lr_scale" in param_group:
                param_group[self.field] = value * param_group["lr_scale"]
            else:
                param_group[self.field] = value


# ----------------------------------------------------------------------------- scaler, EMA
class NativeScalerWithClip:
    """``loss_scaler(loss, optimizer, clip_grad=..., parameters=...)``: backward,
    then (on the update micro-batch) unscale, clip, step and update."""

    state_dict_key = "amp_scaler"

    def __init__(self, device: str = "cuda", enabled: bool = True) -> None:
        self._scaler = torch.amp.GradScaler(device, enabled=enabled)

    def __call__(self, loss, optimizer, clip_grad=None, clip_mode="norm", parameters=None,
                 create_graph=False, need_update=True) -> None:
        self._scaler.scale(loss).backward(create_graph=create_graph)
        if need_update:
            if clip_grad is not None:
                assert parameters is not None
                self._scaler.unscale_(optimizer)  # unscale the gradients in place before clipping
                if clip_mode == "norm":
                    torch.nn.utils.clip_grad_norm_(parameters, clip_grad)
                else:
                    torch.nn.utils.clip_grad_value_(parameters, clip_grad)
            self._scaler.step(optimizer)
            self._scaler.update()

    def state_dict(self) -> dict:
        return self._scaler.state_dict()


class ModelEma:
    """Exponential moving average of a model's state (parameters and buffers).

    Made from the plain model before the DDP wrapper; ``update()`` takes the
    wrapped model (its ``state_dict()`` values are in the same order)."""

    def __init__(self, model: nn.Module, decay: float = 0.999) -> None:
        self.module = deepcopy(model)
        self.module.eval()
        self.decay = decay

    @torch.no_grad()
    def update(self, model: nn.Module, step: int | None = None) -> None:
        decay = self.decay if step is None else min(self.decay, (1 + step) / (10 + step))
        for ema_v, model_v in zip(self.module.state_dict().values(), model.state_dict().values()):
            if ema_v.is_floating_point():
                ema_v.lerp_(model_v, 1.0 - decay)
            else:
                ema_v.copy_(model_v)


# ----------------------------------------------------------------------------- model
class ConvBlock(nn.Module):
    """Depthwise 3x3, pointwise expansion, BatchNorm, GELU, with a residual."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.dw = nn.Conv2d(dim, dim, 3, padding=1, groups=dim, bias=False)
        self.bn = nn.BatchNorm2d(dim)
        self.pw1 = nn.Conv2d(dim, 2 * dim, 1)
        self.act = nn.GELU()
        self.pw2 = nn.Conv2d(2 * dim, dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.pw2(self.act(self.pw1(self.bn(self.dw(x)))))


class SmallConvNet(nn.Module):
    def __init__(self, num_classes: int = 10, dims=(32, 64), drop_rate: float = 0.1) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, dims[0], 3, padding=1, bias=False), nn.BatchNorm2d(dims[0]),
                                  nn.GELU())
        stages, cin = [], dims[0]
        for i, d in enumerate(dims):
            down = nn.Identity() if i == 0 else nn.Sequential(nn.Conv2d(cin, d, 2, stride=2), nn.BatchNorm2d(d))
            stages += [down, ConvBlock(d), ConvBlock(d)]
            cin = d
        self.stages = nn.Sequential(*stages)
        self.head_drop = nn.Dropout(drop_rate)
        self.head = nn.Linear(cin, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stages(self.stem(x)).mean((2, 3))
        return self.head(self.head_drop(x))


def accuracy(output: torch.Tensor, target: torch.Tensor, topk=(1,)) -> list[torch.Tensor]:
    maxk = min(max(topk), output.size(1))
    _, pred = output.topk(maxk, 1, True, True)
    correct = pred.t().eq(target.reshape(1, -1).expand_as(pred.t()))
    return [correct[:min(k, maxk)].reshape(-1).float().sum(0) * 100.0 / target.size(0) for k in topk]


def reduce_tensor(tensor: torch.Tensor, n: int) -> torch.Tensor:
    rt = tensor.clone()
    dist.all_reduce(rt, op=dist.ReduceOp.SUM)
    return rt / n


def synthetic_split(n: int, size: int, classes: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    images = torch.randn(n, 3, size, size, generator=g)
    teacher = torch.randn(3 * 16, classes, generator=torch.Generator().manual_seed(4242))
    labels = (nn.functional.adaptive_avg_pool2d(images, 4).reshape(n, -1) @ teacher).argmax(1)
    return TensorDataset(images, labels)


# ----------------------------------------------------------------------------- script
def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mode", choices=["ddp", "pgd", "pgd_nographs"], default="pgd")
    p.add_argument("--out-dir", default="out-timm")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=16, help="per process")
    p.add_argument("--grad-accum-steps", type=int, default=1)
    p.add_argument("--train-samples", type=int, default=512)
    p.add_argument("--val-samples", type=int, default=128)
    p.add_argument("--image-size", type=int, default=32)
    p.add_argument("--num-classes", type=int, default=10)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--weight-decay", type=float, default=0.05)
    p.add_argument("--warmup-updates", type=int, default=5)
    p.add_argument("--clip-grad", type=float, default=1.0)
    p.add_argument("--smoothing", type=float, default=0.1)
    p.add_argument("--model-ema-decay", type=float, default=0.99)
    p.add_argument("--amp-dtype", choices=["bfloat16", "float16", "float32"], default=None,
                   help="autocast dtype (default bfloat16 on CUDA, float32 on CPU)")
    p.add_argument("--log-interval", type=int, default=5)
    p.add_argument("--deterministic", action="store_true",
                   help="cudnn.deterministic instead of cudnn.benchmark (for bitwise comparisons)")
    p.add_argument("--seed", type=int, default=42)
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    for k, v in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                 "MASTER_PORT": "29518"}.items():
        os.environ.setdefault(k, v)
    cuda = torch.cuda.is_available()
    local_rank = int(os.environ["LOCAL_RANK"])
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group(backend="nccl" if cuda else "gloo", init_method="env://")
    world_size, rank = dist.get_world_size(), dist.get_rank()
    torch.backends.cudnn.benchmark = not args.deterministic
    torch.backends.cudnn.deterministic = args.deterministic
    torch.manual_seed(args.seed + rank)

    amp_dtype = args.amp_dtype or ("bfloat16" if cuda else "float32")
    amp_autocast = suppress if amp_dtype == "float32" else partial(
        torch.autocast, device_type=device.type, dtype=getattr(torch, amp_dtype))
    loss_scaler = NativeScalerWithClip(device.type, enabled=amp_dtype == "float16")

    model = SmallConvNet(args.num_classes).to(device)
    model.to(memory_format=torch.channels_last)
    decay = [p for n, p in model.named_parameters() if p.ndim > 1 and not n.endswith(".bias")]
    no_decay = [p for n, p in model.named_parameters() if p.ndim <= 1 or n.endswith(".bias")]
    optimizer = torch.optim.AdamW([{"params": no_decay, "weight_decay": 0.0},
                                   {"params": decay, "weight_decay": args.weight_decay}], lr=args.lr)
    model_ema = ModelEma(model, decay=args.model_ema_decay)  # before the DDP wrapper, as timm does

    # ---- the line that differs ----------------------------------------------------------
    if args.mode == "ddp":
        model = nn.parallel.DistributedDataParallel(model, device_ids=[local_rank] if cuda else None)
    else:
        import pygraph_dist as pgd
        model, optimizer = pgd.wrap(model, optimizer, graphs=args.mode == "pgd")
    # -------------------------------------------------------------------------------------

    train_set = synthetic_split(args.train_samples, args.image_size, args.num_classes, seed=1)
    val_set = synthetic_split(args.val_samples, args.image_size, args.num_classes, seed=2)
    train_sampler = DistributedSampler(train_set, seed=args.seed, drop_last=True)
    loader_train = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler, drop_last=True,
                              pin_memory=cuda)
    loader_eval = DataLoader(val_set, batch_size=args.batch_size,
                             sampler=DistributedSampler(val_set, shuffle=False, drop_last=True), pin_memory=cuda)
    updates_per_epoch = (len(loader_train) + args.grad_accum_steps - 1) // args.grad_accum_steps
    lr_scheduler = CosineUpdateScheduler(optimizer, t_initial=args.epochs * updates_per_epoch - args.warmup_updates,
                                         lr_min=args.lr * 0.01, warmup_t=args.warmup_updates,
                                         warmup_lr_init=args.lr * 0.1)
    train_loss_fn = nn.CrossEntropyLoss(label_smoothing=args.smoothing)
    validate_loss_fn = nn.CrossEntropyLoss()

    log: dict = {"losses": [], "logged": [], "val": [], "val_ema": []}
    num_updates = 0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        num_updates = train_one_epoch(epoch, model, loader_train, optimizer, train_loss_fn, args, device,
                                      lr_scheduler, amp_autocast, loss_scaler, model_ema, num_updates, log)
        log["val"].append(validate(model, loader_eval, validate_loss_fn, args, device, amp_autocast))
        log["val_ema"].append(validate(model_ema.module, loader_eval, validate_loss_fn, args, device,
                                       amp_autocast))
        lr_scheduler.step(epoch + 1, log["val"][-1]["top1"])
        if rank == 0:
            print(f"epoch {epoch}: top-1 {log['val'][-1]['top1']:.2f} (EMA {log['val_ema'][-1]['top1']:.2f})")
    write_result(args, model, model_ema, log, rank, world_size)
    dist.destroy_process_group()


def train_one_epoch(epoch, model, loader, optimizer, loss_fn, args, device, lr_scheduler, amp_autocast,
                    loss_scaler, model_ema, num_updates, log) -> int:
    model.train()
    accum_steps = args.grad_accum_steps
    last_idx = len(loader) - 1
    has_no_sync = hasattr(model, "no_sync")
    world_size = dist.get_world_size()
    for batch_idx, (input, target) in enumerate(loader):
        last_batch = batch_idx == last_idx
        need_update = last_batch or (batch_idx + 1) % accum_steps == 0
        input, target = input.to(device, non_blocking=True), target.to(device, non_blocking=True)
        input = input.contiguous(memory_format=torch.channels_last)

        def _forward():
            with amp_autocast():
                output = model(input)
                loss = loss_fn(output, target)
            if accum_steps > 1:
                loss /= accum_steps
            return loss

        def _backward(_loss):
            loss_scaler(_loss, optimizer, clip_grad=args.clip_grad, clip_mode="norm",
                        parameters=model.parameters(), need_update=need_update)

        if has_no_sync and not need_update:
            with model.no_sync():
                loss = _forward()
                _backward(loss)
        else:
            loss = _forward()
            _backward(loss)
        log["losses"].append(loss.detach())
        if not need_update:
            continue
        num_updates += 1
        optimizer.zero_grad()
        model_ema.update(model, step=num_updates)
        if num_updates % args.log_interval == 0:
            reduced_loss = reduce_tensor(loss.data, world_size)
            log["logged"].append(reduced_loss.item() * accum_steps)
            if dist.get_rank() == 0:
                lr = optimizer.param_groups[0]["lr"]
                print(f"Train: {epoch} [{batch_idx:>4d}/{last_idx}] loss {log['logged'][-1]:.4f} "
                      f"lr {float(lr):.3e}")
        lr_scheduler.step_update(num_updates=num_updates)
    return num_updates


def validate(model, loader, loss_fn, args, device, amp_autocast) -> dict:
    model.eval()
    world_size = dist.get_world_size()
    sums = torch.zeros(3, dtype=torch.float64)
    with torch.no_grad():
        for input, target in loader:
            input, target = input.to(device), target.to(device)
            input = input.contiguous(memory_format=torch.channels_last)
            with amp_autocast():
                output = model(input)
                loss = loss_fn(output, target)
            acc1, acc5 = accuracy(output, target, topk=(1, 5))
            reduced = [reduce_tensor(t.data, world_size) for t in (loss, acc1, acc5)]
            sums += torch.tensor([r.item() for r in reduced], dtype=torch.float64)
    n = max(1, len(loader))
    return {"loss": float(sums[0] / n), "top1": float(sums[1] / n), "top5": float(sums[2] / n)}


def write_result(args, model, model_ema, log, rank, world_size) -> None:
    inner = model.module
    params = torch.cat([p.detach().float().reshape(-1).cpu() for p in inner.parameters()])
    ema = torch.cat([v.detach().float().reshape(-1).cpu() for v in model_ema.module.state_dict().values()])
    ema_params = torch.cat([p.detach().float().reshape(-1).cpu() for p in model_ema.module.parameters()])
    buffers = torch.cat([b.detach().float().reshape(-1).cpu() for b in inner.buffers()])
    result = {"mode": args.mode, "rank": rank, "world_size": world_size,
              "losses": torch.stack(log.pop("losses")).float().cpu().tolist(), **log,
              "param_sum": float(params.double().sum()), "param_abs_sum": float(params.double().abs().sum()),
              "ema_sum": float(ema.double().sum()), "buffer_sum": float(buffers.double().sum()),
              "channels_last": all(p.is_contiguous(memory_format=torch.channels_last)
                                   for p in inner.parameters() if p.dim() == 4),
              "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}
    if args.mode != "ddp":
        import pygraph_dist as pgd
        rep = pgd.report()
        result["report"] = asdict(rep.models[0]) if rep.models else None
        result["report_text"] = str(rep)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if rank == 0:
        torch.save({"params": params, "buffers": buffers, "ema": ema, "ema_params": ema_params},
                   out / "final_params.pt")
    (out / f"result_rank{rank}.json").write_text(json.dumps(result, indent=1, default=str))


if __name__ == "__main__":
    main()
