# Sourced by bootstrap.sh and test.sh: maps JF_ENV to a venv, an interpreter and a requirements override file.
# One place for the two CI environments (README "Tests and CI").
case "${JF_ENV:-primary}" in
  primary)
    JF_VENV=.venv
    JF_PY=python3.11
    command -v "$JF_PY" >/dev/null || JF_PY=python3
    JF_OVERRIDES=""
    ;;
  py312)
    JF_VENV=.venv312
    JF_PY="$(pyenv root 2>/dev/null)/versions/3.12.1/bin/python"
    [ -x "$JF_PY" ] || JF_PY=python3.12
    JF_OVERRIDES=requirements-py312.txt
    ;;
  *)
    echo "JF_ENV must be 'primary' or 'py312', got '${JF_ENV}'" >&2
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
