"""Reasons as the report shows them: a reason cut into its items, each item
in about one sentence, and the fix for reasons that do not say their own.

Plain text in, plain text out: the records (:mod:`~pygraph_dist.reports.reporting`)
and their text (:mod:`~pygraph_dist.reports.report_text`) both build on these.
"""

from __future__ import annotations

import re


# Fixes for eager reasons that do not carry one themselves (the loop check's
# reasons, capture failures and argument warnings say what to change already).
FIXES: tuple[tuple[str, str], ...] = (
    ("was replaced by another object",
     "change the value in place instead of assigning a new object, e.g. param_group['lr'].fill_(lr)"),
    ("changed from",
     "graphs bake this value in and capture again at each change: change it rarely, or keep it fixed"),
    ("evicted from the graph cache",
     "raise wrap(max_graphs=...), or pass wrap(pad_batch_to=...) so that fewer input shapes reach "
     "the model"),
    ("above graph_memory_mb", "raise wrap(graph_memory_mb=...), or leave it unset"),
    ("is not faster than eager",
     "expected where kernels, not launches, bound the step; wrap(select=False) keeps the graph anyway"),
    ("not on a CUDA device", "move the model to a CUDA device before wrap()"),
    ("the optimizer state was loaded", "load optimizer checkpoints before training, not every step"),
    ("a parameter's storage was replaced",
     "load weights in place (load_state_dict() without assign=True, or p.data.copy_(...))"),
    ("a parameter was frozen or unfrozen",
     "freeze or unfreeze parameters rarely: each change captures again"),
)

# What the stock backend costs, and how to keep the graph-safe one (backend.py:
# pgd.init()'s "auto" is "cpu:gloo,cuda:pgd_nccl"; register() makes the name known).
STOCK_BACKEND = ("stock backend: collective fingerprints off, so a rank whose captured collectives "
                 "differ is not named; keep them with pgd.init(), or pygraph_dist.launch.backend.register() "
                 "then init_process_group(backend='cpu:gloo,cuda:pgd_nccl')")


_ANCHOR = re.compile(r" at (?:\S+:\d+|<unknown>)\. ")
_SITE = "; raised at "  # what capture_guard.site_text puts before the line that raised


def split_violations(text: str) -> list[str]:
    """The loop check's reasons, one per item: it joins ``"what at file:line. fix"``
    strings with ``"; "`` (probe.Probe.finish), and fixes may hold ``"; "`` too,
    so a new item starts at the last ``"; "`` before the next ``" at file:line. "``."""
    anchors = list(_ANCHOR.finditer(text))
    if len(anchors) < 2:
        return [text] if text else []
    items, start = [], 0
    for prev, nxt in zip(anchors, anchors[1:]):
        cut = text.rfind("; ", prev.end(), nxt.start())
        if cut < 0:
            continue
        items.append(text[start:cut])
        start = cut + 2
    items.append(text[start:])
    return items


def reason_items(text: str, world_size: int = 0) -> list[str]:
    """A reason as separate items, each once. Agreed reasons are ``"rank 0: ...;
    rank 1: ..."`` (agreement.agree), mostly the same on every rank: an item all
    ``world_size`` ranks gave is shown once without ranks, others keep theirs."""
    parts = re.split(r"(?:^|; )rank (\d+): ", text)
    if len(parts) < 3 or parts[0]:
        return split_violations(text)
    ranks_of: dict[str, list[int]] = {}
    for i in range(1, len(parts), 2):
        for item in split_violations(parts[i + 1]):
            ranks_of.setdefault(item.rstrip(". "), []).append(int(parts[i]))  # the last one ends in "."
    everyone = set(range(world_size)) if world_size else {r for rs in ranks_of.values() for r in rs}
    return [item if set(rs) >= everyone else f"rank{'s' if len(rs) > 1 else ''} "
            f"{', '.join(map(str, rs))}: {item}" for item, rs in ranks_of.items()]


def brief(item: str, limit: int = 200) -> str:
    """One reason in about one sentence: ``what at file:line. fix`` without the
    examples in brackets, or the text cut near ``limit`` at a clause boundary.
    A failed capture's ``"; raised at file:line ..."`` is kept whole after the cut."""
    site = item.find(_SITE)
    if site > 0:
        return brief(item[:site], limit) + item[site:]
    anchor = _ANCHOR.search(item)
    if anchor:
        what = _drop_brackets(item[:anchor.start()])
        item = f"{what}{anchor.group(0)}{item[anchor.end():]}"
        if len(item) <= 1.5 * limit:
            return item
    if len(item) <= limit:
        return item
    cut = max(item.rfind(sep, 0, limit) for sep in (". ", "; ", ", ", " ("))
    return item[:cut if cut > limit // 3 else limit].rstrip(" .;,") + " …"


def _drop_brackets(text: str) -> str:
    """``text`` without its top-level `` (...)`` asides (which may nest: ``parameters()``)."""
    out, depth = [], 0
    for i, ch in enumerate(text):
        if ch == "(" and (depth or text[i - 1:i] == " "):
            depth += 1
            if depth == 1 and out and out[-1] == " ":
                out.pop()
            continue
        if depth:
            depth -= ch == ")"
            continue
        out.append(ch)
    return "".join(out)


def fix_for(reason: str) -> str:
    """The fix :data:`FIXES` knows for ``reason`` ('' when the reason says it itself)."""
    return next((fix for needle, fix in FIXES if needle in reason), "")


_RAISED_AT = re.compile(r"; raised at (\S+:\d+)")


def failure_where(reason: str) -> str:
    """The ``file:line`` a capture-failure reason names
    (:func:`~pygraph_dist.graphs.capture_guard.site_text` writes it), or "".
    Of an agreed reason (``"rank 0: ...; rank 1: ..."``), the first rank's."""
    found = _RAISED_AT.search(reason or "")
    return found.group(1) if found else ""
