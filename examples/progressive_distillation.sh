#!/usr/bin/env bash
# Progressive distillation (paper Sec. 4.1): round 1 trajectories at n=16 from the base model, train with
# w=16; regenerate trajectories with the round-1 model at n=32; train round 2 with w=8 -- on one machine
# (NPROC processes). examples/train_jf_qwen7b_h200.sh is the same recipe for H200 nodes with every flag spelled out.
# Runs $PYTHON if set, else the checkout's .venv/bin/python (set up by bash scripts/bootstrap.sh).
# Every stage resumes: trajectory collection skips prompts already in complete shards, training resumes from
# the latest checkpoint in its --save directory, and a finished stage (its .done marker) is skipped.
#
#   bash examples/progressive_distillation.sh BASE_CKPT PROMPTS.jsonl WORKDIR [NPROC] [-- extra pretrain_jf.py flags]
#
# Environment knobs (defaults: the paper, Sec. 4.1 -- lr 1e-6, batch size 4, max new sequence length 2048):
#   N1=16 W1=16 N2=32 W2=8 MAX_NEW=2048 STEPS1=10000 STEPS2=10000 LR=1e-6 TP=1 PP=1 MBS=1 GBS=4 BATCH=32
# (the official code's values instead: LR=1e-5 and -- --ar-weight 10 --pc-normalization reference)
set -euo pipefail
BASE=${1:?base checkpoint}; PROMPTS=${2:?prompts jsonl}; WORK=${3:?work dir}; NPROC=${4:-1}
shift $(( $# < 4 ? $# : 4 )); [ "${1:-}" = "--" ] && shift
N1=${N1:-16} W1=${W1:-16} N2=${N2:-32} W2=${W2:-8} MAX_NEW=${MAX_NEW:-2048}
STEPS1=${STEPS1:-10000} STEPS2=${STEPS2:-10000} LR=${LR:-1e-6} TP=${TP:-1} PP=${PP:-1}
MBS=${MBS:-1} GBS=${GBS:-4} BATCH=${BATCH:-32}
DP=$(( NPROC / (TP * PP) )); (( DP >= 1 )) || { echo "error: NPROC=$NPROC < TP x PP = $((TP * PP))" >&2; exit 1; }
if (( GBS % (DP * MBS) )); then  # megatron: the global batch is a multiple of DP x micro-batch
  NEW=$(( (GBS + DP * MBS - 1) / (DP * MBS) * DP * MBS ))
  echo "note: global batch $GBS -> $NEW: it must be a multiple of data-parallel size x micro-batch = $DP x $MBS"
  GBS=$NEW
fi
cd "$(dirname "$0")/.."
source scripts/jf_env.sh
DRY_RUN=${DRY_RUN:-0}  # 1: print each stage's command instead of running it
if [ "$DRY_RUN" = 1 ]; then PY=$(jf_python "$PWD" 2>/dev/null) || PY=python; else PY=$(jf_python "$PWD"); fi
mkdir -p "$WORK"
launch() {
  local cmd=("$PY" "$@"); [ "$NPROC" -gt 1 ] && cmd=("$PY" -m torch.distributed.run --nproc_per_node "$NPROC" "$@")
  if [ "$DRY_RUN" = 1 ]; then printf '+'; printf ' %q' "${cmd[@]}"; printf '\n'; else "${cmd[@]}"; fi
}
stage() {  # stage NAME command...
  local name=$1; shift
  if [ -f "$WORK/$name.done" ]; then echo "[$name] done earlier, skipping"; return; fi
  echo "[$name] starting"; "$@"; [ "$DRY_RUN" = 1 ] || date -u +%FT%TZ > "$WORK/$name.done"
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
