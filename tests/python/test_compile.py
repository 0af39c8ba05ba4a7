"""torch.compile inside the graph: ``wrap(..., compile=True)`` (issue 14, item 1).

GPU: compiled + graphed parameters bitwise equal to compiled + eager (the plugin
with ``graphs=False``) after 30 steps, with the loss inside the model (tier 1)
and outside it (tier 2, whose backward variants need the donated-buffer
switch), and with a module the user compiled. Both runs share one process, so
they run the same inductor kernels (autotuning choices included).
CPU: the compiled model trains like DDP on the uncompiled one (inductor's C++
kernels round differently, so within 1e-5, not bitwise); the option's checks.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import pygraph_dist as pgd
from pygraph_dist.loop.compiled import check_compiled_module, compile_kwargs

from common import MLP, data, device, flat_params, max_diff, ranks_agree


class Net(MLP):
    """common.MLP returning the loss (tier 1) or the logits (``logits=True``: tier 2)."""

    def __init__(self, width=64, depth=3, classes=5, logits=False):
        super().__init__(width=width, depth=depth, classes=classes)
        self.logits = logits

    def forward(self, x, y=None):
        out = self.head(self.body(x))
        return out if self.logits else F.cross_entropy(out, y)


def compiled_training(loop="inside", amp="fp32", steps=30, how="option", graphs_too=1):
    """Train compiled with graphs (and, with ``graphs_too``, again with
    graphs=False from the same start); return parameters, tiers and the report."""
    amp_arg = None if amp == "fp32" else amp
    pgd.init()
    rank = dist.get_rank()
    dev = device()
    width = 64

    def run(graphs):
        torch.manual_seed(0)
        base = Net(width=width, logits=loop == "outside").to(dev)
        module = torch.compile(base) if how == "user" else base
        opt = torch.optim.AdamW(module.parameters(), lr=1e-3)
        model, opt = pgd.wrap(module, opt, amp=amp_arg, graphs=graphs, compile=how == "option")
        losses = []
        for step in range(steps):
            x, y = data(step, rank, batch=32, width=width, device=dev)
            opt.zero_grad(set_to_none=True)
            if loop == "outside":
                with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=amp == "bf16"):
                    loss = F.cross_entropy(model(x).float(), y)
            else:
                loss = model(x, y)
            loss.backward()
            opt.step()
            losses.append(float(loss))
        r = pgd.report().models[-1]
        result = {"params": flat_params(base), "report": str(pgd.report()), "compile": r.compile,
                  "tiers": sorted({g.tier for g in r.graphs}), "replays": r.replays,
                  "losses": losses, "keys": list(model.state_dict())[:2]}
        model.engine.teardown()
        return result

    g = run(True)
    out = {k: v for k, v in g.items() if k != "params"}
    out["ranks_agree"] = ranks_agree(g["params"], dev)
    if graphs_too:
        e = run(False)
        out["bitwise"] = bool(torch.equal(g["params"], e["params"]))
        out["max_diff"] = max_diff(g["params"], e["params"])
        out["eager_losses"] = e["losses"]
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("loop,amp,how", [
    ("inside", "fp32", "option"),
    ("outside", "fp32", "option"),
    ("inside", "bf16", "option"),
    ("outside", "bf16", "option"),
    ("outside", "bf16", "user"),
])
def test_compiled_graphed_is_bitwise_compiled_eager(ranks, loop, amp, how):
    (r,) = ranks("test_compile:compiled_training", world_size=1, timeout=400,
                 kwargs={"loop": loop, "amp": amp, "how": how})
    assert r["tiers"] == (["1"] if loop == "inside" else ["2"]), r["report"]
    assert r["replays"] >= 20, r["report"]
    assert r["bitwise"], f"max |diff| {r['max_diff']}\n{r['report']}"
    assert r["losses"][-1] < r["losses"][0]
    if how == "option":  # the uncompiled module's keys
        assert r["keys"] == ["module.body.0.weight", "module.body.0.bias"], r["keys"]
        assert r["compile"].startswith("torch.compile()") and "compilation(s)" in r["compile"], r["report"]
    else:
        assert r["compile"].startswith("compiled by the user"), r["report"]


@pytest.mark.multigpu
def test_compiled_graphed_two_ranks(ranks):
    results = ranks("test_compile:compiled_training", timeout=400,
                    kwargs={"loop": "outside", "amp": "bf16", "how": "option"})
    for r in results:
        assert r["tiers"] == ["2"] and r["replays"] >= 20, r["report"]
        assert r["bitwise"], f"max |diff| {r['max_diff']}\n{r['report']}"
        assert r["ranks_agree"]


def compiled_vs_ddp_cpu(steps=5):
    """CPU, Gloo: wrap(compile=True) with the loss outside the model against
    torch DDP on the uncompiled model, same data."""
    pgd.init()
    rank = dist.get_rank()

    torch.manual_seed(0)
    base = Net(width=32, logits=True)
    model, opt = pgd.wrap(base, torch.optim.SGD(base.parameters(), lr=0.1, momentum=0.9), compile=True)
    torch.manual_seed(0)
    ref = nn.parallel.DistributedDataParallel(Net(width=32, logits=True))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for step in range(steps):
        x, y = data(step, rank, batch=8 if step < steps - 1 else 6)  # the last batch recompiles
        for m, o in ((model, opt), (ref, ref_opt)):
            o.zero_grad(set_to_none=True)
            F.cross_entropy(m(x), y).backward()
            o.step()
    r = pgd.report().models[-1]
    return {"max_diff": max_diff(flat_params(base), flat_params(ref.module)), "compile": r.compile,
            "keys": list(model.state_dict())[:1], "report": str(pgd.report())}


def test_compile_option_trains_like_ddp_on_cpu(ranks):
    for r in ranks("test_compile:compiled_vs_ddp_cpu", timeout=400):
        assert r["max_diff"] < 1e-5, r
        assert r["keys"] == ["module.body.0.weight"]
        # One compilation for the first shape, at least one more for the short last batch.
        assert "torch.compile()" in r["compile"] and "after the first iteration" in r["compile"], r["report"]


def test_compile_modes_with_their_own_cuda_graphs_are_switched():
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        assert compile_kwargs({"mode": "reduce-overhead"}) == {}
        assert compile_kwargs({"mode": "max-autotune"}) == {"mode": "max-autotune-no-cudagraphs"}
        assert compile_kwargs({"options": {"triton.cudagraphs": True, "max_autotune": True}}) == {
            "options": {"triton.cudagraphs": False, "max_autotune": True}}
    assert len(w) == 3 and all("cannot run inside pygraph_dist's graph" in str(x.message) for x in w)
    assert compile_kwargs(True) == {} and compile_kwargs(False) is None
    assert compile_kwargs({"mode": "max-autotune-no-cudagraphs", "dynamic": False}) == {
        "mode": "max-autotune-no-cudagraphs", "dynamic": False}
    with pytest.raises(TypeError, match="those of torch.compile: mode, options"):
        compile_kwargs({"mdoe": "default"})
    with pytest.raises(TypeError, match="pass True, or a dict"):
        compile_kwargs("default")


def test_modules_compiled_with_cuda_graphs_are_refused_with_the_fix():
    with pytest.raises(ValueError, match=r"wrap\(\.\.\., compile=True\)"):
        check_compiled_module(torch.compile(Net(), mode="reduce-overhead"), False)
    inplace = Net()
    inplace.compile(mode="reduce-overhead")
    with pytest.raises(ValueError, match=r"model\.compile\(\.\.\.\)"):
        check_compiled_module(inplace, False)
    with pytest.raises(ValueError, match="already compiled"):
        check_compiled_module(torch.compile(Net()), True)
    check_compiled_module(torch.compile(Net()), False)  # the default mode is welcome
    check_compiled_module(Net(), True)


def test_process_wide_inductor_cudagraphs_is_switched_or_refused():
    """torch._inductor.config.triton.cudagraphs = True (a recipe's global) would
    make every compilation record graphs of its own: compile= turns it off for
    our compilation with a warning, a user-compiled module is refused; an
    explicit option of the module's own wins over the global."""
    from torch._inductor import config as inductor_config

    with inductor_config.patch({"triton.cudagraphs": True}):
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            assert compile_kwargs(True) == {"options": {"triton.cudagraphs": False}}
            assert compile_kwargs({"options": {"max_autotune": True}}) == {
                "options": {"max_autotune": True, "triton.cudagraphs": False}}
        assert len(w) == 2 and all("torch._inductor.config.triton.cudagraphs is True" in str(x.message)
                                   for x in w)
        with pytest.raises(ValueError, match=r"torch\._inductor\.config\.triton\.cudagraphs = True"):
            check_compiled_module(torch.compile(Net()), False)
        check_compiled_module(torch.compile(Net(), options={"triton.cudagraphs": False}), False)
    check_compiled_module(torch.compile(Net()), False)
    assert compile_kwargs(True) == {}


def test_compiled_submodules_count_as_compiled():
    from pygraph_dist.loop.compiled import is_compiled

    net = Net()
    assert not is_compiled(net)
    net.body.compile()
    assert is_compiled(net)  # donated buffers must go off for it too
    net.head.compile(mode="reduce-overhead")
    with pytest.raises(ValueError, match=r"has a submodule that was compiled \(model\.head\.compile"):
        check_compiled_module(net, False)
    with pytest.raises(ValueError, match="backend.*cudagraphs"):
        compile_kwargs({"backend": "cudagraphs"})


def test_compile_timer_survives_dynamo_reset():
    from pygraph_dist.loop.compiled import TIMER

    from torch._dynamo.callback import callback_handler

    assert TIMER.install()
    torch._dynamo.reset()  # clears dynamo's callbacks (the benchmark resets between modes)
    assert TIMER._start not in callback_handler.start_callbacks
    assert TIMER.install()
    assert TIMER._start in callback_handler.start_callbacks
