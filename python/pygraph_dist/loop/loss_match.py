"""Tier 2's loss lane, step by step: a model call's outputs matched against
the learned loss (:mod:`~pygraph_dist.loop.loss_lane` says what the lane is and how
the loss is learned).

:class:`LaneRun` watches the calls made on one model call's outputs. The
learned loss's calls are recognised in order (the function, the structure of
the arguments, which output or earlier result each tensor is, the other
tensors' shape, dtype and device, every plain value, autocast and grad mode);
the last one hands out a pending loss, and ``loss.backward()`` asks the engine
to replay the ``"lane"`` graph (``commit``). Anything else leaves the lane for
the step, with the loss computed eagerly from the values it was computed from.
"""

from __future__ import annotations

import weakref

import torch
import torch.utils._pytree as pytree

from .loss_lane import (
    _METADATA, COMMITTED, HOOKS, MATCHING, OFF, PENDING, LaneTensor, LossTrace, TraceOp, _backward_target,
    _call_text, _mutating, _name, _owner, _plain, _run, _tensors_of, changed, rebuild, track, version
)


class LaneRun:
    """One model call of a step whose loss the ``"lane"`` graph can compute
    (module docstring). ``commit(run)`` (the engine's) replays the graph at
    ``loss.backward()`` and returns whether it could."""

    def __init__(self, trace: LossTrace, exts: list[torch.Tensor], loss_meta: tuple, commit) -> None:
        self.trace, self.static_exts, self.loss_meta, self.commit = trace, exts, loss_meta, commit
        self.call = None  # split._Call: the model call whose outputs these are
        self.ext_seen: dict[int, torch.Tensor] = {}  # this step's tensor for each of the trace's others
        self.live = True
        self.state = MATCHING
        self.pos = 0
        self._pending = lambda: None  # a weak reference to the pending loss handed out
        self.derived: list = []  # weak references to its detach()/clone() copies, waiting too
        self.real = None  # the loss computed eagerly, once the lane is off after the loss call
        self.terminal_call = None  # (op, leaves) of the loss's call, to compute it eagerly
        self.why = ""  # why this step left the lane
        self.versions: list = []  # (weak ref, _version) of the outputs and the trace's results

    def wrap_outputs(self, tensors) -> list:
        """The forward graph's fresh output copies (inside ``_GraphedCall.forward``)."""
        wrapped = [track(t, self, i, fresh=True) for i, t in enumerate(tensors)]
        self.versions = [(weakref.ref(t), version(t)) for t in wrapped]
        return wrapped

    # ------------------------------------------------------------- calls
    def op(self, func, args, kwargs):
        state = self.state
        if state is MATCHING:
            return self._matching(func, args, kwargs)
        if state is PENDING:
            return self._on_pending(func, args, kwargs)
        if state is OFF and self.real is not None:
            args, kwargs = self._swap(args, kwargs)
        elif state is COMMITTED and (func is torch.Tensor.backward or func is torch.autograd.backward):
            target, _ = _backward_target(func, args, kwargs)
            if target is self.pending:
                raise RuntimeError(
                    "Trying to backward through the graph a second time: backward() was already "
                    "called on this loss (pygraph_dist replayed it inside the backward graph).")
        return _plain(func, args, kwargs)

    def _matching(self, func, args, kwargs):
        trace = self.trace
        if func is torch.Tensor.backward or func is torch.autograd.backward:
            self.off("backward() was called on a tensor other than the learned loss")
            return _plain(func, args, kwargs)
        op = trace.ops[self.pos]
        # Another function (loss.numel(), out.shape for logging): no flatten.
        leaves, spec = pytree.tree_flatten((args, kwargs)) if func is op.func else (None, None)
        if leaves is None or not self._matches(op, leaves, spec):
            name = _name(func)
            if _mutating(name, kwargs):
                self.off(f"{name}() changed an output of the model call in place")
            elif name in HOOKS:
                self.off(f"{name}() on an output of the model call")
            return _plain(func, args, kwargs)
        for (k, v), x in zip(op.code, leaves):
            if k == "e":
                self.static_exts[v].copy_(x)
        if self.pos == len(trace.ops) - 1:
            if changed(self.versions):  # through a view or detach() of an output, or no_grad
                self.off("an output of the model call was changed in place before the loss")
                return _plain(func, args, kwargs)
            return self._loss_call(op, leaves)
        self.pos += 1
        result = _plain(func, args, kwargs)
        tensors = _tensors_of(result)
        if tensors is None or len(tensors) != len(op.outs):
            self.off(f"{_name(func)}() returned something else than when the loss was learned")
            return result
        wrapped = [track(t, self, s) for t, s in zip(tensors, op.outs)]
        self.versions.extend((weakref.ref(t), version(t)) for t in wrapped)
        return rebuild(result, wrapped)

    def _matches(self, op: TraceOp, leaves: list, spec) -> bool:
        if len(leaves) != len(op.code) or spec != op.spec:
            return False
        for x, (k, v) in zip(leaves, op.code):
            if k == "s":
                if not (isinstance(x, LaneTensor) and x._pgd_owner is self and x._pgd_slot == v):
                    return False
            elif k == "e":
                shape, dtype, device = self.trace.exts[v]
                if not isinstance(x, torch.Tensor) or (isinstance(x, LaneTensor) and x._pgd_owner is self) \
                        or x.dtype != dtype or x.device != device or tuple(x.shape) != shape \
                        or x.requires_grad or x.layout != torch.strided or not x.is_contiguous() \
                        or self.ext_seen.setdefault(v, x) is not x:
                    return False
            elif type(x) is not type(v) or x != v:
                return False
        enabled, dtype = op.autocast
        have = torch.is_autocast_enabled(self.trace.device_type)
        return torch.is_grad_enabled() and have == enabled and (
            not enabled or torch.get_autocast_dtype(self.trace.device_type) == dtype)

    def _loss_call(self, op: TraceOp, leaves: list):
        """The call that computes the loss: its tensors into the static copies,
        a pending loss handed out."""
        self.terminal_call = (op, leaves)
        shape, dtype, device = self.loss_meta
        pending = torch.Tensor._make_subclass(LaneTensor, torch.empty(shape, dtype=dtype, device=device), True)
        pending._pgd_owner, pending._pgd_slot, pending._pgd_waiting = self, self.trace.terminal, True
        # Weak: the pending loss points here (its owner); a strong reference back
        # would keep both, and the eagerly computed loss with its autograd graph,
        # until the cyclic garbage collector runs.
        self._pending = weakref.ref(pending)
        self.state = PENDING
        return pending

    def _on_pending(self, func, args, kwargs):
        if func is torch.Tensor.backward or func is torch.autograd.backward:
            target, extra = _backward_target(func, args, kwargs)
            if target is self.pending and not extra:
                if self.commit(self):
                    self.state = COMMITTED
                    self.terminal_call = None
                    return None
            elif target is not self.pending and _owner((target,), {}) is not self:
                return _plain(func, args, kwargs)  # a backward of something else entirely
        elif (func is torch.Tensor.detach or func is torch.Tensor.clone) and len(args) == 1 and not kwargs \
                and self._waiting(args[0]):
            # loss.detach() for logging, Lightning's detach().clone(): a copy that
            # waits for the value too (no autograd through a detached copy).
            return self._derive(grad=func is torch.Tensor.clone and args[0].requires_grad)
        elif _name(func) in _METADATA or (
                not self._involves_pending(args, kwargs) and not _mutating(_name(func), kwargs)
                and _name(func) not in HOOKS):
            return _plain(func, args, kwargs)  # the loss's shape, or another call on an output (logging)
        self.realize(self.why or f"the loss was read before backward() ({_call_text(func)})")
        args, kwargs = self._swap(args, kwargs)
        return _plain(func, args, kwargs)

    @property
    def pending(self):
        return self._pending()

    def _waiting(self, x) -> bool:
        """``x`` is the pending loss, or a copy of it, still without its value."""
        return isinstance(x, LaneTensor) and x._pgd_owner is self and x._pgd_waiting

    def _involves_pending(self, args, kwargs) -> bool:
        return any(self._waiting(x) for x in pytree.tree_leaves((args, kwargs)))

    def _derive(self, *, grad: bool) -> LaneTensor:
        shape, dtype, device = self.loss_meta
        d = torch.Tensor._make_subclass(LaneTensor, torch.empty(shape, dtype=dtype, device=device), grad)
        d._pgd_owner, d._pgd_slot, d._pgd_waiting = self, -1, True
        self.derived.append(weakref.ref(d))
        return d

    def _waiting_copies(self) -> list:
        return [d for d in (r() for r in self.derived) if d is not None]

    def fill(self, value: torch.Tensor) -> None:
        """The graph computed the loss: ``value`` into the pending loss and its copies."""
        for t in [self.pending, *self._waiting_copies()]:
            if t is not None:
                _fill(t, value)
                t._pgd_waiting = False
        self.derived = []

    # ----------------------------------------------------------- leaving
    def realize(self, why: str) -> None:
        """Leave the lane after the loss call: the loss computed eagerly now, from
        the values the loss call saw (the static copies of its other tensors)."""
        if self.state is not PENDING:
            return
        if changed(self.versions):
            raise RuntimeError(
                "An output of the model call (or a tensor computed from it) was changed in place after "
                "the loss was computed from it and before the loss was read or backward() was called: "
                "pygraph_dist cannot compute the loss as it was. Change it after backward(), or "
                "wrap(..., loss_graphs=False).")
        op, leaves = self.terminal_call
        self.terminal_call = None
        p, copies = self.pending, self._waiting_copies()
        if p is not None or copies:  # else nobody holds the loss any more: nothing to compute
            leaves = [self.static_exts[v] if k == "e" else x for (k, v), x in zip(op.code, leaves)]
            real = self.real = _run(op, leaves, self.trace.device_type)
            if p is not None:
                p._pgd_real, p._pgd_waiting = real, False
            for d in copies:  # a detached copy takes the value; a clone stands for real.clone()
                if d.requires_grad:
                    d._pgd_real = real.clone()
                else:
                    _fill(d, real.detach())
                d._pgd_waiting = False
        self.derived = []
        self.off(why)

    def off(self, why: str) -> None:
        self.state = OFF
        if not self.why:
            self.why = why

    def end(self, why: str) -> None:
        """The step is over (``optimizer.step()``, or the next model call)."""
        if self.state is PENDING:
            self.realize(why)
        elif self.state is MATCHING:
            self.off("the learned loss was not computed in this step")
        self.live = self.state is OFF and self.real is not None  # the pending loss stays a proxy
        # Nothing of the step is needed any more: no cycle through the outputs
        # (they point here) may keep them, or the loss's autograd graph, alive.
        self.terminal_call = None
        self.ext_seen.clear()
        if self.real is not None:  # the loss's autograd graph goes with the step
            self.real = self.real.detach()
            p = self.pending
            if p is not None:
                p._pgd_real = self.real
        if self.call is not None:
            self.call.lane = None
            self.call = None

    def _swap(self, args, kwargs):
        """The eagerly computed loss (or its clone) for the pending one in a call."""
        if self.real is None:
            return args, kwargs
        return pytree.tree_map(lambda x: getattr(x, "_pgd_real", x) if isinstance(x, LaneTensor) else x,
                               (args, kwargs))


def _fill(t: torch.Tensor, value: torch.Tensor) -> None:
    with torch._C.DisableTorchFunctionSubclass(), torch.no_grad():
        t.detach().copy_(value)

