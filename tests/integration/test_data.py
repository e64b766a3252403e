"""Data: up-front checks of shard folders (missing, empty, mixed, corrupted: named), the objective
against the data, the masking collator, and streaming reads (sample ids, mid-epoch resume, a
corrupted sample named by its shard, two "nodes" sharing one host)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from pipeline import objectives
from pipeline.data.collator import MaskingCollator
from pipeline.data.loader import build_loader
from pipeline.data.masking import MaskingSpec
from pipeline.data.shards import ShardError, inspect_data
from tests.support.trainer import REPO, launch_env, shard_sets


@pytest.fixture(scope="session")
def shards(tmp_path_factory) -> dict[str, Path]:
    return shard_sets(tmp_path_factory)


@pytest.fixture(scope="session")
def packed(shards) -> Path:
    return shards["packed32"]


@pytest.fixture(scope="session")
def nsp(shards) -> Path:
    return shards["nsp48"]


def _tok(folder: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder / "tokenizer")


def _collator(
    folder: Path, *, nsp: bool, seed: int = 0, whole_word: bool = False, padding: str = "remove"
) -> MaskingCollator:
    tok = _tok(folder)
    spec = MaskingSpec(
        mask_token_id=tok.mask_token_id,
        special_ids=tuple(tok.all_special_ids),
        vocab_size=len(tok),
        whole_word=whole_word,
    )
    return MaskingCollator(spec=spec, pad_id=tok.pad_token_id, seed=seed, nsp=nsp, max_seq_len=64, padding=padding)


def _copy(src: Path, dest: Path) -> Path:
    shutil.copytree(src, dest)
    return dest


# ---------------------------------------------------------------------------------------------------
# inspect_data
# ---------------------------------------------------------------------------------------------------


def test_inspect_reads_format_length_tokenizer(packed, nsp, tmp_path):
    info = inspect_data([str(packed)], cache_root=str(tmp_path))
    assert info.format == "packed" and info.max_seq_len == 32
    assert info.tokenizer_dir == str(packed / "tokenizer")
    index = json.loads((packed / "index.json").read_text())
    assert info.samples == sum(s["samples"] for s in index["shards"]) > 0
    assert inspect_data([str(nsp)], cache_root=str(tmp_path)).format == "nsp"


def test_missing_folder_and_missing_index(tmp_path):
    with pytest.raises(ValueError, match=r"--data .*nope: no such folder"):
        inspect_data([str(tmp_path / "nope")], cache_root=str(tmp_path))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"no index.json"):
        inspect_data([str(tmp_path / "empty")], cache_root=str(tmp_path))


def test_empty_index_is_refused(tmp_path):
    d = tmp_path / "zero"
    d.mkdir()
    (d / "index.json").write_text(json.dumps({"version": 2, "shards": []}))
    with pytest.raises(ValueError, match=r"lists no samples"):
        inspect_data([str(d)], cache_root=str(tmp_path))


def test_mixed_formats_and_lengths_are_refused(shards, packed, nsp, tmp_path):
    with pytest.raises(ValueError, match=r"mixes shard formats"):
        inspect_data([str(packed), str(nsp)], cache_root=str(tmp_path))
    other = shards["packed16"]
    with pytest.raises(ValueError, match=r"different --max_seq_len: \[16, 32\]"):
        inspect_data([str(packed), str(other)], cache_root=str(tmp_path))


def test_truncated_shard_is_named(packed, tmp_path):
    d = _copy(packed, tmp_path / "cut")
    shard = sorted(d.glob("part-*/shard.*.mds*"))[0]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) - 10])
    rel = shard.relative_to(d)
    with pytest.raises(
        ShardError, match=rf"corrupted shard .*{rel}: {len(data) - 10} bytes, the index says {len(data)}"
    ):
        inspect_data([str(d)], cache_root=str(tmp_path))


def test_corrupted_header_and_missing_shard_are_named(packed, tmp_path):
    import zstandard

    d = _copy(packed, tmp_path / "bad")
    for z in d.glob("part-*/shard.*.mds.zstd"):  # the raw shard, as streaming decompresses it
        z.with_suffix("").write_bytes(zstandard.ZstdDecompressor().decompress(z.read_bytes()))
        z.unlink()
    shard = sorted(d.glob("part-*/shard.*.mds"))[0]
    data = bytearray(shard.read_bytes())
    data[0:4] = np.uint32(999).tobytes()  # the sample count
    shard.write_bytes(bytes(data))
    with pytest.raises(ShardError, match=rf"corrupted shard .*{shard.name}: its header does not match"):
        inspect_data([str(d)], cache_root=str(tmp_path))
    shard.unlink()
    with pytest.raises(ShardError, match=rf"missing shard .*{shard.name}"):
        inspect_data([str(d)], cache_root=str(tmp_path))


def test_objective_against_data():
    assert objectives.get("tacl").check_data(nsp="on", fmt="nsp", paths=["d"]) is True
    with pytest.raises(ValueError, match=r"tacl trains on NSP pairs.*--format nsp.*--nsp off"):
        objectives.get("tacl").check_data(nsp="on", fmt="packed", paths=["d"])
    assert objectives.get("tacl").check_data(nsp="off", fmt="packed", paths=["d"]) is False
    with pytest.raises(ValueError, match=r"taco trains on packed blocks.*--format packed"):
        objectives.get("taco").check_data(nsp="off", fmt="nsp", paths=["d"])
    assert objectives.get("mlm").check_data(nsp="auto", fmt="nsp", paths=["d"]) is True
    assert objectives.get("mlm").check_data(nsp="auto", fmt="packed", paths=["d"]) is False


# ---------------------------------------------------------------------------------------------------
# Collator
# ---------------------------------------------------------------------------------------------------


def _samples(rows: list[list[int]], *, nsp: bool = False) -> list[dict]:
    out = []
    for i, ids in enumerate(rows):
        s = {
            "input_ids": np.asarray(ids, np.uint16),
            "token_type_ids": np.zeros(len(ids), np.uint8),
            "word_starts": np.ones(len(ids), np.uint8),
            "sample_id": 100 + i,
            "epoch": 0,
        }
        if nsp:
            s["nsp_label"] = i % 2
        out.append(s)
    return out


def test_collator_pads_to_the_longest_and_aligns_labels(nsp):
    col = _collator(nsp, nsp=True, padding="keep")
    tok = _tok(nsp)
    rows = [tok("the big cat sees the dog in the park .")["input_ids"], tok("the fox .")["input_ids"]]
    b = col(_samples(rows, nsp=True))
    L = max(map(len, rows))
    assert b["input_ids"].shape == (2, L)  # the longest of the batch, not max_seq_len
    assert b["attention_mask"].tolist() == [[1] * len(r) + [0] * (L - len(r)) for r in rows]
    assert (b["original_ids"][1, len(rows[1]) :] == tok.pad_token_id).all()
    masked = b["masked"]
    assert not masked[b["attention_mask"] == 0].any()
    # mlm_labels are the original ids at the masked positions, row-major (the head's gather order).
    assert b["mlm_labels"].tolist() == b["original_ids"][masked].tolist()
    assert (b["input_ids"][~masked] == b["original_ids"][~masked]).all()
    assert b["nsp_labels"].tolist() == [0, 1] and b["sample_ids"].tolist() == [100, 101]
    # Masking is a function of (seed, epoch, sample id): the same batch again, the same masks.
    again = col(_samples(rows, nsp=True))
    assert torch.equal(again["input_ids"], b["input_ids"])
    shuffled = col(list(reversed(_samples(rows, nsp=True))))
    assert torch.equal(shuffled["input_ids"][1, : len(rows[0])], b["input_ids"][0, : len(rows[0])])


def test_unpadded_layout_is_the_padded_batch_without_its_pads(nsp):
    tok = _tok(nsp)
    rows = [tok("the big cat sees the dog in the park .")["input_ids"], tok("the fox .")["input_ids"]]
    padded = _collator(nsp, nsp=True, padding="keep")(_samples(rows, nsp=True))
    b = _collator(nsp, nsp=True)(_samples(rows, nsp=True))
    assert b["layout"] == "unpadded" and padded["layout"] == "padded"
    real = padded["attention_mask"].bool()
    # One [T] stream of the real tokens, split by cu_seqlens, with the same masks as the padded batch.
    assert b["input_ids"].tolist() == padded["input_ids"][real].tolist()
    assert b["original_ids"].tolist() == padded["original_ids"][real].tolist()
    assert b["cu_seqlens"].tolist() == [0, len(rows[0]), len(rows[0]) + len(rows[1])]
    assert b["position_ids"].tolist() == list(range(len(rows[0]))) + list(range(len(rows[1])))
    assert b["masked_index"].shape == b["mlm_labels"].shape
    assert b["original_ids"][b["masked_index"]].tolist() == b["mlm_labels"].tolist() == padded["mlm_labels"].tolist()
    assert b["num_sequences"] == 2 and b["num_tokens"] == sum(map(len, rows))


def test_collator_refuses_overlong_samples(nsp):
    col = _collator(nsp, nsp=False)
    with pytest.raises(ShardError, match=r"sample 100 has 70 tokens, more than max_seq_len 64"):
        col(_samples([[2] + [10] * 68 + [3]]))


# ---------------------------------------------------------------------------------------------------
# Streaming reads (single process)
# ---------------------------------------------------------------------------------------------------


def _loader(
    folder: Path, *, micro: int = 4, workers: int = 0, vocab: int | None = None, nsp: bool = False, verify: bool = True
):
    info = inspect_data([str(folder)], cache_root=str(folder.parent / "cache"), verify_files=verify)
    tok = _tok(folder)
    return build_loader(
        info,
        weights=None,
        micro_batch=micro,
        collator=_collator(folder, nsp=nsp),
        vocab_size=vocab or len(tok),
        seed=0,
        num_workers=workers,
        num_canonical_nodes=1,
        run_id="unit",
        pin_memory=False,
    )


def test_loader_yields_every_sample_once_per_epoch(packed):
    loader = _loader(packed, workers=1)
    ids = [i for b in loader for i in b["sample_ids"].tolist()]
    n = inspect_data([str(packed)], cache_root=str(packed.parent / "cache")).samples
    assert sorted(ids) == list(range(n))
    second = [i for b in loader for i in b["sample_ids"].tolist()]
    assert sorted(second) == list(range(n)) and second != ids  # a new shuffle each epoch


@pytest.mark.parametrize("fmt", ["packed", "nsp"])
def test_mapped_reads_decode_every_sample_as_streaming_does(shards, fmt, tmp_path):
    """The loader reads samples from a memory map with coders built once (pipeline.data.loader):
    every column of every sample equals what streaming's own reader decodes."""
    from streaming import StreamingDataset

    folder = shards["packed32" if fmt == "packed" else "nsp48"]
    ours = _loader(folder, nsp=fmt == "nsp").dataset
    # streaming decompresses into its local folder: a copy, not the session's shards.
    theirs = StreamingDataset(local=str(_copy(folder, tmp_path / "plain")), shuffle=False, batch_size=1)
    assert all("get_sample_data" in vars(s) for s in ours.shards)  # the mapped path, not streaming's
    for i in range(len(theirs)):
        a, b = ours.get_item(i), theirs.get_item(i)
        assert set(a) - {"sample_id", "epoch"} == set(b)
        for k, v in b.items():
            assert np.array_equal(a[k], v) if isinstance(v, np.ndarray) else a[k] == v, (i, k)


def test_loader_state_resumes_mid_epoch(packed):
    loader = _loader(packed)
    full = [b["sample_ids"].tolist() for b in loader]
    loader = _loader(packed)
    it = iter(loader)
    first = [next(it)["sample_ids"].tolist() for _ in range(3)]
    state = loader.state_dict()
    del it
    resumed = _loader(packed)
    resumed.load_state_dict(state)
    rest = [b["sample_ids"].tolist() for b in resumed]
    assert first + rest == full


def test_sample_outside_the_vocabulary_names_its_shard(packed, tmp_path):
    # A shard that decodes but holds ids beyond the vocabulary (a different tokenizer, or bit rot).
    loader = _loader(packed, vocab=10)
    with pytest.raises(
        ShardError,
        match=r"corrupted shard .*part-0000\d/shard\.\d+\.mds: sample \d+: token id \d+ >= the vocabulary size 10",
    ):
        next(iter(loader))


@pytest.mark.parametrize("workers", [0, 1])
def test_a_compressed_shard_that_fails_its_hash_is_named_as_streaming_reads_it(packed, tmp_path, workers):
    # Pre-flight hashes every local file; this is the check behind it, for remote data and for a
    # file changed after pre-flight: streaming verifies each .zstd as it fetches and decompresses it.
    d = _copy(packed, tmp_path / "flipped")
    shard = sorted(d.glob("part-*/shard.*.mds.zstd"))[-1]
    raw = bytearray(shard.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    shard.write_bytes(bytes(raw))
    with pytest.raises(ShardError, match=rf"corrupted shard {shard}: its xxh64 is \w+, the index says"):
        inspect_data([str(d)], cache_root=str(tmp_path / "c0"))  # pre-flight says it first...
    loader = _loader(d, workers=workers, verify=False)
    with pytest.raises(ShardError, match=rf"corrupted shard {shard}: cannot prepare it \(its xxh64 differs"):
        for _ in loader:  # ...and streaming, had pre-flight not looked
            pass


def test_compressed_shards_are_decompressed_into_the_cache_not_the_data_folder(packed, tmp_path):
    d = _copy(packed, tmp_path / "data")
    before = sorted((str(p.relative_to(d)), p.stat().st_size) for p in d.rglob("*"))
    loader = _loader(d, workers=1)
    ids = [i for b in loader for i in b["sample_ids"].tolist()]
    assert sorted(ids) == list(range(inspect_data([str(d)], cache_root=str(tmp_path)).samples))
    assert sorted((str(p.relative_to(d)), p.stat().st_size) for p in d.rglob("*")) == before
    cached = Path(loader.dataset.streams[0].local)
    assert cached.is_relative_to(tmp_path / "cache") and cached.parent.name.startswith("node0-")
    assert len(list(cached.glob("part-*/shard.*.mds"))) == len(list(d.glob("part-*/shard.*.mds.zstd")))
    assert not list(cached.glob("part-*/shard.*.mds.zstd"))  # the copies are dropped once decompressed


# ---------------------------------------------------------------------------------------------------
# Two "nodes" on one host: streaming's shared-memory names must not collide
# ---------------------------------------------------------------------------------------------------

_TWO_NODE_SCRIPT = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    from pipeline import distributed
    from pipeline.data.collator import MaskingCollator
    from pipeline.data.loader import build_loader
    from pipeline.data.shards import inspect_data
    from pipeline.data.masking import MaskingSpec
    from transformers import AutoTokenizer
    folder = Path(sys.argv[1])
    distributed.init_process_group(backend="gloo", timeout_s=60)
    tok = AutoTokenizer.from_pretrained(folder / "tokenizer")
    spec = MaskingSpec(mask_token_id=tok.mask_token_id, special_ids=tuple(tok.all_special_ids), vocab_size=len(tok))
    col = MaskingCollator(spec=spec, pad_id=tok.pad_token_id, seed=0, nsp=False, max_seq_len=64)
    info = inspect_data([str(folder)], cache_root=sys.argv[2])
    loader = build_loader(info, weights=None, micro_batch=2, collator=col, vocab_size=len(tok), seed=0,
                          num_workers=1, num_canonical_nodes=2, run_id="twonode", pin_memory=False)
    ids = [i for b in loader for i in b["sample_ids"].tolist()]
    print("IDS " + json.dumps(ids), flush=True)
    distributed.barrier()
""")


@pytest.mark.multiproc
def test_two_nodes_on_one_host_read_disjoint_halves(packed, tmp_path, port):
    script = tmp_path / "two_nodes.py"
    script.write_text(_TWO_NODE_SCRIPT)
    procs = []
    for r in range(2):
        env = launch_env(
            RANK=str(r),
            LOCAL_RANK="0",
            WORLD_SIZE="2",
            LOCAL_WORLD_SIZE="1",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
        )
        # Files, not pipes: a rank blocked on a full pipe would hold the other at a barrier.
        out, err = open(tmp_path / f"out{r}", "w"), open(tmp_path / f"err{r}", "w")
        procs.append(
            subprocess.Popen(
                [sys.executable, str(script), str(packed), str(tmp_path / "cache")],
                cwd=REPO,
                env=env,
                stdout=out,
                stderr=err,
            )
        )
    for r, p in enumerate(procs):
        assert p.wait(timeout=180) == 0, (tmp_path / f"err{r}").read_text()[-3000:]
    outs = [(tmp_path / f"out{r}").read_text() for r in range(2)]
    ids = [json.loads(next(line for line in out.splitlines() if line.startswith("IDS "))[4:]) for out in outs]
    n = inspect_data([str(packed)], cache_root=str(tmp_path)).samples
    assert not set(ids[0]) & set(ids[1])
    assert set(ids[0]) | set(ids[1]) == set(range(n))


# ---------------------------------------------------------------------------------------------------
# Remote shards (a real S3 API: moto's server on 127.0.0.1)
# ---------------------------------------------------------------------------------------------------


def test_remote_shards_stream_through_a_per_job_cache(packed, tmp_path, monkeypatch, port):
    import boto3
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        for key, value in {
            "S3_ENDPOINT_URL": f"http://127.0.0.1:{port}",
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
        }.items():
            monkeypatch.setenv(key, value)
        s3 = boto3.client("s3", endpoint_url=f"http://127.0.0.1:{port}")
        s3.create_bucket(Bucket="data")
        for f in packed.rglob("*"):
            if f.is_file() and not f.name.endswith(".mds") and f.name != ".done":  # what the builder uploads
                s3.upload_file(str(f), "data", f"en/{f.relative_to(packed)}")
        cache = tmp_path / "job-cache"
        info = inspect_data(["s3://data/en"], cache_root=str(cache))
        local = inspect_data([str(packed)], cache_root=str(tmp_path))
        assert (info.format, info.samples, info.max_seq_len) == (local.format, local.samples, local.max_seq_len)
        src = info.sources[0]
        assert src.remote == "s3://data/en" and Path(src.local).is_relative_to(cache)
        # The builder's tokenizer came along, so --tokenizer may default to it for remote data too.
        assert info.tokenizer_dir == str(Path(src.local) / "tokenizer")
        tok = _tok(Path(src.local))
        loader = build_loader(
            info,
            weights=None,
            micro_batch=4,
            collator=_collator(Path(src.local), nsp=False),
            vocab_size=len(tok),
            seed=0,
            num_workers=0,
            num_canonical_nodes=1,
            run_id="remote",
            pin_memory=False,
        )
        ids = [i for b in loader for i in b["sample_ids"].tolist()]
        assert sorted(ids) == list(range(info.samples))
        # The shards were downloaded into this run's own folder of the job's cache.
        attempt = Path(loader.dataset.streams[0].local)
        assert attempt.parent.name.startswith("node0-") and attempt.is_relative_to(cache)
        assert list(attempt.glob("part-*/shard.*"))
    finally:
        server.stop()


def test_remote_without_index_is_named(tmp_path, monkeypatch, port):
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        for key, value in {
            "S3_ENDPOINT_URL": f"http://127.0.0.1:{port}",
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
        }.items():
            monkeypatch.setenv(key, value)
        import boto3

        boto3.client("s3", endpoint_url=f"http://127.0.0.1:{port}").create_bucket(Bucket="empty")
        with pytest.raises(ValueError, match=r"--data s3://empty/x: cannot fetch index.json"):
            inspect_data(["s3://empty/x"], cache_root=str(tmp_path))
    finally:
        server.stop()


def test_an_unfinished_build_is_refused(packed, tmp_path):
    d = _copy(packed, tmp_path / "unfinished")
    manifest = json.loads((d / "build_manifest.json").read_text())
    (d / "build_manifest.json").write_text(json.dumps({**manifest, "status": "running"}))
    with pytest.raises(ValueError, match=r"its build did not finish .*'running'.*--resume"):
        inspect_data([str(d)], cache_root=str(tmp_path))
