"""MDS output: a sample encoder specialised to the contract's columns, and the shard writers (the
columns, compression, hashes and size limit are preprocessing.shard_format's).

A chunk task writes thousands of samples per MB of text, and `import streaming` alone costs a Ray
worker ~4 s and ~1 GB (it imports torch, torchvision and transformers). So:
- `LocalMDSWriter` writes local MDS part folders with no streaming import: the same shard files
  (`shard.NNNNN.mds.zstd`, MDS joint-shard layout, zstd level 3, xxh64) and the same `index.json`
  as `streaming.MDSWriter`, byte for byte (a test writes both and compares every file), and
  `StreamingDataset` reads them.
- With `--remote`, `make_fast_writer_class()` gives `streaming.MDSWriter` itself (its uploader
  does the remote I/O) with the same specialised `encode_sample`.
`SampleEncoder` is the one encoder both use: 1-D arrays of a fixed dtype, ints and short strings,
the same bytes as streaming's generic encoder at a fraction of the per-sample Python cost.
"""

from __future__ import annotations

import json
import os
import struct
from typing import Any

import numpy as np

from preprocessing.shard_format import COMPRESSION, HASH, HASHES, INDEX, MDS_VERSION, SIZE_LIMIT_BYTES

_ZSTD_LEVEL = 3  # streaming's default for "zstd"


def _shape_header(n: int) -> bytes:
    """NDArray's dynamic-shape header for a 1-D array of n elements: (ndim << 2 | shape dtype
    code), then n in the smallest unsigned type that holds it."""
    if n < (1 << 8):
        return bytes([(1 << 2) | 0]) + struct.pack("<B", n)
    if n < (1 << 16):
        return bytes([(1 << 2) | 1]) + struct.pack("<H", n)
    return bytes([(1 << 2) | 2]) + struct.pack("<I", n)


class SampleEncoder:
    """Encodes a sample dict into an MDS sample record for fixed columns (sorted by name, as
    streaming orders them): a uint32 size per variable-size column, then the data."""

    def __init__(self, columns: dict[str, str]):
        self.column_names = sorted(columns)
        self.column_encodings = [columns[n] for n in self.column_names]
        # Only `int` (8 bytes) has a fixed size among the encodings we write.
        self.column_sizes = [8 if e == "int" else None for e in self.column_encodings]
        kinds = []
        for name, encoding in zip(self.column_names, self.column_encodings):
            if encoding.startswith("ndarray:") and encoding.count(":") == 1:
                kinds.append((name, "ndarray", np.dtype(encoding.split(":")[1])))
            elif encoding in ("str", "int"):
                kinds.append((name, encoding, None))
            else:
                raise ValueError(f"the MDS sample encoder does not encode column {name}: {encoding}")
        self._kinds = kinds

    def encode(self, sample: dict[str, Any]) -> bytes:
        sizes, parts = [], []
        for name, kind, dtype in self._kinds:
            value = sample[name]
            if kind == "ndarray":
                if value.dtype != dtype or value.ndim != 1 or value.size == 0:
                    raise ValueError(
                        f"column {name}: expected a non-empty 1-D {dtype} array, "
                        f"got {value.dtype} with shape {value.shape}"
                    )
                datum = _shape_header(value.size) + value.tobytes()
                sizes.append(len(datum))
            elif kind == "str":
                datum = value.encode("utf-8")
                sizes.append(len(datum))
            else:
                datum = struct.pack("<q", value)
            parts.append(datum)
        return struct.pack(f"<{len(sizes)}I", *sizes) + b"".join(parts)


class LocalMDSWriter:
    """A local MDS dataset writer equivalent to `streaming.MDSWriter(out=local, compression="zstd",
    hashes=["xxh64"], size_limit="64mb")`, without importing streaming. Use as a context manager;
    `shards` holds the index entries."""

    def __init__(self, *, out: str, columns: dict[str, str], size_limit: int = SIZE_LIMIT_BYTES):
        self.local = out
        os.makedirs(out, exist_ok=True)
        self.encoder = SampleEncoder(columns)
        self.size_limit = size_limit
        self.config = {
            "version": MDS_VERSION,
            "format": "mds",
            "compression": COMPRESSION,
            "hashes": list(HASHES),
            "size_limit": size_limit,
            "column_names": self.encoder.column_names,
            "column_encodings": self.encoder.column_encodings,
            "column_sizes": self.encoder.column_sizes,
        }
        self.config_data = json.dumps(self.config, sort_keys=True).encode("utf-8")
        # Shard size accounting as streaming's: a 4-byte count, a 4-byte end offset and the config
        # per shard, a 4-byte offset per sample.
        self._per_shard = 4 + 4 + len(self.config_data)
        self.shards: list[dict] = []
        self._samples: list[bytes] = []
        self._size = self._per_shard

    def write(self, sample: dict[str, Any]) -> None:
        record = self.encoder.encode(sample)
        if self._samples and self.size_limit < self._size + len(record) + 4:
            self._flush()
        self._samples.append(record)
        self._size += len(record) + 4

    def _flush(self) -> None:
        import xxhash
        import zstd

        n = len(self._samples)
        sizes = np.fromiter(map(len, self._samples), dtype=np.int64, count=n)
        offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.uint32)
        offsets += 4 + 4 * (n + 1) + len(self.config_data)
        raw = np.uint32(n).tobytes() + offsets.tobytes() + self.config_data + b"".join(self._samples)
        zipped = zstd.compress(raw, _ZSTD_LEVEL)
        raw_name = f"shard.{len(self.shards):05}.mds"
        zip_name = f"{raw_name}.zstd"
        with open(os.path.join(self.local, zip_name), "wb") as f:
            f.write(zipped)
        entry = {
            "samples": n,
            "raw_data": {"basename": raw_name, "bytes": len(raw), "hashes": {HASH: xxhash.xxh64(raw).hexdigest()}},
            "zip_data": {
                "basename": zip_name,
                "bytes": len(zipped),
                "hashes": {HASH: xxhash.xxh64(zipped).hexdigest()},
            },
        }
        entry.update(
            {
                k: self.config[k]
                for k in (
                    "version",
                    "format",
                    "compression",
                    "hashes",
                    "size_limit",
                    "column_names",
                    "column_encodings",
                    "column_sizes",
                )
            }
        )
        self.shards.append(entry)
        self._samples, self._size = [], self._per_shard

    def __enter__(self) -> LocalMDSWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            return
        if self._samples:
            self._flush()
        with open(os.path.join(self.local, INDEX), "w") as f:
            json.dump({"version": MDS_VERSION, "shards": self.shards}, f, sort_keys=True)


def merge_local_indexes(out: str, part_names: list[str]) -> int:
    """OUT/index.json over the part folders' own index.json files, each shard's file names
    prefixed with its part folder: what `streaming.base.util.merge_index` writes for local parts,
    without importing streaming. Returns the number of shards."""
    shards = []
    for name in part_names:
        with open(os.path.join(out, name, INDEX)) as f:
            part = json.load(f)
        for shard in part["shards"]:
            for key in ("raw_data", "zip_data", "raw_meta", "zip_meta"):
                if shard.get(key):
                    shard[key]["basename"] = f"{name}/{shard[key]['basename']}"
            shards.append(shard)
    tmp = os.path.join(out, INDEX + ".tmp")
    with open(tmp, "w") as f:
        json.dump({"version": MDS_VERSION, "shards": shards}, f)
    os.replace(tmp, os.path.join(out, INDEX))
    return len(shards)


def make_fast_writer_class():
    """`streaming.MDSWriter` with `SampleEncoder`; for remote output only (it imports streaming,
    which costs seconds)."""
    from streaming import MDSWriter

    class FastMDSWriter(MDSWriter):
        def __init__(self, **kwargs: Any):
            super().__init__(**kwargs)
            self._encoder = SampleEncoder(self.columns)

        def encode_sample(self, sample: dict[str, Any]) -> bytes:
            return self._encoder.encode(sample)

    return FastMDSWriter
