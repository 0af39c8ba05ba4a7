"""``self.log`` inside a graphed ``training_step``: the logged values keep flowing.

On a graph replay the Python of ``training_step`` does not run, so neither do
its ``self.log(...)`` calls. The strategy therefore routes every call of a
step method through :class:`LoggedCalls`:

* while the method's body runs, ``self.log`` (and ``log_dict``, which calls
  it) only *records* the call -- name, value, keyword arguments. Lightning's
  own bookkeeping (``value.clone()``, ``sync_dist`` all-reduces, epoch sums)
  must not be recorded into a CUDA graph, and it must happen once per step;
* after the wrapped model call returns, the calls recorded by the body's last
  run are issued to Lightning (``LightningModule.log``), in order, in the same
  hook (``_current_fx_name`` is still ``training_step``);
* a body run while a CUDA graph was being captured holds tensors that the
  graph writes on every replay (allocated in its pool; we keep them alive, so
  their memory is never reused). They are kept per call signature, and after
  a call in which the body did not run -- a replay -- those calls are issued
  again with fresh copies of those tensors. The copies are made on the current
  stream, which the engine orders after the replay and before the next one.

A logged Python number or other object computed inside ``training_step`` is
re-issued as captured (a replay cannot recompute it); the first such value is
warned about, naming it.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.utils._pytree as pytree

logger = logging.getLogger("pygraph_dist")


@dataclass
class _Run:
    calls: list[tuple[str, Any, dict]] = field(default_factory=list)
    captured: bool = False  # some call was made while a CUDA graph was being captured


class LoggedCalls:
    """Records ``self.log`` calls of step methods and issues them to Lightning."""

    def __init__(self, log: Callable[..., None]) -> None:
        self._log = log  # the unbound LightningModule.log
        self._signature = inspect.signature(log)
        self._run: _Run | None = None  # the body's last run in the current model call
        self._graphed: dict[tuple, list[tuple[str, Any, dict]]] = {}  # signature -> calls
        self._warned: set[str] = set()
        self.reissued = 0  # calls issued again after replays (for tests and reports)

    @contextlib.contextmanager
    def recording(self, module: torch.nn.Module):
        """Around one run of a step method's body: ``module.log`` records."""
        run = _Run()
        self._run = run

        def log(name: str, value: Any, *args: Any, **kwargs: Any) -> None:
            if args:  # options passed by position: named, as LightningModule.log takes them
                bound = self._signature.bind(module, name, value, *args, **kwargs).arguments
                kwargs = {k: v for k, v in list(bound.items())[3:]}  # after (self, name, value)
            if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                run.captured = True
            run.calls.append((name, value, kwargs))

        had = "log" in module.__dict__
        previous = module.__dict__.get("log")
        module.__dict__["log"] = log
        try:
            yield
        finally:
            if had:
                module.__dict__["log"] = previous
            else:
                module.__dict__.pop("log", None)

    def begin_call(self) -> None:
        self._run = None

    def end_call(self, module: torch.nn.Module, key: tuple) -> None:
        """After the wrapped model call: issue what its body logged, or -- when
        its body did not run (a replay) -- what the captured body logged."""
        run, self._run = self._run, None
        if run is not None:
            if run.captured:
                self._graphed[key] = run.calls
            for name, value, kwargs in run.calls:
                self._log(module, name, _fresh(value) if run.captured else value, **kwargs)
            return
        calls = self._graphed.get(key)
        if not calls:
            return
        for name, value, kwargs in calls:
            if not isinstance(value, torch.Tensor) and name not in self._warned:
                self._warned.add(name)
                logger.warning(
                    "self.log(%r, ...) in a graphed step logs a %s computed in Python; graph replays "
                    "do not run the step's Python, so the value captured is logged again on every "
                    "replay. Log a tensor (or compute the value outside the step, e.g. in "
                    "on_train_batch_end) to see it change.", name, type(value).__name__)
            self._log(module, name, _fresh(value), **kwargs)
            self.reissued += 1

    def forget(self) -> None:
        """Drop the captured tensors (teardown: the graphs are gone)."""
        self._graphed.clear()
        self._run = None


def _fresh(value: Any) -> Any:
    """A copy of the graph's tensors that the next replay will not overwrite."""
    return pytree.tree_map(lambda t: t.detach().clone() if isinstance(t, torch.Tensor) else t, value)


def call_key(method: str, args: tuple, kwargs: dict, ignored: set[int]) -> tuple:
    """What tells the graphs of a step method apart: tensor shapes, dtypes and
    devices, and the other values except the arguments left out of the
    signature (``batch_idx``) -- the engine's own signature, near enough: a
    call it graphs separately is never matched to another's logged values."""
    parts: list = [method]
    positional = [a for i, a in enumerate(args) if i not in ignored]
    for leaf in pytree.tree_leaves((positional, kwargs)):
        if isinstance(leaf, torch.Tensor):
            parts.append((tuple(leaf.shape), leaf.dtype, str(leaf.device)))
        else:
            try:
                hash(leaf)
                parts.append(leaf)
            except TypeError:
                parts.append(type(leaf).__name__)
    return tuple(parts)
