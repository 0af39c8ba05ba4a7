"""``clip_route``: torch's ``clip_grad_norm_`` replaced by the router at
``wrap()``. For parameters that are no wrapped model's it must be torch's own
function, result for result; the probe-side rules are in test_report.py
(loop_report's clip variants) and the graphed step in test_loops.py."""

from __future__ import annotations

import inspect

import torch

from pygraph_dist import clip_route


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
    assert clip_route._own("torch") and clip_route._own("torch.nn.utils") and clip_route._own("pygraph_dist.step")
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
