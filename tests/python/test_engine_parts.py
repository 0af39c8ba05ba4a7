"""The engine has parts, not mixins (issue 48, item 2).

``Engine`` has no base class: :func:`pygraph_dist.engine.wiring.build_parts`
builds the parts and returns them as ``EngineParts``, and ``Engine.__init__``
holds each one. No module of the package reaches into the engine's private
attributes: the parts are given what they use, and the optimizer and the clip
router see only its public members (``StepOwner``, ``ClipOwner``). Like
tests/python/test_layers.py, the source checks read the files (``ast``).
"""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "python" / "pygraph_dist"
ENGINE = PACKAGE / "engine" / "engine.py"
WIRING = PACKAGE / "engine" / "wiring.py"
# What the engine is called where other modules hold it: model.engine, the
# optimizer's _pgd_engine, clip_route's owner...
ENGINE_NAMES = frozenset({"engine", "_engine", "_pgd_engine", "eng", "owner"})


def _last_name(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return ""


def private_engine_reads(path: Path, root: Path = PACKAGE.parent) -> list[str]:
    """``engine._x`` (read or written) in ``path``: ``file:line: engine._x``, the file relative to ``root``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
                and _last_name(node.value) in ENGINE_NAMES):
            found.append(f"{path.relative_to(root)}:{node.lineno}: "
                         f"{_last_name(node.value)}.{node.attr}")
    return found


def test_engine_has_no_base_class():
    from pygraph_dist.engine.engine import Engine

    assert Engine.__mro__ == (Engine, object), (
        f"Engine has base classes {[c.__name__ for c in Engine.__mro__[1:-1]]}: give the engine a part "
        "(built in engine/wiring.py) instead of a mixin")


def test_no_module_reads_the_engines_private_attributes():
    files = [p for p in sorted(PACKAGE.rglob("*.py")) if p != ENGINE]
    assert len(files) > 40 and WIRING in files  # the scan sees the package
    found = [hit for p in files for hit in private_engine_reads(p)]
    assert not found, ("modules outside engine/engine.py that read or write the engine's private "
                       "attributes; give the part what it uses, or make it a public member:\n  "
                       + "\n  ".join(found))


def test_private_engine_reads_are_found(tmp_path):
    """The check is not vacuous: a private read through any of the engine's names is named."""
    src = tmp_path / "pygraph_dist" / "m.py"
    src.parent.mkdir()
    src.write_text("def f(model, opt, engine):\n    model.engine._entry = None\n"
                   "    return opt._pgd_engine._phase, engine.step, engine.__class__\n")
    assert private_engine_reads(src, tmp_path) == ["pygraph_dist/m.py:2: engine._entry",
                                                   "pygraph_dist/m.py:3: _pgd_engine._phase"]


def test_the_builder_reads_nothing_of_the_engine():
    """wiring.py is given the engine as ``owner`` only to attach it (the optimizer's
    StepOwner, the side stream's lifetime): no attribute of it is read there."""
    tree = ast.parse(WIRING.read_text())
    reads = [f"wiring.py:{n.lineno}: owner.{n.attr}" for n in ast.walk(tree)
             if isinstance(n, ast.Attribute) and _last_name(n.value) == "owner"]
    assert not reads, "build_parts reads the engine:\n  " + "\n  ".join(reads)


def holds_every_part():
    """One rank: wrap a model and compare the engine's attributes with the parts it was built from."""
    import torch
    import torch.distributed as dist

    import pygraph_dist as pgd
    from pygraph_dist.engine import wiring

    dist.init_process_group("gloo")
    built = []
    build_parts = wiring.build_parts

    def recording(*args, **kwargs):
        built.append(build_parts(*args, **kwargs))
        return built[-1]

    wiring.build_parts = recording
    import pygraph_dist.engine.engine as engine_module

    engine_module.build_parts = recording
    model = torch.nn.Linear(4, 2)
    wrapped, _ = pgd.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1))
    engine, (parts,) = wrapped.engine, built
    names = [f.name for f in dataclasses.fields(parts)]
    held = {name: (("_" + name) if name in wiring.ENGINE_PRIVATE else name) for name in names}
    missing = [a for n, a in held.items() if getattr(engine, a, None) is not getattr(parts, n)]
    dist.destroy_process_group()  # releases the engine (pygraph_dist's shutdown hook)
    return {"fields": len(names), "missing": missing, "private": sorted(a for a in held.values() if a[0] == "_")}


def test_the_engine_holds_every_part(ranks):
    """Each field of EngineParts is the engine's attribute of that name (``_name`` for the
    three it keeps private), the very object the builder made: none left behind."""
    (r,) = ranks("test_engine_parts:holds_every_part", world_size=1)
    assert r["missing"] == [] and r["fields"] >= 30, r
    assert r["private"] == ["_clear_grads", "_frozen_at_wrap", "_release_stream"], r
