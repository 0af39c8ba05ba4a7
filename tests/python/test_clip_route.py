"""``clip_route``: torch's ``clip_grad_norm_`` replaced by the router at
``wrap()``. For parameters that are no wrapped model's it must be torch's own
function, result for result; the probe-side rules are in test_report.py
(loop_report's clip variants) and the graphed step in test_loops.py."""

from __future__ import annotations

import inspect

import pytest
import torch

from pygraph_dist.step import clip_route


def _grads(seed: int):
    g = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(5, 3, generator=g)), torch.nn.Parameter(torch.randn(7, generator=g))]
    for p in params:
        p.grad = torch.randn(p.shape, generator=g) * 10
    return params


def test_unwrapped_parameters_get_torchs_own_clip():
    clip_route.install()
    try:
        assert torch.nn.utils.clip_grad_norm_ is clip_route.clip_grad_norm_
        assert torch.nn.utils.clip_grad.clip_grad_norm_ is clip_route.clip_grad_norm_
        # the same signature and documentation as torch's
        assert inspect.signature(torch.nn.utils.clip_grad_norm_) == inspect.signature(clip_route.ORIGINAL)
        assert torch.nn.utils.clip_grad_norm_.__doc__ == clip_route.ORIGINAL.__doc__
        for kwargs in ({}, {"norm_type": 1.0}, {"norm_type": float("inf")}, {"foreach": False}):
            mine, ref = _grads(0), _grads(0)
            got = torch.nn.utils.clip_grad_norm_(iter(mine), 1.0, **kwargs)  # a generator, as model.parameters()
            want = clip_route.ORIGINAL(ref, 1.0, **kwargs)
            assert torch.equal(got, want), kwargs
            assert all(torch.equal(a.grad, b.grad) for a, b in zip(mine, ref)), kwargs
        single, ref = _grads(1)[0], _grads(1)[0]  # one tensor, not a list
        assert torch.equal(torch.nn.utils.clip_grad_norm_(single, 0.5), clip_route.ORIGINAL(ref, 0.5))
        assert torch.equal(single.grad, ref.grad)
    finally:
        clip_route.uninstall()
    assert torch.nn.utils.clip_grad_norm_ is clip_route.ORIGINAL


def test_a_plan_matches_only_the_same_call():
    params = _grads(2)
    plan = clip_route.ClipPlan(1.0, tuple(params), None)
    assert plan.same_call(list(params), 1.0, 2.0, False, None)
    assert plan.same_call(list(params), 1, 2, False, None)  # ints are the same numbers
    assert not plan.same_call(list(params), 0.5, 2.0, False, None)
    assert not plan.same_call(list(params), 1.0, 1.0, False, None)
    assert not plan.same_call(list(params), 1.0, 2.0, True, None)
    assert not plan.same_call(list(params), 1.0, 2.0, False, True)
    assert not plan.same_call(list(reversed(params)), 1.0, 2.0, False, None)  # another order: another norm
    assert not plan.same_call(params[:1], 1.0, 2.0, False, None)
    assert plan.same(clip_route.ClipPlan(1.0, tuple(params), None))
    assert plan.digest() == clip_route.ClipPlan(1.0, tuple(_grads(3)), None).digest()  # ranks' own tensors
    assert plan.digest() != clip_route.ClipPlan(0.5, tuple(params), None).digest()
    assert plan.describe() == "clip_grad_norm_(max_norm=1) inside the step graph"


def test_an_empty_generator_warns_as_torch_does():
    import warnings

    clip_route.install()
    try:
        for fn in (clip_route.ORIGINAL, torch.nn.utils.clip_grad_norm_):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                fn((p for p in []), 1.0)
            assert any("empty generator" in str(w.message) for w in caught), (fn, caught)
    finally:
        clip_route.uninstall()


def test_only_torch_and_pygraph_dist_keep_their_names():
    assert clip_route._own("torch") and clip_route._own("torch.nn.utils") and clip_route._own("pygraph_dist.step.step")
    assert not clip_route._own("torchvision") and not clip_route._own("torch_utils")
    assert not clip_route._own("torchmetrics.functional") and not clip_route._own("__main__")


def test_names_bound_to_torchs_clip_before_wrap_are_rebound():
    """``from torch.nn.utils import clip_grad_norm_`` before wrap(): install()
    rebinds that global of the calling module (and only names bound to torch's
    function); uninstall() binds it back."""
    clip_route.uninstall()
    space: dict = {"__name__": "user_script", "clip_route": clip_route}
    exec("from torch.nn.utils import clip_grad_norm_\n"
         "from torch.nn.utils.clip_grad import clip_grad_norm_ as clip\n"
         "other = len\n"
         "def setup():\n"
         "    clip_route.install()\n", space)
    assert space["clip_grad_norm_"] is clip_route.ORIGINAL and space["clip"] is clip_route.ORIGINAL
    try:
        space["setup"]()  # as wrap() called from the script's function
        assert space["clip_grad_norm_"] is clip_route.clip_grad_norm_
        assert space["clip"] is clip_route.clip_grad_norm_ and space["other"] is len
        assert clip_route.rebind([space]) == []  # nothing left to rebind: idempotent
    finally:
        clip_route.uninstall()
    assert space["clip_grad_norm_"] is clip_route.ORIGINAL and space["clip"] is clip_route.ORIGINAL


def test_model_parameters_of_a_wrapped_model_is_read_once_per_structure():
    """clip_grad_norm_(model.parameters()): the generator's walk over the modules
    (1.2-1.5 ms at 500 tensors) happens once, and again after any registration."""
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 2))
    assert clip_route.parameters_of(m.parameters()) is None  # not remembered: the generator runs
    clip_route.remember(m)
    first = clip_route.parameters_of(m.parameters())
    assert first == tuple(m.parameters())
    assert clip_route.parameters_of(m.parameters()) is first  # cached: the same tuple
    m.add_module("extra", torch.nn.Linear(2, 2))  # a submodule registered: read again
    second = clip_route.parameters_of(m.parameters())
    assert second is not first and second == tuple(m.parameters()) and len(second) == 6
    m[0].weight = torch.nn.Parameter(torch.zeros(3, 3))  # a parameter replaced by setattr
    third = clip_route.parameters_of(m.parameters())
    assert third == tuple(m.parameters()) and third[0] is m[0].weight
    m[0].load_state_dict({"weight": torch.ones(3, 3), "bias": torch.ones(3)}, assign=True)
    assert clip_route.parameters_of(m.parameters())[0] is m[0].weight
    # anything but a fresh recursive parameters() generator of a remembered module: None
    assert clip_route.parameters_of(m.parameters(recurse=False)) is None
    started = m.parameters()
    next(started)
    assert clip_route.parameters_of(started) is None
    assert clip_route.parameters_of(list(m.parameters())) is None
    assert clip_route.parameters_of(p for p in m.parameters()) is None
    assert clip_route.parameters_of(m[0].parameters()) is None  # a submodule: not remembered
    clip_route.structure_changed()  # as the engine does when a parameter's storage drifted
    fourth = clip_route.parameters_of(m.parameters())
    clip_route.structure_changed()
    assert clip_route.parameters_of(m.parameters()) is not fourth


def test_the_cache_is_the_modules_own():
    """Found by identity (a module equal to another is not it) and kept in the
    module's own __dict__: nothing outside holds the parameters or the module."""
    import gc
    import weakref

    class Config(torch.nn.Module):  # equality by configuration, as some libraries define it
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(2, 2)

        def __eq__(self, other):
            return isinstance(other, Config)

        def __hash__(self):
            return 0

    a, b = Config(), Config()
    clip_route.remember(a)
    assert clip_route.parameters_of(a.parameters()) == tuple(a.parameters())
    assert clip_route.parameters_of(b.parameters()) is None  # b equals a, but was never remembered
    # A hook that refers to its module (a parameter -> hook -> module cycle) is collected with it.
    a.lin.weight.register_hook(lambda g, m=a: g)
    ref = weakref.ref(a)
    del a
    gc.collect()
    assert ref() is None


def test_a_generator_kept_and_passed_again_is_empty_as_with_torch():
    """torch's clip uses the generator up: passed a second time it clips nothing
    and warns. A cached answer closes the generator, so the same happens."""
    import warnings

    m = torch.nn.Linear(3, 3)
    for p in m.parameters():
        p.grad = torch.full_like(p, 10.0)
    clip_route.remember(m)
    clip_route.install()
    try:
        clip_route.parameters_of(m.parameters())  # the cache filled
        kept = m.parameters()
        first = torch.nn.utils.clip_grad_norm_(kept, 1.0)
        assert float(first) > 1.0
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            second = torch.nn.utils.clip_grad_norm_(kept, 1.0)
        assert float(second) == 0.0 and any("empty" in str(w.message) for w in seen), seen
    finally:
        clip_route.uninstall()


def test_the_cached_parameters_clip_as_torch_does():
    """Through the router, a remembered module's parameters() clips exactly as
    torch's own function with the generator (no engine: torch's path)."""
    def model(seed):
        torch.manual_seed(seed)
        m = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Linear(4, 3))
        for p in m.parameters():
            p.grad = torch.randn_like(p) * 10
        return m

    clip_route.install()
    try:
        mine, ref = model(0), model(0)
        clip_route.remember(mine)
        for _ in range(2):  # the second call reads the cache
            got = torch.nn.utils.clip_grad_norm_(mine.parameters(), 1.0)
            want = clip_route.ORIGINAL(ref.parameters(), 1.0)
            assert torch.equal(got, want)
            assert all(torch.equal(a.grad, b.grad) for a, b in zip(mine.parameters(), ref.parameters()))
    finally:
        clip_route.uninstall()


def wrapped_clip_loop(steps=6):
    """A wrapped model (CPU, one rank) trained with the loop's own clip, beside
    DDP with torch's clip: the router read model.parameters() from the cache."""
    import torch.distributed as dist
    from torch import nn

    import pygraph_dist as pgd

    pgd.init()
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
    ref = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
    ref.load_state_dict(net.state_dict())
    model, opt = pgd.wrap(net, torch.optim.SGD(net.parameters(), lr=0.5))
    ddp = nn.parallel.DistributedDataParallel(ref)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    cached = [clip_route.parameters_of(m.parameters()) for m in (model, model.module)]
    norms = []
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(16, 8, generator=g) * 5, torch.randint(0, 4, (16,), generator=g)
        out = []
        for m, o in ((model, opt), (ddp, ref_opt)):
            o.zero_grad(set_to_none=True)
            torch.nn.functional.cross_entropy(m(x), y).backward()
            out.append(float(torch.nn.utils.clip_grad_norm_(m.parameters(), 0.1)))
            o.step()
        norms.append(out)
    same = all(torch.equal(a, b) for a, b in zip(net.parameters(), ref.parameters()))
    again = [clip_route.parameters_of(m.parameters()) for m in (model, model.module)]
    result = {
        "cached_is_parameters": [c == tuple(net.parameters()) for c in cached],
        "cached_again": [a is c for a, c in zip(again, cached)],
        "norms": norms, "bitwise": same, "rank": dist.get_rank(),
    }
    pgd.shutdown()
    return result


def test_a_wrapped_models_clip_reads_the_cache_and_trains_as_ddp(ranks):
    for r in ranks("test_clip_route:wrapped_clip_loop", world_size=1, timeout=120):
        assert r["cached_is_parameters"] == [True, True], r  # wrapper and module: remembered at wrap()
        assert r["cached_again"] == [True, True], r  # nothing registered since: the same tuples
        assert all(a == b for a, b in r["norms"]) and r["norms"][0][0] > 0.1, r["norms"]  # clipped
        assert r["bitwise"], r


def test_a_tier2_clip_never_captured_is_described_with_its_reasons():
    """report()'s clip clause for a tier-2 clip that never became a graph for
    reasons found at the call: each reason with its count, the most frequent
    first, two at most; nothing for calls refused by the probe's checks alone
    (the probe's reason says why), and the graph's replays once one exists."""
    from pygraph_dist.tiers.split_clip import SplitClip

    clip = SplitClip(step=None, runner=None, accum=None, clip_param_ids=frozenset())  # describe() reads none
    clip.off = False
    assert clip.describe() == ""
    clip._eager()  # a call routable() refused: the probe's reason covers it
    assert clip.describe() == ""
    for why, n in (("a mode", 3), ("still accumulating", 1), ("a frozen .grad", 2)):
        for _ in range(n):
            clip._eager(why)
    text = clip.describe()
    assert text == ("your clip_grad_norm_ eager between the graphs (3 calls: a mode; 2 calls: a frozen "
                    ".grad; 1 more reason)"), text
    assert clip.eager_calls == 7


def _bucket_grads(seed: int, dtype=torch.float32):
    """Parameters whose gradients lie in flat buffers as the reducer lays them
    out -- three back to back in one, a gap, one alone after it; two more back
    to back in a second buffer, listed between the first buffer's -- plus a
    transposed (strided) one, a separate tensor and a parameter without a
    gradient. The buffers hold a sentinel (7) wherever no gradient is."""
    g = torch.Generator().manual_seed(seed)
    bufs = [torch.full((64,), 7.0, dtype=dtype), torch.full((32,), 7.0, dtype=dtype)]
    layout = [((5, 3), 0, 0), ((7,), 0, 15), ((4, 2), 1, 0), ((4, 4), 0, 22), ((6,), 1, 8), ((3, 3), 0, 40)]
    params = []
    for shape, b, offset in layout:  # 38..39 and 49..: the sentinel
        p = torch.nn.Parameter(torch.zeros(shape, dtype=dtype))
        p.grad = bufs[b][offset:offset + p.numel()].view(shape)
        params.append(p)
    strided = torch.nn.Parameter(torch.zeros(3, 4, dtype=dtype))
    strided.grad = torch.zeros(4, 3, dtype=dtype).t()
    alone = torch.nn.Parameter(torch.zeros(6, dtype=dtype))
    alone.grad = torch.zeros(6, dtype=dtype)
    params += [strided, alone, torch.nn.Parameter(torch.zeros(2, dtype=dtype))]
    for p in params[:-1]:
        p.grad.copy_(torch.randn(p.shape, generator=g) * 10)
    return params, bufs


def test_clip_in_spans_is_torchs_clip_bit_for_bit():
    from common import count_ops

    for max_norm in (1.0, 1e6):  # clipping, and a coefficient clamped to 1
        for foreach in (None, False):
            (ours, bufs), (theirs, _) = _bucket_grads(3), _bucket_grads(3)
            with count_ops()() as counted:
                norm = clip_route.clip_in_spans(ours, max_norm, foreach, spans=True)
            ref = clip_route.ORIGINAL(theirs, max_norm, 2.0, foreach=foreach)
            assert torch.equal(norm, ref), (max_norm, foreach)
            for a, b in zip(ours, theirs):
                assert (a.grad is None) == (b.grad is None)
                if a.grad is not None:
                    assert torch.equal(a.grad, b.grad), (max_norm, foreach, a.shape)
            # What is no gradient's is left alone: the gap and the buffers' tails.
            assert bufs[0][38:40].eq(7).all() and bufs[0][49:].eq(7).all() and bufs[1][14:].eq(7).all()
            # Each buffer's gradients back to back as one tensor (3 and 2 of them),
            # the other three (after the gap, strided, separate) as they are.
            assert counted.ops.get("mul_", 0) == (5 if foreach is False else 0), counted.ops
            assert counted.ops.get("_foreach_mul_", 0) == (0 if foreach is False else 1), counted.ops


def test_clip_in_spans_runs_torchs_clip_where_spans_do_not_apply(monkeypatch):
    calls = []
    monkeypatch.setattr(clip_route, "ORIGINAL", lambda *a, **k: calls.append(a[1]) or torch.zeros(()))
    clip_route.clip_in_spans(_bucket_grads(1, torch.bfloat16)[0], 1.0, spans=True)  # not float32
    clip_route.clip_in_spans(_bucket_grads(1)[0], 2.0)  # eager (no capture): torch's, the same values

    class Sub(torch.Tensor):
        pass

    params = _bucket_grads(1)[0]
    params[0].grad = params[0].grad.as_subclass(Sub)
    clip_route.clip_in_spans(params, 3.0, spans=True)  # a tensor subclass
    monkeypatch.setenv("PYGRAPH_DIST_CLIP_SPANS", "0")
    clip_route.clip_in_spans(_bucket_grads(1)[0], 4.0, spans=True)
    assert calls == [1.0, 2.0, 3.0, 4.0]


def test_clip_in_spans_takes_a_generator_or_a_tensor_as_torch_does():
    ours, theirs = _bucket_grads(5)[0], _bucket_grads(5)[0]
    norm = clip_route.clip_in_spans((p for p in ours), 1.0, spans=True)
    assert torch.equal(norm, clip_route.ORIGINAL(theirs, 1.0)), "a generator is read once"
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(ours[:-1], theirs[:-1]))
    one = _bucket_grads(6)[0][0]
    ref = _bucket_grads(6)[0][0]
    assert torch.equal(clip_route.clip_in_spans(one, 1.0, spans=True), clip_route.ORIGINAL(ref, 1.0))
    assert torch.equal(one.grad, ref.grad)


@pytest.mark.gpu
def test_clip_in_spans_captured_on_a_gpu_is_torchs_clip_bit_for_bit(monkeypatch):
    """On a GPU, in a CUDA graph (where the spans apply): 300 gradients in three
    buckets with gaps, some large enough for the foreach kernel to split them
    over launches, against torch's clip run eagerly on copies -- the norm and
    every gradient bit for bit, the gaps untouched."""
    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(11)
    bufs = [torch.full((1 << 20,), 7.0, device=dev) for _ in range(3)]
    params, offsets = [], [0, 0, 0]
    covered = [torch.zeros(b.numel(), dtype=torch.bool, device=dev) for b in bufs]
    for i in range(300):
        n = 257 if i % 7 == 0 else 4096  # 257: the next slot starts after a gap (alignment)
        b = i % 3
        p = torch.nn.Parameter(torch.zeros(n, device=dev))
        p.grad = bufs[b][offsets[b]:offsets[b] + n]
        p.grad.copy_(torch.randn(n, generator=g).to(dev))
        covered[b][offsets[b]:offsets[b] + n] = True
        offsets[b] += n + (-n % 16)
        params.append(p)
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in params]
    for a, b in zip(theirs, params):
        a.grad = b.grad.clone()
    plans = []
    real = clip_route.copy_plan
    monkeypatch.setattr(clip_route, "copy_plan", lambda *a, **k: plans.append(1) or real(*a, **k))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        norm = clip_route.clip_in_spans(params, 0.5)
    graph.replay()
    torch.cuda.synchronize()
    ref = clip_route.ORIGINAL(theirs, 0.5)
    assert plans == [1]  # the spans, chosen because a graph was being captured
    assert torch.equal(norm, ref) and float(ref) > 0.5
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(params, theirs))
    for b, mask in zip(bufs, covered):  # the gaps and the tails: no gradient's
        assert b[~mask].eq(7).all()
