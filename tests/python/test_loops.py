"""The loops people write, each run through pgd.wrap() and through torch DDP.

Every loop here is one a user would write for DDP: the loss outside the model,
gradient accumulation with and without ``no_sync()``, a step that ends early,
``clip_grad_norm_`` in the loop, a user-owned GradScaler, two losses summed,
modules returning dicts, tuples and Hugging Face-style outputs, SGD with
momentum, AdamW and an LR scheduler. The same function trains both models, so
any difference is the wrapper's. The case functions run in each rank
(``rank_main.py``); the tests assert on what they return.
"""

from __future__ import annotations

import contextlib
import copy
import re
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

import pygraph_dist as pgd
from common import device, flat_params

LOOPS = ["readme", "readme_clip", "outside", "outside_acc", "accum4", "accum4_nosync", "accum_ends_early",
         "clip", "scaler", "two_losses", "dict", "tuple", "hf", "regularizer", "dropout"]
# The tier each loop gets on a GPU: 1 (the whole iteration in one graph) when the
# loss comes out of the model call and the loop is one forward, backward and step;
# 2 (forward and backward graphs per micro-batch, the user's code between them,
# the step graph at optimizer.step()) for the other loops DDP accepts; 3 (eager,
# as written, with the reason in report()) when the loss reaches parameters
# other than through the model call's outputs.
# readme_clip: clip_grad_norm_(model.parameters(), c) moves into the step graph (clip_route.py).
TIERS = {"readme": "1", "readme_clip": "1", "dict": "1", "hf": "1", "regularizer": "3"}  # the rest: "2"


# ------------------------------------------------------------------ models
class Body(nn.Module):
    def __init__(self, width=32, classes=5):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.LayerNorm(width),
                                  nn.Linear(width, width), nn.GELU())
        self.head = nn.Linear(width, classes)

    def logits(self, x):
        return self.head(self.body(x))


class Logits(Body):
    def forward(self, x):
        return self.logits(x)


class DropoutLogits(Body):
    """Random numbers inside the graphs: masks must match graphs=False bitwise."""

    def __init__(self):
        super().__init__()
        self.drop = nn.Dropout(0.2)

    def forward(self, x):
        return self.head(self.drop(self.body(x)))


class WithLoss(Body):
    def forward(self, x, y):
        return F.cross_entropy(self.logits(x), y)


class DictOut(Body):
    def forward(self, x, y):
        logits = self.logits(x)
        return {"loss": F.cross_entropy(logits, y), "logits": logits}


class TupleOut(Body):
    def forward(self, x):
        logits = self.logits(x)
        return logits, 1e-3 * logits.pow(2).mean()


@dataclass
class Output:
    """Shaped like a Hugging Face ModelOutput where transformers is not installed."""

    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None


def hf_output_class():
    try:
        from transformers.modeling_outputs import SequenceClassifierOutput
        return SequenceClassifierOutput
    except ImportError:
        return Output


class HFOut(Body):
    def forward(self, x, labels=None):
        logits = self.logits(x)
        loss = F.cross_entropy(logits, labels) if labels is not None else None
        return hf_output_class()(loss=loss, logits=logits)


class _PassThroughMode(torch.overrides.TorchFunctionMode):
    """A torch-function mode that changes nothing (as a library's or a profiler's)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


MODELS = {"readme": WithLoss, "readme_clip": WithLoss, "dict": DictOut, "tuple": TupleOut, "hf": HFOut, "dropout": DropoutLogits}


# ------------------------------------------------------------------- loops
def batch(step, rank, dev, n=16, width=32, classes=5):
    g = torch.Generator().manual_seed(1000 * rank + step)
    return (torch.randn(n, width, generator=g).to(dev),
            torch.randint(0, classes, (n,), generator=g).to(dev))


def train(model, opt, loop, steps, rank, dev, *, scheduler=None, scaler=None, autocast=None):
    """One loop, as a user writes it; the same code for DDP and pgd. Returns
    the logged losses (and accuracies where the loop computes them)."""
    log = []
    amp = autocast or torch.autocast(dev.type, enabled=False)
    for step in range(steps):
        x, y = batch(step, rank, dev)
        opt.zero_grad(set_to_none=True)
        if loop in ("accum4", "accum4_nosync", "accum_ends_early"):
            k = 3 if loop == "accum_ends_early" and step == steps - 1 else 4
            for i in range(k):
                xs, ys = x[4 * i:4 * i + 4], y[4 * i:4 * i + 4]
                sync = loop != "accum4_nosync" or i == k - 1
                ctx = model.no_sync() if not sync else contextlib.nullcontext()
                with ctx:
                    with amp:
                        loss = model(xs, ys) / k
                    loss.backward()
            opt.step()
            log.append(float(loss))
        else:
            with amp:
                if loop in ("readme", "readme_clip"):
                    loss = model(x, y)
                elif loop in ("outside", "outside_acc", "clip", "clip_varies", "clip_moded", "scaler", "dropout",
                              "log_first", "zero_late", "detach_first"):
                    out = model(x)
                    loss = F.cross_entropy(out, y)
                    if loop == "log_first" and step % 3 == 0:
                        log.append(("before backward", float(loss)))  # the loss read before backward()
                    elif loop == "zero_late":
                        opt.zero_grad()  # the tutorials' order: zero_grad() between the loss and backward()
                    elif loop == "detach_first":
                        early = loss.detach()  # nanoGPT's micro_losses.append(loss.detach()) before backward()
                elif loop == "regularizer":
                    out = model(x)
                    loss = F.cross_entropy(out, y) + 1e-3 * sum(p.pow(2).sum() for p in model.parameters())
                elif loop == "two_losses":
                    out = model(x)
                    loss = F.cross_entropy(out, y) + 0.1 * out.pow(2).mean()
                elif loop == "dict":
                    out = model(x, y)
                    loss = out["loss"]
                elif loop == "tuple":
                    logits, aux = model(x)
                    loss = F.cross_entropy(logits, y) + aux
                elif loop == "hf":
                    out = model(x, labels=y)
                    loss = out.loss
                else:
                    raise ValueError(loop)
            if scaler is not None:
                scaler.scale(loss).backward()
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                scaler.step(opt)
                scaler.update()
            else:
                loss.backward()
                norm = None
                if loop in ("clip", "readme_clip", "clip_varies"):
                    # clip_varies: every 7th step another max_norm (tier 2: that call eager)
                    c = 0.25 if loop == "clip_varies" and step % 7 == 6 else 0.5
                    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), c)
                elif loop == "clip_moded":  # under a torch-function mode of the user's: eager
                    with _PassThroughMode():
                        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
                opt.step()
            if loop in ("outside_acc", "dict", "hf"):
                logits = out if loop == "outside_acc" else (out["logits"] if loop == "dict" else out.logits)
                log.append((float(loss), float((logits.argmax(-1) == y).float().mean())))
            elif loop == "detach_first":
                log.append(float(early))
            elif loop in ("readme_clip", "clip", "clip_varies", "clip_moded"):  # the norm returned, as scripts log it
                log.append((float(loss), float(norm)))
            else:
                log.append(float(loss))
        if loop == "outside_acc" and step % 10 == 5:
            model.eval()  # an evaluation in the middle of training, as users do
            with torch.no_grad():
                o = model(x).float()
                log.append((float(o.sum()), float((o.argmax(-1) == y).float().mean())))
            model.train()
        if scheduler is not None:
            scheduler.step()
    return log


def _model_for(loop):
    if loop in ("accum4", "accum4_nosync", "accum_ends_early"):
        return WithLoss
    return MODELS.get(loop, Logits)


def _optimizer(params, name):
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    return torch.optim.AdamW(params, lr=1e-2)


# ------------------------------------------------------------------- cases
def loop_vs_ddp(loop="readme", optimizer="adamw", steps=6, scheduler=0, amp="fp32", graphs=1, loss_graphs=1):
    """Rank body: ``loop`` through pgd.wrap() (graphs on or off) and through DDP."""
    pgd.init()
    rank = dist.get_rank()
    dev = device()
    torch.manual_seed(0)
    base = _model_for(loop)().to(dev)
    ref_model = nn.parallel.DistributedDataParallel(copy.deepcopy(base))

    def run(model, opt, wrapped):
        torch.manual_seed(1)  # the same dropout masks for DDP and pgd
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5) if scheduler else None
        scaler = autocast = None
        if loop == "scaler":
            scaler = torch.amp.GradScaler(dev.type, init_scale=2.0 ** 10)
            if dev.type == "cuda":
                autocast = torch.autocast("cuda", dtype=torch.float16)
        elif amp == "bf16" and not wrapped:
            autocast = torch.autocast(dev.type, dtype=torch.bfloat16, cache_enabled=False)
        return train(model, opt, loop, steps, rank, dev, scheduler=sched, scaler=scaler, autocast=autocast)

    ref_opt = _optimizer(ref_model.parameters(), optimizer)
    if optimizer == "adamw" and dev.type == "cuda":
        # pgd makes AdamW capturable (lr as a device tensor); the reference does the same
        # so that both run the same kernels.
        for g in ref_opt.param_groups:
            g["capturable"] = True
            g["lr"] = torch.tensor(g["lr"], device=dev)
    initial = flat_params(base)
    ref_log = run(ref_model, ref_opt, False)

    model, opt = pgd.wrap(base, _optimizer(base.parameters(), optimizer), graphs=bool(graphs),
                          amp=None if amp == "fp32" else amp, loss_graphs=bool(loss_graphs))
    log = run(model, opt, True)
    rep = pgd.report().models[-1]
    return {
        "loop": loop,
        "max_param_diff": float((flat_params(model.module) - flat_params(ref_model.module)).abs().max()),
        "moved": float((flat_params(model.module) - initial).abs().max()),
        "params": flat_params(model.module).tolist() if dev.type == "cuda" else [],
        "log": log,
        "ref_log": ref_log,
        "tiers": [g.tier for g in rep.graphs if g.tier != "eval"],  # evaluation entries apart
        "phases": [g.phase for g in rep.graphs],
        "replays": rep.replays,
        "loop_verdict": rep.loop,
        "report": str(pgd.report()),
    }


# On the CPU everything is fp32, and accumulation without no_sync reduces every
# backward in both DDP and pgd: the same arithmetic up to rounding.
CPU_TOLERANCE = 1e-5


@pytest.mark.parametrize("loop", LOOPS)
def test_every_loop_trains_like_ddp_on_cpu(ranks, loop):
    optimizer = "sgd" if loop in ("clip", "accum4_nosync", "tuple") else "adamw"
    for r in ranks("test_loops:loop_vs_ddp", timeout=240,
                   kwargs={"loop": loop, "optimizer": optimizer, "scheduler": int(loop == "outside")}):
        assert r["moved"] > 1e-3, "the loop did not train"
        assert r["max_param_diff"] < CPU_TOLERANCE, (loop, r["max_param_diff"], r["report"])
        got = [x[0] if isinstance(x, list) else x for x in r["log"]]
        want = [x[0] if isinstance(x, list) else x for x in r["ref_log"]]
        assert got == pytest.approx(want, rel=1e-4, abs=1e-6), (loop, got, want)
        if loop in ("outside_acc", "dict", "hf"):
            assert [x[1] for x in r["log"]] == [x[1] for x in r["ref_log"]]  # the logits reached the user
        assert r["tiers"] and all(t == "3" for t in r["tiers"]), r["report"]  # no CUDA graphs on a CPU
        if loop == "regularizer":
            assert "reaches model parameters directly" in r["loop_verdict"], r["loop_verdict"]
        if loop == "readme_clip":  # the clip is part of a loop fit for tier 1, its norm returned
            assert r["loop_verdict"].startswith("conforms"), r["loop_verdict"]
            assert [x[1] for x in r["log"]] == pytest.approx([x[1] for x in r["ref_log"]], rel=1e-4)


def test_graphs_false_never_raises_a_loop_error(ranks):
    """Accumulation with graphs=False used to raise LoopConformanceError."""
    for r in ranks("test_loops:loop_vs_ddp", timeout=240,
                   kwargs={"loop": "accum4", "graphs": 0, "steps": 8}):
        assert r["max_param_diff"] < 1e-5, r["report"]
        assert "graphs are disabled" in r["report"] or "CPU-only" in r["report"] or "no CUDA device" in r["report"]


def clip_pair(steps=30):
    """Rank body: the loop with clip_grad_norm_ and the loss from the model,
    graphed and with graphs=False, each against DDP."""
    kw = {"loop": "readme_clip", "optimizer": "adamw", "steps": steps}
    return {"graphed": loop_vs_ddp(**kw, graphs=1), "eager": loop_vs_ddp(**kw, graphs=0)}


@pytest.mark.gpu
def test_the_users_clip_moves_into_the_step_graph(ranks):
    """clip_grad_norm_(model.parameters(), c) between backward and step: tier 1,
    the clip inside the step graph, bitwise equal to graphs=False -- the
    parameters and every norm the call returned."""
    (r,) = ranks("test_loops:clip_pair", world_size=1, timeout=300)
    g, e = r["graphed"], r["eager"]
    assert g["tiers"][:1] == ["1"] and g["replays"] > 20, g["report"]
    assert "your clip_grad_norm_(max_norm=0.5) inside the step graph" in g["loop_verdict"], g["loop_verdict"]
    assert g["params"] == e["params"], g["report"]
    assert g["log"] == e["log"], (g["log"][:4], e["log"][:4])
    norms = [x[1] for x in g["log"]]
    assert max(norms) > 0.5, norms  # the clip changed gradients
    assert norms == pytest.approx([x[1] for x in g["ref_log"]], rel=1e-4)
    assert g["max_param_diff"] < 1e-4, g["max_param_diff"]


def clip_pair_tier2(loop="clip", steps=30):
    """Rank body: the loss outside the model and clip_grad_norm_ between backward
    and step (tier 2), graphed and with graphs=False, each against DDP."""
    kw = {"loop": loop, "optimizer": "sgd", "steps": steps}
    return {"graphed": loop_vs_ddp(**kw, graphs=1), "eager": loop_vs_ddp(**kw, graphs=0)}


@pytest.mark.gpu
def test_a_clip_never_captured_says_why_in_the_report(ranks):
    """Tier 2 with the clip under a torch-function mode of the user's every step:
    torch's clip runs eagerly where it is written (bitwise like graphs=False),
    and report() says so and why, rather than nothing."""
    (r,) = ranks("test_loops:clip_pair_tier2", world_size=1, timeout=300, kwargs={"loop": "clip_moded"})
    g, e = r["graphed"], r["eager"]
    assert g["tiers"][:1] == ["2"] and g["replays"] > 20, g["report"]
    assert "your clip_grad_norm_ eager between the graphs (" in g["loop_verdict"], g["loop_verdict"]
    assert "torch-function or dispatch mode" in g["loop_verdict"], g["loop_verdict"]
    assert g["params"] == e["params"], g["report"]
    assert g["log"] == e["log"], (g["log"][:4], e["log"][:4])


@pytest.mark.gpu
@pytest.mark.parametrize("loop", ["clip", "clip_varies"])
def test_the_users_clip_is_a_graph_of_its_own_in_tier_2(ranks, loop):
    """Tier 2 (the loss outside the model): the same clip_grad_norm_ captured once
    as a graph of its own and replayed at the call (split_clip.py), bitwise
    equal to graphs=False -- the parameters and every norm the call returned.
    clip_varies: a call with another max_norm runs torch's, eagerly."""
    (r,) = ranks("test_loops:clip_pair_tier2", world_size=1, timeout=300, kwargs={"loop": loop})
    g, e = r["graphed"], r["eager"]
    assert g["tiers"][:1] == ["2"] and g["replays"] > 20, g["report"]
    m = re.search(r"your clip_grad_norm_\(max_norm=0.5\) a graph of its own \((\d+) replays(, (\d+) calls eager)?\)",
                  g["loop_verdict"])
    assert m and int(m.group(1)) > 15, g["loop_verdict"]
    if loop == "clip_varies":
        assert m.group(3) and int(m.group(3)) >= 3, g["loop_verdict"]
    assert g["params"] == e["params"], g["report"]
    assert g["log"] == e["log"], (g["log"][:4], e["log"][:4])
    norms = [x[1] for x in g["log"]]
    assert max(norms[5:]) > 0.5, norms  # the clip changed gradients in replayed steps (5: probe, warm-up)
    assert norms == pytest.approx([x[1] for x in g["ref_log"]], rel=1e-4)


# Tier-2 loops whose loss the "lane" graph computes (loss_lane.py), and the
# fewest steps it must have computed; log_first reads the loss before backward()
# every third step, which computes that step's loss eagerly.
LANE_LOOPS = {"outside": 20, "outside_acc": 20, "two_losses": 20, "tuple": 20, "scaler": 20,
              "dropout": 20, "clip": 20, "zero_late": 20, "detach_first": 20, "log_first": 12}


def lane_loops(steps=30):
    """Rank body: the tier-2 loops with the loss lane, with graphs=False, and
    (for "outside") with loss_graphs=False, each against DDP."""
    out = {}
    for loop in LANE_LOOPS:
        optimizer = "sgd" if loop in ("clip", "tuple") else "adamw"
        kw = {"loop": loop, "optimizer": optimizer, "steps": steps, "scheduler": int(loop == "outside")}
        out[loop] = {"graphed": loop_vs_ddp(**kw, graphs=1), "eager": loop_vs_ddp(**kw, graphs=0)}
        if loop == "outside":
            out[loop]["no_lane"] = loop_vs_ddp(**kw, graphs=1, loss_graphs=0)
    return out


@pytest.mark.gpu
def test_the_loss_outside_the_model_runs_inside_the_backward_graph(ranks):
    """Tier 2's loss lane: the loop's own loss, learned in the warm-up, computed
    by the backward graph at loss.backward() -- bitwise equal to graphs=False
    (the parameters and every loss the loop logged, also one read before
    backward()), and report() says where the loss ran."""
    (r,) = ranks("test_loops:lane_loops", world_size=1, timeout=580)
    failures = []
    for loop, least in LANE_LOOPS.items():
        g, e = r[loop]["graphed"], r[loop]["eager"]
        m = re.search(r"your loss \(([^)]*)\) inside the backward graph \((\d+) steps", g["loop_verdict"])
        checks = {
            "tier 2": g["tiers"][:1] == ["2"] and g["replays"] > 20,
            "bitwise equal to graphs=False": g["params"] == e["params"],
            "the same logged losses": g["log"] == e["log"],
            f"the loss in the graph >= {least} steps": m is not None and int(m.group(2)) >= least,
        }
        if loop == "outside":
            # zero_grad() came before the model call that captured: that step's
            # loss ran in the lane too (the capture leaves .grad None, as it found it).
            checks["the capture step in the lane"] = "gradients were present" not in g["loop_verdict"]
        if loop == "log_first":
            checks["the early read said"] = ("steps eager: the loss was read before backward() (float(loss))"
                                             in g["loop_verdict"])
        failures += [f"{loop}: not {what}\n{g['loop_verdict']}\n{g['report']}" for what, ok in checks.items() if not ok]
    n = r["outside"]["no_lane"]
    if n["params"] != r["outside"]["eager"]["params"] or "your loss (" in n["loop_verdict"]:
        failures.append(f"outside, loss_graphs=False: not bitwise / still in the graph\n{n['loop_verdict']}")
    assert not failures, "\n".join(failures)


def all_loops(amp="fp32", steps=30):
    """Rank body for the GPU matrix: every loop, graphed and with graphs=False,
    each against DDP, in one process (one NCCL start-up instead of 46)."""
    out = {}
    for loop in LOOPS:
        if loop == "scaler" and amp == "bf16":
            continue  # the user's GradScaler loop is an fp16 loop
        optimizer = "sgd" if loop in ("clip", "accum4_nosync", "tuple") else "adamw"
        kw = {"loop": loop, "optimizer": optimizer, "amp": amp, "steps": steps,
              "scheduler": int(loop == "outside")}
        out[loop] = {"graphed": loop_vs_ddp(**kw, graphs=1), "eager": loop_vs_ddp(**kw, graphs=0)}
    if amp == "fp32":
        # amp="fp16" (pgd's own scaler) with the loss outside: the backward graph
        # scales the outputs' gradients. Against graphs=False only (DDP runs fp32 here).
        kw = {"loop": "outside", "optimizer": "adamw", "amp": "fp16", "steps": steps}
        out["outside@fp16"] = {"graphed": loop_vs_ddp(**kw, graphs=1), "eager": loop_vs_ddp(**kw, graphs=0)}
    return out


@pytest.mark.multigpu
@pytest.mark.parametrize("amp", ["fp32", "bf16"])
def test_every_loop_on_gpus(ranks, amp):
    """2 GPUs: the tier each loop gets, bitwise equal to the same loop with
    graphs=False, and within rounding of torch DDP."""
    failures = []
    for r in ranks("test_loops:all_loops", timeout=580, kwargs={"amp": amp}):
        for loop, pair in r.items():
            g, e = pair["graphed"], pair["eager"]
            want_tier = TIERS.get(loop, "2")
            # "@fp16" rows are compared with graphs=False only (their DDP reference runs fp32).
            tol = float("inf") if "@" in loop else (5e-2 if amp == "bf16" else 1e-4)
            checks = {
                "bitwise equal to graphs=False": g["params"] == e["params"],
                f"tier {want_tier}": g["tiers"][:1] == [want_tier],
                "replayed": want_tier == "3" or g["replays"] > 20,
                "within rounding of DDP": g["max_param_diff"] < tol,
                "trained": g["moved"] > 1e-3,
            }
            failures += [f"{loop}/{amp}: not {what} (tiers {g['tiers']}, diff vs DDP "
                         f"{g['max_param_diff']:.3g})\n{g['report']}"
                         for what, ok in checks.items() if not ok]
    assert not failures, "\n".join(failures)
