"""Imports point down: no import cycle in the package, and no layer importing a higher one.

Issue 48, item 3. The graph is read from the sources (``ast``), not from
``sys.modules``: every ``import`` counts, those inside functions and under
``if TYPE_CHECKING:`` too. A lazy import that exists only to dodge a cycle is
still a cycle: the two modules still need each other, and the next change to
either has to know both. Cut a cycle by moving code to where it belongs (a
lower module both can import, an argument passed down, a narrow interface
such as ``clip_route.ClipOwner``), never by hiding the import.

Modules are named by their path in the package without ``.py``
(``reduce/reducer``, ``integrations/hf``, ``__init__`` for the package itself). The
implicit import of a parent package that every submodule import performs is
not an edge (every module would otherwise import ``__init__``); an explicit
``import pygraph_dist`` or ``from pygraph_dist import wrap`` is. It reads the
files; it imports nothing of the package.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE_NAME = "pygraph_dist"
PACKAGE = Path(__file__).resolve().parents[2] / "python" / PACKAGE_NAME
NATIVE = {"_C"}  # built from csrc/ (pygraph_dist._C): imported, but no source to read

# The declared layers, lowest first: one subpackage each (plus the package's own
# ``__init__``, the API). A module may import modules of its own subpackage and of
# the layers before it, never of a later one. Each subpackage's docstring says
# what it owns and ends with ``May import:`` naming exactly the layers before it
# (checked below), so the tree and this list say the same. Every module of the
# package is in a layer (checked).
LAYERS: list[tuple[str, str]] = [
    ("runtime", "the native extension, every change to code we do not own, host spans, fused kernels"),
    ("launch", "launch environments, the launcher, the backend, collectives, agreement, lifetimes, the watchdog"),
    ("reports", "report()'s records and text, reasons and their fixes, notes on model classes"),
    ("loop", "wrap()'s options and the user's loop as read: AMP, param groups, monitor, conformance, "
             "arguments, outputs, accumulation, the loss"),
    ("graphs", "what any graph is made with: the capture guard, the graph cache, pools, host copies"),
    ("reduce", "gradients across ranks: buckets, their collectives, the reducer, adopted gradients"),
    ("step", "the optimizer made graph-aware, clipping, the iteration tier 1 captures"),
    ("tiers", "tier 1's capture, tier 2's split step, evaluation graphs"),
    ("engine", "the engine that composes them for one wrapped model"),
    ("__init__", "the API: wrap(), GraphedModule, report(), init(), shutdown()"),
    ("integrations", "Hugging Face and Lightning"),
]


def layer_name(module: str) -> str:
    """``loop/monitor`` -> ``loop``; ``__init__`` -> ``__init__``; ``loop/__init__`` -> ``loop``."""
    return module.split("/")[0]


# ------------------------------------------------------------------ the graph
def _modules(root: Path = PACKAGE) -> dict[str, Path]:
    """Module name (path in the package, no ``.py``) -> file."""
    return {p.relative_to(root).with_suffix("").as_posix(): p for p in sorted(root.rglob("*.py"))}


def _dotted(name: str, package: str) -> str:
    """``integrations/hf`` -> ``pygraph_dist.integrations.hf``; ``__init__`` -> ``pygraph_dist``."""
    parts = [package] + [p for p in name.split("/") if p != "__init__"]
    return ".".join(parts)


def import_graph(root: Path = PACKAGE, package: str = PACKAGE_NAME) -> dict[str, dict[str, list[int]]]:
    """Module -> {imported module of the package -> line numbers}, for every
    import statement anywhere in the module (functions and TYPE_CHECKING included)."""
    modules = _modules(root)
    by_dotted = {_dotted(name, package): name for name in modules}
    graph: dict[str, dict[str, list[int]]] = {name: {} for name in modules}
    for name, path in modules.items():
        dotted = _dotted(name, package)
        here = dotted if path.name == "__init__.py" else dotted.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = here.split(".")
                    base = base[:len(base) - (node.level - 1)]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                for alias in node.names:
                    submodule = f"{source}.{alias.name}"
                    # ``from . import reducer`` imports a module; ``from .reducer import X``
                    # a name of one; the native extension is outside the graph.
                    if submodule in by_dotted:
                        targets.append(submodule)
                    elif not (source == package and alias.name in NATIVE):
                        targets.append(source)
            for target in targets:
                # ``import pygraph_dist.integrations.hf`` binds the package and imports the submodule.
                while target and target not in by_dotted and "." in target:
                    target = target.rpartition(".")[0]
                other = by_dotted.get(target)
                if other is not None and other != name:
                    lines = graph[name].setdefault(other, [])
                    if node.lineno not in lines:  # one per statement: from .x import a, b
                        lines.append(node.lineno)
    return graph


def find_cycles(graph: dict[str, dict[str, list[int]]]) -> list[list[str]]:
    """One cycle (``[a, b, ..., a]``) per strongly connected component of more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []

    def visit(v: str) -> None:  # Tarjan; the package is small enough to recurse
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(component)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    cycles = []
    for component in components:  # the shortest path back to the start, within the component
        start = min(component)
        paths = {start: [start]}
        frontier = [start]
        found = None
        while frontier and found is None:
            nxt = []
            for v in frontier:
                for w in sorted(graph[v]):
                    if w == start:
                        found = paths[v] + [start]
                        break
                    if w in component and w not in paths:
                        paths[w] = paths[v] + [w]
                        nxt.append(w)
                if found:
                    break
            frontier = nxt
        cycles.append(found)
    return cycles


def describe_cycle(cycle: list[str], graph: dict[str, dict[str, list[int]]]) -> str:
    """``a -> b (a.py:12) -> a (b.py:40)``: each step with the line that imports."""
    text = cycle[0]
    for a, b in zip(cycle, cycle[1:]):
        lines = ",".join(map(str, graph[a][b]))
        text += f" -> {b} ({a}.py:{lines})"
    return text


def layer_of(modules) -> dict[str, int]:
    index = {name: i for i, (name, _) in enumerate(LAYERS)}
    return {m: index[layer_name(m)] for m in modules if layer_name(m) in index}


# ------------------------------------------------------------------ the checks
def test_graph_is_read():
    graph = import_graph()
    # The scan must see the package and its imports, or the checks below pass on nothing.
    assert len(graph) > 40 and {"__init__", "engine/engine", "reduce/reducer", "integrations/lightning"} <= set(graph)
    assert "tiers/capture" in graph["engine/engine"] and "reduce/reducer" in graph["tiers/capture"]
    assert "__init__" in graph["integrations/hf"]  # import pygraph_dist as pgd
    assert graph["runtime/_ext"] == {}  # from .. import _C: native


def test_no_import_cycles():
    graph = import_graph()
    cycles = find_cycles(graph)
    assert not cycles, (
        "import cycles in python/pygraph_dist (imports inside functions and under TYPE_CHECKING "
        "count):\n  " + "\n  ".join(describe_cycle(c, graph) for c in cycles)
        + "\nMove what both need into a lower module, or pass it down as an argument.")


def test_every_module_in_a_layer():
    modules = set(import_graph())
    names = [name for name, _ in LAYERS]
    assert len(names) == len(set(names)), f"a layer named twice in LAYERS: {names}"
    missing = sorted(m for m in modules if layer_name(m) not in names)
    assert not missing, (f"modules in no layer: {missing}; put each in the subpackage of its concern, "
                         "or declare a new subpackage in LAYERS (tests/python/test_layers.py)")
    stale = sorted(n for n in names if not any(layer_name(m) == n for m in modules))
    assert not stale, f"LAYERS names layers with no module: {stale}"
    flat = sorted(m for m in modules if "/" not in m and m != "__init__")
    assert not flat, f"modules outside every subpackage: {flat}; each belongs in a layer's folder"


def test_imports_point_down():
    graph = import_graph()
    layer = layer_of(graph)
    upward = [f"{a} (layer {layer[a] + 1}: {LAYERS[layer[a]][0]}) imports {b} "
              f"(layer {layer[b] + 1}: {LAYERS[layer[b]][0]}) at {a}.py:{','.join(map(str, lines))}"
              for a, targets in sorted(graph.items()) for b, lines in sorted(targets.items())
              if layer[b] > layer[a]]
    assert not upward, ("imports that point up the layers of LAYERS (tests/python/test_layers.py):\n  "
                        + "\n  ".join(upward))


def test_each_subpackage_says_what_it_may_import():
    """The docstring of each layer's ``__init__.py`` ends by naming the layers it may
    import, exactly the ones before it here: the tree documents the order."""
    import re

    names = [name for name, _ in LAYERS]
    wrong = []
    for i, name in enumerate(names):
        init = PACKAGE / name / "__init__.py"
        if name in ("__init__", "integrations") or not init.exists():
            continue
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        found = re.search(r"May import: ([^.]*)\.", doc)
        declared = [] if not found or found.group(1) == "nothing of the package" else \
            [x.strip() for x in found.group(1).split(",")]
        if not found or declared != names[:i]:
            wrong.append(f"{name}/__init__.py says {found.group(0) if found else 'nothing'}; "
                         f"LAYERS gives: May import: {', '.join(names[:i]) or 'nothing of the package'}.")
    assert not wrong, "\n".join(wrong)


def test_a_cycle_is_found_and_named(tmp_path):
    """The checks are not vacuous: lazy and TYPE_CHECKING imports make cycles, named with their lines."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from .a import f\n")
    (pkg / "a.py").write_text("def f():\n    from .b import g\n    return g()\n")
    (pkg / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .sub.c import C\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "c.py").write_text("from .. import a\nfrom ..d import x\nimport pkg\n")
    (pkg / "d.py").write_text("x = 1\n")
    graph = import_graph(pkg, "pkg")
    assert graph["sub/c"] == {"a": [1], "d": [2], "__init__": [3]}
    cycles = find_cycles(graph)
    assert len(cycles) == 1 and set(cycles[0]) == {"__init__", "a", "b", "sub/c"}
    assert describe_cycle(["a", "b", "sub/c", "a"], graph) == "a -> b (a.py:2) -> sub/c (b.py:3) -> a (sub/c.py:1)"
