"""The graphs of one wrapped model, one entry per input signature.

An input signature is the call's pytree structure plus, per leaf, the shape,
dtype, device and requires-grad of a tensor or the value of anything else.
Each signature has its own capture policy (the core's ``CapturePolicy``), its
own graphs and its own history. This module owns the entries: lookup (with
optional padding of short batches), drift and invalidation, the least-
recently-used bound on the number and memory of live graphs, the memory pool
the graphs share, and the event log ``report()`` shows.

Every decision here is deterministic given agreed inputs (the sequence of
signatures is the same on every rank, and pool sizes are agreed as the max
over ranks), so eviction happens alike everywhere without a collective.
"""

from __future__ import annotations

import logging
import struct
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import torch

from ..loop.amp import dtype_name
from ..loop.param_groups import group_versions, hyperparams_drift, same_versions
from ..reports.report_reasons import failure_where
from ..runtime._ext import C
from ..runtime.spans import timed

logger = logging.getLogger("pygraph_dist")

Phase = C.Phase


@dataclass
class DriftSnapshot:
    """What a graph baked in at capture, compared before every replay."""

    hyperparams: list = field(default_factory=list)
    params: Any = None  # GradientReducer.param_state(): data pointers and requires_grad
    state_version: int = 0
    versions: Any = None  # param_groups.group_versions() at capture: the param groups' change counts


@dataclass
class GraphEntry:
    """One input signature of one wrapped model."""

    key: tuple
    description: str
    policy: Any  # C.CapturePolicy
    # The captured graphs. Tier 1: the whole iteration, or forward+backward and
    # the step. Tier 2 (split.py): graph is the forward, bwd_graphs the backward
    # (by sync: with and without the all-reduces), step_graph the step.
    tier: int | str = 1  # 1, 2, or "eval" (evaluation.py)
    graph: torch.cuda.CUDAGraph | None = None
    step_graph: torch.cuda.CUDAGraph | None = None
    bwd_graphs: dict = field(default_factory=dict)
    out_template: Any = None  # tier 2: the static outputs, in the module's structure
    static_outs: list = field(default_factory=list)
    diff_mask: list = field(default_factory=list)
    static_grads: list = field(default_factory=list)
    last_call: Any = None  # tier 2: the latest replay of the forward graph
    # Tier 2's loss lane (loss_lane.py): the warm-up's recorder, the captured
    # trace, its static tensors and loss.
    lane_recorder: Any = None
    loss_trace: Any = None
    lane_exts: list = field(default_factory=list)
    lane_loss: Any = None
    lane_meta: tuple = ()
    # host_copies.py: the host tensors its forward copies (observed at warm-up,
    # replayed from pinned buffers), or None.
    host_copies: Any = None
    eager_buckets: tuple = ()  # buckets reduced eagerly between the two graphs
    sparse_grads: dict = field(default_factory=dict)  # param index -> captured local sparse grad
    # Static inputs and output the graphs read and write.
    static: Any = None  # (args, kwargs) with device tensors
    static_leaves: list = field(default_factory=list)
    static_result: Any = None  # (loss, outputs) the graph writes
    # fast_lane.py: the InputGuard of the static inputs in guard_for (a capture
    # replaces the list, which retires the guard).
    guard: Any = None
    guard_for: Any = None
    # What the capture recorded.
    collectives: str = ""
    n_collectives: int = 0
    pool_detail: str = ""  # what the pool holds, by phase (pool_account.py)
    first_seen_s: float = 0.0
    setup_s: float = 0.0  # first warm-up iteration -> capture agreed (synchronised)
    capture_s: float = 0.0
    pool_bytes: int = 0
    drift: DriftSnapshot = field(default_factory=DriftSnapshot)
    # Selection: timed warm-up and replays, and the agreed decision.
    eager_times: list = field(default_factory=list)
    replay_times: list = field(default_factory=list)
    selection: str = ""  # "kept: ..." / "dropped: ..." once decided
    eager_ms: float = 0.0
    replay_ms: float = 0.0
    # Bookkeeping.
    unused_seen: set = field(default_factory=set)  # sets of params without a gradient, per iteration
    last_used: int = 0
    warmups: int = 0

    @property
    def live(self) -> bool:
        return self.graph is not None

    def segments(self, bucket_kinds: list[str]) -> str:
        """How the iteration is split into graphs, for report() and the log."""
        if self.graph is None and self.step_graph is None:
            return "no graph"
        if self.tier == 2:
            variants = " (with and without the all-reduces)" if False in self.bwd_graphs else ""
            return (f"3 graphs per step: forward and backward{variants} per micro-batch, step at "
                    "optimizer.step(); your code runs eagerly between them")
        if self.step_graph is None:
            return "1 graph (whole iteration)"
        kinds = [bucket_kinds[b] for b in self.eager_buckets]
        sparse = kinds.count("sparse")
        parts = [f"bucket{'s' if len(kinds) > 1 else ''} {', '.join(map(str, self.eager_buckets))} "
                 f"reduced eagerly between them"]
        if sparse:
            parts.append(f"{sparse} sparse parameter{'s' if sparse > 1 else ''} stepped eagerly after")
        return "2 graphs (forward+backward, step); " + "; ".join(parts)


@dataclass(frozen=True)
class Event:
    iteration: int
    inputs: str
    event: str
    detail: str
    where: str = ""  # the line that raised, when detail is a failed capture's reason


class GraphCache:
    def __init__(self, *, rank: int, max_graphs: int, graph_memory_mb: float | None,
                 pad_batch_to: tuple[int, ...] = (), pad_value: Any = 0) -> None:
        self.rank = rank
        self.max_graphs = max_graphs
        self.graph_memory_mb = graph_memory_mb
        self.pad_batch_to = pad_batch_to
        self.pad_value = pad_value
        self.entries: OrderedDict[tuple, GraphEntry] = OrderedDict()
        self.events: list[Event] = []
        self.captured_any = False
        self._pool = None
        self.on_none_live = None  # called when a release leaves no graph live (Engine.__init__)

    # ------------------------------------------------------------ lookup
    @timed("signature")
    def pad(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if not self.pad_batch_to:
            return args, kwargs
        return pad_batch(args, kwargs, self.pad_batch_to, self.pad_value)

    @timed("signature")
    def lookup(self, leaves: list, spec, extra: tuple = ()) -> tuple[GraphEntry, bool]:
        """The entry for this call's signature, and whether it is new. ``extra``:
        ambient state a graph bakes in besides the arguments (autocast)."""
        try:
            key = (spec, tuple(_leaf_key(x) for x in leaves), extra)
            hash(key)
        except TypeError:
            key = ("unhashable", id(self))
        entry = self.entries.get(key)
        if entry is not None:
            self.entries.move_to_end(key)
            return entry, False
        entry = GraphEntry(key=key, description=describe_leaves(leaves), policy=None)
        self.entries[key] = entry
        return entry, True

    @timed("signature")
    def find(self, leaves: list, spec, extra: tuple = ()) -> GraphEntry | None:
        """The entry for this signature if there is one (nothing is created)."""
        try:
            return self.entries.get((spec, tuple(_leaf_key(x) for x in leaves), extra))
        except TypeError:
            return None

    def latest_static_inputs(self):
        for entry in reversed(self.entries.values()):
            if entry.live and entry.tier != "eval":
                return entry.static
        return None

    # -------------------------------------------------------------- pool
    def pool_for_capture(self):
        """The memory pool the next capture records into.

        Once every graph captured into a pool id has been released, the
        allocator keeps the id with use_count 0 and asserts on the next capture
        into it ("it->second->use_count > 0", CUDACachingAllocator
        create_or_incref_pool): after a failed capture, an invalidation or the
        eviction of the last graph, a fresh pool is taken."""
        if self._pool is None or not any(e.live for e in self.entries.values()):
            self._pool = torch.cuda.graph_pool_handle()
        return self._pool

    # ------------------------------------------------------------ events
    def event(self, entry: GraphEntry | None, iteration: int, what: str, detail: str) -> None:
        self.events.append(Event(iteration, entry.description if entry is not None else "", what, detail,
                                 failure_where(detail)))

    # ------------------------------------------------------------- drift
    @timed("drift")
    def drift(self, entry: GraphEntry, reducer, optimizer, lr_tensors,
              state_version: int) -> str | None:
        """Why ``entry``'s graphs no longer describe this iteration, or None.
        ``reducer``: the model's GradientReducer (its parameters' state)."""
        if not entry.live:
            return "the graph was released"
        if entry.drift.state_version != state_version:
            return "the optimizer state was loaded (its tensors moved)"
        state = reducer.param_state()  # one C++ pass over the parameters (csrc/param_watch.h)
        if state != entry.drift.params:
            ptrs, requires_grad = decode_param_state(state)
            ptrs0, requires_grad0 = decode_param_state(entry.drift.params)
            if ptrs != ptrs0:
                return ("a parameter's storage was replaced (for example load_state_dict(assign=True) "
                        "or p.data = ...)")
            if requires_grad != requires_grad0:
                return "a parameter was frozen or unfrozen (requires_grad changed)"
        return self.hyperparams_drift(entry, optimizer, lr_tensors)

    @timed("drift")
    def hyperparams_drift(self, entry: GraphEntry, optimizer, lr_tensors) -> str | None:
        """:meth:`drift`'s check of the optimizer's hyperparameters alone."""
        if same_versions(optimizer, entry.drift.versions):  # no group changed since the capture
            return None
        drift = hyperparams_drift(optimizer, entry.drift.hyperparams, lr_tensors)
        if drift is None:  # changed, but back to what the graph baked in (or an lr adopted)
            entry.drift.versions = group_versions(optimizer)
        return drift

    def release(self, entry: GraphEntry) -> None:
        discard(entry.graph)
        discard(entry.step_graph)
        for g in entry.bwd_graphs.values():
            discard(g)
        entry.graph = None
        entry.step_graph = None
        entry.bwd_graphs = {}
        entry.out_template = None
        entry.static_outs, entry.static_grads = [], []
        entry.last_call = None
        entry.sparse_grads = {}
        entry.static_result = None
        entry.lane_loss, entry.lane_exts, entry.lane_recorder = None, [], None
        if entry.host_copies is not None:  # its pinned buffers, once no replay reads them
            entry.host_copies.retire()
            entry.host_copies = None
        if self.on_none_live is not None and not any(e.live for e in self.entries.values()):
            self.on_none_live()

    def invalidate(self, entry: GraphEntry, iteration: int, reason: str) -> None:
        self.release(entry)
        entry.first_seen_s = 0.0
        entry.policy.invalidate(reason)
        nxt = "capturing again after warm-up" if entry.policy.phase != Phase.EAGER else "running eagerly"
        self.event(entry, iteration, "invalidated", f"{reason} ({nxt})")
        if self.rank == 0:
            logger.info("graph for [%s] invalidated: %s; %s", entry.description, reason, nxt)

    def enforce_limits(self, newest: GraphEntry, iteration: int) -> None:
        """LRU out beyond max_graphs or graph_memory_mb."""
        cap = self.graph_memory_mb
        cap_bytes = None if cap is None else int(cap * 2**20)
        if cap_bytes is not None and newest.pool_bytes > cap_bytes:
            self.release(newest)
            newest.policy.reject(
                f"its graph needs {newest.pool_bytes / 2**20:.0f} MiB, above graph_memory_mb={cap:g}"
            )
            self.event(newest, iteration, "not kept", newest.policy.reason)
            return
        live = sorted((e for e in self.entries.values() if e.live), key=lambda e: e.last_used)
        while live and (
            len(live) > self.max_graphs
            or (cap_bytes is not None and sum(e.pool_bytes for e in live) > cap_bytes)
        ):
            victim = live.pop(0)
            if victim is newest:
                continue
            self.invalidate(victim, iteration, f"evicted from the graph cache (least recently used; "
                                               f"max_graphs={self.max_graphs})")

    def describe(self, bucket_kinds: list[str]) -> list:
        return describe_entries(self.entries.values(), bucket_kinds)

    def release_all(self, reason: str) -> bool:
        released = False
        for entry in self.entries.values():
            if entry.live:
                self.release(entry)
                entry.policy.disable(reason)
                released = True
        return released


def discard(graph: torch.cuda.CUDAGraph | None) -> None:
    if graph is None:
        return
    try:
        graph.reset()
    except RuntimeError as exc:  # a capture that never ended may refuse; nothing else to free
        logger.debug("graph.reset() after a failed capture: %s", exc)


def _leaf_key(leaf) -> tuple:
    if isinstance(leaf, torch.Tensor):
        return ("T", tuple(leaf.shape), leaf.dtype, leaf.device.type, leaf.requires_grad)
    hash(leaf)  # TypeError for unhashable arguments
    return ("V", type(leaf).__name__, leaf)


def describe_leaves(leaves) -> str:
    parts = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            parts.append(f"{tuple(leaf.shape)} {str(leaf.dtype).replace('torch.', '')}")
        else:
            parts.append(repr(leaf))
    return ", ".join(parts) if parts else "no inputs"


def pad_batch(args: tuple, kwargs: dict, sizes: tuple[int, ...], value) -> tuple[tuple, dict]:
    """Pad dim 0 of every tensor with the call's batch size up to the next size in ``sizes``.

    ``value`` is one fill value, or one per positional argument (e.g. ``(0, -100)``:
    targets filled with cross-entropy's ignore_index, so padded rows add nothing
    to a mean loss). Keyword tensors are filled with 0 (or the scalar value)."""
    tensors = [a for a in args if isinstance(a, torch.Tensor) and a.dim() > 0]
    if not tensors:
        return args, kwargs
    batch = tensors[0].shape[0]
    target = min((s for s in sizes if s >= batch), default=None)
    if target is None or target == batch:
        return args, kwargs
    per_arg = isinstance(value, (tuple, list))

    def pad(t, fill):
        if not isinstance(t, torch.Tensor) or t.dim() == 0 or t.shape[0] != batch:
            return t
        extra = t.new_full((target - batch, *t.shape[1:]), fill)
        return torch.cat([t, extra], dim=0)

    new_args = tuple(pad(a, value[i] if per_arg and i < len(value) else (0 if per_arg else value))
                     for i, a in enumerate(args))
    new_kwargs = {k: pad(v, 0 if per_arg else value) for k, v in kwargs.items()}
    return new_args, new_kwargs


def describe_entries(entries, bucket_kinds: list[str]) -> list:
    """One :class:`~pygraph_dist.reports.reporting.GraphReport` per signature, in first-seen order."""
    from ..reports.reporting import GraphReport

    out = []
    for e in entries:
        p = e.policy
        out.append(GraphReport(
            inputs=e.description, phase=C.phase_name(p.phase), reason=p.reason,
            iterations=p.iterations, replays=p.replays, eager_iterations=p.eager_iterations,
            capture_attempts=p.capture_attempts, recaptures=p.recaptures,
            collectives=e.collectives, n_collectives=e.n_collectives,
            capture_ms=e.capture_s * 1e3, setup_s=e.setup_s, pool_mib=e.pool_bytes / 2**20,
            segments=e.segments(bucket_kinds), selection=e.selection,
            eager_ms=e.eager_ms, replay_ms=e.replay_ms, live=e.live,
            tier=(e.tier if e.tier == "eval" else str(e.tier) if e.live else
                  ("3" if p.phase == Phase.EAGER else "")),
            was_tier=str(e.tier) if e.live or p.replays else "", autocast=_autocast_name(e.key),
            where=failure_where(p.reason), pool_detail=e.pool_detail,
        ))
    return out


def _autocast_name(key: tuple) -> str:
    """The caller's autocast a signature was seen under (the key's ambient part,
    ``amp.autocast_state``): "bf16", "fp16", or "" when off."""
    ambient = key[2][-2:] if len(key) == 3 else ()  # evaluation keys put their mode first
    if len(ambient) != 2 or not ambient[0]:
        return ""
    return dtype_name(ambient[1])


# bytes from ParamWatch.state() (9 bytes a parameter: data pointer, requires_grad),
# or the Python fallback's (data pointers, requires_grad) lists.
_PARAM_STATE = struct.Struct("=Q?")  # as csrc/param_watch.cpp packs it (native byte order)


def decode_param_state(state: bytes | tuple) -> tuple[list[int], list[bool]]:
    """(data pointers, requires_grad) of a :meth:`GradientReducer.param_state`."""
    if isinstance(state, bytes):
        pairs = list(_PARAM_STATE.iter_unpack(state))
        return [p for p, _ in pairs], [bool(r) for _, r in pairs]
    return list(state[0]), list(state[1])
