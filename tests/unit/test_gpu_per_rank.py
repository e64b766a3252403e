"""One GPU per rank (pipeline.distributed): the choice of a rank's GPU from what the ranks see, the
refusal of ranks that share one, and the collectives behind them over a real rendezvous store
before the process group exists. The GPUs are UUID strings: no CUDA needed."""

import os

import pytest
import torch
import torch.multiprocessing as mp

from pipeline import distributed
from preprocessing.errors import UsageError
from tests.conftest import free_port

NODE_GPUS = [f"GPU-n1-{i}" for i in range(8)]  # one node's 8 GPUs: 0-3 on socket 0, 4-7 on socket 1
FIX = "launch one task per GPU ("


def closest_views() -> list[distributed.RankView]:
    """8 ranks of a 2-socket node under srun --gpu-bind=closest and the socket-cyclic task layout:
    even local ranks see GPUs 0-3, odd ones 4-7."""
    return [distributed.RankView(r, r, tuple(NODE_GPUS[:4] if r % 2 == 0 else NODE_GPUS[4:])) for r in range(8)]


def driven(views: list[distributed.RankView], picks: list) -> list[str]:
    return [v.visible[i] for v, i in zip(views, picks)]


@pytest.mark.parametrize("local_rank", [0, 3, 7])
def test_a_rank_that_sees_one_gpu_drives_it(local_rank):
    assert distributed.gpu_index(local_rank, visible=["GPU-x"], sharing=[local_rank]) == 0
    # ... even when other ranks see the same one (the refusal then names them).
    assert distributed.gpu_index(local_rank, visible=["GPU-x"], sharing=[0, 3, 7]) == 0


def test_ranks_that_see_all_the_gpus_drive_their_local_rank():
    for lr in range(8):
        assert distributed.gpu_index(lr, visible=NODE_GPUS, sharing=range(8)) == lr


def test_ranks_that_share_a_socket_s_gpus_take_them_by_their_position_among_the_sharers():
    socket0 = NODE_GPUS[:4]
    assert [distributed.gpu_index(lr, visible=socket0, sharing=[6, 0, 4, 2]) for lr in (0, 2, 4, 6)] == [0, 1, 2, 3]
    # More sharers than GPUs wrap around (and are refused by the UUID check).
    assert distributed.gpu_index(4, visible=["a", "b"], sharing=[0, 2, 4]) == 0
    with pytest.raises(AssertionError):
        distributed.gpu_index(1, visible=socket0, sharing=[0, 2])


def test_under_closest_every_rank_gets_its_own_gpu_where_local_rank_modulo_gpus_did_not():
    views = closest_views()
    got = driven(views, distributed.pick_gpus(views))
    assert got == [NODE_GPUS[i] for i in (0, 4, 1, 5, 2, 6, 3, 7)]
    old = driven(views, [v.local_rank % len(v.visible) for v in views])  # the former rule
    assert old[0] == old[4] == NODE_GPUS[0] and len(set(old)) == 4


def test_sharers_are_found_by_gpu_identity_not_by_the_visible_devices_string():
    """Where cgroups confine each task to its socket's GPUs, both sockets' tasks read
    CUDA_VISIBLE_DEVICES=0,1,2,3 but see different GPUs; two nodes' ranks never share."""
    views = closest_views() + [distributed.RankView(8 + r, r, tuple(f"GPU-n2-{i}" for i in range(8))) for r in range(8)]
    got = driven(views, distributed.pick_gpus(views))
    assert sorted(got[:8]) == NODE_GPUS and got[8:] == [f"GPU-n2-{i}" for i in range(8)]
    one_each = [distributed.RankView(r, r, (g,)) for r, g in enumerate(NODE_GPUS)]  # srun --gpus-per-task=1
    assert distributed.pick_gpus(one_each) == [0] * 8
    assert distributed.pick_gpus([distributed.RankView(0, 0, ()), distributed.RankView(1, 1, ())]) == [None, None]


def claim(rank: int, uuid, visible: str = "0,1,2,3", node: str = "n1") -> distributed.GpuClaim:
    return distributed.GpuClaim(rank=rank, node=node, uuid=uuid, visible_devices=visible)


def test_two_ranks_on_one_gpu_are_refused_with_the_ranks_the_node_and_the_gpu():
    claims = [claim(r, f"GPU-{r % 4}") for r in range(8)]
    with pytest.raises(UsageError) as e:
        distributed.refuse_shared_gpus(claims)
    msg = str(e.value)
    assert msg.startswith(
        "ranks 0 and 4 on node n1 both drive GPU GPU-0 (CUDA_VISIBLE_DEVICES=0,1,2,3) "
        "(3 more GPU(s) are driven by several ranks): " + FIX
    ), msg
    assert "srun without --gpu-bind" in msg and "\n" not in msg


def test_the_refusal_names_every_sharer_and_what_each_saw():
    claims = [claim(1, "GPU-a", "0,1"), claim(5, "GPU-a", "0,1,2,3"), claim(3, "GPU-a", "0,1", node="n2")]
    with pytest.raises(UsageError) as e:
        distributed.refuse_shared_gpus(claims + [claim(0, "GPU-b")])
    assert str(e.value).startswith(
        "ranks 1, 3 and 5 on nodes n1 and n2 all drive GPU GPU-a "
        "(CUDA_VISIBLE_DEVICES=0,1 on rank 1, 0,1 on rank 3, 0,1,2,3 on rank 5): " + FIX
    ), str(e.value)


def test_ranks_without_a_gpu_beside_ranks_with_one_are_refused():
    with pytest.raises(UsageError) as e:
        distributed.refuse_shared_gpus([claim(0, "GPU-a"), claim(1, None, "", node="n2"), claim(2, "GPU-b")])
    assert str(e.value).startswith("rank 1 on node n2 sees no GPU (CUDA_VISIBLE_DEVICES=) while the other ranks")


def test_distinct_gpus_and_cpu_worlds_are_accepted():
    distributed.refuse_shared_gpus([claim(r, f"GPU-{r}") for r in range(8)])
    distributed.refuse_shared_gpus([claim(r, None, "") for r in range(4)])


def test_a_world_of_one_needs_no_store(monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID"):
        monkeypatch.delenv(k, raising=False)
    assert distributed.gpu_for_this_rank(visible=lambda: ["GPU-a", "GPU-b"]) == torch.device("cuda", 0)
    distributed.check_one_gpu_per_rank(torch.device("cuda", 1), uuid_of=lambda i: f"GPU-{i}")
    assert distributed.launch._STORE is None


def _worker(rank: int, port: int, out: dict) -> None:
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1"
    )
    os.environ["MASTER_PORT"] = str(port)
    seen = ["GPU-b", "GPU-a"]  # both ranks see both GPUs
    gpu = distributed.gpu_for_this_rank(visible=lambda: seen, timeout_s=60)
    distributed.check_one_gpu_per_rank(gpu, uuid_of=lambda i: seen[i], timeout_s=60)
    try:  # both ranks on the first GPU: refused on every rank
        distributed.check_one_gpu_per_rank(torch.device("cuda", 0), uuid_of=lambda i: seen[i], timeout_s=60)
        refusal = None
    except UsageError as e:
        refusal = str(e)
    # The process group forms over the same rendezvous store afterwards.
    distributed.init_process_group(backend="gloo", timeout_s=60)
    out[rank] = dict(gpu=str(gpu), refusal=refusal, ints=distributed.all_gather_ints([rank]))
    torch.distributed.destroy_process_group()


@pytest.mark.multiproc
def test_two_ranks_choose_and_check_over_the_rendezvous_store_before_the_process_group():
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_worker, args=(free_port(), out), nprocs=2, join=True)
        got = dict(out)
    host = distributed.hostname()
    for rank in (0, 1):
        assert got[rank]["gpu"] == f"cuda:{rank}"
        assert got[rank]["refusal"].startswith(
            f"ranks 0 and 1 on node {host} both drive GPU GPU-b (CUDA_VISIBLE_DEVICES="
        ), got[rank]
        assert got[rank]["ints"] == [[0], [1]]
