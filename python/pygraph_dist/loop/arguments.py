"""Python values among the model call's arguments.

A graph bakes in every Python value its forward read, so an input signature
holds the value of every non-tensor argument (``graph_cache.py``): a call with
another value is another signature, with its own warm-up and capture. An
argument that changes on every call -- Lightning's ``training_step(batch,
batch_idx)``, a step counter -- therefore never reaches a graph. Two things
here:

* :class:`VaryingScalars` notices it (three different values of one argument
  in calls whose tensors match) so that the engine can say which argument,
  and what to do, once;
* :class:`IgnoredArgs` is ``wrap(..., ignore_args=("batch_idx",))``: those
  arguments leave the signature, and calls that differ only in them share a
  graph. That is right only if the forward does not read them, so while the
  loop is probed their values reach the forward as watched stand-ins (int and
  float subclasses): any use -- arithmetic, comparison, formatting, hashing,
  truth value, a torch call that receives one -- is recorded with the line
  that did it, and the probe's verdict (agreed by all ranks) then keeps the
  loop eager, naming that line. Not watched under ``compile=``, whose tracing
  would see the stand-ins.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

from .monitor import user_location


class _Ignored:
    """Stands for an ignored argument's value in a signature."""

    _instance = None

    def __new__(cls):
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "<ignored>"

    def __reduce__(self):
        return (_Ignored, ())


IGNORED = _Ignored()

_NUMBER_DUNDERS = (
    "__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__", "__truediv__", "__rtruediv__",
    "__floordiv__", "__rfloordiv__", "__mod__", "__rmod__", "__divmod__", "__rdivmod__", "__pow__",
    "__rpow__", "__neg__", "__pos__", "__abs__", "__eq__", "__ne__", "__lt__", "__le__", "__gt__", "__ge__",
    "__hash__", "__bool__", "__int__", "__float__", "__format__", "__str__", "__repr__", "__round__",
    "__trunc__", "__floor__", "__ceil__",
)
_INT_DUNDERS = _NUMBER_DUNDERS + (
    "__index__", "__invert__", "__lshift__", "__rlshift__", "__rshift__", "__rrshift__", "__and__",
    "__rand__", "__or__", "__ror__", "__xor__", "__rxor__",
)


def _watched_type(base: type, dunders: tuple[str, ...]) -> type:
    def make(name: str, original: Callable):
        def method(self, *args, **kwargs):
            watcher = self.__dict__.get("_pgd_watcher")
            if watcher is not None:
                watcher.used(self.__dict__["_pgd_name"], name)
            return original(self, *args, **kwargs)
        method.__name__ = name
        return method

    namespace = {name: make(name, getattr(base, name)) for name in dunders if hasattr(base, name)}
    return type(f"Watched{base.__name__.capitalize()}", (base,), namespace)


_WatchedInt = _watched_type(int, _INT_DUNDERS)
_WatchedFloat = _watched_type(float, _NUMBER_DUNDERS)
_WATCHED = (_WatchedInt, _WatchedFloat)


class _Watcher(TorchFunctionMode):
    """Collects uses of the stand-ins; as a torch-function mode, also the torch
    calls that receive one (which read the number without a Python method)."""

    _pgd_mode = True  # monitor.remove_from_under_own_modes

    def __init__(self) -> None:
        super().__init__()
        self.uses: list[tuple[str, str, str]] = []  # (argument, how, where)
        self.on = True

    def used(self, name: str, how: str) -> None:
        if self.on and not any(n == name for n, _, _ in self.uses):
            self.uses.append((name, how.strip("_") if how.startswith("__") else how, user_location()))

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.on:
            for leaf in pytree.tree_leaves((args, kwargs)):
                if type(leaf) in _WATCHED:
                    self.used(leaf.__dict__["_pgd_name"], f"passed to {getattr(func, '__name__', 'a torch call')}")
        return func(*args, **kwargs)


def _forward_of(module: torch.nn.Module) -> Callable:
    """The forward whose parameters name the call's arguments (a module compiled
    by ``torch.compile`` forwards ``*args, **kwargs`` to the original's)."""
    return getattr(module, "_orig_mod", module).forward


class IgnoredArgs:
    """``wrap(..., ignore_args=names)``: arguments of the model call left out of
    the input signature, by name (positional arguments are matched through the
    signature of the module's ``forward``)."""

    def __init__(self, names: tuple[str, ...], module: torch.nn.Module,
                 forward: Callable | None = None) -> None:
        """``forward``: the function the model call really runs, when it is not
        ``module.forward`` -- Lightning's strategy calls ``training_step(batch,
        batch_idx)`` through the wrapper, so positions are read from it."""
        self.names = tuple(names)
        self.positions: dict[int, str] = {}
        self.forward = forward
        try:
            params = list(inspect.signature(forward or _forward_of(module)).parameters.values())
        except (TypeError, ValueError):  # no signature to read: keyword arguments only
            params = []
        positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        takes_any_keyword = any(p.kind is p.VAR_KEYWORD for p in params)
        for name in self.names:
            index = next((i for i, p in enumerate(positional) if p.name == name), None)
            if index is not None:
                self.positions[index] = name
            elif not takes_any_keyword and not any(p.name == name for p in params):
                raise ValueError(
                    f"ignore_args names {name!r}, which "
                    f"{getattr(forward, '__qualname__', None) or type(getattr(module, '_orig_mod', module)).__name__ + '.forward'} does not take "
                    f"(its arguments: {', '.join(p.name for p in params) or 'none'}).")

    def __bool__(self) -> bool:
        return bool(self.names)

    def _named(self, args: tuple, kwargs: dict):
        for i, name in self.positions.items():
            if i < len(args):
                yield name, args[i]
        for name in self.names:
            if name in kwargs:
                yield name, kwargs[name]

    def mask(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """``(args, kwargs)`` with every ignored argument replaced by IGNORED, for the signature."""
        for name, value in self._named(args, kwargs):
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(
                    f"ignore_args: {name!r} was passed a {type(value).__name__}; only int and float "
                    "arguments can be left out of the signature (tensors are the graph's inputs, "
                    "and other values decide what the forward does). Remove it from ignore_args.")
        args = tuple(IGNORED if i in self.positions else a for i, a in enumerate(args))
        kwargs = {k: IGNORED if k in self.names else v for k, v in kwargs.items()}
        return args, kwargs

    def signature(self, args: tuple, kwargs: dict, leaves: list, spec) -> tuple[list, object]:
        """The leaves and structure a call's signature is made of: the call's own
        (``leaves``, ``spec``), with the ignored values masked (each is one leaf,
        so the positions of the tensors do not move)."""
        if not self.names:
            return leaves, spec
        return pytree.tree_flatten(self.mask(args, kwargs))

    def watch(self, args: tuple, kwargs: dict) -> tuple[tuple, dict, _Watcher]:
        """``(args, kwargs)`` with stand-ins that report their uses to the returned watcher."""
        watcher = _Watcher()

        def stand_in(name, value):
            kind = _WatchedFloat if isinstance(value, float) else _WatchedInt
            obj = kind(value)
            obj.__dict__.update(_pgd_watcher=watcher, _pgd_name=name)
            return obj

        args = tuple(stand_in(self.positions[i], a) if i in self.positions else a for i, a in enumerate(args))
        kwargs = {k: stand_in(k, v) if k in self.names else v for k, v in kwargs.items()}
        return args, kwargs, watcher


class VaryingScalars:
    """Which non-tensor leaves of the call take many values while the tensors
    stay the same (each value is a signature of its own)."""

    THRESHOLD = 3

    def __init__(self) -> None:
        self._values: dict[tuple, set] = {}
        self.reported: set[tuple] = set()

    def new_signature(self, leaf_keys: tuple, spec, extra: tuple) -> list[int]:
        """Leaf positions that have just reached THRESHOLD distinct values."""
        tensors = tuple(k if k[0] == "T" else None for k in leaf_keys)
        out = []
        for i, k in enumerate(leaf_keys):
            if k[0] != "V":
                continue
            slot = (spec, tensors, extra, i)
            values = self._values.setdefault(slot, set())
            if len(values) < self.THRESHOLD:
                values.add(k)
                if len(values) == self.THRESHOLD and slot not in self.reported:
                    self.reported.add(slot)
                    out.append(i)
        return out


def leaf_name(module: torch.nn.Module, leaves: list, spec, index: int) -> str:
    """The model-call argument that holds leaf ``index``: ``'batch_idx'`` or ``'args[1]'``."""
    paths, _ = pytree.tree_flatten_with_path(pytree.tree_unflatten(leaves, spec))
    path = paths[index][0]
    if not path:
        return "an argument"
    top = path[0]
    try:
        positional = [p.name for p in inspect.signature(_forward_of(module)).parameters.values()
                      if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        positional = []
    rest = "".join(str(k) for k in path[2:])
    if getattr(top, "idx", None) == 0 and len(path) > 1:  # (args, kwargs)[0]: positional
        i = path[1].idx
        name = positional[i] if i < len(positional) else f"args[{i}]"
        return f"{name!r}{rest}" if i < len(positional) else f"{name}{rest}"
    if getattr(top, "idx", None) == 1 and len(path) > 1:  # keyword
        return f"{path[1].key!r}{rest}"
    return "an argument"


def varying_detail(name: str) -> str:
    """What the engine says once argument ``name`` of the model call has taken
    :attr:`VaryingScalars.THRESHOLD` values with the same tensor shapes."""
    nested = name.endswith("]")  # a value inside a container argument: batch['step']
    fix = ("ignore_args takes whole arguments: pass it as an argument of its own, or as a tensor, "
           "or leave it out of the call" if nested else
           f"if the forward does not use it (like Lightning's batch_idx), pass "
           f"wrap(..., ignore_args=[{name}]); if it does, pass it as a tensor or leave it out "
           "of the call")
    return (f"argument {name} of the model call has taken {VaryingScalars.THRESHOLD} different "
            "values in calls with the same tensor shapes: graphs are captured per value of a "
            "Python argument (the forward may read it), so calls with a new value run eagerly; "
            + fix)
