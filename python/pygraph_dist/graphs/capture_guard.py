"""What a capture refuses to record, and how a failed capture becomes a reason.

Every capture of a wrapped model -- the whole iteration, tier 2's forward,
backward and step graphs, evaluation graphs -- records through
:func:`capture_into`: ``torch.cuda.graph`` in thread-local capture mode,
with two guards that turn a silently wrong graph into a failed capture:

* the host-side CUDA RNG state calls (``torch.cuda.get_rng_state`` /
  ``set_rng_state``, as ``torch.utils.checkpoint`` makes them) raise
  :class:`GraphUnsafeRNGError` while recording;
* with ``watch_generators``, so does a random draw from a CUDA generator
  other than the device's default one (:class:`_GeneratorGuard`).

A capture that raises is not fatal: :meth:`capture.GraphRunner.capture`
(and ``split``, ``evaluation``) hand the exception to
:func:`describe_capture_error`, which reads its chain into ``(reason,
retryable)``; the ranks agree on the verdict and the iteration runs eagerly.
A gradient bucket whose all-reduce raised while recording shows up in that
chain as a :class:`BucketCaptureError` (raised by the reducer), which is how
the bucket -- not the whole model -- leaves the graph on every rank.

A reason names the line that raised (:func:`error_site`): the innermost frame
of the exception's traceback outside torch, pygraph_dist and the standard
library -- the user's model, or a library's (``transformers/models/...py:123``,
followed by the user's line that led there) -- as ``"...; raised at
model.py:42 in forward()"``; ``reports.report_reasons.failure_where`` reads the
``file:line`` back out of a reason (agreed reasons included), for ``report()``'s ``where``.
"""

from __future__ import annotations

import contextlib
import re

import torch
from torch.overrides import TorchFunctionMode

from ..loop.monitor import Site, frames_of, locate
from ..runtime import patches
from ..runtime._ext import C, NOT_CAPTURABLE_TAG


class BucketCaptureError(RuntimeError):
    """A graph bucket's all-reduce failed while a graph was being captured."""

    def __init__(self, bucket: int, cause: BaseException) -> None:
        super().__init__(f"gradient bucket {bucket}: its all-reduce could not be captured: "
                         f"{type(cause).__name__}: {str(cause).splitlines()[0] if str(cause) else ''}")
        self.bucket = bucket


def exception_chain(error: BaseException | None, limit: int = 6):
    e, seen = error, 0
    while e is not None and seen < limit:
        yield e
        e, seen = e.__cause__ or e.__context__, seen + 1


def _bucket_error(error: BaseException | None) -> BucketCaptureError | None:
    """The BucketCaptureError in ``error``'s chain, if a bucket's all-reduce caused it."""
    return next((e for e in exception_chain(error) if isinstance(e, BucketCaptureError)), None)


class GraphUnsafeRNGError(RuntimeError):
    """The captured iteration read or restored the CUDA RNG state on the host."""


_RNG_STATE_FUNCTIONS = ("get_rng_state", "set_rng_state")


def _refusing_while_capturing(name: str, original):
    def guarded(*args, **kwargs):
        if torch.cuda.is_current_stream_capturing():
            raise GraphUnsafeRNGError(
                f"{NOT_CAPTURABLE_TAG}torch.cuda.{name}() while capturing (torch.utils.checkpoint with "
                "preserve_rng_state=True): a replay would restore the captured RNG state, so recomputed "
                "dropout masks would not match the forward's. Use preserve_rng_state=False if the "
                "checkpointed layers draw no random numbers; otherwise this trains eagerly")
        return original(*args, **kwargs)

    guarded.__wrapped__ = original
    return guarded


class _GeneratorGuard(TorchFunctionMode):
    """While recording: refuse random draws from a CUDA generator other than
    the device's default one. The capture registers the default generator
    with the graph (its philox offset moves on at every replay); another
    generator is not registered, so every replay would draw the very numbers
    the capture drew."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        gen = kwargs.get("generator")
        if isinstance(gen, torch.Generator) and gen.device.type == "cuda":
            index = gen.device.index if gen.device.index is not None else torch.cuda.current_device()
            if gen is not torch.cuda.default_generators[index]:
                raise GraphUnsafeRNGError(
                    f"{NOT_CAPTURABLE_TAG}{getattr(func, '__name__', 'a random op')}(generator=...) draws "
                    "from a CUDA torch.Generator of your own inside the captured iteration: a graph "
                    "replays the numbers it drew at capture (only the default generator's state moves "
                    "on between replays). Use the default generator (torch.manual_seed seeds it), or "
                    "this trains eagerly")
        return func(*args, **kwargs)


@contextlib.contextmanager
def capture_into(graph, *, pool, stream, watch_generators: bool = False):
    """``torch.cuda.graph`` as every capture here uses it, with the host-side
    CUDA RNG state calls refused while it records.

    ``torch.cuda.get_rng_state``/``set_rng_state`` copy the generator's seed and
    offset to and from the host. A graph records neither: every replay would
    draw from the offsets the capture saw, where the forward's own draws move
    on (graph-safe philox offsets). ``torch.utils.checkpoint`` saves the state
    in forward and restores it for the recomputation in backward, so a graphed
    checkpointed layer with dropout would recompute with other masks than its
    forward used: silently wrong gradients. Refusing makes the capture fail
    with that reason, agreed by all ranks, and the iteration runs eagerly.
    ``watch_generators``: the same for draws from a CUDA generator other than
    the default one (``_GeneratorGuard``)."""
    import torch.cuda.random as cuda_random

    refusing = patches.Swap("cuda.rng_state_calls", [  # patches.py says why
        (module, name, _refusing_while_capturing(name, getattr(module, name)))
        for module in (torch.cuda, cuda_random) for name in _RNG_STATE_FUNCTIONS])
    try:
        with _QuietWhenEmpty(torch.cuda.graph(graph, pool=pool, stream=stream,
                                              capture_error_mode="thread_local")), \
                (_GeneratorGuard() if watch_generators else contextlib.nullcontext()):
            yield
    finally:
        refusing.undo()


# What capture_end warns when a graph recorded no kernel: a capture that failed
# at its first op (the eager rerun follows), or an evaluation forward without a
# kernel. Neither is the user's concern, and replaying an empty graph is harmless.
_EMPTY_GRAPH = r"The CUDA Graph is empty"


class _QuietWhenEmpty:
    """``torch.cuda.graph`` with capture_end's empty-graph warning (alone) silenced."""

    def __init__(self, inner) -> None:
        self.inner = inner

    def __enter__(self):
        return self.inner.__enter__()

    def __exit__(self, *exc_info):
        with patches.ignoring_warning(_EMPTY_GRAPH):
            return self.inner.__exit__(*exc_info)


def end_failed_capture(generator, rng_snapshot, stream, device) -> None:
    """Undo what a failed :func:`capture_into` leaves behind. A capture that dies
    before ``capture_end`` leaves the CUDA generator in capture mode, and the
    next eager dropout fails with 'Offset increment outside graph capture
    encountered unexpectedly': give the generator its pre-capture state back
    (``rng_snapshot``, ``generator.clone_state()`` taken before), check that
    ``stream`` (the capture stream) stopped capturing, and synchronise."""
    generator.graphsafe_set_state(rng_snapshot)
    with torch.cuda.stream(stream):
        if C.current_stream_is_capturing():
            raise RuntimeError("pygraph_dist: the capture stream is still capturing after a "
                               "failed capture; cannot continue safely")
    torch.cuda.synchronize(device)


def _traceback_frames(tb) -> tuple[list, object]:
    """A traceback's frames as :func:`~pygraph_dist.loop.monitor.locate` reads them
    (innermost first), and the frame that called its outermost one."""
    frames, outer = [], None
    while tb is not None:
        frame = tb.tb_frame
        outer = outer or frame.f_back
        frames.append((frame.f_code.co_filename, tb.tb_lineno, frame.f_code.co_name,
                       str(frame.f_globals.get("__name__", ""))))
        tb = tb.tb_next
    return frames[::-1], outer


def error_site(error: BaseException | None) -> Site | None:
    """The line that raised ``error``: the innermost frame of its traceback outside
    torch, pygraph_dist and the standard library (a framework's, such as
    ``transformers/models/mistral/modeling_mistral.py:123``, with the user's line
    that led there), or None when every frame is torch's or ours. The chain is
    read from its root cause out: ``torch.cuda.graph``'s exit raises capture_end's
    error from our own frames, with the body's error (the line) as its context."""
    for e in reversed(list(exception_chain(error, 4))):
        frames, outer = _traceback_frames(e.__traceback__)
        # Beyond the traceback, the callers still on the stack (the user's loop
        # around the wrapped call) name the user's line after a framework's.
        site = locate(frames, frames_of(outer))
        if site is not None:
            return site
    return None


def site_text(site: Site | None) -> str:
    """What a reason says of ``site``: ``"; raised at model.py:42 in forward()"``
    (and ``" (from train.py:55)"`` after a framework's line), or "" without one."""
    if site is None:
        return ""
    text = f"; raised at {site.where}" + (f" in {site.function}()" if site.function else "")
    return text + (f" (from {site.user})" if site.user else "")


TORCHSCRIPT_FAILED = "The following operation failed in the TorchScript interpreter"


_ERROR_LINE = re.compile(r"^[\w.]*(Error|Exception):(.*)$")


def _torchscript_inner(error_text: str) -> tuple[str, str] | None:
    """``(type, message)`` of the error an error raised inside a TorchScript function
    (``torch.jit.script``; its first line says only that) wraps: its last ``Type:
    message`` line, the message "" when TorchScript kept none (the type "" without
    such a line); None for other errors."""
    lines = error_text.splitlines()
    if not lines or TORCHSCRIPT_FAILED not in lines[0]:
        return None
    inner = [m for m in map(_ERROR_LINE.match, lines[1:]) if m]
    if not inner:
        return "", ""
    kind, message = inner[-1].group(0).split(":", 1)
    return kind.removeprefix("builtins."), message.strip()


def torchscript_without_message(error: BaseException | None) -> bool:
    """An error inside a TorchScript function whose message TorchScript dropped, as it
    does for an error raised through a Python dispatch mode (a pageable host copy under
    pygraph_dist's own modes, for one)."""
    return any((inner := _torchscript_inner(str(e))) is not None and not inner[1] for e in exception_chain(error))


def first_line(error_text: str) -> str:
    """The line a reason quotes of an error's ``"Type: message"``: its first, or for an
    error raised inside a TorchScript function the error it wraps, marked so."""
    inner = _torchscript_inner(error_text)
    if inner is None:
        return error_text.splitlines()[0][:400] if error_text else ""
    kind, message = inner
    if not message:
        return f"{kind or 'an error'} inside a TorchScript function (TorchScript kept no message)"
    return f"{kind}: {message}"[:400] + " (inside a TorchScript function)"


def describe_capture_error(error: BaseException | None) -> tuple[str, bool]:
    """(reason, retryable) for a local capture failure; the reason ends with the
    line that raised, when one is outside torch and pygraph_dist (:func:`site_text`)."""
    if error is None:
        return "", True
    at = site_text(error_site(error))
    bucket_error = _bucket_error(error)
    if bucket_error is not None:
        return f"{bucket_error}{at}", True
    # torch.cuda.graph.__exit__ ends the capture even when the body raised, so
    # the error we catch may be capture_end's; the cause is in the chain.
    chain = [f"{type(e).__name__}: {e}".strip() for e in exception_chain(error, 4)]
    text = "\n".join(chain)
    first = first_line(chain[-1]) if chain else ""
    if NOT_CAPTURABLE_TAG in text:
        return first.replace(NOT_CAPTURABLE_TAG, "").strip() + at, False
    lowered = text.lower()
    if "not permitted when stream is capturing" in lowered or (
        "capture" in lowered and ("invalidated" in lowered or "unsupported" in lowered)
    ):
        return (
            "a host synchronisation happened during capture (e.g. .item(), .cpu(), nonzero, "
            "boolean-mask indexing, a blocking copy, printing a tensor) in the model, the loss "
            f"or the optimizer; CUDA said: {first}{at}"
        ), False
    if "capturable is false" in lowered:
        return f"the optimizer is not capturable: {first}{at}", False
    return first + at, True


