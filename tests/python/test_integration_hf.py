"""Hugging Face integration (``pygraph_dist.integrations.hf``): an Accelerate loop
with ``PGDAccelerator`` and ``transformers.Trainer`` as ``PGDTrainer``.

CPU (2 Gloo ranks): each trains like the framework's own DDP within fp32
rounding, and the report shows the tier. One GPU: graphs replay (tier 1 or 2)
and training is bitwise that of the same integration with ``graphs=False``.
The loops are the examples' own (``examples/accelerate_loop.py``,
``examples/hf_trainer.py``), so the examples are what is tested.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))
# What the rank bodies import: the rank server imports it once (tests/python/rank_server.py).
RANK_PRELOAD = ("accelerate", "transformers.trainer", "accelerate_loop", "hf_trainer", "pygraph_dist.integrations.hf")

CPU_TOLERANCE = 1e-5  # fp32 on the CPU: our reducer against DDP's, the same arithmetic up to rounding


def _report(model_index: int = -1) -> dict:
    import pygraph_dist as pgd

    rep = pgd.report().models[model_index]
    train = [g for g in rep.graphs if g.tier != "eval"]  # evaluation calls have graphs of their own
    return {"tiers": [g.tier for g in train], "phases": [g.phase for g in train],
            "replays": rep.replays, "eval_calls": rep.eval_calls, "eval_replays": rep.eval_replays,
            "loop": rep.loop, "model": rep.model, "text": str(pgd.report(verbose=True))}


def _losses(history: list[dict], key: str) -> list[float]:
    return [e[key] for e in history if key in e]


# --------------------------------------------------------------- Accelerate
def accelerate_vs_stock(steps: int = 6, clip_in_graph: int = 0):
    """Rank body: the example's Accelerate loop with accelerate.Accelerator (DDP),
    then with PGDAccelerator, in one process group (fp32, Gloo). clip_in_graph:
    PGDAccelerator(max_grad_norm=1.0), the loop's own accelerator.clip_grad_norm_
    value, clipped inside the optimizer step."""
    from accelerate import Accelerator
    from accelerate_loop import run

    import pygraph_dist as pgd
    from pygraph_dist.integrations.hf import PGDAccelerator

    pgd.init()
    kw = dict(steps=steps, batch=4, seq=32, layers=2, width=64, vocab=128, log_every=2)
    stock = run(Accelerator(cpu=True, gradient_accumulation_steps=2), **kw)
    accelerator = PGDAccelerator(cpu=True, gradient_accumulation_steps=2,
                                 **({"max_grad_norm": 1.0} if clip_in_graph else {}))
    ours = run(accelerator, **kw)
    step_clips = next(m for m in accelerator._models if type(m).__name__ == "GraphedModule").engine.step.max_grad_norm
    initial = torch.cat([p.detach().reshape(-1) for p in __import__("accelerate_loop").make_model(
        2, 64, 128, 32).parameters()])
    return {
        "max_param_diff": float((ours["params"] - stock["params"]).abs().max()),
        "moved": float((ours["params"] - initial).abs().max()),
        "logged": ours["logged"], "stock_logged": stock["logged"],
        "eval_loss": ours["eval_loss"], "stock_eval_loss": stock["eval_loss"],
        "steps": ours["steps"], "prepared": ours["prepared"], "stock_prepared": stock["prepared"],
        "step_clips": step_clips, **_report(),
    }


@pytest.mark.parametrize("clip_in_graph", [False, True])
def test_accelerate_loop_trains_like_ddp_on_cpu(ranks, clip_in_graph):
    for r in ranks("test_integration_hf:accelerate_vs_stock", timeout=240,
                   kwargs={"clip_in_graph": int(clip_in_graph)}):
        # in the graph: the step clips (once: the parameters below match DDP's clipped run)
        assert r["step_clips"] == (1.0 if clip_in_graph else None)
        assert r["prepared"] == "GraphedModule" and r["stock_prepared"] == "DistributedDataParallel"
        assert r["steps"] == 6 and r["moved"] > 1e-3, "the loop did not train"
        assert r["max_param_diff"] < CPU_TOLERANCE, (r["max_param_diff"], r["text"])
        assert r["logged"] == pytest.approx(r["stock_logged"], rel=1e-5), (r["logged"], r["stock_logged"])
        assert r["eval_loss"] == pytest.approx(r["stock_eval_loss"], rel=1e-5)
        assert r["model"] == "GPT2LMHeadModel"
        assert r["tiers"] and all(t == "3" for t in r["tiers"]), r["text"]  # no CUDA graphs on a CPU
        assert "GPT2LMHeadModel (rank" in r["text"] and "tier" in r["text"]


def accelerate_graphed_vs_eager(steps: int = 24):
    """Rank body (one GPU): the Accelerate loop, bf16, graphed, with graphs=False,
    and with the stock Accelerator."""
    from accelerate import Accelerator
    from accelerate_loop import run

    import pygraph_dist as pgd
    from pygraph_dist.integrations.hf import PGDAccelerator

    pgd.init()
    kw = dict(steps=steps, batch=8, seq=64, layers=2, width=128, vocab=512, log_every=2)
    graphed = run(PGDAccelerator(mixed_precision="bf16", gradient_accumulation_steps=2), **kw)
    rep = _report()
    eager = run(PGDAccelerator(mixed_precision="bf16", gradient_accumulation_steps=2, graphs=False), **kw)
    stock = run(Accelerator(mixed_precision="bf16", gradient_accumulation_steps=2), **kw)
    return {"bitwise": bool(torch.equal(graphed["params"], eager["params"])),
            "max_diff": float((graphed["params"] - eager["params"]).abs().max()),
            "logged": graphed["logged"], "eager_logged": eager["logged"], "stock_logged": stock["logged"],
            "eval_loss": graphed["eval_loss"], "eager_eval_loss": eager["eval_loss"],
            "first_loss": graphed["first_loss"], "stock_first_loss": stock["first_loss"], **rep}


@pytest.mark.gpu
def test_accelerate_loop_replays_graphs_bitwise_like_graphs_false(ranks):
    r, = ranks("test_integration_hf:accelerate_graphed_vs_eager", world_size=1, timeout=400)
    assert r["tiers"] and r["tiers"][0] in ("1", "2"), r["text"]
    assert r["phases"][0] == "replay" and r["replays"] >= 12, r["text"]
    assert r["bitwise"], (r["max_diff"], r["text"])
    assert r["logged"] == r["eager_logged"] and r["eval_loss"] == r["eager_eval_loss"]
    # Accelerate's own bf16 autocast runs inside the graphed forward: the first loss
    # (same weights, before any step) is bitwise the stock Accelerator's. Later
    # losses differ by the optimizer's rounding only (AdamW made capturable).
    assert r["first_loss"] == r["stock_first_loss"], (r["first_loss"], r["stock_first_loss"])
    assert r["logged"] == pytest.approx(r["stock_logged"], rel=2e-2), (r["logged"], r["stock_logged"])


# ------------------------------------------------------------------ Trainer
def trainer_vs_stock(steps: int = 6, accum: int = 2):
    """Rank body: the example's Trainer run with transformers.Trainer (DDP), then
    with PGDTrainer: gradient_accumulation_steps=2 (``accum``), max_grad_norm=1.0,
    a linear schedule, logging every 2 steps and evaluation every 3 (fp32, Gloo)."""
    from hf_trainer import run

    import pygraph_dist as pgd

    pgd.init()  # before TrainingArguments: Accelerate then uses this process group
    kw = dict(steps=steps, batch=4, seq=32, layers=2, width=64, vocab=128, accum=accum, logging_steps=2,
              eval_steps=3)
    said: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            said.append(record.getMessage())

    log = logging.getLogger("pygraph_dist")
    log.addHandler(Keep(logging.INFO))
    level, log.level = log.level, logging.INFO
    with tempfile.TemporaryDirectory() as out:
        stock = run(True, out, **kw)
        ours = run(False, out, **kw)
    log.setLevel(level)
    return {
        "max_param_diff": float((ours["params"] - stock["params"]).abs().max()),
        "loss": _losses(ours["log_history"], "loss"), "stock_loss": _losses(stock["log_history"], "loss"),
        "eval": _losses(ours["log_history"], "eval_loss"),
        "stock_eval": _losses(stock["log_history"], "eval_loss"),
        "grad_norm": _losses(ours["log_history"], "grad_norm"),
        "stock_grad_norm": _losses(stock["log_history"], "grad_norm"),
        "prepared": ours["prepared"], "stock_prepared": stock["prepared"],
        "token_hint": [m for m in said if "average_tokens_across_devices" in m],
        **_report(),
    }


def test_trainer_trains_like_ddp_on_cpu(ranks):
    ranks_results = ranks("test_integration_hf:trainer_vs_stock", timeout=240)
    for r in ranks_results:
        assert r["prepared"] == "GraphedModule" and r["stock_prepared"] == "DistributedDataParallel"
        assert len(r["loss"]) == 3 and len(r["eval"]) == 2, (r["loss"], r["eval"])
        assert r["max_param_diff"] < CPU_TOLERANCE, (r["max_param_diff"], r["text"])
        assert r["loss"] == pytest.approx(r["stock_loss"], rel=1e-5)
        assert r["eval"] == pytest.approx(r["stock_eval"], rel=1e-5)
        assert r["grad_norm"] == pytest.approx(r["stock_grad_norm"], rel=1e-4)  # clipping saw the same norms
        assert r["tiers"] and all(t == "3" for t in r["tiers"]), r["text"]
        # max_grad_norm clips inside the optimizer step (PGDAccelerator.clip_grad_norm_), not between graphs
        assert "clip_grad_norm_" not in r["loop"], r["loop"]
    # 2 processes: the Trainer's loss *= 2 (average_tokens_across_devices) is the same number at
    # every step, which a tier-1 graph seeds its backward with: not a reason against tier 1 on any
    # rank (this loop accumulates 2 micro-batches, which is: tier 2).
    for r in ranks_results:
        assert "tensor other than the loss" not in r["loop"] and "accumulation" in r["loop"], r["text"]
        assert not r["token_hint"], r["token_hint"]


def test_trainer_at_two_processes_fits_tier_1(ranks):
    """One micro-batch per step at 2 processes: the Trainer's ``loss *= 2`` keeps
    the loop fit for one graph per iteration (the probe's verdict; graphs need a GPU)."""
    for r in ranks("test_integration_hf:trainer_vs_stock", timeout=240, kwargs={"accum": 1}):
        assert r["loop"].startswith("conforms"), r["text"]
        assert r["max_param_diff"] < CPU_TOLERANCE and r["loss"] == pytest.approx(r["stock_loss"], rel=1e-5)


def trainer_graphed_vs_eager(steps: int = 24, accum: int = 2):
    """Rank body (one GPU): PGDTrainer with bf16=True, graphed and with graphs=False."""
    from hf_trainer import run

    import pygraph_dist as pgd

    pgd.init()
    kw = dict(steps=steps, batch=8, seq=64, layers=2, width=128, vocab=512, accum=accum, logging_steps=4,
              eval_steps=12)
    with tempfile.TemporaryDirectory() as out:
        graphed = run(False, out, **kw)
        rep = _report()
        eager = run(False, out, wrap_options={"graphs": False}, **kw)
    return {"bitwise": bool(torch.equal(graphed["params"], eager["params"])),
            "max_diff": float((graphed["params"] - eager["params"]).abs().max()),
            "loss": _losses(graphed["log_history"], "loss"), "eager_loss": _losses(eager["log_history"], "loss"),
            "eval": _losses(graphed["log_history"], "eval_loss"),
            "eager_eval": _losses(eager["log_history"], "eval_loss"),
            "grad_norm": _losses(graphed["log_history"], "grad_norm"),
            "eager_grad_norm": _losses(eager["log_history"], "grad_norm"), **rep}


@pytest.mark.gpu
@pytest.mark.parametrize("accum", [2, 1])
def test_trainer_replays_graphs_bitwise_like_graphs_false(ranks, accum):
    """accum=2: tier 2 (micro-batches); accum=1: tier 1 (Accelerate's loss / 1 is the
    loss's own backward, max_grad_norm clips inside the graph)."""
    r, = ranks("test_integration_hf:trainer_graphed_vs_eager", world_size=1, timeout=400,
               kwargs={"accum": accum})
    assert r["tiers"] and r["tiers"][0] == ("2" if accum == 2 else "1"), r["text"]
    assert r["phases"][0] == "replay" and r["replays"] >= 12, r["text"]
    assert r["bitwise"], (r["max_diff"], r["text"])
    assert r["loss"] == r["eager_loss"] and r["eval"] == r["eager_eval"] and len(r["eval"]) == 2
    # the norm the graph clipped with, logged by the Trainer after the step: that of graphs=False
    assert r["grad_norm"] == r["eager_grad_norm"] and all(n == n for n in r["grad_norm"]), r["grad_norm"]
    assert "autocast bf16 inside the model's forward" in r["text"], r["text"]


def trainer_resume(steps: int = 6):
    """Rank body: PGDTrainer saving a checkpoint half way, and a fresh PGDTrainer
    resuming from it (optimizer state, scheduler, RNG): the same final parameters."""
    import os

    from hf_trainer import TokenDataset, make_model, run, training_arguments

    import pygraph_dist as pgd
    from pygraph_dist.integrations.hf import PGDTrainer

    pgd.init()
    kw = dict(batch=4, logging_steps=2, eval_steps=3)
    with tempfile.TemporaryDirectory() as out:
        whole = run(False, out, steps=steps, seq=32, layers=2, width=64, vocab=128, save_strategy="steps",
                    save_steps=steps // 2, **kw)
        model = make_model(2, 64, 128, 32)
        trainer = PGDTrainer(model=model, args=training_arguments(out, steps=steps, **kw),
                             train_dataset=TokenDataset(steps * 2 * 4, 32, 128, seed=1),
                             eval_dataset=TokenDataset(16, 32, 128, seed=2))
        trainer.train(resume_from_checkpoint=os.path.join(out, f"checkpoint-{steps // 2}"))
        resumed = torch.cat([p.detach().float().reshape(-1) for p in model.parameters()])
    return {"max_diff": float((resumed - whole["params"]).abs().max()), **_report()}


def test_trainer_checkpoint_resume_on_cpu(ranks):
    r, = ranks("test_integration_hf:trainer_resume", world_size=1, timeout=240)
    assert r["max_diff"] < CPU_TOLERANCE, (r["max_diff"], r["text"])


def trainer_nan_filter(steps: int = 6):
    """Rank body: a loss that is infinite at two micro-batches (a constant added,
    so the gradients stay finite), with the Trainer's default
    logging_nan_inf_filter: stock Trainer against PGDTrainer, which applies the
    filter on the device (no host read of every loss) while training. Counts
    the Trainer loop's own torch.isnan calls (its host check) and what
    callbacks and evaluation see of the option."""
    import sys

    from hf_trainer import TokenDataset, make_model, training_arguments

    import pygraph_dist as pgd
    from pygraph_dist.integrations.hf import PGDTrainer
    from transformers import Trainer, TrainerCallback

    pgd.init()
    host_checks = [0]
    isnan = torch.isnan

    def counting_isnan(*args, **kwargs):
        if sys._getframe(1).f_code.co_name in ("_run_epoch", "_inner_training_loop"):
            host_checks[0] += 1
        return isnan(*args, **kwargs)

    def bumped(base):
        class Bumped(base):
            calls, seen_eval = 0, set()

            def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
                loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
                if model.training:
                    self.calls += 1
                    if self.calls in (3, 8):
                        loss = loss + float("inf")
                return loss

            def prediction_step(self, *args, **kwargs):
                self.seen_eval.add(self.args.logging_nan_inf_filter)
                return super().prediction_step(*args, **kwargs)
        return Bumped

    class Seen(TrainerCallback):
        def __init__(self):
            self.values = set()

        def on_train_begin(self, args, state, control, **kwargs):
            self.values.add(args.logging_nan_inf_filter)

        def on_step_end(self, args, state, control, **kwargs):
            self.values.add(args.logging_nan_inf_filter)

    out = {}
    torch.isnan = counting_isnan
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for name, base in (("stock", Trainer), ("ours", PGDTrainer)):
                host_checks[0] = 0
                seen = Seen()
                args = training_arguments(tmp, steps=steps, batch=4, accum=2, logging_steps=2, eval_steps=3)
                trainer = bumped(base)(model=make_model(2, 64, 128, 32), args=args, callbacks=[seen],
                                       train_dataset=TokenDataset(steps * 2 * 4, 32, 128, seed=1),
                                       eval_dataset=TokenDataset(8, 32, 128, seed=2))
                trainer.train()
                out[name] = {"loss": _losses(trainer.state.log_history, "loss"),
                             "eval": _losses(trainer.state.log_history, "eval_loss"),
                             "host_checks": host_checks[0], "micro_batches": trainer.calls,
                             "seen_callbacks": sorted(seen.values), "seen_eval": sorted(trainer.seen_eval),
                             "after": trainer.args.logging_nan_inf_filter}
    finally:
        torch.isnan = isnan
    return out


def test_trainer_filters_nonfinite_losses_on_the_device(ranks):
    r, = ranks("test_integration_hf:trainer_nan_filter", world_size=1, timeout=240)
    stock, ours = r["stock"], r["ours"]
    assert len(ours["loss"]) == 3 and all(v == v and abs(v) != float("inf") for v in ours["loss"]), r
    assert ours["loss"] == pytest.approx(stock["loss"], rel=1e-6), r  # the filter's averages, as the Trainer's
    assert ours["eval"] == pytest.approx(stock["eval"], rel=1e-6), r
    # the Trainer reads every micro-batch's loss on the host; PGDTrainer's loop never does
    assert stock["host_checks"] == stock["micro_batches"] == 12 and ours["host_checks"] == 0, r
    # callbacks, evaluation and train()'s caller see the option as set
    assert ours["seen_callbacks"] == [True] and ours["seen_eval"] == [True] and ours["after"] is True, r


def test_nan_filtered_is_the_trainers_rule():
    from transformers import Trainer

    from pygraph_dist.integrations._hf_nan_filter import fits, nan_filtered
    from pygraph_dist.integrations.hf import PGDTrainer

    class OwnStep(PGDTrainer):  # may change the loss after the filter: the host check stays
        def training_step(self, *args, **kwargs):
            return super().training_step(*args, **kwargs) * 1

    assert fits(Trainer, PGDTrainer, PGDTrainer) and not fits(Trainer, OwnStep, PGDTrainer)

    tr = torch.tensor(6.0)
    for loss, expected in ((torch.tensor(0.5), 0.5), (torch.tensor(float("nan")), 2.0),
                           (torch.tensor(float("-inf")), 2.0), (torch.tensor(1.5, dtype=torch.bfloat16), 1.5)):
        host = tr + (tr / 3 if (torch.isnan(loss) or torch.isinf(loss)) else loss)
        assert torch.equal(tr + nan_filtered(loss, tr, 3), host) and float(host) == 6.0 + expected


def prepare_rules():
    """Rank body: what PGDAccelerator.prepare refuses, and what it gives back."""
    from accelerate_loop import make_model

    import pygraph_dist as pgd
    from pygraph_dist.integrations.hf import PGDAccelerator

    pgd.init()
    accelerator = PGDAccelerator(cpu=True)
    out = {}
    try:
        accelerator.prepare(make_model(1, 64, 128, 32))
    except ValueError as e:
        out["alone"] = str(e)
    frozen = make_model(1, 64, 128, 32).requires_grad_(False)
    out["frozen_type"] = type(accelerator.prepare(frozen)).__name__  # nothing to train: Accelerate's own
    model = make_model(1, 64, 128, 32)
    wrapped, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    out["type"] = type(wrapped).__name__
    out["unwrapped_is_model"] = accelerator.unwrap_model(wrapped) is model
    out["state_dict_prefixed"] = any(k.startswith("module.") for k in accelerator.get_state_dict(wrapped))
    out["in_registry"] = [type(m).__name__ for m in accelerator._models]  # noqa: SLF001
    try:
        with accelerator.trigger_sync_in_backward(wrapped):
            pass
    except NotImplementedError as e:
        out["trigger"] = str(e)
    return out


def test_prepare_pairs_models_with_optimizers(ranks):
    r, = ranks("test_integration_hf:prepare_rules", world_size=1, timeout=120)
    assert "no optimizer in the same prepare() call" in r.get("alone", ""), r
    assert r["frozen_type"] == "GPT2LMHeadModel" and r["type"] == "GraphedModule", r
    assert r["unwrapped_is_model"] and not r["state_dict_prefixed"], r
    assert r["in_registry"] == ["GPT2LMHeadModel", "GraphedModule"], r  # the frozen one, then the wrapper
    assert "outside accelerator.no_sync" in r.get("trigger", ""), r


# ------------------------------------------------------- optional dependency
def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          cwd=str(ROOT))


def test_import_pygraph_dist_never_imports_hf():
    p = _python("import sys, pygraph_dist\n"
                "bad = [m for m in ('transformers', 'accelerate') if m in sys.modules]\n"
                "assert not bad, bad\nprint('ok')")
    assert p.returncode == 0 and "ok" in p.stdout, p.stderr


BLOCK = ("import sys\n"
         "class Block:\n"
         "    def find_spec(self, name, path=None, target=None):\n"
         "        if name.split('.')[0] in {names!r}:\n"
         "            raise ImportError(f'No module named {{name!r}} (blocked by the test)')\n"
         "sys.meta_path.insert(0, Block())\n")


@pytest.mark.parametrize("missing, statement", [
    (("accelerate", "transformers"), "import pygraph_dist.integrations.hf"),
    (("transformers",), "from pygraph_dist.integrations.hf import PGDTrainer"),
])
def test_missing_package_names_the_extra(missing, statement):
    p = _python(BLOCK.format(names=set(missing)) + statement)
    assert p.returncode != 0 and "ImportError" in p.stderr, p.stderr
    assert "pip install pygraph_dist[hf]" in p.stderr, p.stderr


def test_accelerator_without_transformers_imports():
    p = _python(BLOCK.format(names={"transformers"}) +
                "from pygraph_dist.integrations.hf import PGDAccelerator\nprint('ok')")
    assert p.returncode == 0 and "ok" in p.stdout, p.stderr


def clip_mismatch():
    """Rank body: PGDAccelerator(max_grad_norm=0.5) and a loop clipping at 1.0."""
    from accelerate_loop import run

    import pygraph_dist as pgd
    from pygraph_dist.integrations.hf import PGDAccelerator

    pgd.init()
    try:
        run(PGDAccelerator(cpu=True, max_grad_norm=0.5), steps=2, batch=2, seq=16, layers=1, width=32, vocab=64)
    except ValueError as exc:
        return {"error": str(exc)}
    return {"error": ""}


def clip_filtered(subset: int = 0):
    """Rank body: a model with a frozen parameter, the loop clipping the trainable
    ones (as LoRA loops do) -- with accelerate.Accelerator and with
    PGDAccelerator(max_grad_norm=1.0). subset: clip only part of them (refused)."""
    from accelerate import Accelerator

    import pygraph_dist as pgd
    from pygraph_dist.integrations.hf import PGDAccelerator

    pgd.init()

    def train(accelerator):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
        model[0].bias.requires_grad_(False)
        opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
        model, opt = accelerator.prepare(model, opt)
        g = torch.Generator().manual_seed(1)
        norms = []
        for _ in range(3):
            loss = model(10 * torch.randn(4, 8, generator=g)).pow(2).mean()
            accelerator.backward(loss)
            params = [p for p in model.parameters() if p.requires_grad]
            norm = accelerator.clip_grad_norm_(params[:1] if subset else params, 1.0)
            opt.step()
            opt.zero_grad()
            norms.append(float(norm))  # after the step, as the Trainer logs it
        return torch.cat([p.detach().reshape(-1) for p in model.parameters()]), norms

    stock, stock_norms = train(Accelerator(cpu=True))
    try:
        ours, norms = train(PGDAccelerator(cpu=True, max_grad_norm=1.0))
    except ValueError as exc:
        return {"error": str(exc)}
    return {"error": "", "max_diff": float((ours - stock).abs().max()), "norms": norms, "stock_norms": stock_norms}


@pytest.mark.parametrize("subset", [0, 1])
def test_clip_of_trainable_parameters_clips_once(ranks, subset):
    r, = ranks("test_integration_hf:clip_filtered", world_size=1, timeout=120, kwargs={"subset": subset})
    if subset:
        assert "only part of those parameters" in r["error"], r["error"]
        return
    assert not r["error"], r["error"]
    assert r["norms"] == pytest.approx(r["stock_norms"], rel=1e-6) and min(r["norms"]) > 1.0, r
    assert r["max_diff"] < 1e-6, r


def test_clip_value_other_than_wraps_is_refused(ranks):
    r, = ranks("test_integration_hf:clip_mismatch", world_size=1, timeout=120)
    assert "max_grad_norm=0.5" in r["error"] and "clipping twice" in r["error"], r["error"]


def test_amp_option_is_refused_with_the_fix():
    from pygraph_dist.integrations.hf import split_wrap_options

    assert split_wrap_options({"graphs": False, "cpu": True}) == ({"graphs": False}, {"cpu": True})
    with pytest.raises(ValueError, match="mixed_precision"):
        split_wrap_options({"amp": "bf16"})


# ---------------------------------------------------------------- benchmark
@pytest.mark.parametrize("framework, labels", [("trainer", {"Trainer", "PGDTrainer"}),
                                               ("accelerate", {"Accelerator", "PGDAccelerator"})])
def test_bench_hf_smoke(tmp_path, framework, labels):
    out = tmp_path / "bench.json"
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_hf.py"), "--smoke", "--framework", framework,
                        "--out", str(out)], capture_output=True, text=True, timeout=240, cwd=str(ROOT))
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    import json

    result = json.loads(out.read_text())
    rows = {r["trainer"]: r for r in result["rows"]}
    assert set(rows) == labels and result["config"]["framework"] == framework, result
    assert all(r["ms_per_step"] > 0 and r["steps_timed"] > 0 for r in rows.values()), result
