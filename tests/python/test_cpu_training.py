"""CPU tests with 2 Gloo ranks: reducer vs DDP, eager training through wrap(), loop checks.

Each test runs the case defined just above it in every rank (``conftest.run_ranks``
with ``"test_cpu_training:<case>"``) and asserts on what the ranks return.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

import pygraph_dist as pgd
from pygraph_dist.launch import agreement
from pygraph_dist.reduce.reducer import GradientReducer

from common import MLP, data, flat_params, max_diff, ranks_agree, train


def reducer_vs_ddp():
    pgd.init()
    rank = dist.get_rank()
    torch.manual_seed(0)
    ours = MLP()
    theirs = copy.deepcopy(ours)
    ddp = nn.parallel.DistributedDataParallel(theirs)
    reducer = GradientReducer(list(ours.named_parameters()), None, bucket_cap_mb=0.004)
    diffs, local_vs_reduced = [], []
    for step in range(3):
        x, y = data(step, rank)
        ours.zero_grad(set_to_none=True)
        ours(x, y).backward()
        ddp.zero_grad(set_to_none=True)
        ddp(x, y).backward()
        local = copy.deepcopy(ours)
        local.zero_grad(set_to_none=True)
        reducer.enabled = False
        local(x, y).backward()
        reducer.enabled = True
        diffs.append(max(max_diff(a.grad, b.grad) for a, b in zip(ours.parameters(), theirs.parameters())))
        local_vs_reduced.append(max(max_diff(a.grad, b.grad) for a, b in zip(ours.parameters(), local.parameters())))
    grads = torch.cat([p.grad.reshape(-1) for p in ours.parameters()])
    return {
        "max_diff_vs_ddp": max(diffs),
        "local_vs_reduced": min(local_vs_reduced),
        "buckets": len(reducer.plan.buckets),
        "ranks_agree": ranks_agree(grads, "cpu"),
        "grad_is_bucket_view": all(
            p.grad.data_ptr() == v.data_ptr() for p, v in zip(reducer.params, reducer.views)
        ),
    }


@pytest.mark.parametrize("world", [2, 3])
def test_reducer_matches_ddp(ranks, world):
    for r in ranks("test_cpu_training:reducer_vs_ddp", world_size=world, timeout=180):
        if world == 2:
            assert r["max_diff_vs_ddp"] == 0.0, r  # same arithmetic as DDP: multiply by 1/2, sum
        else:
            # 3 ranks: Gloo may sum our smaller buckets in another order than DDP's.
            assert r["max_diff_vs_ddp"] < 1e-6, r
        assert r["local_vs_reduced"] > 0, "gradients were not reduced at all"
        assert r["buckets"] >= 3
        assert r["ranks_agree"]
        assert r["grad_is_bucket_view"]


def wrap_cpu_vs_ddp():
    pgd.init()
    rank = dist.get_rank()
    torch.manual_seed(0)
    base = MLP()
    ref = nn.parallel.DistributedDataParallel(copy.deepcopy(base))
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    model, opt = pgd.wrap(base, torch.optim.AdamW(base.parameters(), lr=1e-2))
    ours = train(model, opt, 8, rank)
    theirs = train(ref, ref_opt, 8, rank)
    r = pgd.report().models[0]
    return {
        "max_param_diff": max_diff(flat_params(model.module), flat_params(ref.module)),
        "loss_first_last": [ours[0], ours[-1]],
        "ref_losses": theirs,
        "losses": ours,
        "ranks_agree": ranks_agree(flat_params(model.module), "cpu"),
        "graphs_possible": r.graphs_possible,
        "graphs_reason": r.graphs_reason,
        "loop": r.loop,
        "phases": [g.phase for g in r.graphs],
        "report_text": str(pgd.report()),
        "step_count": int(opt.state[next(iter(base.parameters()))]["step"]),
        "optimizer_class": type(opt).__name__,
        "is_adamw": isinstance(opt, torch.optim.AdamW),
    }


@pytest.mark.parametrize("world", [2, 3])
def test_wrap_on_cpu_trains_eagerly_like_ddp(ranks, world):
    results = ranks("test_cpu_training:wrap_cpu_vs_ddp", world_size=world, timeout=180)
    for r in results:
        assert not r["graphs_possible"]
        assert "CPU-only" in r["graphs_reason"] or "no CUDA device" in r["graphs_reason"], r["graphs_reason"]
        assert r["phases"] == ["eager"]
        assert r["loop"].startswith("conforms")
        assert r["max_param_diff"] < 1e-6, r
        assert r["losses"] == pytest.approx(r["ref_losses"], rel=1e-5)
        assert r["ranks_agree"]
        assert r["step_count"] == 8  # one optimizer step per iteration, not two
        assert r["is_adamw"] and r["optimizer_class"] == "GraphedAdamW"
        assert "graphs unavailable" in r["report_text"]


def test_zero_grad_between_forward_and_backward_conforms(ranks):
    """zero_grad() after the model call still zeroes before backward: not a
    deviation (it used to be taken for a missing zero_grad())."""
    for r in ranks("test_cpu_training:loop_variant", kwargs={"variant": "zero_after_forward"}, timeout=120):
        assert r["loop"].startswith("conforms"), r["loop"]
        assert r["max_param_diff"] < 1e-6, r


def loop_variant(variant="plain"):
    """A loop that a graph cannot represent: the probe must say so, and training
    must stay exactly what the loop means (compared with DDP running the same loop)."""
    pgd.init()
    rank = dist.get_rank()
    torch.manual_seed(0)
    base = MLP()
    ref = nn.parallel.DistributedDataParallel(copy.deepcopy(base))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    model, opt = pgd.wrap(base, torch.optim.SGD(base.parameters(), lr=0.1))
    clip = 0.5 if variant == "clip" else None
    train(model, opt, 5, rank, clip=clip, variant=variant)
    train(ref, ref_opt, 5, rank, clip=clip, variant=variant)
    r = pgd.report().models[0]
    return {
        "loop": r.loop,
        "phases": [g.phase for g in r.graphs],
        "max_param_diff": max_diff(flat_params(model.module), flat_params(ref.module)),
    }


def test_a_loss_scaled_by_a_constant_conforms(ranks):
    """(loss * 0.5).backward() every step: one graph per iteration seeds its
    backward with 0.5 (conformance.loss_seed); eager training matches DDP."""
    for r in ranks("test_cpu_training:loop_variant", kwargs={"variant": "scaled_const"}, timeout=120):
        assert r["loop"].startswith("conforms"), r
        assert r["max_param_diff"] < 1e-6, r


@pytest.mark.parametrize("variant,needle,tier", [
    ("scaled", "backward() was called on a tensor other than the loss", "2"),
    ("aux", "reaches model parameters directly", "3"),  # a regulariser outside the model
    ("accumulate", "called again before optimizer.step()", "2"),
    ("no_zero_grad", "zero_grad() was not called", "3"),
    ("grad_edit", "modifies a parameter, gradient", "2"),
])
def test_loop_the_graph_cannot_represent_is_detected(ranks, variant, needle, tier):
    """What one graph per iteration cannot represent: the check says which tier
    the loop fits on a GPU (tier 2: graphs per micro-batch; tier 3: none) and
    why, also on a CPU, where everything trains eagerly."""
    for r in ranks("test_cpu_training:loop_variant", kwargs={"variant": variant}, timeout=120):
        head = "fits tier 2 (graphs per micro-batch" if tier == "2" else "not graphable"
        assert r["loop"].startswith(head), r
        assert needle in r["loop"], r["loop"]
        assert "common.py:" in r["loop"], "the message should point at the user's line"
        assert r["phases"] == ["eager"]
        # ...and training is exactly what the loop means (DDP running the same loop).
        assert r["max_param_diff"] < 1e-6, r


def test_plain_loop_conforms(ranks):
    for r in ranks("test_cpu_training:loop_variant", kwargs={"variant": "plain"}, timeout=120):
        assert r["loop"].startswith("conforms"), r["loop"]


def test_a_loop_that_clips_all_parameters_conforms(ranks):
    """clip_grad_norm_(model.parameters(), c) between backward and step moves
    into the step graph on a GPU (clip_route.py), so the loop conforms; it
    trains as DDP running the same loop."""
    for r in ranks("test_cpu_training:loop_variant", kwargs={"variant": "clip"}, timeout=120):
        assert r["loop"].startswith("conforms"), r["loop"]
        assert r["max_param_diff"] < 1e-6, r


def scheduler_before_wrap():
    pgd.init()
    rank = dist.get_rank()
    torch.manual_seed(0)
    base = MLP()
    opt = torch.optim.Adam(base.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)  # before wrap
    model, opt = pgd.wrap(base, opt)
    train(model, opt, 6, rank, scheduler=sched)
    first = next(iter(base.parameters()))
    return {
        "adam_steps": int(opt.state[first]["step"]),
        "engine_iterations": model.engine.iteration,
        "lr": float(opt.param_groups[0]["lr"]),
        "last_lr": float(sched.get_last_lr()[0]),
        "sd_lr_type": type(opt.state_dict()["param_groups"][0]["lr"]).__name__,
    }


def test_scheduler_created_before_wrap_does_not_double_step(ranks):
    for r in ranks("test_cpu_training:scheduler_before_wrap", timeout=120):
        assert r["adam_steps"] == 6 == r["engine_iterations"]
        assert r["lr"] == pytest.approx(1e-2 * 0.5**3)
        assert r["last_lr"] == pytest.approx(1e-2 * 0.5**3)
        assert r["sd_lr_type"] == "float"


def eval_and_errors():
    pgd.init()
    torch.manual_seed(0)
    base = MLP()
    model, opt = pgd.wrap(base, torch.optim.SGD(base.parameters(), lr=0.1))
    x, y = data(0, dist.get_rank())
    model.eval()
    with torch.no_grad():
        eval_loss = model(x, y)
    model.train()
    out = {"eval_loss_is_tensor": isinstance(eval_loss, torch.Tensor),
           "iterations_after_eval": model.engine.iteration}
    # A module that returns logits (loss computed outside, as with DDP): the call
    # returns the logits, the loop trains (eagerly), and the report says why.
    logits_model = nn.Linear(32, 5)
    m2, o2 = pgd.wrap(logits_model, torch.optim.SGD(logits_model.parameters(), lr=0.1))
    for _ in range(3):
        o2.zero_grad()
        logits = m2(x)
        nn.functional.cross_entropy(logits, y).backward()
        o2.step()
    out["logits_shape"] = list(logits.shape)
    out["logits_loop"] = pgd.report().models[-1].loop
    # loss_fn makes it work: model(*inputs, target).
    lin = nn.Linear(32, 5)
    m3, o3 = pgd.wrap(lin, torch.optim.SGD(lin.parameters(), lr=0.1), loss_fn=nn.functional.cross_entropy)
    o3.zero_grad()
    loss = m3(x, y)
    loss.backward()
    o3.step()
    out["loss_fn_loss"] = float(loss)
    # An optimizer over parameters the model does not own is refused.
    try:
        pgd.wrap(nn.Linear(3, 3), torch.optim.SGD(nn.Linear(3, 3).parameters(), lr=0.1))
        out["foreign_error"] = ""
    except ValueError as exc:
        out["foreign_error"] = str(exc)
    return out


def test_eval_calls_and_clear_errors(ranks):
    for r in ranks("test_cpu_training:eval_and_errors", timeout=120):
        assert r["eval_loss_is_tensor"]
        assert r["iterations_after_eval"] == 0
        # Issue 12: the call returns what the module returns (it raised TypeError before).
        assert r["logits_shape"] == [16, 5]
        assert "loss is computed outside the model" in r["logits_loop"] and "loss_fn" in r["logits_loop"]
        assert r["loss_fn_loss"] > 0
        assert "not parameters of the wrapped model" in r["foreign_error"]


def fingerprint():
    pgd.init()
    rank = dist.get_rank()
    backend = pgd.graph_safe_backend(None, "cpu")
    assert backend is not None, "init() on CPU should use the graph-safe Gloo wrapper"
    issued0 = backend.collectives_issued
    a = torch.ones(10)
    b = torch.arange(5)
    # Same collectives on both ranks; rank 1 starts recording one collective earlier.
    if rank == 1:
        backend.start_recording()
    dist.all_reduce(a)
    if rank == 0:
        backend.start_recording()
    dist.broadcast(b, src=0)
    dist.all_reduce(a, op=dist.ReduceOp.MAX)
    fp = backend.stop_recording()
    verdict = agreement.agree(True, "", [fp.digest], group=None, device=torch.device("cpu"),
                              details={"collectives": fp.records(), "config": ""},
                              explain=agreement.explain_mismatch)
    # Now the same window on both ranks: digests agree.
    backend.start_recording()
    dist.all_reduce(a)
    fp2 = backend.stop_recording()
    verdict2 = agreement.agree(True, "", [fp2.digest], group=None, device=torch.device("cpu"))
    dist.barrier()  # outside capture, a barrier is just forwarded
    return {
        "backend_name": dist.get_backend(),
        "records": fp.records(),
        "describe": fp.describe(),
        "mismatch_agreed": verdict.agreed,
        "mismatch_reason": verdict.reason,
        "match_agreed": verdict2.agreed,
        "issued": backend.collectives_issued - issued0,
        "captured": backend.collectives_captured,
    }


def test_backend_fingerprints_and_agreement(ranks):
    results = ranks("test_cpu_training:fingerprint", timeout=60)
    r0, r1 = results
    assert r0["backend_name"] == "pgd_gloo"
    assert [x["kind"] for x in r0["records"]] == ["broadcast", "allreduce"]
    assert [x["kind"] for x in r1["records"]] == ["allreduce", "broadcast", "allreduce"]
    assert r1["records"][0]["numel"] == 10 and r1["records"][0]["dtype"] == "Float"
    for r in results:
        assert not r["mismatch_agreed"]
        assert "different collective sequences" in r["mismatch_reason"]
        assert "rank 0 broadcast" in r["mismatch_reason"] and "rank 1 allreduce" in r["mismatch_reason"]
        assert r["match_agreed"]
        assert r["captured"] == 0  # nothing is captured on CPU
    assert r0["issued"] >= 6  # every collective went through the wrapper


def agreement_failure():
    pgd.init()
    rank = dist.get_rank()
    v = agreement.agree(rank != 1, "boom on rank 1" if rank == 1 else "", [7], group=None,
                        device=torch.device("cpu"))
    v2 = agreement.agree(rank != 1, "transient", [], group=None, device=torch.device("cpu"), retryable=True)
    return {"agreed": v.agreed, "reason": v.reason, "final": v.final, "retry_final": v2.final}


def test_agreement_names_the_failing_rank(ranks):
    for r in ranks("test_cpu_training:agreement_failure", timeout=60):
        assert not r["agreed"]
        assert r["reason"] == "rank 1: boom on rank 1"
        assert r["final"] and not r["retry_final"]


# ----------------------------------------------------------- bf16 gradient all-reduce
def _bf16_compress_hook(state, bucket):
    buffer = bucket.buffer()
    compressed = buffer.to(torch.bfloat16).div_(dist.get_world_size())
    fut = dist.all_reduce(compressed, async_op=True).get_future()

    def decompress(fut):
        buffer.copy_(fut.value()[0])
        return buffer

    return fut.then(decompress)


def bf16_comm_vs_ddp(graphs=1, steps=12):
    """grad_comm_dtype=torch.bfloat16 against DDP with bf16_compress_hook (and
    against fp32 DDP, to see that the compression is real)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    from common import device

    pgd.init()
    rank = dist.get_rank()
    dev = device()
    torch.manual_seed(0)
    base = MLP().to(dev)
    ref16 = nn.parallel.DistributedDataParallel(copy.deepcopy(base))
    # DDP's own hook refuses to register without CUDA and NCCL; on the CPU the
    # same arithmetic (default_hooks._compress_hook) as a hook of ours.
    ref16.register_comm_hook(None, default_hooks.bf16_compress_hook if dev.type == "cuda"
                             else _bf16_compress_hook)
    ref32 = nn.parallel.DistributedDataParallel(copy.deepcopy(base))
    model, opt = pgd.wrap(base, torch.optim.SGD(base.parameters(), lr=0.05, momentum=0.9),
                          grad_comm_dtype=torch.bfloat16, graphs=bool(graphs))
    ours = train(model, opt, steps, rank, dev=dev)
    for ref in (ref16, ref32):
        train(ref, torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9), steps, rank, dev=dev)
    r = pgd.report().models[0]
    mine = flat_params(model.module)
    return {
        "vs_bf16_ddp": max_diff(mine, flat_params(ref16.module)),
        "vs_fp32_ddp": max_diff(mine, flat_params(ref32.module)),
        "bf16_vs_fp32_ddp": max_diff(flat_params(ref16.module), flat_params(ref32.module)),
        "ranks_agree": ranks_agree(mine, dev.type),
        "params": mine.tolist() if dev.type == "cuda" else [],
        "buckets": r.buckets,
        "replays": r.replays,
        "losses": ours,
    }


def test_bf16_gradient_allreduce_matches_ddp_bf16_compress_hook(ranks):
    for r in ranks("test_cpu_training:bf16_comm_vs_ddp", timeout=180):
        assert "all-reduced in bfloat16" in r["buckets"], r["buckets"]
        assert r["bf16_vs_fp32_ddp"] > 1e-6  # the compression changes training at all
        # Bitwise: DDP casts then divides by the world size in bf16, we divide in
        # fp32 then cast; dividing by 2 is exact either way.
        assert r["vs_bf16_ddp"] == 0.0, r
        assert r["ranks_agree"]


def test_grad_comm_dtype_refuses_what_it_does_not_offer():
    from pygraph_dist.loop.config import WrapConfig

    with pytest.raises(ValueError, match="torch.bfloat16"):
        WrapConfig(grad_comm_dtype=torch.float16)
    assert WrapConfig(grad_comm_dtype="bf16").grad_comm_dtype is torch.bfloat16
    assert WrapConfig(grad_comm_dtype=torch.float32).grad_comm_dtype is None


def bf16_comm_world_size_one(steps=6):
    """One rank: grad_comm_dtype=bf16 sends nothing, so it must neither cast nor
    round: bitwise the plain run."""
    pgd.init()
    dev = torch.device("cpu")
    runs = {}
    for comm in (None, torch.bfloat16):
        torch.manual_seed(0)
        base = MLP()
        model, opt = pgd.wrap(base, torch.optim.SGD(base.parameters(), lr=0.05, momentum=0.9),
                              grad_comm_dtype=comm)
        train(model, opt, steps, 0, dev=dev)
        runs[str(comm)] = (flat_params(model.module), pgd.report().models[-1].buckets)
    (plain, _), (bf16, buckets) = runs.values()
    return {"diff": max_diff(plain, bf16), "buckets": buckets}


def test_bf16_gradient_allreduce_is_a_no_op_at_world_size_one(ranks):
    (r,) = ranks("test_cpu_training:bf16_comm_world_size_one", world_size=1, timeout=120)
    assert r["diff"] == 0.0, r
    assert "bfloat16" not in r["buckets"], r["buckets"]


@pytest.mark.multigpu
def test_bf16_gradient_allreduce_graphed_on_gpus(ranks):
    """2 GPUs: bf16 all-reduce inside the graph, bitwise equal to graphs=False and
    within bf16 rounding of DDP's bf16_compress_hook."""
    graphed = ranks("test_cpu_training:bf16_comm_vs_ddp", timeout=240, kwargs={"graphs": 1, "steps": 30})
    eager = ranks("test_cpu_training:bf16_comm_vs_ddp", timeout=240, kwargs={"graphs": 0, "steps": 30})
    for g, e in zip(graphed, eager):
        assert g["replays"] > 20, g
        assert g["params"] == e["params"]
        assert g["vs_bf16_ddp"] <= 0.05 * g["bf16_vs_fp32_ddp"] + 1e-6, g


def test_side_streams_are_reused_never_shared(monkeypatch):
    """A wrapped model's side stream comes from a per-device pool: a torn-down
    model's stream is reused (cuBLAS keeps a workspace per stream for good), two
    live models never get the same one (newer torch frees a stream's workspace
    when any graph captured on it is destroyed). Fake streams: no GPU here."""
    from pygraph_dist.step import step as step_mod

    class FakeStream:
        made = 0

        def __init__(self, device):
            FakeStream.made += 1
            self.device = device

    monkeypatch.setattr(step_mod.torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(step_mod, "_FREE_SIDE_STREAMS", {})
    cuda0, cuda1 = torch.device("cuda", 0), torch.device("cuda", 1)
    a = step_mod.acquire_side_stream(cuda0)
    b = step_mod.acquire_side_stream(cuda0)
    assert a is not b and FakeStream.made == 2
    step_mod.release_side_stream(b)
    c = step_mod.acquire_side_stream(cuda0)
    assert c is b and FakeStream.made == 2          # reused, not a new one
    d = step_mod.acquire_side_stream(cuda1)
    assert d.device.index == 1 and FakeStream.made == 3  # per device
    step_mod.release_side_stream(a)
    assert step_mod.acquire_side_stream(cuda1) is not a   # device 0's stream stays on device 0


# ----------------------------------------------- step overlapping the last bucket
def step_overlap(opt_name="adamw", steps=5):
    """The whole-iteration body with the step split around the last bucket's
    all-reduce, against the same body stepping once after every bucket: the
    parameters must be bitwise equal (per-parameter optimizers), and the split
    must have happened."""
    from pygraph_dist.step import step as step_mod

    pgd.init()
    rank = dist.get_rank()
    results, splits = {}, {}
    for overlap in (True, False):
        torch.manual_seed(0)
        base = MLP(width=32, depth=4)
        opt = (torch.optim.AdamW(base.parameters(), lr=1e-2) if opt_name == "adamw"
               else torch.optim.SGD(base.parameters(), lr=0.05, momentum=0.9))
        model, opt = pgd.wrap(base, opt, bucket_cap_mb=0.004)
        step = model.engine.step
        if not overlap:
            step.overlap_reason = lambda: "switched off by the test"
        calls = []
        real = step_mod.only_params

        def counting(optimizer, keep, real=real, calls=calls):
            calls.append(sum(keep(p) for g in optimizer.param_groups for p in g["params"]))
            return real(optimizer, keep)

        step_mod.only_params = counting
        try:
            for s in range(steps):
                x, y = data(s, rank)
                step.clear_grads()
                step.body(((x, y), {}))
        finally:
            step_mod.only_params = real
        assert model.engine.reducer.tail is None
        buckets = len(model.engine.reducer.plan.buckets)
        results[overlap] = flat_params(model.module)
        splits[overlap] = calls
        model.engine.teardown()
    n_params = len(list(MLP(width=32, depth=4).parameters()))
    return {
        "diff": max_diff(results[True], results[False]),
        "splits": splits[True], "splits_off": splits[False], "n_params": n_params, "buckets": buckets,
        "ranks_agree": ranks_agree(results[True], "cpu"),
    }


@pytest.mark.parametrize("opt_name", ["adamw", "sgd"])
def test_step_overlapping_the_last_bucket_is_the_same_step(ranks, opt_name):
    for r in ranks("test_cpu_training:step_overlap", timeout=180, kwargs={"opt_name": opt_name}):
        assert r["diff"] == 0.0, r
        assert r["ranks_agree"]
        assert r["splits_off"] == []
        # Every iteration: the parameters outside the last bucket, then the rest.
        assert r["buckets"] > 2 and len(r["splits"]) == 2 * 5, r
        for first, second in zip(r["splits"][::2], r["splits"][1::2]):
            assert first > 0 and second > 0 and first + second == r["n_params"], r


def test_step_overlap_only_where_the_split_is_the_same_step():
    """Clipping, a scaler, an inf check, step hooks or an optimizer not known to
    step per parameter keep the single step after every bucket."""
    from types import SimpleNamespace

    from pygraph_dist.step.step import IterationStep

    def reason(**kw):
        opt = kw.pop("opt", None) or torch.optim.SGD([nn.Parameter(torch.zeros(2))], lr=0.1)
        fake = SimpleNamespace(world_size=2, max_grad_norm=None, grad_scaler=None, skip_nonfinite=False,
                               sparse_ids=set(), optimizer=opt, optimizer_class=type(opt), routed_clip=None)
        fake.__dict__.update(kw)
        return IterationStep.overlap_reason(fake)

    assert reason() is None
    assert reason(world_size=1) == "nothing to overlap"
    assert "clipping" in reason(max_grad_norm=1.0)
    assert "clipping" in reason(routed_clip=object())  # the loop's own clip_grad_norm_, in the step
    assert "clipping" in reason(skip_nonfinite=True)

    class MyOpt(torch.optim.SGD):
        pass

    assert "MyOpt is not known" in reason(opt=MyOpt([nn.Parameter(torch.zeros(2))], lr=0.1))
    hooked = torch.optim.AdamW([nn.Parameter(torch.zeros(2))])
    hooked.register_step_post_hook(lambda *a: None)
    assert "twice" in reason(opt=hooked)


def mismatched_wrap(kind: str):
    """wrap() on ranks whose models (kind="width", "buffer") or bucket plans
    (kind="cap") differ: every rank raises, saying what differs, instead of
    hanging in the first broadcast or all-reduce."""
    pgd.init()
    rank = dist.get_rank()
    torch.manual_seed(0)
    width = 12 if kind == "width" and rank == 1 else 10
    net = nn.Sequential(nn.Linear(4, width), nn.ReLU(), nn.Linear(width, 3))
    if kind == "buffer":
        net.register_buffer("scale", torch.ones(2 + rank))
    cap = 1e-4 if kind == "cap" and rank == 1 else 25.0
    try:
        pgd.wrap(net, torch.optim.SGD(net.parameters(), lr=0.1), bucket_cap_mb=cap)
        error = ""
    except RuntimeError as exc:
        error = str(exc)
    pgd.shutdown()
    return {"error": error}


@pytest.mark.parametrize("kind", ["width", "buffer", "cap"])
def test_wrap_refuses_models_that_differ_between_ranks(ranks, kind):
    for r in ranks("test_cpu_training:mismatched_wrap", timeout=60, kwargs={"kind": kind}):
        if kind == "cap":
            assert "the ranks planned different gradient buckets" in r["error"], r
            assert "bucket_cap_mb" in r["error"]
        else:
            assert "the ranks' models differ" in r["error"], r
            shown = "'0.weight (10, 4) float32' against rank 1's '0.weight (12, 4) float32'" if kind == "width" \
                else "'scale (2,) float32' against rank 1's 'scale (3,) float32'"
            assert shown in r["error"], r
