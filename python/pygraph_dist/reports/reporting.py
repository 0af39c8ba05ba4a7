"""``pygraph_dist.report()``: what was graphed, for which inputs, and why not.

The engine describes each wrapped model as a :class:`ModelReport` (one
:class:`GraphReport` per input signature, plus the event log). Everything a
reader sees is derived from those records by :func:`summarize`, so the
summary line, the per-signature table and the JSON form cannot disagree:
"tier 2" is said only of a signature whose graphs replayed at tier 2, and a
signature that ended eager is reported eager, whatever the loop check found.
The text is rendered by :mod:`~pygraph_dist.reports.report_text` from the records and
their summaries; reasons are cut and given fixes by
:mod:`~pygraph_dist.reports.report_reasons`. Both sit below this module.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import asdict, dataclass, field

from .report_reasons import brief, fix_for, reason_items
from .report_reasons import failure_where
from .report_text import render

logger = logging.getLogger("pygraph_dist")

# Outcomes the event log appends to a detail: "(capturing again after warm-up)"
# (graph_cache.invalidate), "(will retry after warm-up)" / "(running eagerly)"
# (capture.capture_failed). Repeated events are counted without them.
_OUTCOME = re.compile(r" \((capturing again after warm-up|will retry after warm-up|running eagerly)\)$")
# The suffix CapturePolicy::invalidate (csrc/core/capture_policy.cpp) adds when a
# signature goes eager after more than max_recaptures invalidations.
_TOO_MANY = re.compile(r"^(?P<base>.*); the graph was invalidated (?P<n>\d+) times, more than "
                       r"max_recaptures=(?P<max>\d+)$", re.S)
_NUMBER = re.compile(r"\d+(?:\.\d+)?(?:e[-+]?\d+)?")
# Events whose detail differs every time (timings, sizes): counted by name only.
_ROUTINE = {"captured", "selected"}

# What wrap() says once (warn_stock_backend): report_reasons.STOCK_BACKEND, with what it
# means at run time.
STOCK_BACKEND_AT_WRAP = ("the process group uses torch's stock backend, not pygraph_dist's graph-safe "
                         "one: collective fingerprints are off, so a capture whose collectives differ "
                         "between ranks is not caught (with them it falls back to eager and names the "
                         "rank), and its replays can hang until the replay watchdog ends the process. "
                         "To keep the check, call pgd.init() instead of init_process_group, or call "
                         "pygraph_dist.launch.backend.register() and then "
                         "init_process_group(backend='cpu:gloo,cuda:pgd_nccl', ...)")


@dataclass(frozen=True)
class GraphReport:
    """One input signature of one model (``graph_cache.describe_entries``)."""

    inputs: str
    phase: str  # probe, warmup, capture, replay or eager (the core's CapturePolicy)
    reason: str
    iterations: int
    replays: int
    eager_iterations: int
    capture_attempts: int
    recaptures: int
    collectives: str
    n_collectives: int
    capture_ms: float
    setup_s: float
    pool_mib: float
    segments: str = ""    # "1 graph (whole iteration)" or the split and what runs eagerly
    selection: str = ""   # "kept: replay .. vs eager .." / "dropped: ..." / "" (not decided)
    eager_ms: float = 0.0
    replay_ms: float = 0.0
    live: bool = False    # a graph for these inputs is held now
    # 1 or 2 while a graph is held; 3: eager, as written (reason says why);
    # "" while probing or warming up.
    tier: str = ""
    # The tier of the last graph that replayed for these inputs ("" if none did):
    # "2" with tier "3" is a signature that was graphed, then went eager.
    was_tier: str = ""
    # The caller's own autocast around the model call ("bf16", "fp16"; "" if none).
    autocast: str = ""
    # The line that raised when the reason is a failed capture ("model.py:42",
    # "transformers/models/mistral/modeling_mistral.py:123"; "" otherwise):
    # capture_guard.failure_where(reason).
    where: str = ""
    # What the graph's private pool holds, by phase (pool_account.py; verbose report).
    pool_detail: str = ""


@dataclass(frozen=True)
class ModelReport:
    """One wrapped model on this rank: its settings, what the loop check found,
    one :class:`GraphReport` per input signature and the event log."""

    model: str
    rank: int
    world_size: int
    graphs_possible: bool
    graphs_reason: str
    loop: str  # what the loop check found (not what ran: see summarize())
    amp: str
    optimizer: str
    optimizer_changes: list[str]
    buckets: str
    backend: str
    eager_buckets: list[str] = field(default_factory=list)  # buckets outside the graph, and why
    graphs: list[GraphReport] = field(default_factory=list)
    events: list[dict] = field(default_factory=list)
    skipped_steps: int | None = None  # skip_nonfinite: optimizer steps skipped (inf/NaN gradients)
    compile: str = ""  # torch.compile inside the graph: how, compilations, seconds, recompiles
    # Gradient accumulation without no_sync(): the learned micro-batch count (accumulation.py)
    accumulation: str = ""
    # CUDA through a process group without pygraph_dist's graph-safe backend.
    stock_backend: bool = False
    # The loop fits tier 2: what the probe saw that keeps it from tier 1.
    tier1_needs: str = ""
    # Tier 2: where your own code's loss and clip ran (loss_lane.py, split_clip.py).
    tier2_user_code: str = ""
    # What this model computes differently when captured (model_notes.py): graphed
    # steps are close to eager ones, not bitwise. Said only once a graph replayed.
    numerics: list[str] = field(default_factory=list)
    # Autocast entered inside the module's forward ("bf16", "fp16"; "" if none seen
    # by the probe), e.g. Accelerate's, which patches it into forward.
    inner_autocast: str = ""

    def text(self, verbose: bool = False) -> str:
        """This model's part of :func:`pygraph_dist.report`'s text."""
        return render([(self, summarize(self))], verbose)

    def __str__(self) -> str:
        """The text report, as ``print(pgd.report())`` shows it for this model
        (Lightning's ``trainer.strategy.last_report`` is one of these)."""
        return self.text()

    def as_dict(self) -> dict:
        """This model's entry of :meth:`Report.as_dict`."""
        return Report([self]).as_dict()["models"][0]

    @property
    def replays(self) -> int:
        """Training steps (optimizer steps, micro-batches included) replayed; evaluation calls not counted."""
        return sum(g.replays for g in self.graphs if g.tier != "eval")

    @property
    def eager_iterations(self) -> int:
        """Training steps that ran eagerly (probe, warm-up and capture included); evaluation calls not counted."""
        return sum(g.eager_iterations for g in self.graphs if g.tier != "eval")

    @property
    def eval_replays(self) -> int:
        """Evaluation calls (no grad) replayed as forward graphs (evaluation.py)."""
        return sum(g.replays for g in self.graphs if g.tier == "eval")

    @property
    def eval_calls(self) -> int:
        """Model calls made without autograd (evaluation), replayed or not."""
        return sum(g.iterations for g in self.graphs if g.tier == "eval")


# ------------------------------------------------------------------ summary
def _precision(m: ModelReport) -> str:
    amp = m.amp.split(" ")[0] if m.amp else "fp32"
    weights: dict[str, int] = {}
    for g in m.graphs:
        weights[g.autocast] = weights.get(g.autocast, 0) + max(g.iterations, 1)
    user = sorted((k for k in weights if k), key=lambda k: -weights[k])
    if amp != "fp32":
        return f"amp {amp} (wrap)" + (f", inside your autocast {'/'.join(user)}" if user else "")
    if not user:
        return f"autocast {m.inner_autocast} inside the model's forward" if m.inner_autocast else "fp32"
    text = f"user autocast {'/'.join(user)}"
    if "" in weights:
        with_ac = sum(1 for g in m.graphs if g.autocast)
        text += f" ({with_ac} of {len(m.graphs)} input signatures; fp32 otherwise)"
    return text


def _event_groups(events: list[dict]) -> list[dict]:
    """Events with the same name and detail (the outcome and the numbers in it
    aside: "'weight_decay' changed from 0.01 to 0.02"), counted, in order. A
    group's ``detail`` is its latest; ``varies`` says whether they differed."""
    groups: dict[tuple, dict] = {}
    for e in events:
        detail = e.get("detail", "")
        outcome = _OUTCOME.search(detail)
        base = "" if e["event"] in _ROUTINE else _OUTCOME.sub("", detail)
        g = groups.setdefault((e["event"], _NUMBER.sub("#", base)), {
            "event": e["event"], "detail": base, "varies": False, "count": 0, "signatures": [],
            "first_iteration": e["iteration"], "last_iteration": e["iteration"], "outcome": "",
            "last_detail": "", "where": "",
        })
        g["varies"] = g["varies"] or g["detail"] != base
        g["detail"] = base
        g["count"] += 1
        g["last_iteration"] = e["iteration"]
        g["last_detail"] = detail
        g["where"] = e.get("where") or failure_where(detail)
        g["outcome"] = outcome.group(1) if outcome else ""
        if e.get("inputs", "") not in g["signatures"]:
            g["signatures"].append(e.get("inputs", ""))
    return list(groups.values())


def _eager_reasons(m: ModelReport, graphs: list[GraphReport] | None = None) -> list[dict]:
    """Each distinct reason a signature (of ``graphs``, default all) ran eagerly for good, with its fix."""
    out: dict[str, dict] = {}
    for g in m.graphs if graphs is None else graphs:
        if g.phase != "eager" or not g.reason:
            continue
        r = out.setdefault(g.reason, {"reason": g.reason, "short": "", "items": [], "fix": "",
                                      "where": failure_where(g.reason), "signatures": 0, "steps": 0,
                                      "invalidations": 0})
        r["signatures"] += 1
        r["steps"] += g.eager_iterations
        base, prefix = g.reason, ""
        too_many = _TOO_MANY.match(g.reason)
        if too_many:
            base = too_many["base"]
            r["invalidations"] = int(too_many["n"])
            prefix = f"invalidated {too_many['n']}x (max_recaptures={too_many['max']}) — "
        r["items"] = reason_items(base, m.world_size)
        more = f" (+{len(r['items']) - 1} more)" if len(r["items"]) > 1 else ""
        r["short"] = prefix + brief(r["items"][0]) + more if r["items"] else prefix
        r["fix"] = fix_for(base)
    return sorted(out.values(), key=lambda r: -r["steps"])


def summarize(m: ModelReport) -> dict:
    """What ran, derived from the per-signature records alone (JSON-safe).

    Keys: ``steps``, ``replayed``, ``eager`` (optimizer steps; eager counts the
    probe, warm-up and capture steps too); ``status``: "no steps", "warming up",
    "replaying" (every signature seen holds a graph or is still warming up),
    "partly eager" or "eager"; ``tiers``: tiers of the graphs held now;
    ``was_tiers``: tiers that replayed at some point (a signature since gone
    eager included); ``replay_ms``/``eager_ms``/``speedup``: the timed selection
    of the signature with the most replays, or None; ``precision``;
    ``eager_reasons``: [{reason, short (about one sentence), items (the reason's
    parts, each once), fix, where (the ``file:line`` that raised, for a failed
    capture; else ""), signatures, steps, invalidations}];
    ``events``: counted groups [{event, detail, varies, count, signatures,
    first_iteration, last_iteration, outcome, last_detail, where}];
    ``stock_backend``; ``tier1_needs``: [reason item] (only while a tier-2 graph is held);
    ``tier2_user_code``: where tier 2 ran your loss and clip ("" without tier 2);
    ``eval``: {calls, replayed, eager, signatures, eager_reasons} of the calls made
    without autograd (evaluation.py), which the keys above leave out.
    """
    gs = [g for g in m.graphs if g.tier != "eval"]
    evals = [g for g in m.graphs if g.tier == "eval"]
    steps = sum(g.iterations for g in gs)
    replayed = sum(g.replays for g in gs)
    eager = sum(g.eager_iterations for g in gs)
    live = sorted({g.tier for g in gs if g.live and g.tier})
    was = sorted({g.was_tier for g in gs if g.was_tier and g.replays})
    ended = [g for g in gs if g.phase == "eager"]
    if not steps:
        status = "no steps"
    elif not ended:
        status = "replaying" if replayed or live else "warming up"
    else:
        status = "eager" if len(ended) == len(gs) else "partly eager"
    timed = [g for g in gs if g.replay_ms > 0 and g.eager_ms > 0]
    best = max(timed, key=lambda g: g.replays) if timed else None
    return {
        "steps": steps, "replayed": replayed, "eager": eager, "status": status,
        "tiers": live, "was_tiers": was,
        "replay_ms": round(best.replay_ms, 3) if best else None,
        "eager_ms": round(best.eager_ms, 3) if best else None,
        "speedup": round(best.eager_ms / best.replay_ms, 2) if best else None,
        "precision": _precision(m),
        "eager_reasons": _eager_reasons(m, gs),
        "eval": {"calls": sum(g.iterations for g in evals), "replayed": sum(g.replays for g in evals),
                 "eager": sum(g.eager_iterations for g in evals), "signatures": len(evals),
                 "eager_reasons": _eager_reasons(m, evals)},
        "events": _event_groups(m.events),
        "stock_backend": m.stock_backend,
        "tier1_needs": reason_items(m.tier1_needs, m.world_size) if "2" in live else [],
        "tier2_user_code": m.tier2_user_code if "2" in live or "2" in was else "",
    }


# ------------------------------------------------------------------- report
@dataclass(frozen=True)
class Report:
    """What :func:`pygraph_dist.report` returns: ``str(report)`` is a few lines per
    model (``verbose=True``: every signature, event and setting); ``models`` the
    records; :meth:`as_dict` / :meth:`to_json` the machine-readable form."""

    models: list[ModelReport]
    verbose: bool = False

    def as_dict(self) -> dict:
        """Plain JSON types only, so ``json.loads(json.dumps(d)) == d``.

        ``{"models": [model, ...]}``, one ``model`` per wrapped model in creation
        order: every :class:`~pygraph_dist.reports.reporting.ModelReport` field (``model``, ``rank``,
        ``world_size``, ``graphs_possible``, ``graphs_reason``, ``loop``,
        ``amp``, ``optimizer``, ``optimizer_changes``, ``buckets``, ``backend``,
        ``eager_buckets``, ``skipped_steps``, ``compile``, ``accumulation``,
        ``stock_backend``, ``tier1_needs``), ``graphs``: one dict per input
        signature with the :class:`~pygraph_dist.reports.reporting.GraphReport` fields (``where``: the
        ``file:line`` that raised when ``reason`` is a failed capture), ``events``: the raw event
        log [{iteration, inputs, event, detail, where}], and ``summary``: see
        :func:`~pygraph_dist.reports.reporting.summarize` (steps, replayed, eager, status, tiers, timings,
        precision, eager reasons with fixes, counted events)."""
        return {"models": [{**asdict(m), "summary": summarize(m)} for m in self.models]}

    def to_json(self, **kwargs) -> str:
        """:meth:`as_dict` as a JSON string (``kwargs`` go to ``json.dumps``)."""
        return json.dumps(self.as_dict(), **kwargs)

    def scalars(self, prefix: str = "pygraph_dist/") -> dict[str, float]:
        """Numbers to log per step, e.g. ``for k, v in pgd.report().scalars().items():
        writer.add_scalar(k, v, step)`` (TensorBoard) or ``wandb.log(report.scalars())``.
        Keys ``{prefix}{model}/{steps,replayed,eager,replay_ms,eager_ms}`` (a model
        class wrapped twice gets ``#2``, ``#3``...)."""
        out: dict[str, float] = {}
        seen: dict[str, int] = {}
        for m in self.models:
            seen[m.model] = seen.get(m.model, 0) + 1
            name = m.model if seen[m.model] == 1 else f"{m.model}#{seen[m.model]}"
            s = summarize(m)
            for key in ("steps", "replayed", "eager", "replay_ms", "eager_ms"):
                if s[key] is not None:
                    out[f"{prefix}{name}/{key}"] = s[key]
        return out

    def text(self, verbose: bool | None = None) -> str:
        """The text ``str(report)`` prints; ``verbose`` overrides the form chosen at
        :func:`pygraph_dist.report`."""
        return render([(m, summarize(m)) for m in self.models], self.verbose if verbose is None else verbose)

    def __str__(self) -> str:
        return self.text()


def model_report(engine) -> ModelReport:
    """The report of one wrapped model (``Engine.describe``)."""
    return engine.describe()


_stock_said: set[int] = set()


def warn_stock_backend(engine) -> None:
    """At ``wrap()``: say once per process group, on its rank 0, that a CUDA model
    trains through torch's stock backend, what that loses and how to keep it."""
    group = getattr(engine, "group", None)
    if (engine.device.type != "cuda" or not engine.graphs_possible or engine.fp_backend is not None
            or engine.rank != 0 or id(group) in _stock_said):
        return
    _stock_said.add(id(group))
    logger.warning(STOCK_BACKEND_AT_WRAP)
