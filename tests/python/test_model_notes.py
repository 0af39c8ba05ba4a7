"""model_notes.py: a model that computes differently when captured is named in the
report, never left as a silent difference (CPU; a stand-in for transformers)."""

import sys
import types

import pytest
import torch
from torch import nn

from pygraph_dist.reports.model_notes import capture_divergences
from pygraph_dist.reports.reporting import ModelReport, Report


class Attention(nn.Module):
    def __init__(self, impl: str, heads: int, kv: int):
        super().__init__()
        self.config = types.SimpleNamespace(_attn_implementation=impl, num_attention_heads=heads,
                                            num_key_value_heads=kv)
        self.proj = nn.Linear(4, 4)


class Decoder(nn.Module):
    def __init__(self, *args):
        super().__init__()
        self.layers = nn.ModuleList([Attention(*args)])

    def forward(self, x):
        return self.layers[0].proj(x)


@pytest.fixture
def transformers_that_branches(monkeypatch):
    """transformers as 5.x is: its is_tracing() counts CUDA stream capture."""
    root = types.ModuleType("transformers")
    root.__version__ = "5.17.0"
    utils = types.ModuleType("transformers.utils.import_utils")
    utils.is_cuda_stream_capturing = lambda: False
    monkeypatch.setitem(sys.modules, "transformers", root)
    monkeypatch.setitem(sys.modules, "transformers.utils.import_utils", utils)
    return utils


def test_grouped_query_sdpa_is_named(transformers_that_branches):
    (note,) = capture_divergences(Decoder("sdpa", 4, 2))
    assert note.startswith("Attention (transformers 5.17.0): graphed steps are not bitwise"), note
    assert "grouped-query attention (4 query heads, 2 key/value heads)" in note, note
    assert "not bitwise equal to graphs=False" in note and 'attn_implementation="eager"' in note, note


@pytest.mark.parametrize("args", [("sdpa", 4, 4), ("eager", 4, 2), ("flash_attention_2", 4, 2), ("sdpa", 4, 0)])
def test_other_attention_is_not_named(transformers_that_branches, args):
    """Without grouped keys, or without SDPA, the measured paths are bitwise."""
    assert capture_divergences(Decoder(*args)) == []


def test_an_eager_attention_encoder_is_named(transformers_that_branches, monkeypatch):
    """MPNet: an encoder whose library module builds bidirectional masks, with eager
    attention; the same with SDPA, or a decoder, is not named."""
    library = types.ModuleType("transformers.models.fake_encoder")
    library.create_bidirectional_mask = lambda *a, **k: None
    monkeypatch.setitem(sys.modules, library.__name__, library)

    class EncoderLayer(Attention):
        pass

    EncoderLayer.__module__ = library.__name__

    def encoder(impl, is_decoder=False):
        m = Decoder("eager", 4, 4)
        m.layers[0] = EncoderLayer(impl, 4, 4)
        m.layers[0].config.is_decoder = is_decoder
        return m

    (note,) = capture_divergences(encoder("eager"))
    assert note.startswith("EncoderLayer (transformers 5.17.0): graphed steps are not bitwise equal to "
                           "graphs=False (close)"), note
    assert "bidirectional attention mask" in note, note
    assert capture_divergences(encoder("sdpa")) == []
    assert capture_divergences(encoder("eager", is_decoder=True)) == []
    monkeypatch.delattr(library, "create_bidirectional_mask")
    assert capture_divergences(encoder("eager")) == []


def test_transformers_that_does_not_branch_on_capture(transformers_that_branches, monkeypatch):
    monkeypatch.delattr(transformers_that_branches, "is_cuda_stream_capturing")
    assert capture_divergences(Decoder("sdpa", 4, 2)) == []


def test_no_transformers_imported(monkeypatch):
    monkeypatch.delitem(sys.modules, "transformers.utils.import_utils", raising=False)
    assert capture_divergences(Decoder("sdpa", 4, 2)) == []


def _report(numerics: list[str]) -> ModelReport:
    return ModelReport(
        model="MistralForCausalLM", rank=0, world_size=1, graphs_possible=True, graphs_reason="",
        loop="conforms (checked over 2 probe iterations)", amp="bf16", optimizer="AdamW",
        optimizer_changes=[], buckets="1 bucket", backend="graph-safe (pgd_nccl, fingerprints on)",
        numerics=numerics)


def test_the_report_says_it_in_both_texts_and_the_dict(transformers_that_branches):
    notes = capture_divergences(Decoder("sdpa", 4, 2))
    m = _report(notes)
    default, verbose = Report([m]).text(), Report([m], verbose=True).text()
    # the outcome comes first, so the default report's shortened line still says it
    assert "  numerics: Attention (transformers 5.17.0): graphed steps are not bitwise equal to graphs=False" \
        in default, default
    assert 'attn_implementation="eager"' in default and 'attn_implementation="eager"' in " ".join(verbose.split())
    assert Report([m]).as_dict()["models"][0]["numerics"] == notes
    plain = Report([_report([])])
    assert "numerics" not in plain.text() and "numerics" not in plain.text(verbose=True)


def engine_numerics() -> dict:
    """Rank body: a grouped-query "transformers" model wrapped and trained on CPU."""
    import pygraph_dist as pgd

    root = types.ModuleType("transformers")
    root.__version__ = "5.17.0"
    utils = types.ModuleType("transformers.utils.import_utils")
    utils.is_cuda_stream_capturing = lambda: False
    sys.modules.update({"transformers": root, "transformers.utils.import_utils": utils})
    pgd.init()
    model = Decoder("sdpa", 4, 2)
    wrapped, opt = pgd.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    for _ in range(3):
        wrapped(torch.ones(2, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
    m = pgd.report().models[-1]
    return {"numerics": m.numerics, "signatures": len(m.graphs), "replays": sum(g.replays for g in m.graphs),
            "note_for_the_model": capture_divergences(model)}


def test_engine_says_it_only_after_a_graph_replayed(ranks):
    """On CPU nothing is captured, so nothing differs: no note, though the model has one."""
    (r,) = ranks("test_model_notes:engine_numerics", world_size=1)
    assert r["note_for_the_model"] and r["signatures"] and r["replays"] == 0, r
    assert r["numerics"] == [], r
