"""Watching the user's code between the model call and ``optimizer.step()``.

A graph replays what the engine captured: forward and loss, ``backward()`` of
that loss, the gradient all-reduce, clipping if configured, and the optimizer
step. Whatever the user's loop does *between* the model call and the step, in
their own code, is not in the graph. Most of it is harmless (logging, reading
the loss); some of it would make graphed training silently different from
eager training:

* ``backward()`` on something other than the returned loss — ``loss / k``, a
  sum with an auxiliary loss, ``scaler.scale(loss)``: the graph would apply
  the model's own gradient, not the user's;
* writing to parameters, gradients, optimizer state or the learning rate
  between the model call and the step — ``clip_grad_norm_``, a manual
  ``p.grad.mul_()``: the graph already stepped with the unmodified values;
* a second forward or a missing ``zero_grad()`` (gradient accumulation).

:class:`LoopMonitor` is a ``TorchFunctionMode`` pushed when the model call
returns and popped by ``optimizer.step()``. It sees every torch call the user
makes in that window (modes are thread-local and suspended while their own
handler runs, so the engine's and autograd's internal calls are not seen).
During probe iterations the user's code runs normally and violations are
collected, agreed across ranks, and turn graphs off with a message that says
what to move where. After capture, a violation cannot be undone (the step
already ran), so it raises.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import sysconfig
import traceback
import warnings
from dataclasses import dataclass

import torch
from torch.overrides import TorchFunctionMode

from ..runtime import patches
from ..runtime.spans import timed
from .amp import dtype_name

_PKG_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the package, not loop/
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__))

_INPLACE_DUNDERS = {
    "__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__",
    "__imod__", "__ipow__", "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__",
    "__set__",
}


def _under(path: str, root: str) -> bool:
    return path == root or path.startswith(root + os.sep)


def _internal(filename: str) -> bool:
    path = os.path.abspath(filename)
    return _under(path, _PKG_DIR) or _under(path, _TORCH_DIR)  # torch, not torchvision


# The standard library (a venv's lib/pythonX.Y too, whose site-packages is not it).
_STDLIB_DIRS = tuple({os.path.abspath(p) for key in ("stdlib", "platstdlib")
                      if (p := sysconfig.get_paths().get(key))})
_INSTALLED = ("site-packages", "dist-packages")


def _passed_over(filename: str, module: str) -> bool:
    """Frames a location never names: torch's and ours, Triton's (what
    torch.compile launches), the standard library's (``contextlib`` around a
    ``with``), and generated code (``<frozen ...>``, torch.fx's ``<eval_with_key>``)."""
    if filename.startswith("<"):
        return filename.startswith(("<frozen", "<eval_with_key"))
    if _internal(filename) or module.split(".")[0] == "triton":
        return True
    parts = os.path.abspath(filename).split(os.sep)
    return (any(_under(os.path.abspath(filename), d) for d in _STDLIB_DIRS)
            and not any(part in _INSTALLED for part in parts))


# Packages that run the user's loop for them: a line of theirs is named with the
# user's own line that led there (Fabric's precision plugin calls backward()).
# Transformers' modeling files are the "user's code" of a model from the Hub:
# the line named is theirs, followed by the user's.
_FRAMEWORKS = {"lightning", "lightning_fabric", "pytorch_lightning", "transformers", "accelerate"}


def _file_name(filename: str, top: str, framework: bool) -> str:
    """How a location names a file: a framework's from its package down
    (``lightning/fabric/...py``), an installed package's from site-packages down
    (``timm/models/vit.py``), anything else relative to the working directory."""
    if filename.startswith("<"):
        return filename
    parts = os.path.abspath(filename).split(os.sep)
    if framework:
        cut = max((i for i, part in enumerate(parts) if part == top), default=len(parts) - 1)
        return "/".join(parts[cut:])
    installed = max((i for i, part in enumerate(parts) if part in _INSTALLED), default=-1)
    if 0 <= installed < len(parts) - 1:
        return "/".join(parts[installed + 1:])
    return os.path.relpath(os.path.abspath(filename))


@dataclass(frozen=True)
class Site:
    """A line of code a reason names (:func:`locate`)."""

    where: str          # file:line
    function: str       # the function that line is in ("" at module level)
    user: str = ""      # after a framework's line: the user's own line that led there

    def __str__(self) -> str:
        return f"{self.where} (from {self.user})" if self.user else self.where


def frames_of(frame):
    """``(filename, line, function, module)`` of ``frame`` and its callers, innermost first."""
    while frame is not None:
        yield (frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name,
               str(frame.f_globals.get("__name__", "")))
        frame = frame.f_back


def locate(frames, callers=()) -> Site | None:
    """The innermost of ``frames`` (innermost first, as :func:`frames_of` yields
    them) outside torch, pygraph_dist and the standard library, or None. A
    framework's frame (:data:`_FRAMEWORKS`) is named from its package down, with
    the innermost frame outside the frameworks that led there as ``user``,
    looked for in ``frames`` and then in ``callers`` (frames further out, which
    are never named themselves)."""
    found: Site | None = None
    for i, chain in enumerate((frames, callers)):
        for filename, line, function, module in chain:
            if _passed_over(filename, module):
                continue
            top = module.split(".")[0]
            framework = top in _FRAMEWORKS
            if found is None and i == 0:
                found = Site(f"{_file_name(filename, top, framework)}:{line}",
                             "" if function.startswith("<") else function)
                if not framework:
                    return found
            elif found is not None and not framework:
                return Site(found.where, found.function, f"{_file_name(filename, top, False)}:{line}")
    return found


def user_location() -> str:
    """``file:line`` of the innermost frame outside torch and pygraph_dist. A
    frame of a training framework is named from its package down
    (``lightning/fabric/...py:107``), followed by the innermost frame outside
    the frameworks too: ``... (from train.py:55)``."""
    site = locate(frames_of(sys._getframe(1)))
    return str(site) if site is not None else "<unknown>"


_WRAPPER_NAMES = {"wrapper", "decorate_context", "inner", "wrapped", "fn"}


def _user_call(op: str) -> str:
    """The call the user wrote that led to ``op`` — ``clip_grad_norm_()`` rather
    than the ``_foreach_mul_()`` it runs inside — or ``op()`` when the user
    called the op directly."""
    stack = traceback.extract_stack()[:-1]
    for i in range(len(stack) - 1, -1, -1):
        if _internal(stack[i].filename):
            continue
        for frame in stack[i + 1:]:
            if not _internal(frame.filename) or frame.filename.startswith(_PKG_DIR):
                break
            if not frame.name.startswith("_") and frame.name not in _WRAPPER_NAMES:
                return f"{frame.name}()"
        return f"{op}()"
    return f"{op}()"


@dataclass(frozen=True)
class Violation:
    what: str
    where: str
    fix: str
    # True when tier 2 (forward and backward graphs with the user's code
    # between them, the step graph at optimizer.step()) still runs the loop
    # exactly as written; False when only eager training does.
    split_ok: bool = False

    def __str__(self) -> str:
        return f"{self.what} at {self.where}. {self.fix}"


_HOOK_METHODS = {"register_hook", "retain_grad", "register_post_accumulate_grad_hook"}


def _checking_hook(name: str, args: tuple, kwargs: dict) -> bool:
    """Lightning Fabric's hook on every output of the model call, which checks
    that the loop backpropagates through ``fabric.backward()``
    (``lightning/fabric/wrappers.py``: ``partial(_backward_hook, ...)``). It
    raises or returns None -- it never changes a gradient -- so it is no change
    of the loop: on the loss it still runs in a tier-1 step (the loss handed
    out is the one ``fabric.backward`` reaches), on other outputs it has
    nothing to check."""
    hook = args[1] if len(args) > 1 else kwargs.get("hook")
    target = getattr(hook, "func", None)
    return (name == "register_hook" and isinstance(hook, functools.partial)
            and getattr(target, "__name__", "") == "_backward_hook"
            and getattr(target, "__module__", "") in ("lightning.fabric.wrappers", "lightning_fabric.wrappers"))


def _func_name(func) -> str:
    return getattr(func, "__name__", "") or ""


def _is_mutating(name: str, kwargs: dict) -> bool:
    if kwargs.get("out") is not None:
        return True
    if name in _INPLACE_DUNDERS:
        return True
    return name.endswith("_") and not name.startswith("__")


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            yield from _tensors(o)


class LoopMonitor(TorchFunctionMode):
    """See the module docstring.

    ``loop`` (a :class:`~pygraph_dist.loop.conformance.LoopState`) decides about
    each ``backward()`` (``backward_called(tensor, kwargs) -> bool``: whether
    to run it) and takes violations (``violation(what, fix, defer=True)``);
    ``owned_storages()`` gives the storage pointers of parameters, gradients,
    optimizer state and learning-rate tensors.
    """

    _pgd_mode = True  # remove_from_under_own_modes

    def __init__(self, loop, owned_storages) -> None:
        super().__init__()
        self.loop = loop
        self.owned_storages = owned_storages
        self.active = False
        self.window = ""
        self.violations: list[Violation] = []
        self._owned: set[int] | None = None

    # -------------------------------------------------------------- control
    @timed("monitor")
    def start(self, window: str) -> None:
        self.window = window
        self._owned = None
        if not self.active:
            self.__enter__()
            self.active = True

    def set_window(self, window: str) -> None:
        self.window = window

    @timed("monitor")
    def stop(self) -> list[Violation]:
        """Pop the mode (if it is on top) and hand back what was seen."""
        if self.active:
            if exit_if_on_top(self):
                pass
            elif remove_from_under_own_modes(self):
                # Only pygraph_dist's modes (other wrapped models') sit above
                # ours: another wrapped model was called inside this one's step
                # (a GAN's discriminator in the generator's loss). Ours is taken
                # out from under them; theirs stay in order.
                self.violations.append(Violation(
                    "another pygraph_dist-wrapped model was called between this model's call and "
                    "its optimizer.step() (models trained in alternation, as in GAN training)",
                    user_location(),
                    "A graph holds one model's iteration; this loop trains eagerly, as written.",
                ))
            else:
                # Someone pushed a mode on top of ours and left it there; popping
                # now would pop theirs. Leave ours in place, inert.
                self.violations.append(Violation(
                    "another TorchFunctionMode was entered between the model call and "
                    "optimizer.step() and not exited",
                    user_location(),
                    "Exit it before optimizer.step().",
                ))
            self.active = False
        out, self.violations = self.violations, []
        return out

    def record(self, what: str, fix: str, *, split_ok: bool = False) -> None:
        self.violations.append(Violation(what, user_location(), fix, split_ok))

    # ---------------------------------------------------------------- mode
    @timed("monitor")  # includes the op itself where the monitor lets it run
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.active:
            return func(*args, **kwargs)
        if func is torch.Tensor.backward or func is torch.autograd.backward:
            target = args[0] if args else kwargs.get("tensors")
            if self.loop.backward_called(target, kwargs):
                return func(*args, **kwargs)
            return None
        name = _func_name(func)
        if name in _HOOK_METHODS and not _checking_hook(name, args, kwargs):
            # A hook on a tensor of this step: tier 1 ran the backward at the model
            # call, without it; tier 2 runs the user's backward as written.
            self.loop.violation(
                f"{name}() on a tensor {self.window}",
                "A graph runs the whole backward at the model call, without hooks registered after "
                "it; register gradient hooks on parameters before the loop, or inside the module's "
                "forward. This loop is graphed per micro-batch (tier 2).",
                defer=True,
                split_ok=True,
            )
            return func(*args, **kwargs)
        if func is torch.autograd.grad:
            self.loop.violation(
                "torch.autograd.grad() between the model call and optimizer.step()",
                "The graph applies loss.backward() of the returned loss only; compute extra "
                "gradients outside the training step, or train this model without graphs.",
                defer=True,
            )
            return func(*args, **kwargs)
        if _is_mutating(name, kwargs):
            targets = list(_tensors(args[:1])) + list(_tensors(kwargs.get("out")))
            owned = self._owned_storages()
            for t in targets:
                if storage_ptr(t) in owned:
                    self.loop.violation(
                        f"{_user_call(name)} modifies a parameter, gradient, optimizer state or "
                        f"learning rate {self.window}",
                        self._fix_for(name),
                        defer=True,
                        split_ok=True,  # tier 2 runs it eagerly, where it is written
                    )
                    break
        return func(*args, **kwargs)

    def _owned_storages(self) -> set[int]:
        if self._owned is None:
            self._owned = self.owned_storages()
        return self._owned

    def _fix_for(self, name: str) -> str:
        if "mul" in name or "clamp" in name or "div" in name:
            return (
                "A graph would step before this runs. For gradient clipping pass "
                "max_grad_norm=... to pygraph_dist.wrap(); move other gradient changes into "
                "the model's forward/loss, or after optimizer.step()."
            )
        return (
            "A graph would step before this runs. Move it after optimizer.step() (parameter "
            "and learning-rate updates are read by the next replay), or into the model."
        )


def exit_if_on_top(mode: TorchFunctionMode) -> bool:
    """Exit ``mode`` if it is the innermost torch-function mode. False when a
    mode someone else entered sits on top: popping then would pop theirs."""
    if patches.top_function_mode() is mode:
        mode.__exit__(None, None, None)
        return True
    return False


def remove_from_under_own_modes(mode: TorchFunctionMode) -> bool:
    """Take ``mode`` out of the torch-function stack when every mode above it is
    one of pygraph_dist's (``_pgd_mode``: another wrapped model's monitor or
    accumulation guard, which find themselves on top again when they exit);
    False, leaving the stack as it is, otherwise. Left in place, a mode would
    stay on the stack for the rest of the process, inert but called for every
    torch function."""
    stack = patches.function_modes()
    if mode not in stack:
        return False
    above = stack[stack.index(mode) + 1:]
    if not above or not all(getattr(m, "_pgd_mode", False) for m in above):
        return False
    patches.restack_function_modes(len(above) + 1, above)
    return True


def storage_ptr(t: torch.Tensor) -> int:
    """Address of ``t``'s storage (-1 for tensors without one), to tell owned tensors apart.

    Computed from the tensor, not through ``t.untyped_storage()``: that creates
    a Python object for the storage, which then lives as long as the storage
    (torch 2.13), so that every C++ thread dropping a reference to it -- a
    Gloo worker finishing a bucket's all-reduce -- takes the GIL, which aborts
    the process during interpreter exit (graph_safe_backend.cpp, PythonFreeArgs)."""
    try:
        return t.data_ptr() - t.storage_offset() * t.element_size()
    except (RuntimeError, NotImplementedError):  # no data pointer: sparse, some subclasses
        pass
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return -1


@contextlib.contextmanager
def watch_inner_autocast(enabled: bool, device_type: str, seen: list[str]):
    """On probes, note the autocast dtype that submodules run under when the
    caller's autocast is off: autocast entered inside the module's forward
    (Accelerate patches its own into ``forward``), for report()'s precision
    line. A global forward pre-hook, only for the probe's calls."""
    if not enabled or torch.is_autocast_enabled(device_type):
        yield
        return

    def hook(module, args):  # noqa: ARG001
        if not seen and torch.is_autocast_enabled(device_type):
            seen.append(dtype_name(torch.get_autocast_dtype(device_type)))

    handle = torch.nn.modules.module.register_module_forward_pre_hook(hook)
    try:
        yield
    finally:
        handle.remove()


@contextlib.contextmanager
def watch_host_syncs(enabled: bool, sites: list[str]):
    """On CUDA probes, turn host syncs in forward into warnings and collect
    where they happen (``file:line``) into ``sites``. A sync seen in eager
    forward is only a hint: libraries such as transformers skip theirs while a
    stream is capturing, so capture decides, and its failure message cites these."""
    if not enabled:
        yield
        return
    with patches.sync_debug_warnings() as caught:
        yield
    for w in caught:
        if "called a synchronizing CUDA operation" in str(w.message):
            site = f"{w.filename}:{w.lineno}"
            if site not in sites:
                sites.append(site)
        elif "prototype feature" not in str(w.message):  # torch's notice about the debug mode
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
