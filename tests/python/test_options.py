"""``wrap()``'s options are written once, in ``config.WrapConfig``; the package exports ``__all__`` only.

Issue 48, item 5. ``WrapConfig``'s fields hold each option's name, default and
documentation. ``wrap()`` keeps an explicit keyword-only signature (for users
and IDEs), checked here to be the fields exactly; its docstring's ``Args`` are
generated from them; docs/api.md's options table is checked against them.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import types
from pathlib import Path

import pytest
import torch

import pygraph_dist as pgd
from pygraph_dist.loop.config import OPTIONS, WrapConfig

API_PAGE = Path(__file__).resolve().parents[2] / "docs" / "api.md"
FIELDS = dataclasses.fields(WrapConfig)


def test_wrap_signature_is_wrapconfig():
    params = list(inspect.signature(pgd.wrap).parameters.values())
    assert [p.name for p in params[:2]] == ["model", "optimizer"]
    assert all(p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD for p in params[:2])
    options = params[2:]
    assert [p.name for p in options] == [f.name for f in FIELDS] == list(OPTIONS), (
        "wrap()'s options and WrapConfig's fields differ (names or order): add or move the option "
        "in both, WrapConfig first")
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in options)
    wrong = [f"{p.name}: wrap() {p.default!r}, WrapConfig {f.default!r}" for p, f in zip(options, FIELDS)
             if not (p.default == f.default and type(p.default) is type(f.default))]
    assert not wrong, "wrap()'s defaults differ from WrapConfig's:\n  " + "\n  ".join(wrong)


def test_every_option_documented_once_and_shown_by_wrap():
    doc = " ".join(pgd.wrap.__doc__.split())
    for f in FIELDS:
        text = " ".join(f.metadata.get("doc", "").split())
        assert len(text) > 10, f"WrapConfig.{f.name} has no documentation: option(default, doc)"
        assert f"{f.name}: {text}" in doc, f"wrap()'s docstring does not show {f.name}'s documentation"
    assert "{options}" not in pgd.wrap.__doc__


def test_api_page_table_is_wrapconfig():
    """docs/api.md's options table: one row per field, in order, with the field's default."""
    page = API_PAGE.read_text()
    rows = re.findall(r"^\| `(\w+)` \| `([^`]*)` \|", page, re.M)
    assert [name for name, _ in rows] == list(OPTIONS), (
        "docs/api.md's options table must list WrapConfig's fields in order (add a row with the "
        "default and when to use it)")
    wrong = [f"{name}: page {default}, WrapConfig {f.default!r}" for (name, default), f in zip(rows, FIELDS)
             if default != repr(f.default)]
    assert not wrong, "docs/api.md option defaults differ from WrapConfig:\n  " + "\n  ".join(wrong)


def test_construction_normalises_and_checks():
    config = WrapConfig()
    assert config.compile is None and config.grad_comm_dtype is None and config.eager_params == ()
    config = WrapConfig(pad_batch_to=[64, 32], pad_value=[0, -100], eager_params=["w"], ignore_args="batch_idx",
                        grad_comm_dtype="bf16", compile=True)
    assert config.pad_batch_to == (32, 64) and config.pad_value == (0, -100) and config.eager_params == ("w",)
    assert config.ignore_args == ("batch_idx",) and config.grad_comm_dtype is torch.bfloat16
    assert config.compile == {} or "options" in config.compile
    with pytest.raises(ValueError, match="warmup must be at least 1"):
        WrapConfig(warmup=0)
    with pytest.raises(TypeError, match="ignore_args"):
        WrapConfig(ignore_args=[1])
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.warmup = 5


def test_compile_warning_points_at_wraps_caller():
    """compiled.compile_kwargs's warning, checked inside WrapConfig, still names the line that called wrap()."""
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.warns(UserWarning, match="reduce-overhead") as said, pytest.raises(ValueError, match="warmup"):
        pgd.wrap(model, optimizer, compile={"mode": "reduce-overhead"}, warmup=0)  # refused before any engine
    assert [w.filename for w in said if "reduce-overhead" in str(w.message)] == [__file__]


def _submodules() -> set[str]:
    return {name for name, value in vars(pgd).items()
            if isinstance(value, types.ModuleType) and value.__name__ == f"pygraph_dist.{name}"}


def test_namespace_is_all():
    public = {name for name in dir(pgd) if not name.startswith("_")}
    assert public - _submodules() == set(pgd.__all__), (
        "public names of pygraph_dist that are not in __all__ (give private imports a leading "
        f"underscore): {sorted(public - _submodules() - set(pgd.__all__))}; in __all__ but missing: "
        f"{sorted(set(pgd.__all__) - public)}")


def test_report_function_and_module_both_reachable():
    """``pygraph_dist.report()`` is the documented function; the module is ``pygraph_dist.reports.reporting``."""
    import pygraph_dist.reports.reporting as reporting

    assert callable(pgd.report) and not isinstance(pgd.report, types.ModuleType)
    assert pgd.reports.reporting is reporting and pgd.Report is reporting.Report
    assert reporting.ModelReport.__module__ == "pygraph_dist.reports.reporting"
    r = pgd.report()
    assert isinstance(r, pgd.Report) and isinstance(str(r), str)
    assert isinstance(pgd.report(as_dict=True)["models"], list)


def settings_and_group() -> dict:
    """Rank body: wrap on a subgroup, tear down, look for who still holds the group."""
    import gc

    import torch.distributed as dist

    pgd.init()
    group = dist.new_group([0])
    model = torch.nn.Linear(4, 2)
    wrapped, _ = pgd.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), process_group=group)
    kept = wrapped.engine.config.process_group
    wrapped.engine.teardown()
    gc.collect()
    held = [type(r).__name__ for r in gc.get_referrers(group) if isinstance(r, WrapConfig)]
    return {"kept_is_none": kept is None, "held_by": held}


def test_the_settings_an_engine_keeps_do_not_hold_the_process_group(ranks):
    """teardown() drops the engine's group so that its C++ objects die with
    destroy_process_group(); the WrapConfig the engine keeps must not hold it."""
    (r,) = ranks("test_options:settings_and_group", world_size=1)
    assert r == {"kept_is_none": True, "held_by": []}, r


def test_the_package_imports_without_docstrings():
    """python -OO strips docstrings: wrap() fills its Args section only when it has one."""
    import subprocess
    import sys

    p = subprocess.run([sys.executable, "-OO", "-c", "import pygraph_dist"], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
