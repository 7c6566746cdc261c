#!/usr/bin/env bash
# Jacobi Forcing training of Qwen2.5-Coder-7B-Instruct on H200 nodes (8 GPUs each), multi-node.
#
# Run the same command on every node (Slurm: srun --ntasks-per-node=1 ...), e.g. 2 nodes:
#   NNODES=2 MASTER_ADDR=node0 JOB_ID=jf7b bash examples/train_jf_qwen7b_h200.sh
#
# Before the first run (once, any machine with the HF weights; the result loads at any TP/PP):
#   python tools/convert_hf.py hf-to-mcore --hf /models/Qwen2.5-Coder-7B-Instruct --out ckpt/qwen7b-mcore --tp 2
# and collect greedy Jacobi trajectory shards with block size 32 (megatron_jf.data.shards format, with manifests).
#
# Hyper-parameter sources. "ref" = the official JacobiForcing training scripts
# (scripts/train/train_jacobi_forcing_coder_n32.sh + soft_flexattn_cllm_trainer_multiblock.py, summarised in
# shared/research/jf_reference.md Sec. 6); "paper" = arXiv 2512.14681 Sec. 3.1 / Eq. 7-9. The paper body was
# not available to us, so values the paper may state differently are taken from the reference code.
#   block size n = 32, noise window w = 16, progressive schedule ....... ref data "n32w16", paper Eq. 7
#   noise-conditioned (nc) mask, KL(teacher || student), stop-grad ..... paper Sec. 3.1, Eq. 8
#   AR weight 10, consistency loss / num blocks (reference normalisation) ref L493, L542 (paper Eq. 9: L_pc + w L_AR)
#   LR 1e-5 (n=32 stage; 1e-6 for the n=64 stage), cosine, 3% warmup .. ref n32/n64 scripts
#   AdamW (0.9, 0.95), eps 1e-8, weight decay 0.01 ..................... ref (torch AdamW default decay)
#   micro-batch 1 packed sequence per GPU, 1 epoch, max length 16384 .. ref (4 GPUs x 1 => global batch 4)
#   bf16 ................................................................ ref (DeepSpeed bf16)
set -euo pipefail
cd "$(dirname "$0")/.."

# ---------------------------------------------------------------- cluster
NNODES=${NNODES:-2}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
MASTER_ADDR=${MASTER_ADDR:?set MASTER_ADDR to the first node}
MASTER_PORT=${MASTER_PORT:-29500}
JOB_ID=${JOB_ID:-jf-qwen7b}

# ---------------------------------------------------------------- paths
LOAD=${LOAD:-ckpt/qwen7b-mcore}                 # converted HF checkpoint (weights only)
SAVE=${SAVE:-ckpt/qwen7b-jf-n32w16}             # resumed automatically if it holds a checkpoint
TRAIN_DATA=${TRAIN_DATA:-data/opencodeinstruct_n32/train.manifest.json}
VALID_DATA=${VALID_DATA:-data/opencodeinstruct_n32/valid.manifest.json}

# ---------------------------------------------------------------- sizes
TP=${TP:-2}                                     # 7B in bf16 fits one H200; TP 2 leaves room for 16k x 2 streams
PP=${PP:-1}
WORLD=$((NNODES * GPUS_PER_NODE))
DP=$((WORLD / (TP * PP)))
MICRO_BATCH=1                                   # ref: 1 packed sequence per GPU
GLOBAL_BATCH=${GLOBAL_BATCH:-$DP}               # ref: 4 (4 GPUs x 1, no accumulation); here one per DP rank
# one epoch over the shards (ref), unless TRAIN_STEPS is given
if [[ -z "${TRAIN_STEPS:-}" ]]; then
  RECORDS=$(python -c "import json,sys; print(json.load(open(sys.argv[1]))['counts']['records'])" "$TRAIN_DATA")
  TRAIN_STEPS=$(( (RECORDS + GLOBAL_BATCH - 1) / GLOBAL_BATCH ))
fi

DISTRIBUTED_ARGS=(
  --nnodes "$NNODES" --nproc_per_node "$GPUS_PER_NODE"
  --rdzv_backend c10d --rdzv_endpoint "$MASTER_ADDR:$MASTER_PORT" --rdzv_id "$JOB_ID"
)
MODEL_PARALLEL_ARGS=(
  --tp "$TP" --pp "$PP"
  --use-megatron-optimizer --use-distributed-optimizer   # megatron DDP + ZeRO-1 style optimizer sharding
  --precision bf16
)
MODEL_ARGS=(
  --load "$LOAD"
)
DATA_ARGS=(
  --objective jf
  --data "$TRAIN_DATA" --valid-data "$VALID_DATA"
  --block-size 32 --window-size 16 --noise-schedule progressive
  --consistency-positions all
  --seq-length 16384
  --num-workers 2
)
JF_ARGS=(
  --attention-path two_stream --mask nc                  # nc == two causal streams: stock causal kernels
  --consistency-loss kl --kl-temperature 1.0
  --pc-weight 1.0 --ar-weight 10 --pc-normalization reference
)
OPTIMIZER_ARGS=(
  --micro-batch-size "$MICRO_BATCH" --global-batch-size "$GLOBAL_BATCH"
  --train-steps "$TRAIN_STEPS"
  --lr 1e-5 --min-lr 0 --warmup-steps $(( (TRAIN_STEPS * 3 + 99) / 100 ))
  --weight-decay 0.01 --adam-beta1 0.9 --adam-beta2 0.95 --adam-eps 1e-8
  --clip-grad 1.0
  --seed 1234
)
CHECKPOINT_ARGS=(
  --save "$SAVE" --save-interval 5000 --keep-last 8      # ref: save every 5000 steps, keep 8
)
LOGGING_ARGS=(
  --log-interval 10 --eval-interval 1000 --eval-iters 50
  --log-file "$SAVE/metrics.jsonl"
  --tensorboard-dir "$SAVE/tensorboard"
)

export OMP_NUM_THREADS=8 CUDA_DEVICE_MAX_CONNECTIONS=1 NCCL_ASYNC_ERROR_HANDLING=1
exec torchrun "${DISTRIBUTED_ARGS[@]}" pretrain_jf.py \
  "${MODEL_PARALLEL_ARGS[@]}" "${MODEL_ARGS[@]}" "${DATA_ARGS[@]}" "${JF_ARGS[@]}" \
  "${OPTIMIZER_ARGS[@]}" "${CHECKPOINT_ARGS[@]}" "${LOGGING_ARGS[@]}"
