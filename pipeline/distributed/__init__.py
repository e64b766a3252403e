"""Everything that knows about ranks: the launch environment (torchrun, deepspeed, Slurm's srun) and
its rendezvous store (launch), one GPU per rank (gpus), the process group and the trainer's small
collectives (group), the gathers and reductions the losses need (collectives), and a counter of the
bytes every collective carries (counting, for pipeline.bench.comm_bytes).

No module outside this package reads RANK / LOCAL_RANK / WORLD_SIZE / SLURM_* or calls torch.distributed.
Every function here also works without a process group (a single process): the gathers return their
input and the reductions are the identity, so the losses run unchanged in unit tests and notebooks.
"""

from pipeline.distributed.collectives import (  # noqa: F401
    all_gather_ints,
    all_gather_uneven,
    mean_over_ranks,
    sum_over_ranks,
    uneven_gather_bytes,
)
from pipeline.distributed.counting import (  # noqa: F401
    CollectiveCall,
    counting_collectives,
    install_collective_counter,
)
from pipeline.distributed.gpus import (  # noqa: F401
    GpuClaim,
    RankView,
    check_one_gpu_per_rank,
    gpu_for_this_rank,
    gpu_index,
    gpu_uuid,
    pick_gpus,
    refuse_shared_gpus,
    visible_gpu_uuids,
)
from pipeline.distributed.group import (  # noqa: F401
    all_gather_object,
    any_rank_flags,
    barrier,
    bound_new_group_timeouts,
    default_backend,
    host_group,
    init_process_group,
    is_distributed,
    is_initialized,
    is_main,
    max_over_ranks,
    node_index,
    node_on_host,
    nodes_by_host,
    num_nodes,
    rank,
    release_deepspeed_shm,
    world_size,
)
from pipeline.distributed.launch import (  # noqa: F401
    all_gather_at_launch,
    env_from_slurm,
    first_host,
    hostname,
    launch_rank,
    launch_world_size,
    launched,
    local_rank,
    local_world_size,
    master_port_for_job,
    node_name,
    normalize_launch_env,
    single_process_env,
)
