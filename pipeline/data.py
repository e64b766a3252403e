"""Training data: the shard folders (local or remote), checked up front; a StreamingDataset that
adds each sample's id; the masking collator; the StreamingDataLoader.

`inspect_data` reads only index files (and, for local folders, each shard's header) so that a
missing, empty, mixed-format or corrupted dataset fails before any process group or device work.
`build_loader` runs after the process group exists, as mosaicml-streaming requires.

Legend: B sequences per micro-batch, L the longest sequence of the batch, N masked positions of
the batch (row-major order).
"""
from __future__ import annotations

import atexit
import hashlib
import json
import os
import secrets
import shutil
import signal
import tempfile
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np
import torch

from pipeline import distributed
from pipeline.masking import IGNORE_INDEX, MaskingSpec, mask_sequence, sample_rng

FORMATS = ("nsp", "packed")
# What a builder's DATA/tokenizer/ holds (an HF fast tokenizer folder); fetched for remote data.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt")
REQUIRED_COLUMNS = ("input_ids", "token_type_ids", "word_starts")


class ShardError(ValueError):
    """A shard that cannot be read as the builder wrote it; the message names it."""


@dataclass
class SourceInfo:
    """One --data argument, as read from its index."""

    path: str  # as given
    remote: Optional[str]  # URL for remote data, None for a local folder
    local: str  # the folder streaming reads (the folder itself, or the job's cache)
    format: str  # nsp | packed
    samples: int
    shards: int
    columns: list[str]
    manifest: Optional[dict[str, Any]]  # build_manifest.json, if present


@dataclass
class DataInfo:
    sources: list[SourceInfo]
    format: str
    max_seq_len: Optional[int]
    tokenizer_dir: Optional[str]  # DATA/tokenizer of the first local source, when present
    manifest_vocab_size: Optional[int]
    samples: int = field(init=False)

    def __post_init__(self) -> None:
        self.samples = sum(s.samples for s in self.sources)


def is_remote(path: str) -> bool:
    return "://" in path


def run_key(save_dir: str) -> str:
    """A short id of the run, the same on every rank: names the remote cache and per-node folders."""
    return hashlib.sha1(str(Path(save_dir).resolve()).encode()).hexdigest()[:12]


def default_cache_root(save_dir: str) -> str:
    return str(Path(tempfile.gettempdir()) / f"tokencl-cache-{run_key(save_dir)}")


def _source_cache(cache_root: str, i: int, url: str) -> str:
    # One folder per stream; streaming refuses two streams (or jobs) sharing a cache folder.
    digest = hashlib.sha1(url.encode()).hexdigest()[:8]
    return str(Path(cache_root) / f"stream{i}-{digest}")


# ---------------------------------------------------------------------------------------------------
# Up-front inspection
# ---------------------------------------------------------------------------------------------------


def _read_json(path: Path, what: str) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ShardError(f"{path}: cannot read the {what} ({e}); rebuild the shards")


def check_shard_file(folder: Path, shard: dict[str, Any]) -> None:
    """Raise ShardError naming the shard if its file is missing, truncated, or its MDS header does not
    match the index (sample count, offsets, size). Reads the header only."""
    raw, zipped = shard.get("raw_data") or {}, shard.get("zip_data") or {}
    name = raw.get("basename", "?")
    raw_path = folder / name
    if not raw_path.exists():
        if zipped and (folder / zipped["basename"]).exists():
            zip_path = folder / zipped["basename"]
            if zip_path.stat().st_size != zipped.get("bytes"):
                raise ShardError(f"corrupted shard {zip_path}: {zip_path.stat().st_size} bytes, the index says "
                                 f"{zipped.get('bytes')}; rebuild the shards")
            return
        raise ShardError(f"missing shard {raw_path} (listed in {folder / 'index.json'}); rebuild the shards")
    size = raw_path.stat().st_size
    if size != raw.get("bytes"):
        raise ShardError(f"corrupted shard {raw_path}: {size} bytes, the index says {raw.get('bytes')}; "
                         f"rebuild the shards")
    if shard.get("format", "mds") != "mds":
        return
    n = int(shard["samples"])
    with open(raw_path, "rb") as f:
        head = f.read(4 * (n + 2))
    if len(head) < 4 * (n + 2):
        raise ShardError(f"corrupted shard {raw_path}: too short for {n} samples; rebuild the shards")
    count = int(np.frombuffer(head[:4], np.uint32)[0])
    offsets = np.frombuffer(head[4:], np.uint32)
    if count != n or offsets[0] < 4 * (n + 2) or offsets[-1] != size or np.any(np.diff(offsets.astype(np.int64)) <= 0):
        raise ShardError(f"corrupted shard {raw_path}: its header does not match the index ({n} samples, "
                         f"{raw.get('bytes')} bytes); rebuild the shards")


def _inspect_one(path: str, *, i: int, cache_root: str, verify_files: bool) -> SourceInfo:
    remote = path if is_remote(path) else None
    if remote is None:
        folder = Path(path)
        if not folder.is_dir():
            raise ValueError(f"--data {path}: no such folder; build shards with preprocessing/build_shards.py")
        index_path = folder / "index.json"
        if not index_path.is_file():
            raise ValueError(f"--data {path}: no index.json in it; is it a shard folder written by "
                             f"preprocessing/build_shards.py?")
        local = str(folder)
        manifest_path = folder / "build_manifest.json"
    else:
        from streaming.base.storage.download import CloudDownloader

        local = _source_cache(cache_root, i, remote)
        index_path = Path(local) / "index.json"
        manifest_path = Path(local) / "build_manifest.json"
        # The index, the manifest and the builder's tokenizer folder (small files). Per-rank
        # temporary names: several ranks of a node may fetch them at once.
        wanted = [("index.json", True), ("build_manifest.json", False)] + \
            [(f"tokenizer/{f}", False) for f in TOKENIZER_FILES]
        for name, needed in wanted:
            dest = Path(local) / name
            if dest.exists():
                continue
            dest.parent.mkdir(parents=True, exist_ok=True)
            tmp = dest.with_name(f"{dest.name}.{os.getpid()}.tmp")
            try:
                CloudDownloader.direct_download(remote.rstrip("/") + "/" + name, str(tmp))
                os.replace(tmp, dest)
            except Exception as e:  # the cloud clients raise many types
                tmp.unlink(missing_ok=True)
                if needed:
                    raise ValueError(f"--data {path}: cannot fetch {name} ({type(e).__name__}: {e})")
        if not any((Path(local) / "tokenizer" / f).exists() for f in ("tokenizer.json", "vocab.txt")):
            shutil.rmtree(Path(local) / "tokenizer", ignore_errors=True)
    index = _read_json(index_path, "shard index")
    shards = index.get("shards")
    if not isinstance(shards, list):
        raise ShardError(f"{index_path}: no 'shards' list; rebuild the shards")
    samples = sum(int(s.get("samples", 0)) for s in shards)
    if not shards or samples == 0:
        raise ValueError(f"--data {path}: the index lists no samples ({len(shards)} shard(s)); the build "
                         f"produced nothing (see its rejects.jsonl and build_manifest.json)")
    columns = list(shards[0].get("column_names", []))
    for s in shards:
        if list(s.get("column_names", [])) != columns:
            raise ShardError(f"{index_path}: shard {s.get('raw_data', {}).get('basename')} has columns "
                             f"{s.get('column_names')}, the first shard {columns}; rebuild the shards")
    missing = [c for c in REQUIRED_COLUMNS if c not in columns]
    if missing:
        raise ValueError(f"--data {path}: samples lack column(s) {missing} (have {columns}); build them with "
                         f"preprocessing/build_shards.py")
    fmt = "nsp" if "nsp_label" in columns else "packed"
    if remote is None and verify_files:
        for s in shards:
            check_shard_file(Path(local), s)
    manifest = _read_json(manifest_path, "build manifest") if manifest_path.is_file() else None
    if manifest is not None and manifest.get("status", "complete") != "complete":
        raise ValueError(f"--data {path}: its build did not finish (build_manifest.json status "
                         f"{manifest.get('status')!r}); finish it with build_shards.py --resume")
    return SourceInfo(path=path, remote=remote, local=local, format=fmt, samples=samples, shards=len(shards),
                      columns=columns, manifest=manifest)


def inspect_data(paths: Sequence[str], *, cache_root: str, max_seq_len: Optional[int] = None,
                 verify_files: bool = True) -> DataInfo:
    """Read every --data index (and local shard headers) and agree on one format and length.

    Raises ValueError (ShardError for corrupted shards) naming the folder/shard: missing folder or
    index, no samples, columns missing, mixed nsp/packed sources, differing max_seq_len.
    """
    if not paths:
        raise ValueError("--data: give at least one shard folder")
    if len(set(paths)) != len(paths):
        raise ValueError(f"--data lists a folder twice: {list(paths)}")
    sources = [_inspect_one(p, i=i, cache_root=cache_root, verify_files=verify_files) for i, p in enumerate(paths)]
    formats = {s.format for s in sources}
    if len(formats) > 1:
        listing = ", ".join(f"{s.path} ({s.format})" for s in sources)
        raise ValueError(f"--data mixes shard formats: {listing}; build all of them with the same --format")
    lengths = {int(s.manifest["config"]["max_seq_len"]) for s in sources
               if s.manifest and "max_seq_len" in s.manifest.get("config", {})}
    if len(lengths) > 1:
        raise ValueError(f"--data folders were built with different --max_seq_len: {sorted(lengths)}")
    data_len = lengths.pop() if lengths else None
    if max_seq_len is not None and data_len is not None and max_seq_len != data_len:
        raise ValueError(f"--max_seq_len {max_seq_len} differs from the shards' {data_len} "
                         f"(build_manifest.json); drop the flag, the shards decide")
    vocab_sizes = {int(s.manifest["tokenizer"]["vocab_size"]) for s in sources
                   if s.manifest and "vocab_size" in s.manifest.get("tokenizer", {})}
    if len(vocab_sizes) > 1:
        raise ValueError(f"--data folders were tokenized with different vocabularies (sizes {sorted(vocab_sizes)}); "
                         f"use one tokenizer for all")
    tok_dir = None
    for s in sources:
        if (Path(s.local) / "tokenizer").is_dir():
            tok_dir = str(Path(s.local) / "tokenizer")
            break
    return DataInfo(sources=sources, format=formats.pop(), max_seq_len=data_len if data_len else max_seq_len,
                    tokenizer_dir=tok_dir, manifest_vocab_size=vocab_sizes.pop() if vocab_sizes else None)


def check_objective_against_data(objective: str, *, nsp: str, fmt: str, paths: Sequence[str]) -> bool:
    """Whether NSP runs, after checking the objective against the shard format.

    TaCL trains on NSP pairs (MLM + NSP + TaCL); it refuses packed shards unless --nsp off. TACO's
    positives and negatives assume packed blocks without padding; it refuses nsp shards.
    """
    where = ", ".join(paths)
    if objective == "tacl" and fmt != "nsp" and nsp != "off":
        raise ValueError(f"--objective tacl trains on NSP pairs, but --data {where} holds {fmt} shards: build "
                         f"them with --format nsp, or pass --nsp off to run TaCL without NSP")
    if objective == "taco" and fmt != "packed":
        raise ValueError(f"--objective taco trains on packed blocks, but --data {where} holds {fmt} shards: "
                         f"build them with --format packed")
    if nsp == "on" and fmt != "nsp":
        raise ValueError(f"--nsp on needs nsp shards, but --data {where} holds {fmt} shards")
    return fmt == "nsp" and nsp != "off"


# ---------------------------------------------------------------------------------------------------
# The dataset, the collator, the loader
# ---------------------------------------------------------------------------------------------------


def _streaming_dataset_class():
    from streaming import StreamingDataset

    class IdStreamingDataset(StreamingDataset):
        """A StreamingDataset whose samples carry their global `sample_id` and the `epoch`, and are
        checked on read: a sample that does not decode, or holds ids outside the vocabulary, raises
        ShardError naming its shard."""

        def __init__(self, *, vocab_size: int, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.vocab_size = vocab_size
            self._epoch = 0

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
            try:
                sample = super().get_item(sample_id, retry)
            except Exception as e:
                raise ShardError(f"corrupted shard {self._shard_name(sample_id)}: sample {sample_id} does not "
                                 f"decode ({type(e).__name__}: {e}); rebuild the shards") from e
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


class MaskingCollator:
    """Pads a list of samples to the longest one and masks it (pipeline.masking).

    Out (torch tensors): input_ids_BL (masked), original_ids_BL, token_type_ids_BL, attention_mask_BL
    (1 = real token), masked_BL (bool), mlm_labels_N (the original ids at masked_BL, row-major),
    sample_ids_B, and nsp_labels_B when `nsp`.
    """

    def __init__(self, *, spec: MaskingSpec, pad_id: int, seed: int, nsp: bool, max_seq_len: Optional[int]) -> None:
        self.spec = spec
        self.pad_id = pad_id
        self.seed = seed
        self.nsp = nsp
        self.max_seq_len = max_seq_len
        self.pool = spec.replacement_pool()

    def __call__(self, samples: Sequence[dict[str, Any]]) -> dict[str, torch.Tensor]:
        B = len(samples)
        L = max(len(s["input_ids"]) for s in samples)
        if self.max_seq_len is not None and L > self.max_seq_len:
            sid = next(s["sample_id"] for s in samples if len(s["input_ids"]) == L)
            raise ShardError(f"sample {sid} has {L} tokens, more than max_seq_len {self.max_seq_len}")
        input_ids = np.full((B, L), self.pad_id, np.int64)
        original = np.full((B, L), self.pad_id, np.int64)
        token_types = np.zeros((B, L), np.int64)
        attention = np.zeros((B, L), np.int64)
        labels = np.full((B, L), IGNORE_INDEX, np.int64)
        for b, s in enumerate(samples):
            ids = np.asarray(s["input_ids"], np.int64)
            n = len(ids)
            rng = sample_rng(seed=self.seed, epoch=int(s.get("epoch", 0)), sample_id=int(s["sample_id"]))
            masked, lab = mask_sequence(ids, word_starts_L=np.asarray(s["word_starts"]), spec=self.spec,
                                        replacement_pool=self.pool, rng=rng)
            input_ids[b, :n] = masked
            original[b, :n] = ids
            token_types[b, :n] = np.asarray(s["token_type_ids"], np.int64)
            attention[b, :n] = 1
            labels[b, :n] = lab
        masked_BL = labels != IGNORE_INDEX
        batch = {
            "input_ids": torch.from_numpy(input_ids),
            "original_ids": torch.from_numpy(original),
            "token_type_ids": torch.from_numpy(token_types),
            "attention_mask": torch.from_numpy(attention),
            "masked": torch.from_numpy(masked_BL),
            "mlm_labels": torch.from_numpy(labels[masked_BL]),
            "sample_ids": torch.tensor([int(s["sample_id"]) for s in samples], dtype=torch.int64),
        }
        if self.nsp:
            batch["nsp_labels"] = torch.tensor([int(s["nsp_label"]) for s in samples], dtype=torch.int64)
        return batch


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

    node = distributed.rank() // distributed.local_world_size()
    pairs = distributed.all_gather_object((distributed.hostname(), node))
    hosts: dict[str, set[int]] = {}
    for host, n in pairs:
        hosts.setdefault(host, set()).add(n)
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
    num_nodes = distributed.world_size() // distributed.local_world_size()
    for turn in range(num_nodes):
        if turn == node and leader and len(mine) > 1:
            prefix = 0
            while (any(Path(f"/dev/shm/{prefix:06}_{name}").exists() for name in SHM_TO_CLEAN)
                   or (folder(node) / f"{prefix:06}_{BARRIER_FILELOCK}").exists()):
                prefix += 1
            for other in mine:
                if other != node:
                    (folder(other) / f"{prefix:06}_{BARRIER_FILELOCK}").touch()
        distributed.barrier()
    tempfile.tempdir = str(folder(node))
    os.environ["TMPDIR"] = tempfile.tempdir
    return [p for p in folder(node).glob(f"*_{BARRIER_FILELOCK}")]


def _attempt_caches(info: DataInfo) -> list[str]:
    """Where streaming caches each source: a local folder is read in place; a remote one goes to
    CACHE/node{n}-{attempt}/stream..., private to this node and to this run of the job.

    streaming refuses a cache folder that another live dataset registered with a remote, and a
    job killed hard leaves its registration behind in shared memory: a requeued job on the same
    node would then be refused its own folder. A fresh folder per attempt (rank 0's token, the same
    on every rank) avoids that; the node's local leader removes the folders of earlier attempts.
    """
    if all(s.remote is None for s in info.sources):
        return [s.local for s in info.sources]
    node = distributed.rank() // distributed.local_world_size()
    token = distributed.all_gather_object(secrets.token_hex(4))[0]
    out = []
    for s in info.sources:
        if s.remote is None:
            out.append(s.local)
            continue
        root = Path(s.local).parent
        out.append(str(root / f"node{node}-{token}" / Path(s.local).name))
        if distributed.local_rank() == 0:
            for old in root.glob(f"node{node}-*"):
                if old.name != f"node{node}-{token}":
                    shutil.rmtree(old, ignore_errors=True)
    distributed.barrier()
    return out


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

    distributed.normalize_launch_env()
    markers = _separate_colocated_nodes(run_id)
    locals_ = _attempt_caches(info)
    total = sum(weights) if weights else None
    streams = [
        Stream(remote=s.remote, local=local, proportion=(w / total) if weights else None)
        for s, local, w in zip(info.sources, locals_, weights or [None] * len(info.sources))
    ]
    dataset = _streaming_dataset_class()(
        streams=streams, vocab_size=vocab_size, batch_size=micro_batch, shuffle=True, shuffle_seed=seed,
        num_canonical_nodes=num_canonical_nodes,
    )
    for m in markers or []:
        # Only the prefix search needed them; streaming's own lock files are not among them.
        m.unlink(missing_ok=True)
    loader = StreamingDataLoader(
        dataset, batch_size=micro_batch, collate_fn=collator, num_workers=num_workers,
        worker_init_fn=_worker_init if num_workers else None, pin_memory=pin_memory,
        persistent_workers=num_workers > 0, drop_last=False, timeout=timeout_s if num_workers else 0,
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
