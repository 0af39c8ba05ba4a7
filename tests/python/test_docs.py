"""The documentation builds without a warning and cannot drift from the code.

* the Sphinx site (docs/) builds with ``-W --keep-going -n`` (every warning,
  broken cross-reference included, fails), autodoc importing pygraph_dist itself;
* every relative link in README.md, docs/*.md and examples/README.md names a
  file that exists;
* every ``wrap()`` option is in the API reference (docs/api.md);
* every reason string the code can print is in docs/troubleshooting.md
  (docs/check_reasons.py defines "reason string" and does the scan);
* README.md stays a front page: at most 150 lines, naming the two commands;
* design.md's module map has a row for every module of the package, under its
  layer, and names the layers of tests/python/test_layers.py in their order;
  docs/_static/layers.svg (docs/layers_figure.py) names what ``LAYERS`` and the
  tree say.
"""

from __future__ import annotations

import importlib.util
import inspect
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
sys.path.insert(0, str(DOCS))
import check_reasons  # noqa: E402  (docs/check_reasons.py)
import layers_figure  # noqa: E402  (docs/layers_figure.py; matplotlib only to draw)

_LINK = re.compile(r"(?<!\!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")


def _markdown_files() -> list[Path]:
    return [ROOT / "README.md", ROOT / "examples" / "README.md", *sorted(DOCS.glob("*.md"))]


def _sphinx_missing() -> str | None:
    missing = [m for m in ("sphinx", "myst_parser") if importlib.util.find_spec(m) is None]
    if missing:
        return (f"{' and '.join(missing)} not installed (pip install 'pygraph_dist[docs]', or "
                "PGD_SETUP_TESTS=1 launch/setup-env.sh): the docs build is not checked here")
    return None


def test_docs_build_strict(tmp_path):
    """sphinx-build -W --keep-going -n: any warning fails, with the warnings in the message."""
    reason = _sphinx_missing()
    if reason:
        pytest.skip(reason)
    env = dict(os.environ)
    # autodoc imports pygraph_dist the way these tests do: the installed package,
    # or this checkout's python/ where its extension was built or copied there
    # (docs/conf.py applies the same rule).
    if any((ROOT / "python" / "pygraph_dist").glob("_C*.so")):
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "python"), env.get("PYTHONPATH")) if p)
    cmd = [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-n", "-q", "-b", "html",
           "-d", str(tmp_path / "doctrees"), str(DOCS), str(tmp_path / "html")]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, (
        f"the docs build failed or warned ({' '.join(cmd)}):\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}")
    html = tmp_path / "html"
    for page in ("index", "getting-started", "tiers", "api", "launching", "troubleshooting",
                 "performance", "design", "limits", "changelog", "integrations"):
        assert (html / f"{page}.html").is_file(), f"docs/{page}.md did not become a page"
    api = (html / "api.html").read_text()
    # autodoc ran on the real package: wrap()'s signature and docstring are on the page.
    assert "max_graphs" in api and "Wrap a model and its optimizer" in api
    assert "LoopConformanceError" in api and "GraphedModule" in api


def test_relative_links_resolve():
    """Every relative link (and image) in the Markdown pages points to an existing file."""
    broken = []
    for md in _markdown_files():
        text = md.read_text()
        text = re.sub(r"```.*?```", "", text, flags=re.S)  # links inside code blocks are code
        for m in _LINK.finditer(text):
            target = (m.group(1) or m.group(2)).split("#", 1)[0]
            if not target or re.match(r"[a-z][a-z0-9+.-]*:", target):  # anchor only, or a URL
                continue
            if not (md.parent / target).exists():
                broken.append(f"{md.relative_to(ROOT)}: ({m.group(1) or m.group(2)})")
    assert not broken, "relative links to files that do not exist:\n  " + "\n  ".join(broken)


def test_link_check_sees_a_broken_link(tmp_path):
    """The link check above would notice a broken link (it is not vacuous)."""
    md = tmp_path / "x.md"
    md.write_text("see [a](missing.md) and ![b](img/none.png) and [c](https://example.org)\n")
    targets = [(m.group(1) or m.group(2)) for m in _LINK.finditer(md.read_text())]
    assert targets == ["missing.md", "img/none.png", "https://example.org"]


def test_every_wrap_option_in_api_reference():
    import pygraph_dist
    from pygraph_dist.loop.config import WrapConfig

    page = (DOCS / "api.md").read_text()
    options = [n for n in inspect.signature(pygraph_dist.wrap).parameters if n not in ("model", "optimizer")]
    options += [f for f in WrapConfig.__dataclass_fields__ if f not in options]
    assert len(options) > 20
    missing = [o for o in options if f"`{o}`" not in page]
    assert not missing, (f"wrap() options missing from docs/api.md (add a row to its options table, "
                         f"with the default and when to use it): {missing}")


def test_wrap_defaults_in_api_reference_match_the_code():
    """The options table's default column says what wrap()'s signature says."""
    import pygraph_dist

    page = (DOCS / "api.md").read_text()
    rows = {m.group(1): m.group(2) for m in re.finditer(r"^\| `(\w+)` \| `([^`]*)` \|", page, re.M)}
    wrong = []
    for name, p in inspect.signature(pygraph_dist.wrap).parameters.items():
        if name in ("model", "optimizer") or name not in rows:
            continue
        if rows[name] != repr(p.default):
            wrong.append(f"{name}: page says {rows[name]}, wrap() has {p.default!r}")
    assert not wrong, "docs/api.md option defaults differ from wrap():\n  " + "\n  ".join(wrong)


def test_every_reason_string_in_troubleshooting():
    missing, problems = check_reasons.missing_reasons()
    assert not problems, "docs/check_reasons.py no longer matches the code:\n  " + "\n  ".join(problems)
    assert not missing, (
        "reason strings the code can print are missing from docs/troubleshooting.md (quote the start "
        "of each message there, with what it means and the fix; `python docs/check_reasons.py` "
        "lists them):\n  " + "\n  ".join(str(r) for r in missing))


def test_reason_scan_finds_what_it_should():
    """The scan is not vacuous: known reasons of every kind are found, with their key."""
    reasons, _ = check_reasons.all_reasons()
    keys = {r.key for r in reasons}
    assert len(reasons) > 100
    assert any(k.startswith("optimizer.step(closure) re-evaluates the model") for k in keys)  # violation
    assert any(k.startswith("warmup must be at least 1") for k in keys)  # raise ValueError
    assert any(k.startswith("pygraph_dist was torn down") for k in keys)  # disable(CONSTANT)
    assert any(k.startswith("a host synchronisation happened during capture") for k in keys)  # producer
    assert any(k.startswith("barrier() during CUDA graph capture") for k in keys)  # C++ refuse()
    assert any(k.startswith("no CUDA device is visible") for k in keys)  # producer, tuple return
    assert all(r.where.split(":")[0] and r.where.split(":")[-1].isdigit() for r in reasons)


def test_reason_key_rules():
    assert check_reasons.key_of("{} is set ({} launch) but {} not: set {}, or launch with `torchrun` now") \
        == "or launch with `torchrun` now"
    assert check_reasons.key_of("pygraph_dist: {} of {}") is None  # nothing static to check
    assert check_reasons.key_of("a b c d e f g h i j k") == "a b c d e f g h"
    assert check_reasons.normalize("Use `wrap(...)`\n  **now**") == "use wrap(...) now"


def test_check_reasons_script_reports_missing(tmp_path):
    """``python docs/check_reasons.py`` names what is missing and where it comes from."""
    page = tmp_path / "troubleshooting.md"
    page.write_text("nothing here\n")
    missing, _ = check_reasons.missing_reasons(page)
    assert missing and all(":" in r.where for r in missing)
    text = str(missing[0])
    assert missing[0].where in text and missing[0].key in text


def test_readme_is_a_front_page():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 150
    assert "## The two commands" in text
    assert "./launch/run-main-job.sh" in text and "./tests/run-all.sh" in text
    assert "docs/" in text  # links into the documentation


# ------------------------------------------------------------------ the module map and the layers figure
def _module_map(text: str | None = None) -> str:
    """design.md's "## Module map" section, up to the next ``## `` heading."""
    text = (DOCS / "design.md").read_text() if text is None else text
    start = text.index("## Module map\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end >= 0 else len(text)]


_LAYER_LINE = re.compile(r"^\*\*Layer (\d+): `([^`]+)`\*\* — (.*)$")
_ROW = re.compile(r"^\| `([^`]+)` \|")


def module_map_problems(section: str, layers, modules) -> list[str]:
    """What the module map gets wrong: a module of the package without a row (or
    with its row under another layer), a row naming no module, a layer missing,
    out of order or with another concern than ``LAYERS`` gives."""
    want_layers = [(str(i), "__init__.py" if name == "__init__" else f"{name}/", concern)
                   for i, (name, concern) in enumerate(layers, 1)]
    # the package's modules as the map names them: path under the package, with .py;
    # a subpackage's __init__.py is its layer's line, not a row.
    want_rows = {f"{m}.py": m.split("/")[0] for m in modules if not m.endswith("/__init__")}
    problems, found_layers, rows = [], [], {}
    current = None
    for line in section.splitlines():
        if (m := _LAYER_LINE.match(line)):
            found_layers.append(m.groups())
            current = layers[int(m.group(1)) - 1][0] if 0 < int(m.group(1)) <= len(layers) else None
        elif (m := _ROW.match(line)) and m.group(1).endswith(".py"):
            rows[m.group(1)] = current
    if found_layers != want_layers:
        problems.append("the layer lines (**Layer N: `name/`** — concern) are not LAYERS in order:\n    found "
                        + "\n          ".join(map(str, found_layers)) + "\n    want "
                        + "\n          ".join(map(str, want_layers)))
    for path, layer in sorted(want_rows.items()):
        if path not in rows:
            problems.append(f"no row for {path}: add `| `{path}` | what it owns |` under Layer "
                            f"{[n for n, _ in layers].index(layer) + 1}: {layer}")
        elif rows[path] != layer:
            problems.append(f"the row for {path} is under layer {rows[path]}, not {layer}")
    problems += [f"a row names {path}, which is no module of the package" for path in sorted(rows)
                 if path not in want_rows]
    return problems


def test_module_map_names_every_module_under_its_layer():
    layers, modules = layers_figure.load_layers()
    problems = module_map_problems(_module_map(), layers, modules)
    assert not problems, ("docs/design.md's module map disagrees with the package and "
                          "tests/python/test_layers.py's LAYERS:\n  " + "\n  ".join(problems))


def test_module_map_check_sees_a_missing_row():
    """The map check is not vacuous: a row taken out, or a module added, is named."""
    layers, modules = layers_figure.load_layers()
    section = _module_map()
    assert "| `reduce/reducer.py` |" in section and "**Layer 6: `reduce/`**" in section
    cut = "\n".join(line for line in section.splitlines() if not line.startswith("| `reduce/reducer.py` |"))
    assert any("reduce/reducer.py" in p for p in module_map_problems(cut, layers, modules))
    assert any("loop/new_rule.py" in p for p in module_map_problems(section, layers, modules + ["loop/new_rule"]))
    moved = section.replace("| `loop/amp.py` |", "| `step/amp.py` |")
    assert any("step/amp.py" in p for p in module_map_problems(moved, layers, modules))
    assert any("not LAYERS in order" in p for p in module_map_problems(section, layers[::-1], modules))


def test_layers_figure_is_current():
    """docs/_static/layers.svg says what LAYERS and the tree say (compared as text,
    so matplotlib's version does not matter; ``python docs/layers_figure.py`` redraws it)."""
    layers, modules = layers_figure.load_layers()
    want = layers_figure.figure_texts(layers_figure.boxes(layers, modules))
    # what equality means: every layer, with its number, and every module is drawn
    drawn = " ".join(want)
    for i, (name, _) in enumerate(layers, 1):
        assert f"layer {i} · " in drawn
    assert all(f"{m.rsplit('/', 1)[-1]}.py" in drawn for m in modules if not m.endswith("/__init__"))
    have = layers_figure.svg_texts()
    assert have == want, (
        "docs/_static/layers.svg is out of date: run `python docs/layers_figure.py` (matplotlib).\n"
        f"  only in the figure: {sorted(set(have) - set(want))}\n  only in LAYERS and the tree: "
        f"{sorted(set(want) - set(have))}")
