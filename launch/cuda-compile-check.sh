#!/usr/bin/env bash
# Compile the extension's CUDA code paths against a CUDA build of torch, on a
# machine without a GPU: catches compile errors in GPU-only code in CI.
# Uses torch==2.14.1 (CUDA 13) from the local package index and the machine's
# nvcc/CUDA headers; only headers, CMake files and libraries are unpacked. Needs PY (from setup-env.sh).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
WORK="$ROOT/build/cuda-check"
TORCH_VERSION=${PGD_CUDA_TORCH_VERSION:-2.14.1}
mkdir -p "$WORK/wheel"
wheel=$(ls "$WORK"/wheel/torch-"$TORCH_VERSION"-*.whl 2>/dev/null | head -n1 || true)
if [ -z "$wheel" ]; then
  echo "[cuda-check] fetching torch==$TORCH_VERSION (CUDA build) from the package index" >&2
  "$PY" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
      "torch==$TORCH_VERSION" -d "$WORK/wheel"
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
