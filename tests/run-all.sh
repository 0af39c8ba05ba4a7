#!/usr/bin/env bash
# Every test: the GoogleTest suite of the C++ core, the compile check of the
# CUDA code paths, and pytest (CPU tests with 2 Gloo ranks and mpirun; GPU
# tests run where CUDA is, and are skipped -- and reported as skipped -- where
# it is not). Sets up the environment first.
#   ./tests/run-all.sh [extra pytest args]
# For a quicker local run (CI runs everything; each is reported as not run):
#   PGD_SKIP_CUDA_COMPILE=1  no compile check of the CUDA code paths (and no
#                            download of a CUDA build of torch for it)
#   PGD_SKIP_TWO_HOST=1      the two-host tests (tests/python/test_multihost.py)
#                            are skipped, with that reason, and setup does not
#                            install MPICH, Slurm and munge for them
set -euo pipefail
export PGD_SETUP_TESTS=1  # setup also installs what the two-host tests use
export PGD_HINT_AT_END=1  # setup's "source .venv/bin/activate" hint comes last
START=$SECONDS
took() { local s=$((SECONDS - ${1:-$START})); printf '%d min %02d s' $((s / 60)) $((s % 60)); }
source "$(dirname "${BASH_SOURCE[0]}")/../launch/setup-env.sh"
cd "$PGD_ROOT"
times=("setup $(took)")
# How quick this host is now, for comparing this run's durations with others'
# (the CI machine's speed has varied by half within an hour).
"$PY" - <<'PYEOF' >&2
import platform, time
t, s = time.process_time(), 0
for i in range(10_000_000):
    s += i
print(f"== host speed: a 10-million-step Python loop took {time.process_time() - t:.2f} CPU-s "
      f"(Python {platform.python_version()})")
PYEOF
# cmake/ctest/ninja: the Python packages' binaries, else the ones on PATH.
if CMAKE="$("$PY" -c 'import cmake, os; print(os.path.join(cmake.CMAKE_BIN_DIR, "cmake"))' 2>/dev/null)"; then
  export PATH="$(dirname "$CMAKE"):$PATH"
fi
if NINJA_DIR="$("$PY" -c 'import ninja, os; print(ninja.BIN_DIR)' 2>/dev/null)"; then
  export PATH="$NINJA_DIR:$PATH"
fi

# The CUDA compile check runs beside the other tests, at the lowest CPU priority:
# most of it is fetching and unpacking a 550 MB wheel, and its compile then only
# takes CPU time that GoogleTest and pytest leave idle (on the 2-core CI machine
# it took 4 min of the command's time when it ran alone). Its output is shown,
# and its failure fails the command, at the end.
cuda_pid=""
if "$PY" -c "import torch, sys; sys.exit(0 if torch.version.cuda else 1)"; then
  echo "== CUDA code paths: already compiled by the install above (torch is a CUDA build)" >&2
elif [ "${PGD_SKIP_CUDA_COMPILE:-0}" = 1 ]; then
  echo "== CUDA code paths: NOT compiled (PGD_SKIP_CUDA_COMPILE=1)" >&2
else
  echo "== CUDA code paths (compile check against a CUDA build of torch): started beside the tests, its output at the end" >&2
  mkdir -p build
  cuda_log=build/cuda-compile-check.log
  cuda_start=$SECONDS
  nice -n 19 ./launch/cuda-compile-check.sh >"$cuda_log" 2>&1 &
  cuda_pid=$!
fi

if [ -f /usr/include/gtest/gtest.h ] || [ -f /usr/local/include/gtest/gtest.h ]; then
  echo "== C++ core (GoogleTest)" >&2
  t=$SECONDS
  cmake -S . -B build/core-tests -G Ninja -DPGD_BUILD_EXTENSION=OFF -DPGD_BUILD_TESTS=ON >/dev/null
  cmake --build build/core-tests
  ctest --test-dir build/core-tests --output-on-failure
  times+=("GoogleTest $(took $t)")
else
  echo "== C++ core: NOT RUN (GoogleTest is not installed and setup could not install it: apt-get install libgtest-dev)" >&2
fi

if [ "${PGD_SKIP_TWO_HOST:-0}" = 1 ]; then
  # tests/run_sharded.py is also a pytest plugin that marks them skipped, with the reason.
  echo "== two-host tests: NOT run (PGD_SKIP_TWO_HOST=1; pytest lists them as skipped)" >&2
  export PYTHONPATH="$PGD_ROOT/tests${PYTHONPATH:+:$PYTHONPATH}"
  export PYTEST_ADDOPTS="-p run_sharded${PYTEST_ADDOPTS:+ $PYTEST_ADDOPTS}"
fi

# Many cores and no pytest arguments: the CPU tests in parallel shards, then the
# GPU tests alone (tests/run_sharded.py says why). Few cores (the 2-core CI
# machine): the CPU tests in nproc+1 pytest-xdist workers, which live for the
# whole run (each keeps its rank servers: tests/python/rank_server.py), then the
# GPU tests alone where CUDA is (without it they are skipped among the CPU
# tests). A CPU test's ranks often wait (rendezvous, a peer, a
# subprocess's start), so one worker more than cores keeps the cores busy.
# PGD_TEST_JOBS=1: one pytest.
jobs="${PGD_TEST_JOBS:-$(( $(nproc) / 4 > 8 ? 8 : $(nproc) / 4 ))}"
workers="${PGD_TEST_WORKERS:-$(( $(nproc) + 1 ))}"
rc=0
t=$SECONDS
if [ "$#" -eq 0 ] && [ "$jobs" -gt 1 ]; then
  "$PY" tests/run_sharded.py --jobs "$jobs" || rc=$?
elif [ "$#" -eq 0 ] && [ "${PGD_TEST_JOBS:-0}" != 1 ] && [ "$workers" -gt 1 ] \
    && "$PY" -c "import xdist" 2>/dev/null; then
  # Without CUDA the GPU tests are only skipped (each with its reason): they are
  # collected with the CPU tests, which saves a second pytest's start.
  if "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    cpu_marks=(-m "not gpu and not multigpu") gpu_alone=1
    echo "== Python (pytest): CPU tests in $workers workers (PGD_TEST_WORKERS; one pytest: PGD_TEST_JOBS=1)" >&2
  else
    cpu_marks=() gpu_alone=0
    echo "== Python (pytest): CPU tests in $workers workers (PGD_TEST_WORKERS; one pytest: PGD_TEST_JOBS=1); no CUDA here, so the GPU tests are skipped among them" >&2
  fi
  cpu_rc=0
  # --durations: where the command's time goes, in every CI log (issue 48, item 6)
  "$PY" -m pytest tests/python -ra -n "$workers" --dist worksteal "${cpu_marks[@]}" \
    --durations=25 || cpu_rc=$?
  [ $cpu_rc = 5 ] && cpu_rc=0  # no test selected
  gpu_rc=0
  if [ $gpu_alone = 1 ]; then
    echo "== Python (pytest): GPU tests (-m 'gpu or multigpu'), alone" >&2
    "$PY" -m pytest tests/python -ra -m "gpu or multigpu" || gpu_rc=$?
    [ $gpu_rc = 5 ] && gpu_rc=0
  fi
  [ $cpu_rc = 0 ] || rc=$cpu_rc
  [ $rc != 0 ] || rc=$gpu_rc
else
  echo "== Python (pytest)" >&2
  "$PY" -m pytest tests/python -ra "$@" || rc=$?
fi
times+=("pytest $(took $t)")

if [ -n "$cuda_pid" ]; then
  echo "== CUDA code paths (compile check against a CUDA build of torch)" >&2
  cuda_rc=0
  wait "$cuda_pid" || cuda_rc=$?
  cat "$cuda_log" >&2
  times+=("CUDA compile check $(took "$cuda_start") beside the tests")
  if [ $cuda_rc != 0 ]; then
    echo "== CUDA code paths: the compile check FAILED (exit status $cuda_rc; its output above)" >&2
    [ $rc != 0 ] || rc=$cuda_rc
  fi
fi
summary=$(printf '%s, ' "${times[@]}")
echo "== run-all.sh: $(took) in all (${summary%, })" >&2
pgd_activate_hint
exit $rc
