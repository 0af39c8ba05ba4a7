"""Draw the package's layers as stacked boxes: docs/_static/layers.svg.

    python docs/layers_figure.py            # rewrite docs/_static/layers.svg
    python docs/layers_figure.py --check    # exit 1 if the figure is out of date

One box per layer of ``LAYERS`` in tests/python/test_layers.py, lowest at the
bottom: its subpackage, its one-line concern and its modules, as the tree has
them. Imports point down. The layers and the module list are read from that
test file (imported by path; it reads the sources and imports nothing of the
package), so the figure and the check that enforces the layers cannot disagree.

The SVG keeps its text as text (``svg.fonttype = "none"``), so
tests/python/test_docs.py can read the strings back and compare them with
:func:`figure_texts`, whatever matplotlib's version does to the bytes.
Only matplotlib is needed to draw; reading and checking need nothing.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import textwrap
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TEST_LAYERS = ROOT / "tests" / "python" / "test_layers.py"
SVG = ROOT / "docs" / "_static" / "layers.svg"

TITLE = "python/pygraph_dist: one layer per box, lowest at the bottom"
ARROW = "imports point down"
CONCERN_WIDTH = 96  # characters per line; generous, as the browser picks the font
MODULES_WIDTH = 110
SANS = ["DejaVu Sans", "sans-serif"]  # the SVG names the fallback, for browsers without DejaVu
MONO = ["DejaVu Sans Mono", "monospace"]


def load_layers(path: Path = TEST_LAYERS):
    """``(LAYERS, modules)``: the declared layers, lowest first, and every module
    of the package by its path in it without ``.py`` (``loop/monitor``)."""
    spec = importlib.util.spec_from_file_location("_pgd_test_layers", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.LAYERS, sorted(mod.import_graph())


@dataclass
class Box:
    heading: str            # "loop/" or "__init__.py"
    count: str              # "layer 4 · 12 modules"
    concern: list[str]      # wrapped lines
    modules: list[str]      # wrapped lines


def boxes(layers, modules) -> list[Box]:
    """One box per layer, lowest first."""
    out = []
    for i, (name, concern) in enumerate(layers):
        if name == "__init__":
            heading, members = "__init__.py", ["__init__"]
        else:
            heading = f"{name}/"
            members = [m.split("/", 1)[1] for m in modules
                       if m.split("/")[0] == name and m != f"{name}/__init__"]
        count = f"layer {i + 1} · {len(members)} module" + ("s" if len(members) != 1 else "")
        out.append(Box(heading, count,
                       textwrap.wrap(concern, CONCERN_WIDTH),
                       textwrap.wrap("  ".join(f"{m}.py" for m in members), MODULES_WIDTH,
                                     break_on_hyphens=False)))
    return out


def figure_texts(bxs: list[Box]) -> list[str]:
    """Every string the figure draws, one per line of text, sorted."""
    texts = [TITLE, ARROW]
    for b in bxs:
        texts += [b.heading, b.count, *b.concern, *b.modules]
    return sorted(texts)


def svg_texts(path: Path = SVG) -> list[str]:
    """The strings of an SVG's ``<text>`` elements, one per element, sorted."""
    root = ET.parse(path).getroot()
    return sorted("".join(el.itertext()) for el in root.iter("{http://www.w3.org/2000/svg}text"))


def draw(bxs: list[Box], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyArrowPatch, FancyBboxPatch

    plt.rcParams.update({"svg.fonttype": "none", "svg.hashsalt": "pygraph_dist-layers",
                         "font.family": SANS, "font.size": 9})
    line = 0.19          # inches per line of text
    pad = 0.10           # inside a box, above and below its text
    gap = 0.07           # between boxes
    width = 11.0
    left, name_w, right_margin = 0.15, 1.55, 0.55
    heights = [max(2, len(b.concern) + len(b.modules)) * line + 2 * pad for b in bxs]
    top_space = 0.45
    height = sum(heights) + gap * (len(bxs) - 1) + top_space + 0.15

    fig = plt.figure(figsize=(width, height))
    ax = fig.add_axes((0, 0, 1, 1))
    ax.set_xlim(0, width)
    ax.set_ylim(0, height)
    ax.axis("off")
    cmap = matplotlib.colormaps["YlGnBu"]
    box_w = width - left - right_margin

    y = 0.15  # bottom edge of the lowest box
    for i, (b, h) in enumerate(zip(bxs, heights)):
        api = b.heading in ("__init__.py", "integrations/")
        face = "#fde9cf" if api else cmap(0.06 + 0.30 * i / max(1, len(bxs) - 1))
        ax.add_patch(FancyBboxPatch((left, y), box_w, h, boxstyle="round,pad=0,rounding_size=0.06",
                                    facecolor=face, edgecolor="#4a5a6a", linewidth=0.8))
        top = y + h - pad - line / 2
        ax.text(left + 0.12, top, b.heading, fontsize=11, fontweight="bold", fontfamily=MONO,
                va="center")
        ax.text(left + 0.12, top - line, b.count, fontsize=8, color="#505050", va="center")
        tx = left + name_w
        k = 0
        for text in b.concern:
            ax.text(tx, top - k * line, text, va="center", fontstyle="italic")
            k += 1
        for text in b.modules:
            ax.text(tx, top - k * line, text, va="center", fontsize=8.5, fontfamily=MONO,
                    color="#1d3557")
            k += 1
        y += h + gap
    boxes_top = y - gap

    ax.text(left, height - 0.22, TITLE, fontsize=11, fontweight="bold", va="center")
    ax_x = width - right_margin / 2
    ax.add_patch(FancyArrowPatch((ax_x, boxes_top - 0.1), (ax_x, 0.25), arrowstyle="-|>,head_width=0.12,"
                                 "head_length=0.2", mutation_scale=20, color="#4a5a6a", linewidth=1.5))
    ax.text(ax_x + 0.1, (boxes_top + 0.15) / 2, ARROW, rotation=90, va="center", ha="left", fontsize=9,
            color="#4a5a6a")
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format=out.suffix.lstrip(".") or "svg", metadata={"Date": None} if out.suffix == ".svg"
                else None)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=SVG, help=f"where to write (default {SVG.relative_to(ROOT)})")
    p.add_argument("--check", action="store_true", help="only check that --out names what LAYERS says")
    args = p.parse_args(argv)
    bxs = boxes(*load_layers())
    if args.check:
        if not args.out.exists() or svg_texts(args.out) != figure_texts(bxs):
            print(f"{args.out} is out of date: run python docs/layers_figure.py", file=sys.stderr)
            return 1
        return 0
    draw(bxs, args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
