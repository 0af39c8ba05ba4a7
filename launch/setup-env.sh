#!/usr/bin/env bash
# Prepare everything pygraph_dist needs, idempotently, and build it.
#   source launch/setup-env.sh      (sets PY to the environment's python)
#
# 1. Debian packages: Open MPI (mpirun, mpicc) and GoogleTest, if missing; with
#    PGD_SETUP_TESTS=1 (tests/run-all.sh) also what the two-host tests use:
#    iproute2, MPICH (mpiexec.mpich, mpicc.mpich; Open MPI stays the default
#    mpirun/mpicc), Slurm (slurmctld, slurmd, srun) and munge -- not with
#    PGD_SKIP_TWO_HOST=1, which skips those tests. Installed with apt-get when
#    root; without root or without network a warning lists them.
# 2. Python: a virtual environment in .venv (PGD_VENV to move it; an existing
#    environment given there is used as it is). If a Python with torch >= 2.11
#    already exists -- PGD_PYTHON, the active virtual environment or conda
#    environment, python3/python on PATH, /opt/*/.venv -- .venv is built on it
#    and sees its packages (that torch, and whatever else is installed there);
#    otherwise torch==2.13.0 is installed (on the dev/CI machine the CPU wheel
#    on local disk) into a .venv made with PGD_BASE_PYTHON (default: python3 on
#    PATH; .ci/run says why CI gives another).
# 3. Build and test tools that are missing (none is downloaded when all are
#    present), mpi4py built against the launcher's MPI; optional ones
#    (matplotlib, tqdm, mpi4py; with PGD_SETUP_TESTS=1 sphinx and myst-parser for
#    the docs build test, lightning, transformers and accelerate for the
#    integration tests) only warn when they cannot be installed; with
#    PGD_SETUP_TESTS=1 also an mpi4py built against MPICH for the two-host test
#    (not with PGD_SKIP_TWO_HOST=1).
# 4. pygraph_dist itself: `pip install --no-build-isolation .`, so that the
#    extension compiles against the torch in the environment.
# pygraph-launch, torchrun and the environment's python are then in $VENV/bin:
# pgd_activate_hint prints how to put them on PATH in a new shell.
set -euo pipefail
PGD_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${PGD_VENV:-$PGD_ROOT/.venv}
TORCH_PIN=2.13.0  # installed only when no Python with torch is found
say() { echo "[setup] $*" >&2; }
warn() { echo "[setup] WARNING: $*" >&2; }
die() { echo "[setup] ERROR: $*" >&2; exit 1; }

# ------------------------------------------------------------ Debian packages
need=()
command -v mpirun >/dev/null 2>&1 || need+=(openmpi-bin)
command -v mpicc >/dev/null 2>&1 || need+=(libopenmpi-dev)
[ -f /usr/include/gtest/gtest.h ] || need+=(libgtest-dev)
extra=()  # only for the tests: never pulls recommends
# ccache: a clone's builds (the extension, the CUDA compile check) reuse earlier compiles (CMakeLists.txt)
[ "${PGD_SETUP_TESTS:-0}" = 1 ] && ! command -v ccache >/dev/null 2>&1 && extra+=(ccache)
if [ "${PGD_SETUP_TESTS:-0}" = 1 ] && [ "${PGD_SKIP_TWO_HOST:-0}" = 1 ]; then
  say "PGD_SKIP_TWO_HOST=1: not installing what only the two-host tests use (iproute2, MPICH, Slurm, munge, MPICH's mpi4py)"
elif [ "${PGD_SETUP_TESTS:-0}" = 1 ]; then
  command -v ip >/dev/null 2>&1 || extra+=(iproute2)
  command -v mpiexec.mpich >/dev/null 2>&1 || extra+=(mpich)
  command -v mpicc.mpich >/dev/null 2>&1 || extra+=(libmpich-dev)
  command -v slurmctld >/dev/null 2>&1 || extra+=(slurmctld)
  command -v slurmd >/dev/null 2>&1 || extra+=(slurmd)
  command -v srun >/dev/null 2>&1 || extra+=(slurm-client)
  command -v munged >/dev/null 2>&1 || extra+=(munge)
fi
if [ $((${#need[@]} + ${#extra[@]})) -gt 0 ]; then
  all="${need[*]} ${extra[*]}"
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    say "installing Debian packages: $all"
    # MPICH registers mpirun/mpicc alternatives too (at a lower priority than
    # Open MPI's); whatever they point at now is put back afterwards.
    alt_before=$(for a in mpirun mpi; do update-alternatives --query "$a" 2>/dev/null | sed -n "s/^Value: /$a /p"; done || true)
    apt_opts=(-o Acquire::Retries=1 -o Acquire::http::Timeout=20 -o Acquire::https::Timeout=20)
    apt_log=$(mktemp)
    apt-get "${apt_opts[@]}" update -qq >"$apt_log" 2>&1 || true
    ok=1
    if [ ${#need[@]} -gt 0 ]; then
      DEBIAN_FRONTEND=noninteractive apt-get "${apt_opts[@]}" install -y -qq "${need[@]}" >>"$apt_log" 2>&1 || ok=0
    fi
    if [ ${#extra[@]} -gt 0 ]; then
      DEBIAN_FRONTEND=noninteractive apt-get "${apt_opts[@]}" install -y -qq --no-install-recommends \
          "${extra[@]}" >>"$apt_log" 2>&1 || ok=0
    fi
    while read -r name value; do
      [ -n "$name" ] || continue
      now=$(update-alternatives --query "$name" 2>/dev/null | sed -n 's/^Value: //p')
      if [ "$now" != "$value" ]; then
        say "restoring the $name alternative to $value (was changed to $now)"
        update-alternatives --set "$name" "$value" >/dev/null
      fi
    done <<<"$alt_before"
    if [ $ok = 0 ]; then
      warn "could not install all of: $all (no network?). apt-get said: $(grep -E '^(E|W):' "$apt_log" | tail -n 2 | tr '\n' ' ')"
      warn "without them the parts that use them (MPI launches, the C++ GoogleTest suite, the two-host tests) are skipped or fail with a message naming them"
    fi
    rm -f "$apt_log"
  else
    warn "missing Debian packages: $all; install them (apt-get install $all) for the MPI, GoogleTest and two-host parts"
  fi
fi

# ------------------------------------------------------------ Python
torch_ok() {  # $1 imports torch >= 2.11
  "$1" -c 'import sys, torch; v = torch.__version__.split("+")[0].split("."); sys.exit(0 if (int(v[0]), int(v[1])) >= (2, 11) else 1)' >/dev/null 2>&1
}
py_version() { "$1" -c 'import sys; print("%d.%d" % sys.version_info[:2])'; }

# The first Python with torch >= 2.11: PGD_PYTHON, the active virtual or conda
# environment, python3/python on PATH, then virtual environments under /opt
# (where a GPU machine's image keeps its torch). Never our own .venv.
find_torch_python() {
  local cand
  local cands=()
  [ -n "${VIRTUAL_ENV:-}" ] && cands+=("$VIRTUAL_ENV/bin/python")
  [ -n "${CONDA_PREFIX:-}" ] && cands+=("$CONDA_PREFIX/bin/python")
  for cand in python3 python; do
    command -v "$cand" >/dev/null 2>&1 && cands+=("$(command -v "$cand")")
  done
  for cand in /opt/*/.venv/bin/python /opt/*/venv/bin/python /opt/conda/bin/python; do
    [ -x "$cand" ] && cands+=("$cand")
  done
  for cand in "${cands[@]}"; do
    case "$cand" in "$VENV"/*) continue ;; esac
    [ -x "$cand" ] || continue
    if torch_ok "$cand"; then echo "$cand"; return 0; fi
  done
  return 1
}

# Why a .pth file and not --system-site-packages, nor installing into that
# Python: a venv made from a venv's python inherits the *base interpreter*
# (sys._base_executable), so --system-site-packages sees the base's packages,
# not the venv's -- the torch in /opt/torch/.venv stayed invisible and setup
# went to download torch==2.13.0. Installing into the Python that has torch
# would change an environment that may be shared or read-only (/opt, conda).
# So .venv is made from the same interpreter, and a .pth file adds that
# Python's site-packages directories *after* .venv's own (site.addsitedir, so
# their own .pth files work too): its torch and tools are used as they are,
# pip sees them as installed (nothing is downloaded again), and what setup
# adds goes into .venv only.
inherit_site_packages() {  # $1: the python with torch; .venv must exist
  local base=$1 venv_site
  venv_site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  mkdir -p "$venv_site"
  # One line, "import site; site.addsitedir(...); ..." (site executes .pth lines that start with import).
  "$base" - "$base" > "$venv_site/pgd-base-python.pth" <<'PYEOF'
import os, site, sys
dirs = [d for d in site.getsitepackages() if os.path.isdir(d)]
print("import site; " + "; ".join(f"site.addsitedir({d!r})" for d in dirs) + f"  # launch/setup-env.sh: the packages of {sys.argv[1]}")
PYEOF
  # torch's console scripts (torchrun) stay in that Python's bin/, which
  # activating $VENV does not put on PATH: a torchrun here runs torch's launcher
  # with $VENV's python, so that its ranks import pygraph_dist too.
  if [ ! -e "$VENV/bin/torchrun" ]; then
    cat > "$VENV/bin/torchrun" <<SHEOF
#!/bin/sh
# launch/setup-env.sh: torchrun with this environment's python (torch comes from $base)
exec "$VENV/bin/python" -m torch.distributed.run "\$@"
SHEOF
    chmod +x "$VENV/bin/torchrun"
  fi
}

make_venv() {  # $1: interpreter; ensurepip may be missing (Debian without pythonX-venv)
  "$1" -m venv "$VENV" >/dev/null 2>&1 && return 0
  rm -rf "$VENV"
  "$1" -m venv --without-pip "$VENV" || die "cannot create a virtual environment with $1 (install python$(py_version "$1")-venv, or set PGD_VENV to an existing environment)"
  say "created $VENV without pip (no ensurepip in $1); pip must come from the base environment"
}

base="" base_torch=0
if [ -n "${PGD_PYTHON:-}" ]; then
  base=$(command -v "$PGD_PYTHON" 2>/dev/null) || die "PGD_PYTHON=$PGD_PYTHON is not an executable"
  if torch_ok "$base"; then base_torch=1; else say "PGD_PYTHON=$base has no torch >= 2.11"; fi
fi
if [ -x "$VENV/bin/python" ] && torch_ok "$VENV/bin/python"; then
  :  # ready (or an environment that already has torch, given as PGD_VENV)
else
  if [ -z "$base" ]; then base=$(find_torch_python || true); [ -z "$base" ] || base_torch=1; fi
  if [ $base_torch = 1 ]; then
    info=$("$base" -c 'import torch; print("torch", torch.__version__)')
    if [ -x "$VENV/bin/python" ]; then
      # A .venv from an earlier setup that cannot see that torch (e.g. made
      # with --system-site-packages on top of another venv): repair it.
      [ "$(py_version "$VENV/bin/python")" = "$(py_version "$base")" ] || die \
        "$VENV is Python $(py_version "$VENV/bin/python") without torch, and the Python with torch ($base) is $(py_version "$base"): remove $VENV and run again"
      say "letting $VENV see the packages of $base ($info)"
    else
      say "creating $VENV on top of $base ($info)"
      make_venv "$base"
    fi
    inherit_site_packages "$base"
    torch_ok "$VENV/bin/python" || die "$VENV still cannot import torch from $base"
  elif [ ! -x "$VENV/bin/python" ]; then
    interp=${base:-${PGD_BASE_PYTHON:-$(command -v python3 || true)}}
    [ -n "$interp" ] || die "no python3 on PATH"
    say "creating $VENV with $interp (no Python with torch >= 2.11 found; torch==$TORCH_PIN will be installed)"
    make_venv "$interp"
  fi
fi
PY="$VENV/bin/python"
export PY PGD_ROOT
"$PY" -m pip --version >/dev/null 2>&1 || die "$PY has no pip (neither its own nor its base environment's): install pip there"

pip_log=$(mktemp)
# Byte-compiling: pip compiles every module of a package as it installs it, one
# file after another, while nothing else runs (torch: 31 of its 43 s to install
# on the 2-core CI machine; lightning, transformers and accelerate: 17 of 51).
# So packages are installed without (--no-compile), and compileall writes the
# same .pyc files beside the next installs, on the other core. Nothing imports
# a package before its compile has finished (bytecompile_wait): where
# PYTHONDONTWRITEBYTECODE is set (it is on the CI machine) a module without its
# .pyc is compiled again by every process that imports it.
purelib=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
compile_pid="" installed=0
bytecompile_bg() {  # compile what the installs so far left uncompiled (compileall skips the rest)
  bytecompile_wait
  [ $installed = 1 ] || return 0  # an environment used as it is gets no new files
  "$PY" -m compileall -q -j "${1:-1}" "$purelib" >/dev/null 2>&1 &
  compile_pid=$!
}
bytecompile_wait() {  # a file compileall cannot compile is only imported without a .pyc (as pip leaves it)
  [ -n "$compile_pid" ] || return 0
  wait "$compile_pid" || true
  compile_pid=""
}
pip_install() { installed=1; "$PY" -m pip install -q --disable-pip-version-check --no-compile "$@" >"$pip_log" 2>&1; }
pip_error() { grep -iE "error" "$pip_log" | tail -n 2 | tr '\n' ' '; }
if ! torch_ok "$PY"; then
  say "installing torch==$TORCH_PIN"
  pip_install "torch==$TORCH_PIN" || die "could not install torch==$TORCH_PIN: $(pip_error). Install torch >= 2.11 into a Python and run again with PGD_PYTHON=<that python>"
fi
bytecompile_bg

# module:package lists of what is missing.
missing() {
  "$PY" - "$@" <<'PYEOF'
import importlib.util, shutil, sys
out = []
for spec in sys.argv[1:]:
    mod, pkg, exe = (spec.split(":") + [""])[:3]
    if importlib.util.find_spec(mod) is None and not (exe and shutil.which(exe)):
        out.append(pkg)
print(" ".join(out))
PYEOF
}
# cmake and ninja may also come from PATH (scikit-build-core uses those).
required="scikit_build_core:scikit-build-core cmake:cmake:cmake ninja:ninja:ninja"
[ "${PGD_SETUP_TESTS:-0}" = 1 ] && required="$required pytest:pytest pytest_timeout:pytest-timeout"
need_py=$(missing $required)
if [ -n "$need_py" ]; then
  say "installing $need_py"
  # shellcheck disable=SC2086
  pip_install $need_py || die "could not install $need_py, which the build/tests need: $(pip_error)"
fi
# Optional packages: a warning naming what is lost when one cannot be had.
# Offline (pip finds no index, or cannot connect), one failure is enough: the
# others are not tried, so an offline machine does not wait for each timeout.
no_index=0
optional_install() {  # $1: the package(s); $2: what is lost without them; then pip's arguments
  optional_step "$1" "$2" pip_install --retries 1 --timeout 15 "${@:3}"
}
optional_step() {  # $1: the package(s); $2: what is lost without them; then the command (output into $pip_log)
  local what=$1 lost=$2
  shift 2
  if [ $no_index = 1 ]; then
    warn "not installing $what (no package index reachable): $lost"
    return 0
  fi
  say "installing $what"
  "$@" >"$pip_log" 2>&1 && return 0
  grep -qE "from versions: none|NewConnectionError|ConnectTimeout|Max retries exceeded|Temporary failure in name resolution|Network is unreachable" \
    "$pip_log" && no_index=1
  warn "could not install $what ($(pip_error)): $lost"
}
# The two-host tests also launch with MPICH: its own mpi4py, kept apart in
# $VENV/mpich-mpi4py and put first on PYTHONPATH for MPICH's ranks only.
# Compiling mpi4py takes minutes on a 2-core machine, and the installs below
# mostly wait for downloads: this build runs beside them (and beside Open
# MPI's mpi4py build), into a directory of its own, with a log of its own.
# Both mpi4py builds are unoptimised (-O0 -g0; PGD_MPI4PY_CFLAGS to change it):
# pygraph_dist uses mpi4py for the rendezvous (a few small messages), and its
# large generated C file compiled 3.4x quicker (133 s against 456 s, on the
# 2-core machine while it was shared), the longest step of setup.
# Each build is kept as a wheel in a cache per MPI and Python (PGD_CACHE_DIR,
# default ~/.cache/pygraph_dist; keyed by the Python, the mpicc binary, what it
# compiles and links with, and the flags): a fresh clone's setup installs the
# wheel built earlier against the same MPI instead of compiling it again (about
# 30 s each on the 2-core CI machine). pip's own wheel cache is not used: keyed
# by mpi4py's version alone, it would hand back a build against another MPI.
MPI4PY_CFLAGS="${CFLAGS:-} ${PGD_MPI4PY_CFLAGS:--O0 -g0}"
PGD_CACHE_DIR=${PGD_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/pygraph_dist}
mpi4py_install() {  # $1: mpicc; then pip install's own arguments (--target DIR)
  local mpicc=$1 real key dir whl tmp
  shift
  real=$(readlink -f "$mpicc")
  key=$({ "$PY" -c 'import sys, sysconfig; print(sys.version, sysconfig.get_platform())'
          echo "$real"; stat -c '%s %Y' "$real"
          "$mpicc" -show 2>/dev/null || "$mpicc" --showme 2>/dev/null || true
          echo "$MPI4PY_CFLAGS"; } | sha256sum | cut -c1-16)
  dir="$PGD_CACHE_DIR/mpi4py/$key"
  whl=$(ls "$dir"/mpi4py-*.whl 2>/dev/null | head -n1 || true)
  if [ -n "$whl" ]; then
    echo "mpi4py: the wheel built earlier against $mpicc ($whl)"
  else
    tmp=$(mktemp -d)
    MPICC=$mpicc CFLAGS="$MPI4PY_CFLAGS" "$PY" -m pip wheel -q --disable-pip-version-check --retries 1 --timeout 15 \
        --no-cache-dir --no-binary mpi4py --no-deps -w "$tmp" mpi4py || { rm -rf "$tmp"; return 1; }
    whl=$(ls "$tmp"/mpi4py-*.whl | head -n1)
    # Into the cache under a temporary name, then renamed: a setup beside this one
    # never installs half a wheel. A cache that cannot be written is left out.
    if mkdir -p "$dir" 2>/dev/null && cp "$whl" "$dir/.partial.$$" 2>/dev/null; then
      mv "$dir/.partial.$$" "$dir/$(basename "$whl")"
    fi
  fi
  "$PY" -m pip install -q --disable-pip-version-check --no-deps "$@" "$whl"
  local rc=$?
  [ -z "${tmp:-}" ] || rm -rf "$tmp"
  return $rc
}
mpich_pid=""
if [ "${PGD_SETUP_TESTS:-0}" = 1 ] && [ "${PGD_SKIP_TWO_HOST:-0}" != 1 ] \
    && command -v mpicc.mpich >/dev/null 2>&1 && [ ! -d "$VENV/mpich-mpi4py/mpi4py" ]; then
  say "installing mpi4py (built against $(command -v mpicc.mpich), into $VENV/mpich-mpi4py), beside the next steps"
  mpich_log=$(mktemp)
  mpi4py_install "$(command -v mpicc.mpich)" --target "$VENV/mpich-mpi4py" >"$mpich_log" 2>&1 &
  mpich_pid=$!
fi
need_opt=$(missing numpy:numpy matplotlib:matplotlib tqdm:tqdm)
if [ -n "$need_opt" ]; then
  # shellcheck disable=SC2086
  optional_install "$need_opt" "the benchmark's plots and its smoke test are skipped" $need_opt
fi
# The documentation build (tests/python/test_docs.py builds docs/ with warnings
# as errors); without these that test is skipped, with the reason.
if [ "${PGD_SETUP_TESTS:-0}" = 1 ]; then
  # pytest-xdist: tests/run-all.sh runs the CPU tests in a few long-lived
  # workers on a machine with few cores (without it: one pytest, slower).
  need_xdist=$(missing xdist:pytest-xdist)
  if [ -n "$need_xdist" ]; then
    optional_install "$need_xdist" "the CPU tests run in one pytest process, not in parallel workers" $need_xdist
  fi
  need_docs=$(missing sphinx:sphinx myst_parser:myst-parser)
  if [ -n "$need_docs" ]; then
    # shellcheck disable=SC2086
    optional_install "$need_docs" "the documentation build test is skipped" $need_docs
  fi
  # The framework integrations' tests (pygraph_dist[lightning], [hf]): with torch
  # already installed, pip keeps it (each asks for torch>=2.x, which it satisfies).
  need_fw=$(missing lightning:lightning transformers:transformers accelerate:accelerate)
  if [ -n "$need_fw" ]; then
    # shellcheck disable=SC2086
    optional_install "$need_fw" "the Lightning and Hugging Face integration tests are skipped" $need_fw
  fi
fi

# mpi4py compiled against the MPI whose launcher starts the ranks (mpi4py_install).
if ! "$PY" -c "import mpi4py" >/dev/null 2>&1; then
  if command -v mpicc >/dev/null 2>&1; then
    optional_step "mpi4py (built against $(command -v mpicc))" \
      "MPI launches across hosts need MASTER_ADDR/MASTER_PORT, and the mpirun tests are skipped" \
      mpi4py_install "$(command -v mpicc)"
  else
    warn "no mpicc: mpi4py not installed; MPI launches across hosts need MASTER_ADDR/MASTER_PORT, and the mpirun tests are skipped"
  fi
fi
if [ -n "$mpich_pid" ]; then
  wait "$mpich_pid" || warn "could not install mpi4py built against MPICH ($(grep -iE "error" "$mpich_log" | tail -n 2 | tr '\n' ' ')): the MPICH two-host test is skipped"
  rm -f "$mpich_log"
  [ -d "$VENV/mpich-mpi4py/mpi4py" ] || rm -rf "$VENV/mpich-mpi4py"
fi
rm -f "$pip_log"
bytecompile_bg 0  # the installs since torch, on every core; then torch is imported

say "building pygraph_dist against $("$PY" -c 'import torch; print("torch", torch.__version__)')"
( cd "$PGD_ROOT" && "$PY" -m pip install -q --disable-pip-version-check --no-build-isolation --no-deps . )
bytecompile_wait
"$PY" -c "import pygraph_dist as p; ok, why = p.graphs_available(); print('[setup] pygraph_dist', p.__version__, '- graphs available' if ok else '- ' + why)" >&2

# pygraph-launch, torchrun and python with pygraph_dist are in $VENV/bin, which
# is not on PATH: how to get them in a new shell. The two commands print it at
# their end (PGD_HINT_AT_END=1), where it is not scrolled away.
pgd_activate_hint() {
  if [ -f "$VENV/bin/activate" ]; then
    say "pygraph-launch, torchrun and python with pygraph_dist are in $VENV/bin; to use them in a shell: source $VENV/bin/activate"
  else
    say "pygraph-launch, torchrun and python with pygraph_dist are in $VENV/bin; to use them in a shell: export PATH=\"$VENV/bin:\$PATH\""
  fi
}
[ "${PGD_HINT_AT_END:-0}" = 1 ] || pgd_activate_hint
