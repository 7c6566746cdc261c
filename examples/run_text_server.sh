#!/usr/bin/env bash
# Serve a megatron-jf checkpoint: examples/run_text_server.sh CKPT [TP=1] [PORT=5000] [extra server args...]
# Runs $PYTHON if set, else the checkout's .venv/bin/python (set up by bash scripts/bootstrap.sh).
# TP>1 launches torchrun with TP ranks (rank 0 serves HTTP, the others follow).
# TP and PORT are optional positionals: `run_text_server.sh CKPT --decoder mr` serves on 5000 with TP 1.
set -euo pipefail
usage="usage: $0 CKPT [TP] [PORT] [--decoder mr --block-size 16 ...]"
if [ $# -lt 1 ]; then
  echo "$usage" >&2
  exit 2
fi
is_int() { [[ $1 =~ ^[0-9]+$ ]]; }
CKPT=$1; shift
TP=1; PORT=5000
if [ $# -gt 0 ] && [[ $1 != -* ]]; then
  is_int "$1" && [ "$1" -ge 1 ] || { echo "error: TP must be a positive integer, got '$1'; $usage" >&2; exit 2; }
  TP=$1; shift
  if [ $# -gt 0 ] && [[ $1 != -* ]]; then
    is_int "$1" || { echo "error: PORT must be an integer, got '$1'; $usage" >&2; exit 2; }
    PORT=$1; shift
  fi
fi
HERE=$(cd "$(dirname "$0")/.." && pwd)
source "$HERE/scripts/jf_env.sh"
PY=$(jf_python "$HERE")  # $PYTHON, else the checkout's .venv (bash scripts/bootstrap.sh)
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
if [ "$TP" -gt 1 ]; then
  exec "$PY" -m torch.distributed.run --nproc_per_node "$TP" --master_port "${MASTER_PORT:-29511}" \
    "$HERE/tools/run_text_generation_server.py" --load "$CKPT" --tp "$TP" --port "$PORT" "$@"
else
  exec "$PY" "$HERE/tools/run_text_generation_server.py" --load "$CKPT" --tp 1 --port "$PORT" "$@"
fi
