# Sourced by taco_64gpu.sh and tacl_8gpu.sh once they have set their defaults: one training job
# under Slurm, in three modes.
#
#   inside an allocation (sbatch, or bash inside salloc): map Slurm to torch.distributed, run
#       pipeline/train.py under `srun --kill-on-bad-exit=1` with `--resume auto`, and requeue the
#       job when the trainer stopped early after a pre-emption signal;
#   outside one, DRY_RUN=0: submit this script with sbatch, sized by NODES and GPUS_PER_NODE;
#   DRY_RUN=1 (inside or outside): print the resolved srun command and the per-task mapping,
#       start nothing.
#
# Two phases (PHASE2_DATA set; BERT's recipe: most steps at 128 tokens, the rest at 512): once
# phase 1's run (SAVE_DIR) has its checkpoint at MAX_STEPS, the same job trains phase 2 into a run
# folder of its own (PHASE2_SAVE_DIR) with `--continue_from SAVE_DIR` (phase 1's weights and
# optimizer state, phase 2's data, schedule and steps). Each job of the chain (first run or requeue)
# trains phase 1 unless it is finished or phase 2 has started, then phase 2 (`--resume auto` in
# both), so a pre-emption in either phase requeues the job and the next run goes on where it stopped.
#
# Needs from the caller: SCRIPT (its own path), DEFAULT_NODES, DEFAULT_GPUS_PER_NODE, and the
# knob defaults (see the top of taco_64gpu.sh). Needs common.sh sourced.

# srun's binding of each rank; none in CPU mode. Sets CPU_BIND, GPU_BIND and BIND (both).
#   CPU: each task on cores of its own (its loader workers inherit them).
#   GPU: no --gpu-bind. Every task then sees all the job's GPUs on its node (CUDA_VISIBLE_DEVICES
#   lists them), and before NCCL starts the ranks pick one each (pipeline.distributed.
#   gpu_for_this_rank: the GPU at its position among the local ranks that see the same GPUs, i.e.
#   GPU = LOCAL_RANK here) and refuse to start if two ranks drive one physical GPU (same UUID).
#   Slurm's per-task GPU binding is not robust (measured on Slurm 22.05, tests/integration/
#   test_slurm_gpus.py; slurm/README.md, "GPU binding"): --gpu-bind=closest gives a task every GPU
#   of its socket while the default task layout alternates sockets, so local ranks 0, 2, 4, 6 of a
#   2-socket node share GPUs 0-3; --gpu-bind=single:1 gave ranks 0 and 4 the same GPU;
#   --gpu-bind=none set no CUDA_VISIBLE_DEVICES at all (a task sees every GPU of the machine where
#   cgroups do not hide the others); --gpus-per-task=1 gives distinct GPUs, but where cgroups
#   constrain devices a task can then open only its own, which breaks the CUDA IPC that NCCL uses
#   between the GPUs of a node.
set_binding() {
    CPU_BIND=() GPU_BIND=() BIND=()
    truthy "$CPU_MODE" && return 0
    CPU_BIND=(--cpu-bind=cores)
    BIND=("${CPU_BIND[@]}" "${GPU_BIND[@]}")
}

# What the binding gives each task, for the dry run and the job log.
describe_binding() {  # TASKS_PER_NODE
    if truthy "$CPU_MODE"; then
        say "CPU mode: DS_ACCELERATOR=cpu, CUDA_VISIBLE_DEVICES='' (gloo)"
        return 0
    fi
    say "GPU binding: none (no srun --gpu-bind): every task sees the $1 GPU(s) of its node, LOCAL_RANK r" \
        "drives GPU r (pipeline.distributed.gpu_for_this_rank), and the ranks refuse to start if two" \
        "drive one GPU (same UUID)"
}

# The rendezvous port of a job: pipeline.distributed owns the formula (a bare `srun python
# pipeline/train.py` derives the same one).
job_master_port() {  # JOB_ID
    PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" "$PYTHON" -c \
        'import sys; from pipeline.distributed import master_port_for_job; print(master_port_for_job(sys.argv[1]))' "$1"
}


# ---------------------------------------------------------------------------------------------------
# The trainer's command, per phase
# ---------------------------------------------------------------------------------------------------

two_phases() { [[ -n "${PHASE2_DATA:-}" ]]; }

# "phase N: " in the messages of a two-phase job; nothing in a one-phase one.
phase_label() {  # PHASE
    if two_phases; then printf 'phase %s: ' "$1"; fi
}

# The phase-2 knobs that follow phase 1's when unset. The trainer's own defaults are not here: a
# knob the user did not set is not passed (pipeline/training/config.py owns them).
phase2_defaults() {
    two_phases || return 0
    : "${PHASE2_SAVE_DIR:=${SAVE_DIR%/}/phase2}" "${PHASE2_DS_CONFIG:=$DS_CONFIG}"
    if [[ -n "${LR:-}" ]]; then : "${PHASE2_LR:=$LR}"; fi
}

# What the trainer makes of TRAIN_CMD: every knob with its resolved value (its defaults included).
print_resolved_config() {  # PHASE
    local resolved
    if ! resolved=$("${TRAIN_CMD[@]}" --print_config 2>&1); then
        printf '%s\n' "$resolved" >&2
        die "$(phase_label "$1")the trainer refuses these settings (above)"
    fi
    say "$(phase_label "$1")resolved configuration (pipeline/train.py --print_config):"
    printf '%s\n' "$resolved"
}

# The trainer's arguments for phase 1 (the run of SAVE_DIR) or phase 2 (PHASE2_SAVE_DIR, continuing
# SAVE_DIR's latest checkpoint). Sets TRAIN_CMD.
build_train_cmd() {  # PHASE
    local d data ds steps save lr warmup export="" extra
    if [[ "$1" == 2 ]]; then
        data="$PHASE2_DATA" ds="$PHASE2_DS_CONFIG" steps="$PHASE2_STEPS" save="$PHASE2_SAVE_DIR"
        lr="${PHASE2_LR:-}" warmup="${PHASE2_WARMUP_STEPS:-}" export="${EXPORT_DIR:-}"
    else
        data="$DATA" ds="$DS_CONFIG" steps="$MAX_STEPS" save="$SAVE_DIR" lr="${LR:-}" warmup="${WARMUP_STEPS:-}"
        two_phases || export="${EXPORT_DIR:-}"  # the final model is the last phase's
    fi
    TRAIN_CMD=("$PYTHON" "$REPO/pipeline/train.py" --ds_config "$ds" --objective "$OBJECTIVE")
    IFS=',' read -ra _data <<<"$data"
    for d in "${_data[@]}"; do TRAIN_CMD+=(--data "$d"); done
    if [[ "$1" == 2 ]]; then
        TRAIN_CMD+=(--continue_from "$SAVE_DIR")
    else
        [[ -n "${DATA_WEIGHTS:-}" ]] && TRAIN_CMD+=(--data_weights "$DATA_WEIGHTS")
        if [[ -n "${INIT_FROM:-}" ]]; then
            TRAIN_CMD+=(--init_from "$INIT_FROM")
        else
            TRAIN_CMD+=(--model_config "$MODEL_CONFIG")
        fi
    fi
    [[ -n "${TOKENIZER:-}" ]] && TRAIN_CMD+=(--tokenizer "$TOKENIZER")
    TRAIN_CMD+=(--max_steps "$steps" --save_dir "$save" --resume auto)
    # Knobs the trainer has defaults for travel only when the user set them: the defaults live in
    # pipeline/training/config.py alone (a dry run prints the resolved values).
    [[ -n "${SAVE_EVERY:-}" ]] && TRAIN_CMD+=(--save_every "$SAVE_EVERY")
    [[ -n "${SEED:-}" ]] && TRAIN_CMD+=(--seed "$SEED")
    [[ -n "${DIST_TIMEOUT_S:-}" ]] && TRAIN_CMD+=(--dist_timeout_s "$DIST_TIMEOUT_S")
    [[ -n "$lr" ]] && TRAIN_CMD+=(--lr "$lr")
    [[ -n "$warmup" ]] && TRAIN_CMD+=(--warmup_steps "$warmup")
    [[ -n "$export" ]] && TRAIN_CMD+=(--export_dir "$export")
    [[ -n "${REPORT_TO:-}" ]] && TRAIN_CMD+=(--report_to "$REPORT_TO")
    # EXTRA_ARGS (both phases) and PHASE2_EXTRA_ARGS (phase 2) are split on white space: flags
    # without spaces in their values.
    read -ra extra <<<"${EXTRA_ARGS:-}"
    TRAIN_CMD+=("${extra[@]}")
    if [[ "$1" == 2 ]]; then
        read -ra extra <<<"${PHASE2_EXTRA_ARGS:-}"
        TRAIN_CMD+=("${extra[@]}")
    fi
}

# ---------------------------------------------------------------------------------------------------
# Checks on the login node
# ---------------------------------------------------------------------------------------------------

require_number() {  # NAME VALUE
    [[ "$2" =~ ^[0-9]*[.]?[0-9]+([eE][-+]?[0-9]+)?$ ]] || die "$1=$2 is not a number"
}

check_knobs() {
    require_int MAX_STEPS "$MAX_STEPS" 1
    [[ -z "${SAVE_EVERY:-}" ]] || require_int SAVE_EVERY "$SAVE_EVERY" 1
    [[ -z "${SEED:-}" ]] || require_int SEED "$SEED" 0
    [[ -z "${WARMUP_STEPS:-}" ]] || require_int WARMUP_STEPS "$WARMUP_STEPS" 0
    [[ -z "${LR:-}" ]] || require_number LR "$LR"
    require_int MAX_REQUEUES "$MAX_REQUEUES" 0
    [[ -z "${DIST_TIMEOUT_S:-}" || "$DIST_TIMEOUT_S" =~ ^[0-9]+([.][0-9]+)?$ ]] ||
        die "DIST_TIMEOUT_S=$DIST_TIMEOUT_S is not a number of seconds"
    [[ -n "$DATA" ]] || die "DATA is empty: set DATA to a shard folder (or several, comma-separated)"
    [[ -n "$SAVE_DIR" ]] || die "SAVE_DIR is empty: set it to a folder on shared storage"
    if [[ -n "${REQUIRE_INIT_FROM:-}" && -z "${INIT_FROM:-}" ]]; then
        die "INIT_FROM is not set: give the pre-trained BERT folder (config.json + weights) to continue from"
    fi
    [[ -n "${INIT_FROM:-}" || -n "$MODEL_CONFIG" ]] || die "set MODEL_CONFIG (tiny|base|large|cfg.json) or INIT_FROM"
    check_phase2_knobs
}

PHASE2_KNOBS=(PHASE2_STEPS PHASE2_LR PHASE2_WARMUP_STEPS PHASE2_DS_CONFIG PHASE2_SAVE_DIR PHASE2_EXTRA_ARGS)

check_phase2_knobs() {
    local name
    if ! two_phases; then  # a phase-2 knob without PHASE2_DATA would silently train one phase
        for name in "${PHASE2_KNOBS[@]}"; do
            [[ -z "${!name:-}" ]] || die "$name is set but PHASE2_DATA is not: set PHASE2_DATA to phase 2's" \
                "shard folder(s) (comma-separated), or unset $name"
        done
        return 0
    fi
    [[ -n "${PHASE2_STEPS:-}" ]] || die "PHASE2_DATA is set but PHASE2_STEPS is not: give phase 2's optimizer" \
        "steps (BERT's recipe trains 90% of the steps in phase 1: PHASE2_STEPS = MAX_STEPS / 9)"
    require_int PHASE2_STEPS "$PHASE2_STEPS" 1
    if [[ -n "${PHASE2_WARMUP_STEPS:-}" ]]; then
        require_int PHASE2_WARMUP_STEPS "$PHASE2_WARMUP_STEPS" 0
        (( PHASE2_WARMUP_STEPS < PHASE2_STEPS )) ||
            die "PHASE2_WARMUP_STEPS=$PHASE2_WARMUP_STEPS must be < PHASE2_STEPS=$PHASE2_STEPS"
    fi
    [[ -z "${PHASE2_LR:-}" ]] || require_number PHASE2_LR "$PHASE2_LR"
    [[ -n "$PHASE2_SAVE_DIR" ]] || die "PHASE2_SAVE_DIR is empty: set it to phase 2's run folder on shared storage"
    [[ "$(realpath -m "$PHASE2_SAVE_DIR")" != "$(realpath -m "$SAVE_DIR")" ]] ||
        die "PHASE2_SAVE_DIR=$PHASE2_SAVE_DIR is phase 1's SAVE_DIR: phase 2 needs a run folder of its own"
}

# Local inputs that do not exist fail here, on the login node, rather than after the queue wait.
check_paths_exist() {
    check_data_folders DATA "$DATA"
    [[ -f "$DS_CONFIG" ]] || die "DS_CONFIG: no such file: $DS_CONFIG"
    [[ -z "${INIT_FROM:-}" || -d "$INIT_FROM" ]] || die "INIT_FROM: no such folder: $INIT_FROM"
    two_phases || return 0
    check_data_folders PHASE2_DATA "$PHASE2_DATA"
    [[ -f "$PHASE2_DS_CONFIG" ]] || die "PHASE2_DS_CONFIG: no such file: $PHASE2_DS_CONFIG"
}

check_data_folders() {  # NAME COMMA_SEPARATED_FOLDERS
    local d
    IFS=',' read -ra _data <<<"$2"
    for d in "${_data[@]}"; do
        [[ "$d" == *://* || -d "$d" ]] || die "$1: no such folder: $d (build shards with preprocessing/build_shards.py)"
    done
}

# ---------------------------------------------------------------------------------------------------
# What the job log says
# ---------------------------------------------------------------------------------------------------

# The W&B settings the ranks get: every WANDB_* variable of this shell reaches the tasks (srun
# --export=ALL, whatever SLURM_EXPORT_ENV a site or `sbatch --export` set), and a requeued job keeps
# the environment it was submitted with. Values are printed except the API key's.
describe_wandb() {
    local names=() name
    mapfile -t names < <(compgen -e | grep '^WANDB_' | sort)
    (( ${#names[@]} )) || { [[ "${REPORT_TO:-}" == *wandb* ]] && say "W&B: no WANDB_* variables set" \
        "(the ranks use \`wandb login\`'s credentials; WANDB_MODE=offline where nodes have no internet)"; return 0; }
    local shown=()
    for name in "${names[@]}"; do
        if [[ "$name" == *KEY* || "$name" == *TOKEN* ]]; then shown+=("$name=(set)"); else shown+=("$name=${!name}"); fi
    done
    say "W&B: ${shown[*]} (passed to every task)"
}

# "global batch 256 = micro 32 x accumulation 1 x 8 ranks", read from the DeepSpeed JSON (its owner).

# "global batch 256 = micro 32 x accumulation 1 x 8 ranks", read from the DeepSpeed JSON (its owner).
describe_batch() {  # DS_CONFIG WORLD_SIZE
    "$PYTHON" - "$1" "$2" <<'PYEOF' 2>/dev/null || echo "global batch: cannot read $1"
import json, sys
ds = json.load(open(sys.argv[1]))
micro, accum, world = ds["train_micro_batch_size_per_gpu"], ds.get("gradient_accumulation_steps", 1), int(sys.argv[2])
print(f"global batch {micro * accum * world} = micro {micro} x accumulation {accum} x {world} ranks ({sys.argv[1]})")
PYEOF
}

# The second phase in one line, and its global batch when its DeepSpeed JSON is another one.
describe_phase2() {  # WORLD_SIZE
    say "phase 2, once phase 1's checkpoint is at step $MAX_STEPS: $PHASE2_STEPS steps of $PHASE2_DATA" \
        "into $PHASE2_SAVE_DIR, continuing $SAVE_DIR's latest checkpoint (--continue_from)"
    [[ "$PHASE2_DS_CONFIG" == "$DS_CONFIG" ]] || say "phase 2: $(describe_batch "$PHASE2_DS_CONFIG" "$1")"
}

# The environment of a run: CPU mode for tests and laptops, one thread pool per task.
export_run_env() {  # CPUS_PER_TASK
    if truthy "$CPU_MODE"; then
        # DeepSpeed's CPU accelerator; hiding the GPUs makes the trainer pick gloo over nccl.
        export DS_ACCELERATOR=cpu CUDA_VISIBLE_DEVICES=""
    else
        # NCCL: fail a broken collective instead of hanging on it, ride out fabric hiccups, say only
        # what is wrong (docs/scaling.md). The site's own settings (NCCL_SOCKET_IFNAME, ...) win.
        export TORCH_NCCL_ASYNC_ERROR_HANDLING="${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}"
        export NCCL_IB_TIMEOUT="${NCCL_IB_TIMEOUT:-22}" NCCL_DEBUG="${NCCL_DEBUG:-WARN}"
    fi
    export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$1}"
    # The srun steps must not inherit a launcher's per-process variables from the submitting shell.
    unset RANK LOCAL_RANK WORLD_SIZE LOCAL_WORLD_SIZE
}


# ---------------------------------------------------------------------------------------------------
# The three modes
# ---------------------------------------------------------------------------------------------------

submit_self() {
    local args=(--nodes="$NODES" --ntasks-per-node="$GPUS_PER_NODE")
    if truthy "$CPU_MODE"; then args+=(--gpus-per-node=0); else args+=(--gpus-per-node="$GPUS_PER_NODE"); fi
    [[ -n "${PARTITION:-}" ]] && args+=(--partition="$PARTITION")
    [[ -n "${ACCOUNT:-}" ]] && args+=(--account="$ACCOUNT")
    [[ -n "${TIME_LIMIT:-}" ]] && args+=(--time="$TIME_LIMIT")
    check_paths_exist
    mkdir -p logs  # the header's --output=logs/%x-%j.out; Slurm does not create folders
    say "submitting: $NODES node(s) x $GPUS_PER_NODE rank(s)"
    print_cmd sbatch "${args[@]}" "$@" "$SCRIPT"
    exec sbatch "${args[@]}" "$@" "$SCRIPT"
}

# The srun that runs one phase's trainer on every task of the allocation (the trainer's arguments
# follow it). Sets SRUN.
build_srun() {  # NODES WORLD_SIZE TASKS_PER_NODE CPUS_PER_TASK
    SRUN=(srun --kill-on-bad-exit=1 --nodes="$1" --ntasks="$2" --ntasks-per-node="$3" --cpus-per-task="$4"
          --export=ALL "${BIND[@]}" bash "$REPO/slurm/task_env.sh")
}

dry_run() {  # NODELIST TASKS_PER_NODE CPUS_PER_TASK JOB_ID
    local nodelist="$1" tpn="$2" cpt="$3" job="$4" nodes n i=0 phase
    mapfile -t nodes < <(expand_hostlist "$nodelist")
    local world=$(( ${#nodes[@]} * tpn ))
    local master_addr master_port
    master_addr=$(node_addr "${nodes[0]}")
    master_port=$(job_master_port "$job")
    say "dry run: nothing is started"
    say "allocation: ${#nodes[@]} node(s) ($nodelist) x $tpn task(s), $cpt CPU(s) per task; job id $job"
    say "$(describe_batch "$DS_CONFIG" "$world")"
    say "MASTER_ADDR=$master_addr MASTER_PORT=$master_port WORLD_SIZE=$world LOCAL_WORLD_SIZE=$tpn" \
        "TMPDIR=$LOCAL_DISK/tokencl-$job (on each node)"
    set_binding
    describe_binding "$tpn"
    describe_wandb
    build_srun "${#nodes[@]}" "$world" "$tpn" "$cpt"
    for phase in 1 2; do
        (( phase == 1 )) || two_phases || break
        if two_phases && (( phase == 1 )); then say "phase 1: $MAX_STEPS steps of $DATA into $SAVE_DIR"; fi
        (( phase == 1 )) || describe_phase2 "$world"
        build_train_cmd "$phase"
        print_cmd "${SRUN[@]}" "${TRAIN_CMD[@]}"
        print_resolved_config "$phase"
    done
    local gpus=""
    truthy "$CPU_MODE" || gpus=" -> GPU 0..$((tpn - 1))"
    for n in "${nodes[@]}"; do
        say "node $n: RANK $((i * tpn))..$((i * tpn + tpn - 1)), LOCAL_RANK 0..$((tpn - 1))$gpus"
        i=$((i + 1))
    done
}

# One phase's training step (TRAIN_CMD), then the decision: returns when the phase reached its last
# step; exits the script when the step failed, and requeues the job when it was pre-empted (or a
# pre-emption signal came before the step started).
run_phase() {  # PHASE SAVE_DIR MAX_STEPS
    local label at
    label=$(phase_label "$1")
    if [[ -n "$SIGNALLED" ]]; then
        say "${label}not started: the job got SIG$SIGNALLED"
        requeue_job "$MAX_REQUEUES" "${label:+${label%: }}${label:-training} starts in the requeued job"
    fi
    print_cmd "${SRUN[@]}" "${TRAIN_CMD[@]}"
    run_step_forwarding_signals "${SRUN[@]}" "${TRAIN_CMD[@]}"
    if (( STEP_RC != 0 )); then
        # A dead or hung rank ends here: srun --kill-on-bad-exit stops the others, and a rank
        # stuck in a collective fails after --dist_timeout_s. Not requeued: a crash would repeat.
        at=$(latest_checkpoint_step "$2")
        say "${label}the training step failed with exit code $STEP_RC; submit the same script again to resume" \
            "$( (( at >= 0 )) && echo "from checkpoint step $at${label:+ of $2}" ||
                echo "(no checkpoint yet${label:+ in $2}: it starts over)")"
        exit "$STEP_RC"
    fi
    finish_or_requeue "$2" "$3" "$MAX_REQUEUES" "${label%: }"
}

# Slurm sends its pre-emption warning once: a phase 2 started after it (phase 1 ended in the last
# minutes of the job) would be killed at the time limit, unsaved and not requeued. With less than
# this left, the job is requeued instead, and phase 2 starts in the requeued one. (The headers'
# --signal=USR1@180 comes up to a minute early; DeepSpeed's start takes the rest.)
PHASE2_MIN_SECONDS_LEFT=300

# Phase 1 unless it is finished or phase 2 has started, then phase 2.
run_two_phases() {
    local at1 at2 left
    at1=$(latest_checkpoint_step "$SAVE_DIR")
    at2=$(latest_checkpoint_step "$PHASE2_SAVE_DIR")
    if (( at2 >= 0 )); then
        say "phase 1: not trained again: phase 2 has started (checkpoint step $at2 in $PHASE2_SAVE_DIR;" \
            "phase 1's latest is step $at1 of $MAX_STEPS in $SAVE_DIR)"
    elif (( at1 >= MAX_STEPS )); then
        say "phase 1: finished (checkpoint at step $at1 of $MAX_STEPS in $SAVE_DIR): on to phase 2"
    else
        # Phase 2's settings, checked by the trainer when the job starts rather than after phase 1's
        # hours (a requeued job runs with the same settings).
        if (( ${SLURM_RESTART_COUNT:-0} == 0 )); then
            build_train_cmd 2
            print_resolved_config 2 >/dev/null
        fi
        build_train_cmd 1
        run_phase 1 "$SAVE_DIR" "$MAX_STEPS"
        left=$(job_seconds_left)
        if (( left >= 0 && left < PHASE2_MIN_SECONDS_LEFT )); then
            say "phase 2: not started in this job: $left s left before its time limit"
            requeue_job "$MAX_REQUEUES" "phase 2 starts in the requeued job"
        fi
    fi
    build_train_cmd 2
    run_phase 2 "$PHASE2_SAVE_DIR" "$PHASE2_STEPS"
}

run_in_allocation() {
    local nnodes="${SLURM_JOB_NUM_NODES:-${SLURM_NNODES:-1}}" tpn cpt
    tpn=$(alloc_tasks_per_node)
    cpt="${SLURM_CPUS_PER_TASK:-1}"
    # NODES / GPUS_PER_NODE size a submission; inside a job the allocation is what counts.
    [[ -z "${NODES_SET:-}" || "$NODES" == "$nnodes" ]] ||
        die "NODES=$NODES but this allocation has $nnodes node(s): size the job with sbatch --nodes (or bash $SCRIPT)"
    [[ -z "${GPUS_PER_NODE_SET:-}" || "$GPUS_PER_NODE" == "$tpn" ]] ||
        die "GPUS_PER_NODE=$GPUS_PER_NODE but this allocation runs $tpn task(s) per node: use sbatch --ntasks-per-node"
    if ! truthy "$CPU_MODE" && [[ -n "${SLURM_GPUS_ON_NODE:-}" && "$SLURM_GPUS_ON_NODE" != "$tpn" ]]; then
        die "one task per GPU: this allocation has $SLURM_GPUS_ON_NODE GPU(s) and $tpn task(s) per node" \
            "(set --ntasks-per-node equal to --gpus-per-node, or CPU_MODE=1)"
    fi
    if truthy "$DRY_RUN"; then
        dry_run "$SLURM_JOB_NODELIST" "$tpn" "$cpt" "$SLURM_JOB_ID"
        return 0
    fi

    SIGNALLED=""
    remember_signals
    local nodes world
    mapfile -t nodes < <(expand_hostlist "$SLURM_JOB_NODELIST")
    world=$(( nnodes * tpn ))
    export_run_env "$cpt"
    MASTER_ADDR=$(node_addr "${nodes[0]}")
    MASTER_PORT=$(job_master_port "$SLURM_JOB_ID")
    export MASTER_ADDR MASTER_PORT
    export JOB_SCRATCH="$LOCAL_DISK/tokencl-$SLURM_JOB_ID"

    say "job $SLURM_JOB_ID (restart ${SLURM_RESTART_COUNT:-0}): $nnodes node(s) ($SLURM_JOB_NODELIST) x $tpn" \
        "task(s), world size $world, objective $OBJECTIVE, $(phase_label 1)max_steps $MAX_STEPS, save_dir $SAVE_DIR"
    say "$(describe_batch "$DS_CONFIG" "$world")"
    ! two_phases || describe_phase2 "$world"
    say "MASTER_ADDR=$MASTER_ADDR MASTER_PORT=$MASTER_PORT TMPDIR=$JOB_SCRATCH (on each node)"
    set_binding
    describe_binding "$tpn"
    describe_wandb
    build_srun "$nnodes" "$world" "$tpn" "$cpt"
    if two_phases; then
        run_two_phases
    else
        build_train_cmd 1
        run_phase 1 "$SAVE_DIR" "$MAX_STEPS"
    fi
    # Done: the node-local scratch of this job is no longer needed on any node.
    srun --overlap --nodes="$nnodes" --ntasks="$nnodes" --ntasks-per-node=1 rm -rf "$JOB_SCRATCH" || true
}

train_main() {
    [[ -n "${NODES:-}" ]] && NODES_SET=1
    [[ -n "${GPUS_PER_NODE:-}" ]] && GPUS_PER_NODE_SET=1
    NODES="${NODES:-$DEFAULT_NODES}"
    GPUS_PER_NODE="${GPUS_PER_NODE:-$DEFAULT_GPUS_PER_NODE}"
    require_int NODES "$NODES" 1
    require_int GPUS_PER_NODE "$GPUS_PER_NODE" 1
    phase2_defaults
    check_knobs
    if [[ -n "${SLURM_JOB_ID:-}" ]]; then
        run_in_allocation
    elif truthy "$DRY_RUN"; then
        local last
        last=$(printf '%03d' "$NODES")
        dry_run "node[001-$last]" "$GPUS_PER_NODE" "$DEFAULT_CPUS_PER_TASK" 12345
        say "(outside Slurm: example node names and job id; submit with: bash $SCRIPT, or sbatch $SCRIPT)"
    else
        submit_self "$@"
    fi
}
