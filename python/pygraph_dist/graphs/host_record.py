"""What host copies and reads one wrapped model has met (host_copies.py):
the model's :class:`HostWatch` (on once a capture met a pageable host copy),
and per input signature a :class:`HostRecord` of what the observed warm-up
iterations copied and read, folded in one iteration at a time.

Below the session (host_session.py), which reads a record to substitute or
verify a region, and the hooks (host_copies.py), which fold each observed
region into its record.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import torch

from .host_values import difference, same_value, staging_buffer

CHECK_ENV = "PYGRAPH_DIST_CHECK_HOST_COPIES"


# =================================================================== the model's watch
class HostWatch:
    """One wrapped model's switch (``GraphRunner.host_watch``): off until a
    capture meets a pageable host copy; then every warm-up is observed and every
    capture substitutes. ``device_type``/``pin`` are settable for tests."""

    def __init__(self, *, enabled: bool = False, device_type: str = "cuda", pin: bool = True) -> None:
        self.enabled = enabled  # wiring: CUDA graphs possible, module not compiled
        self.wanted = False
        self.device_type = device_type
        self.pin = pin
        self.check_every = check_every_from_env()
        self._retired: list = []  # (event, buffers) of released graphs, freed once the event passed

    @property
    def on(self) -> bool:
        return self.enabled and self.wanted

    def retire(self, buffers: list) -> None:
        """Keep ``buffers`` (read by a graph just released) until the work queued
        so far on the current stream is done: a replay may still be reading them,
        and freed pinned memory is handed to the next ``pin_memory()``."""
        self._purge()
        if not buffers:
            return
        if self.device_type != "cuda" or not torch.cuda.is_available():
            return
        try:
            event = torch.cuda.Event()
            event.record()
        except RuntimeError:  # CUDA going away (teardown): nothing runs any more
            return
        self._retired.append((event, buffers))

    def _purge(self) -> None:
        self._retired = [(e, b) for e, b in self._retired if e is not None and not e.query()]


def check_every_from_env() -> int:
    text = os.environ.get(CHECK_ENV, "").strip()
    if not text:
        return 0
    try:
        n = int(text)
    except ValueError:
        raise ValueError(f"{CHECK_ENV} must be a whole number of iterations, got {text!r}") from None
    return max(0, n)


# ====================================================================== records
@dataclass
class CopyRecord:
    """The n-th host-to-device copy of one line, as the observed iterations made it."""

    site: str  # file:line as reasons name it
    meta: tuple  # dtype, shape, strides of the host source
    target: tuple  # what the copy produces (dtype, device, ...)
    values: torch.Tensor  # the host values (a copy)
    buffer: torch.Tensor | None = None  # pinned, in the target dtype: what the graph copies from
    varied: str = ""  # how the observed iterations disagreed ("" when they did not)


@dataclass
class ReadRecord:
    """A host read of a constant device value, by its recipe."""

    site: str
    value: Any
    varied: str = ""


@dataclass
class HostRecord:
    """What the observed iterations of one signature copied and read (``GraphEntry.host_copies``)."""

    watch: HostWatch
    iterations: int = 0
    copies: dict = field(default_factory=dict)  # (line key, n) -> CopyRecord
    counts: dict = field(default_factory=dict)  # line key -> copies per iteration
    count_varied: dict = field(default_factory=dict)  # line key -> text
    sites: dict = field(default_factory=dict)  # line key -> site text
    reads: dict = field(default_factory=dict)  # recipe -> ReadRecord
    check_calls: int = 0  # replays counted by check_due()

    @property
    def checking(self) -> bool:
        """Check mode is on for this signature (it has copies to check)."""
        return self.watch.check_every > 0 and bool(self.copies)

    def buffers(self) -> list:
        return [c.buffer for c in self.copies.values() if c.buffer is not None]

    def retire(self) -> None:
        """The entry's graphs are released: its pinned buffers go (once no replay reads them)."""
        self.watch.retire(self.buffers())
        for c in self.copies.values():
            c.buffer = None

    def describe(self) -> str:
        """For the "captured" event: what the graph replays from host buffers."""
        if not self.copies and not self.reads:
            return ""
        parts = []
        if self.copies:
            lines = sorted({self.sites[k] for k, _ in self.copies})
            nbytes = sum(c.buffer.numel() * c.buffer.element_size() for c in self.copies.values()
                         if c.buffer is not None)
            parts.append(f"{len(self.copies)} host-to-device cop{'y' if len(self.copies) == 1 else 'ies'} "
                         f"replayed from pinned buffers ({nbytes} B) at {', '.join(lines[:3])}"
                         + (f" +{len(lines) - 3}" if len(lines) > 3 else ""))
        if self.reads:
            lines = sorted({r.site for r in self.reads.values()})
            parts.append(f"{len(self.reads)} host read{'s' if len(self.reads) > 1 else ''} of constant "
                         f"device values answered at capture ({', '.join(lines[:3])})")
        return "; ".join(parts)

    # ------------------------------------------------------------- merging
    def merge(self, counts: dict, sites: dict, copies: dict, reads: dict) -> None:
        """Fold one observed iteration in (a host_session region's ``counts``,
        ``sites``, ``copies`` and ``reads``): what differs from the earlier
        iterations is marked varied."""
        first = self.iterations == 0
        for key, count in counts.items():
            self.sites.setdefault(key, sites[key])
            if first:
                self.counts[key] = count
            elif self.counts.get(key, 0) != count and key not in self.count_varied:
                self.count_varied[key] = (f"copied {self.counts.get(key, 0)} then {count} times in one "
                                          "iteration")
        if not first:
            for key, count in self.counts.items():
                if key not in counts and key not in self.count_varied:
                    self.count_varied[key] = f"copied {count} then 0 times in one iteration"
        for k, (meta, target, values) in copies.items():
            old = self.copies.get(k)
            if old is None:
                self.copies[k] = CopyRecord(sites[k[0]], meta, target, values)
                continue
            if not old.varied:
                old.varied = difference(old.meta, old.target, old.values, meta, target, values)
                if old.varied:
                    old.buffer = None
        for recipe, (site, value) in reads.items():
            old = self.reads.get(recipe)
            if old is None:
                self.reads[recipe] = ReadRecord(site, value)
            elif not old.varied and not same_value(old.value, value):
                old.varied = "the value differed between iterations (a non-deterministic op)"
        self.iterations += 1
        for c in self.copies.values():  # outside any capture: warm-ups are eager
            if c.buffer is None and not c.varied:
                c.buffer = staging_buffer(c.values, c.target, pin=self.watch.pin)

