#!/usr/bin/env bash
# Create (or reuse) .venv with the pinned CPU environment and install megatron-jf in editable mode.
# Idempotent: re-running after the requirements change reinstalls; otherwise it returns at once.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
if [ ! -x .venv/bin/python ]; then
  echo "[bootstrap] creating .venv with $PY"
  "$PY" -m venv .venv
fi
stamp=.venv/.megatron_jf_stamp
want=$(cat requirements-cpu.txt requirements-nodeps.txt setup.py | sha256sum | cut -c1-16)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
echo "[bootstrap] installing pinned packages (a few minutes on a fresh machine)"
.venv/bin/python -m pip install -q --disable-pip-version-check -r requirements-cpu.txt
.venv/bin/python -m pip install -q --disable-pip-version-check --no-deps -r requirements-nodeps.txt
.venv/bin/python -m pip install -q --disable-pip-version-check --no-deps -e .
echo "$want" > "$stamp"
echo "[bootstrap] done"
