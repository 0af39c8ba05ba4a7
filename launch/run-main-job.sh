#!/usr/bin/env bash
# The main job: a short data-parallel training run of a deep MLP on 2 local
# ranks (Gloo on a CPU-only machine, NCCL + CUDA graphs with 2 GPUs; one rank
# per GPU when fewer GPUs than ranks). Sets up the environment first.
#   ./launch/run-main-job.sh [--steps N] [other examples/train_mlp.py flags]
set -euo pipefail
export PGD_HINT_AT_END=1  # setup's "source .venv/bin/activate" hint comes last
source "$(dirname "${BASH_SOURCE[0]}")/setup-env.sh"
cd "$PGD_ROOT"
nproc=2
gpus=$("$PY" -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)")
if [ "$gpus" -ge 1 ] && [ "$gpus" -lt 2 ]; then
  echo "[main] one GPU visible: running 1 rank (NCCL allows one rank per GPU)" >&2
  nproc=1
fi
rc=0
"$PY" -m pygraph_dist.launch --launcher torchrun -n "$nproc" examples/train_mlp.py "$@" || rc=$?
pgd_activate_hint
exit $rc
