"""torch.compile inside the graph: ``wrap(model, optimizer, compile=True)``.

pygraph_dist compiles the module's call itself (``torch.compile(module)``, kept
beside the module: ``model.module`` and the ``state_dict`` keys stay those of
the uncompiled module) in a mode that emits no CUDA graphs of its own; its
inductor kernels then run inside pygraph_dist's graphs like any others.

Three things make a compiled module safe to capture, and are handled here:

* CUDA graphs of its own (``mode="reduce-overhead"``, ``max-autotune``,
  ``options={"triton.cudagraphs": True}``, or the process-wide
  ``torch._inductor.config.triton.cudagraphs = True``) cannot run inside another capture:
  ``compile=`` switches them off with a warning; a module the user compiled
  that way is refused with the change to make.
* AOTAutograd's *donated buffers* (saved activations the compiled backward may
  overwrite) forbid ``backward(retain_graph=True)``, which tier 2 uses to
  capture its backward variants: ``torch._functorch.config.donated_buffer``
  is set to False when a compiled module is wrapped, until ``pgd.shutdown()``
  (``patches.disable_donated_buffers``: why it cannot be narrowed to the compile).
* Compile time: dynamo's compile callbacks time every compilation
  (recompilations for new input shapes included) for ``report()``.
"""

from __future__ import annotations

import threading
import time
import warnings
from dataclasses import dataclass

import torch

from ..runtime import patches

COMPILE_KEYS = ("mode", "options", "dynamic", "fullgraph", "backend")
_CUDAGRAPH_MODES = {"reduce-overhead": None, "max-autotune": "max-autotune-no-cudagraphs"}


def compile_kwargs(spec) -> dict | None:
    """``torch.compile`` keyword arguments from ``wrap(compile=...)``: None when
    off. Modes and options that add CUDA graphs of torch's own are switched to
    their graph-free counterparts, with a warning that says so."""
    if spec is None or spec is False:
        return None
    if spec is True:
        spec = {}
    if not isinstance(spec, dict):
        raise TypeError(f"compile={spec!r}: pass True, or a dict of torch.compile arguments "
                        f"({', '.join(COMPILE_KEYS)}), e.g. compile={{'mode': 'max-autotune-no-cudagraphs'}}")
    unknown = sorted(set(spec) - set(COMPILE_KEYS))
    if unknown:
        raise TypeError(f"compile={{...}} got {', '.join(map(repr, unknown))}: the arguments taken are "
                        f"those of torch.compile: {', '.join(COMPILE_KEYS)}")
    kw = dict(spec)
    if kw.get("backend") == "cudagraphs":
        raise ValueError("compile={'backend': 'cudagraphs'} records CUDA graphs of torch.compile's own, which "
                         "cannot run inside pygraph_dist's graph: use the default backend (inductor).")
    mode = kw.get("mode")
    if mode in _CUDAGRAPH_MODES:
        new = _CUDAGRAPH_MODES[mode]
        warnings.warn(
            f"wrap(compile={{'mode': {mode!r}}}): that mode records CUDA graphs of torch.compile's own, "
            f"which cannot run inside pygraph_dist's graph (it already captures the whole iteration); "
            f"compiling with mode={new!r} instead.", UserWarning, stacklevel=3)
        if new is None:
            kw.pop("mode")
        else:
            kw["mode"] = new
    options = kw.get("options") or {}
    if options.get("triton.cudagraphs", _global_cudagraphs()):
        if "triton.cudagraphs" in options:
            why = "wrap(compile={'options': {'triton.cudagraphs': True}}): CUDA graphs of torch.compile's own"
        else:
            why = ("wrap(compile=...): torch._inductor.config.triton.cudagraphs is True in this process, "
                   "and CUDA graphs of torch.compile's own")
        warnings.warn(f"{why} cannot run inside pygraph_dist's graph; compiling this module with "
                      "options={'triton.cudagraphs': False} (a process-wide setting stays as it is).",
                      UserWarning, stacklevel=3)
        kw["options"] = {**options, "triton.cudagraphs": False}
    return kw


def _global_cudagraphs() -> bool:
    """``torch._inductor.config.triton.cudagraphs``: what a compilation that
    does not say otherwise uses (set by the user, or by a recipe they import)."""
    return patches.inductor_cudagraphs()


def _compiler_config(module: torch.nn.Module) -> dict | None:
    """The inductor configuration a compiled module was compiled with, or None
    when it is not compiled (or its backend says nothing)."""
    ctx = getattr(module, "dynamo_ctx", None)  # torch.compile(module) -> OptimizedModule
    if ctx is not None:
        return getattr(ctx, "compiler_config", None) or {}
    impl = getattr(module, "_compiled_call_impl", None)  # module.compile() in place
    if impl is not None:
        get = getattr(impl, "get_compiler_config", None)
        return (get() if callable(get) else None) or {}
    return None


def _compiled_parts(module: torch.nn.Module) -> list[tuple[str, torch.nn.Module, dict]]:
    """(name, submodule, compiler config) of the module and every submodule
    compiled by torch.compile(...) or .compile()."""
    out = []
    for name, m in module.named_modules():
        cfg = _compiler_config(m)
        if cfg is not None:
            out.append((name, m, cfg))
    return out


def is_compiled(module: torch.nn.Module) -> bool:
    """The module, or one of its submodules, is compiled."""
    return bool(_compiled_parts(module))


def check_compiled_module(module: torch.nn.Module, compile_spec) -> None:
    """A module compiled by the user (or with compiled submodules): refuse CUDA
    graphs of their own (and a second compilation through ``compile=``) with
    the change to make."""
    parts = _compiled_parts(module)
    if not parts:
        return
    name, part, cfg = next(((n, m, c) for n, m, c in parts if c.get("triton.cudagraphs")), parts[0])
    what = "model" if not name else f"model.{name}"
    how = (f"torch.compile({what}, ...)" if getattr(part, "dynamo_ctx", None) is not None
           else f"{what}.compile(...)")
    if compile_spec not in (None, False):
        raise ValueError(
            f"the model is already compiled ({how}) and wrap() was also given compile=...: pass the "
            "uncompiled model with compile=..., or the compiled one without it.")
    if cfg.get("triton.cudagraphs", _global_cudagraphs()):
        raise ValueError(
            f"the model{'' if not name else ' has a submodule that'} was compiled ({how}) with CUDA graphs of torch.compile's own "
            "(mode='reduce-overhead' or 'max-autotune', options={'triton.cudagraphs': True}, or "
            "torch._inductor.config.triton.cudagraphs = True with no option overriding it); they "
            "cannot run inside pygraph_dist's graph, which already captures the whole iteration. Pass "
            "the uncompiled model with wrap(..., compile=True) (or compile={'mode': "
            "'max-autotune-no-cudagraphs'}), or compile it in the default mode.")


def disable_donated_buffers() -> bool:
    """Turn AOTAutograd's donated buffers off for the process until
    ``pgd.shutdown()``: tier 2 captures its backward variants with
    ``retain_graph=True``, which a backward compiled with donated buffers
    refuses. Process-wide because on torch 2.11 (the GPU machine) a
    ``config.patch(donated_buffer=False)`` around the model call alone was not
    enough: the flag is also consulted when the backward runs, which for tier 2
    is the user's ``backward()`` (patches.py, ``functorch.donated_buffer``).
    Costs the compiled backward some memory reuse. True if it was on."""
    return patches.disable_donated_buffers()


# ------------------------------------------------------------ compile time
@dataclass
class CompileStats:
    """Compilations seen while an engine ran (dynamo's compile callbacks)."""

    compilations: int = 0     # dynamo frame compilations (graph breaks add some)
    backward: int = 0         # lazily compiled backward graphs
    seconds: float = 0.0      # wall time in compilation, backward included
    after_first: int = 0      # compilations after the engine's first iteration: recompiles
    # Dynamo's callbacks are process-wide: a compilation is booked to the wrapped
    # model that last ran a call (training or evaluation).


class _Timer:
    """Process-wide: dynamo's callbacks are global; each interval is booked to
    the engine that last ran a model call (``current``)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.handler = None  # dynamo's callback_handler, once imported
        self.current = None  # (CompileStats, is_first_iteration: callable) of the active engine
        self.started = 0.0

    def install(self) -> bool:
        """Register (again: ``torch._dynamo.reset()`` clears dynamo's callbacks).
        Called at every model call of a compiled model, so the registered case
        is one list lookup, without the lock or the import."""
        handler = self.handler
        if handler is not None and self._start in handler.start_callbacks:
            return True
        with self.lock:
            self.handler = patches.register_compile_callbacks(self._start, self._end)  # undone at shutdown
            return self.handler is not None

    def _start(self, *args) -> None:
        self.started = time.perf_counter()

    def _end(self, *args) -> None:
        cur = self.current
        if cur is None:
            return
        stats, first = cur
        trigger = getattr(args[0], "callback_trigger", None) if args else None
        name = getattr(trigger, "name", "")
        stats.seconds += time.perf_counter() - self.started
        if name == "LAZY_BACKWARD":
            stats.backward += 1
        elif name in ("", "DYNAMO"):
            stats.compilations += 1
            if not first():
                stats.after_first += 1


TIMER = _Timer()


def describe(kw: dict | None, stats: CompileStats, user_compiled: bool) -> str:
    """The report's compile line ('' when nothing is compiled)."""
    if kw is None and not user_compiled:
        return ""
    what = "compiled by the user" if kw is None else (
        "torch.compile(" + ", ".join(f"{k}={v!r}" for k, v in kw.items()) + ")" if kw else "torch.compile()")
    line = (f"{what}: {stats.compilations} compilation(s)"
            + (f" + {stats.backward} backward" if stats.backward else "")
            + f", {stats.seconds:.1f} s")
    if stats.after_first:
        line += (f"; {stats.after_first} after the first iteration (recompiles: new input shapes, "
                 "eval or no_grad calls, failed guards; TORCH_LOGS=recompiles says which)")
    return line
