"""Input specs, formats, byte-range chunking aligned to documents, and bad input in the readers."""

import gzip
import json
import os
import random
import tracemalloc

import pytest

from preprocessing.errors import UsageError
from preprocessing.inputs import parse_input_spec, plan_chunks, resolve_inputs
from preprocessing.readers import MAX_LINE_BYTES, ChunkReader


def read_all(files, *, chunk_bytes, text_field="text"):
    """(documents as line lists, absolute start lines, merged counts, rejects) over every chunk."""
    docs, where, counts, rejects = [], [], {}, []
    for chunk in plan_chunks(files, chunk_bytes=chunk_bytes, text_field=text_field):
        reader = ChunkReader(chunk, text_field=text_field)
        for doc in reader.documents():
            docs.append(doc.lines)
            where.append(reader.location(doc.line))
        for k, v in reader.counts.items():
            counts[k] = counts.get(k, 0) + v
        rejects += reader.rejects
    return docs, where, counts, rejects


def reference_bert_docs(text):
    """Independent parse of BERT format: blank (whitespace-only) lines separate documents."""
    docs, current, starts, start = [], [], [], None
    for number, line in enumerate(text.split("\n"), start=1):
        line = line.rstrip("\r")
        if line.strip():
            if not current:
                start = number
            current.append(line)
        elif current:
            docs.append(current)
            starts.append(start)
            current = []
    if current:
        docs.append(current)
        starts.append(start)
    return docs, starts


def messy_bert_text(seed=0):
    rng = random.Random(seed)
    parts = []
    for d in range(60):
        lines = [f"doc {d} line {i} " + "x" * rng.randint(0, 80) for i in range(rng.randint(1, 6))]
        eol = "\r\n" if d % 7 == 3 else "\n"
        parts.append(eol.join(lines) + eol)
        parts.append(rng.choice(["\n", "\n\n\n", "   \n", "\r\n", "\n \t\n"]))
    return "".join(parts) + "last doc without a final newline"


def test_input_specs_and_languages():
    assert parse_input_spec("zh:corpora/*.jsonl") == ("zh", "corpora/*.jsonl")
    assert parse_input_spec("en:a.txt") == ("en", "a.txt")
    assert parse_input_spec("plain/path.txt") == (None, "plain/path.txt")
    with pytest.raises(UsageError, match="unknown language prefix 'fr:'"):
        parse_input_spec("fr:books.txt")


def test_missing_paths_empty_globs_and_directories_are_named(tmp_path):
    with pytest.raises(UsageError, match="no such file or directory: .*nope.txt"):
        resolve_inputs([f"en:{tmp_path}/nope.txt"])
    with pytest.raises(UsageError, match=r"the glob .*\*\.jsonl' matched no files"):
        resolve_inputs([f"{tmp_path}/*.jsonl"])
    (tmp_path / "d").mkdir()
    with pytest.raises(UsageError, match="is a directory but not a datasets save_to_disk folder"):
        resolve_inputs([str(tmp_path / "d")])
    (tmp_path / "a.txt").write_text("x\n")
    with pytest.raises(UsageError, match="already read by --input"):
        resolve_inputs([str(tmp_path / "a.txt"), f"en:{tmp_path}/*.txt"])


def test_formats_are_recognised(tmp_path):
    import datasets

    for name in ("a.txt", "b.jsonl", "c.jsonl.gz", "d.txt.zst", "e.parquet", "wiki_00"):
        (tmp_path / name).write_bytes(b"")
    datasets.Dataset.from_dict({"text": ["a", "b"]}).save_to_disk(str(tmp_path / "hf"))
    datasets.DatasetDict(
        {"train": datasets.Dataset.from_dict({"text": ["a"]}), "test": datasets.Dataset.from_dict({"text": ["b"]})}
    ).save_to_disk(str(tmp_path / "hfd"))
    files = resolve_inputs([f"{tmp_path}/*", "zh:" + str(tmp_path / "hf")][:1])
    kinds = {
        f.path.split("/")[-1] if f.kind != "arrow" else f.path.split("/")[-2]: (f.kind, f.compression) for f in files
    }
    assert kinds["a.txt"] == ("text", None) and kinds["b.jsonl"] == ("jsonl", None)
    assert kinds["c.jsonl.gz"] == ("jsonl", "gz") and kinds["d.txt.zst"] == ("text", "zst")
    assert kinds["e.parquet"] == ("parquet", None) and kinds["wiki_00"] == ("text", None)
    assert kinds["hf"] == ("arrow", None)
    assert {kinds["train"], kinds["test"]} == {("arrow", None)}  # every split of a DatasetDict


@pytest.mark.parametrize("chunk_bytes", [1, 7, 61, 500, 4096, 1 << 30])
def test_text_chunks_align_to_documents(tmp_path, chunk_bytes):
    text = messy_bert_text()
    path = tmp_path / "c.txt"
    path.write_bytes(text.encode())
    expected, starts = reference_bert_docs(text)
    docs, where, counts, _ = read_all(resolve_inputs([str(path)]), chunk_bytes=chunk_bytes)
    assert docs == expected
    assert [w["line"] for w in where] == starts
    assert counts["documents_in"] == len(expected)


@pytest.mark.parametrize("chunk_bytes", [1, 13, 200, 1 << 30])
def test_jsonl_chunks_align_to_lines_and_count_bad_lines(tmp_path, chunk_bytes):
    lines = []
    for i in range(1, 41):
        if i % 10 == 3:
            lines.append('{"text": "broken')
        elif i % 10 == 5:
            lines.append(json.dumps({"title": f"no text {i}"}))
        elif i % 10 == 7:
            lines.append(json.dumps({"text": 7}))
        elif i % 10 == 9:
            lines.append(json.dumps({"text": [f"line a {i}", f"line b {i}"]}))
        elif i == 20:
            lines.append("   ")  # a blank line is not a document
        else:
            lines.append(json.dumps({"text": f"doc {i}\nsecond line {i}"}))
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(lines) + "\n")
    docs, where, counts, rejects = read_all(resolve_inputs([str(path)]), chunk_bytes=chunk_bytes)
    good = [i for i in range(1, 41) if i % 10 not in (3, 5, 7) and i != 20]
    assert [w["line"] for w in where] == good
    assert docs[0] == ["doc 1", "second line 1"] and docs[good.index(9)] == ["line a 9", "line b 9"]
    assert counts["documents_in"] == 39
    assert counts["skipped_malformed_json"] == 4 and counts["skipped_missing_field"] == 4
    assert counts["skipped_bad_field_type"] == 4
    by_reason = {}
    for r in rejects:
        assert r["file"] == str(path)
        by_reason.setdefault(r["reason"], []).append(r["line"])
    assert by_reason == {
        "malformed_json": [3, 13, 23, 33],
        "missing_field": [5, 15, 25, 35],
        "bad_field_type": [7, 17, 27, 37],
    }


def test_compressed_files_read_like_plain_ones(tmp_path):
    import zstandard

    text = messy_bert_text(seed=3)
    (tmp_path / "p.txt").write_text(text)
    (tmp_path / "g.txt.gz").write_bytes(gzip.compress(text.encode()))
    (tmp_path / "z.txt.zst").write_bytes(zstandard.ZstdCompressor().compress(text.encode()))
    plain = read_all(resolve_inputs([str(tmp_path / "p.txt")]), chunk_bytes=100)[0]
    for name in ("g.txt.gz", "z.txt.zst"):
        files = resolve_inputs([str(tmp_path / name)])
        assert len(plan_chunks(files, chunk_bytes=100, text_field="text")) == 1  # cannot seek
        assert read_all(files, chunk_bytes=100)[0] == plain


def test_parquet_and_datasets_folders_are_cut_into_row_ranges(tmp_path):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = [f"row {i}\nsecond line of row {i}" if i % 11 else None for i in range(500)]
    pq.write_table(pa.table({"body": texts, "id": list(range(500))}), tmp_path / "t.parquet", row_group_size=64)
    ds = datasets.Dataset.from_dict({"body": texts})
    ds.save_to_disk(str(tmp_path / "hf"), max_shard_size="4KB")
    for spec in (str(tmp_path / "t.parquet"), str(tmp_path / "hf")):
        files = resolve_inputs([spec])
        chunks = plan_chunks(files, chunk_bytes=700, text_field="body")
        assert len(chunks) > 3
        docs, where, counts, rejects = read_all(files, chunk_bytes=700, text_field="body")
        assert docs == [t.split("\n") for t in texts if t is not None]
        assert counts["documents_in"] == 500 and counts["skipped_missing_field"] == 46
        missing = [(r["file"], r["row"]) for r in rejects if r["reason"] == "missing_field"]
        if spec.endswith(".parquet"):
            assert missing == [(str(tmp_path / "t.parquet"), i) for i in range(0, 500, 11)]
        else:  # rows are numbered per Arrow file of the folder
            assert len(files) > 1 and len(missing) == 46
    with pytest.raises(UsageError, match="--text_field text: no such column"):
        plan_chunks(resolve_inputs([str(tmp_path / "t.parquet")]), chunk_bytes=700, text_field="text")


def test_non_utf8_bytes_are_replaced_and_counted(tmp_path):
    path = tmp_path / "bad.txt"
    path.write_bytes(b"fine line\nbad \xff\xfe bytes and a real \xef\xbf\xbd char\n\nnext doc \xc3\n")
    docs, _, counts, rejects = read_all(resolve_inputs([str(path)]), chunk_bytes=1 << 20)
    assert docs == [["fine line", "bad \ufffd\ufffd bytes and a real \ufffd char"], ["next doc \ufffd"]]
    assert counts["non_utf8_replacements"] == 3
    assert [(r["reason"], r["line"], r["replaced"]) for r in rejects] == [
        ("non_utf8_replaced", 2, 2),
        ("non_utf8_replaced", 4, 1),
    ]


def test_a_50mb_line_without_newline_streams_in_bounded_memory(tmp_path):
    path = tmp_path / "huge.txt"
    filler = ("lorem ipsum dolor sit amet " * 40 + "\n").encode()
    body = b"word " * (10 << 20)  # 50 MB, no newline
    path.write_bytes(filler + b"\nStart of the giant line. " + body + b"The end.")
    tracemalloc.start()
    reader = ChunkReader(plan_chunks(resolve_inputs([str(path)]), chunk_bytes=1 << 30, text_field="text")[0])
    parts, first, last = [], None, None
    for doc in reader.documents():
        parts.append((doc.part, doc.last, doc.line))
        first = first or (doc.lines[0] if doc.line == 3 else None)
        last = doc.lines[-1]
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 16 * MAX_LINE_BYTES, f"peak {peak / 1e6:.1f} MB while reading a 50 MB line"
    assert reader.counts["long_line_pieces"] >= 50 and reader.counts["documents_in"] == 2
    # The giant document (line 3) arrives in parts, in order, the last one flagged.
    assert parts[0] == (0, True, 1) and parts[1][:2] == (0, False) and parts[-1][:2] == (len(parts) - 2, True)
    assert {line for _, _, line in parts[1:]} == {3}
    assert first.startswith("Start of the giant line. word word") and last.endswith("word The end.")


# ---- inputs that cannot be read as planned: each a UsageError naming the file -------------------
def test_broken_symlink_fifo_and_fake_or_truncated_compression_are_named(tmp_path):
    (tmp_path / "good.txt").write_text("A document.\n")
    (tmp_path / "dangling.txt").symlink_to(tmp_path / "gone.txt")
    with pytest.raises(UsageError, match=r"dangling.txt is a broken symbolic link \(to .*gone.txt\)"):
        resolve_inputs([f"{tmp_path}/*.txt"])
    (tmp_path / "dangling.txt").unlink()
    os.mkfifo(tmp_path / "pipe.txt")
    with pytest.raises(UsageError, match=r"pipe.txt is a FIFO \(named pipe\); .* needs a regular file"):
        resolve_inputs([f"{tmp_path}/*.txt"])
    (tmp_path / "pipe.txt").unlink()
    (tmp_path / "plain.jsonl.gz").write_bytes(b'{"text": "not compressed"}\n')
    with pytest.raises(
        UsageError,
        match=r"plain.jsonl.gz \(from --input .*\): is named like a gzip file but "
        r"is not gzip",
    ):
        resolve_inputs([str(tmp_path / "plain.jsonl.gz")])
    text = messy_bert_text(seed=5).encode()
    (tmp_path / "short.txt.gz").write_bytes(gzip.compress(text)[:-40])  # within the first MB: found at once
    with pytest.raises(
        UsageError,
        match=r"short.txt.gz .*: the compressed stream ends early, so the file is "
        r"truncated",
    ):
        resolve_inputs([str(tmp_path / "short.txt.gz")])


@pytest.mark.parametrize("name", ["big.txt.gz", "big.txt.zst"])
def test_truncation_past_the_first_mb_is_found_by_the_reader(tmp_path, name):
    """zstandard's stream reader returns a truncated file's first part as if it were all of it; gzip
    raises EOFError. Both must be a UsageError naming the file, not lost text or a traceback."""
    import zstandard

    rng = random.Random(0)
    text = "".join(f"doc {i} {rng.random()} {rng.random()}\n\n" for i in range(200_000)).encode()
    packed = gzip.compress(text) if name.endswith(".gz") else zstandard.ZstdCompressor().compress(text)
    (tmp_path / name).write_bytes(packed[: len(packed) * 3 // 4])
    files = resolve_inputs([str(tmp_path / name)])  # the first MB decompresses fine
    with pytest.raises(UsageError, match=f"{name} .*: the compressed stream ends early"):
        read_all(files, chunk_bytes=1 << 30)


def test_an_input_that_vanishes_or_changes_is_named(tmp_path):
    from preprocessing.inputs import check_unchanged

    path = tmp_path / "a.txt"
    path.write_text(messy_bert_text())
    files = resolve_inputs([str(path)])
    reader = ChunkReader(plan_chunks(files, chunk_bytes=1 << 30, text_field="text")[0])
    path.unlink()
    with pytest.raises(UsageError, match=r"a.txt \(from --input .*\): disappeared during the build"):
        list(reader.documents())
    with pytest.raises(UsageError, match="disappeared during the build"):
        check_unchanged(files[0])
    path.write_text(messy_bert_text())  # the same size, written again
    os.utime(path, ns=(files[0].mtime_ns + 10**9, files[0].mtime_ns + 10**9))
    with pytest.raises(UsageError, match=r"a.txt .*: changed during the build"):
        check_unchanged(files[0])


def test_globs_skip_the_output_folder_and_explicit_paths_inside_it_are_refused(tmp_path, capsys):
    (tmp_path / "a.txt").write_text("x\n")
    out = tmp_path / "out"
    (out / "tokenizer").mkdir(parents=True)
    (out / "tokenizer" / "vocab.txt").write_text("[PAD]\n")
    files = resolve_inputs([f"en:{tmp_path}/**/*.txt"], exclude=out)
    assert [f.path for f in files] == [str(tmp_path / "a.txt")]
    assert f"skipped 1 path(s) inside --output {out}" in capsys.readouterr().err
    with pytest.raises(UsageError, match="matched no files outside --output"):
        resolve_inputs([f"{out}/**/*.txt"], exclude=out)
    with pytest.raises(UsageError, match="is inside --output .*a build cannot read its own output"):
        resolve_inputs([str(out / "tokenizer" / "vocab.txt")], exclude=out)


# ---- encodings ----------------------------------------------------------------------------------
CHINESE = "中华人民共和国最高人民法院。本院认为，上诉人的上诉请求不能成立。" * 40
ENGLISH = "The river ran past the old stone bridge, and the village slept. " * 40


def test_utf16_and_nul_heavy_files_are_refused_with_the_flag_that_reads_them(tmp_path):
    (tmp_path / "bom.txt").write_bytes(("\n\n".join([ENGLISH, CHINESE])).encode("utf-16"))
    with pytest.raises(
        UsageError,
        match=r"bom.txt: starts with a UTF-16 byte-order mark, so it is not utf-8 "
        r"text; pass --encoding '.*bom.txt=utf-16'",
    ):
        resolve_inputs([str(tmp_path / "bom.txt")])
    (tmp_path / "le.jsonl").write_bytes(json.dumps({"text": ENGLISH}).encode("utf-16-le"))
    with pytest.raises(
        UsageError,
        match=r"le.jsonl: [\d,]+ of its first [\d,]+ bytes are NUL.*"
        r"--encoding '.*le.jsonl=utf-16-le'",
    ):
        resolve_inputs([str(tmp_path / "le.jsonl")])


def test_gbk_text_is_refused_and_read_right_with_encoding(tmp_path):
    from preprocessing.charsets import parse_rules

    docs = [[CHINESE[:60], CHINESE[60:200]], [ENGLISH[:100]], [CHINESE[200:400]]]
    text = "".join("\n".join(lines) + "\n\n" for lines in docs)
    path = tmp_path / "court.txt"
    path.write_bytes(text.encode("gbk"))
    with pytest.raises(
        UsageError,
        match=r"court.txt: [\d,]+ of its first [\d,]+ characters are not valid utf-8 .* "
        r"\(it decodes cleanly as gb18030\); pass --encoding '.*court.txt=gb18030'",
    ):
        resolve_inputs([str(path)])
    files = resolve_inputs([str(path)], encoding_rules=parse_rules(["*.txt=gbk"]))
    assert files[0].encoding == "gbk" and files[0].byte_ranges
    for chunk_bytes in (7, 1 << 30):  # still cut into byte ranges: b"\n" is only ever a newline in GBK
        got, _, counts, _ = read_all(files, chunk_bytes=chunk_bytes)
        assert got == docs and counts.get("non_utf8_replacements", 0) == 0
    with pytest.raises(UsageError, match="--encoding latin-9x: unknown encoding"):
        parse_rules(["latin-9x"])


def test_utf16_with_encoding_is_transcoded_as_one_chunk(tmp_path):
    from preprocessing.charsets import parse_rules

    docs = [[ENGLISH[:80]], [CHINESE[:50], CHINESE[50:90]]]
    (tmp_path / "w.jsonl").write_bytes(
        "".join(json.dumps({"text": "\n".join(d)}, ensure_ascii=False) + "\r\n" for d in docs).encode("utf-16")
    )
    files = resolve_inputs([str(tmp_path / "w.jsonl")], encoding_rules=parse_rules(["utf-16"]))
    assert len(plan_chunks(files, chunk_bytes=10, text_field="text")) == 1
    got, where, counts, _ = read_all(files, chunk_bytes=10)
    assert got == docs and [w["line"] for w in where] == [1, 2] and counts["documents_in"] == 2


def test_a_utf8_bom_keeps_the_first_jsonl_record(tmp_path):
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + "".join(json.dumps({"text": f"record {i}"}) + "\n" for i in range(3)).encode())
    for chunk_bytes in (5, 1 << 30):
        docs, where, counts, rejects = read_all(resolve_inputs([str(path)]), chunk_bytes=chunk_bytes)
        assert docs == [["record 0"], ["record 1"], ["record 2"]] and rejects == []
