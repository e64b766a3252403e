#!/usr/bin/env bash
# Run by `srun` once per task: maps Slurm's per-task variables to the torch.distributed ones and
# execs the command given as arguments (so the trainer is the task's process and gets its signals).
#
#   RANK = SLURM_PROCID, LOCAL_RANK = SLURM_LOCALID, WORLD_SIZE = tasks in the step,
#   LOCAL_WORLD_SIZE = tasks per node; MASTER_ADDR / MASTER_PORT come from the batch script.
#   TMPDIR = JOB_SCRATCH when it is set: a node-local folder unique to the job, shared by the
#   ranks of a node as streaming expects (its cache of remote shards and lock files go there).
set -euo pipefail

: "${SLURM_PROCID:?task_env.sh runs under srun}"
: "${MASTER_ADDR:?the batch script exports MASTER_ADDR}" "${MASTER_PORT:?the batch script exports MASTER_PORT}"

tasks_per_node="${SLURM_NTASKS_PER_NODE:-${SLURM_STEP_TASKS_PER_NODE:-1}}"
export RANK="$SLURM_PROCID"
export LOCAL_RANK="${SLURM_LOCALID:-0}"
export WORLD_SIZE="${SLURM_STEP_NUM_TASKS:-${SLURM_NTASKS:-1}}"
export LOCAL_WORLD_SIZE="${tasks_per_node%%[(,]*}"
node="${SLURMD_NODENAME:-$(hostname -s)}"

if [[ -n "${JOB_SCRATCH:-}" ]]; then
    export TMPDIR="$JOB_SCRATCH"
    mkdir -p "$TMPDIR"
fi

echo "[slurm] node $node task $RANK: RANK=$RANK LOCAL_RANK=$LOCAL_RANK WORLD_SIZE=$WORLD_SIZE" \
     "LOCAL_WORLD_SIZE=$LOCAL_WORLD_SIZE MASTER_ADDR=$MASTER_ADDR MASTER_PORT=$MASTER_PORT" \
     "TMPDIR=${TMPDIR:-/tmp}"
exec "$@"
