"""Merge bench_scaling.py results (later files win for the same cell and, for
the floor, the same world size), re-derive speedups, efficiencies and ratios,
print the table and redraw the plots.

    python benchmarks/merge_results.py OUT.json IN1.json IN2.json ...

A cell is (workload, mode, loop, world size, condition); cells of results
written before loops existed are the inside loop.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_scaling import derive, key, table  # noqa: E402
from plots import plot_all  # noqa: E402


def main(out: str, inputs: list[str]) -> None:
    merged, floors, env, sources = {}, {}, {}, []
    for path in inputs:
        data = json.loads(Path(path).read_text())
        env = env or data.get("environment", {})
        sources.append({"file": Path(path).name, "config": data.get("config", {}),
                        "wall_s": data.get("wall_s"), "complete": data.get("complete")})
        for c in data["cells"]:
            c.setdefault("loop", "inside")
            merged[key(c)] = c
        for f in data.get("floor", []):
            if f.get("device"):
                floors[f["world_size"]] = f
    cells = list(merged.values())
    derive(cells)
    result = {"environment": env, "sources": sources, "floor": list(floors.values()), "cells": cells}
    Path(out).write_text(json.dumps(result, indent=1))
    text = table(cells, env, list(floors.values()))
    Path(out).with_suffix(".txt").write_text(text + "\n")
    print(text)
    for png in plot_all(result, Path(out).with_suffix("")):
        print(png, file=sys.stderr)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
