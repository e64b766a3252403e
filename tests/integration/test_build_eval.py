"""The held-out split (--eval_share) end to end on real Ray (loopback) and real MDS files: which
documents are held out (a reference reimplementation of the rule), the same with 1 and 2 workers and
with other chunks, never in a training sample, counted, and OUTPUT/eval a shard folder of its own
that the training folder's index does not list; --resume redoes a chunk whose held-out part is
missing, and refuses another --eval_share."""

import hashlib
import json

import pytest
import xxhash

from pipeline.data.shards import inspect_data
from preprocessing.builder import build_shards
from preprocessing.errors import UsageError
from preprocessing.report import format_summary
from preprocessing.text import clean_text, split_sentences
from tests.support.builder import config, ray_on_loopback, read_samples, shard_hashes, small_corpus, squash

pytestmark = pytest.mark.multiproc
SEED, SHARE = 3, 0.25


@pytest.fixture(scope="module")
def ray_here():
    yield from ray_on_loopback()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return small_corpus(tmp_path_factory.mktemp("corpus"))


def picked(docs: list[list[str]], *, seed: int, share: float) -> set[int]:
    """The documents the rule holds out, written here from its description: xxh3-64 of the lines
    joined by newlines, keyed by sha256("eval:SEED")'s first 8 bytes, below share * 2**64."""
    key = int.from_bytes(hashlib.sha256(f"eval:{seed}".encode()).digest()[:8], "little")
    return {
        i
        for i, lines in enumerate(docs)
        if xxhash.xxh3_64_intdigest("\n".join(lines).encode(), seed=key) < share * 2**64
    }


def sentence_index(corpus) -> dict[str, tuple[str, int]]:
    """Every sentence of the corpus, squashed -> (language, document)."""
    index = {}
    for lang, docs in (("en", corpus.en), ("zh", corpus.zh)):
        for d, lines in enumerate(docs):
            for line in lines:
                for s in split_sentences(clean_text(line), lang):
                    if len(squash(s)) >= 8:
                        index[squash(s)] = (lang, d)
    return index


def documents_in(folder, corpus, index) -> set[tuple[str, int]]:
    """The documents whose (whole) sentences appear in the samples of a shard folder."""
    found = set()
    for sample in read_samples(folder):
        text = squash(corpus.hf.decode([int(i) for i in sample["input_ids"]], skip_special_tokens=True))
        found |= {doc for sentence, doc in index.items() if sentence in text}
    return found


@pytest.fixture(scope="module")
def builds(ray_here, corpus, tmp_path_factory):
    """nsp builds holding out SHARE of the documents: 1 and 2 workers on small chunks, and one on
    one chunk per file."""
    root = tmp_path_factory.mktemp("held_out")
    common = dict(format="nsp", max_seq_len=128, seed=SEED, eval_share=SHARE)
    return {
        name: (root / name, build_shards(config(corpus, root / name, **common, **extra)))
        for name, extra in {
            "w1": dict(num_workers=1),
            "w2": dict(num_workers=2),
            "one_chunk_per_file": dict(chunk_mb=1.0),
        }.items()
    }


def test_held_out_documents_are_the_rules_whatever_the_workers_and_chunks(builds, corpus):
    want = {("en", d) for d in picked(corpus.en, seed=SEED, share=SHARE)}
    want |= {("zh", d) for d in picked(corpus.zh, seed=SEED, share=SHARE)}
    assert {lang for lang, _ in want} == {"en", "zh"}  # both languages give some
    assert picked(corpus.en, seed=SEED + 1, share=SHARE) != picked(corpus.en, seed=SEED, share=SHARE)
    (w1, m1), (w2, m2) = builds["w1"], builds["w2"]
    assert m1.chunks > 4 and m1.workers == 1 and m2.workers == 2
    assert shard_hashes(w1) == shard_hashes(w2) and shard_hashes(w1 / "eval") == shard_hashes(w2 / "eval")
    assert m1.counts == m2.counts
    index = sentence_index(corpus)
    for folder, manifest in builds.values():
        held, trained = documents_in(folder / "eval", corpus, index), documents_in(folder, corpus, index)
        assert {d for d in held if d[0] == "en"} == {d for d in want if d[0] == "en"}, folder.name
        assert held <= want and any(lang == "zh" for lang, _ in held)
        assert not trained & want, f"held-out documents in training samples: {sorted(trained & want)}"
        assert len(trained) > 40
        assert manifest.counts.eval.documents_written == len(want)


def test_counts_and_the_eval_folder_of_its_own(builds, tmp_path):
    out, manifest = builds["w2"]
    c, held = manifest.counts, manifest.counts.eval
    assert c.documents_in == c.documents_written + sum(c.documents_skipped.values())  # held-out ones written
    assert 0 < held.documents_written < c.documents_written and held.samples > 0 and held.tokens > 0
    assert c.documents_in == 60 + 30 and c.documents_written == 90
    train = inspect_data([str(out)], cache_root=str(tmp_path / "c1"))
    assert train.samples == c.samples == len(read_samples(out)) and train.sources[0].shards == c.shards
    index = json.loads((out / "index.json").read_text())
    assert all(not s["raw_data"]["basename"].startswith("eval/") for s in index["shards"])
    assert {s["raw_data"]["basename"].split("/")[0] for s in index["shards"]} <= {f"part-{i:05d}" for i in range(99)}
    ev = inspect_data([str(out / "eval")], cache_root=str(tmp_path / "c2"))
    assert ev.samples == held.samples == len(read_samples(out / "eval")) and ev.sources[0].shards == held.shards
    assert (ev.format, ev.max_seq_len, ev.manifest_vocab_size) == (train.format, 128, train.manifest_vocab_size)
    assert ev.tokenizer_dir == str(out / "eval" / "tokenizer")
    assert ev.sources[0].columns == train.sources[0].columns
    own = ev.sources[0].manifest
    assert own.split == "eval" and own.status == "complete" and own.counts == held
    assert own.tokenizer.vocab_fingerprint == manifest.tokenizer.vocab_fingerprint
    both = inspect_data([str(out), str(out / "eval")], cache_root=str(tmp_path / "c3"))
    assert both.samples == c.samples + held.samples
    table = format_summary(manifest)
    assert f"documents written   90  (train {90 - held.documents_written}, eval {held.documents_written})" in table
    assert f"eval (OUTPUT/eval)  {held.documents_written} documents, {held.tokens:,} tokens" in table


def test_packed_held_out_split_accounts_for_every_document(ray_here, corpus, tmp_path):
    """Packed: each split its own stream; the held-out documents that end up wholly in a chunk's
    dropped tail are skipped (packed_tail) like the others."""
    m = build_shards(config(corpus, tmp_path / "p", seed=SEED, eval_share=SHARE, max_seq_len=16))
    c = m.counts
    assert c.documents_in == c.documents_written + sum(c.documents_skipped.values())
    assert c.eval.samples > 0 and c.eval.tokens_dropped_tail > 0 and c.tokens_dropped_tail > 0
    want = {("en", d) for d in picked(corpus.en, seed=SEED, share=SHARE)}
    want |= {("zh", d) for d in picked(corpus.zh, seed=SEED, share=SHARE)}
    index = sentence_index(corpus)
    assert not documents_in(tmp_path / "p", corpus, index) & want
    assert documents_in(tmp_path / "p" / "eval", corpus, index) <= want


def test_resume_redoes_a_missing_held_out_part_and_refuses_another_share(ray_here, corpus, builds, tmp_path):
    import shutil

    src, first = builds["w2"]
    out = tmp_path / "copy"
    shutil.copytree(src, out)
    shutil.rmtree(out / "eval" / "part-00001")
    (out / "eval" / ".tmp-part-00002-0123abcd").mkdir()  # a task killed mid-write
    common = dict(format="nsp", max_seq_len=128, seed=SEED, eval_share=SHARE, resume=True)
    again = build_shards(config(corpus, out, **common))
    assert again.chunks_resumed == again.chunks - 1
    assert shard_hashes(out) == shard_hashes(src) and shard_hashes(out / "eval") == shard_hashes(src / "eval")
    assert again.counts == first.counts and not list((out / "eval").glob(".tmp-*"))
    with pytest.raises(UsageError, match=r"different eval_share \(before: \[0\.25\], now: \[0\.5\]\)"):
        build_shards(config(corpus, out, **{**common, "eval_share": 0.5}))


def test_remote_upload_of_the_held_out_split(ray_here, corpus, tmp_path, monkeypatch, port):
    """--remote: OUTPUT/eval goes to REMOTE/eval (shards, index, manifest, tokenizer), a dataset that
    streaming reads from there; REMOTE/index.json lists none of its shards."""
    import boto3
    from moto.server import ThreadedMotoServer
    from streaming import StreamingDataset

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
        s3.create_bucket(Bucket="corpus")
        out = tmp_path / "local"
        m = build_shards(
            config(
                corpus,
                out,
                format="nsp",
                max_seq_len=64,
                chunk_mb=0.01,
                seed=SEED,
                eval_share=SHARE,
                remote="s3://corpus/shards",
            )
        )
        keys = {o["Key"] for o in s3.list_objects_v2(Bucket="corpus")["Contents"]}
        wanted = {"index.json", "build_manifest.json", "tokenizer/tokenizer.json"}
        assert {f"shards/eval/{k}" for k in wanted} <= keys
        assert sum(k.startswith("shards/eval/") and k.endswith(".mds.zstd") for k in keys) == m.counts.eval.shards
        s3.download_file("corpus", "shards/index.json", str(tmp_path / "root_index.json"))
        root = json.loads((tmp_path / "root_index.json").read_text())
        assert sum(s["samples"] for s in root["shards"]) == m.counts.samples
        ds = StreamingDataset(
            remote="s3://corpus/shards/eval", local=str(tmp_path / "cache"), batch_size=1, shuffle=False
        )
        here = read_samples(out / "eval")
        assert len(ds) == len(here) == m.counts.eval.samples > 0
        assert [ds[i]["input_ids"].tolist() for i in range(len(ds))] == [s["input_ids"].tolist() for s in here]
    finally:
        server.stop()
