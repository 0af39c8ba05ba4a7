"""ImageNet-style classification training, written the way the reference scripts are.

The habits of the torchvision / pytorch-examples ImageNet scripts: ``mp.spawn``
of one worker per device, each calling its own
``dist.init_process_group(backend, init_method="tcp://...", world_size, rank)``
(no ``pygraph_dist.init()``); a ResNet (torchvision's ``resnet18`` when
torchvision imports, else a small ResNet defined here); SGD with momentum and
``StepLR``; the loss computed outside the model (``criterion(output, target)``);
top-1/top-5 accuracy from the logits and ``loss.item()`` every step;
``zero_grad()`` between the forward and the backward; ``validate()`` every
epoch under ``model.eval()`` + ``torch.no_grad()``; ``torch.save`` of a
checkpoint every epoch (rank 0) and ``--resume`` from it.

Only the line that creates DDP differs (``--mode``):

    python examples/scripts/imagenet_ref.py --mode ddp --world-size 1
    python examples/scripts/imagenet_ref.py --mode pgd --world-size 1
    python examples/scripts/imagenet_ref.py --mode pgd --world-size 1 --epochs 4 --resume out-imagenet/checkpoint.pth.tar

Data: a synthetic image set (labels from a fixed random teacher), so nothing
is downloaded. ``--out-dir`` receives ``result_rank<r>.json`` (per-step
losses and accuracies, validation per epoch, checksums, ms/it,
``pgd.report()``), ``final_params.pt`` and ``checkpoint.pth.tar`` (rank 0).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import asdict
from pathlib import Path

import torch
import torch.backends.cudnn as cudnn
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch.optim.lr_scheduler import StepLR
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


# ----------------------------------------------------------------------------- data
class SyntheticImages(Dataset):
    """``n`` images of 3 x size x size; the label is a fixed random linear
    teacher's choice on 4x4-pooled pixels (learnable, the same in every process)."""

    def __init__(self, n: int, size: int, classes: int, seed: int) -> None:
        self.n, self.size, self.seed = n, size, seed
        self.teacher = torch.randn(3 * 16, classes, generator=torch.Generator().manual_seed(12345))

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        image = torch.randn(3, self.size, self.size, generator=g)
        pooled = nn.functional.adaptive_avg_pool2d(image, 4).reshape(-1)
        return image, int((pooled @ self.teacher).argmax())


# ----------------------------------------------------------------------------- model
class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        return self.relu(self.bn2(self.conv2(out)) + identity)


class SmallResNet(nn.Module):
    """Three stages of basic blocks: a ResNet small enough for a CPU."""

    def __init__(self, num_classes: int, widths=(16, 32, 64)) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, widths[0], 3, 1, 1, bias=False), nn.BatchNorm2d(widths[0]),
                                  nn.ReLU(inplace=True))
        blocks, cin = [], widths[0]
        for i, w in enumerate(widths):
            blocks.append(BasicBlock(cin, w, 1 if i == 0 else 2))
            cin = w
        self.layers = nn.Sequential(*blocks)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(cin, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(self.pool(self.layers(self.stem(x))), 1))


def build_model(arch: str, num_classes: int) -> nn.Module:
    if arch in ("auto", "resnet18"):
        try:
            import torchvision
            return torchvision.models.resnet18(num_classes=num_classes)
        except ImportError:
            if arch == "resnet18":
                raise
    return SmallResNet(num_classes)


def accuracy(output: torch.Tensor, target: torch.Tensor, topk=(1,)) -> list[torch.Tensor]:
    """Top-k accuracies (percent) of the logits."""
    with torch.no_grad():
        maxk, batch_size = max(topk), target.size(0)
        _, pred = output.topk(maxk, 1, True, True)
        pred = pred.t()
        correct = pred.eq(target.view(1, -1).expand_as(pred))
        return [correct[:k].reshape(-1).float().sum(0, keepdim=True).mul_(100.0 / batch_size) for k in topk]


# ----------------------------------------------------------------------------- script
def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mode", choices=["ddp", "pgd", "pgd_nographs"], default="pgd")
    p.add_argument("--arch", choices=["auto", "resnet18", "small"], default="auto",
                   help="auto: torchvision's resnet18 when torchvision imports, else the small ResNet")
    p.add_argument("--world-size", type=int, default=None, help="processes (default: GPUs, or 2 on a CPU)")
    p.add_argument("--dist-url", default=None, help="default: tcp://127.0.0.1:<a free port>")
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=32, help="total over all processes")
    p.add_argument("--train-samples", type=int, default=512)
    p.add_argument("--val-samples", type=int, default=128)
    p.add_argument("--image-size", type=int, default=32)
    p.add_argument("--num-classes", type=int, default=10)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--weight-decay", type=float, default=1e-4)
    p.add_argument("--lr-step", type=int, default=2, help="StepLR step_size in epochs")
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--resume", default="", help="path to a checkpoint to continue from")
    p.add_argument("--out-dir", default="out-imagenet")
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    os.makedirs(args.out_dir, exist_ok=True)
    torch.manual_seed(args.seed)
    ngpus = torch.cuda.device_count()
    args.world_size = args.world_size or ngpus or 2
    if args.dist_url is None:
        import socket
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            args.dist_url = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    mp.spawn(main_worker, nprocs=args.world_size, args=(args,))


def main_worker(gpu: int, args: argparse.Namespace) -> None:
    cuda = torch.cuda.is_available()
    cudnn.deterministic, cudnn.benchmark = True, False  # a spawned process starts with torch's defaults
    args.rank = gpu
    backend = "nccl" if cuda else "gloo"
    dist.init_process_group(backend=backend, init_method=args.dist_url, world_size=args.world_size,
                            rank=args.rank)
    device = torch.device("cuda", gpu) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(gpu)
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    model = build_model(args.arch, args.num_classes).to(device)
    batch_size = args.batch_size // args.world_size
    criterion = nn.CrossEntropyLoss().to(device)
    optimizer = torch.optim.SGD(model.parameters(), args.lr, momentum=args.momentum,
                                weight_decay=args.weight_decay)

    # ---- the line that differs ----------------------------------------------------------
    if args.mode == "ddp":
        model = nn.parallel.DistributedDataParallel(model, device_ids=[gpu] if cuda else None)
    else:
        import pygraph_dist as pgd
        model, optimizer = pgd.wrap(model, optimizer, graphs=args.mode == "pgd")
    # -------------------------------------------------------------------------------------
    scheduler = StepLR(optimizer, step_size=args.lr_step, gamma=0.1)

    start_epoch, best_acc1 = 0, 0.0
    if args.resume:
        checkpoint = torch.load(args.resume, map_location=device)
        start_epoch, best_acc1 = checkpoint["epoch"], checkpoint["best_acc1"]
        model.load_state_dict(checkpoint["state_dict"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        scheduler.load_state_dict(checkpoint["scheduler"])
        print(f"=> loaded checkpoint '{args.resume}' (epoch {start_epoch})")

    train_dataset = SyntheticImages(args.train_samples, args.image_size, args.num_classes, seed=1)
    val_dataset = SyntheticImages(args.val_samples, args.image_size, args.num_classes, seed=2)
    train_sampler = DistributedSampler(train_dataset, seed=args.seed)
    val_sampler = DistributedSampler(val_dataset, shuffle=False, drop_last=True)
    train_loader = DataLoader(train_dataset, batch_size=batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=cuda)
    val_loader = DataLoader(val_dataset, batch_size=batch_size, sampler=val_sampler,
                            num_workers=args.workers, pin_memory=cuda)

    log: dict = {"steps": [], "val": [], "epoch_ms_per_iter": []}
    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        train(train_loader, model, criterion, optimizer, epoch, device, log)
        acc1 = validate(val_loader, model, criterion, device, log)
        scheduler.step()
        is_best, best_acc1 = acc1 > best_acc1, max(acc1, best_acc1)
        if args.rank == 0:
            torch.save({"epoch": epoch + 1, "arch": args.arch, "state_dict": model.state_dict(),
                        "best_acc1": best_acc1, "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict()},
                       Path(args.out_dir, "checkpoint.pth.tar"))
            if is_best:
                print(f"epoch {epoch}: best top-1 so far {best_acc1:.2f}")
    write_result(args, model, log)
    dist.destroy_process_group()


def train(loader, model, criterion, optimizer, epoch, device, log) -> None:
    model.train()
    end = None
    for i, (images, target) in enumerate(loader):
        if i == 1:  # time from the second batch: the first includes loader start-up
            if device.type == "cuda":
                torch.cuda.synchronize()
            end = time.perf_counter()
        images = images.to(device, non_blocking=True)
        target = target.to(device, non_blocking=True)
        output = model(images)
        loss = criterion(output, target)
        acc1, acc5 = accuracy(output, target, topk=(1, 5))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        log["steps"].append([loss.item(), acc1.item(), acc5.item()])
        if i % 4 == 0 and dist.get_rank() == 0:
            print(f"Epoch: [{epoch}][{i}/{len(loader)}] loss {log['steps'][-1][0]:.4f} "
                  f"acc@1 {log['steps'][-1][1]:.1f} acc@5 {log['steps'][-1][2]:.1f}")
    if end is not None and len(loader) > 1:
        if device.type == "cuda":
            torch.cuda.synchronize()
        log["epoch_ms_per_iter"].append((time.perf_counter() - end) * 1e3 / (len(loader) - 1))


def validate(loader, model, criterion, device, log) -> float:
    """Loss, top-1 and top-5 over the validation set, summed over ranks."""
    model.eval()
    totals = torch.zeros(4, dtype=torch.float64, device=device)  # loss*n, correct@1, correct@5, n
    with torch.no_grad():
        for images, target in loader:
            images = images.to(device, non_blocking=True)
            target = target.to(device, non_blocking=True)
            output = model(images)
            loss = criterion(output, target)
            acc1, acc5 = accuracy(output, target, topk=(1, 5))
            n = images.size(0)
            totals += torch.stack([loss.double() * n, acc1[0].double() * n / 100, acc5[0].double() * n / 100,
                                   torch.tensor(float(n), dtype=torch.float64, device=device)])
    dist.all_reduce(totals)
    loss, c1, c5, n = totals.tolist()
    log["val"].append({"loss": loss / n, "top1": 100 * c1 / n, "top5": 100 * c5 / n})
    if dist.get_rank() == 0:
        print(f" * Acc@1 {100 * c1 / n:.3f} Acc@5 {100 * c5 / n:.3f} loss {loss / n:.4f}")
    return 100 * c1 / n


def write_result(args, model, log) -> None:
    """``result_rank<r>.json`` and, from rank 0, ``final_params.pt`` (parameters, then buffers)."""
    inner = model.module
    params = torch.cat([p.detach().float().reshape(-1).cpu() for p in inner.parameters()])
    buffers = torch.cat([b.detach().float().reshape(-1).cpu() for b in inner.buffers()])
    result = {"mode": args.mode, "rank": args.rank, "world_size": args.world_size, "resumed": bool(args.resume),
              **log, "param_sum": float(params.double().sum()),
              "param_abs_sum": float(params.double().abs().sum()),
              "buffer_sum": float(buffers.double().sum()), "arch": type(inner).__name__,
              "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}
    if args.mode != "ddp":
        import pygraph_dist as pgd
        rep = pgd.report()
        result["report"] = asdict(rep.models[0]) if rep.models else None
        result["report_text"] = str(rep)
    out = Path(args.out_dir)
    if args.rank == 0:
        torch.save({"params": params, "buffers": buffers}, out / "final_params.pt")
    (out / f"result_rank{args.rank}.json").write_text(json.dumps(result, indent=1, default=str))


if __name__ == "__main__":
    main()
