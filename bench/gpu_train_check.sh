#!/usr/bin/env bash
# GPU training check (issue 12) on one H200, <= 8 minutes: see bench/gpu_train_check.py for what it runs.
# Installs the carried wheels (.whl/*.whl: megatron-core 0.16.1, webdataset, braceexpand) into /tmp/jf_site
# without touching the network, then runs the check. Pass --dry-run to check the plumbing on CPU.
#   device tool:  run(command="bash bench/gpu_train_check.sh", carry=[".whl"], timeout_s=560)
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c "import megatron.core, webdataset" 2>/dev/null; then
  if ls .whl/*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/jf_site .whl/*.whl \
      || { echo "gpu_train_check.sh: installing .whl/*.whl failed" >&2; exit 1; }
    export PYTHONPATH=/tmp/jf_site${PYTHONPATH:+:$PYTHONPATH}
  else
    echo "gpu_train_check.sh: megatron-core / webdataset missing and no .whl/ wheels (see bench/gpu_train_check.py)" >&2
    exit 1
  fi
fi
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2} CUDA_DEVICE_MAX_CONNECTIONS=1 PYTHONUNBUFFERED=1
if [ -n "${OUT:-}" ]; then
  "$PY" bench/gpu_train_check.py "$@" 2>&1 | tee "$OUT/gpu_train_check.log"
else
  "$PY" bench/gpu_train_check.py "$@"
fi
