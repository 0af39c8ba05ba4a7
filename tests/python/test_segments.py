"""Segments, padding and selection (issue 5): CPU parts with Gloo ranks, GPU parts
against eager references (skipped without CUDA)."""

from __future__ import annotations

import pytest
import torch

from pygraph_dist.capture import varying_paths
from pygraph_dist.graph_cache import pad_batch


# ------------------------------------------------------------------ CPU
@pytest.mark.parametrize("world", [2, 3])
def test_sparse_and_eager_buckets_train_like_ddp(ranks, world):
    for r in ranks("sparse_vs_ddp", world_size=world, timeout=180):
        # The embedding's bucket is sparse and alone; head.bias is alone and eager.
        assert r["kinds"].count("sparse") == 1 and r["kinds"].count("eager") == 1, r["kinds"]
        assert sum(r["isolated"]) == 2
        assert r["emb_grad_sparse"]
        assert len(r["eager_buckets"]) == 2
        assert any("emb.weight" in b and "sparse gradient" in b for b in r["eager_buckets"]), r["report"]
        assert any("head.bias" in b and "eager_params" in b for b in r["eager_buckets"]), r["report"]
        # Same training as DDP (which all-reduces sparse gradients itself), ranks with
        # different numbers of sparse entries included.
        assert r["max_param_diff"] < 1e-6, r
        assert r["losses"] == pytest.approx(r["ref_losses"], rel=1e-5)
        assert r["ranks_agree"]
        assert "gradient buckets outside the graph" in r["report"]


def test_wrap_refuses_what_sparse_gradients_cannot_do(ranks):
    for r in ranks("sparse_errors", timeout=120):
        assert "does not take sparse gradients" in r["adam"] and "SGD" in r["adam"], r
        assert "max_grad_norm" in r["clip"], r
        assert "nope.weight" in r["unknown"] and "named_parameters" in r["unknown"], r
        assert "select_margin" in r["margin"], r
        assert r["ok"] == ""


def test_padding_reuses_a_signature_and_masked_loss_is_unchanged(ranks):
    for r in ranks("padding", timeout=120):
        # Batches of 16 and 5 rows: 5 is padded to 8, so exactly two signatures.
        assert len(r["signatures"]) == 2, r["signatures"]
        assert any(s.startswith("(8, 32)") for s in r["signatures"]), r["signatures"]
        # Targets padded with ignore_index: the loss and the training are those of
        # the unpadded batches (up to summation order).
        assert r["losses"] == pytest.approx(r["ref_losses"], rel=1e-5, abs=1e-6)
        assert r["max_param_diff"] < 1e-5, r
        # Padded without a mask, the loss of a short batch changes: why padding is opt-in.
        assert abs(r["unmasked_loss"] - r["masked_loss"]) > 1e-4, r


def test_pad_batch_rules():
    x, y, mask = torch.ones(5, 3), torch.arange(5), torch.ones(3)
    (px, py, pm), _ = pad_batch((x, y, mask), {}, (8, 16), (0.5, -100))
    assert px.shape == (8, 3) and torch.equal(px[5:], torch.full((3, 3), 0.5))
    assert py.tolist() == [0, 1, 2, 3, 4, -100, -100, -100]
    assert pm is mask  # not batch-shaped: left alone
    # Exactly a configured size, or above the largest: untouched.
    (same,), _ = pad_batch((torch.ones(8, 2),), {}, (8,), 0)
    assert same.shape == (8, 2)
    (big,), _ = pad_batch((torch.ones(20, 2),), {}, (8, 16), 0)
    assert big.shape == (20, 2)
    _, kw = pad_batch((torch.ones(3, 1),), {"w": torch.ones(3)}, (4,), 0)
    assert kw["w"].tolist() == [1, 1, 1, 0]


def test_varying_gradient_paths_are_named():
    assert varying_paths({frozenset()}) == ""
    assert varying_paths({frozenset({"a.weight"})}) == ""  # always unused: zeros in the graph
    why = varying_paths({frozenset(), frozenset({"branch.weight", "branch.bias"})})
    assert "branch.bias" in why and "branch.weight" in why and "some iterations" in why


# ------------------------------------------------------------------ GPU
@pytest.mark.multigpu
def test_sparse_embedding_eager_dense_graphed_bitwise(ranks):
    for r in ranks("gpu_sparse_segments", args=["--steps", "50"], timeout=300):
        assert r["phase"] == "replay", r["report"]
        assert r["replays"] >= 40, r["report"]
        assert r["segments"].startswith("2 graphs"), r["segments"]
        assert "sparse parameter stepped eagerly" in r["segments"], r["segments"]
        assert len(r["eager_buckets"]) == 2, r["eager_buckets"]
        assert r["n_collectives"] > 0  # the dense buckets' all-reduces are in the graph
        assert r["bitwise"], f"max |diff| {r['max_diff']}\n{r['report']}"
        assert r["losses_equal"] and r["ranks_agree"] and r["emb_moved"]


@pytest.mark.multigpu
def test_bucket_failing_capture_leaves_the_graph_on_all_ranks(ranks):
    for r in ranks("gpu_bucket_capture_failure", args=["--steps", "40"], timeout=300):
        assert r["n_buckets"] >= 3
        assert r["phase"] == "replay", r["report"]
        assert r["replays"] >= 25, r["report"]
        # First capture failed on rank 1 only; both ranks retried with the bucket outside.
        kinds = [e["event"] for e in r["events"]]
        assert kinds[:2] == ["capture failed", "captured"], r["report"]
        assert len(r["eager_buckets"]) == 1 and r["eager_buckets"][0].startswith("bucket 1 "), r["eager_buckets"]
        assert "failed capture" in r["eager_buckets"][0] and "rank 1" in r["eager_buckets"][0], r
        assert r["segments"].startswith("2 graphs"), r["segments"]
        assert r["bitwise"], f"max |diff| {r['max_diff']}\n{r['report']}"
        assert r["ranks_agree"]


@pytest.mark.multigpu
def test_selection_keeps_graphs_that_pay_and_drops_others_collectively(ranks):
    for r in ranks("gpu_selection", args=["--steps", "30"], timeout=300):
        phase, selection, replays, eager_ms, replay_ms = r["kept"]
        assert phase == "replay" and selection.startswith("kept"), r["report"]
        assert 0 < replay_ms < eager_ms, r["kept"]
        phase, selection, replays, reason = r["dropped"]
        assert phase == "eager" and selection.startswith("dropped"), r["report"]
        assert "select_margin" in reason
        assert replays == 3  # the timed replays, then eager for good
        assert r["bitwise_kept"] and r["bitwise_dropped"], r
        assert r["ranks_agree"]


@pytest.mark.multigpu
def test_parameters_used_only_in_some_iterations_keep_that_shape_eager(ranks):
    for r in ranks("gpu_varying_paths", timeout=300):
        assert r["phase"] == "eager" and r["replays"] == 0, r
        assert "branch.weight" in r["reason"] and "some iterations" in r["reason"], r["reason"]
        assert r["bitwise"], r
