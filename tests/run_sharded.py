"""pytest over tests/python in parallel shards, for machines with many cores.

Every CPU test starts two to four rank processes that each import torch; with a
CUDA build of torch that import dominates, and one pytest process leaves most
cores of a 16- or 32-core GPU machine idle (the CPU tests took over 10 minutes
there, 5 on the 2-core CI machine). ``run-all.sh`` calls this when the machine
has the cores for it (``PGD_TEST_JOBS``, default: one job per 4 cores, at most
8) and no pytest arguments were given:

1. the CPU tests (``-m "not gpu and not multigpu"``), one pytest per test file,
   ``--jobs`` files at a time, longest first; a line per finished file with
   its skip reasons, the whole log of a file that failed;
2. the GPU tests (``-m "gpu or multigpu"``) in one pytest, in the foreground,
   never beside other tests (they share the GPUs and time themselves).

Exit status 0 only if every pytest passed (or selected no test).

This module is also a pytest plugin (``-p run_sharded``, with ``tests/`` on
``PYTHONPATH``), which ``run-all.sh`` loads for every pytest, sharded or not,
when ``PGD_SKIP_TWO_HOST=1``: the two-host tests (marker ``multihost``) are then
skipped with that reason, so that a quick local run still lists them.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

HERE = Path(__file__).resolve().parent
TESTS = HERE / "python"
# Slowest CPU files first (the CI machine's durations), so no shard ends on a long one.
LONGEST_FIRST = ["test_loops.py", "test_ecosystem_scripts.py", "test_launch_env.py", "test_multihost.py",
                 "test_cpu_training.py", "test_launch_and_tools.py", "test_faults_exit_stress.py", "test_segments.py",
                 "test_faults_native_watchdog.py", "test_compile.py", "test_nonfinite_resume.py"]
NO_TESTS_COLLECTED = 5  # pytest's exit code when a file has no test of the marker
TWO_HOST_SKIPPED = ("PGD_SKIP_TWO_HOST=1: the two-host tests (torchrun, Open MPI, MPICH, Slurm across two "
                    "network namespaces) are not run; ./tests/run-all.sh without it runs them, as CI does")


def pytest_collection_modifyitems(config, items):
    """As a pytest plugin: with PGD_SKIP_TWO_HOST=1, every ``multihost`` test is skipped, with the reason."""
    if os.environ.get("PGD_SKIP_TWO_HOST") != "1":
        return
    import pytest

    skip = pytest.mark.skip(reason=TWO_HOST_SKIPPED)
    for item in items:
        if "multihost" in item.keywords:
            item.add_marker(skip)


def ordered_files(tests: Path = TESTS) -> list[Path]:
    files = sorted(tests.glob("test_*.py"))
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    return sorted(files, key=lambda f: rank.get(f.name, len(rank)))


SUMMARY = re.compile(r"^=+ (.*) in [\d.]+s( \([\d:]+\))? =+$")


def summary_line(log: str) -> str:
    """pytest's final '== 3 passed, 1 skipped in 12.3s ==' line, without the '='
    ('(no summary line)' for a pytest that died before writing one)."""
    for line in reversed(log.splitlines()):
        if SUMMARY.match(line.strip()):
            return line.strip().strip("= ")
    return "(no summary line)"


def run_file(path: Path, log_dir: Path) -> tuple[Path, int, str, float]:
    log = log_dir / f"{path.stem}.log"
    t0 = time.monotonic()
    with open(log, "w") as f:
        rc = subprocess.call([sys.executable, "-m", "pytest", str(path), "-ra", "-p", "no:cacheprovider",
                              "-m", "not gpu and not multigpu"], stdout=f, stderr=subprocess.STDOUT,
                             cwd=str(HERE.parent))
    return path, rc, log.read_text(errors="replace"), time.monotonic() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, required=True, help="test files run at the same time")
    ap.add_argument("--dir", type=Path, default=TESTS, help="the test files' folder (default: tests/python)")
    args = ap.parse_args(argv)
    files = ordered_files(args.dir)
    failed: list[str] = []
    totals: dict[str, int] = {}
    t0 = time.monotonic()
    print(f"== pytest, CPU tests: {len(files)} files, {args.jobs} at a time (PGD_TEST_JOBS; "
          "one pytest: PGD_TEST_JOBS=1)", flush=True)
    with tempfile.TemporaryDirectory(prefix="pgd-tests-") as tmp, ThreadPoolExecutor(args.jobs) as pool:
        futures = [pool.submit(run_file, f, Path(tmp)) for f in files]
        for n, fut in enumerate(as_completed(futures), 1):
            path, rc, log, seconds = fut.result()
            line = summary_line(log)
            ok = rc in (0, NO_TESTS_COLLECTED)
            print(f"[{n:2d}/{len(files)}] {path.name:34s} {'ok  ' if ok else 'FAIL'} {seconds:6.1f} s  {line}",
                  flush=True)
            for count, word in re.findall(r"(\d+) (passed|failed|skipped|deselected|xfailed|xpassed|errors?)\b",
                                          line):
                word = "errors" if word == "error" else word
                totals[word] = totals.get(word, 0) + int(count)
            for skipped in (ln for ln in log.splitlines() if ln.startswith(("SKIPPED", "XFAIL", "XPASS"))):
                print(f"        {skipped}", flush=True)  # no skip goes unexplained
            if not ok:
                failed.append(path.name)
                print(f"---- {path.name} (exit {rc}) ----\n{log}---- end of {path.name} ----", flush=True)
    cpu = ", ".join(f"{v} {k}" for k, v in totals.items() if k != "deselected")
    print(f"== CPU tests: {cpu} in {time.monotonic() - t0:.0f} s"
          + (f"; FAILED in {', '.join(failed)}" if failed else ""), flush=True)

    print("== pytest, GPU tests (-m 'gpu or multigpu'), one at a time", flush=True)
    rc = subprocess.call([sys.executable, "-m", "pytest", str(args.dir), "-ra", "-m", "gpu or multigpu"],
                         cwd=str(HERE.parent))
    if rc not in (0, NO_TESTS_COLLECTED):
        failed.append(f"GPU tests (exit {rc})")
    print(f"== all tests: {'FAILED: ' + ', '.join(failed) if failed else 'passed'} "
          f"({time.monotonic() - t0:.0f} s)", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
