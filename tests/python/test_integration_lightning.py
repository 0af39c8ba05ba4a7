"""Lightning integration: ``Trainer(strategy="pgd")`` and ``Fabric(strategy="pgd")``.

CPU (Gloo, 2 ranks started with a torchrun environment, which Lightning's
launcher takes as processes created externally): the example's LightningModule
(accumulate 2, clip 1.0, a per-step or per-epoch scheduler, ``self.log``, a
validation loop) trained by ``strategy="pgd"`` equals ``strategy="ddp"``
within fp32 rounding, in parameters and in logged losses; the probe's verdict
is not tier 3 (``step(closure)`` is gone). Checkpoint resume equals
uninterrupted training. Fabric likewise against Fabric's DDP.

GPU (one GPU): the same module in bf16-mixed replays graphs (tier 1 or 2),
its logged losses keep flowing on replays, and it is bitwise equal to the
same strategy with ``graphs=False``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import ROOT, child_env, run_ranks

# Whether it is installed, without importing it: an import here would cost every
# pytest-xdist worker Lightning's import at collection (2.5 s on the 2-core CI
# machine), where only the few tests that use it in-process need it.
if importlib.util.find_spec("lightning") is None:
    pytest.skip("could not import 'lightning': No module named 'lightning'", allow_module_level=True)

# Ranks are started as torchrun starts them. Lightning knows torchrun by
# TORCHELASTIC_RUN_ID; without it, it asks mpi4py whether this is an MPI job,
# and an Open MPI mpi4py in a process no mpirun started initialises as a
# singleton, which aborts where Open MPI finds no ssh/rsh agent (the GPU machine).
TORCHRUN_ENV = {"TORCHELASTIC_RUN_ID": "pgd-tests", "GROUP_RANK": "0"}


@pytest.fixture
def ranks(tmp_path):
    def run(case: str, **kwargs):
        kwargs["env"] = {**TORCHRUN_ENV, **(kwargs.get("env") or {})}
        return run_ranks(case, tmp_path, **kwargs)
    return run
sys.path.insert(0, str(ROOT / "examples"))
# What the rank bodies import: the rank server imports it once (tests/python/rank_server.py).
RANK_PRELOAD = ("lightning", "lightning.pytorch", "lightning_gpt", "pygraph_dist.integrations.lightning")

TINY = dict(vocab=32, seq=16, layers=2, width=32, heads=2, lr=3e-3, warmup=3)
SMALL = dict(vocab=256, seq=64, layers=2, width=128, heads=2, lr=1e-3, warmup=3)
SIZES = {"tiny": (TINY, 8), "small": (SMALL, 16)}  # (LitGPT arguments, batch size)


# -------------------------------------------------------------- rank cases
def _trainer_fit(strategy: str, *, graphs: int = 1, steps: int = 6, accumulate: int = 2, clip: float = 1.0,
                 schedule: str = "step", precision: str = "32-true", epochs: int = -1, ckpt_in: str = "",
                 ckpt_out: str = "", batches: int = 8, size: str = "tiny", select: int = 1) -> dict:
    import lightning as L
    from lightning.pytorch.loggers import Logger

    import lightning_gpt as ex

    class Record(Logger):
        """Every logged value, per step (all ranks; Lightning's own loggers log on rank 0)."""

        def __init__(self) -> None:
            super().__init__()
            self.rows: list[dict] = []

        name, version = "record", 0

        def log_metrics(self, metrics, step=None):
            self.rows.append({k: float(v) for k, v in metrics.items()})

        def log_hyperparams(self, *args, **kwargs):
            pass

    gpu = torch.cuda.is_available()
    L.seed_everything(0)
    dims, batch = SIZES[size]
    model = ex.LitGPT(schedule=schedule, **dims)
    vocab, seq = model.hparams.vocab, model.hparams.seq
    world = 1 if gpu else 2
    train, val = ex.loaders(batch, seq, vocab, train_batches=batches, world=world)
    record = Record()
    options = {k: False for k, on in (("graphs", graphs), ("select", select)) if not on}
    strat = ex.strategy_for(strategy, **options)  # the name "pgd" when no option is given
    limits = dict(max_epochs=epochs) if epochs > 0 else dict(max_steps=steps)
    trainer = L.Trainer(
        strategy=strat, accelerator="gpu" if gpu else "cpu", devices=world, precision=precision,
        accumulate_grad_batches=accumulate, gradient_clip_val=clip or None, limit_val_batches=2,
        val_check_interval=1.0, num_sanity_val_steps=1, log_every_n_steps=1, logger=record,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, **limits)
    trainer.fit(model, train, val, ckpt_path=ckpt_in or None)
    if ckpt_out:
        trainer.save_checkpoint(ckpt_out)
    params = {n: p.detach().float().cpu().reshape(-1).tolist() for n, p in model.named_parameters()}
    result = {"params": params, "losses": [r["train_loss"] for r in record.rows if "train_loss" in r],
              "val": [r["val_loss"] for r in record.rows if "val_loss" in r],
              "global_step": trainer.global_step}
    if strategy == "pgd":
        d = trainer.strategy.last_report  # before fit's teardown released the graphs
        result.update(loop=d.loop, tiers=[g.tier for g in d.graphs if g.tier != "eval"], eval_replays=d.eval_replays, replays=d.replays, amp=d.amp,
                      reissued=trainer.strategy.logged.reissued, report=str(d))
    return result


def trainer_pair(**kwargs) -> dict:
    """The same fit with strategy="ddp" and strategy="pgd", in one process."""
    return {"ddp": _trainer_fit("ddp", **kwargs), "pgd": _trainer_fit("pgd", **kwargs)}


def _manual_module(**dims):
    import torch.nn.functional as F

    import lightning_gpt as ex

    class ManualGPT(ex.LitGPT):
        """Manual optimization: zero_grad, forward, manual_backward, clip, step, scheduler."""

        def __init__(self, **kw) -> None:
            super().__init__(**kw)
            self.automatic_optimization = False

        def training_step(self, batch, batch_idx):
            opt, sched = self.optimizers(), self.lr_schedulers()
            x, y = batch
            opt.zero_grad()
            logits = self(x)
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))
            self.manual_backward(loss)
            self.clip_gradients(opt, gradient_clip_val=1.0, gradient_clip_algorithm="norm")
            opt.step()
            sched.step()
            self.log("train_loss", loss, on_step=True)

    return ManualGPT(**dims)


def _manual_fit(strategy: str, *, graphs: int = 1, select: int = 1, size: str = "tiny", steps: int = 6) -> dict:
    import lightning as L

    import lightning_gpt as ex

    gpu = torch.cuda.is_available()
    dims, batch = SIZES[size]
    L.seed_everything(0)
    model = _manual_module(**dims)
    world = 1 if gpu else 2
    train, val = ex.loaders(batch, dims["seq"], dims["vocab"], train_batches=steps, world=world)
    losses = []

    class Losses(L.Callback):
        def on_train_batch_end(self, trainer, *rest):
            losses.append(float(trainer.callback_metrics["train_loss"]))

    options = {k: False for k, on in (("graphs", graphs), ("select", select)) if not on}
    trainer = L.Trainer(strategy=ex.strategy_for(strategy, **options), accelerator="gpu" if gpu else "cpu",
                        devices=world, max_steps=steps, limit_val_batches=2, num_sanity_val_steps=1,
                        logger=False, callbacks=[Losses()], enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, train, val)
    out = {"params": {n: p.detach().float().cpu().reshape(-1).tolist() for n, p in model.named_parameters()},
           "losses": losses, "val": float(trainer.callback_metrics["val_loss"])}
    if strategy == "pgd":
        d = trainer.strategy.last_report
        out.update(loop=d.loop, tiers=[g.tier for g in d.graphs if g.tier != "eval"], eval_replays=d.eval_replays, replays=d.replays,
                   forward_restored="forward" not in model.__dict__)
    return out


def manual_pair() -> dict:
    """Manual optimization, strategy="ddp" and strategy="pgd"."""
    return {strategy: _manual_fit(strategy) for strategy in ("ddp", "pgd")}


def manual_graphed_vs_eager() -> dict:
    kwargs = dict(select=0, size="small", steps=20)
    return {"graphed": _manual_fit("pgd", **kwargs), "eager": _manual_fit("pgd", graphs=0, **kwargs)}


@pytest.mark.gpu
@pytest.mark.timeout(600)
def test_manual_optimization_graphs_bitwise_gpu(ranks):
    (r,) = ranks("test_integration_lightning:manual_graphed_vs_eager", world_size=1, timeout=560)
    g, e = r["graphed"], r["eager"]
    assert set(g["tiers"]) & {"1", "2"}, g["loop"]
    assert g["replays"] >= 10, g
    assert g["losses"] == e["losses"] and len(g["losses"]) == 20
    for name in g["params"]:
        assert g["params"][name] == e["params"][name], name


def trainer_resume(out: str, schedule: str = "epoch") -> dict:
    """One epoch, a checkpoint, fit(ckpt_path=...) to two epochs -- and two epochs straight."""
    ckpt = os.path.join(out, "one-epoch.ckpt")
    _trainer_fit("pgd", schedule=schedule, epochs=1, ckpt_out=ckpt)
    import torch.distributed as dist

    dist.barrier()  # rank 0 wrote the checkpoint
    resumed = _trainer_fit("pgd", schedule=schedule, epochs=2, ckpt_in=ckpt)
    straight = _trainer_fit("pgd", schedule=schedule, epochs=2)
    return {"resumed": resumed, "straight": straight}


def fabric_pair() -> dict:
    return {"ddp": _fabric_loop("ddp"), "pgd": _fabric_loop("pgd")}


class _LossInModel(torch.nn.Module):
    """The GPT returning its loss (model(x, y)), as Fabric loops that keep the loss in the module."""

    def __init__(self, gpt):
        super().__init__()
        self.gpt = gpt

    def forward(self, x, y):
        logits = self.gpt(x)
        return torch.nn.functional.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))


def fabric_pair_loss_in_model() -> dict:
    """One micro-batch per step, the loss from the model, fabric.clip_gradients without
    its host check: fit for tier 1 (Fabric's own fabric.backward() check hook included)."""
    return {"ddp": _fabric_loop("ddp", accumulate=1, loss_in_model=True),
            "pgd": _fabric_loop("pgd", accumulate=1, loss_in_model=True)}


def _fabric_loop(strategy: str, steps: int = 6, accumulate: int = 2, graphs: bool = True,
                 loss_in_model: bool = False) -> dict:
    import lightning as L

    import lightning_gpt as ex

    gpu = torch.cuda.is_available()
    strat = strategy
    if strategy == "pgd":
        from pygraph_dist.integrations.lightning import PGDFabricStrategy  # importing registers "pgd"

        # On a GPU select=False keeps graphs even where eager is as fast (not what is tested here).
        strat = PGDFabricStrategy(graphs=graphs, select=False) if gpu else \
            "pgd" if graphs else PGDFabricStrategy(graphs=False)
    fabric = L.Fabric(strategy=strat, accelerator="gpu" if gpu else "cpu", devices=1 if gpu else 2)
    fabric.launch()
    fabric.seed_everything(0)
    model = ex.GPT(**{k: TINY[k] for k in ("vocab", "seq", "layers", "width", "heads")})
    if loss_in_model:
        model = _LossInModel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model, optimizer = fabric.setup(model, optimizer)
    train, _ = ex.loaders(8, TINY["seq"], TINY["vocab"], train_batches=steps * accumulate, world=fabric.world_size)
    train = fabric.setup_dataloaders(train)
    losses = []
    for i, (x, y) in enumerate(train):
        last = (i + 1) % accumulate == 0
        with fabric.no_backward_sync(model, enabled=not last):
            if loss_in_model:
                loss = model(x, y)
            else:
                logits = model(x)
                loss = torch.nn.functional.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))
            fabric.backward(loss / accumulate)
        if last:
            fabric.clip_gradients(model, optimizer, max_norm=1.0, error_if_nonfinite=not loss_in_model)
            optimizer.step()
            optimizer.zero_grad()
        losses.append(float(loss))
    params = {n: p.detach().float().cpu().reshape(-1).tolist() for n, p in model.named_parameters()}
    result = {"params": params, "losses": losses}
    if strategy == "pgd":
        d = fabric.strategy.engines[0].describe()
        result.update(loop=d.loop, tiers=[g.tier for g in d.graphs if g.tier != "eval"], eval_replays=d.eval_replays, replays=d.replays)
    return result


# ------------------------------------------------------------------ helpers
def _close(a: dict, b: dict, rtol: float = 1e-4, atol: float = 1e-6) -> None:
    assert a["params"].keys() == b["params"].keys()
    for name in a["params"]:
        x, y = torch.tensor(a["params"][name]), torch.tensor(b["params"][name])
        torch.testing.assert_close(x, y, rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")
    assert len(a["losses"]) == len(b["losses"]) > 0
    torch.testing.assert_close(torch.tensor(a["losses"]), torch.tensor(b["losses"]), rtol=rtol, atol=atol)


def _not_tier3(loop: str) -> None:
    # On a CPU no graph is possible, so the verdict names what keeps tier 1 away;
    # what must not be there is what only tier 3 can run.
    for tier3 in ("step(closure)", "reaches model parameters", "several forward passes",
                  "zero_grad() was not called"):
        assert tier3 not in loop, loop


# -------------------------------------------------------------------- tests
@pytest.mark.timeout(300)
@pytest.mark.parametrize("schedule,precision", [("step", "32-true"), ("epoch", "32-true"), ("step", "bf16-mixed")])
def test_trainer_pgd_equals_ddp_cpu(ranks, schedule, precision):
    kwargs = {"schedule": schedule, "precision": precision}
    for r in ranks("test_integration_lightning:trainer_pair", kwargs=kwargs, timeout=280):
        assert r["ddp"]["global_step"] == r["pgd"]["global_step"] == 6
        # bf16-mixed: Lightning's autocast and wrap(amp="bf16") cast the same ops; the
        # in-graph clip sums the norm in another parameter order.
        _close(r["pgd"], r["ddp"], **({"rtol": 1e-3, "atol": 1e-5} if precision == "bf16-mixed" else {}))
        assert r["pgd"]["amp"].startswith("bf16" if precision == "bf16-mixed" else "fp32"), r["pgd"]["amp"]
        assert len(r["pgd"]["val"]) == len(r["ddp"]["val"]) > 0
        torch.testing.assert_close(torch.tensor(r["pgd"]["val"]), torch.tensor(r["ddp"]["val"]))
        _not_tier3(r["pgd"]["loop"])
        assert r["pgd"]["tiers"] and set(r["pgd"]["tiers"]) == {"3"}, r["pgd"]["report"]  # CPU: eager


@pytest.mark.timeout(300)
def test_trainer_accumulate_1_fits_tier1_cpu(ranks):
    """accumulate_grad_batches=1: Lightning still divides the loss by it, and
    loss / 1 is the loss: the loop fits one graph per step (tier 1), with
    gradient_clip_val clipped in the step graph."""
    for r in ranks("test_integration_lightning:trainer_pair", kwargs={"accumulate": 1}, timeout=280):
        assert r["ddp"]["global_step"] == r["pgd"]["global_step"] == 6
        _close(r["pgd"], r["ddp"])
        assert r["pgd"]["loop"].startswith("conforms"), r["pgd"]["loop"]


@pytest.mark.timeout(300)
def test_trainer_resume_from_checkpoint_cpu(ranks):
    for r in ranks("test_integration_lightning:trainer_resume", timeout=280):
        assert r["resumed"]["global_step"] == r["straight"]["global_step"] > 0
        n = len(r["resumed"]["losses"])
        assert 0 < n < len(r["straight"]["losses"])  # the second epoch only
        torch.testing.assert_close(torch.tensor(r["resumed"]["losses"]),
                                   torch.tensor(r["straight"]["losses"][-n:]), rtol=1e-5, atol=1e-7)
        for name, values in r["straight"]["params"].items():
            torch.testing.assert_close(torch.tensor(r["resumed"]["params"][name]), torch.tensor(values),
                                       rtol=1e-5, atol=1e-7)


@pytest.mark.timeout(300)
def test_fabric_pgd_equals_ddp_cpu(ranks):
    for r in ranks("test_integration_lightning:fabric_pair", timeout=280):
        _close(r["pgd"], r["ddp"])
        _not_tier3(r["pgd"]["loop"])
        # The line inside Fabric named with the loop's own.
        loop = r["pgd"]["loop"]
        assert re.search(r"at lightning(_fabric)?/[\w/]+\.py:\d+ \(from tests/python/test_integration_lightning\.py:\d+\)",
                         loop), loop


@pytest.mark.timeout(300)
def test_fabric_loss_in_model_conforms_cpu(ranks):
    for r in ranks("test_integration_lightning:fabric_pair_loss_in_model", timeout=280):
        _close(r["pgd"], r["ddp"])
        # Fabric's hook on the model's output (its fabric.backward() check) is no change of the loop
        assert r["pgd"]["loop"].startswith("conforms"), r["pgd"]["loop"]


@pytest.mark.timeout(300)
def test_manual_optimization_pgd_equals_ddp_cpu(ranks):
    for r in ranks("test_integration_lightning:manual_pair", timeout=280):
        _close(r["pgd"], r["ddp"])
        assert r["pgd"]["val"] == pytest.approx(r["ddp"]["val"], rel=1e-5)
        _not_tier3(r["pgd"]["loop"])
        assert "loss is computed outside the model" in r["pgd"]["loop"]  # the forward is the model call
        assert r["pgd"]["forward_restored"]


def test_strategy_rejects_wrap_options_it_owns():
    from pygraph_dist.integrations.lightning import PGDStrategy

    with pytest.raises(ValueError, match=r"amp= comes from Trainer\(precision=...\)"):
        PGDStrategy(amp="bf16")
    with pytest.raises(TypeError, match="unknown option.*find_unused_parameters.*wrap"):
        PGDStrategy(find_unused_parameters=True)


def test_registered_names():
    from lightning.fabric.strategies import STRATEGY_REGISTRY
    from lightning.pytorch.strategies import StrategyRegistry

    import pygraph_dist.integrations.lightning as pl_pgd

    assert isinstance(StrategyRegistry.get("pgd"), pl_pgd.PGDStrategy)
    assert isinstance(STRATEGY_REGISTRY.get("pgd"), pl_pgd.PGDFabricStrategy)


def _python(code: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], env=child_env(**env), capture_output=True, text=True,
                          timeout=120, cwd=str(ROOT))


def test_import_pygraph_dist_does_not_import_lightning():
    r = _python("import sys, pygraph_dist, pygraph_dist.integrations; "
                "print(sorted(m for m in sys.modules if m.split('.')[0] in ('lightning', 'pytorch_lightning')))")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]", r.stdout


def test_missing_lightning_names_the_extra():
    r = _python("import sys; sys.modules['lightning'] = None\n"
                "try:\n    import pygraph_dist.integrations.lightning\n"
                "except ImportError as e:\n    print('ImportError:', e)\n")
    assert r.returncode == 0, r.stderr
    assert "ImportError:" in r.stdout and "pip install pygraph_dist[lightning]" in r.stdout, r.stdout


@pytest.mark.timeout(300)
@pytest.mark.parametrize("framework", ["trainer", "fabric"])
def test_benchmark_smoke_cpu(tmp_path, framework):
    out = tmp_path / "bench.json"
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_lightning.py"), "--smoke",
                        "--framework", framework, "--out", str(out)],
                       env=child_env(), capture_output=True, text=True, timeout=280, cwd=str(ROOT))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["config"]["framework"] == framework
    rows = result["rows"]
    assert {row["strategy"] for row in rows} == {"ddp", "pgd"}
    assert all(row["ms_per_step"] > 0 and row["steps_timed"] > 0 for row in rows), rows


# --------------------------------------------------------------------- GPU
def trainer_graphed_vs_eager(precision: str = "bf16-mixed", accumulate: int = 2) -> dict:
    # select=False: keep the graphs even where the eager step is as fast (not what is tested here)
    kwargs = dict(precision=precision, steps=20, batches=40, size="small", select=0, accumulate=accumulate)
    return {"graphed": _trainer_fit("pgd", graphs=1, **kwargs), "eager": _trainer_fit("pgd", graphs=0, **kwargs)}


@pytest.mark.gpu
@pytest.mark.timeout(600)
@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed", "32-true"])
def test_trainer_graphs_bitwise_gpu(ranks, precision):
    (r,) = ranks("test_integration_lightning:trainer_graphed_vs_eager", world_size=1,
                 kwargs={"precision": precision}, timeout=560)
    g, e = r["graphed"], r["eager"]
    assert set(g["tiers"]) & {"1", "2"}, g["report"]
    assert g["replays"] >= 10, g["report"]  # 20 steps, less 2 probed, 3 warm-up, 1 captured
    assert g["reissued"] > 0, g["report"]  # self.log values issued again after replays
    assert g["losses"] == e["losses"] and len(g["losses"]) == 20
    assert g["val"] == e["val"]
    for name in g["params"]:
        assert g["params"][name] == e["params"][name], name


@pytest.mark.gpu
@pytest.mark.timeout(600)
def test_trainer_accumulate_1_replays_tier1_bitwise_gpu(ranks):
    (r,) = ranks("test_integration_lightning:trainer_graphed_vs_eager", world_size=1,
                 kwargs={"accumulate": 1}, timeout=560)
    g, e = r["graphed"], r["eager"]
    assert g["tiers"] == ["1"], g["report"]
    assert g["replays"] >= 10, g["report"]
    assert g["losses"] == e["losses"] and g["val"] == e["val"]
    for name in g["params"]:
        assert g["params"][name] == e["params"][name], name


def fabric_graphed_vs_eager(loss_in_model: bool = False) -> dict:
    kw = dict(steps=20, accumulate=1, loss_in_model=True) if loss_in_model else dict(steps=20)
    return {"graphed": _fabric_loop("pgd", **kw), "eager": _fabric_loop("pgd", graphs=False, **kw)}


@pytest.mark.gpu
@pytest.mark.timeout(400)
@pytest.mark.parametrize("loss_in_model", [False, True])
def test_fabric_graphs_bitwise_gpu(ranks, loss_in_model):
    """The usual Fabric loop (tier 2), and one whose model returns the loss (tier 1,
    Fabric's fabric.backward() check hook on the handed-out loss)."""
    (r,) = ranks("test_integration_lightning:fabric_graphed_vs_eager", world_size=1, timeout=380,
                 kwargs={"loss_in_model": loss_in_model})
    g, e = r["graphed"], r["eager"]
    if loss_in_model:
        assert g["tiers"] == ["1"], g["loop"]
    else:
        assert set(g["tiers"]) & {"1", "2"}, g["loop"]
    assert g["replays"] >= 10, g
    assert g["losses"] == e["losses"]
    for name in g["params"]:
        assert g["params"][name] == e["params"][name], name


def test_logged_values_reissued_after_replay(monkeypatch):
    """What the strategy does around each step call, with the CUDA capture
    simulated: eager values go to Lightning as they are; values logged during
    a capture are kept (the graph rewrites them) and issued again, copied,
    after every call whose body did not run."""
    from pygraph_dist.integrations._lightning_logs import LoggedCalls, call_key

    issued = []

    def log(module, name, value, prog_bar=False, on_step=None):
        issued.append((name, value, prog_bar, on_step))

    calls, module = LoggedCalls(log), torch.nn.Linear(1, 1)
    key = call_key("training_step", (torch.zeros(2, 3), 5), {}, {1})
    assert key == call_key("training_step", (torch.ones(2, 3), 6), {}, {1})  # batch_idx left out
    other = call_key("training_step", (torch.zeros(4, 3), 5), {}, {1})
    assert other != key

    eager = torch.tensor(1.0)
    calls.begin_call()
    with calls.recording(module):
        module.log("loss", eager, on_step=True)
    assert "log" not in module.__dict__  # the method is LightningModule's again
    calls.end_call(module, key)
    assert issued == [("loss", eager, False, True)]

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    static = torch.tensor(2.0)
    calls.begin_call()
    with calls.recording(module):
        module.log("loss", static, True)  # options by position are passed on by name
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    calls.end_call(module, key)
    name, value, prog_bar, _ = issued[-1]
    assert (name, float(value), prog_bar) == ("loss", 2.0, True) and value is not static

    static.fill_(3.0)  # a replay writes the graph's tensor; the body does not run
    calls.begin_call()
    calls.end_call(module, key)
    assert float(issued[-1][1]) == 3.0 and issued[-1][1] is not static and calls.reissued == 1
    calls.begin_call()
    calls.end_call(module, other)  # another signature's graph: not these values
    assert calls.reissued == 1 and len(issued) == 3


def test_ignore_args_read_from_training_step():
    """The strategy's model call runs training_step(batch, batch_idx), not forward(idx):
    ignore_args positions come from training_step, and a wrong name names it."""
    from pygraph_dist.loop.arguments import IGNORED, IgnoredArgs
    from pygraph_dist.integrations.lightning import _step_ignored_args

    import lightning_gpt as ex

    module = ex.LitGPT(**TINY)
    assert _step_ignored_args(module.training_step) == ("batch_idx",)
    ignored = IgnoredArgs(("batch_idx",), module, forward=module.training_step)
    assert ignored.positions == {1: "batch_idx"}
    batch = [torch.zeros(2, 4, dtype=torch.long)] * 2
    assert ignored.mask((batch, 7), {}) == ((batch, IGNORED), {})
    with pytest.raises(ValueError, match=r"LitGPT.training_step does not take.*its arguments: batch, batch_idx"):
        IgnoredArgs(("step",), module, forward=module.training_step)
