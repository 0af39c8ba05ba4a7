"""The steady state of a graphed loop at the fewest host steps (issue 26).

Once a signature's graphs replay, each model call used to rebuild its key --
``tree_flatten``, a tuple per leaf, the TreeSpec hashed -- about 30 us of
Python per call, more than the hand-written recipe's whole step. Here:

* :func:`build_guard` makes a ``C.InputGuard`` for the entry that replayed:
  the call's structure with a ``C.TensorSlot`` per tensor, walked in C++
  against the next call (csrc/input_guard.h). A call it accepts has the same
  key as the entry's, so the engine skips the lookup; one it refuses takes
  the slow path, which finds or creates the right entry as before.
* :class:`ClearGrads` is ``optimizer.zero_grad(set_to_none=True)`` in one C++
  call when the optimizer's parameters are exactly the wrapped model's (torch's
  own loops over the parameters in Python inside a profiler range: 40 us at 18
  parameter tensors, 290 us at 500).

Both only ever decline: what they cannot prove the same goes the long way.
"""

from __future__ import annotations

import collections
import operator

import torch
import torch.utils._pytree as pytree

from ..runtime._ext import C
from .arguments import IGNORED

_STRUCTURES = (tuple, list, dict, collections.OrderedDict, type(None))


def _plain(spec) -> bool:
    """Whether ``spec`` is built only of the containers InputGuard walks
    (tuples, namedtuples, lists, dicts): a registered custom pytree node
    (a dataclass, HF's ModelOutput) would compare by value there."""
    if spec.is_leaf():
        return True
    t = spec.type
    if t not in _STRUCTURES and t is not collections.namedtuple:  # pytree's marker for namedtuples
        return False
    children = spec.children() if callable(getattr(spec, "children", None)) else spec.children_specs
    return all(_plain(c) for c in children)


def build_guard(args: tuple, kwargs: dict, masked_leaves: list, static_leaves: list):
    """An InputGuard accepting exactly the calls whose signature key is this
    call's, or None where the call's structure is not one it can walk.
    ``masked_leaves``: the call's leaves with ignored arguments as IGNORED
    (``IgnoredArgs.signature``); ``static_leaves``: the entry's static inputs, in the
    same order."""
    guard_cls = getattr(C, "InputGuard", None)
    if guard_cls is None:  # an extension built before input_guard.cpp
        return None
    leaves, spec = pytree.tree_flatten((args, kwargs))
    if len(leaves) != len(masked_leaves) or len(leaves) != len(static_leaves) or not _plain(spec):
        return None
    slots, statics = [], []
    placeholder = torch.empty(0)
    for i, (leaf, masked, static) in enumerate(zip(leaves, masked_leaves, static_leaves)):
        if masked is IGNORED:
            slots.append(C.TensorSlot(-1, [], torch.float32, "cpu", False))
            statics.append(placeholder)
        elif isinstance(leaf, torch.Tensor):
            if not isinstance(static, torch.Tensor):
                return None
            slots.append(C.TensorSlot(i, list(leaf.shape), leaf.dtype, leaf.device.type, leaf.requires_grad))
            statics.append(static)
        else:
            if isinstance(leaf, (tuple, list, dict)):  # a container pytree keeps whole (torch.Size, a
                return None                            # structseq): InputGuard would walk into it
            try:
                hash(leaf)
            except TypeError:
                return None
            slots.append(leaf)
            statics.append(placeholder)
    return guard_cls(pytree.tree_unflatten(slots, spec), statics)


class ClearGrads:
    """``zero_grad(set_to_none=True)`` of an optimizer whose parameters are the
    wrapped model's, in one C++ call (``ParamWatch.clear_grads``).

    Checked at every call against the optimizer's param groups, parameter by
    parameter: a group added or changed falls back to torch's ``zero_grad``
    until the parameters are the model's again."""

    def __init__(self, optimizer: torch.optim.Optimizer, optimizer_class: type, watch, params: list) -> None:
        self.optimizer = optimizer
        self.watch = watch
        self.param_ids = frozenset(id(p) for p in params)
        # A subclass's own zero_grad may do more than clear: left to run.
        self.usable = (watch is not None and hasattr(watch, "clear_grads")
                       and optimizer_class.zero_grad is torch.optim.Optimizer.zero_grad)
        self._lists: list[tuple] = []  # each group's parameters when last checked
        # One C++ loop (bindings.cpp); the Python spelling took ~40 us at 500 parameters.
        self._same_params = getattr(C, "same_group_params", None) or _same_group_params
        self._same = False

    def __call__(self, set_to_none: bool) -> bool:
        """Clear the gradients; False (nothing done) where torch's zero_grad must run."""
        if not (set_to_none and self.usable):
            return False
        groups, lists = self.optimizer.param_groups, self._lists
        # The same parameters, group by group, as at the last check (an element
        # replaced in place keeps its list's id and length), compared by identity.
        if not self._same_params(groups, lists):
            self._lists = [tuple(g["params"]) for g in groups]
            ids = [id(p) for snap in self._lists for p in snap]
            self._same = len(ids) == len(self.param_ids) and set(ids) == self.param_ids
        if not self._same:
            return False
        self.watch.clear_grads()
        return True


def _same_group_params(groups: list, lists: list) -> bool:
    """``C.same_group_params`` in Python (an extension built before it)."""
    return len(groups) == len(lists) and all(
        len(g["params"]) == len(snap) and all(map(operator.is_, g["params"], snap))
        for g, snap in zip(groups, lists))
