#!/usr/bin/env bash
# Build MDS shards with a Ray cluster spread over the allocated nodes: the Ray head on the first
# node, one Ray worker on each other node (each started by srun), then
# preprocessing/build_shards.py as the driver on the head node. Ray is shut down on success and
# on failure alike.
#
#SBATCH --job-name=build-shards
#SBATCH --nodes=4
#SBATCH --ntasks-per-node=1
#SBATCH --cpus-per-task=32
#SBATCH --mem-per-cpu=4G
#SBATCH --time=12:00:00
#SBATCH --output=logs/%x-%j.out
#
# Run it (from the repository root, with the project's Python environment active; INPUTS and
# OUTPUT on storage every node sees):
#   INPUTS="en:/data/wiki/*.txt zh:/data/zh/*.jsonl" OUTPUT=/data/shards sbatch slurm/build_shards_ray.sh
#   NODES=8 CPUS_PER_NODE=64 INPUTS=... OUTPUT=... bash slurm/build_shards_ray.sh   # submits itself, resized
#   DRY_RUN=1 INPUTS=... OUTPUT=... bash slurm/build_shards_ray.sh   # prints the srun command of every node
#                                                                    # and the builder's resolved settings
#
# Knobs (environment variables; default in brackets):
#   INPUTS           builder inputs, space-separated [en:|zh:]PATH_OR_GLOB (quote globs) [required]
#   OUTPUT           shard folder to write [required]
#   TOKENIZER        an HF tokenizer folder to use as is []
#   TRAIN_TOKENIZER  the builder's --train_tokenizer: train one on the inputs instead [wordpiece, when
#                    TOKENIZER is unset: the builder needs one of the two and has no default]
#   VOCAB_SIZE, FORMAT, MAX_SEQ_LEN, SEED, EVAL_SHARE, NUM_WORKERS
#                    the builder's --vocab_size, --format, ...: passed only when set, so the defaults
#                    are the builder's own (preprocessing/config.py; a dry run prints them resolved)
#   EXTRA_ARGS       more build_shards.py flags, split on spaces (e.g. --overwrite, --remote URL) []
#   NODES            nodes, when this script submits itself [4]
#   CPUS_PER_NODE    CPUs Ray uses per node [the allocation's --cpus-per-task; 32 when submitting]
#   PARTITION, ACCOUNT, TIME_LIMIT   sbatch --partition/--account/--time when it submits itself []
#   PYTHON           the driver's interpreter; `ray` is taken from the same folder [python]
#   RAY_PORT         the head's port [30000 + job id % 2000]
#   RAY_START_TIMEOUT_S  how long to wait for every node to join [300]
#   RAY_LOOPBACK     1: keep Ray on 127.0.0.1 (one-node test clusters; Ray cannot hold two nodes on
#                    one host over loopback) [0]
#   LOCAL_DISK       node-local scratch root; Ray's temp folder (and its logs, left for inspection)
#                    is LOCAL_DISK/tkray-JOBID on each node [$SLURM_TMPDIR or /tmp]
#   DRY_RUN          1: print every command, start nothing [0]
#
# Each job makes its own Ray token (RAY_AUTH_TOKEN, passed to every node by srun's environment)
# and temp folder, so two builds on one node, or a user's own Ray, do not mix.
set -euo pipefail

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

DEFAULT_NODES=4
DEFAULT_CPUS_PER_NODE=32
: "${INPUTS:=}" "${OUTPUT:=}" "${TOKENIZER:=}" "${TRAIN_TOKENIZER:=}" "${EXTRA_ARGS:=}"
# The builder's knobs that travel only when set, each as --<its name in lower case>.
BUILDER_KNOBS=(VOCAB_SIZE FORMAT MAX_SEQ_LEN SEED EVAL_SHARE NUM_WORKERS)
: "${PYTHON:=python}" "${RAY_START_TIMEOUT_S:=300}" "${RAY_LOOPBACK:=0}" "${DRY_RUN:=0}"
: "${LOCAL_DISK:=${SLURM_TMPDIR:-/tmp}}"

# `ray` from the same environment as the driver: the versions must match.
ray_bin() {
    local py
    py=$(command -v "$PYTHON" 2>/dev/null || echo "$PYTHON")
    if [[ -x "$(dirname "$py")/ray" ]]; then echo "$(dirname "$py")/ray"; else echo ray; fi
}

check_knobs() {
    [[ -n "$INPUTS" ]] || die "INPUTS is empty: give the builder's inputs, e.g. INPUTS=\"en:/data/wiki/*.txt\""
    [[ -n "$OUTPUT" ]] || die "OUTPUT is empty: give the shard folder to write (on shared storage)"
    [[ -n "$TOKENIZER" || -n "$TRAIN_TOKENIZER" ]] || TRAIN_TOKENIZER=wordpiece
    require_int RAY_START_TIMEOUT_S "$RAY_START_TIMEOUT_S" 1
}

# Sets BUILD_CMD: the driver, joining the running cluster.
build_builder_cmd() {  # RAY_ADDRESS
    local spec inputs extra knob
    read -ra inputs <<<"$INPUTS"  # read does not expand globs: the builder does
    BUILD_CMD=("$PYTHON" "$REPO/preprocessing/build_shards.py")
    for spec in "${inputs[@]}"; do BUILD_CMD+=(--input "$spec"); done
    BUILD_CMD+=(--output "$OUTPUT")
    [[ -n "$TOKENIZER" ]] && BUILD_CMD+=(--tokenizer "$TOKENIZER")
    [[ -n "$TRAIN_TOKENIZER" ]] && BUILD_CMD+=(--train_tokenizer "$TRAIN_TOKENIZER")
    for knob in "${BUILDER_KNOBS[@]}"; do
        [[ -n "${!knob:-}" ]] && BUILD_CMD+=("--${knob,,}" "${!knob}")
    done
    BUILD_CMD+=(--ray_address "$1")
    read -ra extra <<<"$EXTRA_ARGS"
    BUILD_CMD+=("${extra[@]}")
}

# What the builder makes of BUILD_CMD: every knob with its resolved value, its defaults included.
# A value it refuses stops the script here (on the login node when submitting), naming the flag.
resolved_config() {
    local resolved
    if ! resolved=$("${BUILD_CMD[@]}" --print_config 2>&1); then
        printf '%s\n' "$resolved" >&2
        die "the shard builder refuses these settings (above)"
    fi
    printf '%s\n' "$resolved"
}

# Sets HEAD_CMD and WORKER_CMD (for node $3): `ray start --block` under srun, one task per node.
# The task first records its pid in RAY_TMPDIR (node-local), for stop_node.
build_ray_cmds() {  # HEAD_NODE HEAD_ADDR NODE CPUS PORT
    local head="$1" head_addr="$2" node="$3" cpus="$4" port="$5" ray
    ray=$(ray_bin)
    local srun_one=(srun --nodes=1 --ntasks=1 --cpus-per-task="$cpus" --kill-on-bad-exit=1)
    # shellcheck disable=SC2016  # expanded by the task's shell, on its node
    local rec=(bash -c 'mkdir -p "$RAY_TMPDIR" && echo $$ >"$RAY_TMPDIR/ray-start.pid" && exec "$@"' ray-node)
    HEAD_CMD=("${srun_one[@]}" --job-name=ray-head --nodelist="$head" "${rec[@]}" "$ray" start --head --port="$port" --num-cpus="$cpus"
              --include-dashboard=false --disable-usage-stats --block)
    truthy "$RAY_LOOPBACK" || HEAD_CMD+=(--node-ip-address="$head_addr")
    WORKER_CMD=("${srun_one[@]}" --job-name="ray-worker-$node" --nodelist="$node" "${rec[@]}" "$ray" start --address="$head_addr:$port"
                --node-ip-address="$(node_addr "$node")" --num-cpus="$cpus" --disable-usage-stats --block)
}

# Nodes alive in the Ray cluster, from `ray status` ("Active:" lists "<count> node_<id>" lines).
ray_active_nodes() {  # ADDRESS
    "$(ray_bin)" status --address "$1" 2>/dev/null |
        awk '/^Active:/ {on=1; next} /^[A-Z][a-z]+:/ {on=0} on && $2 ~ /^node_/ {n += $1} END {print n + 0}'
}

# The head is the node running this batch script (the driver runs here and finds Ray's files on
# this node's disk); the workers are the others.
order_nodes() {  # NODELIST -> prints head first
    local here="${SLURMD_NODENAME:-}" n
    mapfile -t _all < <(expand_hostlist "$1")
    [[ -n "$here" && " ${_all[*]} " == *" $here "* ]] || here="${_all[0]}"
    echo "$here"
    for n in "${_all[@]}"; do [[ "$n" == "$here" ]] || echo "$n"; done
}

dry_run() {  # NODELIST CPUS JOB_ID
    local nodes head_addr port n
    mapfile -t nodes < <(order_nodes "$1")
    head_addr=$(node_addr "${nodes[0]}")
    truthy "$RAY_LOOPBACK" && head_addr=127.0.0.1
    port="${RAY_PORT:-$(port_from_job "$3" 30000 2000)}"
    say "dry run: nothing is started"
    say "allocation: ${#nodes[@]} node(s) ($1), $2 CPU(s) each; job id $3; Ray head ${nodes[0]} at $head_addr:$port"
    local env_line="RAY_TMPDIR=$LOCAL_DISK/tkray-$3 RAY_AUTH_MODE=token RAY_AUTH_TOKEN=<random, per job>"
    truthy "$RAY_LOOPBACK" && env_line+=" RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0"
    say "$env_line"
    build_ray_cmds "${nodes[0]}" "$head_addr" "${nodes[0]}" "$2" "$port"
    say "head on ${nodes[0]}:"
    print_cmd "${HEAD_CMD[@]}"
    for n in "${nodes[@]:1}"; do
        build_ray_cmds "${nodes[0]}" "$head_addr" "$n" "$2" "$port"
        say "worker on $n:"
        print_cmd "${WORKER_CMD[@]}"
    done
    say "then, once \`ray status\` lists ${#nodes[@]} active node(s), the driver on ${nodes[0]}:"
    build_builder_cmd "$(truthy "$RAY_LOOPBACK" && echo auto || echo "$head_addr:$port")"
    print_cmd "${BUILD_CMD[@]}"
    say "resolved configuration (preprocessing/build_shards.py --print_config):"
    resolved_config
    say "and on exit, success or failure: SIGTERM to each node's \`ray start\` (workers, then the head), e.g."
    # shellcheck disable=SC2016  # printed as it would run
    print_cmd srun --overlap --nodes=1 --ntasks=1 --nodelist="${nodes[-1]}" \
        bash -c 'kill -TERM "$(cat "$RAY_TMPDIR/ray-start.pid")"'
}

RAY_PIDS=()  # the srun of each Ray node, head first
RAY_NODES=()

# Stop the Ray node on NODE: SIGTERM to its `ray start --block` alone (by the pid it recorded on
# that node), which drains the node and stops its Ray processes. A signal to the whole step
# (scancel, or SIGTERM to srun) would reach the GCS and raylet at the same moment and break the
# drain. --overlap: the Ray step holds the node's CPUs.
stop_node() {  # NODE
    # shellcheck disable=SC2016  # expanded on the node
    srun --overlap --nodes=1 --ntasks=1 --nodelist="$1" \
        bash -c 'kill -TERM "$(cat "$RAY_TMPDIR/ray-start.pid")"' 2>/dev/null || true
}

stop_ray() {
    local i
    (( ${#RAY_PIDS[@]} )) || return 0
    say "stopping Ray on ${#RAY_PIDS[@]} node(s)"
    # Workers first, then the head.
    for (( i = ${#RAY_PIDS[@]} - 1; i >= 0; i-- )); do
        stop_node "${RAY_NODES[$i]}"
        wait_or_kill "${RAY_PIDS[$i]}" 60
    done
    RAY_PIDS=()
}

# Wait for an srun to end; after TIMEOUT_S seconds make it cancel its step.
wait_or_kill() {  # PID TIMEOUT_S
    local i
    for (( i = 0; i < $2 * 10; i++ )); do kill -0 "$1" 2>/dev/null || break; sleep 0.1; done
    if kill -0 "$1" 2>/dev/null; then
        say "a Ray node did not stop within $2 s: cancelling its step"
        kill -TERM "$1" 2>/dev/null || true
    fi
    wait "$1" 2>/dev/null || true
}

run_in_allocation() {
    local nodes cpus port head_addr address n rc=0
    mapfile -t nodes < <(order_nodes "$SLURM_JOB_NODELIST")
    cpus="${CPUS_PER_NODE:-${SLURM_CPUS_PER_TASK:-1}}"
    require_int CPUS_PER_NODE "$cpus" 1
    if truthy "$RAY_LOOPBACK" && (( ${#nodes[@]} > 1 )); then
        die "RAY_LOOPBACK=1 keeps Ray on 127.0.0.1, where it cannot hold ${#nodes[@]} nodes: use a one-node allocation"
    fi
    if truthy "$DRY_RUN"; then
        dry_run "$SLURM_JOB_NODELIST" "$cpus" "$SLURM_JOB_ID"
        return 0
    fi
    port="${RAY_PORT:-$(port_from_job "$SLURM_JOB_ID" 30000 2000)}"
    head_addr=$(node_addr "${nodes[0]}")
    export RAY_TMPDIR="$LOCAL_DISK/tkray-$SLURM_JOB_ID" RAY_USAGE_STATS_ENABLED=0 RAY_AUTH_MODE=token
    RAY_AUTH_TOKEN=$(od -An -tx1 -N32 /dev/urandom | tr -d ' \n')
    export RAY_AUTH_TOKEN
    if truthy "$RAY_LOOPBACK"; then
        export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0
        head_addr=127.0.0.1
        address=auto  # an explicit 127.0.0.1:PORT does not connect in this mode
    else
        address="$head_addr:$port"
    fi
    trap stop_ray EXIT
    trap 'exit 143' TERM
    trap 'exit 130' INT

    say "job $SLURM_JOB_ID: Ray head on ${nodes[0]} ($head_addr:$port), $((${#nodes[@]} - 1)) worker node(s)," \
        "$cpus CPU(s) each"
    build_ray_cmds "${nodes[0]}" "$head_addr" "${nodes[0]}" "$cpus" "$port"
    print_cmd "${HEAD_CMD[@]}"
    "${HEAD_CMD[@]}" &
    RAY_PIDS+=($!)
    RAY_NODES+=("${nodes[0]}")
    # Workers join once the head answers.
    local deadline=$(( SECONDS + RAY_START_TIMEOUT_S )) up=0
    until "$(ray_bin)" status --address "$address" >/dev/null 2>&1; do
        kill -0 "${RAY_PIDS[0]}" 2>/dev/null || { say "error: the Ray head exited during start-up"; exit 1; }
        (( SECONDS < deadline )) || { say "error: the Ray head did not answer within ${RAY_START_TIMEOUT_S} s"; exit 1; }
        sleep 1
    done
    for n in "${nodes[@]:1}"; do
        build_ray_cmds "${nodes[0]}" "$head_addr" "$n" "$cpus" "$port"
        print_cmd "${WORKER_CMD[@]}"
        "${WORKER_CMD[@]}" &
        RAY_PIDS+=($!)
        RAY_NODES+=("$n")
    done
    while :; do
        up=$(ray_active_nodes "$address")
        (( up >= ${#nodes[@]} )) && break
        for n in "${!RAY_PIDS[@]}"; do
            kill -0 "${RAY_PIDS[$n]}" 2>/dev/null || { say "error: the Ray node on ${nodes[$n]} exited during start-up"; exit 1; }
        done
        (( SECONDS < deadline )) || { say "error: $up of ${#nodes[@]} Ray node(s) up after ${RAY_START_TIMEOUT_S} s"; exit 1; }
        sleep 1
    done
    say "Ray is up: $up node(s)"

    build_builder_cmd "$address"
    print_cmd "${BUILD_CMD[@]}"
    "${BUILD_CMD[@]}" || rc=$?
    if (( rc == 0 )); then say "shards written to $OUTPUT"; else say "the shard builder failed with exit code $rc"; fi
    stop_ray
    exit "$rc"
}

submit_self() {
    local num_nodes="${NODES:-$DEFAULT_NODES}" cpus="${CPUS_PER_NODE:-$DEFAULT_CPUS_PER_NODE}"
    require_int NODES "$num_nodes" 1
    require_int CPUS_PER_NODE "$cpus" 1
    local args=(--nodes="$num_nodes" --ntasks-per-node=1 --cpus-per-task="$cpus")
    [[ -n "${PARTITION:-}" ]] && args+=(--partition="$PARTITION")
    [[ -n "${ACCOUNT:-}" ]] && args+=(--account="$ACCOUNT")
    [[ -n "${TIME_LIMIT:-}" ]] && args+=(--time="$TIME_LIMIT")
    build_builder_cmd auto
    resolved_config >/dev/null
    mkdir -p logs
    print_cmd sbatch "${args[@]}" "$@" "$SCRIPT"
    exec sbatch "${args[@]}" "$@" "$SCRIPT"
}

check_knobs
if [[ -n "${SLURM_JOB_ID:-}" ]]; then
    run_in_allocation
elif truthy "$DRY_RUN"; then
    n="${NODES:-$DEFAULT_NODES}"
    require_int NODES "$n" 1
    dry_run "node[001-$(printf '%03d' "$n")]" "${CPUS_PER_NODE:-$DEFAULT_CPUS_PER_NODE}" 12345
    say "(outside Slurm: example node names and job id)"
else
    submit_self "$@"
fi
