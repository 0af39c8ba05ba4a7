"""Cross-rank agreement: every decision all ranks must share, in one place.

NCCL requires "captured or not" to be uniform over the ranks of a
communicator (NCCL user guide, "Using NCCL with CUDA Graphs": a graph launch
containing NCCL work is itself a collective), so a rank never acts on a local
verdict that changes which collectives run: it agrees first. Each function
here is called by every rank of the group at the same point of the same
iteration (the engine's control flow up to that point is itself agreed), so
the collectives inside match.

* :func:`agree` — probe verdicts and capture success: one eager all-reduce
  (MIN) of ``[ok, -final, d0, -d0, d1, -d1, ...]`` tells every rank whether all
  ranks said ok and whether every digest is equal everywhere (the minimum of d
  equals the maximum, i.e. -min(-d)). Only when the answer is no, an
  ``all_gather_object`` collects each rank's reason and details so that the
  message can say which rank and what differed; every rank takes that branch
  because every rank saw the same all-reduce result.
* :func:`agreed_max` — selection timings and graph pool sizes (the slowest
  rank decides; the largest pool counts against the memory cap).
* :func:`agreed_failed_buckets` — gradient buckets whose all-reduce failed
  capture on any rank.
* :func:`config_digest` / :func:`explain_mismatch` — what all ranks must have
  captured alike, and the message when they did not.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..runtime._ext import C
from . import collectives

_MASK = (1 << 62) - 1  # digests are 62-bit so that -d fits in int64


@dataclass(frozen=True)
class Verdict:
    agreed: bool
    reason: str  # empty when agreed
    # True when the disagreement is deterministic (a rank failed for a reason
    # that will recur, or ranks captured different things): no point retrying.
    final: bool = True


def agree(
    ok: bool,
    reason: str,
    digests: Sequence[int],
    *,
    group: dist.ProcessGroup | None,
    device: torch.device,
    details: object = None,
    explain: Callable[[list[dict]], str] | None = None,
    retryable: bool = False,
) -> Verdict:
    """All ranks learn whether every rank is ok and every digest matches.

    ``details`` (any picklable object) is gathered only on disagreement and
    handed to ``explain`` (one dict per rank: rank, ok, reason, digests,
    details) to describe a digest mismatch. ``retryable`` marks a local
    failure as worth another attempt; the verdict is final if any rank says
    its failure is not.
    """
    final_here = not ok and not retryable
    # Slot 1 holds -final so that MIN finds "any rank final".
    values = [1 if ok else 0, -1 if final_here else 0]
    for d in digests:
        d = int(d) & _MASK
        values += [d, -d]
    t = torch.tensor(values, dtype=torch.int64, device=device)
    collectives.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    got = t.tolist()
    all_ok = got[0] == 1
    any_final = got[1] == -1
    same = all(got[2 + 2 * i] == -got[3 + 2 * i] for i in range(len(digests)))
    if all_ok and same:
        return Verdict(True, "")

    mine = {
        "rank": dist.get_rank(group),
        "ok": ok,
        "reason": reason,
        "digests": [int(d) & _MASK for d in digests],
        "details": details,
    }
    everyone = collectives.all_gather_object(mine, group=group, device=device)
    if not all_ok:
        failed = [r for r in everyone if not r["ok"]]
        text = "; ".join(f"rank {r['rank']}: {r['reason']}" for r in failed)
        return Verdict(False, text, final=any_final)
    text = explain(everyone) if explain else "ranks disagree"
    return Verdict(False, text, final=True)


def agreed_max(values: Sequence[int], *, group, device: torch.device) -> list[int]:
    """The element-wise maximum over ranks of ``values`` (integers)."""
    t = torch.tensor(list(values), dtype=torch.int64, device=device)
    collectives.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return [int(v) for v in t.tolist()]


def agreed_failed_buckets(n_buckets: int, failed_here: int | None, *, group,
                          device: torch.device) -> list[int]:
    """Buckets whose all-reduce failed capture on any rank (MAX over ranks).
    Called by every rank after a failed capture agreement."""
    if n_buckets == 0:
        return []
    flags = [0] * n_buckets
    if failed_here is not None:
        flags[failed_here] = 1
    return [b for b, f in enumerate(agreed_max(flags, group=group, device=device)) if f]


def config_digest(text: str) -> int:
    """Digest of a configuration's text, for :func:`agree`."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


def explain_mismatch(everyone: list[dict]) -> str:
    """Which ranks captured what, for a fingerprint (digest 0) or configuration
    (digest 1) mismatch. ``details`` holds ``collectives`` (the fingerprint's
    records) and ``config`` (the configuration text)."""
    first = everyone[0]
    for other in everyone[1:]:
        if other["digests"][0] != first["digests"][0]:
            a, b = first["details"]["collectives"], other["details"]["collectives"]
            i = C.CaptureFingerprint.first_difference(C.CaptureFingerprint.from_records(a),
                                                      C.CaptureFingerprint.from_records(b))
            if i is None:
                i = min(len(a), len(b))

            def show(seq):
                if i >= len(seq):
                    return "nothing"
                r = seq[i]
                return f"{r['kind']} {r['dtype']} x{r['numel']}"

            return (
                f"ranks captured different collective sequences: rank {first['rank']} captured "
                f"{len(a)}, rank {other['rank']} captured {len(b)}; first difference at #{i}: "
                f"rank {first['rank']} {show(a)} vs rank {other['rank']} {show(b)}"
            )
        if other["digests"][1] != first["digests"][1]:
            return (
                f"rank {first['rank']} and rank {other['rank']} captured different "
                f"configurations (inputs, amp, clipping or optimizer hyperparameters): "
                f"{first['details']['config']} vs {other['details']['config']}"
            )
    return "ranks disagree"


def check_same_model(named_tensors: Sequence[tuple[str, torch.Tensor]], buffers: Sequence[torch.Tensor | None], *,
                     group, device: torch.device) -> None:
    """``wrap()``: every rank has the same parameters (frozen ones too) and module
    buffers (names, shapes, dtypes) and planned the same gradient buckets,
    checked before the first collective that depends on them (rank 0's
    parameters broadcast, the buckets' all-reduces). A rank whose model or
    bucket plan differed used to hang or fail inside the backend there; DDP
    checks parameter shapes the same way (``_verify_param_shape_across_processes``).
    Raises RuntimeError on every rank, saying what differs."""
    params = [f"{n} {tuple(t.shape)} {str(t.dtype).replace('torch.', '')}" for n, t in named_tensors]
    buckets = [int(b.numel()) if b is not None else -1 for b in buffers]
    verdict = agree(True, "", [config_digest("\n".join(params)), config_digest(repr(buckets))],
                    group=group, device=device, details={"params": params, "buckets": buckets},
                    explain=_explain_model_mismatch)
    if not verdict.agreed:
        raise RuntimeError(f"pygraph_dist.wrap(): {verdict.reason}")


def _explain_model_mismatch(everyone: list[dict]) -> str:
    first = everyone[0]
    for other in everyone[1:]:
        a, b = first["details"]["params"], other["details"]["params"]
        if a != b:
            i = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            shown = [seq[i] if i < len(seq) else "nothing" for seq in (a, b)]
            return (f"the ranks' models differ: rank {first['rank']} has {len(a)} parameters and "
                    f"buffers, rank {other['rank']} has {len(b)}; the first difference is rank "
                    f"{first['rank']}'s '{shown[0]}' against rank {other['rank']}'s '{shown[1]}'. Wrap the "
                    "same model on every rank (DDP requires the same).")
        a, b = first["details"]["buckets"], other["details"]["buckets"]
        if a != b:
            return (f"the ranks planned different gradient buckets (elements per bucket: rank "
                    f"{first['rank']} {a[:8]}, rank {other['rank']} {b[:8]}). Pass the same bucket_cap_mb, "
                    "eager_params and grad_comm_dtype to wrap() on every rank, with the same "
                    "PYGRAPH_DIST_BUCKET_ALIGN in every rank's environment.")
    return "ranks disagree"
