"""The streaming loader: a StreamingDataset that adds each sample's id and checks it on read, and the
StreamingDataLoader around it, with per-node shared-memory prefixes and per-attempt caches.

A shard that fails to arrive or to decompress (its xxh64 differs from the index, say) ends the job
with a ShardError naming the source's file, on whichever worker thread streaming prepared it.

`build_loader` runs after the process group exists, as mosaicml-streaming requires.
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
from pipeline.data.shards import DataInfo, ShardError
from preprocessing.shard_format import HASH


def _streaming_dataset_class():
    from streaming import StreamingDataset
    from streaming.base.dataset import _ShardState

    class IdStreamingDataset(StreamingDataset):
        """A StreamingDataset whose samples carry their global `sample_id` and the `epoch`, and are
        checked on read: a sample that does not decode, or holds ids outside the vocabulary, raises
        ShardError naming its shard, and so does a shard that cannot be prepared (fetched, checked
        against its hash, decompressed)."""

        def __init__(self, *, vocab_size: int, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.vocab_size = vocab_size
            self._epoch = 0
            self._failure: Optional[ShardError] = None
            if not self.cache_limit:  # evicting a mapped file would not free its space
                for shard in self.shards:
                    _map_reads(shard)

        def prepare_shard(self, shard_id: int, blocking: bool = True) -> None:
            # streaming's download thread calls this for every sample and takes a file lock each
            # time to find the shard already there; without a cache limit there is nothing to
            # update for a local shard (its access time only orders evictions).
            if not self.cache_limit and self._shard_states[shard_id] == _ShardState.LOCAL:
                return
            try:
                super().prepare_shard(shard_id, blocking)
            except Exception as e:
                # streaming leaves the shard "being prepared" for good, so that every other worker
                # of the node would wait for it: hand it back, and they fail on it too.
                self._shard_states[shard_id] = _ShardState.REMOTE
                shard = self.shards[shard_id]
                stream = self.streams[self.stream_per_shard[shard_id]]
                raw, zipped = shard.file_pairs[0]
                name = os.path.join(stream.remote or stream.local, (zipped or raw).basename)
                why = (
                    f"its {HASH} differs from the index" if "Checksum failure" in str(e) else f"{type(e).__name__}: {e}"
                )
                self._failure = ShardError(f"corrupted shard {name}: cannot prepare it ({why}); rebuild the shards")
                raise self._failure from e

        def on_exception(self, future) -> None:
            # streaming re-raises a background thread's error inside a future callback, where it is
            # only logged (a long traceback) and the epoch quietly ends early: __iter__ raises ours.
            if isinstance(future.exception(), ShardError):
                self._event.set()
                return
            super().on_exception(future)

        # streaming's epoch exit waits until both background threads report that they have
        # exited, which a thread that raised never does: a bad shard would hang the rank for good.
        def _prepare_thread(self, it) -> None:
            try:
                super()._prepare_thread(it)
            except BaseException:
                it.on_exit()
                raise

        def _ready_thread(self, it) -> None:
            try:
                super()._ready_thread(it)
            except BaseException:
                it.on_exit()
                raise

        def __iter__(self):
            yield from super().__iter__()
            if self._failure is not None:
                raise self._failure

        def _resume_incr_epoch(self) -> tuple[int, int]:
            # The epoch is decided here (on each worker) at the start of __iter__; the collator
            # keys each sample's masking on it so that masking changes from epoch to epoch.
            epoch, sample_in_epoch = super()._resume_incr_epoch()
            self._epoch = epoch
            return epoch, sample_in_epoch

        def _shard_name(self, sample_id: int) -> str:
            shard_id, _ = self.spanner[sample_id]
            stream = self.streams[self.stream_per_shard[shard_id]]
            return os.path.join(stream.remote or stream.local, self.shards[shard_id].raw_data.basename)

        def get_item(self, sample_id: int, retry: int = 7) -> dict[str, Any]:
            if self._failure is not None:
                raise self._failure
            try:
                sample = super().get_item(sample_id, retry)
            except ShardError:
                raise
            except Exception as e:
                raise ShardError(
                    f"corrupted shard {self._shard_name(sample_id)}: sample {sample_id} does not "
                    f"decode ({type(e).__name__}: {e}); rebuild the shards"
                ) from e
            ids = sample.get("input_ids")
            bad = None
            if ids is None or len(ids) < 2:
                bad = "input_ids missing or shorter than 2 tokens"
            elif len(sample.get("token_type_ids", ())) != len(ids) or len(sample.get("word_starts", ())) != len(ids):
                bad = "input_ids, token_type_ids and word_starts differ in length"
            elif int(ids.max()) >= self.vocab_size:
                bad = f"token id {int(ids.max())} >= the vocabulary size {self.vocab_size} (another tokenizer?)"
            if bad:
                raise ShardError(f"corrupted shard {self._shard_name(sample_id)}: sample {sample_id}: {bad}")
            sample["sample_id"] = sample_id
            sample["epoch"] = self._epoch
            return sample

    return IdStreamingDataset


class _MappedReads:
    """Sample reads of one MDS shard from a memory map of its raw file, decoded by streaming's own
    coders built once per column. streaming opens, seeks and reads the file for every sample and
    parses every column's encoding string again: most of a worker's time at L = 128
    (pipeline.bench.loader). The map is made lazily in each process (workers are forked) and the
    file's absence is still a FileNotFoundError, which is how streaming learns to fetch a shard."""

    def __init__(self, shard: Any) -> None:
        from streaming.base.format.mds.encodings import mds_decode

        self.shard = shard
        self._pid = -1
        self._map: Any = None
        try:
            from streaming.base.format.mds.encodings import _get_coder

            coders = [_get_coder(e) for e in shard.column_encodings]
            self._decoders = [c.decode for c in coders]
        except (ImportError, AttributeError):  # another streaming: its public decoder, per call
            self._decoders = [lambda b, e=e: mds_decode(e, b) for e in shard.column_encodings]
        self._columns = list(zip(shard.column_names, shard.column_sizes, self._decoders))

    def _mapped(self):
        if self._pid != os.getpid():
            import mmap

            path = os.path.join(self.shard.dirname, self.shard.split, self.shard.raw_data.basename)
            with open(path, "rb") as f:
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            self._pid = os.getpid()
        return self._map

    def get_sample_data(self, idx: int) -> bytes:
        import numpy as np

        mm = self._mapped()
        begin, end = np.frombuffer(mm, np.uint32, count=2, offset=(1 + idx) * 4)
        if end <= begin or end > len(mm):
            raise IndexError(f"relative sample index {idx} is not in {self.shard.raw_data.basename}")
        return mm[begin:end]

    def decode_sample(self, data: bytes) -> dict[str, Any]:
        import numpy as np

        sizes, at = [], 0
        for _, size, _ in self._columns:
            if size is None:
                size = int(np.frombuffer(data, np.uint32, count=1, offset=at)[0])
                at += 4
            sizes.append(size)
        sample = {}
        for (name, _, decode), size in zip(self._columns, sizes):
            sample[name] = decode(data[at : at + size])
            at += size
        return sample


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


def _map_reads(shard: Any) -> None:
    from streaming.base.format.mds.reader import MDSReader

    if isinstance(shard, MDSReader):
        reads = _MappedReads(shard)
        shard.get_sample_data = reads.get_sample_data
        shard.decode_sample = reads.decode_sample


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
    from streaming import Stream, StreamingDataLoader

    class Loader(StreamingDataLoader):
        # streaming counts the samples it has yielded (its resume state) as the length of a batch's
        # first value; our batches begin with host values (the layout's name), so say it outright.
        def _get_batch_size(self, batch: Any) -> int:
            return int(batch["num_sequences"])

        def __iter__(self):
            for batch in super().__iter__():
                yield unpack_batch(batch)

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
    dataset = _streaming_dataset_class()(
        streams=streams,
        vocab_size=vocab_size,
        batch_size=micro_batch,
        shuffle=True,
        shuffle_seed=seed,
        num_canonical_nodes=num_canonical_nodes,
    )
    for m in markers or []:
        # Only the prefix search needed them; streaming's own lock files are not among them.
        m.unlink(missing_ok=True)
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
