#!/usr/bin/env bash
# TACO pre-training (MLM + token-alignment contrastive loss, Fu et al. 2022) on 8 nodes x 8 GPUs:
# one task per GPU, 64 DeepSpeed ZeRO-2 ranks, resumable and requeued on pre-emption.
#
#SBATCH --job-name=taco-64gpu
#SBATCH --nodes=8
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=8
#SBATCH --mem-per-cpu=8G
#SBATCH --time=24:00:00
#SBATCH --requeue
#SBATCH --signal=USR1@180
#SBATCH --open-mode=append
#SBATCH --output=logs/%x-%j.out
#
# Run it (from the repository root, with the project's Python environment active):
#   sbatch slurm/taco_64gpu.sh                                   # as sized above (mkdir -p logs first)
#   NODES=2 GPUS_PER_NODE=8 bash slurm/taco_64gpu.sh [sbatch options]   # submits itself, resized
#   DRY_RUN=1 bash slurm/taco_64gpu.sh                           # prints the resolved srun command
# sbatch's own options and variables (--partition, SBATCH_ACCOUNT, --time...) override the headers.
#
# Knobs (environment variables; default in brackets):
#   NODES            nodes, when this script submits itself [8]; inside a job: the allocation's
#   GPUS_PER_NODE    ranks per node, one per GPU (CPU processes with CPU_MODE=1) [8]
#   PARTITION, ACCOUNT, TIME_LIMIT   sbatch --partition/--account/--time when it submits itself []
#   CPU_MODE         1: no GPUs, DeepSpeed on CPU with gloo (tests, laptops) [0]
#   DATA             shard folder(s) or remote URL(s), comma-separated [data/shards]
#   DATA_WEIGHTS     mixing weights, one per DATA entry, comma-separated []
#   SAVE_DIR         run folder on shared storage (checkpoints, metrics) [runs/taco-64gpu]
#   MAX_STEPS        optimizer steps [62500: the paper's 500k steps at 2,048 sequences, in sequences seen]
#   LR, WARMUP_STEPS peak learning rate and linear warm-up for this global batch [1e-3, 6% of MAX_STEPS]
#   DS_CONFIG        DeepSpeed JSON: micro-batch, accumulation, precision, ZeRO
#                    [deepspeed_configs/zero2_64gpu.json: 128 x 2 x 64 = 16,384 sequences per step,
#                    AdamW betas (0.9, 0.98); zero2_64gpu_fp32comm.json reduces gradients in fp32]
#   The sizing (what ZeRO-2 sends, where 64 GPUs pay off, bucket sizes, AdamW): docs/scaling.md
#   MODEL_CONFIG     tiny | base | large | path/to/bert_config.json [base]
#   INIT_FROM        continue from a pre-trained Hugging Face BERT folder instead []
#   TOKENIZER        tokenizer folder [DATA/tokenizer]
#   SAVE_EVERY       checkpoint every N steps [the trainer's default]
#   SEED             [the trainer's default]
#   DIST_TIMEOUT_S   a collective waits at most this long for a dead or hung rank [the trainer's default]
#   EXPORT_DIR       write the final student as a Hugging Face folder []
#   REPORT_TO        the trainer's --report_to: tensorboard, wandb, both comma-separated [tensorboard];
#                    WANDB_* variables (WANDB_PROJECT, WANDB_MODE=offline, ...) reach every rank, and a
#                    requeued job continues the same W&B run
#   EXTRA_ARGS       more pipeline/train.py flags, split on spaces (both phases) []
#   A second phase (BERT's recipe: 90% of the steps at 128 tokens, the rest at 512), in the same job:
#   PHASE2_DATA      phase 2's shard folder(s), e.g. built with --max_seq_len 512; unset: one phase []
#   PHASE2_STEPS     phase 2's optimizer steps [required with PHASE2_DATA]
#   PHASE2_LR, PHASE2_WARMUP_STEPS   phase 2's peak learning rate and warm-up [LR, 6% of PHASE2_STEPS]
#   PHASE2_DS_CONFIG phase 2's DeepSpeed JSON (longer sequences may want a smaller micro-batch) [DS_CONFIG]
#   PHASE2_SAVE_DIR  phase 2's run folder [SAVE_DIR/phase2]
#   PHASE2_EXTRA_ARGS more pipeline/train.py flags for phase 2 only []
#   (TOKENIZER, SAVE_EVERY, SEED, DIST_TIMEOUT_S, REPORT_TO apply to both phases; EXPORT_DIR to the last)
#   PYTHON           the interpreter the ranks run [python]
#   LOCAL_DISK       node-local scratch root; the job uses LOCAL_DISK/tokencl-JOBID as TMPDIR [$SLURM_TMPDIR or /tmp]
#   MAX_REQUEUES     stop requeueing after this many restarts [50]
#   DRY_RUN          1: print what would run, start nothing [0]
#
# Pre-emption: 180 s before the time limit Slurm sends SIGUSR1 to every rank (SIGTERM on a
# pre-empting `scontrol requeue`). The trainer saves a checkpoint at the next step boundary and
# exits 0; this script then finds the last checkpoint short of MAX_STEPS and requeues the job,
# which resumes from it (--resume auto). A failed step (a rank died) is not requeued: submit the
# script again and it resumes from the last complete checkpoint.
#
# Two phases (PHASE2_DATA set): phase 1 trains into SAVE_DIR; once its checkpoint is at MAX_STEPS,
# the same job trains phase 2 into PHASE2_SAVE_DIR, starting from that checkpoint's weights and
# optimizer state (pipeline/train.py --continue_from SAVE_DIR) with phase 2's data, schedule and
# steps. A pre-emption in either phase requeues the job; the requeued job skips a finished phase 1
# and resumes phase 2 (or resumes phase 1). The log's "[slurm] phase N: ..." lines say which ran.
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

DEFAULT_NODES=8
DEFAULT_GPUS_PER_NODE=8
DEFAULT_CPUS_PER_TASK=8
: "${CPU_MODE:=0}" "${DRY_RUN:=0}"
: "${OBJECTIVE:=taco}"
: "${DATA:=data/shards}" "${SAVE_DIR:=runs/taco-64gpu}"
: "${MAX_STEPS:=62500}" "${LR:=1e-3}"
[[ "$MAX_STEPS" =~ ^[0-9]+$ ]] && : "${WARMUP_STEPS:=$(( MAX_STEPS * 6 / 100 ))}"
if [[ -n "${PHASE2_DATA:-}" && "${PHASE2_STEPS:-}" =~ ^[0-9]+$ ]]; then
    : "${PHASE2_WARMUP_STEPS:=$(( PHASE2_STEPS * 6 / 100 ))}"
fi
: "${DS_CONFIG:=$REPO/deepspeed_configs/zero2_64gpu.json}" "${MODEL_CONFIG:=base}"
: "${PYTHON:=python}" "${LOCAL_DISK:=${SLURM_TMPDIR:-/tmp}}" "${MAX_REQUEUES:=50}"

train_main "$@"
