"""Sphinx configuration of the pygraph_dist documentation.

Why Sphinx (and not MkDocs): PyTorch, torchvision, torchaudio, Lightning,
Hugging Face's Accelerate docs before their doc-builder, DeepSpeed and most of
the PyTorch ecosystem build their documentation with Sphinx and autodoc, so
the API reference reads and cross-links the way PyTorch users expect, and
docstrings stay the one source of the reference. Pages are Markdown, through
myst-parser, so that they read on GitHub as well.

Build (strict, as CI does in tests/python/test_docs.py):

    PYTHONPATH=python python -m sphinx -W --keep-going -n -b html docs docs/_build/html

autodoc imports pygraph_dist for real (nothing is mocked): this checkout's
``python/`` when its native extension has been copied or built there, else
the installed package.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if any((ROOT / "python" / "pygraph_dist").glob("_C*.so")):
    sys.path.insert(0, str(ROOT / "python"))

import pygraph_dist  # noqa: E402  (fails the build loudly if it cannot be imported)

project = "pygraph_dist"
author = "pygraph_dist contributors"
copyright = "2026, pygraph_dist contributors"
release = version = pygraph_dist.__version__

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",  # the Google-style "Args:" sections of the docstrings
]
source_suffix = {".md": "markdown"}
root_doc = "index"
# README.md here is for people browsing docs/ on GitHub; check_reasons.py is a script.
exclude_patterns = ["_build", "README.md"]

myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3  # [text](page.md#a-heading) links

# The reference of the framework integrations (api.md) imports Lightning,
# transformers and Accelerate, optional extras that the test environment need
# not have: autodoc mocks whichever is not installed, so the strict build
# still passes with the real docstrings (the signatures then read *args, **kwargs).
autodoc_mock_imports = [m for m in ("lightning", "transformers", "accelerate")
                        if importlib.util.find_spec(m) is None]
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_preserve_defaults = True
napoleon_google_docstring = True
napoleon_numpy_docstring = False

# -n (nitpicky) checks every cross-reference. torch's and the standard
# library's objects would need intersphinx, which needs the network; the CI
# machines have none, so those targets are accepted without a link.
nitpick_ignore_regex = [
    (r"py:.*", r"(torch|typing|collections|datetime|contextlib)(\..*)?"),
    (r"py:.*", r"'?(Mapping|Callable|Any|Engine|Report|ModelReport|GraphReport|optional)\b.*"),
    (r"py:.*", r"pygraph_dist\.engine\.(engine\.)?Engine"),  # engine/engine.py since the layers
    (r"py:.*", r"(int|float|str|bool|dict|list|tuple|None|object|RuntimeError)"),
]

html_theme = "alabaster"
html_title = "pygraph_dist"
html_static_path = ["_static"]
html_css_files = ["custom.css"]
html_theme_options = {
    "description": "Whole training iterations of data-parallel PyTorch as CUDA graphs",
    "page_width": "1180px",
    "sidebar_width": "240px",
    "fixed_sidebar": True,
}
