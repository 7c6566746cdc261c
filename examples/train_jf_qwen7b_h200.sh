#!/usr/bin/env bash
# Jacobi Forcing for Qwen2.5-Coder-7B-Instruct on H200 nodes (8 GPUs each): the paper's recipe (arXiv 2512.14681,
# Sec. 4.1, "Training Settings"), four resumable stages:
#   1. traj1  greedy Jacobi trajectories of the base model at block size n=16 (max 2048 new tokens)
#   2. jf1    round 1: n=16, window w=16, 10k steps, lr 1e-6, batch size 4, linear progressive noise schedule
#   3. traj2  trajectories regenerated with the round-1 model at n=32
#   4. jf2    round 2: n=32, w=8, 10k steps from the round-1 weights
# with L = L_pc + w_AR * L_AR (paper Eq. 9). A stage that finished (WORK/<stage>.done) is skipped; an interrupted
# stage resumes when the script is run again (trajectory collection skips prompts already in complete shards,
# training resumes from the newest checkpoint in its --save directory).
#
# Run the same command on every node (Slurm: srun --ntasks-per-node=1 ...); WORK must be on a shared filesystem:
#   BASE=ckpt/qwen7b-mcore PROMPTS=data/opencodeinstruct.jsonl WORK=runs/jf7b \
#   NNODES=1 MASTER_ADDR=node0 bash examples/train_jf_qwen7b_h200.sh [-- extra pretrain_jf.py flags]
# Before the first run (once; the result loads at any TP/PP):
#   python tools/convert_hf.py hf-to-mcore --hf /models/Qwen2.5-Coder-7B-Instruct --out ckpt/qwen7b-mcore --tp 2
# DRY_RUN=1 prints every stage's command (and the batch arithmetic) without running anything.
#
# Where the values come from. "paper" = Sec. 4.1 / Eq. 7-9; "code" = the official JacobiForcing training scripts
# (their loss and trainer), used where the paper gives no value:
#   n=16 w=16 10k steps, then n=32 w=8 10k steps, trajectories regenerated ... paper Sec. 4.1
#   lr 1e-6, batch size 4, max new sequence length 2048 ......................... paper Sec. 4.1
#   linear progressive noise schedule, noise-conditioned (nc) mask, KL ......... paper Eq. 7-8
#   L = L_pc + w_AR L_AR, per-block L_pc normalisation ("paper") ............... paper Eq. 8-9
#     (Eq. 9 gives no value for its weight, whose symbol w also names the window of Eq. 7; the official
#      checkpoints are named "ar_1": AR_WEIGHT=1 here. The official code uses 10 with a mean-over-positions
#      normalisation: AR_WEIGHT=10 PC_NORMALIZATION=reference LR=1e-5 reproduce the code instead.)
#   cosine decay to 0 with 3% warmup, AdamW (0.9, 0.95) eps 1e-8, decay 0.01 ..... code (paper: not stated)
#   bf16 with fp32 main weights, gradient clip 1.0 ................................ code
#
# Memory (per GPU, TP=2, 16k-token streams worst case; measure with
#   python -m bench.train_memory --model qwen2.5-7b --script examples/train_jf_qwen7b_h200.sh):
# without recomputation the saved activations alone are ~36*h elements per token per layer, ~133 GiB at TP=2 for
# two 16k-token streams, more than an H200 holds next to the weights and optimizer state. Full recomputation
# (every layer, one at a time), sequence parallelism, the distributed optimizer and the chunked loss over the
# loss rows keep the 16k worst case under 120 GiB (the planner projects 41.7 GiB per GPU for these settings at
# TP=2, DP=4; a projection from activation sizes measured on CPU, not a GPU measurement). The paper's samples
# (prompt + <= 2048 new tokens) are far shorter, and with variable sequence lengths nothing is padded to
# --seq-length; a sample longer than --seq-length stops the run with an error naming it.
set -euo pipefail
cd "$(dirname "$0")/.."
[ "${1:-}" = "--" ] && shift
EXTRA_ARGS=("$@")

# ---------------------------------------------------------------- cluster
NNODES=${NNODES:-1}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
MASTER_ADDR=${MASTER_ADDR:-localhost}
MASTER_PORT=${MASTER_PORT:-29500}
JOB_ID=${JOB_ID:-jf-qwen7b}
DRY_RUN=${DRY_RUN:-0}

# ---------------------------------------------------------------- paths
BASE=${BASE:-ckpt/qwen7b-mcore}                 # converted base model (weights + tokenizer)
PROMPTS=${PROMPTS:-data/opencodeinstruct.jsonl} # {"id", "prompt"|"messages"} per line
WORK=${WORK:-runs/jf-qwen7b}                    # trajectories, checkpoints, logs, stage markers

# ---------------------------------------------------------------- recipe (paper Sec. 4.1)
N1=${N1:-16}; W1=${W1:-16}; STEPS1=${STEPS1:-10000}
N2=${N2:-32}; W2=${W2:-8};  STEPS2=${STEPS2:-10000}
LR=${LR:-1e-6}
BATCH=${BATCH:-4}                               # samples per optimizer step (paper "batch size")
MAX_NEW=${MAX_NEW:-2048}                        # paper "max new sequence length"
AR_WEIGHT=${AR_WEIGHT:-1}
PC_NORMALIZATION=${PC_NORMALIZATION:-paper}

# ---------------------------------------------------------------- sizes
TP=${TP:-2}
PP=${PP:-1}
SEQ_LENGTH=${SEQ_LENGTH:-16384}                 # bound on prompt + response per stream (not a padded length)
MICRO_BATCH=${MICRO_BATCH:-1}                   # samples per microbatch per data-parallel rank
GEN_BATCH=${GEN_BATCH:-16}                      # prompts decoded together per rank during collection
WORLD=$((NNODES * GPUS_PER_NODE))
if (( WORLD % (TP * PP) )); then echo "error: $WORLD GPUs do not split into TP=$TP x PP=$PP" >&2; exit 1; fi
DP=$((WORLD / (TP * PP)))
GLOBAL_BATCH=${GLOBAL_BATCH:-$BATCH}
# megatron needs the global batch to be a multiple of DP x micro-batch: say what changes and why
STEP=$((DP * MICRO_BATCH))
if (( GLOBAL_BATCH % STEP )); then
  NEW=$(( (GLOBAL_BATCH + STEP - 1) / STEP * STEP ))
  echo "note: global batch $GLOBAL_BATCH -> $NEW: it must be a multiple of data-parallel size x micro-batch" \
       "= $DP x $MICRO_BATCH on $WORLD GPUs at TP=$TP PP=$PP (the paper's value is $BATCH; fewer GPUs, a larger" \
       "TP, or GLOBAL_BATCH=... keep another value). Steps, lr and schedule are unchanged."
  GLOBAL_BATCH=$NEW
fi
echo "batch: $GLOBAL_BATCH samples per step = $((GLOBAL_BATCH / STEP)) microbatch(es) x $MICRO_BATCH x DP $DP"

DISTRIBUTED_ARGS=(
  --nnodes "$NNODES" --nproc_per_node "$GPUS_PER_NODE"
  --rdzv_backend c10d --rdzv_endpoint "$MASTER_ADDR:$MASTER_PORT"
)
MODEL_PARALLEL_ARGS=(
  --tp "$TP" --pp "$PP"
  --use-megatron-optimizer --use-distributed-optimizer  # megatron DDP + optimizer state sharded over DP
  --overlap-grad-reduce --overlap-param-gather          # reduce-scatter / all-gather hidden behind compute
  --precision bf16
  --sequence-parallel
  --recompute-granularity full --recompute-method uniform --recompute-num-layers 1
)
DATA_ARGS=(
  --objective jf --noise-schedule progressive --consistency-positions all
  --seq-length "$SEQ_LENGTH" --num-workers 2
)
JF_ARGS=(
  --attention-path two_stream --mask nc                 # nc == two causal streams: stock causal kernels
  --consistency-loss kl --kl-temperature 1.0
  --pc-weight 1.0 --ar-weight "$AR_WEIGHT" --pc-normalization "$PC_NORMALIZATION"
  --loss-chunk-size 1024
)
OPTIMIZER_ARGS=(
  --micro-batch-size "$MICRO_BATCH" --global-batch-size "$GLOBAL_BATCH"
  --lr "$LR" --min-lr 0
  --weight-decay 0.01 --adam-beta1 0.9 --adam-beta2 0.95 --adam-eps 1e-8
  --clip-grad 1.0 --seed 1234
)

export OMP_NUM_THREADS=8 CUDA_DEVICE_MAX_CONNECTIONS=1 NCCL_ASYNC_ERROR_HANDLING=1
launch() {  # launch STAGE script args...: torchrun over every node (a fresh rendezvous id per stage)
  local stage=$1; shift
  local cmd=(torchrun "${DISTRIBUTED_ARGS[@]}" --rdzv_id "$JOB_ID-$stage" "$@")
  if [ "$DRY_RUN" = 1 ]; then printf '+'; printf ' %q' "${cmd[@]}"; printf '\n'; else "${cmd[@]}"; fi
}
stage() {  # stage NAME args...: skipped once WORK/NAME.done exists
  local name=$1; shift
  if [ -f "$WORK/$name.done" ]; then echo "[$name] done earlier, skipping"; return; fi
  echo "[$name] starting"
  launch "$name" "$@"
  if [ "$DRY_RUN" != 1 ]; then date -u +%FT%TZ > "$WORK/$name.done"; fi
}
collect() {  # collect LOAD N OUT
  echo tools/generate_trajectories.py --load "$1" --prompts "$PROMPTS" --block-size "$2" \
    --max-new-tokens "$MAX_NEW" --batch-size "$GEN_BATCH" --tp "$TP" --bf16 --no-progress --out "$3"
}
train() {  # train LOAD DATA N W STEPS SAVE
  echo pretrain_jf.py --load "$1" --data "$2" --block-size "$3" --window-size "$4" --train-steps "$5" \
    --save "$6" --save-interval 500 --keep-last 4 --log-interval 10 --log-file "$6/metrics.jsonl" \
    --tensorboard-dir "$6/tensorboard" --no-progress
}
mkdir -p "$WORK"
# shellcheck disable=SC2046  # the helpers print plain words (paths must not contain spaces)
stage traj1 $(collect "$BASE" "$N1" "$WORK/traj_n$N1")
stage jf1 $(train "$BASE" "$WORK/traj_n$N1" "$N1" "$W1" "$STEPS1" "$WORK/jf_round1") \
  "${MODEL_PARALLEL_ARGS[@]}" "${DATA_ARGS[@]}" "${JF_ARGS[@]}" "${OPTIMIZER_ARGS[@]}" ${EXTRA_ARGS[@]+"${EXTRA_ARGS[@]}"}
stage traj2 $(collect "$WORK/jf_round1" "$N2" "$WORK/traj_n$N2")
stage jf2 $(train "$WORK/jf_round1" "$WORK/traj_n$N2" "$N2" "$W2" "$STEPS2" "$WORK/jf_round2") \
  "${MODEL_PARALLEL_ARGS[@]}" "${DATA_ARGS[@]}" "${JF_ARGS[@]}" "${OPTIMIZER_ARGS[@]}" ${EXTRA_ARGS[@]+"${EXTRA_ARGS[@]}"}
echo "Jacobi Forcing finished: $WORK/jf_round2 (to HF: python tools/convert_hf.py mcore-to-hf --load $WORK/jf_round2 --out HF_DIR)"
