"""CPU tests with 2 Gloo ranks: reducer vs DDP, eager training through wrap(), loop checks."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize("world", [2, 3])
def test_reducer_matches_ddp(ranks, world):
    for r in ranks("reducer_vs_ddp", world_size=world, timeout=180):
        if world == 2:
            assert r["max_diff_vs_ddp"] == 0.0, r  # same arithmetic as DDP: multiply by 1/2, sum
        else:
            # 3 ranks: Gloo may sum our smaller buckets in another order than DDP's.
            assert r["max_diff_vs_ddp"] < 1e-6, r
        assert r["local_vs_reduced"] > 0, "gradients were not reduced at all"
        assert r["buckets"] >= 3
        assert r["ranks_agree"]
        assert r["grad_is_bucket_view"]


@pytest.mark.parametrize("world", [2, 3])
def test_wrap_on_cpu_trains_eagerly_like_ddp(ranks, world):
    results = ranks("wrap_cpu_vs_ddp", world_size=world, timeout=180)
    for r in results:
        assert not r["graphs_possible"]
        assert "CPU-only" in r["graphs_reason"]
        assert r["phases"] == ["eager"]
        assert r["loop"].startswith("conforms")
        assert r["max_param_diff"] < 1e-6, r
        assert r["losses"] == pytest.approx(r["ref_losses"], rel=1e-5)
        assert r["ranks_agree"]
        assert r["step_count"] == 8  # one optimizer step per iteration, not two
        assert r["is_adamw"] and r["optimizer_class"] == "GraphedAdamW"
        assert "graphs unavailable" in r["report_text"]


@pytest.mark.parametrize("variant,needle", [
    ("clip", "max_grad_norm"),
    ("scaled", "backward() was called on a tensor other than the loss"),
    ("aux", "backward() was called on a tensor other than the loss"),
    ("accumulate", "called again before optimizer.step()"),
    ("no_zero_grad", "zero_grad() was not called"),
    ("grad_edit", "modifies a parameter, gradient"),
])
def test_loop_the_graph_cannot_represent_is_detected(ranks, variant, needle):
    for r in ranks("loop_variant", args=["--variant", variant], timeout=120):
        assert r["loop"].startswith("not graphable"), r
        assert needle in r["loop"], r["loop"]
        assert "common.py:" in r["loop"], "the message should point at the user's line"
        assert r["phases"] == ["eager"]
        # ...and training is exactly what the loop means (DDP running the same loop).
        assert r["max_param_diff"] < 1e-6, r


def test_plain_loop_conforms(ranks):
    for r in ranks("loop_variant", args=["--variant", "plain"], timeout=120):
        assert r["loop"].startswith("conforms"), r["loop"]


def test_scheduler_created_before_wrap_does_not_double_step(ranks):
    for r in ranks("scheduler_before_wrap", timeout=120):
        assert r["adam_steps"] == 6 == r["engine_iterations"]
        assert r["lr"] == pytest.approx(1e-2 * 0.5**3)
        assert r["last_lr"] == pytest.approx(1e-2 * 0.5**3)
        assert r["sd_lr_type"] == "float"


def test_eval_calls_and_clear_errors(ranks):
    for r in ranks("eval_and_errors", timeout=120):
        assert r["eval_loss_is_tensor"]
        assert r["iterations_after_eval"] == 0
        assert "must produce the scalar loss" in r["logits_error"] and "loss_fn" in r["logits_error"]
        assert r["loss_fn_loss"] > 0
        assert "not parameters of the wrapped model" in r["foreign_error"]


def test_backend_fingerprints_and_agreement(ranks):
    results = ranks("fingerprint", timeout=60)
    r0, r1 = results
    assert r0["backend_name"] == "pgd_gloo"
    assert [x["kind"] for x in r0["records"]] == ["broadcast", "allreduce"]
    assert [x["kind"] for x in r1["records"]] == ["allreduce", "broadcast", "allreduce"]
    assert r1["records"][0]["numel"] == 10 and r1["records"][0]["dtype"] == "Float"
    for r in results:
        assert not r["mismatch_agreed"]
        assert "different collective sequences" in r["mismatch_reason"]
        assert "rank 0 broadcast" in r["mismatch_reason"] and "rank 1 allreduce" in r["mismatch_reason"]
        assert r["match_agreed"]
        assert r["captured"] == 0  # nothing is captured on CPU
    assert r0["issued"] >= 6  # every collective went through the wrapper


def test_agreement_names_the_failing_rank(ranks):
    for r in ranks("agreement_failure", timeout=60):
        assert not r["agreed"]
        assert r["reason"] == "rank 1: boom on rank 1"
        assert r["final"] and not r["retry_final"]
