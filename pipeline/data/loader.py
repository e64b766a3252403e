"""The streaming loader: the StreamingDataLoader around our StreamingDataset (each sample's id, checked
on read: pipeline.data.streaming_dataset), with per-node shared-memory prefixes and per-attempt caches.

A shard that fails to arrive or to decompress (its xxh64 differs from the index, say) ends the job
with a ShardError naming the source's file, on whichever worker thread streaming prepared it.

`open_dataset` is the one way shards are opened for reading (the trainer's `build_loader`, the analysis,
the benchmarks); it runs after the process group exists, as mosaicml-streaming requires.
"""

from __future__ import annotations

import atexit
import os
import secrets
import shutil
import signal
import tempfile
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Optional

from pipeline import distributed
from pipeline.data.collator import MaskingCollator
from pipeline.data.shards import DataInfo
from preprocessing.shard_format import HASH

_PACKED, _SPEC = "_packed_tensors", "_packed_spec"


class PackingCollate:
    """A collator whose batch crosses from a worker to the rank as one byte buffer: torch moves each
    tensor of a batch through its own shared-memory segment, and a dozen of them per batch cost the
    worker more than reading and masking the samples (pipeline.bench.loader). `unpack_batch` turns
    it back into the collator's dict, every tensor a view of the one (pinned) buffer."""

    def __init__(self, collate: Any) -> None:
        self.collate = collate

    def __call__(self, samples: Sequence[dict[str, Any]]) -> dict[str, Any]:
        import torch

        batch = self.collate(samples)
        out = {k: v for k, v in batch.items() if not isinstance(v, torch.Tensor)}
        spec, parts, seen, offset = [], [], {}, 0
        for key, t in batch.items():
            if not isinstance(t, torch.Tensor):
                continue
            if id(t) in seen:  # the same tensor under two names
                spec.append((key, seen[id(t)]))
                continue
            seen[id(t)] = key
            flat = t.contiguous().reshape(-1).view(torch.uint8)
            pad = -offset % 8  # every dtype's view needs its alignment
            if pad:
                parts.append(torch.zeros(pad, dtype=torch.uint8))
                offset += pad
            spec.append((key, (str(t.dtype).removeprefix("torch."), tuple(t.shape), offset, flat.numel())))
            parts.append(flat)
            offset += flat.numel()
        out[_PACKED] = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.uint8)
        out[_SPEC] = spec
        return out


def unpack_batch(batch: dict[str, Any]) -> dict[str, Any]:
    """The collator's dict from a PackingCollate batch (any other batch is returned as it is)."""
    if _PACKED not in batch:
        return batch
    import torch

    buf = batch[_PACKED]
    out = {k: v for k, v in batch.items() if k not in (_PACKED, _SPEC)}
    for key, where in batch[_SPEC]:
        if isinstance(where, str):
            out[key] = out[where]
            continue
        dtype, shape, offset, nbytes = where
        out[key] = buf[offset : offset + nbytes].view(getattr(torch, dtype)).reshape(shape)
    return out


def _worker_init(_: int) -> None:
    # Slurm's pre-emption signal reaches every process of the step, and the deepspeed launcher
    # terminates the whole tree: a worker that died of it would crash its rank before the rank
    # could save. The rank owns the decision; workers stop when it shuts the loader down.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _separate_colocated_nodes(key: str) -> Optional[list[Path]]:
    """Give each node its own streaming shared-memory prefix when several nodes share one host.

    streaming picks a prefix on every rank before its local leader registers it, so two local
    leaders on one host (a test or a fake-node Slurm set-up) pick the same one and collide. Here
    nodes take turns (world barriers, which every rank passes) choosing a free prefix; each node
    gets a private temp folder, and a choice is hidden from the other nodes' searches by a marker
    file (streaming skips prefixes whose file lock exists) in their folders. Returns the markers
    written into this node's folder, to be removed once the dataset exists; None when no host
    holds two nodes.
    """
    from streaming.base.constant import BARRIER_FILELOCK, SHM_TO_CLEAN

    node = distributed.node_index()
    hosts = distributed.nodes_by_host()
    if all(len(nodes) == 1 for nodes in hosts.values()):
        return None
    base = Path(tempfile.gettempdir())
    mine = sorted(hosts[distributed.hostname()])

    def folder(n: int) -> Path:
        return base / f"tokencl-{key}-node{n}"

    leader = distributed.local_rank() == 0
    if leader:
        folder(node).mkdir(parents=True, exist_ok=True)
        # Lock files left by an earlier run of this job would read as markers below.
        for stale in folder(node).glob("*_filelock"):
            stale.unlink(missing_ok=True)
    distributed.barrier()
    for turn in range(distributed.num_nodes()):
        if turn == node and leader and len(mine) > 1:
            prefix = 0
            while (
                any(Path(f"/dev/shm/{prefix:06}_{name}").exists() for name in SHM_TO_CLEAN)
                or (folder(node) / f"{prefix:06}_{BARRIER_FILELOCK}").exists()
            ):
                prefix += 1
            for other in mine:
                if other != node:
                    (folder(other) / f"{prefix:06}_{BARRIER_FILELOCK}").touch()
        distributed.barrier()
    tempfile.tempdir = str(folder(node))
    os.environ["TMPDIR"] = tempfile.tempdir
    return [p for p in folder(node).glob(f"*_{BARRIER_FILELOCK}")]


def _attempt_caches(info: DataInfo) -> list[str]:
    """Where streaming keeps each source's shards: a source read in place, its own folder; any other
    (remote data, local .mds.zstd shards) CACHE/node{n}-{attempt}/stream..., private to this node and
    to this run of the job.

    streaming refuses a cache folder that another live dataset registered with a remote, and a
    job killed hard leaves its registration behind in shared memory: a requeued job on the same
    node would then be refused its own folder. A fresh folder per attempt (rank 0's token, the same
    on every rank) avoids that; the node's local leader removes the folders of earlier attempts.
    """
    if all(s.cache is None for s in info.sources):
        return [s.local for s in info.sources]
    node = distributed.node_index()
    token = distributed.all_gather_object(secrets.token_hex(4))[0]
    out = []
    for s in info.sources:
        if s.cache is None:
            out.append(s.local)
            continue
        root = Path(s.cache).parent
        out.append(str(root / f"node{node}-{token}" / Path(s.cache).name))
        if distributed.local_rank() == 0:
            for old in root.glob(f"node{node}-*"):
                if old.name != f"node{node}-{token}":
                    shutil.rmtree(old, ignore_errors=True)
    distributed.barrier()
    return out


def open_dataset(
    info: DataInfo,
    *,
    vocab_size: int,
    batch_size: int,
    shuffle: bool,
    seed: int,
    run_id: str,
    weights: Optional[Sequence[float]] = None,
    num_canonical_nodes: Optional[int] = None,
):
    """The streaming dataset over every source of `info` (what `inspect_data` checked and verified), as
    every reader of shards opens it: the trainer's loader, the analysis, the benchmarks. A local
    folder of decompressed shards is read in place; `.mds.zstd` shards and remote data go through this
    node's cache (`_attempt_caches`), never into the data folder; each file's xxh64 is checked as it is
    prepared and each sample as it is read (IdStreamingDataset). With a process group, call it on every
    rank after the group exists, as mosaicml-streaming requires."""
    from streaming import Stream

    distributed.normalize_launch_env()
    markers = _separate_colocated_nodes(run_id)
    locals_ = _attempt_caches(info)
    total = sum(weights) if weights else None
    streams = [
        Stream(
            # A cached local folder is streaming's "remote": it copies each .zstd into the cache,
            # checks it and decompresses it there, and removes the copy.
            remote=s.remote or (s.local if s.cache else None),
            local=local,
            proportion=(w / total) if weights else None,
            validate_hash=HASH if s.hashed else None,
        )
        for s, local, w in zip(info.sources, locals_, weights or [None] * len(info.sources))
    ]
    from pipeline.data.streaming_dataset import IdStreamingDataset  # streaming imports torchvision: only here

    dataset = IdStreamingDataset(
        streams=streams,
        vocab_size=vocab_size,
        batch_size=batch_size,
        shuffle=shuffle,
        shuffle_seed=seed,
        num_canonical_nodes=num_canonical_nodes,
    )
    for m in markers or []:
        # Only the prefix search needed them; streaming's own lock files are not among them.
        m.unlink(missing_ok=True)
    return dataset


def cores_per_rank() -> int:
    """The cores this rank may use: its affinity (a Slurm task bound to its cores sees only those),
    or the node's cores shared by its ranks when it is not bound."""
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if usable >= (os.cpu_count() or 1):  # not bound: the node's cores are shared by its ranks
        usable //= max(1, distributed.local_world_size())
    return max(1, usable)


def loader_workers(requested: Optional[int], *, say: Callable[[str], None]) -> int:
    """The loader workers per rank. Default: the cores per rank less one (for the rank itself), at
    most 8. A requested count is capped at the cores per rank, and `say` is told: more workers than
    cores only add processes (each with its memory and /tmp folder) that wait for the same cores,
    which is why the builder caps its Ray tasks too."""
    cores = cores_per_rank()
    if requested is None:
        return max(1, min(8, cores - 1))
    if requested > cores:
        say(f"--num_workers {requested}: capped at {cores}, the cores per rank (more workers would wait for them)")
        return cores
    return requested


def build_loader(
    info: DataInfo,
    *,
    weights: Optional[Sequence[float]],
    micro_batch: int,
    collator: MaskingCollator,
    vocab_size: int,
    seed: int,
    num_workers: int,
    num_canonical_nodes: Optional[int],
    run_id: str,
    pin_memory: bool,
    timeout_s: float = 0,
):
    """The StreamingDataLoader over every source (call after the process group exists).

    Every rank passes the same seed and the per-rank micro-batch; streaming then gives each rank
    the same number of samples per epoch, so the ranks stay in lockstep. `timeout_s` (with workers)
    bounds the wait for a batch: at an epoch's start streaming's workers meet at a node-wide barrier
    without a timeout of its own, where a hung rank would otherwise hang the others for good.
    """
    from streaming import StreamingDataLoader

    class Loader(StreamingDataLoader):
        # streaming counts the samples it has yielded (its resume state) as the length of a batch's
        # first value; our batches begin with host values (the layout's name), so say it outright.
        def _get_batch_size(self, batch: Any) -> int:
            return int(batch["num_samples"])  # not num_sequences: packed blocks are cut into documents

        def __iter__(self):
            for batch in super().__iter__():
                yield unpack_batch(batch)

    dataset = open_dataset(
        info,
        vocab_size=vocab_size,
        batch_size=micro_batch,
        shuffle=True,
        seed=seed,
        run_id=run_id,
        weights=weights,
        num_canonical_nodes=num_canonical_nodes,
    )
    loader = Loader(
        dataset,
        batch_size=micro_batch,
        collate_fn=PackingCollate(collator) if num_workers else collator,
        num_workers=num_workers,
        worker_init_fn=_worker_init if num_workers else None,
        pin_memory=pin_memory,
        persistent_workers=num_workers > 0,
        drop_last=False,
        timeout=timeout_s if num_workers else 0,
    )
    # Workers ignore SIGTERM (see _worker_init), so multiprocessing's exit hook, which terminates and
    # then joins them, would wait forever: stop them first (atexit runs the later hook first).
    atexit.register(shutdown_loader, weakref.ref(loader))
    return loader


def shutdown_loader(loader: Any) -> None:
    """Stop a loader's worker processes now (also accepts a weak reference)."""
    if isinstance(loader, weakref.ref):
        loader = loader()
    it = getattr(loader, "_iterator", None)
    if it is not None:
        it._shutdown_workers()  # what StreamingDataLoader.__del__ calls
        loader._iterator = None
