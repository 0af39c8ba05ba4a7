"""What a model call returns, as the engine reads it: the loss among the
outputs (:func:`find_loss`), the error when there is none where one is needed,
and the outputs' structure rebuilt around other tensors (:func:`map_outputs`:
fresh copies handed out after a replay, scaled outputs for fp16, detached
static outputs). Used by :mod:`~pygraph_dist.step.step` (the iteration's forward),
:mod:`~pygraph_dist.engine.engine` (the hand-out) and tier 2's calls."""

from __future__ import annotations

import torch

from ..runtime._ext import C


def find_loss(out, *, tuples: bool = False) -> torch.Tensor | None:
    """The scalar loss in a model call's outputs: the output itself, ``out["loss"]``
    or ``out.loss`` (Hugging Face outputs), with ``tuples`` the one 0-dim floating
    tensor of a tuple or list (nanoGPT's ``logits, loss = model(x, y)``) — or None.
    Which tensor the loop calls ``backward()`` on decides the tier (the probe's
    monitor); this only names the candidate."""
    loss = out
    if not isinstance(loss, torch.Tensor):
        if isinstance(out, dict) and "loss" in out:
            loss = out["loss"]
        elif getattr(out, "loss", None) is not None:
            loss = out.loss
        elif tuples and isinstance(out, (tuple, list)):
            # 0-dim, not one element: a (B, 1) prediction at batch size 1 must not
            # become a second candidate (or the loss) depending on the batch.
            scalars = [t for t in out if isinstance(t, torch.Tensor) and t.dim() == 0 and t.is_floating_point()]
            loss = scalars[0] if len(scalars) == 1 else None
    if isinstance(loss, torch.Tensor) and loss.numel() == 1 and loss.is_floating_point():
        return loss
    return None


def loss_error(out, source: str) -> str:
    shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
    return (f"pygraph_dist.wrap(): {source} must produce the scalar loss, got {shape}. Either make "
            "the module return the loss (a one-element tensor, or an object with a .loss such as "
            "Hugging Face outputs), or pass loss_fn=...: the model is then called as "
            "model(*inputs, target) and returns loss_fn(module(*inputs), target).")


def map_outputs(out, fn):
    """``out`` with every tensor replaced by ``fn(tensor)``, keeping its structure
    (tensor, tuple, list, dict, Hugging Face ``ModelOutput``, or anything else as is)."""
    if isinstance(out, torch.Tensor):
        return fn(out)
    if isinstance(out, dict):
        items = {k: map_outputs(v, fn) for k, v in out.items()}
        if type(out) is dict:
            return items
        try:
            return type(out)(**items)  # ModelOutput dataclasses, OrderedDict subclasses
        except TypeError:
            copy = type(out)()
            copy.update(items)
            return copy
    if isinstance(out, tuple) and hasattr(out, "_fields"):
        return type(out)(*(map_outputs(v, fn) for v in out))
    if isinstance(out, (tuple, list)):
        return type(out)(map_outputs(v, fn) for v in out)
    return out


def _fresh_copy_py(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone()


# ``t.detach().clone()``, strides included: one cudaMemcpyAsync per dense CUDA
# tensor instead of clone()'s dispatch (csrc/hand_out.cpp; issue 26).
fresh_copy = getattr(C, "fresh_copy", _fresh_copy_py)


def hand_out_outputs(out, loss: torch.Tensor, fresh_loss: torch.Tensor):
    """A replay's outputs ``out`` as the caller gets them: ``fresh_loss`` for the
    graph's ``loss``, a fresh copy of every other tensor (the graph's own are
    overwritten by the next replay)."""
    if out is loss:
        return fresh_loss
    return map_outputs(out, lambda t: fresh_loss if t is loss else fresh_copy(t))
