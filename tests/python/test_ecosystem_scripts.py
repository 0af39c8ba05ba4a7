"""The ecosystem's training scripts, run as files, with DDP and with pygraph_dist.

``examples/scripts/`` holds three scripts written the way the most-copied
training scripts are (a character-level GPT pretraining script, an
ImageNet-style reference script launched with ``mp.spawn`` and its own
``init_process_group``, a timm-style script); each switches between
``--mode ddp``, ``pgd`` and ``pgd_nographs`` only where DDP is created, and
writes what it trained to ``--out-dir`` (``result_rank<r>.json``,
``final_params.pt``).

CPU (2 Gloo ranks): each script with pygraph_dist trains like the same script
with DDP, within fp32 rounding (losses per step, evaluation, final
parameters), and the ImageNet script's checkpoint + ``--resume`` gives the
uninterrupted run's parameters.

GPU (one GPU): each script graphed is bitwise equal to ``graphs=False``, at
the tier expected, every step after warm-up replayed, no recapture, and its
evaluation loop replayed as graphs.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch

from conftest import ROOT, RankFailure, child_env, free_port, popen_script, stock_gloo_exit_abort

SCRIPTS = ROOT / "examples" / "scripts"

# Small shapes, so that a CPU run of each script takes seconds.
GPT_SMALL = ["--n-layer", "2", "--n-embd", "32", "--n-head", "2", "--block-size", "32", "--batch-size", "8",
             "--max-iters", "12", "--eval-interval", "5", "--eval-iters", "3", "--log-interval", "4",
             "--warmup-iters", "3", "--grad-accum-steps", "4", "--time-from", "2"]
IMAGENET_SMALL = ["--arch", "small", "--train-samples", "128", "--val-samples", "64", "--batch-size", "32"]
TIMM_SMALL = ["--train-samples", "256", "--val-samples", "64", "--batch-size", "16", "--grad-accum-steps", "2",
              "--epochs", "2", "--deterministic"]


# ------------------------------------------------------------------ launching
def run_script(script: str, args: list[str], out_dir: Path, *, world_size: int, timeout: float,
               spawn: bool = False, cuda: bool = False) -> list[dict]:
    """Run ``examples/scripts/<script>`` and return each rank's result JSON.

    torchrun-style (``spawn=False``): ``world_size`` processes with RANK,
    WORLD_SIZE, ... set. ``spawn=True``: one process that ``mp.spawn``s its
    ranks (``--world-size`` and ``--dist-url`` added). Each launch runs in its
    own session and is killed as a whole (spawned children included) after
    ``timeout`` seconds."""
    out_dir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    base = [sys.executable, str(SCRIPTS / script), *args, "--out-dir", str(out_dir)]
    env_all = {} if cuda else {"CUDA_VISIBLE_DEVICES": ""}
    launches = []
    if spawn:
        launches.append((base + ["--world-size", str(world_size), "--dist-url", f"tcp://127.0.0.1:{port}"],
                         child_env(**env_all)))
    else:
        for rank in range(world_size):
            launches.append((base, child_env(
                RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), **env_all)))
    procs = []
    for i, (cmd, env) in enumerate(launches):
        log = open(out_dir / f"launch{i}.log", "w")
        # A CPU launch is forked from a server that imported torch (conftest.popen_script);
        # mp.spawn's children are new Pythons either way.
        procs.append((popen_script(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=str(ROOT),
                                   start_new_session=True), log))
    deadline = time.monotonic() + timeout
    timed_out = False
    for p, _ in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            timed_out = True
            break
    for p, log in procs:
        if timed_out or p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)  # the session this launch started, nothing else
            except ProcessLookupError:
                pass
            p.wait()
        log.close()
    logs = "\n".join(f"----- launch {i} -----\n{(out_dir / f'launch{i}.log').read_text()[-6000:]}"
                     for i in range(len(procs)))
    if timed_out:
        raise RankFailure(f"{script} {' '.join(args)}: did not finish within {timeout} s\n{logs}")
    if any(p.returncode != 0 for p, _ in procs):
        done = all((out_dir / f"result_rank{r}.json").exists() for r in range(world_size))
        ddp_control = "--mode" in args and args[args.index("--mode") + 1] == "ddp"
        if not (ddp_control and done and stock_gloo_exit_abort(logs)):
            raise RankFailure(f"{script} {' '.join(args)}: exit codes {[p.returncode for p, _ in procs]}\n{logs}")
        # The DDP control over the script's own init_process_group("gloo"):
        # torch's DDP issues its all-reduces from backward through torch's stock
        # Gloo, whose worker threads can release a finished Work holding Python
        # objects while the interpreter finalizes, after destroy_process_group
        # (std::terminate in pt_gloo_runloop; seen in a fresh-clone CI run of the
        # ImageNet script's DDP control). pygraph_dist's own collectives hold
        # none over any group (python/pygraph_dist/launch/collectives.py, issue 25;
        # tests/python/test_faults_exit_stress.py), so with pgd an abort fails.
        # Every result was written: what this test checks is complete, so the
        # control's abort is warned about, not hidden.
        warnings.warn(f"{script}: a rank of the DDP control aborted at exit in torch's stock Gloo "
                      f"after writing its results (exit codes {[p.returncode for p, _ in procs]})")
    return [json.loads((out_dir / f"result_rank{r}.json").read_text()) for r in range(world_size)]


def final_params(out_dir: Path):
    return torch.load(out_dir / "final_params.pt")


def max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max())


# ------------------------------------------------------------------ CPU: pgd trains like DDP
# fp32 on a CPU, where pgd runs the loop as written: the same arithmetic as
# DDP up to the order of the gradient reduction (accumulation: DDP reduces the
# local sum once, pgd may reduce every micro-batch).
TOL = 1e-5


def _runs(tmp_path, script, args, **kw) -> dict:
    out = {}
    for mode in ("ddp", "pgd"):
        out[mode] = (run_script(script, args + ["--mode", mode], tmp_path / mode, **kw), tmp_path / mode)
    return out


def _assert_ranks_agree(results: list[dict]) -> None:
    sums = {(r["param_sum"], r["param_abs_sum"]) for r in results}
    assert len(sums) == 1, f"ranks hold different parameters: {sums}"


def test_gpt_pretrain_with_pgd_trains_like_ddp_on_cpu(tmp_path):
    runs = _runs(tmp_path, "gpt_pretrain.py", GPT_SMALL, world_size=2, timeout=240)
    (ddp, ddp_dir), (pgd, pgd_dir) = runs["ddp"], runs["pgd"]
    for r in range(2):
        # 13 iterations x 2 micro-steps per rank; every loss the model handed out.
        assert len(pgd[r]["losses"]) == len(ddp[r]["losses"]) == 26
        assert pgd[r]["losses"] == pytest.approx(ddp[r]["losses"], rel=1e-4, abs=1e-6)
    _assert_ranks_agree(ddp)
    _assert_ranks_agree(pgd)
    # estimate_loss() on rank 0 only, at iterations 0, 5 and 10 (model.eval() + no_grad()).
    assert [e["iter"] for e in pgd[0]["evals"]] == [0, 5, 10]
    assert pgd[0]["evals"] == [pytest.approx(e, rel=1e-5) for e in ddp[0]["evals"]]
    assert pgd[1]["evals"] == []
    p_ddp, p_pgd = final_params(ddp_dir), final_params(pgd_dir)
    assert max_abs_diff(p_ddp, p_pgd) < TOL
    first = pgd[0]["losses"][:2]
    assert sum(pgd[0]["losses"][-2:]) < sum(first), "the GPT did not learn"
    # The checkpoint: model.module.state_dict() and the optimizer, saved on rank 0 at iteration 10.
    ck_ddp = torch.load(ddp_dir / "ckpt.pt", weights_only=False)
    ck_pgd = torch.load(pgd_dir / "ckpt.pt", weights_only=False)
    assert ck_pgd["iter_num"] == ck_ddp["iter_num"] == 10
    assert list(ck_pgd["model"]) == list(ck_ddp["model"])  # the keys of the unwrapped module
    for k, v in ck_ddp["model"].items():
        assert max_abs_diff(v, ck_pgd["model"][k]) < TOL, k
    for pid, st in ck_ddp["optimizer"]["state"].items():
        for k in ("exp_avg", "exp_avg_sq"):
            assert max_abs_diff(st[k], ck_pgd["optimizer"]["state"][pid][k].cpu()) < TOL, (pid, k)
    assert [g["lr"] for g in ck_pgd["optimizer"]["param_groups"]] == pytest.approx(
        [g["lr"] for g in ck_ddp["optimizer"]["param_groups"]])
    assert pgd[0]["report"]["model"] == "GPT"
    # What a new user reads at the end (issue 28): a few lines, and the same story as the records.
    text = pgd[0]["report_text"]
    assert len(text.splitlines()) <= 12, text
    assert "evaluation (no grad)" in text and "precision:" in text, text


@pytest.fixture
def imagenet_two_epochs(made_once):
    """The ImageNet script's 2-epoch run in a mode, made once per session and
    checked by two tests: the reference test (pgd against DDP) and the resume
    test (from the checkpoint it leaves). Each run is 3 new Pythons (the
    launcher and its mp.spawn ranks)."""
    def run(mode: str) -> tuple[list[dict], Path]:
        return made_once(f"imagenet_two_epochs_{mode}", lambda out: run_script(
            "imagenet_ref.py", IMAGENET_SMALL + ["--mode", mode, "--epochs", "2"], out, world_size=2,
            timeout=240, spawn=True))
    return run


def test_imagenet_reference_with_pgd_trains_like_ddp_on_cpu(imagenet_two_epochs):
    (ddp, ddp_dir), (pgd, pgd_dir) = imagenet_two_epochs("ddp"), imagenet_two_epochs("pgd")
    for r in range(2):
        assert len(pgd[r]["steps"]) == 2 * 4  # 128 samples / 2 ranks / 16 per rank, 2 epochs
        got, want = [s[0] for s in pgd[r]["steps"]], [s[0] for s in ddp[r]["steps"]]
        assert got == pytest.approx(want, rel=1e-4, abs=1e-6)
        assert [s[1:] for s in pgd[r]["steps"]] == [s[1:] for s in ddp[r]["steps"]]  # top-1 / top-5
        assert len(pgd[r]["val"]) == 2
        for a, b in zip(pgd[r]["val"], ddp[r]["val"]):
            assert a["loss"] == pytest.approx(b["loss"], rel=1e-4)
            assert (a["top1"], a["top5"]) == (b["top1"], b["top5"])
    _assert_ranks_agree(ddp)
    _assert_ranks_agree(pgd)
    f_ddp, f_pgd = final_params(ddp_dir), final_params(pgd_dir)
    assert max_abs_diff(f_ddp["params"], f_pgd["params"]) < TOL
    assert max_abs_diff(f_ddp["buffers"], f_pgd["buffers"]) < 1e-4  # BatchNorm running statistics
    # The checkpoint holds the DDP-style "module."-prefixed keys in both modes.
    ck_ddp = torch.load(ddp_dir / "checkpoint.pth.tar", weights_only=False)
    ck_pgd = torch.load(pgd_dir / "checkpoint.pth.tar", weights_only=False)
    assert list(ck_pgd["state_dict"]) == list(ck_ddp["state_dict"])
    assert next(iter(ck_pgd["state_dict"])).startswith("module.")
    assert ck_pgd["scheduler"]["last_epoch"] == ck_ddp["scheduler"]["last_epoch"] == 2


@pytest.mark.parametrize("mode", ["pgd", "ddp"])
def test_imagenet_checkpoint_resume_continues_the_uninterrupted_run(tmp_path, mode, imagenet_two_epochs):
    """3 epochs in one go; 2 epochs, then --resume from their checkpoint for the
    third: the same parameters, buffers and per-step losses (DDP: the control)."""
    base = IMAGENET_SMALL + ["--mode", mode]
    full = run_script("imagenet_ref.py", base + ["--epochs", "3"], tmp_path / "full", world_size=2,
                      timeout=240, spawn=True)
    _, part = imagenet_two_epochs(mode)
    resumed = run_script("imagenet_ref.py", base + ["--epochs", "3", "--resume", str(part / "checkpoint.pth.tar")],
                         tmp_path / "resumed", world_size=2, timeout=240, spawn=True)
    for r in range(2):
        assert resumed[r]["resumed"] and len(resumed[r]["steps"]) == 4
        assert resumed[r]["steps"] == full[r]["steps"][-4:]
        assert resumed[r]["val"] == full[r]["val"][-1:]
    f_full, f_res = final_params(tmp_path / "full"), final_params(tmp_path / "resumed")
    assert torch.equal(f_full["params"], f_res["params"]), max_abs_diff(f_full["params"], f_res["params"])
    assert torch.equal(f_full["buffers"], f_res["buffers"])


def test_timm_style_with_pgd_trains_like_ddp_on_cpu(tmp_path):
    runs = _runs(tmp_path, "timm_style.py", TIMM_SMALL, world_size=2, timeout=240)
    (ddp, ddp_dir), (pgd, pgd_dir) = runs["ddp"], runs["pgd"]
    for r in range(2):
        assert len(pgd[r]["losses"]) == 2 * 8  # 128 samples per rank / 16, 2 epochs, accumulation over 2
        assert pgd[r]["losses"] == pytest.approx(ddp[r]["losses"], rel=1e-4, abs=1e-6)
        assert pgd[r]["logged"] == pytest.approx(ddp[r]["logged"], rel=1e-4)
        for key in ("val", "val_ema"):
            for a, b in zip(pgd[r][key], ddp[r][key], strict=True):
                assert a["loss"] == pytest.approx(b["loss"], rel=1e-4), key
        assert pgd[r]["channels_last"] and ddp[r]["channels_last"]
    _assert_ranks_agree(ddp)
    _assert_ranks_agree(pgd)
    f_ddp, f_pgd = final_params(ddp_dir), final_params(pgd_dir)
    for k in ("params", "buffers", "ema"):
        assert max_abs_diff(f_ddp[k], f_pgd[k]) < 1e-4, k
    assert max_abs_diff(f_pgd["ema_params"], f_pgd["params"]) > 1e-4  # the EMA is an average, not a copy


def test_bench_scripts_smoke(tmp_path):
    """The benchmark harness end to end on a CPU: every mode's row and the table."""
    p = subprocess.run([sys.executable, "benchmarks/bench_scripts.py", "--smoke", "--out-dir", str(tmp_path)],
                       cwd=str(ROOT), env=child_env(CUDA_VISIBLE_DEVICES=""), capture_output=True, text=True,
                       timeout=280)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    result = json.loads((tmp_path / "bench_scripts.json").read_text())
    modes = [row["mode"] for row in result["train"]]
    assert modes == ["ddp", "pgd", "ddp+compile", "pgd+compile", "pgd_nographs"]
    assert all(row["ms_per_iter"] > 0 for row in result["train"])
    assert [row["mode"] for row in result["eval"]] == modes
    assert result["pgd_vs_graphs_false_bitwise"] == {"eval": True, "losses": True}
    assert [a["ok"] is not None for a in result["acceptance"]] == [True] * 4
    assert all(row["s_per_eval"] > 0 for row in result["eval"])
    table = (tmp_path / "bench_scripts.txt").read_text()
    assert "ms/it" in table and "pgd+compile" in table and "s/eval" in table and "acceptance" in table


# ------------------------------------------------------------------ GPU: graphed, bitwise
# The tier each script gets: 2 (forward and backward graphs, the script's own
# code between them, the step graph at optimizer.step()). All three compute
# something from the model's outputs outside the model call (the loss divided
# by the accumulation count; the criterion on the logits) and accumulate over
# several model calls per step (GPT, timm).
EXPECTED_TIER = {"gpt_pretrain.py": "2", "imagenet_ref.py": "2", "timm_style.py": "2"}
# Training iterations that do not replay: 2 probe, 3 warm-up, 1 capture.
NOT_REPLAYED = 6
# Calls of an evaluation signature that do not replay (its own warm-up and capture): at most.
EVAL_NOT_REPLAYED = 4

GPU_RUNS = {
    # Bitwise across processes needs deterministic kernels: --deterministic for the GPT
    # (flash attention's backward), cudnn.deterministic for the convolutions.
    # 41 iterations x 2 micro-steps; evaluation at 0, 10, 20, 30, 40: 5 x 2 splits x 5 batches.
    "gpt": ("gpt_pretrain.py", ["--n-layer", "2", "--n-embd", "128", "--n-head", "4", "--block-size", "64",
                                "--batch-size", "16", "--max-iters", "40", "--eval-interval", "10",
                                "--eval-iters", "5", "--log-interval", "10", "--warmup-iters", "5",
                                "--grad-accum-steps", "2", "--dtype", "bfloat16", "--deterministic"], 50),
    "gpt+compile": ("gpt_pretrain.py", ["--n-layer", "2", "--n-embd", "128", "--n-head", "4",
                                        "--block-size", "64", "--batch-size", "16", "--max-iters", "40",
                                        "--eval-interval", "10", "--eval-iters", "5", "--log-interval", "10",
                                        "--warmup-iters", "5", "--grad-accum-steps", "2", "--dtype", "bfloat16",
                                        "--deterministic", "--compile"], 50),
    # 3 epochs x 8 steps; validate() 3 x 8 batches.
    "imagenet": ("imagenet_ref.py", ["--train-samples", "256", "--val-samples", "256", "--batch-size", "32",
                                     "--epochs", "3"], 24),
    # 3 epochs x 16 updates of 2 micro-batches; validate(model) 3 x 8 batches (the EMA's runs eagerly).
    "timm": ("timm_style.py", ["--train-samples", "512", "--val-samples", "128", "--batch-size", "16",
                               "--grad-accum-steps", "2", "--epochs", "3", "--deterministic"], 24),
    "timm@fp16": ("timm_style.py", ["--train-samples", "512", "--val-samples", "128", "--batch-size", "16",
                                    "--grad-accum-steps", "2", "--epochs", "3", "--deterministic",
                                    "--amp-dtype", "float16"], 24),
}


def is_eval_record(g: dict) -> bool:
    """An evaluation (forward-only) signature's record in ``pgd.report()`` (evaluation.py)."""
    return g.get("tier") == "eval"


def _eval_outputs(result: dict):
    return result.get("evals") or [result.get("val"), result.get("val_ema")]


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(GPU_RUNS))
def test_script_graphed_equals_graphs_false_on_one_gpu(tmp_path, name):
    script, args, eval_calls = GPU_RUNS[name]
    spawn = script == "imagenet_ref.py"
    timeout = 500 if "compile" in name else 300
    graphed = run_script(script, args + ["--mode", "pgd"], tmp_path / "pgd", world_size=1, timeout=timeout,
                         spawn=spawn, cuda=True)[0]
    eager = run_script(script, args + ["--mode", "pgd_nographs"], tmp_path / "eager", world_size=1,
                       timeout=timeout, spawn=spawn, cuda=True)[0]
    text = graphed["report_text"]
    assert len(text.splitlines()) <= 12, text  # issue 28: report() in a few lines
    if script == "gpt_pretrain.py":  # the script's own autocast, said as such
        assert "user autocast bf16" in text and "replayed (tier 2)" in text, text
    # Bitwise: every logged loss, every evaluation, the final parameters (and buffers, EMA).
    losses = "steps" if script == "imagenet_ref.py" else "losses"
    assert graphed[losses] == eager[losses], f"losses differ from graphs=False\n{text}"
    assert _eval_outputs(graphed) == _eval_outputs(eager), f"evaluation differs from graphs=False\n{text}"
    fg, fe = final_params(tmp_path / "pgd"), final_params(tmp_path / "eager")
    fg, fe = (fg, fe) if isinstance(fg, dict) else ({"params": fg}, {"params": fe})
    for k in fg:
        assert torch.equal(fg[k], fe[k]), f"{k}: max |diff| {max_abs_diff(fg[k], fe[k])}\n{text}"

    rep = graphed["report"]
    train = [g for g in rep["graphs"] if not is_eval_record(g)]
    evals = [g for g in rep["graphs"] if is_eval_record(g)]
    # The tier, and every training step after probe, warm-up and capture replayed.
    assert train and train[0]["tier"] == EXPECTED_TIER[script] and train[0]["phase"] == "replay", text
    iterations = sum(g["iterations"] for g in train)
    replays = sum(g["replays"] for g in train)
    assert iterations >= 20 and replays >= iterations - NOT_REPLAYED * len(train), (iterations, replays, text)
    # Nothing captured again: the float lr every iteration, require_backward_grad_sync,
    # the evaluations in between, the checkpoints.
    assert sum(g["recaptures"] for g in rep["graphs"]) == 0, text
    assert not [e for e in rep["events"] if e["event"] == "invalidated"], text
    # The evaluation loop replayed forward-only graphs.
    assert evals, f"no evaluation graph in report() (see is_eval_record)\n{text}"
    assert all(g["phase"] == "replay" for g in evals), text
    eval_replays = sum(g["replays"] for g in evals)
    assert eval_replays >= eval_calls - EVAL_NOT_REPLAYED * len(evals), (eval_replays, eval_calls, text)


@pytest.mark.multigpu
def test_gpt_evaluated_on_rank_0_only_on_two_gpus(tmp_path):
    """The GPT script evaluates on rank 0 only (``if ... and master_process``), as
    the scripts it is modelled on do: rank 0's evaluation graphs must be captured
    and replayed without anything from rank 1 (no collective, no agreement), and
    training on both ranks must stay bitwise equal to graphs=False."""
    script, args, eval_calls = GPU_RUNS["gpt"]
    graphed = run_script(script, args + ["--mode", "pgd"], tmp_path / "pgd", world_size=2, timeout=400, cuda=True)
    eager = run_script(script, args + ["--mode", "pgd_nographs"], tmp_path / "eager", world_size=2, timeout=400,
                       cuda=True)
    for g, e in zip(graphed, eager):
        assert g["losses"] == e["losses"], g["report_text"]
        assert g["evals"] == e["evals"], g["report_text"]
        assert (g["param_sum"], g["param_abs_sum"]) == (e["param_sum"], e["param_abs_sum"])
    _assert_ranks_agree(graphed)
    assert torch.equal(final_params(tmp_path / "pgd"), final_params(tmp_path / "eager"))
    evals0 = [g for g in graphed[0]["report"]["graphs"] if is_eval_record(g)]
    evals1 = [g for g in graphed[1]["report"]["graphs"] if is_eval_record(g)]
    assert evals0 and sum(g["replays"] for g in evals0) >= eval_calls - EVAL_NOT_REPLAYED * len(evals0), \
        graphed[0]["report_text"]
    assert not evals1, graphed[1]["report_text"]  # rank 1 never evaluated
    for r in graphed:
        train = [g for g in r["report"]["graphs"] if not is_eval_record(g)]
        # One micro-step per rank here (--grad-accum-steps 2 over 2 ranks): tier 1 or 2.
        assert train[0]["tier"] in ("1", "2") and train[0]["phase"] == "replay", r["report_text"]
        assert sum(g["recaptures"] for g in r["report"]["graphs"]) == 0, r["report_text"]
