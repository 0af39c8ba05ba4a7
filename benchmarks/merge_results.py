"""Merge bench_scaling.py results (later files win for the same cell), re-derive
speedups and efficiencies, print the table and redraw the plots.

    python benchmarks/merge_results.py OUT.json IN1.json IN2.json ...
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_scaling import derive, table  # noqa: E402
from plots import plot_all  # noqa: E402


def main(out: str, inputs: list[str]) -> None:
    merged, env, sources = {}, {}, []
    for path in inputs:
        data = json.loads(Path(path).read_text())
        env = env or data.get("environment", {})
        sources.append({"file": Path(path).name, "config": data.get("config", {}),
                        "wall_s": data.get("wall_s")})
        for c in data["cells"]:
            merged[(c["workload"], c["mode"], c["world_size"], c["condition"])] = c
    cells = list(merged.values())
    derive(cells)
    result = {"environment": env, "sources": sources, "cells": cells}
    Path(out).write_text(json.dumps(result, indent=1))
    print(table(cells, env))
    for png in plot_all(result, Path(out).with_suffix("")):
        print(png, file=sys.stderr)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
