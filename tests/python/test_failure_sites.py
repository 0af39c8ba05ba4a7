"""A failed capture's reason names the line that raised (issue 46, item 3).

``describe_capture_error`` walks the exception's traceback (root cause first)
for the innermost frame outside torch, pygraph_dist and the standard library:
the user's model line, or a library's (``transformers/...py:N``, followed by the
user's line that led there). The report carries it as ``where``. CPU only: the
"torch" and "pygraph_dist" frames around the user's code are compiled with file
names inside those packages, the user's and the library's are real files.

Also here: what Lightning hands users to print (``strategy.last_report``, a
:class:`ModelReport`) prints the text report (item 5), and captures do not warn
"The CUDA Graph is empty" (GPU).
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import types
import warnings
from dataclasses import asdict

import pytest
import torch

import pygraph_dist as pgd
from pygraph_dist.runtime._ext import C
from pygraph_dist.tiers.capture import GraphRunner
from pygraph_dist.graphs.capture_guard import describe_capture_error, error_site
from pygraph_dist.reports.report_reasons import failure_where
from pygraph_dist.graphs.graph_cache import GraphCache
from pygraph_dist.loop.monitor import _PKG_DIR, _TORCH_DIR
from pygraph_dist.reports.reporting import ModelReport, Report

PINNED = ("Cannot copy between CPU and CUDA tensors during CUDA graph capture unless the CPU tensor "
          "is pinned")


def _code_in(directory: str, name: str, source: str) -> dict:
    """Functions whose frames carry a file name inside ``directory`` (torch's or ours)."""
    space: dict = {"__name__": f"fake_{name}", "PINNED": PINNED, "describe": describe_capture_error}
    exec(compile(source, os.path.join(directory, f"_fake_{name}.py"), "exec"), space)  # noqa: S102
    return space


# torch's side: an op that refuses the copy, and torch.cuda.graph's exit, which
# ends the capture and raises its own error with the body's as context.
TORCH = _code_in(_TORCH_DIR, "torch_ops", '''
def copy_to_device(x):
    raise RuntimeError(PINNED)

class graph:
    def __enter__(self):
        return self
    def __exit__(self, *exc):
        if exc[0] is not None:
            raise RuntimeError("CUDA error: operation failed due to a previous error during capture")
''')

# pygraph_dist's side: GraphRunner._capture, which catches and describes.
OURS = _code_in(_PKG_DIR, "capture", '''
def capture(fn, *args):
    try:
        fn(*args)
    except Exception as exc:
        return exc, describe(exc)

def capture_in_graph(fn, *args):
    try:
        with TORCH_graph():
            fn(*args)
    except Exception as exc:
        return exc, describe(exc)
''')
OURS["TORCH_graph"] = TORCH["graph"]


def _load(path, name: str) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, str(path))
    module = importlib.util.module_from_spec(spec)
    module.copy_to_device = TORCH["copy_to_device"]
    spec.loader.exec_module(module)
    return module


def _line(path, text: str) -> int:
    return next(i for i, line in enumerate(path.read_text().splitlines(), 1) if text in line)


USER_MODEL = '''import torch


def forward(x):
    y = x * 2
    return copy_to_device(y)  # the host copy


def shapes(x):
    return torch.ones(2) + torch.ones(3)  # a real torch error, raised in C++
'''


@pytest.fixture
def user_model(tmp_path):
    path = tmp_path / "user_model.py"
    path.write_text(USER_MODEL)
    return path, _load(path, "user_model")


def test_reason_names_the_users_line(user_model):
    path, mod = user_model
    error, (reason, retryable) = OURS["capture"](mod.forward, torch.ones(2))
    where = f"{os.path.relpath(path)}:{_line(path, 'the host copy')}"
    assert reason == f"RuntimeError: {PINNED}; raised at {where} in forward()", reason
    assert retryable
    assert failure_where(reason) == where
    site = error_site(error)
    assert (site.where, site.function, site.user) == (where, "forward", "")
    # An error torch raises in C++: the innermost Python frame is the user's line.
    error, (reason, _) = OURS["capture"](mod.shapes, None)
    assert reason.startswith("RuntimeError: The size of tensor a (2) must match"), reason
    assert failure_where(reason) == f"{os.path.relpath(path)}:{_line(path, 'raised in C++')}", reason


def test_chained_error_names_the_bodys_line(user_model):
    """torch.cuda.graph's exit raises capture_end's error (from torch's and our
    frames only) with the body's error as its context: the reason quotes the
    body's error, at the body's line."""
    path, mod = user_model
    error, (reason, _) = OURS["capture_in_graph"](mod.forward, torch.ones(2))
    assert "previous error during capture" in str(error) and isinstance(error.__context__, RuntimeError)
    where = f"{os.path.relpath(path)}:{_line(path, 'the host copy')}"
    assert reason == f"RuntimeError: {PINNED}; raised at {where} in forward()", reason
    # The same from an explicit cause (raise ... from ...).
    try:
        try:
            mod.forward(torch.ones(2))
        except RuntimeError as cause:
            raise RuntimeError("capture_end failed") from cause  # this file's line: not named
    except RuntimeError as exc:
        reason = describe_capture_error(exc)[0]
        assert reason.startswith(f"RuntimeError: {PINNED}") and failure_where(reason) == where, reason


def test_no_line_outside_torch_and_ours():
    """Every frame torch's or ours: no line is named, rather than a wrong one."""
    error, (reason, _) = OURS["capture"](TORCH["copy_to_device"], None)
    assert reason == f"RuntimeError: {PINNED}", reason
    assert error_site(error) is None and failure_where(reason) == ""
    assert describe_capture_error(None) == ("", True)


FRAMEWORK_MODEL = '''import torch


class Attention:
    def forward(self, x):
        mask = copy_to_device(x)  # transformers' own line
        return mask
'''

TRAIN = '''def step(capture, model, x):
    return capture(model.forward, x)  # the user's line
'''


def test_a_librarys_line_with_the_users(tmp_path):
    """A model from a library: its line, from the package down, then the user's
    line that led there -- here outside the traceback, on the stack (the loop's
    call of the wrapped model)."""
    lib = tmp_path / "site-packages" / "transformers" / "models" / "fake" / "modeling_fake.py"
    lib.parent.mkdir(parents=True)
    lib.write_text(FRAMEWORK_MODEL)
    model = _load(lib, "transformers.models.fake.modeling_fake").Attention()
    train = tmp_path / "train.py"
    train.write_text(TRAIN)
    error, (reason, _) = _load(train, "train").step(OURS["capture"], model, torch.ones(2))
    where = f"transformers/models/fake/modeling_fake.py:{_line(lib, 'own line')}"
    user = f"{os.path.relpath(train)}:{_line(train, 'the user')}"
    assert reason == f"RuntimeError: {PINNED}; raised at {where} in forward() (from {user})", reason
    assert failure_where(reason) == where
    # A library that is no framework (timm, torchvision): named from site-packages down, alone.
    timm = tmp_path / "site-packages" / "timm" / "layers" / "attn.py"
    timm.parent.mkdir(parents=True)
    timm.write_text(FRAMEWORK_MODEL)
    error, (reason, _) = OURS["capture"](_load(timm, "timm.layers.attn").Attention().forward, None)
    assert reason.endswith(f"; raised at timm/layers/attn.py:{_line(timm, 'own line')} in forward()"), reason


def test_torchvision_is_not_torch():
    """torch's directory is a prefix of torchvision's: only torch itself is passed over."""
    from pygraph_dist.loop.monitor import _internal, _passed_over

    assert _internal(os.path.join(_TORCH_DIR, "nn", "modules", "module.py"))
    assert not _internal(_TORCH_DIR + "vision" + os.sep + "models" + os.sep + "resnet.py")
    assert _passed_over(os.__file__, "os")  # the standard library
    assert _passed_over(__file__, "") is False


# ------------------------------------------------------------------ report
def _failed_capture_report(tmp_path, world_size: int = 1) -> ModelReport:
    """One signature whose capture failed at the user's line, recorded as the
    engine records it (GraphRunner.capture_failed: the policy and the event log)."""
    path = tmp_path / "net.py"
    path.write_text(USER_MODEL)
    _, (reason, _) = OURS["capture"](_load(path, "net").forward, torch.ones(2))
    if world_size > 1:  # as agreement.agree joins the failed ranks' reasons
        reason = "; ".join(f"rank {r}: {reason}" for r in range(world_size))
    cache = GraphCache(rank=0, max_graphs=4, graph_memory_mb=None)
    entry, _ = cache.lookup([torch.ones(4, 8)], None)
    entry.policy = C.CapturePolicy(C.PolicyConfig(
        probe_iters=0, warmup_iters=0, max_capture_attempts=2, max_recaptures=8))
    entry.policy.begin_iteration()
    GraphRunner.capture_failed(types.SimpleNamespace(cache=cache, rank=0), entry, 3, reason, False,
                               local_error=True)
    return ModelReport(
        model="Net", rank=0, world_size=world_size, graphs_possible=True, graphs_reason="",
        loop="conforms (checked over 2 probe iterations)", amp="fp32", optimizer="AdamW",
        optimizer_changes=[], buckets="1 bucket", backend="graph-safe (pgd_nccl, fingerprints on)",
        graphs=cache.describe([]), events=[asdict(e) for e in cache.events])


@pytest.mark.parametrize("world_size", [1, 2])
def test_report_says_where(tmp_path, world_size):
    m = _failed_capture_report(tmp_path, world_size)
    where = f"{os.path.relpath(tmp_path / 'net.py')}:{_line(tmp_path / 'net.py', 'the host copy')}"
    d = json.loads(Report([m]).to_json())["models"][0]
    assert d["graphs"][0]["where"] == where and d["graphs"][0]["phase"] == "eager", d["graphs"]
    assert d["events"][0]["event"] == "capture failed" and d["events"][0]["where"] == where
    reasons = d["summary"]["eager_reasons"]
    assert [r["where"] for r in reasons] == [where], reasons
    assert where in reasons[0]["short"], reasons
    default, verbose = Report([m]).text(), Report([m], verbose=True).text()
    flat = " ".join(default.split())
    assert f"eager: RuntimeError: {PINNED}; raised at {where} in forward()" in flat, default
    assert where in " ".join(verbose.split()), verbose
    assert m.as_dict() == d


def test_a_long_reason_keeps_its_line_in_the_default_text(tmp_path):
    """brief() cuts a long reason near 200 characters: before the line that raised,
    which stays whole."""
    m = _failed_capture_report(tmp_path)
    long = "a host synchronisation happened during capture, " + "which is long " * 30
    reason = long + "; raised at model.py:42 in forward() (from train.py:7)"
    g = m.graphs[0]
    m = ModelReport(**{**m.__dict__, "graphs": [type(g)(**{**g.__dict__, "reason": reason,
                                                          "where": failure_where(reason)})]})
    short = Report([m]).as_dict()["models"][0]["summary"]["eager_reasons"][0]["short"]
    assert len(short) < len(reason), short
    assert short.endswith(" …; raised at model.py:42 in forward() (from train.py:7)"), short
    assert "raised at model.py:42 in forward() (from train.py:7)" in " ".join(Report([m]).text().split())


def test_a_model_report_prints_as_text(tmp_path):
    """What Lightning hands users to print (``trainer.strategy.last_report``,
    ``engine.describe()``) prints the text report, not a dataclass repr."""
    m = _failed_capture_report(tmp_path)
    text = str(m)
    assert text == Report([m]).text(), text
    assert text.startswith("pygraph_dist — Net (rank 0 of 1): ") and "ModelReport(" not in text, text
    assert "(details: pygraph_dist.report(verbose=True))" in text
    assert m.text(verbose=True).startswith("pygraph_dist report — Net (rank 0 of 1)")
    assert repr(m).startswith("ModelReport(")  # the record itself, for debugging


@pytest.mark.timeout(300)
def test_lightning_last_report_prints_the_text_report(ranks):
    """``print(trainer.strategy.last_report)``, as docs/integrations.md says (CPU, 2 ranks)."""
    pytest.importorskip("lightning")
    for r in ranks("test_integration_lightning:trainer_pair", kwargs={"accumulate": 1}, timeout=280):
        text = r["pgd"]["report"]  # str(trainer.strategy.last_report)
        assert text.startswith("pygraph_dist — "), text
        assert "(details: pygraph_dist.report(verbose=True))" in text and "ModelReport(" not in text, text


# ------------------------------------------------------------------- GPU
@pytest.mark.gpu
def test_capture_into_does_not_warn_that_the_graph_is_empty():
    """A capture that records no kernel does not reach the user as torch's "The
    CUDA Graph is empty" warning; other warnings raised while capturing still do."""
    from pygraph_dist.graphs.capture_guard import capture_into

    stream = torch.cuda.Stream()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        graph = torch.cuda.CUDAGraph()
        with capture_into(graph, pool=None, stream=stream):
            warnings.warn("the user's own warning")
        graph.replay()
        torch.cuda.synchronize()
    texts = [str(w.message) for w in seen]
    assert not any("CUDA Graph is empty" in t for t in texts), texts
    assert "the user's own warning" in texts, texts
    # Without capture_into torch does warn, and this test would see it.
    with warnings.catch_warnings(record=True) as bare:
        warnings.simplefilter("always")
        with torch.cuda.graph(torch.cuda.CUDAGraph(), stream=stream):
            pass
    assert any("CUDA Graph is empty" in str(w.message) for w in bare), [str(w.message) for w in bare]


class RngFirst(torch.nn.Module):
    """Training: the capture fails at the forward's first line, having recorded
    nothing (as the demo Transformer's host copy did). Evaluation: a forward
    without a kernel, captured as an empty graph."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 1)

    def forward(self, x, y=None):
        if y is None:
            return x.view(-1)  # no kernel
        torch.cuda.get_rng_state()  # refused while capturing
        return torch.nn.functional.mse_loss(self.lin(x).squeeze(-1), y)


def gpu_empty_graphs(steps: int = 10) -> dict:
    """Rank body: train and evaluate RngFirst through wrap(), recording warnings."""
    pgd.init()
    torch.manual_seed(0)
    base = RngFirst().cuda()
    model, opt = pgd.wrap(base, torch.optim.SGD(base.parameters(), lr=0.1))
    x, y = torch.randn(16, 8, device="cuda"), torch.randn(16, device="cuda")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for _ in range(steps):
            loss = model(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad()
        model.eval()
        with torch.no_grad():
            outs = [model(x) for _ in range(6)]
        torch.cuda.synchronize()
    return {"warnings": [f"{w.category.__name__}: {w.message}" for w in seen],
            "graphs": pgd.report(as_dict=True)["models"][-1]["graphs"],
            "evals_ok": all(torch.equal(o, x.view(-1)) for o in outs),
            "report": str(pgd.report(verbose=True))}


@pytest.mark.gpu
def test_wrapped_captures_do_not_warn_that_the_graph_is_empty(ranks):
    """Through wrap(): a training capture that fails at once runs eagerly with the
    line in the report, an evaluation forward without a kernel is graphed, and
    neither warns "The CUDA Graph is empty"."""
    (r,) = ranks("test_failure_sites:gpu_empty_graphs", world_size=1, timeout=300)
    assert not any("CUDA Graph is empty" in w for w in r["warnings"]), r["warnings"]
    train = [g for g in r["graphs"] if g["tier"] != "eval"]
    line = _line_of(RngFirst.forward, "refused while capturing")
    assert train and train[0]["phase"] == "eager", r["report"]
    assert train[0]["where"].endswith(f"test_failure_sites.py:{line}"), r["report"]
    assert f"test_failure_sites.py:{line} in forward()" in train[0]["reason"], r["report"]
    assert r["evals_ok"], r["report"]


def _line_of(function, text: str) -> int:
    import inspect

    lines, start = inspect.getsourcelines(function)
    return start + next(i for i, line in enumerate(lines) if text in line)
