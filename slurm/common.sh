# Shared by the launchers in slurm/ (sourced, not run). Bash helpers for the three jobs:
# finding the repository from inside a job, reading the allocation, the per-task launch
# environment, dry runs that print what would run, and the requeue decision after a pre-emption.
#
# Every function prints its own messages with the "[slurm]" prefix; the job logs stay greppable.

SLURM_LOG_PREFIX="[slurm]"

say() { printf '%s %s\n' "$SLURM_LOG_PREFIX" "$*"; }

# A user error: the message names the variable and the value, and the exit code is 2 (as the
# Python entry points do).
die() {
    printf '%s error: %s\n' "$SLURM_LOG_PREFIX" "$*" >&2
    exit 2
}

# Print a command as a shell would re-read it, prefixed with "+": plain words as they are, others
# in single quotes.
print_cmd() {
    local out="+" arg q="'"
    for arg in "$@"; do
        if [[ "$arg" =~ ^[A-Za-z0-9_@%+=:,./-]+$ ]]; then
            out+=" $arg"
        else
            out+=" '${arg//$q/$q\\$q$q}'"
        fi
    done
    printf '%s\n' "$out"
}

# 1 for 1/true/yes/on (any case), else 0.
truthy() {
    case "${1,,}" in 1|true|yes|on) return 0 ;; *) return 1 ;; esac
}

require_int() {  # NAME VALUE [MIN]
    [[ "$2" =~ ^[0-9]+$ ]] || die "$1=$2 is not a whole number"
    (( $2 >= ${3:-0} )) || die "$1=$2 must be >= ${3:-0}"
}

# ---------------------------------------------------------------------------------------------------
# The allocation
# ---------------------------------------------------------------------------------------------------

# Expand a Slurm host list ("gpu[001-003,007]-ib,cpu1", "rack[1-2]-n[01-02]") into one name per
# line. scontrol does it when it can reach a configuration; the fallback covers dry runs on a laptop
# without Slurm: text around the brackets is kept, several bracket groups expand left to right.
expand_hostlist() {
    local list="$1"
    if command -v scontrol >/dev/null 2>&1 && scontrol show hostnames "$list" 2>/dev/null; then
        return 0
    fi
    local item="" c depth=0 i
    # Split on the commas outside brackets.
    for ((i = 0; i < ${#list}; i++)); do
        c="${list:i:1}"
        [[ "$c" == "[" ]] && depth=$((depth + 1))
        [[ "$c" == "]" ]] && depth=$((depth - 1))
        if [[ "$c" == "," && $depth -eq 0 ]]; then
            _expand_host "$item"
            item=""
        else
            item+="$c"
        fi
    done
    [[ -n "$item" ]] && _expand_host "$item"
    return 0
}

# One host-list item ("pre[01-03,7]post[1-2]") -> its names: the first bracket group expanded, the
# rest of the item recursively.
_expand_host() {
    local item="$1" prefix ranges rest r lo hi width i tail
    if [[ ! "$item" =~ ^([^\[]*)\[([^]]+)\](.*)$ ]]; then
        printf '%s\n' "$item"
        return
    fi
    prefix="${BASH_REMATCH[1]}" ranges="${BASH_REMATCH[2]}" rest="${BASH_REMATCH[3]}"
    local -a items tails
    IFS=',' read -ra items <<<"$ranges"
    mapfile -t tails < <(_expand_host "$rest")
    for r in "${items[@]}"; do
        lo="${r%-*}" hi="${r#*-}" width="${#lo}"
        for ((i = 10#$lo; i <= 10#$hi; i++)); do
            for tail in "${tails[@]}"; do printf '%s%0*d%s\n' "$prefix" "$width" "$i" "$tail"; done
        done
    done
}

# The address other nodes reach NODE at: Slurm's own NodeAddr (what slurmctld uses), which is the
# node's name on most clusters and an IP where names do not resolve (our one-machine test cluster).
node_addr() {
    local node="$1" addr=""
    if command -v scontrol >/dev/null 2>&1; then
        addr=$(scontrol show node "$node" 2>/dev/null | sed -n 's/.*NodeAddr=\([^ ]*\).*/\1/p' | head -n 1)
    fi
    printf '%s\n' "${addr:-$node}"
}

# Ranks per node of the current allocation: --ntasks-per-node, else the first count of
# SLURM_TASKS_PER_NODE ("8(x8)" -> 8).
alloc_tasks_per_node() {
    if [[ -n "${SLURM_NTASKS_PER_NODE:-}" ]]; then
        printf '%s\n' "${SLURM_NTASKS_PER_NODE%%(*}"
    else
        local t="${SLURM_TASKS_PER_NODE:-1}"
        printf '%s\n' "${t%%[(,]*}"
    fi
}

# A port in [base, base + span) that is a function of the job id, so jobs sharing a node differ
# and a requeued job (same id) finds the same one.
port_from_job() {  # JOB_ID BASE SPAN
    local id="${1//[^0-9]/}"
    printf '%s\n' $(( $2 + 10#${id:-0} % $3 ))
}

# ---------------------------------------------------------------------------------------------------
# Pre-emption and requeue
# ---------------------------------------------------------------------------------------------------

# The step of the last complete checkpoint in SAVE_DIR (DeepSpeed's `latest` tag file, written
# only after a checkpoint is complete), or -1 when there is none.
latest_checkpoint_step() {
    local f="$1/checkpoints/latest" tag
    [[ -f "$f" ]] || { echo -1; return; }
    tag=$(tr -d '[:space:]' <"$f")
    if [[ "$tag" =~ ^step_0*([0-9]+)$ ]]; then echo "${BASH_REMATCH[1]}"; else echo -1; fi
}

# Until a step runs, a pre-emption signal that reaches the batch shell is remembered in SIGNALLED
# (bash's default for USR1 and TERM would end the script, and the job with it, unrequeued): the
# next step is then not started, and the job is requeued (train_job.sh's run_phase).
remember_signals() {
    trap 'SIGNALLED=USR1' USR1
    trap 'SIGNALLED=TERM' TERM
}

# Run "$@" (an srun command) in the background and wait for it, forwarding USR1/TERM that reach
# the batch shell to the step. The batch shell only receives them when they are sent to it
# (`--signal=B:USR1@...`, `scancel --batch`/`--full`); the header's `--signal=USR1@180` signals
# the step's tasks directly. The trainer treats repeated signals as one. Sets STEP_RC, and
# SIGNALLED to the signal's name when the batch shell saw one (the caller empties it once per job).
run_step_forwarding_signals() {
    "$@" &
    local pid=$!
    # srun forwards USR1 and TERM to every task of its step. The pid is fixed now (SC2064).
    # shellcheck disable=SC2064
    trap "SIGNALLED=USR1; kill -s USR1 $pid 2>/dev/null || true" USR1
    # shellcheck disable=SC2064
    trap "SIGNALLED=TERM; kill -s TERM $pid 2>/dev/null || true" TERM
    # wait returns >128 when a trapped signal interrupts it while the step still runs: wait again.
    # Once it is gone, wait returns its remembered exit status.
    while kill -0 "$pid" 2>/dev/null; do wait "$pid" || true; done
    set +e
    wait "$pid"
    # shellcheck disable=SC2034  # read by the caller
    STEP_RC=$?
    set -e
    remember_signals
}

# After a step that exited 0: requeue this job if training stopped before MAX_STEPS (a
# pre-emption signal made the trainer save and exit 0); return when it reached MAX_STEPS. LABEL
# ("phase 2") starts the messages of a job with several phases.
finish_or_requeue() {  # SAVE_DIR MAX_STEPS MAX_REQUEUES [LABEL]
    local save_dir="$1" max_steps="$2" max_requeues="$3" label="${4:+$4: }" at
    at=$(latest_checkpoint_step "$save_dir")
    if (( at >= max_steps )); then
        say "${label}training finished: checkpoint at step $at of $max_steps (restarts: ${SLURM_RESTART_COUNT:-0})"
        return 0
    fi
    say "${label}the step exited 0 at step $at of $max_steps${SIGNALLED:+ after SIG$SIGNALLED}: pre-empted"
    requeue_job "$max_requeues" "it resumes ${4:+$4 }from step $at"
}

# Requeue this job (the headers say --requeue) and end the script; the requeued job runs it again
# from the top. NEXT says what the next run does. Exits 3 when the job cannot be requeued.
requeue_job() {  # MAX_REQUEUES NEXT
    local restarts="${SLURM_RESTART_COUNT:-0}"
    if (( restarts >= $1 )); then
        say "not requeueing: this job was already requeued $restarts times (MAX_REQUEUES=$1)"
        exit 3
    fi
    say "requeueing job $SLURM_JOB_ID (restart $((restarts + 1))); $2"
    if ! scontrol requeue "$SLURM_JOB_ID"; then
        say "scontrol requeue failed (was the job submitted with --no-requeue?); submit the same script" \
            "again: $2"
        exit 3
    fi
    sleep 60  # the requeue ends this shell; never run on into the success path
    exit 3
}

# Seconds left before this job's time limit (squeue's %L), or -1 when it has none or Slurm does
# not say.
job_seconds_left() {
    slurm_duration_s "$(squeue -h -j "$SLURM_JOB_ID" -o %L 2>/dev/null | head -n 1)"
}

# A duration as Slurm prints it ([D-]HH:MM:SS, MM:SS, SS) in seconds; -1 for anything else
# (UNLIMITED, NOT_SET, empty).
slurm_duration_s() {  # DURATION
    local t="$1" days=0 total=0 part parts
    if [[ "$t" =~ ^([0-9]+)-(.+)$ ]]; then days="${BASH_REMATCH[1]}" t="${BASH_REMATCH[2]}"; fi
    [[ "$t" =~ ^[0-9]+(:[0-9]+){0,2}$ ]] || { echo -1; return 0; }
    IFS=: read -ra parts <<<"$t"
    for part in "${parts[@]}"; do total=$(( total * 60 + 10#$part )); done
    echo $(( 10#$days * 86400 + total ))
}
