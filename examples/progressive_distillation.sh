#!/usr/bin/env bash
# Progressive distillation (paper Sec. 4.1): round 1 trajectories at n=16 from the base model, train with
# w=16; regenerate trajectories with the round-1 model at n=32; train round 2 with w=8.
# Every stage resumes: trajectory collection skips prompts already in complete shards, training resumes from
# the latest checkpoint in its --save directory, and a finished stage (its .done marker) is skipped.
#
#   bash examples/progressive_distillation.sh BASE_CKPT PROMPTS.jsonl WORKDIR [NPROC] [-- extra pretrain_jf.py flags]
#
# Environment knobs (defaults follow the paper / reference code where they exist):
#   N1=16 W1=16 N2=32 W2=8 MAX_NEW=1024 STEPS1=10000 STEPS2=10000 LR=1e-5 TP=1 PP=1 MBS=1 GBS=32 BATCH=32
set -euo pipefail
BASE=${1:?base checkpoint}; PROMPTS=${2:?prompts jsonl}; WORK=${3:?work dir}; NPROC=${4:-1}
shift $(( $# < 4 ? $# : 4 )); [ "${1:-}" = "--" ] && shift
N1=${N1:-16} W1=${W1:-16} N2=${N2:-32} W2=${W2:-8} MAX_NEW=${MAX_NEW:-1024}
STEPS1=${STEPS1:-10000} STEPS2=${STEPS2:-10000} LR=${LR:-1e-5} TP=${TP:-1} PP=${PP:-1}
MBS=${MBS:-1} GBS=${GBS:-32} BATCH=${BATCH:-32}
cd "$(dirname "$0")/.."
mkdir -p "$WORK"
launch() { if [ "$NPROC" -gt 1 ]; then torchrun --nproc_per_node "$NPROC" "$@"; else python "$@"; fi; }
stage() {  # stage NAME command...
  local name=$1; shift
  if [ -f "$WORK/$name.done" ]; then echo "[$name] done earlier, skipping"; return; fi
  echo "[$name] starting"; "$@"; date -u +%FT%TZ > "$WORK/$name.done"
}
stage traj1 launch tools/generate_trajectories.py --load "$BASE" --prompts "$PROMPTS" --block-size "$N1" \
  --max-new-tokens "$MAX_NEW" --batch-size "$BATCH" --tp "$TP" --out "$WORK/traj_n$N1"
stage jf1 launch pretrain_jf.py --load "$BASE" --data "$WORK/traj_n$N1" --block-size "$N1" --window-size "$W1" \
  --tp "$TP" --pp "$PP" --micro-batch-size "$MBS" --global-batch-size "$GBS" --lr "$LR" --train-steps "$STEPS1" \
  --save "$WORK/jf_round1" --save-interval 500 "$@"
stage traj2 launch tools/generate_trajectories.py --load "$WORK/jf_round1" --prompts "$PROMPTS" --block-size "$N2" \
  --max-new-tokens "$MAX_NEW" --batch-size "$BATCH" --tp "$TP" --out "$WORK/traj_n$N2"
stage jf2 launch pretrain_jf.py --load "$WORK/jf_round1" --data "$WORK/traj_n$N2" --block-size "$N2" --window-size "$W2" \
  --tp "$TP" --pp "$PP" --micro-batch-size "$MBS" --global-batch-size "$GBS" --lr "$LR" --train-steps "$STEPS2" \
  --save "$WORK/jf_round2" --save-interval 500 "$@"
echo "progressive distillation finished: $WORK/jf_round2 (export: python tools/convert_hf.py mcore-to-hf --load $WORK/jf_round2 --out HF_DIR)"
