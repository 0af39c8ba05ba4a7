"""Python values among the model call's arguments (``arguments.py``).

Lightning calls ``training_step(batch, batch_idx)`` as the forward: an int
that changes on every call, and so a new input signature on every call. These
tests check that pygraph_dist says so, that ``wrap(..., ignore_args=...)``
makes such calls share a signature, and that a forward which does read an
ignored argument is caught by the probe (the loop stays eager, naming the line)
instead of replaying a stale value. The graphed side of ``ignore_args`` runs
in ``test_user_scripts.py`` on a GPU.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

import pygraph_dist as pgd
from common import data, flat_params
from pygraph_dist.loop.arguments import IGNORED, IgnoredArgs


class StepModule(nn.Module):
    """``forward(x, y, batch_idx)``; ``reads`` picks how (or whether) it uses batch_idx."""

    def __init__(self, reads: str = "no"):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 5))
        self.reads = reads

    def forward(self, x, y, batch_idx):
        logits = self.net(x)
        if self.reads == "branch" and batch_idx % 2 == 0:  # Python arithmetic on it
            logits = logits * 0.5
        elif self.reads == "torch":
            logits = logits + torch.full_like(logits, batch_idx) * 1e-3  # a torch call receives it
        return F.cross_entropy(logits, y)


def batch_idx_loop(reads="no", ignore=1, steps=8):
    pgd.init()
    rank = dist.get_rank()
    torch.manual_seed(0)
    base = StepModule(reads)
    ref = StepModule(reads)
    ref.load_state_dict(base.state_dict())
    model, opt = pgd.wrap(base, torch.optim.AdamW(base.parameters(), lr=1e-2),
                          ignore_args=["batch_idx"] if ignore else [])
    ref_model = nn.parallel.DistributedDataParallel(ref)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for step in range(steps):
        x, y = data(step, rank)
        for m, o in ((model, opt), (ref_model, ref_opt)):
            o.zero_grad(set_to_none=True)
            m(x, y, step).backward()
            o.step()
    r = pgd.report().models[-1]
    return {
        "signatures": [g.inputs for g in r.graphs],
        "loop": r.loop,
        "events": [e["event"] + ": " + e["detail"] for e in r.events],
        "max_diff": float((flat_params(base) - flat_params(ref)).abs().max()),
    }


def test_a_changing_int_argument_is_named_with_the_fix(ranks):
    for r in ranks("test_arguments:batch_idx_loop", world_size=1, kwargs={"ignore": 0}, timeout=120):
        assert len(r["signatures"]) == 8, r  # one per batch_idx value
        varying = [e for e in r["events"] if e.startswith("argument varies")]
        assert len(varying) == 1, r["events"]  # said once
        assert "'batch_idx'" in varying[0] and "ignore_args=['batch_idx']" in varying[0], varying
        assert r["max_diff"] < 1e-6


def test_ignore_args_shares_one_signature(ranks):
    for r in ranks("test_arguments:batch_idx_loop", world_size=2, kwargs={"ignore": 1}, timeout=120):
        assert len(r["signatures"]) == 1 and "<ignored>" in r["signatures"][0], r["signatures"]
        assert not any(e.startswith("argument varies") for e in r["events"]), r["events"]
        assert "ignore_args" not in r["loop"], r["loop"]  # the forward does not read it
        assert r["max_diff"] < 1e-6


@pytest.mark.parametrize("reads,how", [("branch", "mod"), ("torch", "passed to full_like")])
def test_a_forward_that_reads_an_ignored_argument_is_not_graphed(ranks, reads, how):
    for r in ranks("test_arguments:batch_idx_loop", world_size=2, kwargs={"reads": reads}, timeout=120):
        # The probe's verdict (agreed by both ranks) names the argument, how and where.
        assert "not graphable" in r["loop"], r["loop"]
        assert f"reads 'batch_idx' ({how})" in r["loop"], r["loop"]
        assert "test_arguments.py:" in r["loop"] and "Remove 'batch_idx' from ignore_args" in r["loop"], r["loop"]
        # Eager training, exactly as written (the stand-ins behave as the int).
        assert r["max_diff"] < 1e-6


def test_ignore_args_refuses_what_it_cannot_ignore():
    module = StepModule()
    with pytest.raises(ValueError, match="StepModule.forward does not take.*its arguments: x, y, batch_idx"):
        IgnoredArgs(("batch",), module)
    ignored = IgnoredArgs(("batch_idx",), module)
    x = torch.zeros(2, 32)
    assert ignored.mask((x, x, 3), {}) == ((x, x, IGNORED), {})
    assert ignored.mask((x, x), {"batch_idx": 2.5}) == ((x, x), {"batch_idx": IGNORED})
    for bad in (torch.tensor(1), True, "a", None, (1, 2)):
        with pytest.raises(TypeError, match="only int and float arguments"):
            ignored.mask((x, x, bad), {})
    with pytest.raises(TypeError, match="argument names"):
        pgd.wrap(module, torch.optim.SGD(module.parameters(), lr=0.1), ignore_args=[3])


def test_stand_ins_record_uses_and_behave_as_numbers():
    ignored = IgnoredArgs(("batch_idx",), StepModule())
    (_, _, a), _, watcher = ignored.watch((None, None, 7), {})
    with watcher:
        assert a == 7 and a + 1 == 8 and int(a) == 7 and isinstance(a, int)
    assert [(n, how) for n, how, _ in watcher.uses] == [("batch_idx", "eq")]
    (_, _, b), _, watcher = ignored.watch((None, None, 0.5), {})
    with watcher:
        t = torch.ones(2) * b
    assert t.tolist() == [0.5, 0.5]
    assert watcher.uses and watcher.uses[0][1] == "passed to mul"
    (_, _, c), _, watcher = ignored.watch((None, None, 3), {})
    with watcher:
        pass  # not read
    assert watcher.uses == [] and c == 3
