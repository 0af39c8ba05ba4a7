"""Host cost per step, this tree against another revision's Python, alternated in one run.

A host that drifts by tens of microseconds between minutes (a shared machine,
frequency changes) makes two separate ``host_cost.py`` runs incomparable, and
even one old-then-new pair can mislead. This script runs ``host_cost.py``
(spans off, no plot) for the *base* package and for this tree in turn,
``--rounds`` times (base, this, base, this, ...), in one invocation on the
same GPU, and reports per mode and parameter count:

* the median over rounds of each side's host p50 (us per step);
* the median of the paired differences ``this - base`` (round by round);
* each side's median *over the hand recipe of the same pass*: the hand
  recipe (``hand``, ``hand_tier2``) runs in every pass, so ``+hand`` is
  measured against the host as it was during that pass.

The base is a directory holding a ``pygraph_dist`` package (another
revision's ``python/``, e.g. ``git worktree add /tmp/base <rev>`` then
``--base /tmp/base/python``), imported ahead of the installed one; it uses
the installed compiled extension when it has none of its own
(``pygraph_dist/_C*.so`` is copied in), so only the Python differs.

    python benchmarks/host_cost_ab.py --base /tmp/base/python --rounds 4 \\
        --layers 8,250 --modes hand,pgd_tier1,hand_tier2,pgd_tier2

``--interleave BLOCKS`` measures finer: one long-lived process per side
(``host_cost_worker.py``) sets every mode up once, then the sides take turns
block by block (``--steps`` steps a block, base-this then this-base), so
that two sides' blocks are seconds apart and a slow minute of the host
falls on both. Each block counts as a round in the summary. It is the way
to resolve changes of a few tens of microseconds on a shared host:

    python benchmarks/host_cost_ab.py --base /tmp/base/python --interleave 40 \\
        --steps 200 --layers 8,250 --modes hand,pgd_tier1 --cpus 4,5

Writes ``<name>.json`` (every pass's rows) and ``<name>.txt`` (the table)
after every round, so a run cut short keeps what it finished; ``--budget``
starts no round that would not fit in that many seconds.
``--smoke`` runs the harness on a CPU (host_cost's own --smoke).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from host_cost import LAUNCHER_VARS  # noqa: E402 - the benchmark this drives
HOST_COST = HERE / "host_cost.py"
HAND_OF = {"pgd_tier1": "hand", "pgd_clip_in": "hand", "pgd_tier2": "hand_tier2", "pgd_clip": "hand_tier2",
           "pgd_accum4": "hand_tier2", "hand_tier2": "hand", "callables": "hand_tier2", "eager": "hand",
           "pgd_tier2_eager_loss": "hand_tier2"}


def base_package(base: Path, scratch: Path) -> Path:
    """A directory to put first on PYTHONPATH: ``base``'s pygraph_dist, with the
    installed compiled extension where ``base`` has none."""
    src = base / "pygraph_dist"
    if not (src / "__init__.py").exists():
        raise SystemExit(f"--base {base}: no pygraph_dist package there (pass a revision's python/ directory)")
    if list(src.glob("_C*.so")):
        return base
    import importlib.util

    spec = importlib.util.find_spec("pygraph_dist")
    installed = Path(spec.origin).parent if spec and spec.origin else None
    so = sorted(installed.glob("_C*.so")) if installed else []
    if not so:
        raise SystemExit("no compiled pygraph_dist extension installed to give the base package")
    dest = scratch / "base"
    shutil.copytree(src, dest / "pygraph_dist", ignore=shutil.ignore_patterns("__pycache__"))
    for f in so:
        shutil.copy2(f, dest / "pygraph_dist" / f.name)
    return dest


def side_env(pythonpath: str | None) -> dict:
    """A side's child environment: no launcher variables (one process each), and
    ``pythonpath`` (the base package) ahead of whatever PYTHONPATH holds."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    if pythonpath:
        env["PYTHONPATH"] = pythonpath + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def pinning(args):
    """The preexec_fn that pins a child to --cpus (run in the child, before exec), or None."""
    return (lambda: os.sched_setaffinity(0, args.cpu_set)) if args.cpu_set else None


def write_results(path: Path, args, passes: list[dict], done: int, blocks: bool = False) -> str:
    """The JSON and the table of the ``done`` rounds (or blocks) so far, each
    file replaced whole; returns the table."""
    summary = summarise(passes)
    text = table(summary, passes, args.base, done, blocks=blocks)
    config = {k: v for k, v in vars(args).items() if k != "cpu_set"}
    write_atomic(path, json.dumps({"base": args.base, "config": config, "rounds_done": done,
                                   "summary": summary, "passes": passes}, indent=1))
    write_atomic(path.with_suffix(".txt"), text + "\n")
    return text


def one_pass(side: str, rnd: int, args, pythonpath: str | None, scratch: Path) -> dict:
    name = f"{side}-{rnd}"
    cmd = [sys.executable, str(HOST_COST), "--no-spans", "--no-plot", "--no-calls", "--out-dir", str(scratch), "--name", name,
           "--layers", args.layers, "--modes", args.modes, "--steps", str(args.steps),
           "--warmup", str(args.warmup)] + (["--smoke"] if args.smoke else [])
    env, pin = side_env(pythonpath), pinning(args)
    t0 = time.perf_counter()
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout, preexec_fn=pin)
    out = scratch / f"{name}.json"
    if p.returncode not in (0, 1) or not out.exists():  # 1: a mode failed, its row says so
        why = ("cannot import pygraph_dist" if "No module named 'pygraph_dist'" in p.stderr
               else f"failed with exit code {p.returncode}")
        raise RuntimeError(f"host_cost.py ({side}, round {rnd}) {why}:\n{p.stderr[-3000:]}")
    result = json.loads(out.read_text())
    package, cpus_seen = result["environment"]["package"], result["environment"]["cpus"]
    print(f"[host_cost_ab] {side:4s} round {rnd + 1}/{args.rounds}: {time.perf_counter() - t0:.0f} s",
          file=sys.stderr)
    return {"side": side, "round": rnd, "package": package, "cpus": cpus_seen,
            "environment": result["environment"], "rows": result["rows"]}


def summarise(passes: list[dict]) -> list[dict]:
    """Per (mode, params): medians over rounds, paired differences, +hand per pass."""
    keys = []
    for r in passes[0]["rows"]:
        if (r["mode"], r["params"]) not in keys:
            keys.append((r["mode"], r["params"]))

    def p50(pas, mode, params):
        row = next((r for r in pas["rows"] if r["mode"] == mode and r["params"] == params), None)
        return row["host_p50_us"] if row is not None and row.get("status") == "ok" else None

    def wall(pas, mode, params):
        row = next((r for r in pas["rows"] if r["mode"] == mode and r["params"] == params), None)
        return row.get("wall_ms") if row is not None and row.get("status") == "ok" else None

    out = []
    for mode, params in keys:
        entry = {"mode": mode, "params": params}
        by_round: dict[int, dict[str, float]] = {}
        over_hand: dict[str, list[float]] = {"base": [], "this": []}
        hand = HAND_OF.get(mode)
        for pas in passes:
            v = p50(pas, mode, params)
            if v is None:
                continue
            by_round.setdefault(pas["round"], {})[pas["side"]] = v
            h = p50(pas, hand, params) if hand else None
            if h is not None:
                over_hand[pas["side"]].append(v - h)
        for side in ("base", "this"):
            vals = [r[side] for r in by_round.values() if side in r]
            entry[f"{side}_p50_us"] = statistics.median(vals) if vals else None
            entry[f"{side}_over_{hand}_us" if hand else f"{side}_over_hand_us"] = (
                statistics.median(over_hand[side]) if over_hand[side] else None)
        for side in ("base", "this"):  # GPU-bound modes: ms per back-to-back step (full passes only)
            walls = [w for w in (wall(pas, mode, params) for pas in passes if pas["side"] == side) if w is not None]
            entry[f"{side}_wall_ms"] = statistics.median(walls) if walls else None
        diffs = [r["this"] - r["base"] for r in by_round.values() if "this" in r and "base" in r]
        entry["paired_diff_us"] = statistics.median(diffs) if diffs else None
        entry["paired_diffs_us"] = diffs
        entry["this_faster_rounds"] = sum(d < 0 for d in diffs)
        out.append(entry)
    return out


def table(summary: list[dict], passes: list[dict], base: str, rounds: int, blocks: bool = False) -> str:
    env = passes[0]["environment"]
    how = (f"{rounds} blocks of {env['steps']} steps interleaved (base-this, then this-base), one process per "
           f"side, each mode set up once ({env['warmup']} steps)" if blocks else
           f"{rounds} rounds alternated (base first), {env['steps']} steps after {env['warmup']} per pass")
    lines = [f"host cost A/B: this tree vs {base}; {env['device']}; torch {env['torch']}; {how}",
             "host us per step: medians over rounds of each pass's p50; paired = median of (this - base) per round; "
             "+hand = over the hand recipe of the same pass",
             f"{'mode':12s} {'params':>6s} {'base':>8s} {'this':>8s} {'paired':>8s} {'faster':>7s} "
             f"{'base+hand':>10s} {'this+hand':>10s} {'base ms':>8s} {'this ms':>8s}",
             "-" * 94]

    def f(v):
        return f"{v:8.1f}" if isinstance(v, (int, float)) else f"{'-':>8s}"

    def ms(v):
        return f"{v:8.3f}" if isinstance(v, (int, float)) else f"{'-':>8s}"

    for e in summary:
        hand_key = next((k for k in e if k.startswith("base_over_")), None)
        this_key = hand_key.replace("base_", "this_") if hand_key else None
        faster = f"{e['this_faster_rounds']}/{len(e['paired_diffs_us'])}" if e["paired_diffs_us"] else "-"
        lines.append(f"{e['mode']:12s} {e['params']:6d} {f(e['base_p50_us'])} {f(e['this_p50_us'])} "
                     f"{f(e['paired_diff_us'])} {faster:>7s} "
                     f"{f(e.get(hand_key)) if hand_key else '-':>10s} {f(e.get(this_key)) if this_key else '-':>10s} "
                     f"{ms(e.get('base_wall_ms'))} {ms(e.get('this_wall_ms'))}")
    lines.append("faster = rounds in which this tree's p50 was lower; base+hand/this+hand: over hand (tier 1 modes) "
                 "or hand_tier2 (tier 2 modes), the same pass; base ms/this ms: median wall ms per "
                 "back-to-back step (GPU time where the GPU bounds the step; rounds, not --interleave blocks)")
    return "\n".join(lines)


class Budget:
    """--budget: no round (or block) starts that would not fit in the seconds
    left if it took as long as the longest one so far (0: no limit)."""

    def __init__(self, seconds: float) -> None:
        self.seconds, self.start, self.longest = seconds, time.monotonic(), 0.0
        self.began = self.start

    def allows(self, done: int, total: int, what: str) -> bool:
        left = self.seconds - (time.monotonic() - self.start)
        if self.seconds and done and self.longest > left:
            print(f"[host_cost_ab] stopping after {done} of {total} {what}s: another {what} "
                  f"(up to {self.longest:.0f} s) would not fit in --budget {self.seconds:.0f} s", file=sys.stderr)
            return False
        self.began = time.monotonic()
        return True

    def finished(self) -> None:
        self.longest = max(self.longest, time.monotonic() - self.began)


class Worker:
    """One side's host_cost_worker.py process (--interleave)."""

    def __init__(self, side: str, pythonpath: str | None, args, log: Path) -> None:
        self.side, self.timeout, self.log = side, args.timeout, log
        self.proc = subprocess.Popen(
            [sys.executable, str(HERE / "host_cost_worker.py"), "--steps", str(args.steps),
             "--warmup", str(args.warmup)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log.open("w"), text=True,
            env=side_env(pythonpath), preexec_fn=pinning(args))

    def ask(self, **req) -> dict:
        import select

        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        deadline = time.monotonic() + self.timeout
        while True:
            ready, _, _ = select.select([self.proc.stdout], [], [], max(0.0, deadline - time.monotonic()))
            line = self.proc.stdout.readline() if ready else ""
            if not line:
                why = "did not answer in time" if not ready else f"exited ({self.proc.poll()})"
                raise RuntimeError(f"the {self.side} worker {why} at {req}:\n{self.log.read_text()[-3000:]}")
            if line.startswith("REPLY "):
                reply = json.loads(line[len("REPLY "):])
                if not reply.get("ok"):
                    raise RuntimeError(f"the {self.side} worker failed at {req}: {reply.get('error')}")
                return reply

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()


def interleave(args, base: Path, scratch: Path, path: Path) -> tuple[list[dict], str]:
    """--interleave: both sides' workers set every mode up once, then measure
    blocks of --steps steps, base-this in even blocks and this-base in odd
    ones. Each block is written as a "pass" of its side (round = block), so
    the summary and the table are the rounds' own."""
    layers = [int(x) for x in args.layers.split(",") if x]
    modes = [m for m in args.modes.split(",") if m]
    # hand_tier2 last in its process (host_cost_worker.py's docstring says why)
    plan = [(m, n) for n in layers for m in modes if m != "hand_tier2"]
    plan += [("hand_tier2", n) for n in layers if "hand_tier2" in modes]
    workers = {"base": Worker("base", str(base), args, scratch / "base.log"),
               "this": Worker("this", None, args, scratch / "this.log")}
    try:
        hello = {side: w.ask(cmd="hello") for side, w in workers.items()}
        if hello["base"]["package"] == hello["this"]["package"]:
            raise SystemExit(f"both sides imported {hello['base']['package']}: --base did not take effect")
        params = {}
        for side, w in workers.items():
            t0 = time.monotonic()
            for m, n in plan:
                params[(m, n)] = w.ask(cmd="setup", mode=m, layers=n, warmup=args.warmup)["params"]
            print(f"[host_cost_ab] {side} worker: {len(plan)} modes set up in {time.monotonic() - t0:.0f} s",
                  file=sys.stderr)
        budget, passes, text = Budget(args.budget), [], ""
        for block in range(args.interleave):
            if not budget.allows(block, args.interleave, "block"):
                break
            rows = {"base": [], "this": []}
            for m, n in plan:
                for side in (("base", "this") if block % 2 == 0 else ("this", "base")):
                    r = workers[side].ask(cmd="measure", mode=m, layers=n, steps=args.steps)
                    rows[side].append({"mode": m, "params": params[(m, n)], "status": "ok",
                                       "host_p50_us": r["p50_us"], "host_us": r["mean_us"]})
            for side in ("base", "this"):
                passes.append({"side": side, "round": block, "package": hello[side]["package"],
                               "cpus": ",".join(map(str, sorted(args.cpu_set))),
                               "environment": hello[side]["environment"], "rows": rows[side]})
            budget.finished()
            text = write_results(path, args, passes, block + 1, blocks=True)
        return passes, text
    finally:
        for w in workers.values():
            w.close()


def write_atomic(path: Path, text: str) -> None:
    """Replace ``path`` whole: a run killed while writing leaves the previous round's file."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="host_cost.py for another revision's Python and this tree, "
                                "alternated in one run (see the module docstring)")
    p.add_argument("--base", required=True, help="a directory holding the base revision's pygraph_dist package")
    p.add_argument("--rounds", type=int, default=3, help="base/this pairs (default 3)")
    p.add_argument("--layers", default="8,250")
    p.add_argument("--modes", default="hand,pgd_tier1,hand_tier2,pgd_tier2")
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--smoke", action="store_true", help="CPU check of the harness (host_cost --smoke)")
    p.add_argument("--timeout", type=float, default=600, help="seconds one pass may take")
    p.add_argument("--interleave", type=int, default=0, metavar="BLOCKS",
                   help="instead of --rounds of whole passes: one long-lived process per side "
                        "(host_cost_worker.py), every mode set up once, then BLOCKS blocks of --steps steps, "
                        "the sides alternating block by block (on a machine without a GPU: the pgd modes on its CPU)")
    p.add_argument("--cpus", default="",
                   help="comma-separated CPU ids every pass is pinned to (sched_setaffinity), so that both sides "
                        "run on the same cores: a pass moved between cores or frequency domains was 2-3x "
                        "slower than its neighbours on the shared H100 host (session 37)")
    p.add_argument("--budget", type=float, default=0,
                   help="seconds for the whole run: no round is started that would not fit (0: no limit)")
    p.add_argument("--out-dir", default=str(HERE / "results" / "tmp"))
    p.add_argument("--name", default=None, help="results file stem (default: host-cost-ab-<date>)")
    args = p.parse_args(argv)
    if args.rounds < 1:
        raise SystemExit("--rounds must be at least 1")
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    name = args.name or time.strftime("host-cost-ab-%Y%m%d-%H%M%S")
    path = out_dir / f"{name}.json"
    args.cpu_set = set()
    if args.cpus:
        try:
            args.cpu_set = {int(c) for c in args.cpus.split(",")}
        except ValueError:
            raise SystemExit(f"--cpus {args.cpus!r}: give CPU ids, e.g. --cpus 4,5") from None
        if not args.cpu_set <= os.sched_getaffinity(0):
            raise SystemExit(f"--cpus {args.cpus}: CPU(s) {sorted(args.cpu_set - os.sched_getaffinity(0))} are not "
                             f"available to this process (it may use {sorted(os.sched_getaffinity(0))})")
    passes: list[dict] = []
    text = ""
    with tempfile.TemporaryDirectory() as tmp:
        scratch = Path(tmp)
        base = base_package(Path(args.base).resolve(), scratch)
        if args.interleave:
            passes, text = interleave(args, base, scratch, path)
            print(text)
            print(f"[host_cost_ab] {len(passes) // 2} blocks -> {path}", file=sys.stderr)
            return 0
        budget = Budget(args.budget)
        for rnd in range(args.rounds):
            if not budget.allows(rnd, args.rounds, "round"):
                break
            passes.append(one_pass("base", rnd, args, str(base), scratch))
            passes.append(one_pass("this", rnd, args, None, scratch))
            budget.finished()
            if rnd == 0 and passes[0]["package"] == passes[1]["package"]:
                raise SystemExit(f"both sides imported {passes[0]['package']}: --base did not take effect")
            # Written after every round, so that a run cut short keeps the rounds it finished.
            text = write_results(path, args, passes, rnd + 1)
    print(text)
    print(f"[host_cost_ab] {len(passes)} passes -> {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
