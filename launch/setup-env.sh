#!/usr/bin/env bash
# Prepare everything pygraph_dist needs, idempotently, and build it.
#   source launch/setup-env.sh      (sets PY to the environment's python)
#
# 1. Debian packages: Open MPI (mpirun, mpicc) and GoogleTest, if missing and
#    apt-get is usable (root); otherwise a warning says what to install.
# 2. Python: a virtual environment in .venv (PGD_VENV to move it). If a Python
#    with torch already exists (PGD_PYTHON, or python3 on PATH), the venv sees
#    its packages and uses that torch; otherwise torch==2.13.0 is installed
#    (on the dev/CI machine that is the CPU wheel on local disk).
# 3. Build tools, test tools and mpi4py (built against the launcher's MPI).
# 4. pygraph_dist itself: `pip install --no-build-isolation .`, so that the
#    extension compiles against the torch in the environment.
set -euo pipefail
PGD_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${PGD_VENV:-$PGD_ROOT/.venv}
say() { echo "[setup] $*" >&2; }

need=()
command -v mpirun >/dev/null 2>&1 || need+=(openmpi-bin)
command -v mpicc >/dev/null 2>&1 || need+=(libopenmpi-dev)
[ -f /usr/include/gtest/gtest.h ] || need+=(libgtest-dev)
if [ ${#need[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    say "installing Debian packages: ${need[*]}"
    apt-get update -qq >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
  else
    say "warning: missing Debian packages ${need[*]}; install them (apt-get install ${need[*]}) for the MPI and GoogleTest parts"
  fi
fi

if [ ! -x "$VENV/bin/python" ]; then
  base=${PGD_PYTHON:-}
  if [ -z "$base" ]; then
    for cand in python3 python; do
      if command -v "$cand" >/dev/null 2>&1 && "$cand" -c "import torch" >/dev/null 2>&1; then
        base=$(command -v "$cand"); break
      fi
    done
  fi
  if [ -n "$base" ]; then
    say "creating $VENV on top of $base ($("$base" -c 'import torch; print("torch", torch.__version__)'))"
    "$base" -m venv --system-site-packages "$VENV"
  else
    say "creating $VENV (no Python with torch found; torch==2.13.0 will be installed)"
    python3 -m venv "$VENV"
  fi
fi
PY="$VENV/bin/python"
export PY PGD_ROOT

pip_install() { "$PY" -m pip install -q --disable-pip-version-check "$@"; }
"$PY" -c "import torch" >/dev/null 2>&1 || { say "installing torch==2.13.0"; pip_install torch==2.13.0; }
missing=$("$PY" - <<'PYEOF'
import importlib.util
mods = {"scikit_build_core": "scikit-build-core", "cmake": "cmake", "ninja": "ninja", "numpy": "numpy",
        "pytest": "pytest", "pytest_timeout": "pytest-timeout", "matplotlib": "matplotlib", "tqdm": "tqdm"}
print(" ".join(pkg for mod, pkg in mods.items() if importlib.util.find_spec(mod) is None))
PYEOF
)
[ -z "$missing" ] || { say "installing $missing"; pip_install $missing; }
if ! "$PY" -c "import mpi4py" >/dev/null 2>&1 && command -v mpicc >/dev/null 2>&1; then
  say "building mpi4py against $(command -v mpicc)"
  MPICC=$(command -v mpicc) pip_install --no-binary mpi4py mpi4py
fi

say "building pygraph_dist against $("$PY" -c 'import torch; print("torch", torch.__version__)')"
( cd "$PGD_ROOT" && "$PY" -m pip install -q --disable-pip-version-check --no-build-isolation --no-deps . )
"$PY" -c "import pygraph_dist as p; ok, why = p.graphs_available(); print('[setup] pygraph_dist', p.__version__, '- graphs available' if ok else '- ' + why)" >&2
