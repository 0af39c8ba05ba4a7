"""Every reason pygraph_dist can print must be explained in docs/troubleshooting.md.

Run ``python docs/check_reasons.py`` (from anywhere): it prints each reason
string whose key is missing from the page, with the file:line it comes from,
and exits 1 if any is missing. ``--all`` lists every reason found.
``tests/python/test_docs.py`` runs the same scan.

What counts as a reason string (read from the source, never imported):

* Python (``python/pygraph_dist/**/*.py``, parsed with ``ast``):

  - the message of every ``raise SomeError(...)`` (any exception, SystemExit too);
  - the string arguments of calls to the *sinks* in :data:`SINKS` -- the
    capture policy's ``disable``/``conformance_failed``/``capture_failed``/
    ``invalidate``/``reject``, the loop's ``violation`` and friends (only the
    "what", not the fix), buckets sent outside the graph (``set_eager``),
    ``logger.warning``/``logger.error``/``logger.critical`` and ``warnings.warn``;
  - the strings returned by, or appended to a list in, the *reason producers*
    in :data:`PRODUCERS` (functions whose result becomes a reason, such as
    ``describe_capture_error`` or the optimizer's hyperparameter drift).

  An argument that is a variable is followed to the string assigned to it in
  the same function, or to a module-level constant of the package. A string
  built with ``+``, f-strings, ``%`` formats or ``a if c else b`` contributes
  each of its branches.

* C++ (``csrc/**/*.cpp``): the text of every call in :data:`CPP_SINKS` --
  ``refuse(...)`` (the graph-safe backend's refusals, which become
  capture-failure reasons), ``to_eager(...)`` (the capture policy's own
  reasons) and ``snprintf(...)`` formats (what the replay watchdog prints
  before it ends the process).

A string's *key* is its first static run of text (the text between
placeholders) that has at least :data:`MIN_WORDS` words, cut to
:data:`KEY_WORDS` words and stripped of surrounding punctuation. A string
with no such run (all placeholders) has no key and is not checked.
troubleshooting.md must contain each key, compared case-insensitively after
dropping Markdown's backticks, ``*`` and ``\\`` and collapsing whitespace:
quote the start of the message in the page, e.g. in a code span.

If a sink or producer named here no longer exists in the code, the scan
fails too, so that renaming one cannot silently shrink what is checked.
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "python" / "pygraph_dist"
CSRC = ROOT / "csrc"
PAGE = ROOT / "docs" / "troubleshooting.md"

MIN_WORDS = 4
KEY_WORDS = 8

# Call name -> which positional arguments carry the reason ("all": every string
# argument, keywords included). For the loop's violations only the first
# argument (what happened) is a reason; the second is the fix, which the page
# may paraphrase.
SINKS: dict[str, str | tuple[int, ...]] = {
    "disable": "all",             # CapturePolicy: this input signature trains eagerly
    "conformance_failed": "all",  # CapturePolicy: the probe's verdict on the loop
    "capture_failed": "all",      # CapturePolicy / CaptureRunner: a failed capture
    "invalidate": "all",          # GraphCache / CapturePolicy: drift, eviction
    "reject": "all",              # CapturePolicy: selection or memory cap dropped a graph
    "set_eager": "all",           # GradientReducer: a bucket leaves the graph
    "violation": (0,),            # LoopState: a loop a graph cannot replay
    "forward_violation": (0,),
    "Violation": (0,),
    "record": (0,),
    "_not_graphable": (2,),       # optim.py: the optimizer cannot be captured
    "_reduce": "all",             # accumulation.py: a learned accumulation reduced eagerly
    "warning": "all",             # logger.warning
    "error": "all",               # logger.error
    "critical": "all",            # logger.critical
    "warn": "all",                # warnings.warn
}

# Functions whose returned strings (or strings they append to a list) are
# reasons that reach the report or an error.
PRODUCERS = (
    "graphs_available",        # _ext.py: why graphs are unavailable in this process
    "_why_no_graphs",          # wiring.py: why this model cannot be graphed
    "describe_capture_error",  # capture_guard.py: a capture that raised
    "varying_paths",           # capture.py: parameters used in some iterations only
    "explain_mismatch",        # agreement.py: ranks captured different things
    "drift",                   # graph_cache.py: why a graph was invalidated
    "hyperparams_drift",       # optim.py: a hyperparameter baked into the graph changed
    "_sgd_device_lr_problem",  # optim.py: why SGD keeps a float lr
    "loss_error",              # step.py: the model did not produce a scalar loss
)

CPP_SINKS = ("refuse", "to_eager", "snprintf")

_PLACEHOLDER = re.compile(r"%\{\}|%[-#0 +]*\d*(?:\.\d+)?(?:z|l|ll)?[sdurfigx%]|\{\}")


@dataclass(frozen=True)
class Reason:
    key: str     # what troubleshooting.md must contain
    text: str    # the string, placeholders shown as {}
    where: str   # file:line

    def __str__(self) -> str:
        return f"{self.where}: {self.key!r}  (from {self.text[:100]!r})"


def normalize(text: str) -> str:
    text = text.replace("`", "").replace("*", "").replace("\\", "")
    return re.sub(r"\s+", " ", text).strip().lower()


def key_of(text: str) -> str | None:
    """The first static run of ``text`` with at least MIN_WORDS words, cut to KEY_WORDS."""
    for run in _PLACEHOLDER.split(text):
        words = run.split()
        if sum(any(c.isalnum() for c in w) for w in words) >= MIN_WORDS:
            return " ".join(words[:KEY_WORDS]).strip(" .,;:()[]'\"-—")
    return None


# ------------------------------------------------------------------ Python
def _texts(node: ast.AST, names: dict[str, list[ast.AST]], depth: int = 0) -> list[str]:
    """The possible texts of a string expression, placeholders as ``{}``."""
    if depth > 8:
        return []
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.JoinedStr):
        return ["".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)]
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left = _texts(node.left, names, depth + 1) or ["{}"]
        right = _texts(node.right, names, depth + 1) or ["{}"]
        return [a + b for a in left for b in right]
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mod):  # "..." % args
        return _texts(node.left, names, depth + 1)
    if isinstance(node, ast.IfExp):
        return _texts(node.body, names, depth + 1) + _texts(node.orelse, names, depth + 1)
    if isinstance(node, ast.Tuple):  # return "reason", retryable / return False, "reason"
        return [t for e in node.elts for t in _texts(e, names, depth + 1)]
    if isinstance(node, ast.Name) and node.id in names:
        return [t for value in names[node.id] for t in _texts(value, names, depth + 1)]
    return []


def _assignments(scope: ast.AST) -> dict[str, list[ast.AST]]:
    out: dict[str, list[ast.AST]] = {}
    for node in ast.walk(scope):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    out.setdefault(target.id, []).append(node.value)
    return out


def _module_constants(files: list[Path]) -> dict[str, list[ast.AST]]:
    """Module-level ``NAME = "..."`` of the whole package (imported constants resolve too)."""
    out: dict[str, list[ast.AST]] = {}
    for f in files:
        for node in ast.parse(f.read_text()).body:
            if isinstance(node, ast.Assign) and _texts(node.value, {}):
                for target in node.targets:
                    if isinstance(target, ast.Name):
                        out.setdefault(target.id, []).append(node.value)
    return out


def _call_name(call: ast.Call) -> str:
    f = call.func
    return f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""


def python_reasons(package: Path = PACKAGE) -> tuple[list[Reason], list[str]]:
    """(reasons, problems): problems name sinks or producers not found in the code."""
    files = sorted(package.rglob("*.py"))
    constants = _module_constants(files)
    found: list[Reason] = []
    seen_sinks: set[str] = set()
    seen_producers: set[str] = set()

    def add(expr: ast.AST, names: dict, f: Path) -> None:
        for text in _texts(expr, names):
            text = _PLACEHOLDER.sub("{}", text)
            key = key_of(text)
            if key:
                found.append(Reason(key, text, f"{f.relative_to(ROOT)}:{expr.lineno}"))

    for f in files:
        tree = ast.parse(f.read_text())
        functions = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
        scope_of: dict[ast.AST, ast.AST] = {}
        for fn in functions:  # innermost function wins: walk order visits outer first
            for node in ast.walk(fn):
                scope_of[node] = fn
        local: dict[ast.AST, dict] = {fn: {**constants, **_assignments(fn)} for fn in functions}
        for node in ast.walk(tree):
            names = local.get(scope_of.get(node), constants)
            if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call) and node.exc.args:
                add(node.exc.args[0], names, f)
            elif isinstance(node, ast.Call) and _call_name(node) in SINKS:
                name = _call_name(node)
                if name in ("warning", "error", "critical") and not (
                        isinstance(node.func, ast.Attribute) and isinstance(node.func.value, ast.Name)
                        and node.func.value.id in ("logger", "log", "logging")):
                    continue
                seen_sinks.add(name)
                which = SINKS[name]
                args = list(node.args) + ([k.value for k in node.keywords] if which == "all" else [])
                for i, arg in enumerate(args):
                    if which == "all" or i in which:
                        add(arg, names, f)
        for fn in functions:
            if fn.name not in PRODUCERS:
                continue
            seen_producers.add(fn.name)
            names = local[fn]
            for node in ast.walk(fn):
                if isinstance(node, ast.Return) and node.value is not None:
                    add(node.value, names, f)
                elif (isinstance(node, ast.Call) and _call_name(node) == "append" and node.args):
                    add(node.args[0], names, f)
    problems = [f"sink {s!r} (docs/check_reasons.py SINKS) is no longer called in python/pygraph_dist"
                for s in SINKS if s not in seen_sinks and s not in ("error", "critical", "record")]
    problems += [f"reason producer {p!r} (docs/check_reasons.py PRODUCERS) no longer exists in "
                 "python/pygraph_dist" for p in PRODUCERS if p not in seen_producers]
    return found, problems


# --------------------------------------------------------------------- C++
_STRING = re.compile(r'"((?:[^"\\]|\\.)*)"')


def _cpp_call_args(source: str, start: int) -> str:
    """The text between the parentheses of the call whose ``(`` is at ``start``."""
    depth, i, in_str = 0, start, False
    while i < len(source):
        c = source[i]
        if in_str:
            if c == "\\":
                i += 1
            elif c == '"':
                in_str = False
        elif c == '"':
            in_str = True
        elif c == "(":
            depth += 1
        elif c == ")":
            depth -= 1
            if depth == 0:
                return source[start + 1:i]
        i += 1
    return source[start + 1:]


def cpp_reasons(csrc: Path = CSRC) -> list[Reason]:
    found = []
    for f in sorted(csrc.rglob("*.cpp")):
        source = f.read_text()
        for m in re.finditer(r"\b(?:%s)\(" % "|".join(CPP_SINKS), source):
            args = _cpp_call_args(source, m.end() - 1)
            if args.strip().startswith("const std::string"):
                continue  # the definition of refuse() / to_eager() itself
            # Adjacent literals concatenate; anything else between them is a placeholder.
            text, last = "", 0
            for s in _STRING.finditer(args):
                between = args[last:s.start()]
                if last and not re.fullmatch(r"\s*", between) or (not last and between.strip()):
                    text += "{}"
                text += s.group(1).replace('\\"', '"').replace("\\n", "\n")
                last = s.end()
            key = key_of(text)
            if key:
                line = source.count("\n", 0, m.start()) + 1
                found.append(Reason(key, text, f"{f.relative_to(ROOT)}:{line}"))
    return found


# -------------------------------------------------------------------- check
def all_reasons() -> tuple[list[Reason], list[str]]:
    py, problems = python_reasons()
    return py + cpp_reasons(), problems


def missing_reasons(page: Path = PAGE) -> tuple[list[Reason], list[str]]:
    """Reasons whose key is not in ``page``, and problems with the scan itself."""
    reasons, problems = all_reasons()
    text = normalize(page.read_text())
    return [r for r in reasons if normalize(r.key) not in text], problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--all", action="store_true", help="list every reason found, not only the missing")
    args = parser.parse_args(argv)
    if args.all:
        reasons, _ = all_reasons()
        for r in sorted(set(reasons), key=lambda r: r.where):
            print(r)
        print(f"{len(reasons)} reason strings, {len({normalize(r.key) for r in reasons})} distinct keys")
    missing, problems = missing_reasons()
    for p in problems:
        print(f"scan problem: {p}")
    for r in missing:
        print(f"missing from docs/troubleshooting.md: {r}")
    if not missing and not problems:
        print("docs/troubleshooting.md explains every reason string")
    return 1 if missing or problems else 0


if __name__ == "__main__":
    sys.exit(main())
