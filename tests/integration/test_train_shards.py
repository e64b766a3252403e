"""Shards as the trainer finds them: corrupted bytes end the job with exit 2 naming the shard (a
same-size byte flip in a .mds.zstd, a bit flip in an already decompressed .mds), and a read-only
shard folder trains, with nothing written into it."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import zstandard

from tests.support.trainer import (
    REPO,
    deepspeed_cmd,
    explain,
    free_port,
    launch_env,
    one_rank_env,
    shard_sets,
    train_args,
    write_ds_config,
)


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> dict[str, Path]:
    return shard_sets(tmp_path_factory)


def train_once(data: Path, tmp_path: Path) -> subprocess.CompletedProcess:
    ds = write_ds_config(tmp_path / "ds.json", micro=4)
    args = train_args(ds_config=ds, objective="mlm", data=[data], save_dir=tmp_path / "r", max_steps=4)
    return subprocess.run(
        [sys.executable, str(REPO / "pipeline" / "train.py"), *args],
        capture_output=True,
        text=True,
        env=one_rank_env(),
        timeout=400,
    )


def one_error_line(r: subprocess.CompletedProcess) -> str:
    assert r.returncode == 2, explain(r)
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in r.stdout + r.stderr, explain(r)
    return lines[0]


def test_a_byte_flip_in_a_compressed_shard_is_exit_2_naming_it(shards, tmp_path):
    data = shutil.copytree(shards["packed32"], tmp_path / "data")
    shard = sorted(data.glob("part-*/shard.*.mds.zstd"))[0]
    raw = bytearray(shard.read_bytes())
    for k in range(len(raw) // 2, len(raw) // 2 + 4):
        raw[k] ^= 0xA5  # the same size: the size check of old did not see it
    shard.write_bytes(bytes(raw))
    line = one_error_line(train_once(data, tmp_path))
    assert line.startswith(f"train.py: error: corrupted shard {shard}: its xxh64 is "), line
    assert "the index says" in line and "rebuild the shards" in line


def test_a_bit_flip_in_a_decompressed_shard_is_exit_2_naming_it(shards, tmp_path):
    data = shutil.copytree(shards["packed32"], tmp_path / "data")
    # What a run of the old trainer left behind: every shard decompressed beside its .zstd, which
    # streaming then reads in place.
    for z in data.glob("part-*/shard.*.mds.zstd"):
        z.with_suffix("").write_bytes(zstandard.ZstdDecompressor().decompress(z.read_bytes()))
    shard = sorted(data.glob("part-*/shard.*.mds"))[0]
    raw = bytearray(shard.read_bytes())
    raw[-3] ^= 0x01  # one bit of the last sample (a word-start flag): it still decodes, and would train
    shard.write_bytes(bytes(raw))
    line = one_error_line(train_once(data, tmp_path))
    assert line.startswith(f"train.py: error: corrupted shard {shard}: its xxh64 is "), line


# ---------------------------------------------------------------------------------------------------
# Read-only storage
# ---------------------------------------------------------------------------------------------------


def listing(folder: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(folder.rglob("*"))}


def read_only_prefix(folder: Path) -> list[str] | None:
    """A command prefix that runs its command with `folder` mounted read-only (a bind mount in a
    private mount namespace, gone with the command), or None where this machine cannot. Tests run as
    root, who ignores mode bits: only a read-only mount gives what shared storage gives, EROFS."""
    mount = 'mount --bind -o ro "$0" "$0" && exec "$@"'
    prefix = ["unshare", "--mount", "--propagation", "private", "sh", "-c", mount, str(folder)]
    if shutil.which("unshare") is None:
        return None
    probe = subprocess.run([*prefix, "touch", str(folder / "probe")], capture_output=True, text=True)
    if probe.returncode == 0 or (folder / "probe").exists():
        (folder / "probe").unlink(missing_ok=True)
        return None
    return prefix if "Read-only file system" in probe.stderr else None


@pytest.mark.multiproc
def test_a_read_only_shard_folder_trains_and_nothing_is_written_into_it(shards, tmp_path):
    data = shutil.copytree(shards["packed32"], tmp_path / "data")
    assert not list(data.rglob("*.mds")), "the builder writes compressed shards only"
    prefix = read_only_prefix(data)
    if prefix is None:
        pytest.skip("needs `unshare --mount` and `mount --bind -o ro` (root with CAP_SYS_ADMIN) to mount read-only")
    before = listing(data)
    ds = write_ds_config(tmp_path / "ds.json", micro=4)
    args = train_args(
        ds_config=ds,
        objective="mlm",
        data=[data],
        save_dir=tmp_path / "r",
        max_steps=3,
        extra=["--cache_dir", str(tmp_path / "cache")],
    )
    r = subprocess.run(
        [*prefix, *deepspeed_cmd(free_port(), args)],
        cwd=REPO,
        env=launch_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, explain(r)
    assert "done: step 3" in r.stdout
    assert listing(data) == before  # nothing written, nothing decompressed into it
    # The decompressed copies went to the job's cache, one folder per node and attempt.
    assert list((tmp_path / "cache").glob("node0-*/stream0-*/part-*/shard.*.mds"))
