#!/usr/bin/env bash
# Compile the extension's CUDA code paths against a CUDA build of torch, on a
# machine without a GPU: catches compile errors in GPU-only code in CI.
# Uses torch==2.14.1 (CUDA 13) from the local package index and the machine's
# nvcc/CUDA headers; the wheel is downloaded into build/cuda-check/wheel (never
# installed), and only its headers, CMake files and libraries are unpacked.
# Needs PY (from setup-env.sh). tests/run-all.sh skips it with PGD_SKIP_CUDA_COMPILE=1.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
WORK="$ROOT/build/cuda-check"
TORCH_VERSION=${PGD_CUDA_TORCH_VERSION:-2.14.1}
mkdir -p "$WORK/wheel"
wheel=$(ls "$WORK"/wheel/torch-"$TORCH_VERSION"-*.whl 2>/dev/null | head -n1 || true)
# pip warns about every configured package index that has no copy of torch
# ("Location 'file:///.../torch/' is ignored: it is neither a file nor a
# directory" for a local index without it): harmless when another index had it,
# so those lines are shown only when the download fails.
IGNORED_INDEX="is ignored: it is neither a file nor a directory"
if [ -z "$wheel" ]; then
  echo "[cuda-check] fetching torch==$TORCH_VERSION (CUDA build, a wheel of over 500 MB) from the package index" >&2
  pip_log="$WORK/pip-download.log"
  if ! "$PY" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
      "torch==$TORCH_VERSION" -d "$WORK/wheel" >"$pip_log" 2>&1; then
    cat "$pip_log" >&2
    ! grep -q "$IGNORED_INDEX" "$pip_log" || echo "[cuda-check] (a location \"ignored\" above is a configured package index without torch: harmless by itself)" >&2
    echo "[cuda-check] could not download torch==$TORCH_VERSION: set PGD_CUDA_TORCH_VERSION to a CUDA build of torch the package index has, or skip this check with PGD_SKIP_CUDA_COMPILE=1" >&2
    exit 1
  fi
  grep -v "$IGNORED_INDEX" "$pip_log" >&2 || true
  wheel=$(ls "$WORK"/wheel/torch-"$TORCH_VERSION"-*.whl | head -n1)
fi
if [ ! -f "$WORK/torch/torch/share/cmake/Torch/TorchConfig.cmake" ]; then
  echo "[cuda-check] unpacking headers and libraries of $(basename "$wheel")" >&2
  rm -rf "$WORK/torch"
  "$PY" - "$wheel" "$WORK/torch" <<'PYEOF'
import sys, zipfile
wheel, dest = sys.argv[1:]
# torch's CMake package checks that every library its imported targets name
# exists, so all of torch/lib comes out, not only what the extension links.
with zipfile.ZipFile(wheel) as z:
    names = [n for n in z.namelist() if n.startswith(("torch/include/", "torch/share/", "torch/lib/"))]
    z.extractall(dest, names)
PYEOF
fi
nvcc_bin=$(command -v nvcc || true)
[ -n "$nvcc_bin" ] || { echo "[cuda-check] nvcc is not on PATH: cannot compile the CUDA code paths" >&2; exit 1; }
cmake -S "$ROOT" -B "$WORK/build" -G Ninja -DPython_EXECUTABLE="$PY" \
    -DTorch_DIR="$WORK/torch/torch/share/cmake/Torch" -DPGD_CUDA=ON -DPGD_BUILD_TESTS=OFF \
    > "$WORK/configure.log" 2>&1 || { cat "$WORK/configure.log"; exit 1; }
grep "pygraph_dist: torch" "$WORK/configure.log" >&2
cmake --build "$WORK/build" --target _C
echo "[cuda-check] OK: CUDA code paths compile and link against torch $TORCH_VERSION" >&2
