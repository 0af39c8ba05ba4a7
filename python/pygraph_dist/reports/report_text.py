"""The text of ``pygraph_dist.report()``: a few lines per model, or everything.

Both forms are rendered from a model's summary (:func:`pygraph_dist.reports.reporting.summarize`)
and the same per-signature records, so what the summary says ran is what the table
shows. The records and their summaries are passed in: ``m`` below is a
:class:`~pygraph_dist.reports.reporting.ModelReport` and ``s`` its summary. This module
sits below :mod:`~pygraph_dist.reports.reporting` (whose records print through it) and
imports nothing of it.
"""

from __future__ import annotations

import textwrap

from .report_reasons import STOCK_BACKEND, brief, fix_for, reason_items

WIDTH = 110  # verbose reasons wrap here: no paragraph on one line
MORE = "details: pygraph_dist.report(verbose=True)"


def render(models: list[tuple], verbose: bool) -> str:
    """The text of ``models``: (record, its summary) pairs."""
    if not models:
        return "pygraph_dist: no wrapped model in this process"
    lines: list[str] = []
    for m, s in models:
        lines += _verbose(m, s) if verbose else _default(m, s)
    if not verbose:
        lines.append(f"  ({MORE})")
        lines = [w for line in lines for w in _fold(line)]
    return "\n".join(lines)


def _fold(line: str, width: int = 120) -> list[str]:
    """A default-form line folded at ``width`` (continuations indented)."""
    if len(line) <= width or not line.startswith(" "):  # a model's first line stays whole
        return [line]
    indent = " " * (len(line) - len(line.lstrip()))
    return textwrap.wrap(line.lstrip(), width, initial_indent=indent, subsequent_indent=indent + "    ",
                         break_on_hyphens=False)


# ------------------------------------------------------------------ helpers
def _with_fix(reason: str, fix: str) -> str:
    text = reason.rstrip(". ")
    return f"{text}. Fix: {fix}" if fix else text


def _ran(s: dict) -> str:
    """The summary of what ran (the first line of a model)."""
    steps, replayed, eager = s["steps"], s["replayed"], s["eager"]
    if s["status"] == "no steps":
        return "no training step yet"
    if not replayed:
        return f"{steps} steps, all eager" + (" (probing and warming up)"
                                              if s["status"] == "warming up" else "")
    tiers = s["tiers"] or s["was_tiers"]
    how = "/".join(f"tier {t}" for t in tiers)
    if not s["tiers"]:
        how += ", then eager"
    text = f"{steps} steps, {replayed} replayed ({how}), {eager} eager"
    if s["status"] == "replaying":
        text += " (probe, warm-up, capture)"
    if s["replay_ms"]:
        text += f"; {s['replay_ms']:.2f} ms/step replayed vs {s['eager_ms']:.2f} eager ({s['speedup']:.2f}x)"
    return text


def _status(g) -> str:
    if g.phase == "eager":
        return f"eager (was tier {g.was_tier})" if g.was_tier else "eager"
    if g.live:
        return f"tier {g.tier}"
    return {"probe": "probing", "warmup": "warming up", "capture": "capturing"}.get(g.phase, g.phase)


def _event_text(group: dict, limit: int = 110) -> str:
    detail = group["detail"] if group["event"] not in ("captured", "selected") else ""
    text = f"{group['event']} {group['count']}x"
    if detail:
        text += f" — {brief(detail, limit)}" + (" (the latest; values vary)" if group["varies"] else "")
    if group["outcome"] == "running eagerly" and group["event"] in ("invalidated", "capture failed"):
        text += ", then eager"
    return text


def _extras(m, s: dict) -> list[str]:
    """Precision, compile, accumulation, skipped steps: one short phrase each."""
    out = [f"precision: {s['precision']}"]
    if m.compile:
        out.append(m.compile.split(";")[0])
    if m.accumulation.startswith("learned"):
        out.append("accumulation " + m.accumulation.split(",")[0].removeprefix("learned: "))
    if m.skipped_steps:
        out.append(f"{m.skipped_steps} non-finite steps skipped")
    return out


# ------------------------------------------------------------------ default
def _default(m, s: dict) -> list[str]:
    lines = [f"pygraph_dist — {m.model} (rank {m.rank} of {m.world_size}): {_ran(s)}"]
    train = [g for g in m.graphs if g.tier != "eval"]
    if len(train) > 1:
        shown = sorted(train, key=lambda g: -g.iterations)[:2]
        for g in shown:
            lines.append(f"    [{g.inputs[:40]}] {_status(g)}: {g.replays} replayed, "
                         f"{g.eager_iterations} eager")
        if len(train) > 2:
            lines.append(f"    ... and {len(train) - 2} more input signatures")
    ev = s["eval"]
    if ev["calls"]:
        text = (f"  evaluation (no grad): {ev['calls']} calls, {ev['replayed']} replayed as forward graphs "
                f"({ev['signatures']} signature{'s' if ev['signatures'] > 1 else ''})")
        reasons = [r for r in ev["eager_reasons"] if r["reason"] != m.graphs_reason]  # said below
        if reasons:
            text += f"; eager: {_with_fix(reasons[0]['short'], reasons[0]['fix'])}"
        lines.append(text)
    said: set[str] = set()
    room = 2
    if not m.graphs_possible and m.graphs_reason:
        lines.append("  graphs unavailable: " + _with_fix(brief(m.graphs_reason), fix_for(m.graphs_reason)))
        said.add(m.graphs_reason)
        room -= 1
    reasons = [r for r in s["eager_reasons"] if r["reason"] not in said]
    for r in reasons[:room]:
        lines.append(f"  eager: {_with_fix(r['short'], r['fix'])}")
    if len(reasons) > room:
        lines[-1] += f" (and {len(reasons) - room} more reasons for eager steps)"
    if s["tier2_user_code"]:
        lines.append(f"  tier 2 ran: {s['tier2_user_code']}")
    for note in m.numerics:  # graphed steps are not bitwise to eager ones: never left unsaid
        lines.append(f"  numerics: {brief(note, 160)}")
    if s["tier1_needs"]:
        more = f" (+{len(s['tier1_needs']) - 1} more)" if len(s["tier1_needs"]) > 1 else ""
        lines.append(f"  not tier 1 because: {brief(s['tier1_needs'][0])}{more}")
    # Repeated or unusual events, counted; those an eager line above already says are left out.
    told = {r["reason"] for r in s["eager_reasons"]}
    notable = [g for g in s["events"] if g["event"] not in ("captured", "selected", "loop not graphable")
               and not any(g["detail"] and g["detail"] in r for r in told)]
    if notable:  # as many groups as fit one line
        texts = [_event_text(g, 200 if len(notable) == 1 else 80) for g in notable]
        n = 1
        while n < len(texts) and len("  events: " + "; ".join(texts[:n + 1])) <= 112:
            n += 1
        rest = f"; +{len(texts) - n} more" if n < len(texts) else ""
        lines.append("  events: " + "; ".join(texts[:n]) + rest)
    lines.append("  " + " · ".join(_extras(m, s)))
    if m.stock_backend:
        lines.append(f"  {STOCK_BACKEND}")
    return lines


# ------------------------------------------------------------------ verbose
def _wrapped(label: str, text: str, indent: str, world_size: int = 0) -> list[str]:
    """``label text`` wrapped at WIDTH; a reason's items (each once) one per line."""
    items = reason_items(text, world_size) or [text]
    if len(items) == 1:
        return textwrap.wrap(f"{label}{items[0]}", WIDTH, initial_indent=indent,
                             subsequent_indent=indent + "    ", break_on_hyphens=False)
    out = [f"{indent}{label.rstrip()}"]
    for item in items:
        out += textwrap.wrap(item, WIDTH, initial_indent=indent + "  - ",
                             subsequent_indent=indent + "    ", break_on_hyphens=False)
    return out


def _verbose(m, s: dict) -> list[str]:
    lines = [f"pygraph_dist report — {m.model} (rank {m.rank} of {m.world_size})",
             f"  ran: {_ran(s)}"]
    opt = m.optimizer + (f" ({', '.join(m.optimizer_changes)})" if m.optimizer_changes else "")
    lines.append(f"  optimizer {opt}; {m.buckets}")
    note = m.amp.partition(" ")[2].strip("()")  # "fp32 casts in graphs: Triton"
    lines.append(f"  precision: {s['precision']}" + (f"; {note}" if note else ""))
    lines.append(f"  backend: {m.backend}")
    for note in m.numerics:
        lines += _wrapped("numerics: ", note, "  ")
    if m.stock_backend:
        lines += _wrapped("", STOCK_BACKEND, "    ")
    if not m.graphs_possible:
        lines += _wrapped("graphs unavailable: ", m.graphs_reason, "  ")
    head, reasons = "", m.loop  # the check's verdict, then its reasons one per line
    if m.tier1_needs and m.loop.endswith(m.tier1_needs):
        head, reasons = m.loop[:-len(m.tier1_needs)], m.tier1_needs
    elif m.loop.startswith("not graphable: "):
        head, reasons = "not graphable: ", m.loop.removeprefix("not graphable: ")
    lines += _wrapped(f"loop check: {head}", reasons, "  ", m.world_size)
    if m.compile:
        lines += _wrapped("compile: ", m.compile, "  ")
    if m.accumulation:
        lines += _wrapped("gradient accumulation: ", m.accumulation, "  ")
    if m.skipped_steps is not None:
        lines.append(f"  non-finite steps skipped (skip_nonfinite): {m.skipped_steps}")
    if m.eager_buckets:
        lines.append("  gradient buckets outside the graph:")
        lines += [f"    {b}" for b in m.eager_buckets]
    table, said = _table(m)
    lines += table
    if s["events"]:
        lines.append("  events (repeats counted):")
        for g in s["events"]:
            span = (f"iteration {g['first_iteration']}" if g["count"] == 1 else
                    f"iterations {g['first_iteration']}-{g['last_iteration']}")
            where = f" [{g['signatures'][0][:30]}]" if len(g["signatures"]) == 1 and g["signatures"][0] else (
                f" [{len(g['signatures'])} input signatures]" if len(g["signatures"]) > 1 else "")
            head = f"{g['event']} {g['count']}x, {span}{where}: "
            detail = g["detail"] or g["last_detail"]
            if detail in said:
                detail = "(as above)"
            elif g["varies"]:
                detail += " (the latest; values vary)"
            if g["outcome"]:
                detail += f" (last: {g['outcome']})"
            lines += _wrapped(head, detail, "    ", m.world_size)
    return lines


def _table(m) -> tuple[list[str], set[str]]:
    """The per-signature table, and the reasons it printed."""
    lines = [f"  {'inputs':<34} {'status':<17} {'iters':>6} {'replays':>8} {'eager':>6} "
             f"{'capture':>8} {'setup':>7} {'pool':>8}  collectives"]
    said = {m.graphs_reason, m.loop.removeprefix("not graphable: ")}  # printed above the table
    for g in m.graphs:
        lines.append(
            f"  {g.inputs[:34]:<34} {_status(g):<17} {g.iterations:>6} {g.replays:>8} "
            f"{g.eager_iterations:>6} {g.capture_ms:>6.0f}ms {g.setup_s:>6.2f}s "
            f"{g.pool_mib:>6.1f}Mi  {g.collectives or '-'}")
        if g.autocast:
            lines.append(f"      autocast: {g.autocast} (yours, around the model call)")
        if g.pool_detail and g.live:
            lines += _wrapped("", g.pool_detail, "      ")
        if g.reason:
            label = "eager because: " if g.phase == "eager" else "last reason: "
            if g.reason in said:
                lines.append(f"      {label}(as above)")
            else:
                lines += _wrapped(label, _with_fix(g.reason, fix_for(g.reason)), "      ", m.world_size)
                said.add(g.reason)
        if g.segments and g.segments not in ("1 graph (whole iteration)", "no graph"):
            lines += _wrapped("segments: ", g.segments, "      ")
        # A selection kept a graph this signature no longer has: not shown as kept.
        if g.selection and not (g.phase == "eager" and g.selection.startswith("kept")):
            lines += _wrapped("selection: ", g.selection, "      ")
    return lines, said
