"""Shard folders as every reader opens them (pipeline.data.shards): a column that would unpickle on read
is refused before any sample is read (issue 31)."""

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


def write_mds(folder: Path, *, extra: dict[str, str] | None = None, values: dict | None = None, n: int = 4) -> Path:
    """A small packed MDS folder with streaming's own writer; `extra` columns (name -> encoding)
    get `values[name]` in every sample."""
    from streaming import MDSWriter

    columns = {"input_ids": "ndarray:uint16", "token_type_ids": "ndarray:uint8", "word_starts": "ndarray:uint8"}
    columns.update(extra or {})
    with MDSWriter(out=str(folder), columns=columns) as w:
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
