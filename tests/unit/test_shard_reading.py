"""Shard folders as every reader opens them (pipeline.data: inspect_data, then open_dataset): a column
that would unpickle on read is refused before any sample is read; the analysis reads shards as the
trainer does, verified, and decompresses them outside the data folder (issue 31)."""

from __future__ import annotations

import pathlib
from pathlib import Path

import numpy as np
import pytest

from pipeline.data.shards import ShardError, inspect_data


class _Touch:
    """Unpickling this creates a file: proof that a reader ran code from the shard."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return (pathlib.Path.touch, (self.path,))


def write_mds(
    folder: Path, *, extra: dict[str, str] | None = None, values: dict | None = None, n: int = 4, **writer
) -> Path:
    """A small packed MDS folder with streaming's own writer (`writer`: its compression, hashes...);
    `extra` columns (name -> encoding) get `values[name]` in every sample."""
    from streaming import MDSWriter

    columns = {"input_ids": "ndarray:uint16", "token_type_ids": "ndarray:uint8", "word_starts": "ndarray:uint8"}
    columns.update(extra or {})
    with MDSWriter(out=str(folder), columns=columns, **writer) as w:
        for i in range(n):
            ids = np.array([2, 5 + i, 6, 3], np.uint16)
            w.write(
                {
                    "input_ids": ids,
                    "token_type_ids": np.zeros(4, np.uint8),
                    "word_starts": np.ones(4, np.uint8),
                    **(values or {}),
                }
            )
    return folder


def test_a_pickled_column_is_refused_before_any_sample_is_read(tmp_path):
    marker = tmp_path / "code-ran"
    data = write_mds(tmp_path / "data", extra={"meta": "pkl"}, values={"meta": _Touch(marker)})
    with pytest.raises(ShardError) as e:
        inspect_data([str(data)], cache_root=str(tmp_path / "cache"))
    msg = str(e.value)
    assert f"--data {data}: {data / 'index.json'} declares column(s) meta (pkl)" in msg
    assert "would unpickle" in msg and "nothing was read" in msg
    assert not marker.exists()


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _read(data: Path):
    from pipeline.evaluation.representation.inputs import read_mds_sequences

    return read_mds_sequences(data, special_ids={0, 2, 3}, max_sequences=3, vocab_size=16)


def test_analysis_refuses_a_corrupted_shard_naming_it(tmp_path):
    """A changed token in a hashed shard used to change the analysis's numbers, exit 0."""
    data = write_mds(tmp_path / "data", hashes=["xxh64"])
    seqs, _ = _read(data)
    assert [s.input_ids for s in seqs] == [[2, 5, 6, 3], [2, 6, 6, 3], [2, 7, 6, 3]]
    shard = data / "shard.00000.mds"
    raw = bytearray(shard.read_bytes())
    at = raw.rindex(bytes([7, 0, 6, 0]))  # sample 2's token 7 (uint16, little-endian)
    raw[at] = 9
    shard.write_bytes(bytes(raw))
    with pytest.raises(ShardError, match=f"corrupted shard {shard}: its xxh64 is"):
        _read(data)


def test_analysis_decompresses_outside_a_read_only_data_folder(tmp_path):
    """`.mds.zstd` shards used to be decompressed into the data folder: a traceback when it is
    read-only, and files written into it otherwise."""
    data = write_mds(tmp_path / "data", compression="zstd", hashes=["xxh64"])
    assert sorted(p.name for p in data.iterdir()) == ["index.json", "shard.00000.mds.zstd"]
    before = _tree(data)
    data.chmod(0o555)
    try:
        seqs, stats = _read(data)
    finally:
        data.chmod(0o755)
    assert [s.input_ids for s in seqs] == [[2, 5, 6, 3], [2, 6, 6, 3], [2, 7, 6, 3]]
    assert stats.skipped == {"beyond_max_sequences": 1}
    assert _tree(data) == before


def test_benchmarks_reuse_only_shards_the_trainer_would_accept(tmp_path):
    """The benchmarks reused any folder with an index.json, a corrupted or unfinished one included."""
    from pipeline.bench.common import reusable_shards

    good, bad = write_mds(tmp_path / "good", hashes=["xxh64"]), write_mds(tmp_path / "bad", hashes=["xxh64"])
    assert reusable_shards([good, bad])
    shard = bad / "shard.00000.mds"
    shard.write_bytes(shard.read_bytes()[:-1] + b"\x00")
    assert not reusable_shards([good, bad])
    assert not reusable_shards([good, tmp_path / "never-built"])
