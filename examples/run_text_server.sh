#!/usr/bin/env bash
# Serve a megatron-jf checkpoint: examples/run_text_server.sh CKPT [TP=1] [PORT=5000] [extra server args...]
# TP>1 launches torchrun with TP ranks (rank 0 serves HTTP, the others follow).
set -euo pipefail
if [ $# -lt 1 ]; then
  echo "usage: $0 CKPT [TP] [PORT] [--decoder mr --block-size 16 ...]" >&2
  exit 2
fi
CKPT=$1; TP=${2:-1}; PORT=${3:-5000}
shift $(( $# < 3 ? $# : 3 ))
HERE=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-python}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
if [ "$TP" -gt 1 ]; then
  exec "$PY" -m torch.distributed.run --nproc_per_node "$TP" --master_port "${MASTER_PORT:-29511}" \
    "$HERE/tools/run_text_generation_server.py" --load "$CKPT" --tp "$TP" --port "$PORT" "$@"
else
  exec "$PY" "$HERE/tools/run_text_generation_server.py" --load "$CKPT" --tp 1 --port "$PORT" "$@"
fi
