#!/usr/bin/env bash
# TaCL continual pre-training (Su et al. 2022), the paper's setting: one node, 8 GPUs, student and
# frozen teacher both initialised from a pre-trained BERT given by path (INIT_FROM), MLM + NSP +
# TaCL loss, batch 256 (micro-batch x accumulation x 8 ranks, from the DeepSpeed JSON), sequences
# of 256 tokens (the NSP shards' max_seq_len), 150k steps, lr 1e-4 with 10% warm-up.
#
#SBATCH --job-name=tacl-8gpu
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=8
#SBATCH --mem-per-cpu=8G
#SBATCH --time=48:00:00
#SBATCH --requeue
#SBATCH --signal=USR1@180
#SBATCH --open-mode=append
#SBATCH --output=logs/%x-%j.out
#
# Run it (from the repository root, with the project's Python environment active):
#   python preprocessing/build_shards.py --input en:wiki.txt --output data/tacl_nsp256 \
#       --tokenizer /models/bert-base-uncased --format nsp --max_seq_len 256
#   INIT_FROM=/models/bert-base-uncased DATA=data/tacl_nsp256 sbatch slurm/tacl_8gpu.sh
#   DRY_RUN=1 INIT_FROM=/models/bert-base-uncased bash slurm/tacl_8gpu.sh   # prints the resolved srun command
#
# Knobs (environment variables; default in brackets), as in taco_64gpu.sh:
#   INIT_FROM        the pre-trained Hugging Face BERT folder (config.json + weights) [required]
#   DATA             NSP shard folder(s), comma-separated [data/tacl_nsp256]
#   SAVE_DIR         [runs/tacl-8gpu]     MAX_STEPS [150000]     SAVE_EVERY, SEED [the trainer's defaults]
#   DS_CONFIG        [deepspeed_configs/zero2_tacl.json: micro-batch 32 x accumulation 1 x 8 = 256, the paper's]
#   TOKENIZER        [DATA/tokenizer]     EXPORT_DIR []     EXTRA_ARGS (e.g. --whole_word_masking) []
#   REPORT_TO        tensorboard | wandb | tensorboard,wandb [tensorboard]; WANDB_* reach every rank
#   NODES [1], GPUS_PER_NODE [8], PARTITION, ACCOUNT, TIME_LIMIT, CPU_MODE [0], DIST_TIMEOUT_S [the trainer's],
#   PYTHON [python], LOCAL_DISK [$SLURM_TMPDIR or /tmp], MAX_REQUEUES [50], DRY_RUN [0]
#   A second phase in the same job, as in taco_64gpu.sh: PHASE2_DATA [] (unset: one phase),
#   PHASE2_STEPS [required with PHASE2_DATA], PHASE2_LR [LR if set, else the trainer's],
#   PHASE2_WARMUP_STEPS [the trainer's], PHASE2_DS_CONFIG [DS_CONFIG], PHASE2_SAVE_DIR [SAVE_DIR/phase2],
#   PHASE2_EXTRA_ARGS []
#
# Pre-emption and requeue work as in taco_64gpu.sh: SIGUSR1 180 s before the limit, a checkpoint,
# exit 0, `scontrol requeue`, and the next run resumes (--resume auto).
set -euo pipefail

# sbatch runs a copy of this script from Slurm's spool folder: find the repository.
SCRIPT="${BASH_SOURCE[0]}"
if [[ -n "${TOKENCL_REPO:-}" ]]; then
    REPO="$TOKENCL_REPO"
elif [[ -f "$(dirname "$SCRIPT")/common.sh" ]]; then
    REPO="$(cd "$(dirname "$SCRIPT")/.." && pwd)"
else
    SCRIPT="$(scontrol show job "${SLURM_JOB_ID:-0}" 2>/dev/null | sed -n 's/^ *Command=\([^ ]*\).*/\1/p')"
    REPO="$(cd "$(dirname "${SCRIPT:-${SLURM_SUBMIT_DIR:-.}/slurm/x}")/.." && pwd)"
fi
[[ -f "$REPO/slurm/common.sh" ]] || { echo "[slurm] error: cannot find the repository; set TOKENCL_REPO" >&2; exit 2; }
source "$REPO/slurm/common.sh"
source "$REPO/slurm/train_job.sh"

DEFAULT_NODES=1
DEFAULT_GPUS_PER_NODE=8
DEFAULT_CPUS_PER_TASK=8
REQUIRE_INIT_FROM=1
: "${CPU_MODE:=0}" "${DRY_RUN:=0}"
: "${OBJECTIVE:=tacl}" "${INIT_FROM:=}" "${MODEL_CONFIG:=}"
: "${DATA:=data/tacl_nsp256}" "${SAVE_DIR:=runs/tacl-8gpu}"
: "${MAX_STEPS:=150000}"
: "${DS_CONFIG:=$REPO/deepspeed_configs/zero2_tacl.json}"
: "${PYTHON:=python}" "${LOCAL_DISK:=${SLURM_TMPDIR:-/tmp}}" "${MAX_REQUEUES:=50}"

train_main "$@"
