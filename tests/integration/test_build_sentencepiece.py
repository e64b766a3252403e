"""--train_tokenizer sentencepiece: a real SentencePiece model (unigram and BPE) whose Hugging Face
folder gives exactly the `.model` file's ids on held-out English and Chinese text, round-trips,
trains reproducibly, keeps BERT's special tokens, gets word starts by SentencePiece's '▁'
convention (rjieba's words in Chinese), and builds shards a trainer run learns from. Also: the
datasets-folder reader lists its Arrow files through datasets' public API (issue 14, item 6)."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import numpy as np
import pytest
import rjieba

from preprocessing.errors import UsageError
from preprocessing.shard_format import BuildManifest
from preprocessing.text import clean_text, split_sentences
from tests.support.builder import SAMPLE_EN, SAMPLE_ZH, read_samples, squash, write_bert_text, write_jsonl

CJK = lambda ch: "\u4e00" <= ch <= "\u9fff"  # noqa: E731  (enough for the sample text)
# Text no sample holds: rare ideographs (outside a 0.9995 character coverage, so [UNK]),
# mixed scripts, full-width forms, repeated and odd spaces, and the special tokens typed as text.
ODD = [
    "龘龘靐齉是生僻字,iPhone12手机售价3.5%的A股。",
    "卡拉OK和T恤在2018年很流行。",
    "  leading   and trailing  ",
    "ＡＢＣ１２３\u3000全角",
    "tab\there\nnewline",
    "ﬁ ligature ℃ ½",
    "Ünïcödé façade naïve",
    "𠀀𠀁 astral",
    "hello 北京 world",
    "[CLS] typed [SEP] as [MASK] text [UNK] [PAD]",
    "▁already marked",
    "",
]


# ---- corpora -------------------------------------------------------------------------------------
def sample_docs() -> tuple[list[list[str]], list[list[str]]]:
    """The repo's sample corpus as documents (lists of lines): English, Chinese."""
    en = [block.splitlines() for block in SAMPLE_EN.read_text(encoding="utf-8").split("\n\n") if block.strip()]
    zh = [
        json.loads(line)["text"].split("\n")
        for line in SAMPLE_ZH.read_text(encoding="utf-8").splitlines()
        if line.strip()
    ]
    return en, zh


def split_train_held_out():
    """Two thirds of each language's documents to train on, the rest held out (raw lines)."""
    en, zh = sample_docs()
    cut_en, cut_zh = 2 * len(en) // 3, 2 * len(zh) // 3
    train = [clean_text(line) for doc in en[:cut_en] + zh[:cut_zh] for line in doc]
    held = {
        "en": [line for doc in en[cut_en:] for line in doc if line.strip()],
        "zh": [line for doc in zh[cut_zh:] for line in doc if line.strip()],
    }
    return [t for t in train if t], held


def sentences_of(lines: list[str], lang: str) -> list[str]:
    """What the builder encodes: cleaned lines split into sentences."""
    return [s for line in lines for s in split_sentences(clean_text(line), lang)]


@pytest.fixture(scope="module")
def data():
    return split_train_held_out()


@pytest.fixture(scope="module", params=["unigram", "bpe"])
def sp_dir(request, data, tmp_path_factory) -> Path:
    """OUTPUT/tokenizer as the builder writes it for --train_tokenizer sentencepiece."""
    from preprocessing.tokenization import prepare_tokenizer

    out = tmp_path_factory.mktemp(request.param) / "tokenizer"
    info = prepare_tokenizer(
        tokenizer=None,
        train="sentencepiece",
        sp_model_type=request.param,
        vocab_size=2000,
        lowercase=True,
        out_dir=out,
        texts=lambda: iter(data[0]),
    )
    assert info.kind == "sentencepiece" and (info.cls_id, info.sep_id, info.unk_id) == (2, 3, 1)
    return out


def sp_of(folder: Path):
    import sentencepiece as spm

    return spm.SentencePieceProcessor(model_file=str(folder / "spiece.model"))


# ---- the HF folder against the .model file ---------------------------------------------------------
def test_folder_is_a_fast_hf_tokenizer_with_bert_specials(sp_dir):
    from sentencepiece import sentencepiece_model_pb2 as pb
    from transformers import AutoTokenizer

    from preprocessing.tokenization import describe

    tok = AutoTokenizer.from_pretrained(sp_dir)
    sp = sp_of(sp_dir)
    assert tok.is_fast and len(tok) == sp.get_piece_size() == describe(sp_dir, source="t").vocab_size
    expected = {"[PAD]": 0, "[UNK]": 1, "[CLS]": 2, "[SEP]": 3, "[MASK]": 4}
    assert {t: tok.convert_tokens_to_ids(t) for t in expected} == expected
    assert {t: sp.piece_to_id(t) for t in expected} == expected
    assert (tok.pad_token_id, tok.unk_token_id, tok.cls_token_id, tok.sep_token_id, tok.mask_token_id) == (
        0,
        1,
        2,
        3,
        4,
    )
    assert sorted(tok.all_special_ids) == [0, 1, 2, 3, 4]
    assert [sp.is_control(i) for i in (0, 2, 3, 4)] == [True] * 4 and sp.is_unknown(1)
    m = pb.ModelProto()
    m.ParseFromString((sp_dir / "spiece.model").read_bytes())
    model_type = json.loads((sp_dir / "tokenizer.json").read_text())["model"]["type"]
    assert (m.trainer_spec.model_type, model_type) in ((pb.TrainerSpec.UNIGRAM, "Unigram"), (pb.TrainerSpec.BPE, "BPE"))
    assert m.trainer_spec.character_coverage == pytest.approx(0.9995) and m.trainer_spec.split_by_unicode_script
    # BERT's pair layout, which the builder assembles from cls/sep ids.
    a, b = "The river is wide.", "长城很长。"
    pair = tok(a, b)
    assert pair["input_ids"] == [2, *sp.encode(clean_text(a)), 3, *sp.encode(b), 3]
    n_a = len(sp.encode(a)) + 2
    assert pair["token_type_ids"] == [0] * n_a + [1] * (len(pair["input_ids"]) - n_a)


@pytest.mark.parametrize("lang", ["en", "zh"])
def test_hf_ids_equal_sentencepiece_ids_on_held_out_text(sp_dir, data, lang):
    from transformers import AutoTokenizer

    from preprocessing.tokenization import SentenceEncoder

    tok = AutoTokenizer.from_pretrained(sp_dir)
    sp = sp_of(sp_dir)
    held = data[1][lang]
    texts = held + sentences_of(held, lang)  # raw lines, and the builder's sentences
    got = tok(texts, add_special_tokens=False)["input_ids"]
    want = sp.encode(texts)
    assert [i for i in range(len(texts)) if got[i] != want[i]] == []
    assert tok(texts[0])["input_ids"] == [2, *want[0], 3]
    # The builder's own encoder agrees too.
    encoder = SentenceEncoder((sp_dir / "tokenizer.json").read_text())
    ids, lengths, _ = encoder.encode(texts)
    assert ids.tolist() == [i for w in want for i in w] and lengths.tolist() == [len(w) for w in want]
    flat = [sp.id_to_piece(i) for w in want for i in w]
    if lang == "zh":  # the test sees real SentencePiece Chinese: multi-ideograph pieces and unknown characters
        assert sum(len(p.lstrip("▁")) > 1 and all(map(CJK, p.lstrip("▁"))) for p in flat) > 20
        assert sum(i == 1 for w in want for i in w) > 0


@pytest.mark.corpora
@pytest.mark.parametrize("model_type", ["unigram", "bpe"])
def test_real_corpora_hf_ids_equal_sentencepiece_ids(corpora, tmp_path, model_type):
    """Trained as the builder trains it (training_texts over the planned chunks, 1 MB sampled from
    Wikipedia, court rulings and the classic novels); held out: later Wikipedia articles and
    THUCNews, another domain, so unknown characters and unseen words occur."""
    from transformers import AutoTokenizer

    from preprocessing.inputs import plan_chunks, resolve_inputs
    from preprocessing.tokenization import prepare_tokenizer, training_texts

    files = resolve_inputs(
        [
            f"en:{corpora / 'en' / 'enwiki_sample.jsonl'}",
            f"zh:{corpora / 'zh' / 'court_judgments.txt'}",
            f"zh:{corpora / 'zh' / 'four_classic_novels.txt'}",
        ]
    )
    chunks = plan_chunks(files, chunk_bytes=64 << 20, text_field="text")
    out = tmp_path / "tokenizer"
    prepare_tokenizer(
        tokenizer=None,
        train="sentencepiece",
        sp_model_type=model_type,
        vocab_size=8000,
        lowercase=True,
        out_dir=out,
        texts=lambda: training_texts(chunks, text_field="text", budget_bytes=1 << 20),
    )
    tok, sp = AutoTokenizer.from_pretrained(out), sp_of(out)
    with open(corpora / "en" / "enwiki_wikiextractor.txt", encoding="utf-8") as f:
        f.seek(20 << 20)  # well past the 5 MB that enwiki_sample.jsonl holds
        f.readline()
        en = [line.strip() for line in f.readlines(400_000) if line.strip()]
    with open(corpora / "zh" / "thucnews_cnews.txt", encoding="utf-8") as f:
        zh = [line.strip() for line in f.readlines(400_000) if line.strip()]
    for lang, lines in (("en", en), ("zh", zh)):
        texts = lines + sentences_of(lines, lang)
        got = tok(texts, add_special_tokens=False)["input_ids"]
        want = sp.encode(texts)
        assert [t for t, g, w in zip(texts, got, want) if g != w] == [], lang
        assert sum(map(len, want)) > 50_000
    assert sum(i == 1 for w in sp.encode(zh) for i in w) > 0  # unknown characters were met


def test_odd_text_gives_sentencepiece_ids(sp_dir):
    """Spaces, full-width forms, unknown characters, and special tokens typed as text. sentencepiece
    never makes a control symbol from text, nor does the builder's encoder; AutoTokenizer does
    (HF's added tokens are matched in the raw text, for every HF tokenizer), so it is compared on
    the rest."""
    from transformers import AutoTokenizer

    from preprocessing.tokenization import SentenceEncoder

    tok = AutoTokenizer.from_pretrained(sp_dir)
    sp = sp_of(sp_dir)
    encoder = SentenceEncoder((sp_dir / "tokenizer.json").read_text())
    for text in ODD:
        ids, _, _ = encoder.encode([text])
        assert ids.tolist() == sp.encode(text), text
        if "[" not in text:
            assert tok(text, add_special_tokens=False)["input_ids"] == sp.encode(text), text
    typed = ODD[-3]
    assert not {0, 2, 3, 4} & set(sp.encode(typed))
    assert {2, 3, 4} <= set(tok(typed, add_special_tokens=False)["input_ids"])
    assert 1 in sp.encode(ODD[0])  # the rare ideographs are unknown: fused into [UNK]s


def test_ties_between_equal_paths_break_as_sentencepiece_breaks_them(sp_dir, data):
    """ "......" is both "." + "....." and "....." + "."-like orders of the same pieces: an exact
    tie that sentencepiece's float32 sums and HF's float64 sums once broke differently, after a
    sentence of English (20 of these 1,260 texts, before unigram scores were put on a grid)."""
    from transformers import AutoTokenizer

    tok, sp = AutoTokenizer.from_pretrained(sp_dir), sp_of(sp_dir)
    sents = sentences_of(data[1]["en"], "en") + sentences_of(data[1]["zh"], "zh")
    runs = ("....", "......", "。。。。", "!!!!", "————", "哈哈哈哈哈")
    texts = [a + sep + b for a, b in zip(sents, sents[1:]) for sep in runs]
    got = tok(texts, add_special_tokens=False)["input_ids"]
    assert [t for t, g, w in zip(texts, got, sp.encode(texts)) if g != w] == []


def test_decode_round_trips(sp_dir, data):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(sp_dir)
    sp = sp_of(sp_dir)
    checked = 0
    for lang in ("en", "zh"):
        for text in sentences_of(data[1][lang], lang):
            ids = tok(text)["input_ids"]
            decoded = tok.decode(ids, skip_special_tokens=True)
            if 1 not in ids:  # no unknown character (HF skips [UNK], sentencepiece writes " ⁇ ")
                assert decoded == sp.decode(ids[1:-1])  # sentencepiece's own decoding, spaces included
                assert squash(decoded) == squash(text), text
                assert decoded == " ".join(text.lower().split())  # sample text: casefold == lower
                checked += 1
    assert checked > 100


# ---- training ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("model_type", ["unigram", "bpe"])
def test_training_is_reproducible_for_a_fixed_thread_count(data, model_type):
    """The same texts give the same .model bytes (and so the same tokenizer.json), including from a
    one-shot generator (sentencepiece reads its texts once). The unigram model depends on the thread
    count, which is why training fixes it (TRAIN_THREADS); BPE's pieces do not."""
    import sentencepiece as spm

    from preprocessing.sentencepiece_tokenizer import TRAIN_THREADS, train_sentencepiece

    texts = data[0]
    runs = [train_sentencepiece(texts, vocab_size=2000, model_type=model_type) for _ in range(2)]
    runs.append(train_sentencepiece((t for t in texts), vocab_size=2000, model_type=model_type))
    assert len(set(runs)) == 1
    one = train_sentencepiece(texts, vocab_size=2000, model_type=model_type, num_threads=1)
    assert TRAIN_THREADS != 1

    def pieces(proto):
        sp = spm.SentencePieceProcessor(model_proto=proto)
        return [(sp.id_to_piece(i), sp.get_score(i)) for i in range(sp.get_piece_size())]

    assert (pieces(one) == pieces(runs[0])) == (model_type == "bpe")


def test_cased_training_keeps_case_and_its_control_pieces_unreachable(data):
    from preprocessing.sentencepiece_tokenizer import hf_tokenizer_from_sentencepiece, train_sentencepiece

    proto = train_sentencepiece(data[0] + ["[CLS] [SEP] [MASK] [UNK] [PAD]"], vocab_size=2000, lowercase=False)
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_proto=proto)
    tok = hf_tokenizer_from_sentencepiece(proto)
    tok.encode_special_tokens = True
    for text in ["The River", "THE RIVER", *ODD]:
        assert tok.encode(text, add_special_tokens=False).ids == sp.encode(text), text
    assert sp.encode("The") != sp.encode("the")


def test_bad_requests_are_usage_errors(data, tmp_path):
    from preprocessing.sentencepiece_tokenizer import train_sentencepiece

    zh_text = [t for t in data[0] if any(map(CJK, t))]
    with pytest.raises(UsageError, match="--vocab_size 100: smaller than the characters"):
        train_sentencepiece(zh_text, vocab_size=100)
    with pytest.raises(UsageError, match="no text to train on"):
        train_sentencepiece([], vocab_size=2000)
    with pytest.raises(UsageError, match="--sp_model_type char"):
        train_sentencepiece(zh_text, vocab_size=2000, model_type="char")

    def broken():
        yield "one line"
        raise UsageError("--input x.jsonl: line 2 is not JSON")

    # the reader's own error, not sentencepiece's RuntimeError around it
    with pytest.raises(UsageError, match="line 2 is not JSON"):
        train_sentencepiece(broken(), vocab_size=2000)


def test_command_line_flags(tmp_path, capsys):
    from preprocessing.builder import main
    from preprocessing.config import parse_args

    text = tmp_path / "a.txt"
    text.write_text("One sentence here.\n\nAnother document.\n")
    base = ["--input", str(text), "--output", str(tmp_path / "out")]
    assert parse_args(base + ["--train_tokenizer", "sentencepiece"]).sp_model_type == "unigram"
    assert parse_args(base + ["--train_tokenizer", "wordpiece"]).sp_model_type is None
    assert parse_args(base + ["--train_tokenizer", "sentencepiece", "--sp_model_type", "bpe"]).sp_model_type == "bpe"
    assert parse_args(base + ["--train_tokenizer", "unigram"]).train_tokenizer == "unigram"
    assert main(base + ["--train_tokenizer", "wordpiece", "--sp_model_type", "bpe"]) == 2
    assert "--sp_model_type bpe: only applies to --train_tokenizer sentencepiece" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:  # argparse names the flag and its choices
        parse_args(base + ["--train_tokenizer", "sentencepiece", "--sp_model_type", "char"])
    assert exit_info.value.code == 2 and "--sp_model_type" in capsys.readouterr().err
    assert not (tmp_path / "out" / "build_manifest.json").exists()


# ---- word starts -----------------------------------------------------------------------------------
def reference_sp_starts(tokenizer, sentence: str, *, zh: bool) -> list[int]:
    """Word starts of one sentence, token by token with offsets (`tokenizer`: a tokenizers.Tokenizer):
    the first token starts a word; a token right after a bare '▁' does not (that '▁' started its
    word); a '▁' token does; in Chinese any other token starts where rjieba starts a word at its first
    character; elsewhere a token starts a word when it begins with an ideograph."""
    starts, pos = set(), 0
    for word in rjieba.cut(sentence):
        starts.add(pos)
        pos += len(word)
    e = tokenizer.encode(sentence, add_special_tokens=False)
    out = []
    for j, (token, (lo, _)) in enumerate(zip(e.tokens, e.offsets)):
        if j == 0:
            out.append(1)
        elif e.tokens[j - 1] == "▁":
            out.append(0)
        elif token.startswith("▁"):
            out.append(1)
        elif zh:
            out.append(int(lo in starts))
        else:
            out.append(int(token != "[UNK]" and CJK(token[0])))
    return out


def test_spelled_positions_are_the_offsets(sp_dir, data):
    """words.py's vectorised alignment (token lengths added up) gives every token's first character
    as HF's offsets do, in every sentence without an [UNK]; a sentence with one is left to offsets."""
    from preprocessing.tokenization import SentenceEncoder
    from preprocessing.words import spelled_char_positions

    encoder = SentenceEncoder((sp_dir / "tokenizer.json").read_text())
    # The builder's (cleaned) sentences, then one whose spaces the normaliser collapses.
    sentences = sentences_of(data[1]["zh"] + data[1]["en"], "zh") + [clean_text(s) for s in ODD[:2]] + [ODD[2]]
    ids, lengths, encodings = encoder.encode(sentences, offsets=True)
    char_t, ok_S = spelled_char_positions(
        encoder, ids_t=ids.astype(np.int64), n_tok=lengths, char_lens=np.array([len(s) for s in sentences])
    )
    has_unk = np.array([1 in e.ids for e in encodings])
    assert (ok_S[:-1] == ~has_unk[:-1]).all() and not ok_S[-1]
    assert ok_S.sum() > 100 and has_unk.sum() > 0
    starts = np.concatenate([[0], np.cumsum(lengths)])
    for i in np.flatnonzero(ok_S):
        e = encodings[i]
        expected = [
            -1 if j == 0 and token.startswith("▁") else lo  # the '▁' sentencepiece puts in front
            for j, (token, (lo, _)) in enumerate(zip(e.tokens, e.offsets))
        ]
        assert char_t[starts[i] : starts[i + 1]].tolist() == expected, sentences[i]


def test_word_starts_follow_the_marker_and_rjieba(sp_dir, data):
    from tokenizers import Tokenizer

    from preprocessing.tokenization import SentenceEncoder
    from preprocessing.words import word_starts

    raw = Tokenizer.from_file(str(sp_dir / "tokenizer.json"))
    raw.encode_special_tokens = True
    en_lines, zh_lines = data[1]["en"] + sample_docs()[0][0], data[1]["zh"] + sample_docs()[1][0]
    # English text with Chinese words glued to it: a multi-ideograph piece after a Latin one
    words = sorted(p for p in raw.get_vocab() if len(p) > 1 and all(map(CJK, p)))[:30]
    glued = [f"the{a}and{b} in 2018{a}." for a, b in zip(words[::2], words[1::2])]
    sentences = sentences_of(en_lines, "en") + [
        "Unbelievably, counter-intuitive re-entry in 2018!",
        "hello 北京 world",
        *glued,
    ]
    n_en = len(sentences)
    sentences += sentences_of(zh_lines, "zh") + [s for s in ODD[:3] + ODD[8:9] if s.strip()]
    zh = np.arange(len(sentences)) >= n_en
    encoder = SentenceEncoder((sp_dir / "tokenizer.json").read_text())
    assert encoder.spelled
    ids, lengths, encodings = encoder.encode(sentences)
    ws = word_starts(encoder, ids_T=ids, lengths_S=lengths, encodings=encodings, sentences=sentences, zh_S=zh)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    for i, sentence in enumerate(sentences):
        assert ws[offsets[i] : offsets[i + 1]].tolist() == reference_sp_starts(raw, sentence, zh=bool(zh[i])), sentence
    # The test exercises real words: Chinese words of several tokens, pieces of several ideographs,
    # non-ideograph tokens rjieba starts words at, and sentences aligned by offsets ([UNK]).
    zh_tokens = slice(offsets[n_en], None)
    pieces = [encoder.tok.id_to_token(int(t)) for t in ids[zh_tokens]]
    assert (ws[zh_tokens] == 0).sum() > 100 and sum(len(p) > 1 and all(map(CJK, p)) for p in pieces) > 20
    assert sum(f == 1 and not p.startswith("▁") and not CJK(p[0]) for p, f in zip(pieces, ws[zh_tokens])) > 20
    assert 1 in ids[zh_tokens]
    en_pieces = [encoder.tok.id_to_token(int(t)) for t in ids[: offsets[n_en]]]
    assert (
        sum(
            len(p) > 1 and all(map(CJK, p)) and f == 1 and q != "▁"
            for p, q, f in zip(en_pieces[1:], en_pieces, ws[1 : offsets[n_en]])
        )
        > 10
    )


# ---- the builder and the trainer -------------------------------------------------------------------
@pytest.fixture(scope="module")
def ray_here():
    """One Ray on 127.0.0.1 for the module (conftest keeps Ray on loopback)."""
    import ray

    started = not ray.is_initialized()
    if started:
        ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level=logging.WARNING)
    assert ray.util.get_node_ip_address() == "127.0.0.1"
    yield ray
    if started:
        ray.shutdown()


def build(
    tmp_path: Path,
    *,
    model_type: str,
    fmt: str,
    max_seq_len: int,
    out_name: str,
    docs: tuple[list[list[str]], list[list[str]]] | None = None,
) -> tuple[Path, BuildManifest, list]:
    """Shards of English (BERT text) and Chinese (JSONL) documents, by default the sample corpus,
    with a SentencePiece tokenizer the builder trains on them. Returns (OUTPUT, manifest, the
    documents in input order with their languages). Needs an initialised Ray."""
    from preprocessing.builder import build_shards
    from preprocessing.config import BuildConfig

    en, zh = docs or sample_docs()
    d = tmp_path / f"{out_name}_inputs"
    d.mkdir()
    write_bert_text(d / "en.txt", en)
    write_jsonl(d / "zh.jsonl", zh)
    out = tmp_path / out_name
    cfg = BuildConfig(
        inputs=[f"en:{d / 'en.txt'}", f"zh:{d / 'zh.jsonl'}"],
        output=str(out),
        train_tokenizer="sentencepiece",
        sp_model_type=model_type,
        vocab_size=2000,
        format=fmt,
        max_seq_len=max_seq_len,
        chunk_mb=64,
        num_workers=2,
        seed=3,
        progress=False,
    )
    return out, build_shards(cfg), [(doc, "en") for doc in en] + [(doc, "zh") for doc in zh]


@pytest.mark.multiproc
@pytest.mark.parametrize("model_type", ["unigram", "bpe"])
def test_shard_build_holds_sentencepiece_ids_and_word_starts(ray_here, tmp_path, model_type):
    """Packed shards: each part's token stream is exactly sentencepiece's ids of every sentence of
    its documents, a [SEP] after each document, cut into [CLS] + block samples; word starts are
    the reference's."""
    from tokenizers import Tokenizer

    out, manifest, docs = build(tmp_path, model_type=model_type, fmt="packed", max_seq_len=64, out_name="packed")
    tok_dir = out / "tokenizer"
    assert manifest.tokenizer.kind == "sentencepiece" and manifest.config["sp_model_type"] == model_type
    assert (tok_dir / "spiece.model").is_file() and manifest.chunks == 2
    sp = sp_of(tok_dir)
    raw = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    raw.encode_special_tokens = True
    index = json.loads((out / "index.json").read_text())
    samples = read_samples(out)
    by_part: dict[str, list] = {}
    pos = 0
    for shard in index["shards"]:
        by_part.setdefault(shard["raw_data"]["basename"].split("/")[0], []).extend(
            samples[pos : pos + shard["samples"]]
        )
        pos += shard["samples"]
    assert len(by_part) == 2
    for (name, part), lang in zip(sorted(by_part.items()), ("en", "zh")):
        expected, expected_ws = [], []
        for lines, doc_lang in docs:
            if doc_lang == lang:
                for s in sentences_of(lines, lang):
                    expected += sp.encode(s)
                    expected_ws += reference_sp_starts(raw, s, zh=lang == "zh")
                expected += [3]
                expected_ws += [1]
        assert all(s["input_ids"][0] == 2 and len(s["input_ids"]) == 64 for s in part)
        stream = [t for s in part for t in s["input_ids"][1:].tolist()]
        stream_ws = [w for s in part for w in s["word_starts"][1:].tolist()]
        assert len(stream) > 0.9 * len(expected) and stream == expected[: len(stream)], name
        for k, (got, want) in enumerate(zip(stream_ws, expected_ws)):
            if k % 63 and stream[k] != 3:  # a sample's first token always starts a word; [SEP] is special
                assert got == want, (name, k)
        assert {s["lang"] for s in part} == {lang}


@pytest.mark.multiproc
def test_trainer_runs_from_sentencepiece_shards(ray_here, tmp_path):
    """MLM with whole-word masking learns from --train_tokenizer sentencepiece shards, launched as
    the trainer tests launch it (2 CPU ranks, the tiny model, their small English and Chinese
    grammar, which a few dozen steps can learn); the trainer takes DATA/tokenizer."""
    from transformers import AutoTokenizer

    from tests.support.trainer import (
        corpus,
        explain,
        free_port,
        read_metrics,
        run_deepspeed,
        train_args,
        write_ds_config,
    )

    docs = (corpus(40, seed=1, lang="en"), corpus(40, seed=2, lang="zh"))
    out, manifest, _ = build(tmp_path, model_type="unigram", fmt="packed", max_seq_len=32, out_name="shards", docs=docs)
    tok = AutoTokenizer.from_pretrained(out / "tokenizer")
    assert manifest.tokenizer.vocab_size == len(tok) and manifest.counts.samples > 40
    assert any(len(p) > 1 and all(map(CJK, p)) for p in tok.get_vocab())  # SentencePiece's Chinese words
    ds = write_ds_config(tmp_path / "ds.json", micro=4)
    save = tmp_path / "run"
    # A generous timeout: DeepSpeed JIT-builds its CPU ops (minutes) whenever another checkout of
    # this repo has rebuilt them from its own path since.
    proc = run_deepspeed(
        free_port(),
        train_args(
            ds_config=ds,
            objective="mlm",
            data=[out],
            save_dir=save,
            max_steps=60,
            extra=["--lr", "5e-3", "--whole_word_masking"],
        ),
        timeout=800,
    )
    assert proc.returncode == 0, explain(proc)
    rows = read_metrics(save)
    assert [r["step"] for r in rows] == list(range(1, 61))
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in rows)
    # From ln(V) to what the grammar allows within a few dozen steps; the later steps are averaged
    # because a batch holds only some 40 masked tokens.
    mean = lambda part, key: sum(r[key] for r in part) / len(part)  # noqa: E731
    assert mean(rows[-15:], "mlm_loss") < 0.9 * mean(rows[:3], "mlm_loss")
    assert mean(rows[-15:], "mlm_acc") > mean(rows[:3], "mlm_acc") + 0.03
    config = json.loads((save / "config.json").read_text())
    assert str(out / "tokenizer") in json.dumps(config)


# ---- datasets folders (issue 14, item 6) ---------------------------------------------------------
def test_datasets_folder_files_come_from_the_public_api(tmp_path, monkeypatch):
    """A save_to_disk folder's Arrow files, listed by datasets.load_from_disk, keep the folder as
    spelled (a relative path stays relative) and the split order; a broken folder is a UsageError."""
    import datasets

    from preprocessing.inputs import resolve_inputs

    monkeypatch.chdir(tmp_path)
    datasets.Dataset.from_dict({"text": [f"row {i}" for i in range(300)]}).save_to_disk("hf", max_shard_size="1KB")
    datasets.DatasetDict(
        {"zeta": datasets.Dataset.from_dict({"text": ["z"]}), "alpha": datasets.Dataset.from_dict({"text": ["a"]})}
    ).save_to_disk("hfd")
    files = resolve_inputs(["hf", "hfd"])
    paths = [f.path for f in files]
    n = len(paths) - 2
    assert n > 1 and paths[:n] == [f"hf/data-{i:05d}-of-{n:05d}.arrow" for i in range(n)]
    assert paths[-2:] == ["hfd/zeta/data-00000-of-00001.arrow", "hfd/alpha/data-00000-of-00001.arrow"]
    next((tmp_path / "hf").glob("data-00001-*.arrow")).unlink()
    with pytest.raises(UsageError, match="--input hf: cannot open the datasets folder hf"):
        resolve_inputs(["hf"])
