"""Host tensors made in forward, graphed (issue 46, item 2): host_copies.py.

CPU tests drive the dispatch mode itself with a configurable "device": host
copies against ``meta`` (the CPU is the host; a copy to ``meta`` is a
host-to-device copy without values), host reads of constants against ``cpu``
(the CPU plays the device; its values are real). GPU tests (``gpu_*`` cases,
run through rank_main) train the PyTorch word-language-model pattern -- an
``nn.TransformerEncoder`` fed ``generate_square_subsequent_mask(T).to(device)``
in forward -- graphed, against ``graphs=False``, bit for bit.
"""

from __future__ import annotations

import math
import os
import threading
import warnings
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from pygraph_dist.graphs import host_copies as hc
from pygraph_dist.runtime._ext import NOT_CAPTURABLE_TAG
from pygraph_dist.graphs.capture_guard import describe_capture_error

HERE = os.path.basename(__file__)


def _line_of(func, text: str) -> int:
    """The line number of ``text`` in ``func``'s source."""
    import inspect

    lines, start = inspect.getsourcelines(func)
    return start + next(i for i, line in enumerate(lines) if text in line)


class Entry(SimpleNamespace):
    """A GraphEntry stand-in: what host_copies reads and writes."""

    def __init__(self):
        super().__init__(host_copies=None, warmups=3)


def watch(device_type="meta"):
    w = hc.HostWatch(enabled=True, device_type=device_type, pin=False)
    w.wanted = True
    return w


def observe(w, entry, fn, times=2):
    for _ in range(times):
        with hc.observing(w, entry):
            fn()


# ====================================================================== copies
def forward_mask(T=4):
    return nn.Transformer.generate_square_subsequent_mask(T).to("meta")  # the copy


def test_observed_copies_are_recorded_with_their_line_and_a_staging_buffer():
    w, e = watch(), Entry()
    observe(w, e, forward_mask)
    rec = e.host_copies
    assert rec.iterations == 2 and len(rec.copies) == 1
    (key, n), c = next(iter(rec.copies.items()))
    line = _line_of(forward_mask, "# the copy")
    assert n == 0 and key.endswith(f"{HERE}:{line}") and c.site.endswith(f"{HERE}:{line}")
    assert not c.varied and c.buffer is not None and c.buffer.dtype == torch.float32
    assert torch.equal(c.buffer, nn.Transformer.generate_square_subsequent_mask(4))
    with hc.substituting(w, e):
        out = forward_mask()
    assert out.device.type == "meta" and out.shape == (4, 4) and out.dtype == torch.float32
    assert "1 host-to-device copy replayed from pinned buffers" in hc.describe(e)


def test_every_kind_of_host_copy_is_seen():
    w, e = watch(), Entry()
    dst = torch.empty(2, 3, device="meta")
    like = torch.empty(2, device="meta", dtype=torch.float16)

    def fwd():
        a = torch.arange(3).to("meta", dtype=torch.float64)  # _to_copy with a dtype
        dst.copy_(torch.ones(3))  # copy_, broadcast
        b = torch.tensor([1.5, 2.5], device="meta")  # torch.tensor
        c = torch.as_tensor([1, 2], device="meta")  # torch.as_tensor
        d = like.new_tensor([0.5, 1.0])  # Tensor.new_tensor, on the device of like
        f = torch.tensor(7, device="meta", requires_grad=False, dtype=torch.int32)
        return a, b, c, d, f

    observe(w, e, fwd)
    assert len(e.host_copies.copies) == 6, e.host_copies.copies.keys()
    with hc.substituting(w, e):
        a, b, c, d, f = fwd()
    assert (a.dtype, b.dtype, c.dtype, d.dtype, f.dtype) == (
        torch.float64, torch.float32, torch.int64, torch.float16, torch.int32)
    assert all(t.device.type == "meta" for t in (a, b, c, d, f))
    # The factories are torch's own again outside the session.
    assert torch.tensor([1.0]).device.type == "cpu" and not hasattr(torch.tensor, "__wrapped__")
    assert "new_tensor" not in torch.Tensor.__dict__


def test_an_empty_copy_copies_nothing():
    """transformers' cache makes torch.tensor([], device=...) every forward: at
    capture it is an empty tensor of the same dtype and layout, no copy."""
    w, e = watch(), Entry()
    dst = torch.empty(0, 3, device="meta")

    def fwd():
        dst.copy_(torch.empty(0, 3))
        return torch.tensor([], dtype=torch.float16, device="meta"), torch.empty(2, 0).t().to("meta")

    observe(w, e, fwd)
    with hc.substituting(w, e):
        a, b = fwd()
    assert (a.shape, a.dtype, b.shape) == ((0,), torch.float16, (0, 2))
    assert b.stride() == torch.empty(2, 0).t().stride()


def test_requires_grad_and_default_device_of_the_patched_factories():
    w, e = watch(), Entry()

    def fwd():
        return torch.tensor([1.0, 2.0], device="meta", requires_grad=True)

    observe(w, e, fwd, times=1)
    with hc.substituting(w, e):
        t = fwd()
    assert t.requires_grad and t.is_leaf


@pytest.mark.parametrize("kind", ["to", "copy_"])
def test_the_staging_buffer_sends_what_the_copy_sends(kind):
    """A blocking copy converts on the host: the buffer holds the values converted
    (and broadcast) as torch's copy does there, and copying from it gives the same
    tensor, bit for bit."""
    src = torch.randn(3, 1, dtype=torch.float64) * 1e10
    src[0, 0] = float("nan")
    if kind == "to":
        target = ("_to_copy", torch.float16, "cuda", None, None, False)
        buf = hc.staging_buffer(src, target, pin=False)
        mine, torch_s = buf.to(torch.float16), src.to(torch.float16)
    else:
        dst = torch.empty(3, 4, dtype=torch.bfloat16)
        target = ("copy_", dst.dtype, tuple(dst.shape), tuple(dst.stride()), "cuda", False)
        buf = hc.staging_buffer(src, target, pin=False)
        mine, torch_s = torch.empty_like(dst).copy_(buf), torch.empty_like(dst).copy_(src)
        assert buf.is_contiguous() and buf.shape == dst.shape
    assert buf.dtype == torch_s.dtype
    assert torch.equal(mine.view(torch.int16), torch_s.view(torch.int16))


def test_a_non_blocking_copy_converts_on_the_device_as_torch_does():
    """torch converts a non_blocking host-to-device copy on the device: the buffer
    keeps the host dtype, and the graph's copy converts it there too."""
    src = torch.randn(3, dtype=torch.float64)
    buf = hc.staging_buffer(src, ("_to_copy", torch.float16, "cuda", None, None, True), pin=False)
    assert buf.dtype == torch.float64 and torch.equal(buf, src)
    dst = torch.empty(2, 3, dtype=torch.bfloat16)
    buf = hc.staging_buffer(src, ("copy_", dst.dtype, (2, 3), dst.stride(), "cuda", True), pin=False)
    assert buf.dtype == torch.float64 and buf.shape == (2, 3) and buf.is_contiguous()


def test_a_requested_memory_format_is_the_buffers():
    src = torch.randn(2, 3, 4, 5)
    buf = hc.staging_buffer(src, ("_to_copy", torch.float32, "cuda", None, torch.channels_last, False),
                            pin=False)
    assert buf.is_contiguous(memory_format=torch.channels_last) and torch.equal(buf, src)


def test_strided_sources_keep_their_layout():
    src = torch.arange(12.0).view(3, 4).t()  # dense, transposed
    buf = hc.staging_buffer(src, ("_to_copy", torch.float32, "cuda", None, None, False), pin=False)
    assert buf.stride() == src.stride() and torch.equal(buf, src)
    expanded = torch.arange(3.0).view(3, 1).expand(3, 4)  # not dense: copied contiguous, as torch does
    buf = hc.staging_buffer(expanded, ("_to_copy", torch.float32, "cuda", None, None, False), pin=False)
    assert buf.is_contiguous() and torch.equal(buf, expanded)


def step_mask(step):
    return torch.full((2,), float(step)).to("meta")  # varies


def _refused_at_capture(w, entry, fn) -> str:
    """What ``fn`` raises where a capture substitutes its host values (:func:`_refused`)."""
    def capture():
        with hc.substituting(w, entry):
            fn()

    return _refused(capture)


def _refused(fn, *args) -> str:
    with pytest.raises(hc.HostTensorError) as info:
        fn(*args)
    text = str(info.value)
    assert text.startswith(NOT_CAPTURABLE_TAG)
    reason, retryable = describe_capture_error(info.value)
    assert not retryable and NOT_CAPTURABLE_TAG not in reason
    return text


def test_values_that_change_between_warm_ups_refuse_with_the_line():
    w, e = watch(), Entry()
    for step in range(2):
        with hc.observing(w, e):
            step_mask(step)
    c = next(iter(e.host_copies.copies.values()))
    assert c.varied == "2 of 2 values differ" and c.buffer is None

    text = _refused_at_capture(w, e, lambda: step_mask(5))
    line = _line_of(step_mask, "# varies")
    assert "a host tensor copied to the GPU at " in text
    assert f"{HERE}:{line} changed between iterations" in text
    assert "(2 of 2 values differ)" in text and "runs eagerly" in text and "device=" in text


def test_values_that_change_at_capture_refuse():
    w, e = watch(), Entry()
    for _ in range(2):
        with hc.observing(w, e):
            step_mask(1)

    assert "changed between iterations (2 of 2 values differ)" in _refused_at_capture(w, e, lambda: step_mask(2))


def test_a_changed_shape_or_dtype_says_so():
    w, e = watch(), Entry()
    with hc.observing(w, e):
        torch.zeros(2, 2).to("meta")  # one line
    with hc.observing(w, e):
        torch.zeros(3, dtype=torch.float64).to("meta")  # another line: counts differ per line
    rec = e.host_copies
    assert len(rec.count_varied) == 2, rec.count_varied
    c0 = hc.difference(hc.meta_of(torch.zeros(2, 2)), (), torch.zeros(2, 2),
                       hc.meta_of(torch.zeros(3)), (), torch.zeros(3))
    assert c0 == "float32[2, 2] then float32[3]"


def counted(n):
    for _ in range(n):
        torch.ones(2).to("meta")  # in a loop


def test_the_number_of_copies_of_a_line_must_not_change():
    w, e = watch(), Entry()
    with hc.observing(w, e):
        counted(2)
    with hc.observing(w, e):
        counted(3)

    assert "the number of host tensors copied to the GPU at" in _refused_at_capture(w, e, lambda: counted(2))
    assert "copied 2 then 3 times in one iteration" in _refused_at_capture(w, e, lambda: counted(2))


def test_more_or_fewer_copies_at_capture_refuse():
    w, e = watch(), Entry()
    observe(w, e, lambda: counted(2))

    more = _refused_at_capture(w, e, lambda: counted(3))
    fewer = _refused_at_capture(w, e, lambda: counted(1))
    assert "was not copied in the warm-up iterations (copy 3 of this line)" in more
    assert "was copied 2 times in warm-up and 1 times in this iteration" in fewer
    with hc.substituting(w, e):
        counted(2)  # as observed: fine


def test_copies_made_by_pygraph_dist_itself_are_not_the_models():
    """A copy whose innermost frame outside torch is pygraph_dist's (the call's
    CPU inputs moved by step.to_device) is left alone, never recorded."""
    pkg = os.path.dirname(hc.__file__)
    space: dict = {"torch": torch}
    exec(compile("def to_device(x):\n    return x.to('meta')\n", os.path.join(pkg, "_fake_step.py"), "exec"),
         space)  # noqa: S102
    w, e = watch(), Entry()
    observe(w, e, lambda: space["to_device"](torch.ones(3)))
    assert e.host_copies.iterations == 2 and not e.host_copies.copies


def test_copies_are_seen_through_pygraph_dists_own_modes():
    """At capture the widening casts (a dispatch mode) and the generator guard (a
    torch-function mode) sit between the forward and this module's mode; their
    handlers are pygraph_dist's frames, yet the copy is the model's. (On a GPU
    the copy went unseen there and every capture of the word LM failed.)"""
    from pygraph_dist.runtime import kernels
    from pygraph_dist.graphs.capture_guard import _GeneratorGuard

    w, e = watch(), Entry()
    with _GeneratorGuard():  # the loop monitor's place at warm-up: a torch-function mode
        observe(w, e, forward_mask)
    assert len(e.host_copies.copies) == 1, e.host_copies.copies
    with hc.substituting(w, e), kernels.WideningCasts(), _GeneratorGuard():
        out = forward_mask()
    assert out.device.type == "meta" and out.shape == (4, 4)


def test_the_watch_off_costs_nothing():
    e = Entry()
    off = hc.HostWatch(enabled=True, device_type="meta")  # enabled, not wanted
    assert isinstance(hc.observing(off, e), type(hc.observing(None, e)))
    with hc.observing(off, e):
        forward_mask()
    assert e.host_copies is None
    assert not hasattr(torch.tensor, "__wrapped__")
    # substituting without an observed warm-up: nothing either (torch refuses the copy itself)
    on = watch()
    with hc.substituting(on, e):
        forward_mask()


def test_an_iteration_that_raises_is_not_merged_and_restores_the_factories():
    w, e = watch(), Entry()
    with pytest.raises(ValueError):
        with hc.observing(w, e):
            forward_mask()
            raise ValueError("the user's")
    assert e.host_copies.iterations == 0 and not e.host_copies.copies
    assert not hasattr(torch.tensor, "__wrapped__") and hc._session() is None


def test_other_threads_keep_torchs_factories():
    w, e = watch(), Entry()
    seen = []
    with hc.observing(w, e):
        t = threading.Thread(target=lambda: seen.append(hc._session()))
        t.start()
        t.join()
        assert hc._session() is not None
    assert seen == [None]


def test_integer_lists_and_host_masks_in_indexing_are_host_copies():
    """falcon's ``fused_qkv[..., [-2], :]``: torch builds a list index on the
    indexed tensor's device below the dispatch key, and moves a host index tensor
    inside the kernel (autograd saving the host one for the backward's copy). In
    a session each is moved by a copy at the indexing line, reads and writes, a
    host boolean mask as its integer indices: the same indexing as torch's, and
    the backward indexes with the moved tensors (no copy of its own)."""
    w, e = watch(), Entry()
    x = torch.zeros(2, 4, 3, device="meta", requires_grad=True)
    mask = torch.tensor([True, False, True, True])

    def fwd():
        a = x[..., [-2]]  # LIST READ
        b = x[:, mask]  # MASK READ
        y = torch.zeros(2, 4, 3, device="meta")
        y[[0, 1], [3, 0]] = 1.0  # LIST WRITE
        (a.sum() + b.sum()).backward()
        c = x[0, 1]  # basic indexing: no copy
        return a, b, y, c

    observe(w, e, fwd)
    rec = e.host_copies
    lines = {name: f"{HERE}:{_line_of(fwd, name)}" for name in ("# LIST READ", "# MASK READ", "# LIST WRITE")}
    found = {(k.rsplit(os.sep, 1)[-1], n): c.buffer for (k, n), c in rec.copies.items()}
    assert sorted(found) == sorted([(lines["# LIST READ"], 0), (lines["# MASK READ"], 0),
                                    (lines["# LIST WRITE"], 0), (lines["# LIST WRITE"], 1)]), sorted(found)
    assert found[(lines["# LIST READ"], 0)].tolist() == [-2]
    assert found[(lines["# MASK READ"], 0)].tolist() == [0, 2, 3]  # the mask's integer indices
    assert found[(lines["# LIST WRITE"], 1)].tolist() == [3, 0]
    with hc.substituting(w, e):
        a, b, y, c = fwd()
    assert (a.shape, b.shape, y.shape, c.shape) == ((2, 4, 1), (2, 3, 3), (2, 4, 3), (3,))
    assert "__getitem__" not in vars(torch.Tensor) and "__setitem__" not in vars(torch.Tensor)
    # the legacy list of slices is a tuple to torch: left as it is
    with hc.observing(w, Entry()), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch: a non-tuple sequence for multidimensional indexing
        assert x[[slice(None), 1]].shape == x[:, 1].shape


def test_a_default_device_without_an_index_is_followed():
    """torch.set_default_device("cuda"): torch.get_default_device() calls
    torch.tensor([]) itself, which once recursed through the patched factory
    until Python's limit. torch.tensor(...) without a device is a host copy to
    the default device, and a boolean list still becomes its integer indices on
    the host (on the device, nonzero would read it back)."""
    w, e = watch(), Entry()
    x = torch.zeros(4, 3, device="meta")

    def fwd():
        return x[[True, False, True, True]] * torch.tensor([0.5])  # BOOL LIST AND FACTORY

    previous = torch.get_default_device()
    torch.set_default_device("meta")
    try:
        observe(w, e, fwd)
        with hc.substituting(w, e):
            out = fwd()
    finally:
        torch.set_default_device(previous)
    buffers = sorted(c.buffer.tolist() for c in e.host_copies.copies.values())
    assert buffers == [[0, 2, 3], [0.5]] and out.shape == (3, 3) and out.device.type == "meta", buffers


def test_moved_indices_index_as_torch_does():
    """The rewritten index selects what torch's own indexing selects (CPU values)."""
    from pygraph_dist.graphs import host_session

    x = torch.arange(2 * 4 * 3 * 5).reshape(2, 4, 3, 5)
    mask2 = torch.tensor([[True, False, True], [False, False, True], [True, True, False], [False, True, True]])
    for index in ([1, 0], ..., (..., [-2], slice(None)), (slice(None), mask2), (torch.tensor([True, False]),),
                  (slice(None), [3, 0], slice(None), [[1], [4]]), (torch.tensor([1, 1]), slice(None), [2, 0]),
                  ([True, False],), (0, [[1, 2]], None)):
        moved = host_session._device_index(index, torch.device("cpu"))
        assert torch.equal(x[moved], x[index]), index
        y, z = torch.zeros_like(x), torch.zeros_like(x)
        y[moved], z[index] = 7, 7
        assert torch.equal(y, z), index


def test_transformers_takes_its_capture_branch_in_a_session():
    """transformers skips an all-ones attention mask eagerly and builds it under
    capture (is_tracing()); an observed warm-up must run what the capture runs."""
    pytest.importorskip("transformers")
    from transformers.utils import import_utils

    original = import_utils.is_cuda_stream_capturing
    w, e = watch(), Entry()
    other = []
    assert not import_utils.is_tracing()
    with hc.observing(w, e):
        assert import_utils.is_tracing()
        t = threading.Thread(target=lambda: other.append(import_utils.is_tracing()))
        t.start()
        t.join()
    assert other == [False]  # another thread is not in the session
    assert not import_utils.is_tracing() and import_utils.is_cuda_stream_capturing is original


# =============================================================== the engine's hooks
PINNED = ("Cannot copy between CPU and CUDA tensors during CUDA graph capture unless the CPU tensor "
          "is pinned")


def _chained():
    try:
        raise RuntimeError(PINNED)
    except RuntimeError:  # the next error's __context__, as torch's chained capture errors
        try:
            raise RuntimeError("CUDA error: operation failed due to a previous error during capture")
        except RuntimeError as outer:
            return outer


def test_a_pageable_copy_at_capture_switches_the_watch_on_and_retries():
    w, e = hc.HostWatch(enabled=True), Entry()
    err = _chained()
    assert hc.is_pageable_copy_error(err)
    reason, retryable = hc.capture_failed(w, e, err, "RuntimeError: " + PINNED, False)
    assert w.wanted and w.on and retryable and e.warmups == 0
    assert reason.startswith("RuntimeError: " + PINNED) and "observe the host tensors" in reason
    # Observed and still a pageable copy: torch's reason, as it was.
    e.host_copies = hc.HostRecord(w, iterations=2)
    assert hc.capture_failed(w, e, err, "r", False) == ("r", False)


def _torchscript_pageable_error() -> Exception:
    """A pageable copy's error as TorchScript raises it (DeBERTa's make_log_bucket_position)."""
    @torch.jit.script
    def scripted(x: torch.Tensor, message: str):
        if bool(x.sum() > 0):
            raise RuntimeError(message)
        return x

    try:
        scripted(torch.ones(1), PINNED)
    except Exception as e:  # noqa: BLE001 - torch.jit.Error
        return e
    raise AssertionError("no error")


def test_a_copy_inside_torchscript_says_so_and_what_to_set():
    """Observed warm-ups and still a pageable copy inside torch.jit.script: the reason
    quotes the wrapped error, not TorchScript's first line, and names PYTORCH_JIT=0."""
    err = _torchscript_pageable_error()
    assert str(err).startswith("The following operation failed in the TorchScript interpreter")
    reason, retryable = describe_capture_error(err)
    assert reason.startswith(f"RuntimeError: {PINNED}") and "(inside a TorchScript function)" in reason, reason
    w, e = hc.HostWatch(enabled=True), Entry()
    e.host_copies = hc.HostRecord(w, iterations=2)
    reason, retryable = hc.capture_failed(w, e, err, reason, retryable)
    assert not retryable and "PYTORCH_JIT=0" in reason and "torch.jit.script" in reason, reason


@torch.jit.script
def _scripted_bucket(relative_pos: torch.Tensor, mid: int):
    """DeBERTa-v2's make_log_bucket_position, in short: a host tensor copied in TorchScript."""
    return torch.where(relative_pos < mid, torch.tensor(mid - 1).type_as(relative_pos), relative_pos)


def _scripted_forward(x):
    return _scripted_bucket(x, 2)  # SCRIPTED CALL


def test_torchscript_drops_the_message_of_an_error_raised_through_a_mode():
    """What DeBERTa's first capture meets on the GPU: the pageable copy's error, raised
    while a Python dispatch mode of ours is active, leaves TorchScript as a bare
    "RuntimeError:". Such a failure switches the watch on as a pageable copy does."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class RefusesCopies(TorchDispatchMode):  # stands for CUDA's refusal under capture
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._to_copy.default and args[0].device.type == "cpu":
                raise RuntimeError(PINNED)
            return func(*args, **(kwargs or {}))

    x = torch.zeros(3, dtype=torch.long, device="meta")
    with pytest.raises(Exception) as info, RefusesCopies():
        _scripted_forward(x)
    err = info.value
    assert str(err).startswith("The following operation failed in the TorchScript interpreter")
    assert PINNED not in str(err) and not hc.is_pageable_copy_error(err)  # torch's behaviour, as measured
    reason, retryable = describe_capture_error(err)
    assert reason.startswith("RuntimeError inside a TorchScript function (TorchScript kept no message)"), reason
    assert f"{HERE}:{_line_of(_scripted_forward, '# SCRIPTED CALL')}" in reason, reason
    w, e = hc.HostWatch(enabled=True), Entry()
    reason, retryable = hc.capture_failed(w, e, err, reason, retryable)
    assert w.on and retryable and "as for a host tensor copied to the GPU inside it" in reason, reason
    # observed, and failing so again: final, with what to set
    e.host_copies = hc.HostRecord(w, iterations=2)
    reason, retryable = hc.capture_failed(w, e, err, "r", True)
    assert not retryable and "PYTORCH_JIT=0" in reason, reason


def test_a_host_copy_inside_torchscript_is_graphed():
    """The dispatch mode sees the copies TorchScript makes: observed at the line that
    calls the scripted function, substituted at capture."""
    w, e = watch(), Entry()
    x = torch.zeros(3, dtype=torch.long, device="meta")
    observe(w, e, lambda: _scripted_forward(x), times=3)
    ((key, n),) = e.host_copies.copies
    assert key.endswith(f"{HERE}:{_line_of(_scripted_forward, '# SCRIPTED CALL')}") and n == 0, key
    with hc.substituting(w, e):
        out = _scripted_forward(x)
    assert out.shape == (3,) and out.device.type == "meta"


def test_other_failures_and_a_disabled_watch_change_nothing():
    e = Entry()
    w = hc.HostWatch(enabled=True)
    assert hc.capture_failed(w, e, RuntimeError("operation not permitted when stream is capturing"),
                             "sync", False) == ("sync", False)
    assert hc.capture_failed(w, e, None, "", True) == ("", True)
    assert not w.wanted
    off = hc.HostWatch(enabled=False)  # torch.compile'd module, or no CUDA graphs
    assert hc.capture_failed(off, e, _chained(), "r", True) == ("r", True) and not off.wanted
    assert hc.capture_failed(None, e, _chained(), "r", True) == ("r", True)


def test_release_retires_the_buffers():
    w, e = watch(), Entry()
    observe(w, e, forward_mask)
    rec = e.host_copies
    assert rec.buffers()
    rec.retire()
    assert not rec.buffers()


# ================================================================ host reads of constants
def encoder_forward(enc, x):
    mask = nn.Transformer.generate_square_subsequent_mask(x.shape[0])
    return enc(x, mask=mask)  # reads bool((mask == causal).all()) on the host


def test_a_constant_read_is_answered_from_the_record():
    """nn.TransformerEncoder's causal-mask check, a host read of a value made of
    constants, recorded at warm-up and answered at capture without reading."""
    w, e = watch("cpu"), Entry()
    torch.manual_seed(0)
    enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0), 2,
                                enable_nested_tensor=False)
    x = torch.randn(5, 3, 16)
    ref = encoder_forward(enc, x)
    observe(w, e, lambda: encoder_forward(enc, x))
    reads = e.host_copies.reads
    assert len(reads) == 1
    (r,) = reads.values()
    line = _line_of(encoder_forward, "# reads")
    assert r.value is True and r.site.endswith(f"{HERE}:{line}") and not r.varied
    with hc.substituting(w, e):
        out = encoder_forward(enc, x)
    assert torch.equal(out, ref)
    assert "1 host read of constant device values answered at capture" in hc.describe(e)


def scalar_read():
    t = torch.full((3,), 2.0)
    t.add_(torch.arange(3.0))  # in place, with a constant
    return t.sum().item()


def test_the_value_answered_is_the_recorded_one():
    w, e = watch("cpu"), Entry()
    observe(w, e, scalar_read)
    (r,) = e.host_copies.reads.values()
    assert r.value == 9.0
    r.value = 42.0  # what the record says is what the capture gets: no read happens
    with hc.substituting(w, e):
        assert scalar_read() == 42.0


def test_reads_of_equal_and_to_cpu():
    """torch.equal and a copy to the host (.cpu(), .tolist()) of constants. With the
    CPU playing the device, a copy to "cpu" stands for the device-to-host copy."""
    w, e = watch("cpu"), Entry()

    def fwd():
        a = torch.arange(4)
        b = torch.arange(4)
        return torch.equal(a, b), a.to("cpu", copy=True).tolist()

    observe(w, e, fwd)
    values = [r.value for r in e.host_copies.reads.values()]
    assert values[0] is True and torch.equal(values[1], torch.arange(4)), values
    values[1].fill_(7)  # the record is what the capture gets
    e.host_copies.reads[list(e.host_copies.reads)[1]].value = values[1]
    with hc.substituting(w, e):
        assert fwd() == (True, [7, 7, 7, 7])


def test_a_read_of_inputs_or_weights_refuses_as_a_host_synchronisation():
    w, e = watch("cpu"), Entry()
    weight = nn.Parameter(torch.ones(3))
    x = torch.randn(3)

    def fwd():
        return bool((x * weight > 0).any())  # data-dependent

    observe(w, e, fwd)
    assert not e.host_copies.reads

    text = _refused_at_capture(w, e, fwd)
    line = _line_of(fwd, "# data-dependent")
    assert "a host synchronisation at " in text and f"{HERE}:{line}" in text
    assert "computed from the model's inputs or weights" in text


def test_writes_forget_constants():
    """A constant written in place with a non-constant (through a view too) is no
    longer a constant; random and uninitialised tensors never are; a fresh
    fill_ of an empty tensor is."""
    x = torch.randn(3)
    cases = {
        "view written": lambda: _write_through_view(x),
        "random": lambda: bool((torch.rand(3) > 2).any()),
        "empty": lambda: bool((torch.empty(3) > 2).any()),
    }
    for name, fn in cases.items():
        w, e = watch("cpu"), Entry()
        observe(w, e, fn)
        assert not e.host_copies.reads, name
    w, e = watch("cpu"), Entry()
    observe(w, e, lambda: bool((torch.empty(3).fill_(1.0) > 0).all()))
    assert len(e.host_copies.reads) == 1


def _write_through_view(x):
    m = torch.zeros(3)
    m[1:].add_(x[1:])  # the base's storage is written with an input
    return bool((m > 0).any())


def test_a_read_whose_recipe_was_not_observed_refuses():
    w, e = watch("cpu"), Entry()
    observe(w, e, lambda: torch.full((2,), 1.0).sum().item())

    another_constant = lambda: torch.full((2,), 2.0).sum().item()  # noqa: E731
    assert "that the warm-up iterations did not read" in _refused_at_capture(w, e, another_constant)


def test_reads_that_differed_between_warm_ups_refuse():
    w, e = watch("cpu"), Entry()
    observe(w, e, lambda: torch.full((2,), 1.0).sum().item())
    (r,) = e.host_copies.reads.values()
    r.varied = "the value differed between iterations (a non-deterministic op)"

    assert "read differently" in _refused_at_capture(w, e, lambda: torch.full((2,), 1.0).sum().item())


def test_higher_order_operators_run_and_forget():
    w, e = watch("cpu"), Entry()
    x = torch.ones(3)

    def fwd():
        c = torch.full((3,), 1.0)
        y = torch.cond(x.sum() > 0, lambda t: t + 1, lambda t: t - 1, (c,))
        return y, bool((c > 0).all())

    with hc.observing(w, e):
        y, flag = fwd()
    assert torch.equal(y, torch.full((3,), 2.0)) and flag
    assert not e.host_copies.reads  # the cond op forgot every constant


def test_digests_are_bitwise():
    assert hc.same_value(float("nan"), float("nan")) and not hc.same_value(0.0, -0.0)
    assert not hc.same_value(1, True) and hc.same_value(torch.zeros(2), torch.zeros(2))
    assert hc.value_digest(torch.zeros(2)) != hc.value_digest(-torch.zeros(2))
    assert hc.value_digest(torch.zeros(2)) != hc.value_digest(torch.zeros(2, dtype=torch.float64))


# =================================================================== check mode
def test_check_every_reads_the_environment(monkeypatch):
    monkeypatch.setenv(hc.CHECK_ENV, "3")
    w = hc.HostWatch(enabled=True, device_type="meta", pin=False)
    assert w.check_every == 3
    monkeypatch.setenv(hc.CHECK_ENV, "often")
    with pytest.raises(ValueError, match=hc.CHECK_ENV):
        hc.HostWatch()
    monkeypatch.delenv(hc.CHECK_ENV)
    assert hc.HostWatch().check_every == 0


class _Policy:
    reason = ""

    def reject(self, reason):
        self.reason = reason


class _Cache:
    def __init__(self):
        self.events, self.released = [], []

    def release(self, entry):
        self.released.append(entry)
        entry.host_copies = None

    def event(self, entry, iteration, what, detail):
        self.events.append((what, detail))


def test_check_mode_verifies_every_nth_replay_and_drops_a_changed_graph(monkeypatch):
    monkeypatch.setenv(hc.CHECK_ENV, "2")
    w, e = watch(), Entry()
    e.description, e.policy = "x", _Policy()
    for _ in range(2):
        with hc.observing(w, e):
            step_mask(1)
    assert e.host_copies.checking
    assert [hc.check_due(e) for _ in range(4)] == [False, True, False, True]
    cache = _Cache()
    with hc.verifying(e) as session:
        step_mask(1)  # unchanged
    hc.conclude_check(session, e, cache, 10, collective=False)
    assert not session.changed and not cache.released
    with hc.verifying(e) as session:
        step_mask(2)  # moved on
    assert "changed since the capture (2 of 2 values differ)" in session.changed
    hc.conclude_check(session, e, cache, 11, collective=False)
    assert cache.released == [e] and "check mode" in e.policy.reason and hc.CHECK_ENV in e.policy.reason
    assert cache.events[0][0] == "host copies changed"


def test_run_checked_runs_the_iteration_and_drops_changed_graphs(monkeypatch):
    """The engine's, tier 2's and evaluation's check-mode branch: the iteration
    runs as written (its result handed back), the guard lets go of a matched
    call's tensors, and copies that moved release the entry's graphs."""
    monkeypatch.setenv(hc.CHECK_ENV, "1")
    w, e = watch(), Entry()
    e.description, e.policy = "x", _Policy()
    discarded = []
    e.guard = SimpleNamespace(discard=lambda: discarded.append(True))
    observe(w, e, lambda: step_mask(1))
    cache = _Cache()
    assert hc.run_checked(e, lambda: (step_mask(1), "out")[1], cache=cache, iteration=5, leaves=[1],
                          collective=False) == "out"
    assert not cache.released and not discarded
    assert hc.run_checked(e, lambda: (step_mask(2), "out2")[1], cache=cache, iteration=6, leaves=None,
                          collective=False) == "out2"
    assert discarded == [True] and cache.released == [e] and "changed since the capture" in e.policy.reason


def test_check_mode_off_or_without_copies():
    w, e = watch(), Entry()
    observe(w, e, forward_mask)
    assert w.check_every == 0 or not os.environ.get(hc.CHECK_ENV)
    w.check_every = 0
    assert not e.host_copies.checking and not hc.check_due(e)
    w2, e2 = watch("cpu"), Entry()
    w2.check_every = 1
    observe(w2, e2, scalar_read)  # reads only: constants need no check
    assert not e2.host_copies.checking


# ======================================================================== GPU cases
class WordLM(nn.Module):
    """PyTorch's word-language-model pattern: the causal mask made on the host in
    forward and copied to the GPU, fed to an nn.TransformerEncoder (whose causal
    check then reads the mask on the host). ``loss``: the module returns the loss
    (tier 1); otherwise the log-probabilities (the loop's loss: tier 2).
    ``step_tensor``: a host tensor made from the loop's step counter (``self.step``),
    different every step; ``change_at``: the same host tensor, 0 until that step;
    ``list_index``: indexing with a Python list in forward."""

    def __init__(self, vocab=50, width=32, heads=2, layers=2, loss=True, step_tensor=False, change_at=0,
                 list_index=False):
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        layer = nn.TransformerEncoderLayer(width, heads, 2 * width, dropout=0.1)  # seq-first, as the example
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(width, vocab)
        self.width, self.vocab, self.loss, self.step_tensor = width, vocab, loss, step_tensor
        self.change_at = change_at
        self.list_index = list_index
        self.step = 0

    def forward(self, src, target=None):
        mask = nn.Transformer.generate_square_subsequent_mask(src.shape[0]).to(src.device)  # HOST COPY
        h = self.emb(src) * math.sqrt(self.width)
        if self.step_tensor:
            h = h + torch.tensor(float(self.step % 7) / 100).to(src.device)  # STEP COPY
        if self.change_at:
            later = 0.01 if self.step >= self.change_at else 0.0
            h = h + torch.tensor([later]).to(src.device)  # LATER COPY
        if self.list_index:  # falcon's fused_qkv[..., [-2], :]: a list index torch copies to the device
            h = torch.cat([h[..., :-1], h[..., [-1]] * 0.5], dim=-1)  # LIST INDEX
        out = F.log_softmax(self.head(self.encoder(h, mask=mask)), dim=-1)
        if self.loss and target is not None:
            return F.nll_loss(out.view(-1, self.vocab), target.view(-1))
        return out


def lm_data(step, rank, T=12, batch=4, vocab=50, device="cpu"):
    g = torch.Generator().manual_seed(7000 + 100 * rank + step)
    x = torch.randint(0, vocab, (T, batch), generator=g)
    return x.to(device), torch.roll(x, -1, 0).to(device)


def _graph_rows(rep):
    return [{"inputs": g.inputs, "tier": g.tier, "was_tier": g.was_tier, "phase": g.phase,
             "replays": g.replays, "reason": g.reason, "where": getattr(g, "where", "")}
            for g in rep.graphs]


def gpu_word_lm(tier=1, steps=16, step_tensor=0, evaluate=1, change_at=0, check_every=0, list_index=0):
    """Train the word-language-model pattern graphed and with graphs=False (same
    seeds), then evaluate under no_grad (eval mode); parameters and evaluation
    outputs compared bit for bit. ``check_every``: PYGRAPH_DIST_CHECK_HOST_COPIES."""
    import pygraph_dist as pgd

    from common import device, flat_params, ranks_agree

    if check_every:
        os.environ[hc.CHECK_ENV] = str(check_every)  # read at wrap()
    pgd.init()
    rank = dist.get_rank()
    dev = device()
    out = {}
    for graphs in (True, False):
        torch.manual_seed(0)
        base = WordLM(loss=tier == 1, step_tensor=bool(step_tensor), change_at=change_at,
                      list_index=bool(list_index)).to(dev)
        model, opt = pgd.wrap(base, torch.optim.AdamW(base.parameters(), lr=1e-3), graphs=graphs,
                              select=False)
        torch.manual_seed(1)
        losses = []
        for step in range(steps):
            x, y = lm_data(step, rank, device=dev)
            base.step = step  # the loop's counter (a failed capture runs forward twice in one step)
            opt.zero_grad(set_to_none=True)
            if tier == 1:
                loss = model(x, y)
            else:
                logp = model(x)
                loss = F.nll_loss(logp.view(-1, base.vocab), y.view(-1))
            loss.backward()
            opt.step()
            losses.append(float(loss))
        evals = []
        if evaluate:
            model.eval()
            with torch.no_grad():
                for b in range(6):
                    x, y = lm_data(100 + b, rank, device=dev)
                    evals.append(model(x).double().sum().item())
            model.train()
        rep = pgd.report().models[-1]
        out["graphed" if graphs else "eager"] = {
            "params": flat_params(base).tolist(), "losses": losses, "evals": evals,
            "ranks_agree": ranks_agree(flat_params(base), dev),
            "graphs": _graph_rows(rep), "events": list(rep.events),
            "eval_replays": rep.eval_replays, "report": str(pgd.report())}
    return out


def _assert_bitwise(r):
    g, e = r["graphed"], r["eager"]
    assert g["losses"] == e["losses"], (g["losses"], e["losses"], g["report"])
    assert g["params"] == e["params"], g["report"]
    assert g["evals"] == e["evals"], (g["evals"], e["evals"], g["report"])


@pytest.mark.gpu
@pytest.mark.parametrize("tier", [1, 2])
def test_a_mask_copied_in_forward_is_graphed_bitwise(ranks, tier):
    """Training (tier 1: the module returns the loss; tier 2: the loop computes
    it) and graphed evaluation under no_grad, replayed, bit for bit as graphs=False."""
    (r,) = ranks("test_host_copies:gpu_word_lm", world_size=1, timeout=400, kwargs={"tier": tier})
    _assert_bitwise(r)
    g = r["graphed"]
    train = [x for x in g["graphs"] if x["tier"] != "eval"]
    evals = [x for x in g["graphs"] if x["tier"] == "eval"]
    assert len(train) == 1 and train[0]["phase"] == "replay" and train[0]["replays"] >= 4, g["report"]
    assert train[0]["tier"] == str(tier), g["report"]
    assert len(evals) == 1 and evals[0]["phase"] == "replay" and g["eval_replays"] >= 3, g["report"]
    captured = [e for e in g["events"] if e["event"] == "captured"]
    assert any("host-to-device cop" in e["detail"] and HERE in e["detail"] for e in captured), g["report"]
    assert any("host read" in e["detail"] for e in captured), g["report"]  # the encoder's causal check


@pytest.mark.gpu
@pytest.mark.parametrize("tier", [1, 2])
def test_a_list_index_in_forward_is_graphed_bitwise(ranks, tier):
    """x[..., [-1]] in forward (falcon's attention): the list's copy is graphed at
    its line, in the forward and in the backward's index_put, bit for bit."""
    (r,) = ranks("test_host_copies:gpu_word_lm", world_size=1, timeout=400,
                 kwargs={"tier": tier, "list_index": 1, "evaluate": 1})
    _assert_bitwise(r)
    g = r["graphed"]
    train = [x for x in g["graphs"] if x["tier"] != "eval"]
    assert len(train) == 1 and train[0]["phase"] == "replay" and train[0]["replays"] >= 4, g["report"]
    line = _line_of(WordLM.forward, "# LIST INDEX")
    captured = [e for e in g["events"] if e["event"] == "captured"]
    assert any(f"{HERE}:{line}" in e["detail"] for e in captured), g["report"]


@pytest.mark.gpu
def test_a_host_tensor_that_changes_every_step_runs_eagerly_with_its_line(ranks):
    (r,) = ranks("test_host_copies:gpu_word_lm", world_size=1, timeout=400,
                 kwargs={"tier": 1, "step_tensor": 1, "steps": 14, "evaluate": 0})
    _assert_bitwise(r)
    g = r["graphed"]
    (row,) = g["graphs"]
    line = _line_of(WordLM.forward, "# STEP COPY")
    assert row["phase"] == "eager" and row["replays"] == 0, g["report"]
    assert "changed between iterations" in row["reason"] and f"{HERE}:{line}" in row["reason"], row["reason"]


@pytest.mark.multigpu
def test_a_mask_copied_in_forward_is_graphed_on_two_ranks(ranks):
    """The failed first capture, its retry and the refusals are agreed by both ranks."""
    results = ranks("test_host_copies:gpu_word_lm", world_size=2, timeout=400, kwargs={"tier": 1})
    for r in results:
        _assert_bitwise(r)
        g = r["graphed"]
        assert g["ranks_agree"], g["report"]
        train = [x for x in g["graphs"] if x["tier"] != "eval"]
        assert train[0]["phase"] == "replay" and train[0]["replays"] >= 4, g["report"]


@pytest.mark.gpu
def test_check_mode_drops_the_graph_when_a_host_tensor_changes(ranks):
    """PYGRAPH_DIST_CHECK_HOST_COPIES=1: every iteration after the capture runs
    eagerly and watched; the host tensor that changes at step 13 drops the graph
    there, and training stays bitwise equal to graphs=False."""
    (r,) = ranks("test_host_copies:gpu_word_lm", world_size=1, timeout=400,
                 kwargs={"tier": 1, "change_at": 13, "steps": 16, "evaluate": 0, "check_every": 1})
    _assert_bitwise(r)
    g = r["graphed"]
    (row,) = g["graphs"]
    line = _line_of(WordLM.forward, "# LATER COPY")
    assert row["phase"] == "eager", g["report"]
    assert "changed since the capture" in row["reason"] and hc.CHECK_ENV in row["reason"], row["reason"]
    assert f"{HERE}:{line}" in row["reason"], row["reason"]
    assert any(e["event"] == "host copies changed" for e in g["events"]), g["report"]
    assert any(e["event"] == "captured" for e in g["events"]), g["report"]
