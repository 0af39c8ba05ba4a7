"""Host cost of the per-step checks over the parameters (issue 26, item 2), on a CPU.

Before every replay the engine checks every parameter (storage replaced?
requires_grad changed?) and makes every trainable ``.grad`` its bucket view;
tier 2's backward also asks whether every ``.grad`` is None. This times each
check, per call, at the parameter counts of benchmarks/host_cost.py, three ways:

  loops     the Python loops the engine ran before (graph_cache.drift's two list
            comprehensions, reducer.expose_grads' loop, all(p.grad is None ...),
            SplitGraphs.attach_grads' two list comprehensions)
  fallback  today's code without the C++ ParamWatch (reducer.watch = None)
  native    today's code with it (csrc/param_watch.h): "-" where the installed
            extension was built without it

Checks: drift (storage/requires_grad), expose (.grad views after a replay), none
(every .grad None? after zero_grad), attach (tier 2 before an accumulating
backward, every .grad already its view).

Columns: params = parameter tensors; each other column = us per call, the
minimum over --repeat timeit runs of --number calls (timeit's advice: the
minimum is the least disturbed by other load).

    python benchmarks/param_checks.py [--layers 8,32,250] [--number 2000]
"""

from __future__ import annotations

import argparse
import json
import sys
import timeit
from types import SimpleNamespace

import torch

import pygraph_dist as pgd
from pygraph_dist.reduce.reducer import GradientReducer
from pygraph_dist.tiers.split import SplitGraphs

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from host_cost import build_net  # noqa: E402


def per_call_us(fn, number: int, repeat: int) -> float:
    return min(timeit.repeat(fn, number=number, repeat=repeat)) / number * 1e6


def measure(layers: int, number: int, repeat: int) -> dict:
    net = build_net(layers)
    named = list(net.named_parameters())
    reducer = GradientReducer(named)
    params, views = reducer.params, reducer.views
    native = reducer.watch
    for p, v in zip(params, views):
        p.grad = v  # as after a replay: every .grad is its view already (the common case)
    ptrs, rg = [p.data_ptr() for p in params], [p.requires_grad for p in params]
    split = SplitGraphs(SimpleNamespace(reducer=reducer), lambda: None)

    def loops_drift():
        return [p.data_ptr() for p in params] != ptrs or [p.requires_grad for p in params] != rg

    def loops_expose():
        for p, view in zip(params, views):
            if view is not None and p.requires_grad and p.grad is not view:
                p.grad = view

    def loops_none():
        return all(p.grad is None for p in params)

    def loops_attach():
        trainable = [i for i, p in enumerate(params) if p.requires_grad]
        return [i for i in trainable if params[i].grad is not views[i]]

    def grads_none():  # the "none" check runs after zero_grad(set_to_none=True): a full pass
        for p in params:
            p.grad = None

    row = {"layers": layers, "params": len(params),
           "drift_loops": per_call_us(loops_drift, number, repeat),
           "expose_loops": per_call_us(loops_expose, number, repeat),
           "attach_loops": per_call_us(loops_attach, number, repeat)}
    grads_none()
    row["none_loops"] = per_call_us(loops_none, number, repeat)
    for impl, watch in (("fallback", None), ("native", native)):
        if impl == "native" and watch is None:
            continue
        reducer.watch = watch
        snap = reducer.param_state()
        reducer.expose_grads()
        row[f"drift_{impl}"] = per_call_us(lambda: reducer.param_state() != snap, number, repeat)
        row[f"expose_{impl}"] = per_call_us(reducer.expose_grads, number, repeat)
        row[f"attach_{impl}"] = per_call_us(split.attach_grads, number, repeat)
        grads_none()
        row[f"none_{impl}"] = per_call_us(reducer.all_grads_none, number, repeat)
    reducer.watch = native
    reducer.remove_hooks()
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", default="8,32,250")
    p.add_argument("--number", type=int, default=2000, help="calls per timeit run")
    p.add_argument("--repeat", type=int, default=5, help="timeit runs (the minimum is kept)")
    p.add_argument("--json", default="", help="also write the rows here")
    args = p.parse_args(argv)
    pgd.init()
    rows = [measure(int(n), args.number, args.repeat) for n in args.layers.split(",") if n]
    fmt = lambda r, k: f"{r[k]:>9.2f}" if k in r else f"{'-':>9}"  # noqa: E731
    checks = ("drift", "expose", "none", "attach")
    head = f"{'params':>6} " + " ".join(f"{c + '_' + i:>9}" for c in checks for i in ("py", "fb", "C"))
    print(f"us per call (min of {args.repeat} x {args.number}); torch {torch.__version__}; "
          f"drift = storage/requires_grad check, expose = .grad views, none = all .grad None, "
          f"attach = tier 2's .grad views check; "
          f"_py = the loops before, _fb = fallback, _C = native")
    print(head)
    for r in rows:
        print(f"{r['params']:>6} " + " ".join(fmt(r, f"{c}_{i}") for c in checks
                                               for i in ("loops", "fallback", "native")))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    pgd.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
