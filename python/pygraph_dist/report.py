"""``pygraph_dist.report()``: what was graphed, for which inputs, and why not."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from ._ext import C


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

    @property
    def replays(self) -> int:
        return sum(g.replays for g in self.graphs)

    @property
    def eager_iterations(self) -> int:
        return sum(g.eager_iterations for g in self.graphs)


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
            if m.eager_buckets:
                lines.append("  gradient buckets outside the graph:")
                lines += [f"    {b}" for b in m.eager_buckets]
            header = (f"  {'inputs':<34} {'phase':<8} {'iters':>6} {'replays':>8} {'eager':>6} "
                      f"{'capture':>8} {'setup':>7} {'pool':>8}  collectives / reason")
            lines.append(header)
            for g in m.graphs:
                tail = g.reason if g.phase == "eager" else g.collectives
                lines.append(
                    f"  {g.inputs[:34]:<34} {g.phase:<8} {g.iterations:>6} {g.replays:>8} "
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
                    lines.append(f"    iteration {e['iteration']:>5} [{e['inputs'][:30]}] {e['event']}: {e['detail']}")
        return "\n".join(lines)


def model_report(engine) -> ModelReport:
    graphs = []
    for e in engine.entries.values():
        p = e.policy
        graphs.append(GraphReport(
            inputs=e.description,
            phase=C.phase_name(p.phase),
            reason=p.reason,
            iterations=p.iterations,
            replays=p.replays,
            eager_iterations=p.eager_iterations,
            capture_attempts=p.capture_attempts,
            recaptures=p.recaptures,
            collectives=e.collectives,
            n_collectives=e.n_collectives,
            capture_ms=e.capture_s * 1e3,
            setup_s=e.setup_s,
            pool_mib=e.pool_bytes / 2**20,
            segments=engine._describe_segments(e),
            selection=e.selection,
            eager_ms=e.eager_ms,
            replay_ms=e.replay_ms,
        ))
    if engine.loop_violation:
        loop = f"not graphable: {engine.loop_violation}"
    elif engine.probe_done:
        loop = f"conforms (checked over {engine.config.probe} probe iterations)"
    else:
        loop = "not checked yet"
    backend = "graph-safe (pgd_nccl, fingerprints on)" if engine.fp_backend is not None else (
        "stock (no collective fingerprints)" if engine.device.type == "cuda" else "cpu")
    return ModelReport(
        model=type(engine.module).__name__,
        rank=engine.rank,
        world_size=engine.world_size,
        graphs_possible=engine.graphs_possible,
        graphs_reason=engine.graphs_reason,
        loop=loop,
        amp=engine.amp.name,
        optimizer=engine._base_cls.__name__,
        optimizer_changes=list(engine.opt_plan.changes),
        buckets=engine.reducer.describe(),
        backend=backend,
        eager_buckets=engine.reducer.describe_eager(),
        graphs=graphs,
        events=list(engine.events),
    )
