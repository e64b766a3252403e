"""`--train_tokenizer sentencepiece`: a real SentencePiece model (the `sentencepiece` library's
trainer, unigram or BPE) trained on the builder's sampled text, and its conversion into a Hugging
Face fast tokenizer whose ids are exactly the `.model` file's (`SentencePieceProcessor.encode`).

Ids: [PAD] 0, [UNK] 1, [CLS] 2, [SEP] 3, [MASK] 4 (SPECIAL_TOKENS' order, as the other trained
kinds), then the pieces. [CLS]/[SEP]/[MASK] are control symbols, not user-defined ones: a corpus
that contains the text "[MASK]" must not produce the mask id (the builder's rule for every
tokenizer), and sentencepiece never emits a control symbol from text.
"""

from __future__ import annotations

import io
from collections.abc import Iterable, Iterator
from pathlib import Path

from preprocessing.errors import UsageError
from preprocessing.text import MAX_SENTENCE_CHARS, split_long
from preprocessing.tokenization import SP_MODEL_TYPES, SPECIAL_TOKENS, set_bert_post_processor

SP_MODEL_FILE = "spiece.model"  # the file name HF's SentencePiece tokenizers (T5, ALBERT) use
CHARACTER_COVERAGE = 0.9995  # sentencepiece's recommendation for Chinese/Japanese (1.0 keeps every rare character)
# The unigram trainer sums its EM statistics per thread and then over threads, so the model depends
# on the thread count (checked with sentencepiece 0.2.3 on 4 MB of en+zh text: 1, 2, 4 and 8 threads
# give four different vocabularies, each byte-identical when repeated; BPE's pieces do not change).
# A fixed count, not the machine's cores, makes every machine train the same model.
TRAIN_THREADS = 8
# Our options draw no random numbers (no input_sentence_size sampling: training_texts has already
# sampled the inputs); the generator is seeded anyway so a future default that does stays fixed.
TRAIN_SEED = 0
# sentencepiece skips longer lines; split_long caps a line at MAX_SENTENCE_CHARS characters, which
# is at most 4 bytes each in UTF-8.
MAX_SENTENCE_BYTES = 4 * MAX_SENTENCE_CHARS
# sentencepiece keeps control and unknown pieces out of its lattice; HF's Unigram has no such
# notion and would pick "[CLS]" (score 0) for the text "[CLS]". This score loses to any path of
# ordinary pieces (scores above -100 or so); see _required_chars for the case of unknown characters.
_NEVER_CHOSEN = -1e6
_NORMAL, _UNKNOWN, _CONTROL = 1, 2, 3  # sentencepiece_model.proto ModelProto.SentencePiece.Type
# Unigram scores are rounded to multiples of 2**-SCORE_BITS; see _exact_scores.
SCORE_BITS = 6


def train_sentencepiece(
    texts: Iterable[str],
    *,
    vocab_size: int,
    model_type: str = "unigram",
    lowercase: bool = True,
    num_threads: int = TRAIN_THREADS,
) -> bytes:
    """Train on `texts` (cleaned lines, read once) and return the serialized model (the bytes of a
    `.model` file). `vocab_size` counts the five special pieces and is an upper bound: a corpus
    too small for it yields fewer pieces, as HF's trainers do. The same texts and num_threads give
    the same bytes. Raises UsageError naming --vocab_size or the input when sentencepiece refuses
    the request."""
    import sentencepiece as spm

    if model_type not in SP_MODEL_TYPES:
        raise UsageError(f"--sp_model_type {model_type}: choose one of {', '.join(SP_MODEL_TYPES)}")
    _model_pb2()  # a protobuf that cannot read the model fails now, not after the training
    lines = _Lines(texts)
    model = io.BytesIO()
    spm.set_random_generator_seed(TRAIN_SEED)
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=lines,
            model_writer=model,
            **_trainer_options(
                model_type=model_type, vocab_size=vocab_size, lowercase=lowercase, num_threads=num_threads
            ),
        )
    except (RuntimeError, SystemError) as err:  # sentencepiece 0.2.0 reports a failed iterator as SystemError
        _explain_failure(err, lines=lines, vocab_size=vocab_size)
        raise
    proto = model.getvalue()
    if model_type == "unigram":
        proto = _exact_scores(proto)
    ids = _piece_ids(proto, SPECIAL_TOKENS)
    assert ids == list(range(len(SPECIAL_TOKENS))), ids
    return proto


def _trainer_options(*, model_type: str, vocab_size: int, lowercase: bool, num_threads: int) -> dict:
    """SentencePieceTrainer.train's options: our special pieces and ids, normalisation, and no sampling."""
    return dict(
        model_type=model_type,
        vocab_size=vocab_size,
        character_coverage=CHARACTER_COVERAGE,
        split_by_unicode_script=True,
        # nmt_nfkc is sentencepiece's default rule; _cf adds Unicode case folding.
        normalization_rule_name="nmt_nfkc_cf" if lowercase else "nmt_nfkc",
        pad_id=0,
        pad_piece="[PAD]",
        unk_id=1,
        unk_piece="[UNK]",
        bos_id=-1,
        eos_id=-1,
        control_symbols=["[CLS]", "[SEP]", "[MASK]"],
        required_chars=_required_chars(lowercase),
        hard_vocab_limit=False,
        max_sentence_length=MAX_SENTENCE_BYTES,
        input_sentence_size=0,
        num_threads=num_threads,
        minloglevel=1,
    )


def _explain_failure(err: BaseException, *, lines: _Lines, vocab_size: int) -> None:
    """Called while handling the trainer's error `err`: raises what the user can act on (the reader's own
    exception, no text, a --vocab_size too small); returns for any other error, which the caller re-raises."""
    if lines.error is not None:  # the reader failed; sentencepiece wraps it in a RuntimeError
        raise lines.error from None
    if lines.count == 0:
        raise UsageError("--train_tokenizer sentencepiece: the inputs hold no text to train on") from err
    if "Vocabulary size is smaller than required_chars" in str(err):
        raise UsageError(
            f"--vocab_size {vocab_size}: smaller than the characters sentencepiece must "
            f"keep ({err}); raise --vocab_size"
        ) from err


class _Lines:
    """The iterator sentencepiece pulls lines from: long lines cut to fit max_sentence_length, and
    any exception of the underlying reader kept (sentencepiece turns it into a bare RuntimeError)."""

    def __init__(self, texts: Iterable[str]):
        self._it = iter(texts)
        self._pending: list[str] = []
        self.count = 0
        self.error: BaseException | None = None

    def __iter__(self) -> Iterator[str]:
        return self

    def __next__(self) -> str:
        while not self._pending:
            try:
                line = next(self._it)
            except StopIteration:
                raise
            except BaseException as err:
                self.error = err
                raise
            self._pending = split_long(line)[::-1]  # pieces of at most MAX_SENTENCE_CHARS
        self.count += 1
        return self._pending.pop()


def _required_chars(lowercase: bool) -> str:
    """Cased text keeps "[CLS]" as typed, and if one of its characters were outside the vocabulary
    the HF tokenizer's best path could be the control piece itself (an unknown character costs
    more than _NEVER_CHOSEN). Requiring those few characters rules that out. Case-folded text can
    never spell the upper-case control pieces."""
    return "" if lowercase else "".join(sorted(set("".join(SPECIAL_TOKENS))))


def _model_pb2():
    """sentencepiece's generated ModelProto module. Its code from sentencepiece 0.2.3 on checks the
    protobuf runtime (0.2.3: protobuf >= 7.36.1, < 8); say so instead of protobuf's bare error."""
    try:
        from sentencepiece import sentencepiece_model_pb2
    except Exception as err:  # ImportError (no protobuf, or one without runtime_version) or VersionError
        import importlib.metadata as md

        def version(name: str) -> str:
            try:
                return md.version(name)
            except md.PackageNotFoundError:
                return "not installed"

        raise UsageError(
            f"--train_tokenizer sentencepiece: sentencepiece {version('sentencepiece')} cannot read its model "
            f"file with protobuf {version('protobuf')} ({type(err).__name__}: {err}); install the protobuf "
            "its model code was generated for (pip install -U protobuf), or sentencepiece<0.2.3 with "
            "protobuf>=3.20"
        ) from err
    return sentencepiece_model_pb2


def _exact_scores(proto: bytes) -> bytes:
    """The model with every unigram score rounded to a multiple of 2**-SCORE_BITS (at most 0.008
    off a log-probability). Both Viterbi implementations break ties between equal-scoring paths
    the same way, but sentencepiece adds path scores in float32 and HF tokenizers in float64, so
    a tie such as "...." = "." + "..." or "..." + "." could round differently (it did, on about
    1 Chinese news line in 6,000). On the grid every partial sum up to 2**(24 - SCORE_BITS) in
    magnitude (some 10,000 pieces, far more than a builder sentence) is exact in both, so both pick
    the same path."""
    m = _model_pb2().ModelProto()
    m.ParseFromString(proto)
    for piece in m.pieces:
        if piece.type == _NORMAL:
            piece.score = round(piece.score * (1 << SCORE_BITS)) / (1 << SCORE_BITS)
    return m.SerializeToString()


def _piece_ids(proto: bytes, pieces: list[str]) -> list[int]:
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_proto=proto)
    return [sp.piece_to_id(p) for p in pieces]


def hf_tokenizer_from_sentencepiece(proto: bytes):
    """A `tokenizers.Tokenizer` that gives the ids of the serialized SentencePiece model `proto`
    (unigram or BPE, no byte fallback), with BERT's [CLS] A [SEP] B [SEP] post-processor.

    SentencePiece normalises with a precompiled character map (NFKC, optionally case folding),
    drops leading, trailing and repeated spaces, prepends one '▁' and writes every space as '▁';
    the normalizer below does the same steps in the same order. The pre-tokenizer then splits at
    '▁' (no piece holds a '▁' after its first character, sentencepiece's split_by_whitespace), so
    HF's per-word cache works; unknown characters are fused into one [UNK] as sentencepiece does."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

    model_pb2 = _model_pb2()
    m = model_pb2.ModelProto()
    m.ParseFromString(proto)
    spec = m.trainer_spec
    if spec.byte_fallback:
        raise ValueError("a SentencePiece model with byte_fallback is not supported")
    pieces = [(p.piece, p.score, p.type) for p in m.pieces]
    if spec.model_type == model_pb2.TrainerSpec.UNIGRAM:
        model = models.Unigram(
            [(piece, score if kind == _NORMAL else _NEVER_CHOSEN) for piece, score, kind in pieces],
            unk_id=spec.unk_id,
            byte_fallback=False,
        )
    elif spec.model_type == model_pb2.TrainerSpec.BPE:
        model = models.BPE(
            {piece: i for i, (piece, _, _) in enumerate(pieces)},
            _bpe_merges(pieces),
            unk_token=spec.unk_piece,
            fuse_unk=True,
            byte_fallback=False,
        )
    else:
        raise ValueError(f"SentencePiece model type {spec.model_type} is neither unigram nor BPE")
    tok = Tokenizer(model)
    norm = m.normalizer_spec
    steps = [normalizers.Precompiled(norm.precompiled_charsmap)] if norm.precompiled_charsmap else []
    if norm.remove_extra_whitespaces:
        # sentencepiece counts only U+0020 as a space here (its character map has already turned
        # tabs, newlines and the other Unicode spaces into one); Strip() would remove more.
        steps += [normalizers.Replace(Regex(" {2,}"), " "), normalizers.Replace(Regex("^ | $"), "")]
    if norm.add_dummy_prefix:
        steps.append(normalizers.Prepend("▁"))
    steps.append(normalizers.Replace(" ", "▁"))
    tok.normalizer = normalizers.Sequence(steps)
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="never", split=True)
    tok.decoder = decoders.Metaspace(
        replacement="▁", prepend_scheme="always" if norm.add_dummy_prefix else "never", split=True
    )
    specials = [piece for piece, _, kind in pieces if kind in (_CONTROL, _UNKNOWN)]
    tok.add_special_tokens([AddedToken(p, special=True, normalized=False) for p in specials])
    set_bert_post_processor(tok)
    return tok


def _bpe_merges(pieces: list[tuple[str, float, int]]) -> list[tuple[str, str]]:
    """HF BPE merges that reproduce sentencepiece's BPE encoder, which repeatedly joins the
    adjacent pair whose concatenation is the best-scoring piece (leftmost on ties): every split of
    every ordinary piece into two ordinary pieces, ranked by the joined piece's score. Control and
    unknown pieces are never formed by sentencepiece, so they get no merge."""
    normal = {piece for piece, _, kind in pieces if kind == _NORMAL}
    merges = []
    for i in sorted(range(len(pieces)), key=lambda i: (-pieces[i][1], i)):
        piece, _, kind = pieces[i]
        if kind != _NORMAL:
            continue
        merges += [(piece[:k], piece[k:]) for k in range(1, len(piece)) if piece[:k] in normal and piece[k:] in normal]
    return merges


def save_sentencepiece(proto: bytes, out_dir: Path) -> None:
    """Write an HF tokenizer folder that AutoTokenizer loads as a fast tokenizer (tokenizer.json,
    tokenizer_config.json, special_tokens_map.json) plus the `.model` file itself (SP_MODEL_FILE),
    for tools that want sentencepiece."""
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(
        tokenizer_object=hf_tokenizer_from_sentencepiece(proto),
        unk_token="[UNK]",
        sep_token="[SEP]",
        pad_token="[PAD]",
        cls_token="[CLS]",
        mask_token="[MASK]",
        # decode() then gives sentencepiece's own decoding, not BERT's " ." -> "." clean-up.
        clean_up_tokenization_spaces=False,
    )
    hf.model_max_length = 512
    hf.save_pretrained(str(out_dir))
    (out_dir / SP_MODEL_FILE).write_bytes(proto)
