"""The shard folders a job trains on (local or remote), checked up front.

`inspect_data` reads each --data source's index and manifest and, for a local folder, verifies
every shard file the job will read against the index (size, MDS header, xxh64 of every byte), so
that a missing, empty, mixed-format or corrupted dataset fails before any process group or device
work. The folder layout, the columns and the manifest are the builder's contract,
preprocessing.shard_format.

Where streaming reads each source (`SourceInfo.cache`):
- a local folder whose shards are all decompressed (`.mds`): in place; nothing is written to it;
- a local folder of `.mds.zstd` shards: decompressed into the job's per-node cache (--cache_dir),
  never into the folder, which may be read-only or shared; streaming checks the xxh64 of each
  `.zstd` it decompresses;
- a remote URL: downloaded into the same cache, each file's xxh64 checked as it arrives.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import numpy as np

from preprocessing.errors import UsageError
from preprocessing.shard_format import (
    HASH,
    INDEX,
    MANIFEST,
    REQUIRED_COLUMNS,
    TOKENIZER_DIR,
    TOKENIZER_FILES,
    BuildManifest,
    format_of,
    has_tokenizer,
    pickled_columns,
)

_READ_BLOCK = 8 << 20  # bytes read at a time while hashing


class ShardError(UsageError):
    """A shard that cannot be read as the builder wrote it; the message names it."""


@dataclass
class SourceInfo:
    """One --data argument, as read from its index."""

    path: str  # as given
    remote: Optional[str]  # URL for remote data, None for a local folder
    local: str  # the folder holding index.json, the manifest and tokenizer/ (the folder, or its fetched copy)
    format: str  # nsp | packed
    samples: int
    shards: int
    columns: list[str]
    manifest: Optional[BuildManifest]  # build_manifest.json, if present
    cache: Optional[str] = None  # where streaming keeps this source's shards (under the job's cache); None: in place
    hashed: bool = False  # the index lists an xxh64 for every shard file (streaming then checks them)


@dataclass
class DataInfo:
    sources: list[SourceInfo]
    format: str
    max_seq_len: Optional[int]
    tokenizer_dir: Optional[str]  # DATA/tokenizer of the first source that has one
    manifest_vocab_size: Optional[int]
    samples: int = field(init=False)
    verified_bytes: int = 0  # shard bytes hashed up front
    verify_s: float = 0.0

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
        raise ShardError(f"{path}: cannot read the {what} ({e}); rebuild the shards") from e


def _file_info(shard: dict[str, Any], key: str) -> dict[str, Any]:
    return shard.get(key) or {}


def shard_files(folder: Path, shard: dict[str, Any]) -> tuple[Path, Optional[Path]]:
    """(the decompressed file, the compressed file or None) of one index entry, in `folder`."""
    raw, zipped = _file_info(shard, "raw_data"), _file_info(shard, "zip_data")
    return folder / raw.get("basename", "?"), (folder / zipped["basename"]) if zipped.get("basename") else None


def reads_in_place(folder: Path, shards: list[dict[str, Any]]) -> bool:
    """Whether streaming can read a local folder as it is: every shard's decompressed file is there, so
    nothing needs decompressing. Otherwise the compressed files go through the job's cache."""
    return all(shard_files(folder, s)[0].is_file() for s in shards)


def file_hash(path: Path) -> str:
    """The xxh64 of a file's bytes, as the index records it."""
    import xxhash

    h = xxhash.xxh64()
    buf = bytearray(_READ_BLOCK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


def check_shard_file(folder: Path, shard: dict[str, Any], *, in_place: bool, hashes: bool = True) -> int:
    """Raise ShardError naming the shard file streaming will read (the decompressed one when the folder
    is read in place, else the compressed one) when it is missing, or when its size, its MDS header
    (decompressed files) or its xxh64 (with `hashes`) differs from the index. Returns the bytes hashed."""
    raw_path, zip_path = shard_files(folder, shard)
    if in_place or zip_path is None:
        if not raw_path.is_file():
            raise ShardError(f"missing shard {raw_path} (listed in {folder / INDEX}); rebuild the shards")
        path, info = raw_path, _file_info(shard, "raw_data")
    elif zip_path.is_file():
        path, info = zip_path, _file_info(shard, "zip_data")
    else:
        hint = (
            f" (its decompressed {raw_path.name} is there, but not every shard's is, so the job reads the "
            f"compressed files)"
            if raw_path.is_file()
            else ""
        )
        raise ShardError(f"missing shard {zip_path} (listed in {folder / INDEX}){hint}; rebuild the shards")
    size = path.stat().st_size
    if size != info.get("bytes"):
        raise ShardError(
            f"corrupted shard {path}: {size} bytes, the index says {info.get('bytes')}; rebuild the shards"
        )
    if path == raw_path and shard.get("format", "mds") == "mds":
        _check_mds_header(path, samples=int(shard["samples"]), size=size)
    want = (info.get("hashes") or {}).get(HASH)
    if not hashes or want is None:
        return 0
    got = file_hash(path)
    if got != want:
        raise ShardError(
            f"corrupted shard {path}: its {HASH} is {got}, the index says {want} (its bytes changed after the "
            f"build); rebuild the shards or restore the file"
        )
    return size


def _check_mds_header(path: Path, *, samples: int, size: int) -> None:
    """An MDS shard starts with its sample count and the samples' end offsets (uint32 each)."""
    n = samples
    with open(path, "rb") as f:
        head = f.read(4 * (n + 2))
    if len(head) < 4 * (n + 2):
        raise ShardError(f"corrupted shard {path}: too short for {n} samples; rebuild the shards")
    count = int(np.frombuffer(head[:4], np.uint32)[0])
    offsets = np.frombuffer(head[4:], np.uint32)
    if count != n or offsets[0] < 4 * (n + 2) or offsets[-1] != size or np.any(np.diff(offsets.astype(np.int64)) <= 0):
        raise ShardError(
            f"corrupted shard {path}: its header does not match the index ({n} samples, {size} bytes); "
            f"rebuild the shards"
        )


def _fetch_remote(path: str, *, local: str) -> None:
    """The index, the manifest and the builder's tokenizer folder (small files) of remote data, into
    `local`. Per-rank temporary names: several ranks of a node may fetch them at once."""
    from streaming.base.storage.download import CloudDownloader

    wanted = [(INDEX, True), (MANIFEST, False)] + [(f"{TOKENIZER_DIR}/{f}", False) for f in TOKENIZER_FILES]
    for name, needed in wanted:
        dest = Path(local) / name
        if dest.exists():
            continue
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(f"{dest.name}.{os.getpid()}.tmp")
        try:
            CloudDownloader.direct_download(path.rstrip("/") + "/" + name, str(tmp))
            os.replace(tmp, dest)
        except Exception as e:  # the cloud clients raise many types
            tmp.unlink(missing_ok=True)
            if needed:
                raise UsageError(f"--data {path}: cannot fetch {name} ({type(e).__name__}: {e})") from e
    if not has_tokenizer(Path(local) / TOKENIZER_DIR):
        shutil.rmtree(Path(local) / TOKENIZER_DIR, ignore_errors=True)


def _columns(path: str, *, index_path: Path, shards: list[dict[str, Any]]) -> list[str]:
    """The columns every shard of one source declares. Refused before any sample is read: a column that
    would unpickle on read, shards that disagree, a required column missing."""
    for s in shards:
        if pickled := pickled_columns(s):
            raise ShardError(
                f"--data {path}: {index_path} declares column(s) {', '.join(pickled)} for shard "
                f"{_file_info(s, 'raw_data').get('basename')}: reading them would unpickle whatever the shard "
                f"holds (code runs on read), so nothing was read; build the shards with preprocessing/build_shards.py"
            )
    columns = list(shards[0].get("column_names", []))
    for s in shards:
        if list(s.get("column_names", [])) != columns:
            raise ShardError(
                f"{index_path}: shard {s.get('raw_data', {}).get('basename')} has columns "
                f"{s.get('column_names')}, the first shard {columns}; rebuild the shards"
            )
    missing = [c for c in REQUIRED_COLUMNS if c not in columns]
    if missing:
        raise UsageError(
            f"--data {path}: samples lack column(s) {missing} (have {columns}); build them with "
            f"preprocessing/build_shards.py"
        )
    return columns


def _inspect_one(path: str, *, i: int, cache_root: str, verify_files: bool) -> tuple[SourceInfo, int]:
    """One source's SourceInfo, and the bytes hashed to verify its files."""
    remote = path if is_remote(path) else None
    if remote is None:
        folder = Path(path)
        if not folder.is_dir():
            raise UsageError(f"--data {path}: no such folder; build shards with preprocessing/build_shards.py")
        if not (folder / INDEX).is_file():
            raise UsageError(
                f"--data {path}: no {INDEX} in it; is it a shard folder written by preprocessing/build_shards.py?"
            )
        local = str(folder)
    else:
        local = _source_cache(cache_root, i, remote)
        _fetch_remote(path, local=local)
    index_path, manifest_path = Path(local) / INDEX, Path(local) / MANIFEST
    index = _read_json(index_path, "shard index")
    shards = index.get("shards")
    if not isinstance(shards, list):
        raise ShardError(f"{index_path}: no 'shards' list; rebuild the shards")
    samples = sum(int(s.get("samples", 0)) for s in shards)
    if not shards or samples == 0:
        raise UsageError(
            f"--data {path}: the index lists no samples ({len(shards)} shard(s)); the build "
            f"produced nothing (see its rejects.jsonl and {MANIFEST})"
        )
    columns = _columns(path, index_path=index_path, shards=shards)
    hashed = all(
        HASH in (_file_info(s, key).get("hashes") or {})
        for s in shards
        for key in ("raw_data", "zip_data")
        if s.get(key)
    )
    manifest = BuildManifest.read(manifest_path) if manifest_path.is_file() else None
    if manifest is not None and manifest.status != "complete":
        raise UsageError(
            f"--data {path}: its build did not finish ({MANIFEST} status "
            f"{manifest.status!r}); finish it with build_shards.py --resume"
        )
    cache, verified = local if remote else None, 0
    if remote is None:
        in_place = reads_in_place(Path(local), shards)
        if not in_place:
            cache = _source_cache(cache_root, i, str(Path(local).resolve()))
        if verify_files:
            for s in shards:
                verified += check_shard_file(Path(local), s, in_place=in_place)
    info = SourceInfo(
        path=path,
        remote=remote,
        local=local,
        format=format_of(columns),
        samples=samples,
        shards=len(shards),
        columns=columns,
        manifest=manifest,
        cache=cache,
        hashed=hashed,
    )
    return info, verified


def inspect_data(
    paths: Sequence[str], *, cache_root: str, max_seq_len: Optional[int] = None, verify_files: bool = True
) -> DataInfo:
    """Read every --data index and manifest, verify local shard files (`verify_files`), and agree on
    one format, length and vocabulary size.

    Raises UsageError (ShardError for corrupted shards) naming the folder or shard: missing folder or
    index, no samples, columns missing, an unfinished build, a missing or corrupted shard, mixed
    nsp/packed sources, differing max_seq_len or vocabulary sizes.
    """
    if not paths:
        raise UsageError("--data: give at least one shard folder")
    if len(set(paths)) != len(paths):
        raise UsageError(f"--data lists a folder twice: {list(paths)}")
    t0 = time.perf_counter()
    inspected = [_inspect_one(p, i=i, cache_root=cache_root, verify_files=verify_files) for i, p in enumerate(paths)]
    sources = [source for source, _ in inspected]
    formats = {s.format for s in sources}
    if len(formats) > 1:
        listing = ", ".join(f"{s.path} ({s.format})" for s in sources)
        raise UsageError(f"--data mixes shard formats: {listing}; build all of them with the same --format")
    lengths = {s.manifest.max_seq_len for s in sources if s.manifest and s.manifest.max_seq_len is not None}
    if len(lengths) > 1:
        raise UsageError(f"--data folders were built with different --max_seq_len: {sorted(lengths)}")
    data_len = lengths.pop() if lengths else None
    if max_seq_len is not None and data_len is not None and max_seq_len != data_len:
        raise UsageError(
            f"--max_seq_len {max_seq_len} differs from the shards' {data_len} ({MANIFEST}); drop the flag, "
            "the shards decide"
        )
    vocab_sizes = {s.manifest.vocab_size for s in sources if s.manifest and s.manifest.vocab_size is not None}
    if len(vocab_sizes) > 1:
        raise UsageError(
            f"--data folders were tokenized with different vocabularies (sizes {sorted(vocab_sizes)}); "
            f"use one tokenizer for all"
        )
    tok_dir = next(
        (str(Path(s.local) / TOKENIZER_DIR) for s in sources if (Path(s.local) / TOKENIZER_DIR).is_dir()), None
    )
    return DataInfo(
        sources=sources,
        format=formats.pop(),
        max_seq_len=data_len if data_len else max_seq_len,
        tokenizer_dir=tok_dir,
        manifest_vocab_size=vocab_sizes.pop() if vocab_sizes else None,
        verified_bytes=sum(n for _, n in inspected),
        verify_s=time.perf_counter() - t0,
    )
