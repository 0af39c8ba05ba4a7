"""``conformance.scale_chain``: which ``backward()`` targets are the returned
loss's own backward (Accelerate divides by ``gradient_accumulation_steps``), or
the loss scaled by numbers a graph can seed its backward with."""

from __future__ import annotations

import pytest
import torch

from pygraph_dist.loop.conformance import chain_key, loss_edge, scale_chain


def unit_scaled(target, loss, edge=None) -> bool:
    """Whether ``target`` is ``loss`` scaled by 1 only (``/ 1``, ``* 1``, in place
    or not): what the loop state takes as the returned loss itself."""
    chain = scale_chain(target, loss, edge)
    return chain is not None and not chain_key(chain)


def _loss():
    w = torch.randn(3, requires_grad=True)
    return (w * 2).sum()


def test_loss_times_or_over_one_is_the_loss():
    loss = _loss()
    for target in (loss / 1, loss * 1, 1 * loss, loss / 1.0, loss.div(1), (loss / 1) / 1):
        assert unit_scaled(target, loss)


def test_other_scales_and_other_tensors_are_not():
    loss, other = _loss(), _loss()
    assert not unit_scaled(loss / 2, loss)
    assert not unit_scaled(loss * 0.5, loss)
    assert not unit_scaled(other / 1, loss)  # another loss
    assert not unit_scaled(loss + 0, loss)
    assert not unit_scaled((loss / 1) / 2, loss) and not unit_scaled((loss * 2) / 1, loss)
    assert not unit_scaled(loss / torch.ones((), requires_grad=True), loss)  # the divisor has a gradient
    assert not unit_scaled(loss.double() / 1, loss)
    assert not unit_scaled(loss, loss) and not unit_scaled(None, loss) and not unit_scaled(loss / 1, None)


def test_a_leaf_loss_handed_out_by_a_replay():
    """Tier 1 hands out the loss as a leaf that requires grad."""
    leaf = _loss().detach().clone().requires_grad_(True)
    assert unit_scaled(leaf / 1, leaf)
    assert not unit_scaled(leaf / 3, leaf)


def test_scaled_in_place_as_the_trainer_does():
    """transformers' compute_loss: ``loss *= n_processes`` on the returned loss,
    then Accelerate's ``loss / gradient_accumulation_steps``."""
    for k, expect in ((1, True), (2, False)):
        loss = _loss() * 1.0  # a non-leaf, as the model's loss
        edge, version = loss_edge(loss), loss._version
        loss *= k
        assert loss._version != version  # the loop state tells the in-place change by this
        assert unit_scaled(loss, loss, edge) is expect
        assert unit_scaled(loss / 1, loss, edge) is expect


def test_the_handed_out_loss_is_a_fresh_interior_tensor():
    """The loss a tier-1 replay hands out (csrc/hand_out.cpp, and the Python
    spelling for an older extension): a copy of the graph's static loss that
    requires grad, is not a leaf (transformers' ``loss *= 1`` works), keeps the
    in-place check working, and has nothing behind its grad_fn."""
    from pygraph_dist.engine import engine
    from pygraph_dist.runtime._ext import C

    makers = [engine._hand_out_loss_py]
    if hasattr(C, "hand_out_loss"):
        makers.append(C.hand_out_loss)
    else:
        pytest.fail("pygraph_dist._C has no hand_out_loss: the extension is older than csrc/hand_out.cpp")
    for make in makers:
        static = torch.tensor(2.5)
        with torch.no_grad():  # the engine hands out under whatever grad mode the call had
            fresh = make(static)
        assert fresh.requires_grad and not fresh.is_leaf and fresh.grad_fn is not None
        assert fresh.data_ptr() != static.data_ptr() and fresh.item() == 2.5
        static.fill_(7.0)  # the next replay overwrites the static loss
        assert fresh.item() == 2.5
        edge = loss_edge(fresh)
        scaled = fresh
        scaled *= 1  # in place on an interior tensor: allowed
        assert unit_scaled(scaled, fresh, edge)
        other = make(torch.tensor(1.0))
        other *= 2
        assert not unit_scaled(other, other, loss_edge(make(torch.tensor(1.0))))
        (fresh / 1).backward()  # reaches nothing, fails nothing


def test_the_loss_of_a_tuple_output_is_its_one_0_dim_tensor():
    """nanoGPT's ``logits, loss = model(x, y)``: the 0-dim tensor is the candidate
    loss (where the engine allows the rule: a monitor, no amp="fp16"). A
    one-element prediction of a batch of 1 is not 0-dim, so it never competes."""
    from pygraph_dist.loop.outputs import find_loss

    logits, loss = torch.randn(4, 8), torch.tensor(1.5)
    assert find_loss((logits, loss), tuples=True) is loss
    assert find_loss([loss, logits], tuples=True) is loss
    assert find_loss((logits, loss)) is None  # the rule off: as before
    assert find_loss((torch.randn(1, 1), loss), tuples=True) is loss  # batch of 1
    assert find_loss((torch.randn(1), loss), tuples=True) is loss
    assert find_loss((loss, torch.tensor(0.5)), tuples=True) is None  # two candidates: none
    assert find_loss((logits, torch.tensor(3)), tuples=True) is None  # not floating point
    assert find_loss({"loss": loss, "aux": torch.tensor(0.1)}) is loss


@pytest.mark.gpu
def test_the_handed_out_loss_on_a_gpu_is_the_same_bytes_stream_ordered():
    """csrc/hand_out.cpp's CUDA copy (one cudaMemcpyAsync on the current stream,
    no dispatcher): the same bytes as clone() for every float dtype, the value
    of the static loss at the copy's place in the current stream (the current
    or a side stream, behind GPU work); fresh_copy keeps clone()'s strides
    (channels_last, transposed, size-1 dimensions, an offset) and falls back
    to clone() where the elements are not one dense span."""
    from pygraph_dist.runtime._ext import C

    if not getattr(C, "cuda_enabled", False):
        pytest.fail("pygraph_dist._C was built without CUDA code paths on a machine with a GPU")
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        static = torch.tensor(0.5, device="cuda", dtype=dtype)
        for stream in (torch.cuda.current_stream(), torch.cuda.Stream()):
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                torch.cuda._sleep(2_000_000)
                # Enqueued behind the sleep: a copy made on any other stream (or
                # at once) would read 0.5; one made after the overwrite, 7.0.
                static.fill_(2.718281828)
                fresh = C.hand_out_loss(static)
                static.fill_(7.0)
            torch.cuda.current_stream().wait_stream(stream)
            torch.cuda.synchronize()
            assert fresh.dtype == dtype and fresh.shape == () and fresh.device == static.device
            assert fresh.requires_grad and not fresh.is_leaf and fresh.grad_fn is not None
            expect = torch.tensor(2.718281828, device="cuda", dtype=dtype)
            assert fresh.detach().reshape(1).view(torch.uint8).tolist() == \
                expect.reshape(1).view(torch.uint8).tolist(), dtype
            static.fill_(0.5)
    wide = torch.randn(4, 6, device="cuda")
    for src in (wide, wide.t()):  # contiguous: the raw copy; transposed: clone()
        with torch.no_grad():
            out = C.hand_out_loss(src)
        assert torch.equal(out.detach(), src) and out.is_contiguous() and out.data_ptr() != src.data_ptr()
    # fresh_copy (tier 2's outputs): clone()'s result, strides included, no autograd history.
    images = torch.randn(2, 3, 5, 5, device="cuda")
    pooled = torch.randn(2, 8, 1, 1, device="cuda").to(memory_format=torch.channels_last)  # strides (8, 1, 8, 8)
    for src in (wide, wide.t(), wide[1:], wide[:, ::2], images, images.to(memory_format=torch.channels_last),
                pooled, torch.randn(1, 4, device="cuda").t(), torch.empty(0, 3, device="cuda").t(),
                wide.bfloat16(), torch.randn(0, 3, device="cuda"), wide.requires_grad_()):
        out = C.fresh_copy(src)
        ref = src.detach().clone()
        assert out.stride() == ref.stride() and out.dtype == ref.dtype and out.shape == ref.shape
        assert torch.equal(out, ref) and not out.requires_grad and (out.numel() == 0 or out.data_ptr() != src.data_ptr())


def _scaled(target, scale: str):
    """The loop's scaling of its loss, as scripts write it."""
    if scale == "imul2":
        target *= 2  # transformers' compute_loss at 2 processes
    elif scale == "div3":
        target = target / 3  # Accelerate's backward() at gradient_accumulation_steps=3
    elif scale == "imul7_div3":
        target *= 7
        target = target / 3
    elif scale == "mul0.1":
        target = target * 0.1
    elif scale == "div1_imul3":
        target = target / 1
        target *= 3
    return target


def _forward(dtype):
    torch.manual_seed(0)
    w = torch.randn(5, 3, requires_grad=True)
    return w, (torch.randn(7, 5) @ w.to(dtype).float()).to(dtype).sum() * 1.0  # a non-leaf loss in dtype


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("scale", ["imul2", "div3", "imul7_div3", "mul0.1", "div1_imul3"])
def test_a_constant_scale_seeds_the_same_backward_bitwise(dtype, scale):
    """A tier-1 graph runs backward of the returned loss seeded with what the
    loop's scaling makes of 1.0 (conformance.loss_seed): the gradients must be
    bitwise those of the loop's own backward of the scaled loss."""
    from pygraph_dist.loop.conformance import loss_seed

    w, loss = _forward(dtype)
    edge = loss_edge(loss)
    target = _scaled(loss, scale)
    chain = scale_chain(target, loss, edge)  # read as the loop state reads it, before backward
    assert chain is not None and chain_key(chain), chain
    target.backward()
    w_graph, loss_graph = _forward(dtype)  # the graph's iteration: the same forward, the loss unscaled
    loss_graph.backward(loss_seed(chain, loss_graph))
    assert torch.equal(w.grad, w_graph.grad), (scale, dtype)
    assert loss_seed(scale_chain(loss_graph / 1, loss_graph), loss_graph) is None  # unscaled: as is


def scaled_loss_graphed(scale: str, steps: int = 20):
    """Rank body: the loop scales the returned loss by constants before
    backward() (``_scaled``), with graphs and with graphs=False."""
    import pygraph_dist as pgd
    from common import MLP, data, device, flat_params

    pgd.init()
    dev, out = device(), {}
    for graphs in (True, False):
        torch.manual_seed(0)
        base = MLP().to(dev)
        model, opt = pgd.wrap(base, torch.optim.AdamW(base.parameters(), lr=1e-3), graphs=graphs)
        losses = []
        for step in range(steps):
            x, y = data(step, 0, device=dev)
            opt.zero_grad(set_to_none=True)
            loss = _scaled(model(x, y), scale)
            loss.backward()
            opt.step()
            losses.append(float(loss))
        m = pgd.report().models[-1]
        out[graphs] = {"params": flat_params(base), "losses": losses, "tiers": [g.tier for g in m.graphs],
                       "replays": sum(g.replays for g in m.graphs), "verbose": str(pgd.report(verbose=True))}
        model.engine.teardown()
    pgd.shutdown()
    g = out[True]
    return {"tiers": g["tiers"], "replays": g["replays"], "verbose": g["verbose"],
            "bitwise": bool(torch.equal(g["params"], out[False]["params"])),
            "losses_equal": g["losses"] == out[False]["losses"]}


@pytest.mark.gpu
@pytest.mark.parametrize("scale", ["imul2", "imul7_div3"])
def test_a_loss_scaled_by_constants_replays_tier1_bitwise(ranks, scale):
    """transformers' Trainer at 2 processes (loss *= 2) and Accelerate's
    division: tier 1, bitwise the training of graphs=False, the same losses."""
    (r,) = ranks("test_unit_scaled:scaled_loss_graphed", world_size=1, timeout=240, kwargs={"scale": scale})
    assert r["tiers"] == ["1"] and r["replays"] >= 8, r["verbose"]
    assert r["bitwise"] and r["losses_equal"], r
