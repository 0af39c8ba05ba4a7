"""Cross-rank agreement: the one place where ranks decide together.

Every decision that changes which collectives run — replay a captured graph
or run eagerly, keep graphs after the loop probe — goes through :func:`agree`.
NCCL requires "captured or not" to be uniform over the ranks of a
communicator (NCCL user guide, "Using NCCL with CUDA Graphs"), so a rank
never acts on a local verdict: it all-reduces it first.

One eager all-reduce (MIN) of ``[ok, d0, -d0, d1, -d1, ...]`` tells every rank
whether all ranks said ok and whether every digest is equal everywhere (the
minimum of d equals the maximum, i.e. -min(-d)). Only when the answer is no,
an ``all_gather_object`` collects each rank's reason and details so the
message can say which rank and what differed; both ranks take that branch
because both saw the same all-reduce result.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

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
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
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
    everyone: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    if not all_ok:
        failed = [r for r in everyone if not r["ok"]]
        text = "; ".join(f"rank {r['rank']}: {r['reason']}" for r in failed)
        return Verdict(False, text, final=any_final)
    text = explain(everyone) if explain else "ranks disagree"
    return Verdict(False, text, final=True)
