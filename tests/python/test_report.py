"""``pygraph_dist.report()``: short by default, consistent with its own table,
and machine-readable.

The record tests build :class:`ModelReport` values by hand for the cases that
contradicted themselves before (a tier-2 loop whose only signature went eager,
nine identical invalidations, the user's own autocast, a kept selection on an
eager signature); the rank tests run real loops (CPU: 2 Gloo ranks; GPU: tier
2, invalidations until eager, a stock NCCL process group).
"""

from __future__ import annotations

import dataclasses

import sys
import contextlib
import json
import logging
import os
import re

import pytest
import torch
import torch.distributed as dist

from torch.nn.utils import clip_grad_norm_ as imported_clip_grad_norm_  # bound before wrap() (clip=9)
import pygraph_dist as pgd
from common import MLP, data, device
from pygraph_dist.reports.report_reasons import split_violations
from pygraph_dist.reports.reporting import GraphReport, ModelReport, Report, summarize
import pygraph_dist.reports.reporting as report_mod  # pgd.report is the function; the module is reporting

MAX_LINES = 12
INPUTS = "(64, 256) int64, (64, 256) int64"
LR_REASON = "param group 0: 'lr' was replaced by another object"
SPLIT_REASON = (
    "backward() was called on a tensor other than the loss returned by the model call (for example "
    "a sum with another loss, a scale that changes from step to step, or scaler.scale(loss)), or with extra arguments "
    "at train.py:120. A whole-iteration graph needs backward() of the returned loss; tier 2 graphs it "
    "per micro-batch; "
    "clip_grad_norm_() modifies a parameter, gradient, optimizer state or learning rate between "
    "backward() and optimizer.step() at train.py:124. A graph would step before this runs. For gradient "
    "clipping pass max_grad_norm=... to pygraph_dist.wrap(); move other gradient changes into the "
    "model's forward/loss, or after optimizer.step().")


# ------------------------------------------------------------------ records
def graph(**kw) -> GraphReport:
    base = dict(inputs=INPUTS, phase="replay", reason="", iterations=301, replays=295,
                eager_iterations=6, capture_attempts=1, recaptures=0, collectives="3 all-reduces",
                n_collectives=3, capture_ms=120.0, setup_s=1.5, pool_mib=300.0, live=True, tier="1",
                was_tier="1")
    base.update(kw)
    return GraphReport(**base)


def model(graphs, events=(), **kw) -> ModelReport:
    base = dict(model="GPT", rank=0, world_size=2, graphs_possible=True, graphs_reason="",
                loop="conforms (checked over 2 probe iterations)", amp="fp32", optimizer="GraphedAdamW",
                optimizer_changes=["fused"], buckets="3 buckets, 40.9 MiB in all (largest 25.0 MiB)",
                backend="graph-safe (pgd_nccl, fingerprints on)", graphs=list(graphs), events=list(events))
    base.update(kw)
    return ModelReport(**base)


def gpt_gone_eager() -> ModelReport:
    """Issue 28's GPT script: tier 2, nine invalidations by an lr object, then eager
    for good, under the script's own bf16 autocast, on a stock backend."""
    events = []
    for i in range(9):
        events.append(dict(iteration=6 + 6 * i, inputs=INPUTS, event="captured",
                           detail=f"not recorded (stock backend); 3 graphs per step; capture {100 + i} ms"))
        outcome = "running eagerly" if i == 8 else "capturing again after warm-up"
        events.append(dict(iteration=9 + 6 * i, inputs=INPUTS, event="invalidated",
                           detail=f"{LR_REASON} ({outcome})"))
    g = graph(phase="eager", live=False, tier="3", was_tier="2", replays=9, eager_iterations=292,
              recaptures=9, autocast="bf16", collectives="not recorded (stock backend)",
              reason=f"{LR_REASON}; the graph was invalidated 9 times, more than max_recaptures=8",
              selection="kept (tier 2 is not timed against eager)",
              segments="3 graphs per step: forward and backward per micro-batch, step at optimizer.step()")
    return model([g], events, stock_backend=True, backend="stock (collective fingerprints off)",
                 loop=f"fits tier 2 (graphs per micro-batch, your code between them); not tier 1 because: "
                      f"{SPLIT_REASON}", tier1_needs=SPLIT_REASON)


def tier2_live_and_short_batch() -> ModelReport:
    live = graph(tier="2", was_tier="2", replays=280, eager_iterations=6, iterations=286,
                 selection="kept (tier 2 is not timed against eager)")
    short = graph(inputs="(8, 256) int64, (8, 256) int64", phase="eager", live=False, tier="3", was_tier="",
                  replays=0, eager_iterations=15, iterations=15, capture_ms=0.0, pool_mib=0.0,
                  reason="evicted from the graph cache (least recently used; max_graphs=1)")
    return model([live, short], tier1_needs=SPLIT_REASON,
                 loop=f"fits tier 2 (graphs per micro-batch, your code between them); not tier 1 because: "
                      f"{SPLIT_REASON}")


def flat(text: str) -> str:
    """The text with folded lines joined (the default form folds long lines)."""
    return " ".join(text.split())


def header_claims(text: str) -> tuple[set[str], bool]:
    """The tiers the first line says replayed, and whether it says they ended eager."""
    first = text.splitlines()[0]
    return set(re.findall(r"tier (\d)", first)), "then eager" in first


def check_consistent(m: ModelReport) -> None:
    """The summary line and the table say the same thing about what ran."""
    s = summarize(m)
    default, verbose = Report([m]).text(), Report([m]).text(verbose=True)
    tiers, then_eager = header_claims(default)
    assert tiers == set(s["tiers"] or s["was_tiers"]), default
    assert then_eager == (not s["tiers"] and bool(s["was_tiers"])), default
    # The verbose "ran:" line is the default's first line, word for word.
    ran = default.splitlines()[0].split(": ", 1)[1]
    assert f"  ran: {ran}" in verbose.splitlines(), verbose
    # Each table row's status is the signature's record.
    for g in m.graphs:
        row = next(line for line in verbose.splitlines() if line.startswith(f"  {g.inputs[:34]}"))
        if g.phase == "eager":
            assert "eager" in row and f"tier {g.tier}" not in row, row
            assert (f"was tier {g.was_tier}" in row) == bool(g.was_tier), row
        elif g.live:
            assert f"tier {g.tier}" in row, row
    # Nothing claims a kept graph for a signature that ended eager.
    if all(g.phase == "eager" for g in m.graphs):
        assert "selection: kept" not in verbose, verbose
        assert "not tier 1 because" not in default, default  # tier 2 is not running
    assert sum(g.replays for g in m.graphs) == s["replayed"]


def test_tier2_verdict_then_eager_is_reported_as_eager():
    m = gpt_gone_eager()
    check_consistent(m)
    text = str(Report([m]))
    lines = text.splitlines()
    assert len(lines) <= MAX_LINES, text
    assert lines[0].endswith("301 steps, 9 replayed (tier 2, then eager), 292 eager"), lines[0]
    # One sentence with its fix; the repeats counted, not listed.
    assert "eager: invalidated 9x (max_recaptures=8) — param group 0: 'lr' was replaced by another object" \
        in flat(text) and "Fix: change the value in place" in flat(text), text
    assert flat(text).count(LR_REASON) == 1, text
    assert "precision: user autocast bf16" in flat(text) and "amp fp32" not in flat(text), text
    assert "stock backend: collective fingerprints off" in flat(text) and "pgd.init()" in flat(text), text
    assert "init_process_group(backend='cpu:gloo,cuda:pgd_nccl')" in flat(text), text


def test_repeated_events_are_counted():
    m = gpt_gone_eager()
    s = summarize(m)
    groups = {g["event"]: g for g in s["events"]}
    assert groups["invalidated"]["count"] == 9 and groups["invalidated"]["detail"] == LR_REASON, groups
    assert groups["invalidated"]["outcome"] == "running eagerly"
    assert groups["captured"]["count"] == 9  # details differ (timings); counted by name
    verbose = Report([m]).text(verbose=True)
    assert "invalidated 9x, iterations 9-57" in flat(verbose) and "captured 9x" in flat(verbose), verbose
    assert flat(verbose).count(LR_REASON) == 2, verbose  # the table's reason and the one event group
    # Events the eager line does not already say appear counted in the default form.
    extra = [dict(iteration=100 + i, inputs=INPUTS, event="capture failed",
                  detail="operation not permitted when stream is capturing (will retry after warm-up)")
             for i in range(4)]
    text = str(Report([model(m.graphs, m.events + extra)]))
    assert "events: capture failed 4x — operation not permitted" in flat(text), text
    # Details that differ only in their numbers are one group, shown by the latest.
    wd = [dict(iteration=10 * i, inputs=INPUTS, event="invalidated",
               detail=f"param group 0: 'weight_decay' changed from {0.01 * i:g} to {0.01 * (i + 1):g} "
                      "(capturing again after warm-up)") for i in range(1, 6)]
    groups = summarize(model([graph()], wd))["events"]
    assert len(groups) == 1 and groups[0]["count"] == 5 and groups[0]["varies"], groups
    text = str(Report([model([graph()], wd)]))
    assert ("events: invalidated 5x — param group 0: 'weight_decay' changed from 0.05 to 0.06 "
            "(the latest; values vary)") in flat(text), text


def test_tier2_running_and_a_short_batch_eager():
    m = tier2_live_and_short_batch()
    check_consistent(m)
    text = str(Report([m]))
    assert len(text.splitlines()) <= MAX_LINES, text
    assert "301 steps, 280 replayed (tier 2), 21 eager" in flat(text), text
    assert "[(8, 256) int64, (8, 256) int64] eager: 0 replayed, 15 eager" in flat(text), text
    assert "Fix: raise wrap(max_graphs=...)" in flat(text), text
    assert "not tier 1 because: backward() was called on a tensor other than the loss" in flat(text), text
    assert "(+1 more)" in flat(text), text
    verbose = Report([m]).text(verbose=True)
    # The loop check's reasons one per line, none a paragraph.
    assert any(line.startswith("    - clip_grad_norm_() modifies a parameter")
               for line in verbose.splitlines()), verbose
    assert max(len(line) for line in verbose.splitlines()) <= 160, verbose
    assert summarize(m)["status"] == "partly eager"


def test_tier2_says_where_your_loss_and_clip_ran():
    """The default form's tier-2 line: the loss lane and the clip, counted."""
    lane = ("your loss (cross_entropy) inside the backward graph (270 steps; 10 steps eager: the loss was "
            "read before backward() (loss.item())); your clip_grad_norm_(max_norm=1) a graph of its own "
            "(280 replays)")
    m = dataclasses.replace(tier2_live_and_short_batch(), tier2_user_code=lane)
    text = str(Report([m]))
    assert f"tier 2 ran: {lane}" in flat(text), text
    assert len(text.splitlines()) <= MAX_LINES, text
    assert summarize(m)["tier2_user_code"] == lane
    # Without tier 2 nothing is said.
    assert "tier 2 ran:" not in str(Report([dataclasses.replace(tier2_live_and_short_batch(), tier2_user_code="")]))


def test_tier1_timed_and_precision_of_wrap_amp():
    m = model([graph(replay_ms=0.9, eager_ms=2.4)], amp="bf16 (fp32 casts in graphs: Triton)")
    check_consistent(m)
    text = str(Report([m]))
    assert "301 steps, 295 replayed (tier 1), 6 eager (probe, warm-up, capture); 0.90 ms/step replayed " \
           "vs 2.40 eager (2.67x)" in flat(text), text
    assert "precision: amp bf16 (wrap)" in flat(text), text
    mixed = model([graph(autocast="bf16"), graph(inputs="(8,) float32", autocast="")])
    assert summarize(mixed)["precision"] == "user autocast bf16 (1 of 2 input signatures; fp32 otherwise)"


def test_default_stays_short_with_many_signatures_and_events():
    gs = [graph(inputs=f"({b}, 32) float32", phase="eager", live=False, tier="3", was_tier="1", replays=3,
                eager_iterations=10, iterations=13, reason=f"reason number {b % 4}") for b in range(20)]
    events = [dict(iteration=i, inputs=f"({i % 20}, 32) float32", event=kind, detail=f"{kind} detail {i % 3}")
              for i, kind in enumerate(["invalidated", "capture failed", "argument varies", "not kept"] * 15)]
    m = model(gs, events, stock_backend=True, compile="compiled by the user: 3 compilation(s), 12.0 s; 2 after",
              accumulation="learned: 4 micro-batches per step, all-reduced on the last; 9 skipped",
              skipped_steps=2)
    check_consistent(m)
    text = str(Report([m]))
    assert len(text.splitlines()) <= MAX_LINES, text
    assert "... and 18 more input signatures" in flat(text), text
    assert "(and 2 more reasons for eager steps)" in flat(text), text
    assert "accumulation 4 micro-batches per step · 2 non-finite steps skipped" in flat(text), text


def test_as_dict_round_trips_through_json():
    r = Report([gpt_gone_eager(), tier2_live_and_short_batch()])
    d = r.as_dict()
    assert json.loads(json.dumps(d)) == d
    assert json.loads(r.to_json()) == d
    s = d["models"][0]["summary"]
    assert (s["status"], s["tiers"], s["was_tiers"], s["replayed"]) == ("eager", [], ["2"], 9)
    assert s["eager_reasons"][0]["invalidations"] == 9 and s["eager_reasons"][0]["fix"]
    assert d["models"][0]["graphs"][0]["autocast"] == "bf16"
    scalars = r.scalars()
    assert scalars["pygraph_dist/GPT/replayed"] == 9 and scalars["pygraph_dist/GPT#2/replayed"] == 280


def test_split_violations_keeps_semicolons_inside_fixes():
    items = split_violations(SPLIT_REASON)
    assert len(items) == 2 and items[0].endswith("tier 2 graphs it per micro-batch"), items
    assert items[1].startswith("clip_grad_norm_()") and "pygraph_dist.wrap(); move" in items[1]
    assert split_violations("one reason; with a semicolon") == ["one reason; with a semicolon"]


def test_stock_backend_warning_once_per_group(caplog, monkeypatch):
    from types import SimpleNamespace

    monkeypatch.setattr(report_mod, "_stock_said", set())
    group = object()
    engine = SimpleNamespace(device=torch.device("cuda", 0), graphs_possible=True, fp_backend=None,
                             rank=0, group=group)
    with caplog.at_level(logging.WARNING, logger="pygraph_dist"):
        report_mod.warn_stock_backend(engine)
        report_mod.warn_stock_backend(engine)  # a second model on the same group: said already
        report_mod.warn_stock_backend(SimpleNamespace(**{**vars(engine), "fp_backend": object(),
                                                         "group": object()}))
        report_mod.warn_stock_backend(SimpleNamespace(**{**vars(engine), "rank": 1, "group": object()}))
        report_mod.warn_stock_backend(SimpleNamespace(**{**vars(engine), "device": torch.device("cpu"),
                                                         "group": object()}))
    said = [r.getMessage() for r in caplog.records if "stock backend" in r.getMessage()]
    assert len(said) == 1, said
    assert "collective fingerprints are off" in said[0] and "pygraph_dist.launch.backend.register()" in said[0]


def test_report_without_a_wrapped_model():
    assert str(pgd.report()) == "pygraph_dist: no wrapped model in this process"
    assert pgd.report(as_dict=True) == {"models": []}


# -------------------------------------------------------------------- ranks
class InnerAutocast(torch.nn.Module):
    """A module whose forward enters bf16 autocast itself."""

    def __init__(self, inner: torch.nn.Module, device_type: str) -> None:
        super().__init__()
        self.inner, self.device_type = inner, device_type

    def forward(self, *args):
        with torch.autocast(self.device_type, dtype=torch.bfloat16):
            return self.inner(*args)


def loop_report(variant="readme", steps=10, autocast="", backend="auto", clip=0, select=1):
    """Rank body: a loop through pgd.wrap(), and what report() says about it.

    variant: readme (loss from the model), aux (a regulariser over the
    parameters outside the model: eager on any device), div1 (backward() of
    loss / 1, as Accelerate's backward() at gradient_accumulation_steps=1),
    inner (bf16 autocast inside the module's forward, as Accelerate patches
    it in), wd (weight_decay
    changed every 5 steps: invalidations until eager). clip: clip_grad_norm_
    between backward and step, over all parameters (1: inside the step graph,
    tier 1), all but one (2: tier 2 on a GPU), twice (3), with
    error_if_nonfinite=True (4), in the first step only (5), over an unwrapped
    model's parameters (6: torch's own, as if pygraph_dist were not there),
    with a tensor max_norm (7), after optimizer.step() (8), through a name the
    module imported before wrap() (9: rebound at wrap()), with max_norm=inf (10:
    the norm only, as Trainer logs it with max_grad_norm=0). backend: "auto" (pgd.init())
    or a stock backend name given to init_process_group directly. select: wrap(select=...)."""
    said: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            said.append(record.getMessage())

    logging.getLogger("pygraph_dist").addHandler(Keep(logging.WARNING))
    if backend == "auto":
        pgd.init()
    else:
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group(backend)  # env:// from the launcher, as mp.spawn scripts do
    rank, dev = dist.get_rank(), device()
    torch.manual_seed(0)
    base = (InnerAutocast(MLP(), dev.type) if variant == "inner" else MLP()).to(dev)
    opt = torch.optim.AdamW(base.parameters(), lr=1e-3, weight_decay=0.01)
    model, opt = pgd.wrap(base, opt, select=bool(select))
    other = MLP().to(dev)  # never wrapped (clip=6)
    ac = (torch.autocast(dev.type, dtype=getattr(torch, autocast)) if autocast
          else contextlib.nullcontext())
    for step in range(steps):
        if variant == "wd" and step % 5 == 0:
            for g in opt.param_groups:
                g["weight_decay"] = 0.01 * (1 + step)
        x, y = data(step, rank, device=dev)
        opt.zero_grad(set_to_none=True)
        with ac:
            loss = model(x, y)
        if variant == "aux":
            loss = loss + 1e-4 * sum(p.pow(2).sum() for p in model.parameters())
        if variant == "div1":
            loss = loss / 1
        if variant == "hook":  # a hook on the loss: tier 1 would run the backward without it
            loss = loss / 1
            loss.register_hook(lambda g: g * 2)
        if variant in ("imul1", "imul2"):
            loss *= 1 if variant == "imul1" else 2  # transformers' compute_loss scales in place
        if variant == "imul_varies":  # a different number every other step: no graph can seed it
            loss *= 1 + step % 2
        loss.backward()
        if clip:  # see the docstring: which clip_grad_norm_ calls can move into the step graph
            params = list(model.parameters())
            if clip in (1, 3) or (clip == 5 and step == 0):
                torch.nn.utils.clip_grad_norm_(params, 1.0)
            elif clip == 2:
                torch.nn.utils.clip_grad_norm_(params[1:], 1.0)
            elif clip == 4:
                torch.nn.utils.clip_grad_norm_(params, 1.0, error_if_nonfinite=True)
            elif clip == 6:
                torch.nn.utils.clip_grad_norm_(other.parameters(), 1.0)
            elif clip == 7:
                torch.nn.utils.clip_grad_norm_(params, torch.tensor(1.0))
            elif clip == 9:
                imported_clip_grad_norm_(params, 1.0)
            elif clip == 10:
                torch.nn.utils.clip_grad_norm_(params, float("inf"))
            if clip == 3:
                torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        if clip == 8:  # after the step (a norm logged): the loop's own call, as in eager training
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)
    r = pgd.report()
    d = pgd.report(as_dict=True)
    m = r.models[-1]
    return {"text": str(r), "verbose": str(pgd.report(verbose=True)), "dict": d,
            "json_equal": json.loads(json.dumps(d)) == d, "summary": summarize(m),
            "tiers": [g.tier for g in m.graphs], "phases": [g.phase for g in m.graphs],
            "stock_warnings": [s for s in said if "stock backend" in s]}


@pytest.mark.parametrize("variant", ["readme", "aux"])
def test_report_of_a_cpu_loop_is_short_and_consistent(ranks, variant):
    for r in ranks("test_report:loop_report", timeout=120,
                   kwargs={"variant": variant, "autocast": "bfloat16" if variant == "readme" else ""}):
        text, verbose = r["text"], r["verbose"]
        assert len(text.splitlines()) <= MAX_LINES, text
        assert r["json_equal"] and r["dict"]["models"][0]["summary"] == r["summary"]
        assert r["phases"] == ["eager"] and r["summary"]["replayed"] == 0
        assert text.splitlines()[0].endswith("10 steps, all eager"), text
        assert "graphs unavailable:" in flat(text), text  # no CUDA graphs on a CPU: said once, first
        assert "tier" not in text.splitlines()[0], text
        assert "status" in flat(verbose) and "loop check:" in flat(verbose), verbose
        if variant == "readme":
            assert "precision: user autocast bf16" in flat(text), text
            assert "autocast: bf16 (yours, around the model call)" in flat(verbose), verbose
            assert verbose.count("loop check: conforms") == 1, verbose
        else:
            assert "eager: the loss's backward reaches model parameters directly" in flat(text), text
            assert "test_report.py:" in flat(text) and "precision: fp32" in flat(text), text
            assert "loop check: not graphable:" in flat(verbose), verbose
        assert not r["stock_warnings"]  # CPU: no fingerprints to lose


@pytest.mark.parametrize("variant", ["div1", "imul1", "imul2", "imul_varies", "hook", "inner"])
def test_loss_over_one_conforms_and_inner_autocast_is_reported(ranks, variant):
    """backward() of loss / 1, or of the loss scaled by the same numbers at
    every step (loss *= 2), keeps the loop fit for tier 1 (the graph seeds its
    backward with them); a scale that changes does not. Autocast entered
    inside forward is the precision reported."""
    for r in ranks("test_report:loop_report", timeout=120, kwargs={"variant": variant}):
        text, verbose = r["text"], r["verbose"]
        if variant == "imul_varies":  # loss *= 2 conforms (the graph's seed); a scale that varies does not
            assert "loop check: conforms" not in verbose, verbose
            assert "backward() was called on a tensor other than the loss" in flat(verbose), verbose
            continue
        if variant == "hook":
            assert "loop check: conforms" not in verbose, verbose
            assert "register_hook() on a tensor" in flat(verbose), verbose
            continue
        assert verbose.count("loop check: conforms") == 1, verbose
        if variant == "inner":
            assert "precision: autocast bf16 inside the model's forward" in flat(text), text
        else:
            assert "precision: fp32" in flat(text), text


CLIP_REASONS = {
    2: "cannot move into the step graph: the call clips part of the model's trainable parameters",
    3: "clip_grad_norm_() was called twice in one step",
    4: "cannot move into the step graph: error_if_nonfinite=True reads the norm on the host",
    5: "clip_grad_norm_() was called differently (or not at all) in some probe iterations",
    7: "cannot move into the step graph: max_norm or norm_type is not a Python number",
}


@pytest.mark.parametrize("clip", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10])
def test_a_clip_over_all_parameters_conforms(ranks, clip):
    """clip_grad_norm_ over all the model's parameters, once per step, keeps the
    loop fit for tier 1 (so does a clip of a model pygraph_dist does not wrap);
    any other clip does not, and the check says why."""
    for r in ranks("test_report:loop_report", timeout=120, kwargs={"clip": clip}):
        verbose = r["verbose"]
        if clip in (1, 6, 8, 9, 10):
            assert verbose.count("loop check: conforms") == 1, verbose
        else:
            assert "loop check: conforms" not in verbose, verbose
            assert CLIP_REASONS[clip] in flat(verbose), verbose


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["div1", "imul1", "imul2"])
def test_loss_over_one_replays_tier1_on_gpu(ranks, variant):
    r, = ranks("test_report:loop_report", world_size=1, timeout=300, kwargs={"variant": variant, "steps": 20})
    assert r["tiers"] == ["1"] and r["phases"] == ["replay"], r["verbose"]


@pytest.mark.gpu
def test_report_of_a_tier2_loop_on_gpu(ranks):
    for r in ranks("test_report:loop_report", world_size=1, timeout=300,
                   kwargs={"variant": "readme", "clip": 2, "steps": 30, "autocast": "bfloat16"}):
        text = r["text"]
        assert len(text.splitlines()) <= MAX_LINES, text
        assert r["tiers"] == ["2"] and r["summary"]["tiers"] == ["2"], r["verbose"]
        assert "replayed (tier 2)" in text.splitlines()[0], text
        assert "not tier 1 because: clip_grad_norm_()" in flat(text), text
        assert "clips part of the model's trainable parameters" in flat(r["verbose"]), r["verbose"]
        assert "precision: user autocast bf16" in flat(text), text
        assert "stock backend" not in flat(text) and not r["stock_warnings"], text  # pgd.init(): graph-safe
        assert r["json_equal"]


@pytest.mark.gpu
@pytest.mark.parametrize("clip", [1, 9])
def test_report_of_a_clipping_loop_on_gpu(ranks, clip):
    """clip_grad_norm_(model.parameters(), 1.0) in the loop (9: through a name
    imported before wrap()): tier 1, and the report says where the clipping went."""
    r, = ranks("test_report:loop_report", world_size=1, timeout=300,
               kwargs={"variant": "readme", "clip": clip, "steps": 20})
    assert r["tiers"] == ["1"] and r["phases"] == ["replay"], r["verbose"]
    assert "your clip_grad_norm_(max_norm=1) inside the step graph" in flat(r["verbose"]), r["verbose"]


@pytest.mark.gpu
def test_report_counts_invalidations_until_eager_on_gpu(ranks):
    for r in ranks("test_report:loop_report", world_size=1, timeout=300,
                   kwargs={"variant": "wd", "steps": 70, "select": 0}):  # no drop before 9 invalidations
        text, verbose = r["text"], r["verbose"]
        assert len(text.splitlines()) <= MAX_LINES, text
        assert r["phases"] == ["eager"] and r["summary"]["was_tiers"] == ["1"], verbose
        assert "(tier 1, then eager)" in text.splitlines()[0], text
        assert ("eager: invalidated 9x (max_recaptures=8) — param group 0: 'weight_decay' changed"
                in flat(text)), text
        assert "selection: kept" not in verbose, verbose
        assert re.search(r"invalidated 9x, iterations \d+-\d+", verbose), verbose


@pytest.mark.gpu
@pytest.mark.parametrize("world", [1, pytest.param(2, marks=pytest.mark.multigpu)])
def test_stock_backend_is_said_at_wrap_and_in_the_report(ranks, world):
    results = ranks("test_report:loop_report", world_size=world, timeout=300,
                    kwargs={"backend": "nccl", "steps": 12})
    for rank, r in enumerate(results):
        assert len(r["stock_warnings"]) == (rank == 0), r["stock_warnings"]  # once, on rank 0
        assert "stock backend: collective fingerprints off" in flat(r["text"]), r["text"]
        assert "pygraph_dist.launch.backend.register()" in flat(r["text"]), r["text"]
        assert r["dict"]["models"][0]["stock_backend"] is True
    assert "collective fingerprints are off" in results[0]["stock_warnings"][0]



def test_a_line_inside_a_framework_is_named_with_the_loops_own(tmp_path):
    """A violation inside Fabric's, Accelerate's or the Trainer's code (their
    backward() call) is located there, from the package down, and at the
    innermost line outside the frameworks that led there."""
    import os

    from pygraph_dist.loop.monitor import user_location

    src = tmp_path / "site-packages" / "accelerate" / "loop.py"
    src.parent.mkdir(parents=True)
    src.write_text("def backward(fn):\n    return fn()\n")
    space = {"__name__": "accelerate.loop"}
    exec(compile(src.read_text(), str(src), "exec"), space)  # noqa: S102 - a module of a fake framework
    line = sys._getframe().f_lineno + 1
    where = space["backward"](user_location)
    assert where == f"accelerate/loop.py:2 (from {os.path.relpath(__file__)}:{line})", where
    assert user_location().startswith(os.path.relpath(__file__) + ":")  # the loop's own line alone
