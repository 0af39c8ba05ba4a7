"""Host tensors made in forward, graphed: pageable host-to-device copies, and
host reads of device values computed from them.

This module: the engine's hooks. The model's watch and what the warm-ups
recorded are host_record.py's; one observed, substituted or verified region is
host_session.py's; the values, lines and constant recipes they work with are
host_values.py's (each module imports only those after it).

A forward that builds a tensor on the host and copies it to the GPU every
iteration -- ``nn.Transformer.generate_square_subsequent_mask(T).to(device)``,
``torch.tensor(0.5, device="cuda")``, transformers' sliding-window cache
(``torch.tensor(window).to(device)``) -- cannot be captured as written: a copy
from pageable host memory is not a graph node, and torch refuses it while
capturing ("Cannot copy between CPU and CUDA tensors during CUDA graph capture
unless the CPU tensor is pinned"). Such a copy is graphed here when its host
values are the same on every iteration:

* **trigger** -- a capture that failed with that error (every model is captured
  as before until one does, so this module costs nothing elsewhere) switches the
  model's :class:`HostWatch` on: from then on the warm-up iterations of every
  signature (tier 1, tier 2's forward, evaluation forwards) are *observed* and
  their captures *substitute*. Not for ``torch.compile``'d modules (a dispatch
  mode would meet dynamo);
* **observe** (eager warm-up): :class:`_HostMode`, a ``TorchDispatchMode``, sees
  every ``aten._to_copy`` / ``aten.copy_`` from a non-pinned CPU tensor to the
  device, and ``torch.tensor`` / ``torch.as_tensor`` / ``Tensor.new_tensor``
  with a device target (patched while observing: they copy below the Python
  dispatch key otherwise), names each by its line (the innermost frame outside
  torch and pygraph_dist; copies made by pygraph_dist itself, such as moving CPU
  inputs, are not the model's), and records the n-th copy of each line with a
  copy of its host values. After the first observed iteration the values are
  pinned (``pin_memory``, outside any capture), converted to the target dtype;
* **substitute** (capture): the n-th copy at a line is checked against every
  observed iteration (dtype, shape, strides, values bitwise) and performed from
  the pinned buffer with ``non_blocking=True`` -- a copy the graph records and
  replays from that fixed buffer, which the graph entry owns until it is
  released. A line whose values (or number of copies) differed between
  iterations, or differ at capture, refuses the capture with a non-retryable
  reason naming it; the signature then trains eagerly, as written.

The assumption, and the documented limit: a graph replays the copy from the
buffer filled at warm-up, so replays are bitwise equal to eager training as long
as the host values are the same on every iteration. Values that change only
after the warm-ups (a tensor made from the step counter after step 1000) are
not seen; ``PYGRAPH_DIST_CHECK_HOST_COPIES=N`` runs every N-th iteration of such
a signature eagerly, observed, and drops its graphs (on every rank) when the
values moved.

**Host reads of constants.** A copied mask is often read back on the host at
once: ``nn.TransformerEncoder`` asks whether the mask is causal with
``bool((mask == causal).all())``, a host synchronisation that no capture
allows. While observing or substituting, :class:`_Constants` follows every
device tensor computed only from observed host copies, deterministic device
factories (``torch.full/zeros/arange(..., device=...)``) and deterministic
aten ops on those, by a digest of that recipe; in-place writes (by the op
schemas) forget every tensor on the written storage. A host read
(``.item()``, ``bool()``, ``torch.equal``, ``.cpu()``/``.tolist()``) of such a
constant is recorded at warm-up with its recipe and answered at capture from
the record, without a sync: the recipe fixes the value. A read of anything else
(a value computed from inputs or weights) refuses the capture with a reason
naming its line, as a host synchronisation.
"""

from __future__ import annotations

import contextlib
import logging

from .host_record import CHECK_ENV, HostRecord, HostWatch  # noqa: F401 - CHECK_ENV: part of this module's surface
from .host_session import (  # noqa: F401 - HostTensorError and _session: part of this module's surface
    _FIX, OBSERVE, SUBSTITUTE, VERIFY, HostTensorError, _active, _session, _Session,
)
from .host_values import difference, meta_of, same_value, staging_buffer, value_digest  # noqa: F401
from .capture_guard import TORCHSCRIPT_FAILED, exception_chain, torchscript_without_message

logger = logging.getLogger("pygraph_dist")

# What torch says when a capture meets a pageable host<->device copy (Copy.cu).
PAGEABLE_COPY_ERROR = "Cannot copy between CPU and CUDA tensors during CUDA graph capture"


# ============================================================= the engine's hooks
def observing(watch: HostWatch | None, entry):
    """Around an eager warm-up iteration (or warm-up forward) of ``entry``: record
    its host copies and constant reads, when the model's watch is on."""
    if watch is None or not watch.on:
        return contextlib.nullcontext()
    return _observing(watch, entry)


@contextlib.contextmanager
def _observing(watch: HostWatch, entry):
    record = entry.host_copies
    if record is None:
        record = entry.host_copies = HostRecord(watch)
    session = _Session(record, OBSERVE)
    with _active(session):
        yield
    # Not after an iteration that raised: the user's error propagates.
    record.merge(session.counts, session.sites, session.copies, session.reads)


def substituting(watch: HostWatch | None, entry):
    """Around the capture of ``entry``'s iteration (or forward): its host copies
    from the pinned buffers, its constant reads from the record. Nothing when the
    watch is off or no warm-up of ``entry`` was observed (then a host copy fails
    the capture as torch makes it, and :func:`capture_failed` arranges the retry)."""
    if watch is None or not watch.on or entry.host_copies is None or not entry.host_copies.iterations:
        return contextlib.nullcontext()
    return _substituting(entry.host_copies)


@contextlib.contextmanager
def _substituting(record: HostRecord):
    session = _Session(record, SUBSTITUTE)
    with _active(session):
        yield
    session.finish()


def capture_failed(watch: HostWatch | None, entry, error: BaseException | None, reason: str,
                   retryable: bool) -> tuple[str, bool]:
    """``(reason, retryable)`` of a failed capture, seen by the host watch: a
    pageable host copy in a signature whose warm-ups were not observed switches
    the watch on and asks for another attempt, after observed warm-ups."""
    if watch is None or not watch.enabled or error is None:
        return reason, retryable
    pageable = is_pageable_copy_error(error)
    # TorchScript drops the message of an error raised through a Python dispatch mode: DeBERTa's
    # torch.tensor(...).type_as(...) in a scripted function fails so while a mode of ours is active.
    silent = not pageable and torchscript_without_message(error)
    if not (pageable or silent):
        return reason, retryable
    record = entry.host_copies
    if record is not None and record.iterations:  # observed, and still failing: a copy not seen
        if any(TORCHSCRIPT_FAILED in str(e) for e in exception_chain(error)):
            return (f"{reason}; a host tensor copied inside a TorchScript function (torch.jit.script) is "
                    "out of pygraph_dist's sight: set PYTORCH_JIT=0 in the environment (before the model's "
                    "library is imported) to run its scripted functions as Python, then it is graphed"), False
        return reason, retryable
    watch.wanted = True
    entry.warmups = 0  # the engine then gives the retry at least one (observed) warm-up
    why = ", as for a host tensor copied to the GPU inside it" if silent else ""
    return (f"{reason}{why}; the next warm-up iterations observe the host tensors copied in forward, to "
            "graph them"), True


def is_pageable_copy_error(error: BaseException) -> bool:
    return any(PAGEABLE_COPY_ERROR in str(e) for e in exception_chain(error))


def describe(entry) -> str:
    """``"; ..."`` for the "captured" event of ``entry``, or ""."""
    record = getattr(entry, "host_copies", None)
    text = record.describe() if record is not None else ""
    return f"; {text}" if text else ""


# ================================================================== check mode
def check_due(entry) -> bool:
    """Check mode (``PYGRAPH_DIST_CHECK_HOST_COPIES=N``): whether this replay of
    ``entry`` runs eagerly instead, observed against the record (every N-th)."""
    record = entry.host_copies
    if record is None or not record.checking:
        return False
    record.check_calls += 1
    return record.check_calls % record.watch.check_every == 0


def run_checked(entry, run, *, cache, iteration: int, leaves=(), group=None, device=None, collective: bool,
                rank: int = 0):
    """Check mode's iteration of ``entry``: ``run()`` (the iteration eagerly, as
    written) with its host copies compared with the ones the graph replays; the
    graphs go when they differ (:func:`conclude_check`). ``leaves`` None: the call
    was matched by the input guard, which holds its tensors until discarded."""
    if leaves is None:
        entry.guard.discard()
    with verifying(entry) as session:
        out = run()
    conclude_check(session, entry, cache, iteration, group=group, device=device, collective=collective, rank=rank)
    return out


@contextlib.contextmanager
def verifying(entry):
    """Around an eager check iteration of ``entry``: yields the session, whose
    ``changed`` says how the host copies differ from the record ("" if not)."""
    session = _Session(entry.host_copies, VERIFY)
    with _active(session):
        yield session
    session.finish()


def changed_reason(changed: str) -> str:
    return (f"{changed}: its graph replayed values the forward no longer copies (check mode, "
            f"{CHECK_ENV}); this signature runs eagerly from here on; {_FIX}")


def conclude_check(session: _Session, entry, cache, iteration: int, *, group=None, device=None,
                   collective: bool, rank: int = 0) -> None:
    """After a check iteration: when the host copies changed (on any rank, agreed
    by ``collective`` training signatures; evaluation decides alone), the graphs of
    ``entry`` are released and it runs eagerly for good."""
    changed = session.changed
    if collective:
        from ..launch import agreement

        moved = agreement.agreed_max([1 if changed else 0], group=group, device=device)[0]
        if moved and not changed:
            changed = "a host tensor copied to the GPU changed since the capture on another rank"
    if not changed:
        return
    cache.release(entry)
    entry.policy.reject(changed_reason(changed))
    cache.event(entry, iteration, "host copies changed", entry.policy.reason)
    if rank == 0 or session.changed:
        logger.warning("graph for [%s] dropped: %s", entry.description, entry.policy.reason)
