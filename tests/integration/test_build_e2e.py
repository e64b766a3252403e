"""The shard builder end to end on real Ray (loopback, one instance for the module) and real MDS
files: round trip, NSP pairs, Chinese word starts, determinism across worker counts, bad input."""

import json
from pathlib import Path

import numpy as np
import pytest

from preprocessing.builder import build_shards
from preprocessing.text import clean_text, split_sentences
from tests.support.builder import (
    config,
    english_docs,
    kill_tree,
    part_samples,
    ray_on_loopback,
    read_samples,
    reference_zh_starts,
    shard_hashes,
    small_corpus,
    squash,
    write_bert_text,
    write_jsonl,
)

pytestmark = pytest.mark.multiproc


@pytest.fixture(scope="module")
def ray_here():
    yield from ray_on_loopback()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return small_corpus(tmp_path_factory.mktemp("corpus"))


def part_stats(out):
    return {p.name: json.loads((p / "part_stats.json").read_text()) for p in sorted(Path(out).glob("part-*"))}


def test_packed_round_trip_and_chinese_word_starts(ray_here, corpus, tmp_path):
    out = tmp_path / "packed"
    manifest = build_shards(config(corpus, out))
    c = manifest.counts
    assert c.documents_in == len(corpus.en) + len(corpus.zh) == c.documents_written + sum(c.documents_skipped.values())
    assert manifest.chunks > 6 and c.shards == manifest.chunks
    L, sep = 32, corpus.hf.sep_token_id
    docs = iter(corpus.en + corpus.zh)
    stats = part_stats(out)
    by_part = part_samples(out)
    assert sum(map(len, by_part.values())) == c.samples == len(read_samples(out))
    checked_zh_tokens = 0
    for name, st in stats.items():
        expected = [next(docs) for _ in range(st["counts"]["documents_in"])]
        samples = by_part.get(name, [])
        for s in samples:
            assert len(s["input_ids"]) == L and s["input_ids"].dtype == np.uint16
            assert s["input_ids"][0] == corpus.hf.cls_token_id and not s["token_type_ids"].any()
            assert s["word_starts"][:2].tolist() == [1, 1]
        stream = [t for s in samples for t in s["input_ids"][1:].tolist()]
        stream_ws = [w for s in samples for w in s["word_starts"][1:].tolist()]
        assert len(stream) + st["counts"]["tokens_dropped_tail"] == st["counts"]["tokens"] + len(expected)
        # Round trip: the stream is every document's tokens then [SEP], in input order.
        pieces, start = [], 0
        for i, t in enumerate(stream + [None]):
            if t == sep or t is None:
                pieces.append((start, i))
                start = i + 1
        complete, partial = pieces[:-1], pieces[-1]
        assert len(complete) + (partial[1] > partial[0]) + st["counts"].get("skipped_packed_tail", 0) == len(expected)
        for (lo, hi), lines in zip(complete, expected):
            assert squash(corpus.hf.decode(stream[lo:hi])) == squash("".join(lines))
        if partial[1] > partial[0]:
            assert squash("".join(expected[len(complete)])).startswith(squash(corpus.hf.decode(stream[partial[0] :])))
        lang = "zh" if "zh.jsonl" in st["file"] else "en"
        assert {s["lang"] for s in samples} <= {lang}
        if lang == "zh":  # word starts against rjieba, sentence by sentence
            for (lo, hi), lines in zip(complete, expected):
                sentences = [s for line in lines for s in split_sentences(clean_text(line), "zh")]
                ref = [f for s in sentences for f in reference_zh_starts(corpus.raw, s)]
                got = stream_ws[lo:hi]
                assert len(ref) == len(got)
                for k in range(len(got)):
                    if (lo + k) % (L - 1):  # the first token after [CLS] always starts a word
                        assert got[k] == ref[k], (name, lo + k)
                checked_zh_tokens += hi - lo
    assert checked_zh_tokens > 5000


def test_nsp_pairs_are_real_continuations_when_labelled_so(ray_here, corpus, tmp_path):
    out = tmp_path / "nsp"
    manifest = build_shards(config(corpus, out, format="nsp", max_seq_len=64))
    samples = read_samples(out)
    c = manifest.counts
    assert c.samples == len(samples) and 0.35 < c.nsp_random_next / len(samples) < 0.75
    docs = [squash("".join(lines)) for lines in corpus.en + corpus.zh]
    cls, sep = corpus.hf.cls_token_id, corpus.hf.sep_token_id
    for s in samples:
        ids = s["input_ids"].tolist()
        assert len(ids) <= 64 and ids[0] == cls and ids[-1] == sep and ids.count(sep) == 2
        mid = ids.index(sep)
        assert s["token_type_ids"].tolist() == [0] * (mid + 1) + [1] * (len(ids) - mid - 1)
        a, b = squash(corpus.hf.decode(ids[1:mid])), squash(corpus.hf.decode(ids[mid + 1 : -1]))
        homes = [d for d in docs if a in d]
        assert homes, "A comes from a document"
        if s["nsp_label"] == 0:  # B follows A in A's document (truncation may trim the seam)
            assert any(b in d[d.index(a) + len(a) :] for d in homes), (a, b)
        else:
            assert any(b in d for d in docs)
        assert s["lang"] in ("en", "zh")


def test_same_samples_with_1_and_3_workers(ray_here, corpus, tmp_path):
    runs = {}
    for n in (1, 3):
        cfg = config(corpus, tmp_path / f"w{n}", format="nsp", max_seq_len=48, num_workers=n, seed=7)
        runs[n] = (build_shards(cfg), shard_hashes(tmp_path / f"w{n}"))
    assert runs[1][1] == runs[3][1] and len(runs[1][1]) > 6
    assert runs[1][0].counts == runs[3][0].counts
    other = build_shards(config(corpus, tmp_path / "seed8", format="nsp", max_seq_len=48, seed=8))
    assert (
        shard_hashes(tmp_path / "seed8") != runs[1][1] and other.counts.documents_in == runs[1][0].counts.documents_in
    )


def test_bad_input_is_counted_and_logged(ray_here, corpus, tmp_path):
    d = tmp_path / "in"
    d.mkdir()
    write_bert_text(d / "good.txt", corpus.en[:5])
    (d / "latin1.txt").write_bytes("Caf\xe9 cr\xe8me is sweet.\nIt is.\n\n".encode("latin-1") + b"Fine doc here.\n")
    (d / "controls.txt").write_bytes(b"\x01\x02\x03\n\x07\x08\n\nA real doc after it.\n")
    lines = [
        json.dumps({"text": "First good document."}),
        '{"text": "unterminated',
        json.dumps({"body": "no text field"}),
        json.dumps({"text": ""}),
        "not json at all",
        json.dumps({"text": "Last good document."}),
    ]
    (d / "mixed.jsonl").write_text("\n".join(lines) + "\n")
    words = " ".join(corpus.en[0]).split()
    giant = "Start of the giant line. " + " ".join(words[i % len(words)] for i in range(600_000)) + " The end."
    (d / "giant.txt").write_text("Before it.\n\n" + giant)  # about 3.5 MB, no newline at all
    # nsp: unlike packing, it drops no chunk tail, so every good document must show up
    manifest = build_shards(
        config(corpus, tmp_path / "out", inputs=[f"en:{d}/*"], block_mb=1.0, chunk_mb=1.0, format="nsp", max_seq_len=64)
    )
    c = manifest.counts
    assert c.documents_skipped == {"empty": 2, "malformed_json": 2, "missing_field": 1}
    assert c.documents_in == 5 + 2 + 2 + 6 + 2 == c.documents_written + sum(c.documents_skipped.values())
    assert c.non_utf8_replacements == 2 and c.long_line_pieces >= 3 and c.documents_split == 1
    rejects = [json.loads(line) for line in (tmp_path / "out" / "rejects.jsonl").read_text().splitlines()]
    where = sorted((Path(r["file"]).name, r["line"], r["reason"]) for r in rejects)
    assert where == [
        ("controls.txt", 1, "empty"),
        ("latin1.txt", 1, "non_utf8_replaced"),
        ("mixed.jsonl", 2, "malformed_json"),
        ("mixed.jsonl", 3, "missing_field"),
        ("mixed.jsonl", 4, "empty"),
        ("mixed.jsonl", 5, "malformed_json"),
    ]
    text = "|".join(
        squash(corpus.hf.decode(s["input_ids"], skip_special_tokens=True)) for s in read_samples(tmp_path / "out")
    )
    # U+FFFD replaced the Latin-1 bytes; BERT's normaliser then drops it (clean_text)
    for needle in (
        "Caf cr me is sweet.",
        "First good document.",
        "Last good document.",
        "A real doc after it.",
        "giant line.",
    ):
        assert squash(needle) in text, needle


def test_output_folder_rules(ray_here, corpus, tmp_path):
    from preprocessing.builder import main

    out = tmp_path / "o"
    args = [
        "--input",
        f"en:{corpus.dir / 'en.txt'}",
        "--output",
        str(out),
        "--tokenizer",
        str(corpus.tok_dir),
        "--format",
        "packed",
        "--max_seq_len",
        "32",
        "--no_progress",
    ]
    assert main(args) == 0
    first = shard_hashes(out)
    assert main(args) == 2  # non-empty output
    assert main(args + ["--overwrite"]) == 0 and shard_hashes(out) == first
    assert main(args + ["--resume"]) == 0 and shard_hashes(out) == first  # nothing left to do
    manifest = json.loads((out / "build_manifest.json").read_text())
    assert manifest["chunks_resumed"] == manifest["chunks"]
    assert main(args[:-2] + ["64", "--no_progress", "--resume"]) == 2  # different max_seq_len
    stranger = tmp_path / "mine"
    stranger.mkdir()
    (stranger / "notes.txt").write_text("keep me")
    assert main(args[:3] + [str(stranger)] + args[4:] + ["--overwrite"]) == 2
    assert (stranger / "notes.txt").read_text() == "keep me"


def test_killed_build_resumes_to_the_same_output(ray_here, corpus, tmp_path):
    """A build SIGKILLed midway (driver, Ray and all) and then resumed writes what a clean build
    writes, and re-runs only the chunks that were not finished."""
    import subprocess
    import sys
    import time

    from tests.support.builder import REPO

    big = write_bert_text(tmp_path / "big.txt", english_docs(500, seed=3))
    out = tmp_path / "killed"
    args = [
        sys.executable,
        str(REPO / "preprocessing" / "build_shards.py"),
        "--input",
        f"en:{big}",
        "--output",
        str(out),
        "--tokenizer",
        str(corpus.tok_dir),
        "--format",
        "nsp",
        "--max_seq_len",
        "48",
        "--chunk_mb",
        "0.002",
        "--num_workers",
        "1",
        "--no_progress",
    ]
    proc = subprocess.Popen(args, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.time() + 240
        while len(list(out.glob("part-*/part_stats.json"))) < 3:
            assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
            assert time.time() < deadline, "the build never got going"
            time.sleep(0.02)
    finally:
        kill_tree(proc)
    manifest = json.loads((out / "build_manifest.json").read_text())
    assert manifest["status"] == "running" and not (out / "index.json").exists()
    finished = len(list(out.glob("part-*/part_stats.json")))

    resumed = build_shards(
        config(corpus, out, inputs=[f"en:{big}"], format="nsp", max_seq_len=48, chunk_mb=0.002, resume=True)
    )
    clean = build_shards(
        config(corpus, tmp_path / "clean", inputs=[f"en:{big}"], format="nsp", max_seq_len=48, chunk_mb=0.002)
    )
    assert finished <= resumed.chunks_resumed < resumed.chunks
    assert shard_hashes(out) == shard_hashes(tmp_path / "clean")
    assert resumed.counts == clean.counts
    assert not list(out.glob(".tmp-*"))


def test_remote_upload_to_s3(ray_here, corpus, tmp_path, monkeypatch, port):
    """--remote s3://... against a real S3 API (moto's server on 127.0.0.1); streaming's uploader
    honours S3_ENDPOINT_URL, and the workers get it (and the credentials) from the driver."""
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
        s3.create_bucket(Bucket="corpus")
        out = tmp_path / "local"
        manifest = build_shards(
            config(corpus, out, format="nsp", max_seq_len=64, chunk_mb=0.01, remote="s3://corpus/shards")
        )
        keys = {o["Key"] for o in s3.list_objects_v2(Bucket="corpus")["Contents"]}
        local = {
            str(p.relative_to(out))
            for p in out.rglob("*")
            if p.is_file() and p.name not in ("part_stats.json", "rejects.jsonl") or p.parent == out and p.is_file()
        }
        assert {f"shards/{k}" for k in local if not k.endswith(".mds")} <= keys
        assert {"shards/index.json", "shards/build_manifest.json", "shards/tokenizer/tokenizer.json"} <= keys
        assert sum(k.endswith(".mds.zstd") for k in keys) == manifest.counts.shards
        from streaming import StreamingDataset

        ds = StreamingDataset(remote="s3://corpus/shards", local=str(tmp_path / "cache"), batch_size=1, shuffle=False)
        here = read_samples(out)
        assert len(ds) == len(here) == manifest.counts.samples
        for i in range(0, len(here), 7):
            assert ds[i]["input_ids"].tolist() == here[i]["input_ids"].tolist()
    finally:
        server.stop()


def test_every_input_format_gives_the_same_samples(ray_here, corpus, tmp_path):
    """The same documents as BERT text, JSONL, .gz, .zst, Parquet and a datasets folder build the
    same shards (one chunk each, so the packed stream is identical)."""
    import gzip

    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    docs = corpus.en[:25]
    d = tmp_path / "formats"
    d.mkdir()
    write_bert_text(d / "docs.txt", docs)
    write_jsonl(d / "docs.jsonl", docs, field="body")
    (d / "docs.jsonl.gz").write_bytes(gzip.compress((d / "docs.jsonl").read_bytes()))
    (d / "docs.txt.zst").write_bytes(zstandard.ZstdCompressor().compress((d / "docs.txt").read_bytes()))
    texts = ["\n".join(lines) for lines in docs]
    pq.write_table(pa.table({"body": texts}), d / "docs.parquet", row_group_size=7)
    datasets.Dataset.from_dict({"body": texts}).save_to_disk(str(d / "hf"))
    hashes = {}
    for name in ("docs.txt", "docs.jsonl", "docs.jsonl.gz", "docs.txt.zst", "docs.parquet", "hf"):
        m = build_shards(
            config(corpus, tmp_path / name.replace(".", "_"), inputs=[f"en:{d / name}"], chunk_mb=64, text_field="body")
        )
        assert m.chunks == 1 and m.counts.documents_in == 25
        hashes[name] = [h for _, h, _ in shard_hashes(tmp_path / name.replace(".", "_"))]
    assert all(h == hashes["docs.txt"] for h in hashes.values()), hashes


def test_language_detection_and_trained_tokenizer(ray_here, corpus, tmp_path):
    """No language prefix: each document's language is detected; --train_tokenizer writes a
    loadable OUTPUT/tokenizer that keeps ideographs whole."""
    from transformers import AutoTokenizer

    mixed = write_bert_text(tmp_path / "mixed.txt", [x for pair in zip(corpus.en[:20], corpus.zh[:20]) for x in pair])
    out = tmp_path / "sp"
    m = build_shards(
        config(
            corpus,
            out,
            inputs=[str(mixed)],
            tokenizer=None,
            train_tokenizer="unigram",
            vocab_size=2000,
            format="nsp",
            max_seq_len=64,
            chunk_mb=64,
        )
    )
    tok = AutoTokenizer.from_pretrained(out / "tokenizer")
    # a tiny corpus cannot fill 2000 unigram pieces; the manifest reports what was trained
    assert m.tokenizer.kind == "unigram" and m.tokenizer.vocab_size == len(tok) <= 2000
    assert tok.is_fast and tok.mask_token == "[MASK]"
    assert m.counts.tokens_by_lang["en"] > 0 and m.counts.tokens_by_lang["zh"] > 0
    for s in read_samples(out):
        ids = s["input_ids"].tolist()
        text = tok.decode(ids[1 : ids.index(tok.sep_token_id)])  # segment A: its document's language
        han = sum("\u4e00" <= ch <= "\u9fff" for ch in text)
        assert s["lang"] == ("zh" if han > len(text.replace(" ", "")) / 3 else "en"), text
        for piece in tok.convert_ids_to_tokens(s["input_ids"].tolist()):
            assert not any("\u4e00" <= ch <= "\u9fff" for ch in piece) or len(piece) == 1, piece


@pytest.mark.corpora
def test_real_corpora_round_trip(ray_here, corpora, tmp_path):
    """Real English and Chinese text (../shared/corpora) with a trained joint vocabulary: every
    complete document of the packed stream decodes back to its input, accents and case aside."""
    import unicodedata

    def head(path, limit):
        docs, lines = [], []
        with open(path, encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    lines.append(line.rstrip("\n"))
                elif lines:
                    docs.append(lines)
                    lines = []
                    if sum(len(x) for d in docs for x in d) > limit:
                        break
        return docs

    def plain(text):  # BERT's uncased normaliser also strips accents
        return "".join(c for c in unicodedata.normalize("NFD", squash(text)) if unicodedata.category(c) != "Mn")

    en = head(corpora / "en" / "enwiki_wikiextractor.txt", 300_000)
    zh = head(corpora / "zh" / "court_judgments.txt", 100_000)
    write_bert_text(tmp_path / "en.txt", en)
    write_bert_text(tmp_path / "zh.txt", zh)
    out = tmp_path / "out"
    m = build_shards(
        config(
            corpus=None,
            out=out,
            inputs=[f"en:{tmp_path / 'en.txt'}", f"zh:{tmp_path / 'zh.txt'}"],
            tokenizer=None,
            train_tokenizer="wordpiece",
            vocab_size=8000,
            max_seq_len=128,
            chunk_mb=64,
        )
    )
    assert m.counts.documents_written + sum(m.counts.documents_skipped.values()) == len(en) + len(zh)
    assert m.peak_rss_mb_per_worker < 1500
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(out / "tokenizer")
    parts = part_samples(out)
    for name, docs in zip(sorted(parts), (en, zh)):
        stream = [t for s in parts[name] for t in s["input_ids"][1:].tolist()]
        pieces, start = [], 0
        for i, t in enumerate(stream):
            if t == tok.sep_token_id:
                pieces.append(stream[start:i])
                start = i + 1
        assert len(pieces) >= len(docs) - 2
        for ids, lines in zip(pieces, docs):
            assert plain(tok.decode(ids)) == plain("".join(lines))
