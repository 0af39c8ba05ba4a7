"""``pygraph_dist.report()``: what was graphed, for which inputs, and why not."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field



@dataclass(frozen=True)
class GraphReport:
    inputs: str
    phase: str
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
    # 1: the whole iteration graphed; 3: eager, as written (reason says why
    # and what reaches tier 1); "" while probing or warming up.
    tier: str = ""


@dataclass(frozen=True)
class ModelReport:
    model: str
    rank: int
    world_size: int
    graphs_possible: bool
    graphs_reason: str
    loop: str
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

    @property
    def replays(self) -> int:
        """Training iterations (or micro-batches) replayed; evaluation calls not counted."""
        return sum(g.replays for g in self.graphs if g.tier != "eval")

    @property
    def eager_iterations(self) -> int:
        return sum(g.eager_iterations for g in self.graphs if g.tier != "eval")

    @property
    def eval_replays(self) -> int:
        """Evaluation calls (no grad) replayed as forward graphs (evaluation.py)."""
        return sum(g.replays for g in self.graphs if g.tier == "eval")

    @property
    def eval_calls(self) -> int:
        return sum(g.iterations for g in self.graphs if g.tier == "eval")


@dataclass(frozen=True)
class Report:
    models: list[ModelReport]

    def as_dict(self) -> dict:
        return asdict(self)

    def __str__(self) -> str:
        if not self.models:
            return "pygraph_dist: no wrapped model in this process"
        lines = []
        for m in self.models:
            lines.append(f"pygraph_dist report — {m.model} (rank {m.rank} of {m.world_size})")
            opt = m.optimizer + (f" ({', '.join(m.optimizer_changes)})" if m.optimizer_changes else "")
            lines.append(f"  optimizer {opt}; amp {m.amp}; {m.buckets}; backend {m.backend}")
            if not m.graphs_possible:
                lines.append(f"  graphs unavailable: {m.graphs_reason}")
            lines.append(f"  loop: {m.loop}")
            if m.compile:
                lines.append(f"  compile: {m.compile}")
            if m.accumulation and m.accumulation.startswith("learned"):
                lines.append(f"  gradient accumulation: {m.accumulation}")
            if m.skipped_steps is not None:
                lines.append(f"  non-finite steps skipped (skip_nonfinite): {m.skipped_steps}")
            shown = {m.graphs_reason, m.loop.removeprefix("not graphable: ")} - {""}
            if m.eager_buckets:
                lines.append("  gradient buckets outside the graph:")
                lines += [f"    {b}" for b in m.eager_buckets]
            header = (f"  {'inputs':<34} {'tier':<4} {'phase':<8} {'iters':>6} {'replays':>8} {'eager':>6} "
                      f"{'capture':>8} {'setup':>7} {'pool':>8}  collectives / reason")
            lines.append(header)
            for g in m.graphs:
                tail = g.reason if g.phase == "eager" else g.collectives
                if g.phase == "eager" and g.reason in shown:
                    tail = "(reason above)"
                shown.add(g.reason)
                lines.append(
                    f"  {g.inputs[:34]:<34} {g.tier or '-':<4} {g.phase:<8} {g.iterations:>6} {g.replays:>8} "
                    f"{g.eager_iterations:>6} {g.capture_ms:>6.0f}ms {g.setup_s:>6.2f}s "
                    f"{g.pool_mib:>6.1f}Mi  {tail}"
                )
                if g.segments and g.segments != "1 graph (whole iteration)" and g.segments != "no graph":
                    lines.append(f"      segments: {g.segments}")
                if g.selection:
                    lines.append(f"      selection: {g.selection}")
            if m.events:
                lines.append("  events:")
                for e in m.events[-12:]:
                    detail = e["detail"]
                    for reason in shown:
                        if reason and detail.startswith(reason):
                            detail = "(reason above)" + detail[len(reason):]
                            break
                    lines.append(f"    iteration {e['iteration']:>5} [{e['inputs'][:30]}] {e['event']}: {detail}")
        return "\n".join(lines)


def model_report(engine) -> ModelReport:
    """The report of one wrapped model (``Engine.describe``)."""
    return engine.describe()
