"""NSP instances (BERT's algorithm), packed blocks, and the MDS sample encoder (pure functions)."""

import json
import random

import numpy as np
import pytest

from preprocessing.mds import LocalMDSWriter, make_fast_writer_class, merge_local_indexes
from preprocessing.samples import Packer, TokenizedDocs, assemble_nsp, nsp_instances
from preprocessing.shard_format import columns_for

CLS, SEP = 2, 3


def synthetic_docs(seed, *, num_docs=40, min_sents=1, max_sents=15, max_len=30, langs=("en",)):
    """Documents of sentences of random length; token ids are unique positions (offset by 10)."""
    rng = random.Random(seed)
    sent_lens, doc_counts = [], []
    for _ in range(num_docs):
        n = rng.randint(min_sents, max_sents)
        doc_counts.append(n)
        sent_lens += [rng.randint(1, max_len) for _ in range(n)]
    total = sum(sent_lens)
    return TokenizedDocs(
        ids_T=np.arange(10, 10 + total, dtype=np.uint32),
        word_starts_T=np.array([rng.random() < 0.7 for _ in range(total)], dtype=np.uint8),
        sent_offsets_S1=np.concatenate([[0], np.cumsum(sent_lens)]).astype(np.int64),
        doc_sent_offsets_D1=np.concatenate([[0], np.cumsum(doc_counts)]).astype(np.int64),
        doc_langs=[langs[i % len(langs)] for i in range(num_docs)],
    )


@pytest.mark.parametrize("max_seq_len, max_len", [(16, 4), (16, 30), (64, 30), (128, 30), (128, 300)])
def test_nsp_pairs_follow_bert(max_seq_len, max_len):
    docs = synthetic_docs(max_seq_len, max_len=max_len)
    sent_starts = set(docs.sent_offsets_S1.tolist())
    doc_tok = docs.doc_token_offsets()
    insts = list(nsp_instances(docs, rng=random.Random(0), max_seq_len=max_seq_len))
    # Half the pairs flip to a random B, plus (BERT) every chunk of a single sentence.
    assert 0.45 < np.mean([i.is_random_next for i in insts]) < 0.95
    consumed = {d: int(doc_tok[d]) for d in range(docs.num_docs)}
    for inst in insts:
        (a_lo, a_hi), (b_lo, b_hi) = inst.a, inst.b
        assert a_hi > a_lo and b_hi > b_lo and (a_hi - a_lo) + (b_hi - b_lo) + 3 <= max_seq_len
        # truncation only trims the ends of what was chosen
        assert inst.a_full[0] <= a_lo < a_hi <= inst.a_full[1]
        assert inst.b_full[0] <= b_lo < b_hi <= inst.b_full[1]
        assert inst.a_full[0] in sent_starts and inst.a_full[1] in sent_starts
        assert inst.b_full[0] in sent_starts and inst.b_full[1] in sent_starts
        d = inst.a_doc
        assert doc_tok[d] <= inst.a_full[0] and inst.a_full[1] <= doc_tok[d + 1]
        assert inst.a_full[0] == consumed[d], "A continues where the last sample of its doc stopped"
        if inst.is_random_next:  # B is a run of sentences of another document
            assert inst.b_doc != d
            assert doc_tok[inst.b_doc] <= inst.b_full[0] and inst.b_full[1] <= doc_tok[inst.b_doc + 1]
            consumed[d] = inst.a_full[1]  # the sentences A did not use go back
        else:  # B is the real continuation of A
            assert inst.b_doc == d and inst.b_full[0] == inst.a_full[1] <= inst.b_full[1] <= doc_tok[d + 1]
            consumed[d] = inst.b_full[1]
    assert consumed == {d: int(doc_tok[d + 1]) for d in range(docs.num_docs)}, "every sentence used"
    again = list(nsp_instances(docs, rng=random.Random(0), max_seq_len=max_seq_len))
    assert again == insts


def test_random_b_never_comes_from_as_own_document():
    """BERT's 10 tries and then A's own document: with few documents a 'random' B was often A's
    own continuation. Now: another source document always; the parts of one long document (same
    doc id) count as one; a block with a single document draws from donors, which give no A."""
    from preprocessing.samples import concat_docs

    few = synthetic_docs(5, num_docs=2, min_sents=30, max_sents=40)
    for seed in range(20):
        for inst in nsp_instances(few, rng=random.Random(seed), max_seq_len=32):
            assert not inst.is_random_next or inst.b_doc != inst.a_doc
    parts = synthetic_docs(6, num_docs=6, min_sents=20, max_sents=30)
    parts.doc_ids = np.array([7, 7, 7, 9, 9, 4], dtype=np.int64)  # three documents in six parts
    seen = set()
    for inst in nsp_instances(parts, rng=random.Random(1), max_seq_len=32):
        if inst.is_random_next:
            assert parts.doc_ids[inst.b_doc] != parts.doc_ids[inst.a_doc]
            seen.add(int(parts.doc_ids[inst.b_doc]))
    assert seen == {7, 9, 4}
    alone = synthetic_docs(8, num_docs=3, min_sents=20, max_sents=30)
    alone.doc_ids = np.zeros(3, dtype=np.int64)  # one document, in three parts
    with pytest.raises(ValueError, match="a random B needs another document"):
        list(nsp_instances(alone, rng=random.Random(0), max_seq_len=32))
    donors = synthetic_docs(9, num_docs=4, max_sents=5)
    donors.doc_ids = np.arange(100, 104, dtype=np.int64)
    block = concat_docs([alone, donors])
    block.num_a_docs = alone.num_docs
    assert block.ids_T.tolist() == alone.ids_T.tolist() + donors.ids_T.tolist()
    insts = list(nsp_instances(block, rng=random.Random(0), max_seq_len=32))
    doc_tok = block.doc_token_offsets()
    assert {i.a_doc for i in insts} == {0, 1, 2} and sum(i.is_random_next for i in insts) > 10
    for inst in insts:
        if inst.is_random_next:
            assert inst.b_doc >= 3 and doc_tok[inst.b_doc] <= inst.b_full[0] < inst.b_full[1] <= doc_tok[inst.b_doc + 1]


@pytest.mark.parametrize("max_seq_len", [32, 128, 512])
def test_nsp_labels_are_half_random_on_long_documents(max_seq_len):
    docs = synthetic_docs(1, num_docs=30, min_sents=100, max_sents=200, max_len=max_seq_len // 6)
    # short_seq_prob 0: a short target makes one-sentence chunks, which BERT always pairs randomly.
    labels = [
        i.is_random_next for i in nsp_instances(docs, rng=random.Random(3), max_seq_len=max_seq_len, short_seq_prob=0.0)
    ]
    assert len(labels) > 400 and 0.45 < np.mean(labels) < 0.56, (len(labels), np.mean(labels))


def test_short_seq_prob_gives_short_targets():
    docs = synthetic_docs(7, num_docs=60, max_sents=30, max_len=8)
    lengths = lambda p: [
        i.a[1] - i.a[0] + i.b[1] - i.b[0]
        for i in nsp_instances(docs, rng=random.Random(1), max_seq_len=128, short_seq_prob=p)  # noqa: E731
    ]
    assert np.mean(lengths(1.0)) < 0.75 * np.mean(lengths(0.0))


def test_assemble_nsp_layout():
    docs = synthetic_docs(3)
    for inst in list(nsp_instances(docs, rng=random.Random(2), max_seq_len=32))[:50]:
        ids, types, ws = assemble_nsp(docs, inst, cls_id=CLS, sep_id=SEP, dtype=np.uint16)
        la, lb = inst.a[1] - inst.a[0], inst.b[1] - inst.b[0]
        assert ids.dtype == np.uint16 and len(ids) == la + lb + 3
        assert ids.tolist() == [CLS, *docs.ids_T[inst.a[0] : inst.a[1]], SEP, *docs.ids_T[inst.b[0] : inst.b[1]], SEP]
        assert types.tolist() == [0] * (la + 2) + [1] * (lb + 1)
        expect = [
            1,
            1,
            *docs.word_starts_T[inst.a[0] + 1 : inst.a[1]],
            1,
            1,
            *docs.word_starts_T[inst.b[0] + 1 : inst.b[1]],
            1,
        ]
        assert ws.tolist() == expect


@pytest.mark.parametrize("max_seq_len", [8, 64])
def test_packed_blocks_are_exact_and_concatenate_to_the_stream(max_seq_len):
    packer = Packer(max_seq_len=max_seq_len, cls_id=CLS, sep_id=SEP, dtype=np.uint16)
    stream, stream_ws, blocks, block_ws, langs, doc_starts = [], [], [], [], [], []
    for b in range(4):  # the stream continues across blocks of documents
        docs = synthetic_docs(10 + b, num_docs=7, max_len=9, langs=("en", "zh", "zh"))
        off = docs.doc_token_offsets()
        for d in range(docs.num_docs):
            doc_starts.append(len(stream))
            stream += docs.ids_T[off[d] : off[d + 1]].tolist() + [SEP]
            stream_ws += docs.word_starts_T[off[d] : off[d + 1]].tolist() + [1]
        ids_NL, ws_NL, block_langs = packer.add(docs)
        assert ids_NL.shape[1] == max_seq_len and ids_NL.dtype == np.uint16
        blocks += ids_NL.tolist()
        block_ws += ws_NL.tolist()
        langs += block_langs
    used = len(blocks) * (max_seq_len - 1)
    assert all(row[0] == CLS for row in blocks)
    assert [t for row in blocks for t in row[1:]] == stream[:used]
    for i, row in enumerate(block_ws):
        lo = i * (max_seq_len - 1)
        assert row[:2] == [1, 1] and row[2:] == stream_ws[lo + 1 : lo + max_seq_len - 1]
    assert packer.tail() == (len(stream) - used, sum(s >= used for s in doc_starts))
    assert set(langs) <= {"en", "zh"} and "zh" in langs


def test_fast_mds_encoder_matches_streaming(tmp_path):
    from streaming import MDSWriter

    rng = np.random.default_rng(0)
    for fmt, vocab in (("nsp", 30000), ("packed", 70000)):
        columns = columns_for(fmt=fmt, vocab_size=vocab)
        dtype = np.uint16 if vocab <= 65536 else np.uint32
        fast = make_fast_writer_class()(out=str(tmp_path / f"f{fmt}"), columns=columns)
        stock = MDSWriter(out=str(tmp_path / f"s{fmt}"), columns=columns)
        for n in (1, 5, 255, 256, 65535, 70000):
            sample = {
                "input_ids": rng.integers(0, vocab, n).astype(dtype),
                "token_type_ids": rng.integers(0, 2, n).astype(np.uint8),
                "word_starts": rng.integers(0, 2, n).astype(np.uint8),
                "lang": "zh" if n % 2 else "en",
            }
            if fmt == "nsp":
                sample["nsp_label"] = int(n % 2)
            assert fast.encode_sample(sample) == stock.encode_sample(sample)
        with pytest.raises(ValueError, match="input_ids: expected a non-empty 1-D"):
            fast.encode_sample({**sample, "input_ids": np.zeros(0, dtype=dtype)})


def _random_samples(rng, *, fmt: str, vocab: int, n: int) -> list[dict]:
    dtype = np.uint16 if vocab <= 65536 else np.uint32
    out = []
    for i in range(n):
        length = int(rng.integers(1, 300))
        sample = {
            "input_ids": rng.integers(0, vocab, length).astype(dtype),
            "token_type_ids": rng.integers(0, 2, length).astype(np.uint8),
            "word_starts": rng.integers(0, 2, length).astype(np.uint8),
            "lang": "zh" if i % 3 else "en",
        }
        if fmt == "nsp":
            sample["nsp_label"] = int(i % 2)
        out.append(sample)
    return out


@pytest.mark.parametrize("fmt,vocab", [("nsp", 30000), ("packed", 70000)])
def test_local_writer_writes_streamings_files_byte_for_byte(tmp_path, fmt, vocab):
    """LocalMDSWriter (no streaming import in the workers) must write exactly what
    streaming.MDSWriter writes: every shard file and index.json, several shards included; and the
    merged root index must equal streaming's merge_index, read back by StreamingDataset."""
    from streaming import MDSWriter, StreamingDataset
    from streaming.base.util import merge_index

    rng = np.random.default_rng(1)
    columns = columns_for(fmt=fmt, vocab_size=vocab)
    parts = {
        "part-00000": _random_samples(rng, fmt=fmt, vocab=vocab, n=150),
        "part-00001": _random_samples(rng, fmt=fmt, vocab=vocab, n=40),
    }
    for root, make in (
        ("ours", lambda d: LocalMDSWriter(out=d, columns=columns, size_limit=20_000)),
        ("stock", lambda d: MDSWriter(out=d, columns=columns, compression="zstd", hashes=["xxh64"], size_limit=20_000)),
    ):
        for name, samples in parts.items():
            with make(str(tmp_path / root / name)) as writer:
                for sample in samples:
                    writer.write(sample)
    names = sorted(parts)
    merge_local_indexes(str(tmp_path / "ours"), names)
    merge_index([str(tmp_path / "stock" / n / "index.json") for n in names], str(tmp_path / "stock"), keep_local=True)
    files = sorted(p.relative_to(tmp_path / "stock") for p in (tmp_path / "stock").rglob("*") if p.is_file())
    assert len([f for f in files if f.name.endswith(".zstd")]) > 3  # several shards per part
    assert files == sorted(p.relative_to(tmp_path / "ours") for p in (tmp_path / "ours").rglob("*") if p.is_file())
    for f in files:
        if f.name == "index.json":
            assert json.loads((tmp_path / "ours" / f).read_text()) == json.loads(
                (tmp_path / "stock" / f).read_text()
            ), f
        else:
            assert (tmp_path / "ours" / f).read_bytes() == (tmp_path / "stock" / f).read_bytes(), f
    ds = StreamingDataset(local=str(tmp_path / "ours"), batch_size=1, shuffle=False)
    expected = parts["part-00000"] + parts["part-00001"]
    assert len(ds) == len(expected)
    for i in (0, 77, 149, 150, 189):
        got = ds[i]
        assert np.array_equal(got["input_ids"], expected[i]["input_ids"]) and got["lang"] == expected[i]["lang"]
