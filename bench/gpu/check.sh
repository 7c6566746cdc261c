#!/usr/bin/env bash
# The one-GPU check of issue 21 (bench/gpu_check.py says what each summary row measures). Sized for one H200 in
# <= 9 minutes, the install of the carried wheels included; prints one summary table (and writes its log to
# $OUT/gpu_check.log when $OUT is set, as on the device machine).
#
#   bash bench/gpu_check.sh --fetch-wheels   # here, once per checkout (needs PyPI): .whl/ for the device's Python 3.12
#   bash bench/gpu_check.sh                  # on the GPU machine: installs .whl/*.whl into /tmp/jf_site, runs the check
#   bash bench/gpu_check.sh --dry-run        # CPU, tiny models: the same script end to end (CI runs this)
#   bash bench/gpu_check.sh --sections resume,decode,train:dense/none   # a rerun of some rows (~1-2 min each)
#
# The device machine has no network and no Transformer Engine (TE ships as source only and cannot be carried), so the
# wheels travel with the working tree: device tool run(command="bash bench/gpu_check.sh", carry=[".whl"],
# timeout_s=560). The TE paths (TE layer spec, TE fused THD attention, TENorm) run only in an NGC container.
set -uo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
WHEELS="megatron-core==0.19.2 webdataset==1.0.2 braceexpand==0.1.7"  # what the device image lacks (pure deps: numpy,
                                                                     # packaging, pyyaml, torch are there)
if [ "${1:-}" = "--fetch-wheels" ]; then
  mkdir -p .whl
  # shellcheck disable=SC2086
  exec "$PY" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl $WHEELS
fi
if ! "$PY" -c "import megatron.core, webdataset" 2>/dev/null; then
  if ls .whl/*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/jf_site .whl/*.whl \
      || { echo "gpu_check.sh: installing .whl/*.whl failed" >&2; exit 1; }
    export PYTHONPATH=/tmp/jf_site${PYTHONPATH:+:$PYTHONPATH}
  else
    echo "gpu_check.sh: megatron-core / webdataset missing and no .whl/ wheels (bash bench/gpu_check.sh --fetch-wheels)" >&2
    exit 1
  fi
fi
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2} CUDA_DEVICE_MAX_CONNECTIONS=1 PYTHONUNBUFFERED=1
if [ -n "${OUT:-}" ]; then
  "$PY" -m bench.gpu.check "$@" 2>&1 | tee "$OUT/gpu_check.log"
else
  "$PY" -m bench.gpu.check "$@"
fi
