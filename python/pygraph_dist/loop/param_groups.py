"""Param groups as training scripts write them, and what a graph bakes in of them.

Scripts set hyperparameters by assigning to ``optimizer.param_groups[i][key]``
every step: nanoGPT's ``group['lr'] = get_lr(it)``, timm's schedulers,
``group['lr'] *= 0.1``. A graph reads the lr from a device tensor (optim.py
makes it one where the optimizer allows), so a number assigned to ``'lr'`` is
written *into* that tensor (:class:`WatchedParamGroup`); every other key a
graph bakes in, and whether it changed since the capture
(:func:`hyperparams_drift`, with :func:`same_versions` as its shortcut when no
group changed at all), is checked before each replay (graph_cache.drift).
"""

from __future__ import annotations

import os
import sys

import torch


def write_lr(target: torch.Tensor, value) -> bool:
    """Write ``value`` -- a Python or numpy number, or a one-element tensor --
    into the device lr tensor ``target`` (no host sync); False if it is none of those."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            return False
        with torch.no_grad():
            target.copy_(value.detach().reshape(()))
        return True
    try:
        number = float(value)  # int, float, numpy scalars, Decimal, ...
    except (TypeError, ValueError):
        return False
    with torch.no_grad():
        target.fill_(number)
    return True


_HERE = __file__.rsplit("/", 2)[0]  # the package, not loop/


def _user_line() -> str:
    """``file:line`` of the nearest caller outside torch and pygraph_dist (the
    script line that set a hyperparameter, also through a scheduler's step())."""
    frame = sys._getframe(2)
    while frame is not None:
        path = frame.f_code.co_filename
        if not (path.startswith(_HERE) or f"{os.sep}torch{os.sep}" in path):
            return f"{os.path.basename(path)}:{frame.f_lineno}"
        frame = frame.f_back
    return ""


class WatchedParamGroup(dict):
    """A param group of a wrapped optimizer: a dict that behaves as the one it
    replaces, except that

    * a number (or a one-element tensor) assigned to ``'lr'`` of a group whose
      lr lives on the device is written *into* that tensor, which the graphs
      read -- ``group['lr'] = get_lr(it)`` (nanoGPT), timm's schedulers
      (``param_group[field] = value``), ``group['lr'] *= 0.1`` all reach the
      next replay without capturing again;
    * any other key assigned a new value records the script line that did it,
      for the warning about hyperparameters a graph bakes in.

    ``update``/``setdefault`` go through ``__setitem__``; a group dict replaced
    in the list is caught by :func:`adopt_assigned_lrs` at the next model call
    or step. ``version`` counts the changes a graph could miss (an lr written
    into the device tensor is not one): an unchanged version is an unchanged
    group, which spares the drift check its per-key comparisons.
    """

    __slots__ = ("lr_tensor", "set_at", "version")

    def __init__(self, group: dict, lr_tensor: torch.Tensor | None) -> None:
        super().__init__(group)
        self.lr_tensor = lr_tensor
        self.set_at: dict[str, str] = {}
        self.version = 0

    def __setitem__(self, key, value) -> None:
        if key == "lr" and self.lr_tensor is not None and value is not self.lr_tensor \
                and write_lr(self.lr_tensor, value):
            value = self.lr_tensor
        else:
            old = dict.get(self, key, _MISSING)
            if old is not value:
                self.version += 1
                if key != "params" and old is not _MISSING and not _same(old, value):
                    self.set_at[key] = _user_line()
        dict.__setitem__(self, key, value)

    def update(self, *args, **kwargs) -> None:
        for k, v in dict(*args, **kwargs).items():
            self[k] = v

    def setdefault(self, key, default=None):
        if key not in self:
            self[key] = default
        return dict.__getitem__(self, key)

    def __ior__(self, other):
        self.update(other)
        return self

    def __delitem__(self, key) -> None:
        self.version += 1
        dict.__delitem__(self, key)

    def pop(self, *args):
        self.version += 1
        return dict.pop(self, *args)

    def popitem(self):
        self.version += 1
        return dict.popitem(self)

    def clear(self) -> None:
        self.version += 1
        dict.clear(self)

    def __reduce__(self):  # pickled (deepcopy, torch.save of the optimizer) as a plain dict
        return (dict, (dict(self),))


_MISSING = object()


def group_versions(opt: torch.optim.Optimizer) -> tuple | None:
    """Each param group with its ``version``, for :func:`same_versions`; None
    unless every group is a WatchedParamGroup."""
    groups = opt.param_groups
    if not all(isinstance(g, WatchedParamGroup) for g in groups):
        return None
    return tuple((g, g.version) for g in groups)


def same_versions(opt: torch.optim.Optimizer, versions: tuple | None) -> bool:
    """Whether the param groups are the same dicts as in ``versions``, none
    changed since: then nothing :func:`hyperparams_drift` compares changed."""
    if versions is None:
        return False
    groups = opt.param_groups
    if len(groups) != len(versions):
        return False
    for g, (g0, v0) in zip(groups, versions):
        if g is not g0 or g.version != v0:
            return False
    return True


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return False
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - an odd type compares as changed
        return False


def watch_param_groups(opt: torch.optim.Optimizer, lr_tensors: list[torch.Tensor | None]) -> None:
    """Replace ``opt``'s param group dicts, in place in its list, by
    :class:`WatchedParamGroup` s (same keys and values)."""
    groups = opt.param_groups
    for i, g in enumerate(groups):
        lr_t = lr_tensors[i] if i < len(lr_tensors) else None
        if isinstance(g, WatchedParamGroup):
            g.lr_tensor = lr_t
        else:
            groups[i] = WatchedParamGroup(g, lr_t)


def adopt_assigned_lrs(opt: torch.optim.Optimizer, lr_tensors: list[torch.Tensor | None]) -> None:
    """An lr that reached a group without ``__setitem__`` (``dict.update(group, ...)``, a
    replaced group dict) is written into the device tensor, which goes back into
    the group. Called at every model call and step, before anything reads the lr,
    so that the eager step, a capture and a replay all read the tensor."""
    for g, t in zip(opt.param_groups, lr_tensors):
        if t is not None:
            cur = g.get("lr")
            if cur is not t and write_lr(t, cur):
                dict.__setitem__(g, "lr", t)


# ---------------------------------------------------------------------------
# Hyperparameters baked into a graph.


def snapshot_hyperparams(opt: torch.optim.Optimizer) -> list[dict]:
    return [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]


def where_set(opt: torch.optim.Optimizer, group: int, key: str) -> str:
    """The script line that last assigned ``key`` of param group ``group``, or ""."""
    groups = opt.param_groups
    g = groups[group] if group < len(groups) else None
    return g.set_at.get(key, "") if isinstance(g, WatchedParamGroup) else ""


def hyperparams_drift(
    opt: torch.optim.Optimizer, snapshot: list[dict], lr_tensors: list[torch.Tensor | None]
) -> str | None:
    """What changed since ``snapshot`` that a replay would not see, or None.

    A number assigned to a device-lr group (``group["lr"] = 1e-4``) was
    already written into the device tensor the graph reads (WatchedParamGroup,
    adopt_assigned_lrs): not a change. Reasons start with
    ``param group I: 'KEY'`` (the engine counts them per key).
    """
    adopt_assigned_lrs(opt, lr_tensors)
    groups = opt.param_groups
    if len(groups) != len(snapshot):
        return f"the optimizer now has {len(groups)} param groups instead of {len(snapshot)}"
    for i, (g, snap) in enumerate(zip(groups, snapshot)):
        if len(g) != len(snap) + 1:  # +1: 'params'
            added = sorted(set(g) - set(snap) - {"params"})
            if added:
                return f"param group {i}: '{added[0]}' was added"
        for k, v in snap.items():
            cur = g.get(k)
            if cur is v:
                continue
            where = where_set(opt, i, k)
            at = f" (set at {where})" if where else ""
            if isinstance(v, torch.Tensor) or isinstance(cur, torch.Tensor):
                return f"param group {i}: '{k}' was replaced by another object{at}"
            if not _same(cur, v):
                return f"param group {i}: '{k}' changed from {v!r} to {cur!r}{at}"
    return None
