"""The StreamingDataset the trainer reads shards with: each sample carries its global id and the epoch
and is checked on read, a shard that cannot be prepared ends the epoch with a ShardError naming it, and
local shards are read from a memory map with streaming's decoders built once (`_MappedReads`).

Imported only where shards are opened (pipeline.data.loader.open_dataset): mosaicml-streaming imports
torchvision, which the rest of the pipeline does not need.
"""

from __future__ import annotations

import os
from typing import Any, Optional

from streaming import StreamingDataset
from streaming.base.dataset import _ShardState

from pipeline.data.shards import ShardError
from preprocessing.shard_format import HASH


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
            why = f"its {HASH} differs from the index" if "Checksum failure" in str(e) else f"{type(e).__name__}: {e}"
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


def _map_reads(shard: Any) -> None:
    from streaming.base.format.mds.reader import MDSReader

    if isinstance(shard, MDSReader):
        reads = _MappedReads(shard)
        shard.get_sample_data = reads.get_sample_data
        shard.decode_sample = reads.decode_sample
