#!/usr/bin/env bash
# The GPU check, for the day a machine with an NVIDIA GPU is lent: the CUDA tests (offloading on
# the side stream, the CUDA device's budget, expert parallelism over NCCL) and short GPU
# benchmarks of the host tier and of the disk tier (pinned slots, direct reads into pinned
# memory, side-stream uploads), and short CUDA training runs with host and disk-tier experts. Uses the machine's own python3 with PyTorch (nothing is
# installed: such machines may have no network); moescale runs from this checkout. Results
# and logs go to $OUT (default /tmp/gpu_check). Meant to finish in under 8 minutes.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
status=0
step() {  # step NAME SECONDS CMD...: run with a time limit, log to $OUT/NAME.log
  local name=$1 limit=$2; shift 2
  echo "== $name (limit ${limit}s)"
  timeout "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
  local rc=${PIPESTATUS[0]}
  echo "== $name: exit $rc"
  [ "$rc" -eq 0 ] || status=1
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
torch.cuda.is_available())" | tee -a "$OUT/gpu.txt"
step cuda_tests 240 "$PY" -m pytest -q -p no:cacheprovider -o addopts="" -m gpu \
  tests/offload/test_cuda_offload.py tests/offload/test_devices.py tests/parallel/test_ep_cuda.py
step offload_host 90 "$PY" -m moescale bench offload --device cuda --runs 3 --modes eager \
  --budgets 2 --out "$OUT/offload_cuda.json"
mkdir -p /tmp/moescale-gpu-disk
step offload_disk 150 "$PY" -m moescale bench offload-disk --device cuda --experts 16 \
  --steps 2 --probe-gb 0.5 --dir /tmp/moescale-gpu-disk --out "$OUT/offload_disk_cuda.json"
# the trainer on CUDA with offloaded experts: side-stream uploads, the CUDA stall clock behind
# wait_s (offload/cache.py, devices.py), pinned host memory; host and disk tiers, 6 steps each
for tier in host disk; do
  step "train_${tier}_cuda" 120 "$PY" -m moescale train --train.device cuda --offload.tier "$tier" \
    --train.steps 6 --train.eval_interval 0 --train.sample_tokens 0 --train.progress false \
    --train.report false --train.run_dir "$OUT/run_${tier}_cuda"
done
exit $status
