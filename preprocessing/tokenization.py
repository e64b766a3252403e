"""Tokenizers: load one (folder or hub name), or train a joint English+Chinese vocabulary, and
save it as a Hugging Face tokenizer folder; plus the worker-side batch encoder.

Trained kinds (`--train_tokenizer`), all lower-cased unless told otherwise, with [PAD] [UNK] [CLS]
[SEP] [MASK] as ids 0-4:
- 'wordpiece': BERT's algorithm (`##` continuation pieces), HF tokenizers' WordPieceTrainer;
- 'unigram': the unigram algorithm as HF tokenizers' UnigramTrainer implements it (`▁` marks a
  word start);
- 'sentencepiece': the `sentencepiece` library itself (unigram or BPE, `--sp_model_type`) with its
  own normalisation; a Chinese piece may span several ideographs (sentencepiece_tokenizer.py).
The first two normalise with NFKC and isolate every CJK ideograph as its own token, as
BERT-Chinese does.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
import unicodedata
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from itertools import chain
from pathlib import Path

import numpy as np

from preprocessing.errors import UsageError
from preprocessing.inputs import Chunk
from preprocessing.shard_format import TOKENIZER_FILES, TokenizerRecord, read_vocabulary, special_tokens
from preprocessing.text import _CJK_CLASS, CJK_RANGES, clean_text

SPECIAL_TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
TRAINABLE = ("wordpiece", "unigram", "sentencepiece")
SP_MODEL_TYPES = ("unigram", "bpe")  # --sp_model_type, for --train_tokenizer sentencepiece


@dataclass(frozen=True)
class TokenizerInfo:
    """What the manifest records and the workers need."""

    path: str
    source: str
    sha256: str
    vocab_size: int
    kind: str
    cls_id: int
    sep_id: int
    unk_id: int | None
    vocab_fingerprint: str

    def record(self) -> TokenizerRecord:
        """What the manifest records of it."""
        return TokenizerRecord(**{f.name: getattr(self, f.name) for f in dataclasses.fields(TokenizerRecord)})


def _normalizer(lowercase: bool):
    from tokenizers import Regex, normalizers

    return normalizers.Sequence(
        [
            normalizers.NFKC(),
            # handle_chinese_chars puts spaces around every CJK ideograph: one token each.
            normalizers.BertNormalizer(
                clean_text=True,
                handle_chinese_chars=True,
                strip_accents=None if lowercase else False,
                lowercase=lowercase,
            ),
            normalizers.Replace(Regex(" {2,}"), " "),
            normalizers.Strip(),
        ]
    )


def new_tokenizer(kind: str, *, lowercase: bool = True):
    """An untrained `tokenizers.Tokenizer` with our normaliser, pre-tokenizer and decoder."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    if kind == "wordpiece":
        tok = Tokenizer(models.WordPiece(unk_token="[UNK]", continuing_subword_prefix="##"))
        tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        tok.decoder = decoders.WordPiece(prefix="##")
    elif kind == "unigram":
        tok = Tokenizer(models.Unigram())
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=True),
                # An ideograph is a word of its own: drop the word marker in front of it so the
                # unigram model cannot glue "▁" and the character into two tokens.
                pre_tokenizers.Split(Regex(f"▁(?=[{_CJK_CLASS}])"), behavior="removed"),
            ]
        )
        tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always", split=True)
    else:
        raise UsageError(
            f"--train_tokenizer {kind}: new_tokenizer makes 'wordpiece' or 'unigram' "
            "('sentencepiece' is trained by sentencepiece_tokenizer.train_sentencepiece)"
        )
    tok.normalizer = _normalizer(lowercase)
    return tok


def train_tokenizer(
    kind: str, *, texts: Sequence[str] | Callable[[], Iterable[str]], vocab_size: int, lowercase: bool = True
):
    """Train a joint 'wordpiece' or 'unigram' vocabulary on `texts` (cleaned lines; a callable is
    called once per pass). Returns a `tokenizers.Tokenizer` whose first ids are SPECIAL_TOKENS,
    with BERT's [CLS] A [SEP] B [SEP] post-processor. The same texts give the same tokenizer, run after run."""
    from tokenizers import Tokenizer, trainers

    if not callable(texts) and iter(texts) is texts:
        # A one-shot iterator (a generator) would be empty on the second pass and train on nothing.
        texts = list(texts)
    passes = texts if callable(texts) else (lambda: texts)
    tok = new_tokenizer(kind, lowercase=lowercase)
    if kind == "wordpiece":
        # HF's trainer numbers the '##x' pieces in hash-map order, and merge ties are broken by
        # those numbers, so two runs can give different vocabularies (huggingface/tokenizers
        # #1794). Declaring every '##x' up front, in sorted order, fixes their numbers.
        seeds = _continuation_seeds(passes(), tok.normalizer)
        trainer = trainers.WordPieceTrainer(
            vocab_size=vocab_size,
            special_tokens=SPECIAL_TOKENS + seeds,
            continuing_subword_prefix="##",
            show_progress=False,
        )
    else:
        trainer = trainers.UnigramTrainer(
            vocab_size=vocab_size,
            special_tokens=SPECIAL_TOKENS,
            unk_token="[UNK]",
            max_piece_length=16,
            show_progress=False,
        )
    tok.train_from_iterator(passes(), trainer)
    spec = json.loads(tok.to_str())
    # The seeds are ordinary pieces, not special tokens (which decoding would skip).
    spec["added_tokens"] = [t for t in spec["added_tokens"] if t["content"] in SPECIAL_TOKENS]
    if kind == "unigram":
        # The same pieces every run, but their scores differ in the last bits (hash-map order of
        # float sums) and their order with them: round the scores, then sort, for stable ids.
        pieces = spec["model"]["vocab"]
        head, rest = pieces[: len(SPECIAL_TOKENS)], pieces[len(SPECIAL_TOKENS) :]
        assert [p for p, _ in head] == SPECIAL_TOKENS
        rest = [[piece, round(score, 6)] for piece, score in rest]
        # Characters the trainer must keep are added near the end as a run of single characters
        # 1e-4 apart in score, in hash-set order: give the sorted characters the same ladder.
        ladder = _longest_ladder(rest)
        chars = sorted(rest[i][0] for i in ladder)
        for i, char in zip(ladder, chars):
            rest[i] = [char, rest[i][1]]
        spec["model"]["vocab"] = head + sorted(rest, key=lambda p: (-p[1], p[0]))
    tok = Tokenizer.from_str(json.dumps(spec))
    set_bert_post_processor(tok)
    return tok


def set_bert_post_processor(tok) -> None:
    """BERT's [CLS] A [SEP] B [SEP] template (segment 1 for B) on a `tokenizers.Tokenizer`, so that the
    saved tokenizer encodes pairs as the samples hold them."""
    from tokenizers import processors

    cls_id, sep_id = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls_id), ("[SEP]", sep_id)],
    )


def _longest_ladder(pieces: list) -> list[int]:
    """Indices of the longest chain of single-character pieces whose scores step down by 1e-4
    (other pieces may sit between them), or [] when there is no such chain."""
    prev: dict[int, int] = {}
    length: dict[int, int] = {}
    end_at: dict[float, int] = {}  # rounded score -> last single-character piece with it
    for i, (piece, score) in enumerate(pieces):
        if len(piece) != 1:
            continue
        j = end_at.get(round(score + 1e-4, 6))
        length[i] = length[j] + 1 if j is not None else 1
        if j is not None:
            prev[i] = j
        end_at[round(score, 6)] = i
    if not length or max(length.values()) < 3:
        return []
    i = max(length, key=lambda k: (length[k], -k))
    chain = [i]
    while chain[-1] in prev:
        chain.append(prev[chain[-1]])
    return chain[::-1]


def _continuation_seeds(texts: Iterable[str], normalizer) -> list[str]:
    """'##c' for every character c of the normalised texts that can continue a word (not space,
    punctuation or an ideograph, which BERT's pre-tokenizer isolates), sorted."""
    raw: set[str] = set()
    for line in texts:
        raw.update(line)
    chars = {ch for c in raw for ch in normalizer.normalize_str(c)}
    keep = sorted(c for c in chars if not c.isspace() and not _is_cjk(c) and not _is_punctuation(c))
    return [f"##{c}" for c in keep]


def _is_punctuation(ch: str) -> bool:
    """BERT's rule: ASCII punctuation (incl. symbols like $ and ^) or a Unicode P* character."""
    return (ch.isascii() and not ch.isalnum() and not ch.isspace()) or unicodedata.category(ch).startswith("P")


def save_trained(tok, out_dir: Path, *, kind: str, lowercase: bool) -> None:
    """Write an HF tokenizer folder (tokenizer.json, tokenizer_config.json, special tokens;
    vocab.txt for WordPiece) that AutoTokenizer loads as a fast tokenizer."""
    from transformers import BertTokenizerFast, PreTrainedTokenizerFast

    specials = dict(unk_token="[UNK]", sep_token="[SEP]", pad_token="[PAD]", cls_token="[CLS]", mask_token="[MASK]")
    if kind == "wordpiece":
        hf = BertTokenizerFast(tokenizer_object=tok, do_lower_case=lowercase, **specials)
    else:
        hf = PreTrainedTokenizerFast(tokenizer_object=tok, **specials)
    hf.model_max_length = 512
    hf.save_pretrained(str(out_dir))


def copy_tokenizer(name_or_path: str, out_dir: Path) -> None:
    """Copy --tokenizer into out_dir. A local folder with tokenizer.json and a tokenizer_class is
    copied file by file (no transformers import: seconds saved on every build); anything else
    (a hub name, a folder with only vocab.txt) goes through AutoTokenizer and save_pretrained."""
    src = Path(name_or_path)
    config = src / "tokenizer_config.json"
    if (
        (src / "tokenizer.json").is_file()
        and config.is_file()
        and json.loads(config.read_text()).get("tokenizer_class")
    ):
        out_dir.mkdir(parents=True)
        for name in TOKENIZER_FILES:
            if (src / name).is_file():
                shutil.copy2(src / name, out_dir / name)
        return
    from transformers import AutoTokenizer

    try:
        hf = AutoTokenizer.from_pretrained(name_or_path)
    except Exception as err:  # transformers raises OSError/ValueError/... depending on the cause
        raise UsageError(f"--tokenizer {name_or_path}: cannot load a tokenizer from it ({err})") from err
    if not hf.is_fast:
        raise UsageError(f"--tokenizer {name_or_path}: needs a fast tokenizer (a tokenizer.json)")
    hf.save_pretrained(str(out_dir))


def describe(tok_dir: Path, *, source: str, kind: str | None = None) -> TokenizerInfo:
    """TokenizerInfo of a saved folder; sha256 over tokenizer.json, and its vocabulary fingerprint."""
    from tokenizers import Tokenizer

    data = (tok_dir / "tokenizer.json").read_bytes()
    tok = Tokenizer.from_str(data.decode("utf-8"))
    ids = {role: tok.token_to_id(token) for role, token in special_tokens(tok_dir).items()}
    missing = [f"{name} token" for name in ("cls", "sep", "mask", "pad") if ids[name] is None]
    if missing:
        raise UsageError(
            f"--tokenizer {source}: has no {', '.join(missing)}; BERT pre-training needs "
            "[CLS], [SEP], [MASK] and [PAD] in the vocabulary"
        )
    cls_id, sep_id, unk_id = ids["cls"], ids["sep"], ids["unk"]
    model_type = json.loads(data)["model"]["type"].lower()
    return TokenizerInfo(
        path=str(tok_dir),
        source=source,
        sha256=hashlib.sha256(data).hexdigest(),
        vocab_size=tok.get_vocab_size(with_added_tokens=True),
        kind=kind or model_type,
        cls_id=cls_id,
        sep_id=sep_id,
        unk_id=unk_id,
        vocab_fingerprint=read_vocabulary(tok_dir).fingerprint,
    )


def prepare_tokenizer(
    *,
    tokenizer: str | None,
    train: str | None,
    vocab_size: int,
    lowercase: bool,
    out_dir: Path,
    texts: Callable[[], Iterable[str]] | None,
    sp_model_type: str | None = None,
) -> TokenizerInfo:
    """Fill out_dir (OUTPUT/tokenizer) and describe it. An existing out_dir is reused as is (a
    resumed build keeps the tokenizer its finished parts were made with). `sp_model_type`
    (default 'unigram') applies to train='sentencepiece' only."""
    if (out_dir / "tokenizer.json").exists():
        return describe(out_dir, source=tokenizer or f"trained:{train}", kind=train)
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        if train == "sentencepiece":
            from preprocessing.sentencepiece_tokenizer import save_sentencepiece, train_sentencepiece

            proto = train_sentencepiece(
                texts() if texts else [],
                vocab_size=vocab_size,
                model_type=sp_model_type or "unigram",
                lowercase=lowercase,
            )
            save_sentencepiece(proto, tmp)
        elif train:
            tok = train_tokenizer(train, texts=texts or [], vocab_size=vocab_size, lowercase=lowercase)
            save_trained(tok, tmp, kind=train, lowercase=lowercase)
        else:
            copy_tokenizer(tokenizer, tmp)
        info = describe(tmp, source=tokenizer or f"trained:{train}", kind=train)  # validates it
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    tmp.rename(out_dir)
    return dataclasses.replace(info, path=str(out_dir))


def training_texts(
    chunks: list[Chunk], *, text_field: str, budget_bytes: int, held_out: Callable[[list[str]], bool] | None = None
) -> Iterator[str]:
    """Cleaned lines for tokenizer training: from every chunk, its first share of
    `budget_bytes` (proportional to the chunk's size), so every file and language is sampled. The
    documents `held_out` picks (--eval_share) are left out: held-out text trains nothing."""
    from preprocessing.readers import ChunkReader

    total = sum(c.nbytes for c in chunks) or 1
    for chunk in chunks:
        share = budget_bytes * chunk.nbytes / total
        taken, skip = 0, False
        reader = ChunkReader(chunk, text_field=text_field)
        for doc in reader.documents():
            if doc.part == 0:
                skip = held_out is not None and held_out(doc.lines)
            if skip:
                continue
            for line in doc.lines:
                line = clean_text(line)
                if line:
                    taken += len(line)
                    yield line
            if taken >= share:
                break


class SentenceEncoder:
    """Worker side: tokenizer.json text -> a fast batch encoder of sentences (no special tokens)
    plus per-token lookup tables: `start_table[id]` (1 if the token starts a word by its own
    spelling: not a `##` piece, or a `▁`/`Ġ` piece) and `cjk_table[id]` (the token is one CJK
    ideograph). start_table is None for tokenizers whose word starts need the pre-tokenizer's
    word ids.

    `spelled` tokenizers follow SentencePiece's convention: '▁' pieces spell the normalised text
    (a Metaspace pre-tokenizer) and ideographs are not isolated, so a piece may hold several. For
    them start_table also starts a word at a piece that begins with an ideograph, and words.py
    aligns tokens to characters with `spelled_len[id]` (the characters a token spells, its '▁'
    being the space it stands for; UNKNOWN_SPAN for [UNK] and special tokens) and `lead_table[id]`
    (the token begins with '▁'); `marker_id` is the bare '▁' piece, if any. All three are None
    for other tokenizers."""

    def __init__(self, tokenizer_json: str):
        from tokenizers import Tokenizer

        self.tok = Tokenizer.from_str(tokenizer_json)
        self.tok.no_truncation()
        self.tok.no_padding()
        # Text that happens to contain "[SEP]" must not become the special token.
        self.tok.encode_special_tokens = True
        spec = json.loads(tokenizer_json)
        vocab = self.tok.get_vocab(with_added_tokens=True)
        self.vocab_size = max(vocab.values()) + 1
        tokens = [""] * self.vocab_size
        for piece, i in vocab.items():
            tokens[i] = piece
        special = {t["id"] for t in spec.get("added_tokens", []) if t.get("special")}
        marker = _metaspace_marker(spec)
        self.spelled = marker is not None and not _isolates_ideographs(spec)
        self.start_table = _start_table(spec, tokens=tokens, special=special, spelled=self.spelled)
        model = spec["model"]
        unk = model.get("unk_id", model.get("unk_token"))
        self.unk_id = unk if isinstance(unk, int) or unk is None else vocab.get(unk)
        self.cjk_table = np.array([len(t) == 1 and _is_cjk(t) for t in tokens], dtype=bool)
        self.spelled_len = self.lead_table = self.marker_id = None
        if self.spelled:
            self.lead_table = np.array([t.startswith(marker) for t in tokens], dtype=bool)
            lengths = np.array([len(t) or UNKNOWN_SPAN for t in tokens], dtype=np.int64)
            lengths[list(special | ({self.unk_id} - {None}))] = UNKNOWN_SPAN
            self.spelled_len = lengths
            self.marker_id = vocab.get(marker)

    def encode(self, sentences: list[str], *, offsets: bool = False):
        """(ids_T uint32, lengths_S int64, encodings): the sentences' tokens concatenated, how
        many each has, and the Encoding objects (with offsets only when asked)."""
        fn = self.tok.encode_batch if offsets else self.tok.encode_batch_fast
        encodings = fn(sentences, add_special_tokens=False)
        id_lists = [e.ids for e in encodings]
        lengths = np.fromiter(map(len, id_lists), dtype=np.int64, count=len(id_lists))
        ids = np.fromiter(chain.from_iterable(id_lists), dtype=np.uint32, count=int(lengths.sum()))
        return ids, lengths, encodings


def _is_cjk(ch: str) -> bool:
    cp = ord(ch)
    return any(lo <= cp <= hi for lo, hi in CJK_RANGES)


# spelled_len of a token whose text span is unknown: a sentence holding one cannot add up to its
# length, so words.py aligns it by offsets instead.
UNKNOWN_SPAN = -(1 << 40)


def _metaspace_marker(spec: dict) -> str | None:
    metaspace = _find_component(spec.get("pre_tokenizer"), "Metaspace")
    return None if metaspace is None else metaspace.get("replacement", "▁")


def _isolates_ideographs(spec: dict) -> bool:
    """True when the normaliser puts spaces around every CJK ideograph (BERT's rule), so that no
    piece can hold more than one."""
    bert = _find_component(spec.get("normalizer"), "BertNormalizer")
    return bert is not None and bool(bert.get("handle_chinese_chars"))


def _start_table(spec: dict, *, tokens: list[str], special: set[int], spelled: bool = False) -> np.ndarray | None:
    model = spec["model"]
    if model["type"] == "WordPiece":
        prefix = model.get("continuing_subword_prefix") or "##"
        table = [not t.startswith(prefix) for t in tokens]
    else:
        marker = _metaspace_marker(spec)
        if marker is None and _find_component(spec.get("pre_tokenizer"), "ByteLevel") is not None:
            marker = "Ġ"
        if marker is None:
            return None
        if spelled:
            # A piece that begins with an ideograph follows a piece of another script (sentencepiece's
            # split_by_unicode_script), where jieba would start a word too; in Chinese sentences
            # words.py replaces these flags by rjieba's.
            table = [t.startswith(marker) or (t[:1] != "" and _is_cjk(t[0])) for t in tokens]
        else:
            table = [t.startswith(marker) or (len(t) == 1 and _is_cjk(t)) for t in tokens]
    out = np.array(table, dtype=np.uint8)
    out[list(special)] = 1
    if model["type"] != "WordPiece":
        # WordPiece's [UNK] replaces a whole word; a unigram/BPE [UNK] is one unknown character
        # inside a word, its word start (if any) being the marker piece before it.
        unk = model.get("unk_id")
        if unk is None and model.get("unk_token") in tokens:
            unk = tokens.index(model["unk_token"])
        if unk is not None:
            out[unk] = 0
    return out


def _find_component(node: object, type_name: str) -> dict | None:
    """The first {"type": type_name, ...} inside a tokenizer.json component (searching Sequences)."""
    if isinstance(node, dict):
        if node.get("type") == type_name:
            return node
        node = list(node.values())
    if isinstance(node, list):
        for item in node:
            found = _find_component(item, type_name)
            if found is not None:
                return found
    return None
