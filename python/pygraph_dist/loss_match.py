"""Tier 2's loss lane, step by step: a model call's outputs matched against
the learned loss (:mod:`~pygraph_dist.loss_lane` says what the lane is and how
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
    _call_text, _mutating, _name, _owner, _plain, _run, _tensors_of, changed, rebuild, track, version,
)


class LaneRun:
    """One model call of a step whose loss the ``"lane"`` graph can compute
    (module docstring). ``commit(run)`` (the engine's) replays the graph at
    ``loss.backward()`` and returns whether it could.

    Waiting tensors (``_pgd_waiting``; ``_pgd_src``: the slot whose value they
    take): the pending loss, the results of the loss's deferred calls
    (``trace.deferred``: ``cross_entropy`` before ``/ k``) and ``detach()`` /
    ``clone()`` copies of either. The graph's values fill them at
    ``backward()``; a step that leaves the lane computes them eagerly (their
    ``_pgd_real``), from the values their calls saw."""

    def __init__(self, trace: LossTrace, exts: list[torch.Tensor], loss_meta: tuple, commit) -> None:
        self.trace, self.static_exts, self.loss_meta, self.commit = trace, exts, loss_meta, commit
        self.call = None  # split._Call: the model call whose outputs these are
        self.ext_seen: dict[int, torch.Tensor] = {}  # this step's tensor for each of the trace's others
        self.live = True
        self.state = MATCHING
        self.pos = 0
        self._pending = lambda: None  # a weak reference to the pending loss handed out
        self.waiting: dict = {}  # slot -> weak reference to a deferred call's waiting result
        self.derived: list = []  # weak references to detach()/clone() copies of waiting tensors
        self.deferred_calls: list = []  # (op, leaves) of the deferred calls not computed
        self.reals: dict = {}  # slot -> value computed eagerly (once the step left the lane)
        self.real = None  # the loss computed eagerly, once the lane is off after the loss call
        self.swapping = False  # some waiting tensor has a value computed eagerly (_swap)
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
        if state is OFF and self.swapping:
            args, kwargs = self._swap(args, kwargs)
        elif state is COMMITTED and (func is torch.Tensor.backward or func is torch.autograd.backward):
            target, _ = _backward_target(func, args, kwargs)
            if isinstance(target, LaneTensor) and target._pgd_owner is self and getattr(target, "_pgd_src", None) \
                    is not None:
                raise RuntimeError(
                    "Trying to backward through the graph a second time: backward() was already "
                    "called on this loss (pygraph_dist replayed it inside the backward graph).")
        return _plain(func, args, kwargs)

    def _matching(self, func, args, kwargs):
        trace = self.trace
        if func is torch.Tensor.backward or func is torch.autograd.backward:
            self.off("backward() was called on a tensor other than the learned loss")
            return self._eager(func, args, kwargs)
        op = trace.ops[self.pos]
        # Another function (loss.numel(), out.shape for logging): no flatten.
        leaves, spec = pytree.tree_flatten((args, kwargs)) if func is op.func else (None, None)
        if leaves is None or not self._matches(op, leaves, spec):
            name = _name(func)
            if self.waiting and self._involves_pending(args, kwargs):  # a deferred result, read
                copy = self._derive_call(func, args, kwargs)
                if copy is not None or name in _METADATA:
                    return copy if copy is not None else _plain(func, args, kwargs)
                self.off(f"the loss was read before backward() ({_call_text(func)})")
            elif _mutating(name, kwargs):
                self.off(f"{name}() changed an output of the model call in place")
            elif name in HOOKS:
                self.off(f"{name}() on an output of the model call")
            return self._eager(func, args, kwargs)
        for (k, v), x in zip(op.code, leaves):
            if k == "e":
                self.static_exts[v].copy_(x)
        if self.pos == len(trace.ops) - 1:
            if changed(self.versions):  # through a view or detach() of an output, or no_grad
                self.off("an output of the model call was changed in place before the loss")
                return self._eager(func, args, kwargs)
            return self._loss_call(op, leaves)
        if trace.deferred[self.pos]:  # waits for the graph too (a scalar only the loss reads)
            self.pos += 1
            self.deferred_calls.append((op, leaves))
            return self._waiting_result(op.outs[0])
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

    def _new_waiting(self, src: int, grad: bool) -> LaneTensor:
        """An empty tensor shaped as slot ``src``'s value, waiting for it."""
        shape, dtype = self.loss_meta[:2] if src == self.trace.terminal else self.trace.meta[src][:2]
        w = torch.Tensor._make_subclass(LaneTensor, torch.empty(shape, dtype=dtype, device=self.loss_meta[2]), grad)
        w._pgd_owner, w._pgd_src, w._pgd_waiting = self, src, True
        return w

    def _waiting_result(self, slot: int) -> LaneTensor:
        w = self._new_waiting(slot, self.trace.meta[slot][2])
        w._pgd_slot = slot  # matched by the loss's later calls
        self.waiting[slot] = weakref.ref(w)
        return w

    def _loss_call(self, op: TraceOp, leaves: list):
        """The call that computes the loss: its tensors into the static copies,
        a pending loss handed out."""
        self.terminal_call = (op, leaves)
        pending = self._new_waiting(self.trace.terminal, True)
        pending._pgd_slot = self.trace.terminal
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
                    self.deferred_calls = []
                    return None
            elif target is not self.pending and _owner((target,), {}) is not self:
                return _plain(func, args, kwargs)  # a backward of something else entirely
        else:
            copy = self._derive_call(func, args, kwargs)
            if copy is not None:
                return copy
            if _name(func) in _METADATA or (
                    not self._involves_pending(args, kwargs) and not _mutating(_name(func), kwargs)
                    and _name(func) not in HOOKS):
                return _plain(func, args, kwargs)  # the loss's shape, or another call on an output (logging)
        self.realize(self.why or f"the loss was read before backward() ({_call_text(func)})")
        return self._eager(func, args, kwargs)

    @property
    def pending(self):
        return self._pending()

    def _waiting(self, x) -> bool:
        """``x`` is the pending loss, a deferred result or a copy, still without its value."""
        return isinstance(x, LaneTensor) and x._pgd_owner is self and getattr(x, "_pgd_waiting", False)

    def _involves_pending(self, args, kwargs) -> bool:
        return any(self._waiting(a) for a in args) or any(self._waiting(a) for a in kwargs.values()) or any(
            isinstance(a, (list, tuple)) and any(self._waiting(b) for b in a) for a in args)

    def _derive_call(self, func, args, kwargs):
        """``loss.detach()`` for logging, Lightning's ``detach().clone()``: a copy
        that waits for the value too (no autograd through a detached copy)."""
        if (func is torch.Tensor.detach or func is torch.Tensor.clone) and len(args) == 1 and not kwargs \
                and self._waiting(args[0]):
            d = self._new_waiting(args[0]._pgd_src, func is torch.Tensor.clone and _grad(args[0]))
            d._pgd_slot = -1
            self.derived.append(weakref.ref(d))
            return d
        return None

    def _waiting_copies(self) -> list:
        return [d for d in (r() for r in self.derived) if d is not None]

    def fill(self, value: torch.Tensor, inter: dict | None = None) -> None:
        """The graph computed the loss: ``value`` (and ``inter``, the deferred
        results by slot) into the waiting tensors."""
        values = dict(inter or {})
        values[self.trace.terminal] = value
        for t in [self.pending, *(r() for r in self.waiting.values()), *self._waiting_copies()]:
            if t is not None and t._pgd_waiting and t._pgd_src in values:
                _fill(t, values[t._pgd_src])
                t._pgd_waiting = False
        self.derived = []

    # ----------------------------------------------------------- leaving
    def _compute_waiting(self) -> None:
        """The deferred calls computed eagerly, in order, from the values they saw."""
        if not self.deferred_calls:
            return
        self._check_unchanged()
        for op, leaves in self.deferred_calls:
            self.reals[op.outs[0]] = _run(op, self._real_leaves(op, leaves), self.trace.device_type)
        self.deferred_calls = []
        self._settle([r() for r in self.waiting.values()])

    def _real_leaves(self, op: TraceOp, leaves: list) -> list:
        return [self.static_exts[v] if k == "e" else self.reals.get(v, x) if k == "s" else x
                for (k, v), x in zip(op.code, leaves)]

    def _settle(self, waiting: list) -> None:
        """Waiting tensors whose slot has a value computed eagerly take it (a
        detached copy its bytes; the others stand for it, or for its clone)."""
        for t in [*waiting, *self._waiting_copies()]:
            if t is None or not t._pgd_waiting or t._pgd_src not in self.reals:
                continue
            real = self.reals[t._pgd_src]
            if t._pgd_slot >= 0:
                t._pgd_real = real
            elif _grad(t):
                t._pgd_real = real.clone()
            else:
                _fill(t, real.detach())
            t._pgd_waiting = False
            self.swapping = True

    def _check_unchanged(self) -> None:
        if changed(self.versions):
            raise RuntimeError(
                "An output of the model call (or a tensor computed from it) was changed in place after "
                "the loss was computed from it and before the loss was read or backward() was called: "
                "pygraph_dist cannot compute the loss as it was. Change it after backward(), or "
                "wrap(..., loss_graphs=False).")

    def realize(self, why: str) -> None:
        """Leave the lane after the loss call: the loss computed eagerly now, from
        the values the loss call saw (the static copies of its other tensors)."""
        if self.state is not PENDING:
            return
        self._check_unchanged()
        op, leaves = self.terminal_call
        self.terminal_call = None
        p = self.pending
        if p is not None or self._waiting_copies() or any(r() is not None for r in self.waiting.values()):
            # else nobody holds the loss or what it was computed from: nothing to compute
            self._compute_waiting()
            real = self.real = self.reals[self.trace.terminal] = _run(
                op, self._real_leaves(op, leaves), self.trace.device_type)
            if p is not None:
                p._pgd_real, p._pgd_waiting = real, False
                self.swapping = True
            self._settle([])
        self.deferred_calls = []
        self.derived = []
        self.off(why)

    def leave(self, why: str) -> None:
        """Leave the lane now, the waiting tensors computed (a waiting tensor
        pickled or copied)."""
        if self.state is PENDING:
            self.realize(why)
        elif self.state is MATCHING:
            self.off(why)

    def off(self, why: str) -> None:
        if self.deferred_calls:  # a deferred result is read (or a later call needs it): computed now
            self._compute_waiting()
        self.state = OFF
        if not self.why:
            self.why = why

    def end(self, why: str) -> None:
        """The step is over (``optimizer.step()``, or the next model call)."""
        if self.state is PENDING:
            self.realize(why)
        elif self.state is MATCHING:
            self.off("the learned loss was not computed in this step")
        self.live = self.state is OFF and self.swapping  # waiting tensors stay proxies
        # Nothing of the step is needed any more: no cycle through the outputs
        # (they point here) may keep them, or the loss's autograd graph, alive.
        self.terminal_call = None
        self.deferred_calls = []
        self.ext_seen.clear()
        if self.swapping:  # the loss's autograd graph goes with the step
            for t in [self.pending, *(r() for r in self.waiting.values())]:
                if t is not None and getattr(t, "_pgd_real", None) is not None:
                    t._pgd_real = t._pgd_real.detach()
            self.real = self.real.detach() if self.real is not None else None
        self.reals = {}
        if self.call is not None:
            self.call.lane = None
            self.call = None

    def _eager(self, func, args, kwargs):
        """``func`` as written, on the eagerly computed values of waiting tensors."""
        if self.swapping:
            args, kwargs = self._swap(args, kwargs)
        return _plain(func, args, kwargs)

    def _swap(self, args, kwargs):
        """The eagerly computed values (or their clones) for waiting tensors in a call."""
        return pytree.tree_map(lambda x: getattr(x, "_pgd_real", x) if isinstance(x, LaneTensor) else x,
                               (args, kwargs))


def _grad(t: torch.Tensor) -> bool:
    with torch._C.DisableTorchFunctionSubclass():
        return t.requires_grad


def _fill(t: torch.Tensor, value: torch.Tensor) -> None:
    with torch._C.DisableTorchFunctionSubclass(), torch.no_grad():
        t.detach().copy_(value)

