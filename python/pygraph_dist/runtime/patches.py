"""Every change pygraph_dist makes to code it does not own, and every read of
torch's private state: :data:`REGISTRY` says what each changes, the torch or
NCCL behaviour that forces it, the versions checked and its undo. No other
module assigns torch's module or class attributes, swaps a ``__class__``,
rebinds other modules' globals, sets warning filters (outside ``catch_warnings``), torch flags or environment
variables, or reads :data:`PRIVATE_NAMES` (``tests/python/test_patches.py``).
Scopes: ``process`` (applied at ``wrap()`` or when first needed, undone newest
first by :func:`undo_all` at ``pgd.shutdown()``), ``region`` (one block: a capture,
a host session), ``object`` (one of the user's objects), ``read`` (an accessor
that raises :class:`PrivateAPIMissing`, which callers fall back on).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import sys
import threading
import types
import warnings
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

CHECKED = "torch 2.11.0+cu130 (GPU), 2.13.0+cpu"


@dataclasses.dataclass(frozen=True)
class Patch:
    """One change to code we do not own (or one private read)."""
    key: str
    scope: str       # "process", "region", "object" or "read" (module docstring)
    changes: str     # what is changed or read
    why: str         # the torch / NCCL behaviour that forces it, with its upstream source
    undo: str        # how it is undone ("" for a read)
    sites: str       # where in pygraph_dist it is used
    public_hook: str = ""  # a public API that might replace it, not verified on GPU
    checked: str = CHECKED


# Attributes only this module may touch (test_patches.py looks for them elsewhere; dotted: a suffix).
PRIVATE_NAMES = frozenset({
    "_get_backend", "options._timeout", "_set_sequence_number_for_group", "_set_default_backend",
    "_distributed_c10d", "_len_torch_function_stack", "_get_function_stack_at", "_pop_torch_function_stack",
    "_push_on_torch_function_stack", "_len_torch_dispatch_stack", "_cuda_getCurrentStream", "_cuda_getDevice",
    "donated_buffer", "callback_handler", "_inductor", "_functorch", "HigherOrderOperator",
    "_per_optimizer_states", "_refresh_per_optimizer_state", "_step_supports_amp_scaling",
    "set_sync_debug_mode", "_device_constructors"})

REGISTRY: dict[str, Patch] = {p.key: p for p in (
    Patch("clip_grad_norm_", "process",
          "torch.nn.utils(.clip_grad).clip_grad_norm_ become clip_route.clip_grad_norm_; at every wrap() also "
          "each global that is torch's function, in loaded modules (not torch's or ours) and wrap()'s callers",
          "a tier-1 graph has stepped at the model call, so the loop's own clip must be routed into it "
          "(issue 26); torch/nn/utils/clip_grad.py calls no hook. `from torch.nn.utils import "
          "clip_grad_norm_` before wrap() binds a name a module-attribute swap misses",
          "torch's function set back on both modules and in every name rebound that is still ours",
          "clip_route.install", "none: a TorchFunctionMode sees the norm's kernels, not the call"),
    Patch("ProcessGroup.shutdown", "process",
          "torch.distributed.ProcessGroup.shutdown: a hook releases the graphs on that group, then calls torch's",
          "NCCL >= 2.26's ncclCommDestroy waits for graphs that reference the communicator (pytorch#115388); "
          "from torch 2.9 every destroy path calls pg.shutdown() (torch/distributed/distributed_c10d.py)",
          "the class's stored attribute set back (pybind11's instancemethod: the bare builtin does not bind "
          "self, d69658d), deleted if inherited", "lifetime.install / uninstall",
          "none: a rebound dist.destroy_process_group missed names imported before wrap() (8a152a3)"),
    Patch("signal.wakeup_fd", "process",
          "signal.set_wakeup_fd(the write end of a pipe of ours), where no wakeup fd was set (asyncio's "
          "loop sets its own while it runs, then puts ours back); the extension reads the signal numbers",
          "a rank whose main thread waits in a CUDA call for a replayed collective that an interrupted peer "
          "never launched cannot raise KeyboardInterrupt: the replay watchdog learns of the Ctrl-C this "
          "way and aborts the communicator (2xH200: 4 of 8 sigint runs waited 24 s or more). Python's C "
          "signal handler writes each signal's number to the wakeup fd (Modules/signalmodule.c)",
          "set_wakeup_fd(-1), if ours is still the one set; the pipe and its reader live on, idle",
          "lifetime.install", "none: the wakeup fd is the public way to learn of a signal outside Python"),
    Patch("functorch.donated_buffer", "process",
          "torch._functorch.config.donated_buffer = False once a compiled model is wrapped",
          "tier 2 captures the compiled backward with retain_graph=True, which donated buffers refuse. Read "
          "when AOTAutograd compiles (torch/_functorch/_aot_autograd/graph_compile.py, bw_donated_idxs) and "
          "at every backward (runtime_wrappers.py, _backward_impl: idxs None when compiled with it off), "
          "i.e. in the user's loss.backward(): a patch around the model call alone failed on torch 2.11",
          "the value found set back, if the flag is still False", "wiring.build_parts",
          "config.patch(donated_buffer=False) around every compile and backward (unverified)"),
    Patch("dynamo.compile_callbacks", "process",
          "compiled._Timer's callbacks registered with torch._dynamo.callback.callback_handler",
          "compile time for report(); dynamo's callbacks are process-wide and torch._dynamo.reset() "
          "clears them (torch/_dynamo/callback.py)", "removed from the handler", "compiled._Timer.install"),
    Patch("cuda.rng_state_calls", "region",
          "torch.cuda(.random).get_rng_state/set_rng_state refuse to run while the stream captures",
          "a graph records neither host copy; torch/utils/checkpoint.py saves and restores the state, so "
          "recomputed dropout would draw other masks", "set back as stored when the capture ends",
          "capture_guard.capture_into"),
    Patch("host_tensor_factories", "region",
          "torch.tensor, torch.as_tensor, torch.Tensor.new_tensor build on the host and copy, and "
          "Tensor.__getitem__/__setitem__ index with host tensors for integer lists, in a host session",
          "a host tensor made in forward reaches the device by a copy a graph replays with old values "
          "(host_copies.py); the factories and list indices (torch/csrc/autograd/python_variable_indexing.cpp"
          ", sequenceToVariable) build on the device out of a dispatch mode's sight",
          "set back as stored (new_tensor, __getitem__, __setitem__, inherited from TensorBase, deleted)",
          "host_session._patch"),
    Patch("transformers_capture_branch", "region",
          "transformers.utils.import_utils.is_cuda_stream_capturing answers True on the thread of a host "
          "session (host_session.py), when transformers is loaded",
          "transformers' is_tracing() chooses another branch under stream capture: eagerly it skips an "
          "all-ones attention mask after a host read, captured it builds the mask with a host tensor "
          "(masking_utils.py, eager_mask: torch.tensor(0.0, device=...)); a warm-up must run what the "
          "capture runs to record that copy (transformers 5.17, 5.24)",
          "set back as stored when the last session ends", "host_session._patch"),
    Patch("warnings.sync_debug", "region",
          "torch.cuda.set_sync_debug_mode('warn'), warnings.simplefilter('always') in catch_warnings",
          "a CUDA probe names the lines that sync the host in the capture failure",
          "the previous mode and filters set back", "monitor.watch_host_syncs"),
    Patch("warnings.empty_graph", "region",
          "warnings.filterwarnings('ignore', 'The CUDA Graph is empty') around capture_end",
          "a capture failed at its first op, or a kernel-less evaluation forward (torch/cuda/graphs.py)",
          "catch_warnings restores the filters", "capture_guard._QuietWhenEmpty"),
    Patch("env.OMPI_MCA_plm_rsh_agent", "region",
          "OMPI_MCA_plm_rsh_agent=false in os.environ around `from mpi4py import MPI`",
          "Open MPI's singleton MPI_Init starts a daemon that fails without ssh/rsh",
          "popped after the import", "launch_env._mpi_comm"),
    Patch("optimizer.__class__", "object",
          "the user's optimizer's class becomes a GraphedOptimizerMixin subclass; for fp16 "
          "_step_supports_amp_scaling = True; an LR scheduler's instance step re-made",
          "step() is a no-op in a graphed iteration and state_dict stores float lrs; torch's LRScheduler "
          "wraps the instance's step (torch/optim/lr_scheduler.py, patch_track_step_called: "
          "optim._repatch_scheduler_step); GradScaler reads the flag (torch/amp/grad_scaler.py)",
          "none at shutdown(), on purpose: the param groups keep device-tensor lrs the subclass still "
          "saves as floats; with no engine each call is the original class's", "optim"),
    Patch("accelerate.Accelerator.__class__", "object",
          "the Trainer's Accelerator's class becomes PGDAccelerator",
          "transformers' Trainer builds its Accelerator itself (create_accelerator_and_postprocess)",
          "none: the Trainer owns it", "integrations/hf.py"),
    Patch("GradScaler._per_optimizer_states", "object", "the engine's GradScaler's round state reset",
          "a failed capture leaves a round's stage and found_inf behind (torch/amp/grad_scaler.py)",
          "none: a fresh round", "step.reset_grad_scaler_round"),
    Patch("c10d.backend_internals", "read",
          "ProcessGroup._get_backend, _set_default_backend (written), options._timeout (read; written on "
          "NCCL's Options), _set_sequence_number_for_group, torch._C._distributed_c10d's option classes",
          "backends are built as _new_process_group_helper builds them (distributed_c10d.py); the replay "
          "watchdog's default is the group's timeout", "", "backend.py, wiring, collectives.py"),
    Patch("torch_function_stack", "read",
          "torch._C's torch-function stack (length, item, pop, push) and dispatch stack length",
          "a mode under another of ours is taken out, not left inert for good (the stack is C++'s)",
          "", "monitor.py, split_clip.py"),
    Patch("cuda.current_stream_key", "read", "torch._C._cuda_getCurrentStream(torch._C._cuda_getDevice())",
          "tier 2 compares the current stream per call without building a Stream", "", "split.py",
          "torch.cuda.current_stream() (a Python object per call)"),
    Patch("device_constructors", "read",
          "torch.utils._device._device_constructors() called once before a host session patches torch.tensor",
          "torch.set_default_device's mode recognises factories by identity, from a set it builds on first use "
          "(functools.lru_cache); built while torch.tensor is host_session's function, the set would hold "
          "that function and torch's own torch.tensor would ignore the default device for good",
          "", "host_session._patch"),
    Patch("compile_internals", "read", "torch._inductor.config.triton.cudagraphs, torch._ops.HigherOrderOperator",
          "a process-wide inductor setting decides whether compile= switches graphs off; a host session "
          "cannot follow a higher-order op's body", "", "compiled.py, host_session.py"),
)}


class PrivateAPIMissing(RuntimeError):
    """torch lacks a private attribute pygraph_dist reads (a torch newer than those checked)."""

    def __init__(self, what: str) -> None:
        super().__init__(f"pygraph_dist: torch {torch.__version__} has no {what} (checked on {CHECKED}); "
                         "pygraph_dist falls back where it can, but needs an update for this torch")


# ----------------------------------------------------------- the mechanism
_ABSENT = object()
_lock = threading.RLock()
_undo: dict[str, Callable[[], None]] = {}  # process-scope patches applied, in order


class Swap:
    """Attributes of modules or classes replaced now; :meth:`undo` puts back what the owner
    stored (deletes an inherited one), unless someone replaced ours meanwhile."""

    def __init__(self, key: str, sites: list[tuple[Any, str, Any]]) -> None:
        assert key in REGISTRY, key
        self.saved = []
        for owner, name, value in sites:
            self.saved.append((owner, name, vars(owner).get(name, _ABSENT), value))
            setattr(owner, name, value)

    def undo(self) -> None:
        for owner, name, stored, value in reversed(self.saved):
            if vars(owner).get(name, _ABSENT) is not value:
                continue
            if stored is _ABSENT:
                delattr(owner, name)
            else:
                setattr(owner, name, stored)
        self.saved = []


def _record(key: str, undo: Callable[[], None]) -> None:
    assert REGISTRY[key].scope == "process", key
    _undo[key] = undo


def applied() -> list[str]:
    return list(_undo)  # the process-scope patches in place, in the order applied


def undo(key: str) -> None:
    """Undo one process-scope patch (nothing if it is not applied)."""
    with _lock:
        fn = _undo.pop(key, None)
    if fn is not None:
        fn()


def undo_all() -> None:
    """Undo every process-scope patch, newest first; a failing one is logged (``pgd.shutdown()``)."""
    for key in reversed(applied()):
        try:
            undo(key)
        except Exception as e:  # noqa: BLE001 - shutdown must finish
            logging.getLogger(__name__).warning("pygraph_dist: could not undo patch %r: %r", key, e)


# ----------------------------------------------- clip_grad_norm_ (process)
TORCH_CLIP_GRAD_NORM = torch.nn.utils.clip_grad_norm_
_CLIP_MODULES = (torch.nn.utils, torch.nn.utils.clip_grad)
_OWN = ("pygraph_dist", "torch")  # packages whose names are left as they are
_MODULE_DICT = types.ModuleType.__dict__["__dict__"]
_rebound: list[tuple[dict, str, Any]] = []


def own_package(name) -> bool:
    return any(str(name) == p or str(name).startswith(p + ".") for p in _OWN)


def route_clip_grad_norm(router: Callable) -> list[str]:
    """``router`` in place of torch's ``clip_grad_norm_`` on torch's modules (once), and of every
    name bound to torch's function in a loaded module or in the callers' frame globals (every
    call). Returns the names rebound now."""
    with _lock:
        if "clip_grad_norm_" not in _undo:
            swap = Swap("clip_grad_norm_", [(m, "clip_grad_norm_", router) for m in _CLIP_MODULES
                                            if getattr(m, "clip_grad_norm_", None) is TORCH_CLIP_GRAD_NORM])
            _record("clip_grad_norm_", lambda: (swap.undo(), _unbind()))
        spaces = []
        for name, mod in list(sys.modules.items()):  # the script and the modules it imported
            if isinstance(mod, types.ModuleType) and not own_package(name):
                try:  # the module's own dict, past any __dict__ or __getattr__ of a module subclass
                    spaces.append(_MODULE_DICT.__get__(mod))
                except Exception:  # noqa: BLE001 - a module that cannot be read keeps its names
                    continue
        frame = sys._getframe(1)
        while frame is not None:  # the callers: the script, or the framework that wraps for it
            if not own_package(frame.f_globals.get("__name__", "")):
                spaces.append(frame.f_globals)
            frame = frame.f_back
        return rebind_clip_names(spaces, router)


def rebind_clip_names(spaces: list[dict], router: Callable) -> list[str]:
    """Every global of ``spaces`` that is torch's ``clip_grad_norm_`` becomes ``router``."""
    names, seen = [], set()
    for space in spaces:
        if id(space) in seen:
            continue
        seen.add(id(space))
        for name, value in list(space.items()):
            if value is TORCH_CLIP_GRAD_NORM:
                space[name] = router
                _rebound.append((space, name, router))
                names.append(f"{space.get('__name__', '?')}.{name}")
    return names


def _unbind() -> None:
    for space, name, router in _rebound:
        if space.get(name) is router:
            space[name] = TORCH_CLIP_GRAD_NORM
    _rebound.clear()


# ----------------------------------------- ProcessGroup.shutdown (process)
def hook_process_group_shutdown(before: Callable[[Any], None], logger) -> None:
    """``before(group)`` runs ahead of every ``ProcessGroup.shutdown`` (once)."""
    with _lock:
        cls = dist.ProcessGroup
        original = cls.shutdown
        if "ProcessGroup.shutdown" in _undo or getattr(original, "_pgd_original", None) is not None:
            return

        def shutdown(self, *args, **kwargs):
            try:
                before(self)
            except Exception:  # noqa: BLE001 - never stand between the user and the group's shutdown
                logger.warning("releasing graphs before the process group's shutdown failed", exc_info=True)
            return original(self, *args, **kwargs)

        shutdown._pgd_original = original  # type: ignore[attr-defined]
        shutdown.__doc__ = getattr(original, "__doc__", None)
        shutdown.__name__ = "shutdown"
        swap = Swap("ProcessGroup.shutdown", [(cls, "shutdown", shutdown)])
        _record("ProcessGroup.shutdown", swap.undo)


def process_group_shutdown_hooked() -> bool:
    return getattr(dist.ProcessGroup.shutdown, "_pgd_original", None) is not None


# ------------------------------------------ signal.wakeup_fd (process)
_wakeup_pipe: tuple[int, int] | None = None


def watch_interrupt_signals(watch: Callable[[int], None]) -> bool:
    """Python's signal handler reports SIGINT/SIGTERM to ``watch(read_fd)``'s reader
    too (``signal.set_wakeup_fd``), until :func:`undo_all`. False, and nothing
    changed, off the main thread or where a wakeup fd is set already."""
    global _wakeup_pipe
    import signal

    with _lock:
        if "signal.wakeup_fd" in _undo:
            return True
        if threading.current_thread() is not threading.main_thread():
            return False
        if _wakeup_pipe is None:
            r, w = os.pipe()
            os.set_blocking(w, False)  # set_wakeup_fd requires it; a full pipe drops bytes, never blocks
            _wakeup_pipe = (r, w)
            watch(r)
        w = _wakeup_pipe[1]
        previous = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        if previous != -1:  # someone else's (asyncio's): theirs stays
            signal.set_wakeup_fd(previous)
            return False

        def undo() -> None:
            if threading.current_thread() is not threading.main_thread():
                return
            current = signal.set_wakeup_fd(-1)
            if current != w:  # replaced meanwhile: put theirs back
                signal.set_wakeup_fd(current)

        _record("signal.wakeup_fd", undo)
        return True


# -------------------------------------- compile= (process, and reads)
def disable_donated_buffers() -> bool:
    """AOTAutograd's donated buffers off until :func:`undo_all`; True if this turned them off."""
    try:
        import torch._functorch.config as functorch_config
    except ImportError:  # pragma: no cover - torch without functorch config
        return False
    with _lock:
        if not getattr(functorch_config, "donated_buffer", False):
            return False
        functorch_config.donated_buffer = False
        _record("functorch.donated_buffer", lambda: functorch_config.donated_buffer is False
                and setattr(functorch_config, "donated_buffer", True))
        return True


def register_compile_callbacks(start: Callable, end: Callable):
    """``start``/``end`` on dynamo's callback handler (returned; None without dynamo) until :func:`undo_all`."""
    try:
        from torch._dynamo.callback import callback_handler as handler
    except ImportError:
        return None
    with _lock:
        if start not in handler.start_callbacks:
            handler.register_start_callback(start)
            handler.register_end_callback(end)
        _record("dynamo.compile_callbacks", lambda: [cbs.remove(fn) for cbs, fn in (
            (handler.start_callbacks, start), (handler.end_callbacks, end)) if fn in cbs])
    return handler


def inductor_cudagraphs() -> bool:
    try:  # torch._inductor.config.triton.cudagraphs (False without inductor)
        from torch._inductor import config as inductor_config
    except ImportError:  # pragma: no cover - torch without inductor
        return False
    return bool(getattr(inductor_config.triton, "cudagraphs", False))


def is_higher_order_op(func) -> bool:
    return isinstance(func, torch._ops.HigherOrderOperator)


# ------------------------------------------------------ region-scoped
# (cuda.rng_state_calls and host_tensor_factories: a Swap at their site, undone as the block ends)
def settle_device_constructors() -> None:
    """torch's set of factories that follow the default device, built now from torch's
    own functions, before any is patched (registry ``device_constructors``)."""
    import torch.utils._device as device_module

    build = getattr(device_module, "_device_constructors", None)
    if build is not None:
        build()


def transformers_capture_branch(in_session: Callable[[], bool]) -> Swap | None:
    """transformers' capture check answers True where ``in_session()`` (registry
    ``transformers_capture_branch``); None when transformers is not loaded."""
    module = sys.modules.get("transformers.utils.import_utils")
    original = getattr(module, "is_cuda_stream_capturing", None)
    if original is None:
        return None

    def is_cuda_stream_capturing() -> bool:
        return in_session() or original()

    is_cuda_stream_capturing.__wrapped__ = original
    return Swap("transformers_capture_branch", [(module, "is_cuda_stream_capturing", is_cuda_stream_capturing)])


@contextlib.contextmanager
def sync_debug_warnings() -> Iterator[list]:
    """Host syncs warn inside (every warning caught, once each site); yields the caught list."""
    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield caught
        finally:
            torch.cuda.set_sync_debug_mode(previous)


@contextlib.contextmanager
def ignoring_warning(message: str) -> Iterator[None]:
    """Warnings matching ``message`` ignored inside (registry ``warnings.empty_graph``)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=message)
        yield


@contextlib.contextmanager
def open_mpi_without_agent(needed: bool) -> Iterator[None]:
    if needed:
        os.environ["OMPI_MCA_plm_rsh_agent"] = "false"
    try:
        yield
    finally:
        if needed:
            os.environ.pop("OMPI_MCA_plm_rsh_agent", None)


# ------------------------------------------------------- object-scoped
def swap_class(obj: Any, cls: type, key: str) -> None:
    """``obj.__class__ = cls`` (registry entry ``key``)."""
    assert REGISTRY[key].scope == "object", key
    obj.__class__ = cls


def mark_amp_scaling_step(opt: torch.optim.Optimizer) -> None:
    """What fused=True sets in torch's __init__: GradScaler hands the optimizer its scale."""
    opt._step_supports_amp_scaling = True


def reset_grad_scaler_round(scaler) -> None:
    from collections import defaultdict

    from torch.amp.grad_scaler import _refresh_per_optimizer_state

    scaler._per_optimizer_states = defaultdict(_refresh_per_optimizer_state)


# --------------------------------------------------------------- reads
def group_backend(group, device: torch.device):
    """``group._get_backend(device)``: the c10d backend serving ``device`` (PrivateAPIMissing
    only when torch lacks it; no group or not a group fails as the call does)."""
    if not hasattr(dist.ProcessGroup, "_get_backend"):
        raise PrivateAPIMissing("ProcessGroup._get_backend")
    return group._get_backend(device)


def backend_timeout_s(backend) -> float | None:
    """The timeout a backend was created with (its ``options._timeout``), or None."""
    timeout = getattr(getattr(backend, "options", None), "_timeout", None)
    return None if timeout is None else float(timeout.total_seconds())


def set_options_timeout(options, timeout) -> None:
    options._timeout = timeout  # what _new_process_group_helper sets


def set_sequence_number(backend) -> None:
    backend._set_sequence_number_for_group()  # what _new_process_group_helper calls


def set_default_backend_custom(group) -> None:
    """torch picks a multi-backend group's default type case-sensitively and misses ours."""
    try:
        group._set_default_backend(dist.ProcessGroup.BackendType.CUSTOM)
    except (AttributeError, RuntimeError):
        pass


def c10d_option_classes() -> tuple[type, type, type]:
    """(AllgatherOptions, AllreduceOptions, BroadcastOptions): torch.distributed exports no AllgatherOptions."""
    from torch._C import _distributed_c10d as c10d

    return c10d.AllgatherOptions, c10d.AllreduceOptions, c10d.BroadcastOptions


def _private(name: str):
    """``torch._C.<name>``, or a function that raises :class:`PrivateAPIMissing`."""
    found = getattr(torch._C, name, None)

    def missing(*_args, **_kwargs):
        raise PrivateAPIMissing(f"torch._C.{name}")

    return found if found is not None else missing


(_LEN_FN_STACK, _FN_STACK_AT, _POP_FN, _PUSH_FN, _LEN_DISPATCH_STACK, _CURRENT_STREAM, _CURRENT_DEVICE) = map(
    _private, ("_len_torch_function_stack", "_get_function_stack_at", "_pop_torch_function_stack",
               "_push_on_torch_function_stack", "_len_torch_dispatch_stack", "_cuda_getCurrentStream",
               "_cuda_getDevice"))


def function_modes() -> list:
    """The torch-function mode stack, outermost first."""
    return [_FN_STACK_AT(i) for i in range(_LEN_FN_STACK())]


def top_function_mode():
    """The innermost torch-function mode, or None."""
    n = _LEN_FN_STACK()
    return _FN_STACK_AT(n - 1) if n else None


def restack_function_modes(pop: int, push: list) -> None:
    """Pop ``pop`` modes off the torch-function stack, then push ``push`` (outermost first)."""
    for _ in range(pop):
        _POP_FN()
    for mode in push:
        _PUSH_FN(mode)


def any_mode_active() -> bool:
    """A torch-function or dispatch mode is on its stack."""
    return bool(_LEN_FN_STACK() or _LEN_DISPATCH_STACK())


def current_stream_key() -> tuple:
    """(stream id, device index, device type): the current CUDA stream, as its Stream says."""
    return tuple(_CURRENT_STREAM(_CURRENT_DEVICE()))
