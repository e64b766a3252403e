"""The shard folders a job trains on (local or remote), checked up front.

`inspect_data` reads only index files (and, for local folders, each shard's header) so that a
missing, empty, mixed-format or corrupted dataset fails before any process group or device work.
The folder layout and columns are the builder's contract, preprocessing.shard_format.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import numpy as np

from preprocessing.errors import UsageError

FORMATS = ("nsp", "packed")
# What a builder's DATA/tokenizer/ holds (an HF fast tokenizer folder); fetched for remote data.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt")
REQUIRED_COLUMNS = ("input_ids", "token_type_ids", "word_starts")


class ShardError(UsageError):
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
        raise ShardError(f"{path}: cannot read the {what} ({e}); rebuild the shards") from e


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
                raise ShardError(
                    f"corrupted shard {zip_path}: {zip_path.stat().st_size} bytes, the index says "
                    f"{zipped.get('bytes')}; rebuild the shards"
                )
            return
        raise ShardError(f"missing shard {raw_path} (listed in {folder / 'index.json'}); rebuild the shards")
    size = raw_path.stat().st_size
    if size != raw.get("bytes"):
        raise ShardError(
            f"corrupted shard {raw_path}: {size} bytes, the index says {raw.get('bytes')}; rebuild the shards"
        )
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
        raise ShardError(
            f"corrupted shard {raw_path}: its header does not match the index ({n} samples, "
            f"{raw.get('bytes')} bytes); rebuild the shards"
        )


def _inspect_one(path: str, *, i: int, cache_root: str, verify_files: bool) -> SourceInfo:
    remote = path if is_remote(path) else None
    if remote is None:
        folder = Path(path)
        if not folder.is_dir():
            raise UsageError(f"--data {path}: no such folder; build shards with preprocessing/build_shards.py")
        index_path = folder / "index.json"
        if not index_path.is_file():
            raise UsageError(
                f"--data {path}: no index.json in it; is it a shard folder written by preprocessing/build_shards.py?"
            )
        local = str(folder)
        manifest_path = folder / "build_manifest.json"
    else:
        from streaming.base.storage.download import CloudDownloader

        local = _source_cache(cache_root, i, remote)
        index_path = Path(local) / "index.json"
        manifest_path = Path(local) / "build_manifest.json"
        # The index, the manifest and the builder's tokenizer folder (small files). Per-rank
        # temporary names: several ranks of a node may fetch them at once.
        wanted = [("index.json", True), ("build_manifest.json", False)] + [
            (f"tokenizer/{f}", False) for f in TOKENIZER_FILES
        ]
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
                    raise UsageError(f"--data {path}: cannot fetch {name} ({type(e).__name__}: {e})") from e
        if not any((Path(local) / "tokenizer" / f).exists() for f in ("tokenizer.json", "vocab.txt")):
            shutil.rmtree(Path(local) / "tokenizer", ignore_errors=True)
    index = _read_json(index_path, "shard index")
    shards = index.get("shards")
    if not isinstance(shards, list):
        raise ShardError(f"{index_path}: no 'shards' list; rebuild the shards")
    samples = sum(int(s.get("samples", 0)) for s in shards)
    if not shards or samples == 0:
        raise UsageError(
            f"--data {path}: the index lists no samples ({len(shards)} shard(s)); the build "
            f"produced nothing (see its rejects.jsonl and build_manifest.json)"
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
    fmt = "nsp" if "nsp_label" in columns else "packed"
    if remote is None and verify_files:
        for s in shards:
            check_shard_file(Path(local), s)
    manifest = _read_json(manifest_path, "build manifest") if manifest_path.is_file() else None
    if manifest is not None and manifest.get("status", "complete") != "complete":
        raise UsageError(
            f"--data {path}: its build did not finish (build_manifest.json status "
            f"{manifest.get('status')!r}); finish it with build_shards.py --resume"
        )
    return SourceInfo(
        path=path,
        remote=remote,
        local=local,
        format=fmt,
        samples=samples,
        shards=len(shards),
        columns=columns,
        manifest=manifest,
    )


def inspect_data(
    paths: Sequence[str], *, cache_root: str, max_seq_len: Optional[int] = None, verify_files: bool = True
) -> DataInfo:
    """Read every --data index (and local shard headers) and agree on one format and length.

    Raises ValueError (ShardError for corrupted shards) naming the folder/shard: missing folder or
    index, no samples, columns missing, mixed nsp/packed sources, differing max_seq_len.
    """
    if not paths:
        raise UsageError("--data: give at least one shard folder")
    if len(set(paths)) != len(paths):
        raise UsageError(f"--data lists a folder twice: {list(paths)}")
    sources = [_inspect_one(p, i=i, cache_root=cache_root, verify_files=verify_files) for i, p in enumerate(paths)]
    formats = {s.format for s in sources}
    if len(formats) > 1:
        listing = ", ".join(f"{s.path} ({s.format})" for s in sources)
        raise UsageError(f"--data mixes shard formats: {listing}; build all of them with the same --format")
    lengths = {
        int(s.manifest["config"]["max_seq_len"])
        for s in sources
        if s.manifest and "max_seq_len" in s.manifest.get("config", {})
    }
    if len(lengths) > 1:
        raise UsageError(f"--data folders were built with different --max_seq_len: {sorted(lengths)}")
    data_len = lengths.pop() if lengths else None
    if max_seq_len is not None and data_len is not None and max_seq_len != data_len:
        raise UsageError(
            f"--max_seq_len {max_seq_len} differs from the shards' {data_len} "
            f"(build_manifest.json); drop the flag, the shards decide"
        )
    vocab_sizes = {
        int(s.manifest["tokenizer"]["vocab_size"])
        for s in sources
        if s.manifest and "vocab_size" in s.manifest.get("tokenizer", {})
    }
    if len(vocab_sizes) > 1:
        raise UsageError(
            f"--data folders were tokenized with different vocabularies (sizes {sorted(vocab_sizes)}); "
            f"use one tokenizer for all"
        )
    tok_dir = None
    for s in sources:
        if (Path(s.local) / "tokenizer").is_dir():
            tok_dir = str(Path(s.local) / "tokenizer")
            break
    return DataInfo(
        sources=sources,
        format=formats.pop(),
        max_seq_len=data_len if data_len else max_seq_len,
        tokenizer_dir=tok_dir,
        manifest_vocab_size=vocab_sizes.pop() if vocab_sizes else None,
    )


def check_objective_against_data(objective: str, *, nsp: str, fmt: str, paths: Sequence[str]) -> bool:
    """Whether NSP runs, after checking the objective against the shard format.

    TaCL trains on NSP pairs (MLM + NSP + TaCL); it refuses packed shards unless --nsp off. TACO's
    positives and negatives assume packed blocks without padding; it refuses nsp shards.
    """
    where = ", ".join(paths)
    if objective == "tacl" and fmt != "nsp" and nsp != "off":
        raise UsageError(
            f"--objective tacl trains on NSP pairs, but --data {where} holds {fmt} shards: build "
            f"them with --format nsp, or pass --nsp off to run TaCL without NSP"
        )
    if objective == "taco" and fmt != "packed":
        raise UsageError(
            f"--objective taco trains on packed blocks, but --data {where} holds {fmt} shards: "
            f"build them with --format packed"
        )
    if nsp == "on" and fmt != "nsp":
        raise UsageError(f"--nsp on needs nsp shards, but --data {where} holds {fmt} shards")
    return fmt == "nsp" and nsp != "off"


# ---------------------------------------------------------------------------------------------------
