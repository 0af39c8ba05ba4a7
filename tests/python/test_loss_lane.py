"""The loss lane's learning and matching (loss_lane.py), on the CPU.

The lane's graph needs a GPU (tests/python/test_loops.py's GPU tests run it
bitwise against graphs=False); here the parts that decide what it may replay
are checked with a stand-in for the graph: a ``commit`` that computes the
learned trace on the model's outputs and runs its backward, as the "lane"
graph does. Every test compares with the loop run on a plain model.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from pygraph_dist.loop.loss_lane import COMMITTED, OFF, PENDING, LaneTensor, Recorder
from pygraph_dist.loop.loss_match import LaneRun


class _Copy(torch.autograd.Function):
    """Stands in for split._GraphedCall: fresh outputs, wrapped inside forward."""

    @staticmethod
    def forward(ctx, run, x):  # noqa: ARG004
        return tuple(run.wrap_outputs([x.detach().clone()]))[0]

    @staticmethod
    def backward(ctx, g):  # noqa: ARG004
        return None, g


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 5))


def _batch(step=0):
    g = torch.Generator().manual_seed(step)
    return torch.randn(4, 3, 8, generator=g), torch.randint(0, 5, (4, 3), generator=g)


def gpt_loss(out, y):
    logits = out.view(-1, out.size(-1))
    _ = out.argmax(-1)  # a metric on the outputs, not part of the loss
    return F.cross_entropy(logits, y.view(-1))


def _reference(loss_fn, step=0):
    m = _model()
    x, y = _batch(step)
    loss = loss_fn(m(x), y)
    loss.backward()
    return loss.detach(), [p.grad for p in m.parameters()]


def _learn(loss_fn, step=0):
    m = _model()
    x, y = _batch(step)
    rec = Recorder(torch.device("cpu"))
    (out,) = rec.wrap_outputs([m(x)])
    loss_fn(out, y).backward()
    return rec, [p.grad for p in m.parameters()]


class _Stand:
    """A model call whose loss the lane may compute: ``commit`` does what the
    "lane" graph does, on the outputs of the real forward."""

    def __init__(self, trace, *, accept=True):
        self.model = _model()
        self.trace, self.accept, self.commits = trace, accept, 0

    def call(self, x):
        raw = self.model(x)
        meta = (tuple(torch.Size([])), torch.float32, torch.device("cpu"))
        run = LaneRun(self.trace, self.trace.static_exts(torch.device("cpu")), meta, self._commit)
        run.raw = raw
        return run, _Copy.apply(run, raw)

    def _commit(self, run):
        """What the "lane" graph does (split_lane._capture_lane): the trace on the
        outputs as leaves of their own, its gradient, then the model's backward."""
        if not self.accept:
            run.why = "refused"
            return False
        leaves = [run.raw.detach().requires_grad_(True)]
        loss = self.trace.compute(leaves, run.static_exts)
        grads = torch.autograd.grad(loss, leaves, allow_unused=True, materialize_grads=True)
        torch.autograd.backward([run.raw], list(grads))
        run.fill(loss.detach())
        self.commits += 1
        return True

    def grads(self):
        return [p.grad for p in self.model.parameters()]


def _lane_step(*, accept: bool = True):
    """gpt_loss learned, and one model call in its lane: (stand, run, out, x, y)."""
    rec, _ = _learn(gpt_loss)
    stand = _Stand(rec.trace, accept=accept)
    x, y = _batch()
    run, out = stand.call(x)
    return stand, run, out, x, y


def _same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b))


def test_the_loss_is_learned_and_the_outputs_train_as_before():
    ref_loss, ref_grads = _reference(gpt_loss)
    rec, grads = _learn(gpt_loss)
    assert rec.why == "" and rec.trace is not None
    assert rec.trace.describe() == "view -> cross_entropy"  # argmax and size() are not the loss
    assert len(rec.trace.exts) == 1 and rec.trace.exts[0][0] == (12,)  # y.view(-1)
    assert _same(grads, ref_grads)
    out = _model()(_batch()[0])
    exts = [_batch()[1].view(-1)]
    assert torch.equal(rec.trace.compute([out], exts), ref_loss)


def test_the_pending_loss_is_filled_by_backward_bitwise():
    rec, _ = _learn(gpt_loss)
    for step in range(3):
        ref_loss, ref_grads = _reference(gpt_loss, step)
        stand = _Stand(rec.trace)
        x, y = _batch(step)
        run, out = stand.call(x)
        assert isinstance(out, LaneTensor)
        loss = gpt_loss(out, y)
        assert run.state == PENDING and stand.commits == 0
        loss.backward()
        assert run.state == COMMITTED and stand.commits == 1
        run.end("step")
        assert torch.equal(loss.detach(), ref_loss) and loss.item() == ref_loss.item()
        assert _same(stand.grads(), ref_grads)


def test_the_pending_loss_answers_its_shape_without_leaving_the_lane():
    stand, run, out, x, y = _lane_step()
    loss = gpt_loss(out, y)
    assert loss.shape == () and loss.dim() == 0 and loss.numel() == 1 and loss.dtype == torch.float32
    assert loss.requires_grad and loss.is_floating_point()
    loss.backward()
    assert run.state == COMMITTED and stand.commits == 1


def test_reading_the_loss_before_backward_computes_it_eagerly():
    ref_loss, ref_grads = _reference(gpt_loss)
    stand, run, out, x, y = _lane_step()
    loss = gpt_loss(out, y)
    y.add_(1)  # the loss was computed from y as it was at the call: the lane kept a copy
    assert loss.item() == ref_loss.item()
    assert run.state == OFF and run.why == "the loss was read before backward() (loss.item())", run.why
    loss.backward()  # autograd, through _Copy: tier 2 without the lane
    assert stand.commits == 0 and _same(stand.grads(), ref_grads)


@pytest.mark.parametrize("change", ["smoothing", "weight", "inplace"])
def test_a_changed_loss_is_not_replayed(change):
    """Another loss than the learned one runs eagerly, as written (tier 2)."""
    rec, _ = _learn(gpt_loss)
    stand = _Stand(rec.trace)
    ref = _model()
    x, y = _batch()
    run, out = stand.call(x)
    if change == "smoothing":
        loss = F.cross_entropy(out.view(-1, 5), y.view(-1), label_smoothing=0.1)
        want = F.cross_entropy(ref(x).view(-1, 5), y.view(-1), label_smoothing=0.1)
    elif change == "weight":
        w = torch.arange(1.0, 6.0)
        loss = F.cross_entropy(out.view(-1, 5), y.view(-1), weight=w)
        want = F.cross_entropy(ref(x).view(-1, 5), y.view(-1), weight=w)
    else:
        out.mul_(2)
        loss = gpt_loss(out, y)
        want = gpt_loss(ref(x) * 2, y)
    assert not isinstance(loss, LaneTensor) or run.state == OFF
    loss.backward()
    want.backward()
    run.end("step")
    assert stand.commits == 0
    assert torch.equal(loss.detach(), want.detach())
    assert _same(stand.grads(), [p.grad for p in ref.parameters()])


def test_another_target_of_the_same_shape_is_replayed_with_its_values():
    rec, _ = _learn(gpt_loss)
    stand = _Stand(rec.trace)
    x, y = _batch()
    y2 = (y + 1) % 5
    ref_loss, _ = _reference(lambda o, _y: gpt_loss(o, y2))
    run, out = stand.call(x)
    loss = gpt_loss(out, y2)
    loss.backward()
    assert stand.commits == 1 and torch.equal(loss.detach(), ref_loss)


def test_backward_refused_by_the_engine_falls_back_to_autograd():
    ref_loss, ref_grads = _reference(gpt_loss)
    stand, run, out, x, y = _lane_step(accept=False)
    loss = gpt_loss(out, y)
    loss.backward()
    assert run.state == OFF and run.why == "refused"
    assert _same(stand.grads(), ref_grads) and loss.item() == ref_loss.item()


def test_a_step_without_backward_leaves_the_loss_readable():
    ref_loss, _ = _reference(gpt_loss)
    stand, run, out, x, y = _lane_step()
    loss = gpt_loss(out, y)
    run.end("optimizer.step() came before backward() of the loss")
    assert loss.item() == ref_loss.item() and stand.commits == 0
    assert all(p.grad is None for p in stand.model.parameters())


@pytest.mark.parametrize("loss_fn,why", [
    (lambda o, y: F.cross_entropy(F.dropout(o, 0.1), y.view(-1)), "random numbers"),
    (lambda o, y: F.cross_entropy(o.masked_fill_(o > 3, 0).view(-1, 5), y.view(-1)), "changed in place"),
    (lambda o, y: F.cross_entropy(o.view(-1, 5), y.view(-1)) + _W.sum(), "requires grad"),
])
def test_what_cannot_be_replayed_is_not_learned(loss_fn, why):
    m = _model()
    x, y = _batch()
    rec = Recorder(torch.device("cpu"))
    (out,) = rec.wrap_outputs([m(x).view(-1, 5)])
    loss_fn(out, y).backward()
    assert rec.trace is None and why in rec.why, rec.why


_W = torch.ones(3, requires_grad=True)


def test_backward_with_arguments_is_not_learned():
    m = _model()
    x, y = _batch()
    rec = Recorder(torch.device("cpu"))
    (out,) = rec.wrap_outputs([m(x)])
    gpt_loss(out, y).backward(retain_graph=True)
    assert rec.trace is None and "with arguments" in rec.why


@pytest.mark.parametrize("read_first", [False, True])
def test_a_finished_step_leaves_nothing_to_the_garbage_collector(read_first):
    """The outputs point at their run; nothing of a finished step may point back
    (a cycle keeps the outputs, and the eager loss's autograd graph, until the
    cyclic collector runs: gigabytes of logits on a language model)."""
    import gc
    import weakref

    rec, _ = _learn(gpt_loss)
    stand = _Stand(rec.trace)
    x, y = _batch()
    gc.collect()
    gc.disable()
    try:
        run, out = stand.call(x)
        loss = gpt_loss(out, y)
        if read_first:
            loss.item()
        loss.backward()
        run.end("optimizer.step()")
        run.raw = None  # the stand-in's own reference
        refs = [weakref.ref(t) for t in (out, loss, run)]
        del out, loss, run
        assert [r() is None for r in refs] == [True, True, True]
    finally:
        gc.enable()


@pytest.mark.parametrize("read", ["after", "before"])
def test_detached_copies_of_the_pending_loss_wait_for_its_value(read):
    """nanoGPT's micro_losses.append(loss.detach()) and Lightning's
    loss.detach().clone() before backward(): copies that get the value the
    graph computes (or, when the step leaves the lane, the eager one)."""
    ref_loss, ref_grads = _reference(gpt_loss)
    stand, run, out, x, y = _lane_step()
    loss = gpt_loss(out, y)
    logged = [loss.detach(), loss.detach().clone()]
    assert run.state == PENDING and not logged[0].requires_grad
    if read == "before":
        assert float(logged[1]) == ref_loss.item()  # the step leaves the lane
    loss.backward()
    run.end("step")
    assert stand.commits == (1 if read == "after" else 0)
    assert [t.item() for t in logged] == [ref_loss.item()] * 2 and loss.item() == ref_loss.item()
    assert _same(stand.grads(), ref_grads)


def test_outputs_save_and_copy_as_plain_tensors(tmp_path):
    """torch.save / deepcopy of an output (predictions kept for analysis): a
    plain tensor, not the lane's state (which is this process's)."""
    import copy

    stand, run, out, x, y = _lane_step()
    torch.save({"logits": out}, tmp_path / "o.pt")
    back = torch.load(tmp_path / "o.pt")["logits"]
    assert type(back) is torch.Tensor and torch.equal(back, out.detach())
    loss = gpt_loss(out, y)
    loss.backward()
    assert stand.commits == 1
    dup = copy.deepcopy(loss)  # a leaf (the pending loss, filled in)
    assert type(dup) is torch.Tensor and dup.item() == loss.item()


def test_a_strided_target_is_not_learned():
    m = _model()
    x, y = _batch()
    rec = Recorder(torch.device("cpu"))
    (out,) = rec.wrap_outputs([m(x)])
    yt = y.t().contiguous().t()  # the same values, column-major
    F.cross_entropy(out.view(-1, 5).view(4, 3, 5).transpose(1, 2), yt).backward()
    assert rec.trace is None and "contiguous" in rec.why, rec.why


def test_a_hook_on_an_output_leaves_the_lane_and_runs():
    rec, _ = _learn(gpt_loss)
    ref = _model()
    x, y = _batch()
    r_out = ref(x)
    r_out.register_hook(lambda g: g * 0.5)
    gpt_loss(r_out, y).backward()
    stand = _Stand(rec.trace)
    run, out = stand.call(x)
    out.register_hook(lambda g: g * 0.5)
    gpt_loss(out, y).backward()
    run.end("step")
    assert stand.commits == 0 and "register_hook() on an output" in run.why, run.why
    assert _same(stand.grads(), [p.grad for p in ref.parameters()])
    # and learning one is refused
    m = _model()
    rec2 = Recorder(torch.device("cpu"))
    (o,) = rec2.wrap_outputs([m(x)])
    o.register_hook(lambda g: g)
    gpt_loss(o, y).backward()
    assert rec2.trace is None and "register_hook()" in rec2.why, rec2.why


@pytest.mark.parametrize("how", ["view_fill", "detach_clamp", "relu_inplace"])
def test_an_output_changed_through_an_alias_leaves_the_lane(how):
    """In place through a view or detach() shares the version counter: seen."""
    rec, _ = _learn(gpt_loss)
    ref = _model()
    x, y = _batch()

    def change(o):
        if how == "view_fill":
            with torch.no_grad():
                o[..., 0].fill_(-5)
        elif how == "detach_clamp":
            o.detach().clamp_(max=0.1)
        else:
            F.relu(o.detach(), inplace=True)
        return o

    want = gpt_loss(change(ref(x)), y)
    want.backward()
    stand = _Stand(rec.trace)
    run, out = stand.call(x)
    loss = gpt_loss(change(out), y)
    loss.backward()
    run.end("step")
    assert stand.commits == 0, run.why
    assert torch.equal(loss.detach(), want.detach())
    assert _same(stand.grads(), [p.grad for p in ref.parameters()])


def test_autocast_around_the_loss_is_bitwise():
    """An fp32 output cast twice under the user's autocast: eager casts it twice
    (the output is not a leaf); the lane's capture, where the outputs are leaves
    that require grad, must not share one cached cast (its gradient would be
    summed in bf16)."""
    torch.manual_seed(0)
    w1, w2 = torch.randn(64, 32), torch.randn(64, 32)
    base = torch.randn(16, 32, requires_grad=True)

    def two_linears(o):
        return F.linear(o, w1).float().square().mean() + F.linear(o, w2).float().square().mean()

    amp = torch.autocast("cpu", dtype=torch.bfloat16)
    rec = Recorder(torch.device("cpu"))
    with amp:
        (out,) = rec.wrap_outputs([base * 1.0])
        two_linears(out).backward()
    assert rec.trace is not None, rec.why
    with amp:
        o = (base.detach() * 1.0).requires_grad_()
        (want,) = torch.autograd.grad(two_linears(o * 1.0), o)
        leaf = base.detach().requires_grad_()  # as _capture_lane reads the outputs, inside the model call
        (got,) = torch.autograd.grad(rec.trace.compute([leaf], [w1, w2]), [leaf])
    assert torch.equal(got, want), (got - want).abs().max()


def test_named_results_and_slices_in_the_loss():
    """max()'s named result keeps its names; a Hugging Face-style shift
    (out[:, :-1]) is learned."""
    def shifted(o, y):
        acc = (o.max(-1).indices == y).float().mean()  # a metric before the loss
        assert acc.dim() == 0
        return F.cross_entropy(o[:, :-1].reshape(-1, 5), y[:, 1:].reshape(-1))

    ref_loss, ref_grads = _reference(shifted)
    rec, _ = _learn(shifted)
    assert rec.trace is not None, rec.why
    stand = _Stand(rec.trace)
    x, y = _batch()
    run, out = stand.call(x)
    loss = shifted(out, y)
    loss.backward()
    assert stand.commits == 1 and torch.equal(loss.detach(), ref_loss)
    assert _same(stand.grads(), ref_grads)


def test_a_pending_loss_copied_before_backward_has_its_value():
    import copy

    ref_loss, ref_grads = _reference(gpt_loss)
    stand, run, out, x, y = _lane_step()
    loss = gpt_loss(out, y)
    dup = copy.deepcopy(loss.detach())  # a waiting copy: computed first
    assert dup.item() == ref_loss.item() and run.state == OFF
    loss.backward()
    assert _same(stand.grads(), ref_grads)


def test_the_pending_loss_read_where_scripts_read_it():
    """Reads that reach the pending loss other than as a call's first tensor:
    in a list passed by keyword, after an earlier step's copy in a list, under
    inference_mode, in an f-string: each computes it (or, after backward(),
    shows the graph's value) as eager would."""
    rec, _ = _learn(gpt_loss)
    ref_loss, ref_grads = _reference(gpt_loss)
    stand = _Stand(rec.trace)
    x, y = _batch()
    run, out = stand.call(x)
    loss = gpt_loss(out, y)
    loss.backward()  # in the lane: filled by the graph
    assert run.state == COMMITTED and f"{loss}" == f"{ref_loss}" and f"{loss:.3e}" == f"{ref_loss:.3e}"
    run.end("step")
    run, out = stand.call(x)
    loss = gpt_loss(out, y)
    assert torch.stack(tensors=[loss]).tolist() == [ref_loss.item()] and run.state == OFF
    loss.backward()
    assert f"{loss:.4f}" == f"{ref_loss.item():.4f}" and f"{loss}" == f"{ref_loss}"
    run.end("step")
    kept = [loss.detach()]  # an earlier step's copy, first in the list
    run, out = stand.call(x)
    loss = gpt_loss(out, y)
    assert torch.stack([kept[0], loss]).tolist() == [ref_loss.item()] * 2 and run.state == OFF
    run.end("step")  # read before backward(): this step's loss stays a proxy for its eager value
    kept.append(loss)
    run, out = stand.call(x)
    loss = gpt_loss(out, y)
    assert (kept[1] + loss).item() == 2 * ref_loss.item() and run.state == OFF  # the proxy first, then the pending loss
    assert torch.stack(kept + [loss]).tolist() == [ref_loss.item()] * 3
    run.end("step")
    stand = _Stand(rec.trace)
    run, out = stand.call(x)
    loss = gpt_loss(out, y)
    with torch.inference_mode():
        assert f"{loss:.6f}" == f"{ref_loss.item():.6f}" and run.state == OFF
    loss.backward()  # the loss computed for the read is one backward() runs through
    assert _same(stand.grads(), ref_grads)


def test_the_report_line_counts_steps():
    from pygraph_dist.tiers.split_lane import LaneGraphs

    g = LaneGraphs()
    g._init_lane()
    assert g.describe_lane() == ""
    g.lane_why = "cross_entropy() in the loss draws random numbers"
    assert g.describe_lane() == "your loss eager between the graphs (cross_entropy() in the loss draws random numbers)"
    g.lane, g.lane_steps = "view -> cross_entropy", 1
    g.lane_misses = {"a": 1, "b": 5, "c": 2}
    assert g.describe_lane() == ("your loss (view -> cross_entropy) inside the backward graph (1 step; 5 steps "
                                 "eager: b; 2 steps eager: c)")


def lane_agreement(learned_on="0,1"):
    """Rank body: _lane_trace's agreement, with a recorder that learned (or not) per rank."""
    import torch.distributed as dist

    import pygraph_dist as pgd
    from pygraph_dist.graphs.graph_cache import GraphEntry
    from pygraph_dist.tiers.split_lane import LaneGraphs

    pgd.init()
    rank = dist.get_rank()
    learned = {int(r) for r in str(learned_on).split(",") if r}
    out = []
    for agree in (True, False):
        g = LaneGraphs()
        g._init_lane()
        g.runner = type("Runner", (), {"group": None, "agree_device": torch.device("cpu")})()
        entry = GraphEntry(key=("k",), description="d", policy=None)
        if rank in learned:
            entry.lane_recorder, _ = _learn(gpt_loss)
        else:
            entry.lane_recorder, _ = _learn(lambda o, y: F.cross_entropy(F.dropout(o.view(-1, 5), 0.1), y.view(-1)))
        trace = g._lane_trace(entry, agree=agree)
        out.append({"agree": agree, "trace": trace is not None, "why": g.lane_why})
    return out


@pytest.mark.parametrize("learned_on", ["0,1", "0"])
def test_every_rank_captures_the_lane_or_none(ranks, learned_on):
    """One rank whose loss could not be learned: no rank captures the lane
    (a capture with it on some ranks only would not be agreed)."""
    for rank, r in enumerate(ranks("test_loss_lane:lane_agreement", world_size=2, timeout=120,
                                   kwargs={"learned_on": learned_on})):
        agreed, alone = r
        assert agreed["trace"] == (learned_on == "0,1"), (rank, agreed)
        if rank == 0 and learned_on == "0":
            assert agreed["why"].startswith("another rank did not learn"), agreed
        assert not alone["trace"]  # agree=False: the capture holds no lane (no_sync variant, fp16)
