"""Shared helpers for the shard-builder tests: small corpora, a test tokenizer, MDS read-back, an
independent reference normalisation, and the module fixtures of the tests that build with Ray
(import `ray_here` and `corpus` into a test module to use them there)."""

from __future__ import annotations

import json
import logging
import random
import unicodedata
from pathlib import Path
from types import SimpleNamespace

import numpy as np

REPO = Path(__file__).resolve().parents[2]
SAMPLE_ZH = REPO / "preprocessing" / "sample_corpus" / "zh.jsonl"
SAMPLE_EN = REPO / "preprocessing" / "sample_corpus" / "en.txt"

WORDS = """time person year way day thing man world life hand part child eye woman place work week
case point government company number group problem fact river mountain city garden window
kitchen teacher student doctor music picture letter morning evening winter summer station
market village bridge forest island ocean desert castle engine signal battery planet comet
quickly slowly carefully happily silently bright dark heavy light ancient modern simple
complex green yellow purple orange silver golden wooden stone paper glass copper""".split()


def english_docs(n_docs: int, *, seed: int, min_sents: int = 2, max_sents: int = 12) -> list[list[str]]:
    """Documents of unique sentences ('Doc 3 sentence 5 river ... .'), each a list of lines."""
    rng = random.Random(seed)
    docs = []
    for d in range(n_docs):
        sents = []
        for s in range(rng.randint(min_sents, max_sents)):
            words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 16)))
            sents.append(f"Doc{d} sentence{s} {words}.")
        # Several sentences share a line sometimes, as paragraphs do.
        lines, i = [], 0
        while i < len(sents):
            k = rng.randint(1, 3)
            lines.append(" ".join(sents[i : i + k]))
            i += k
        docs.append(lines)
    return docs


def chinese_docs() -> list[list[str]]:
    """The Chinese documents of the repo's sample corpus, as lists of lines."""
    return [json.loads(line)["text"].split("\n") for line in SAMPLE_ZH.read_text().splitlines() if line.strip()]


def write_bert_text(path: Path, docs: list[list[str]]) -> Path:
    path.write_text("".join("\n".join(lines) + "\n\n" for lines in docs), encoding="utf-8")
    return path


def write_jsonl(path: Path, docs: list[list[str]], *, field: str = "text") -> Path:
    path.write_text(
        "".join(json.dumps({field: "\n".join(lines)}, ensure_ascii=False) + "\n" for lines in docs), encoding="utf-8"
    )
    return path


def train_tokenizer_dir(out: Path, docs: list[list[str]], *, kind: str = "wordpiece", vocab_size: int = 3000) -> Path:
    """An HF tokenizer folder trained (by the builder's own trainer) on the given documents."""
    from preprocessing.text import clean_text
    from preprocessing.tokenization import save_trained, train_tokenizer

    texts = [clean_text(line) for lines in docs for line in lines]
    tok = train_tokenizer(kind, texts=texts, vocab_size=vocab_size)
    save_trained(tok, out, kind=kind, lowercase=True)
    return out


def read_samples(root: Path) -> list[dict]:
    """Every sample of an MDS dataset folder, in index order, via streaming's StreamingDataset."""
    from streaming import StreamingDataset

    ds = StreamingDataset(local=str(root), batch_size=1, shuffle=False)
    return [ds[i] for i in range(len(ds))]


def part_samples(root: Path) -> dict[str, list[dict]]:
    """Samples grouped by part folder (one part per chunk), using the merged index's basenames."""
    index = json.loads((root / "index.json").read_text())
    samples = read_samples(root)
    out: dict[str, list[dict]] = {}
    pos = 0
    for shard in index["shards"]:
        part = shard["raw_data"]["basename"].split("/")[0]
        out.setdefault(part, []).extend(samples[pos : pos + shard["samples"]])
        pos += shard["samples"]
    return out


def shard_hashes(root: Path) -> list[tuple[str, str, int]]:
    """(basename, xxh64 of the uncompressed shard, samples) for every shard in the merged index."""
    index = json.loads((root / "index.json").read_text())
    return [(s["raw_data"]["basename"], s["raw_data"]["hashes"]["xxh64"], s["samples"]) for s in index["shards"]]


def squash(text: str) -> str:
    """Reference normalisation, written independently of preprocessing.text: NFKC, no control or
    format characters, lower case, and no whitespace at all (decoders differ in spacing)."""
    text = unicodedata.normalize("NFKC", text)
    text = "".join(ch for ch in text if unicodedata.category(ch) not in ("Cc", "Cf"))
    return "".join(text.lower().split())


def decode_squashed(tokenizer, ids: np.ndarray) -> str:
    return squash(tokenizer.decode([int(i) for i in ids], skip_special_tokens=True))


def reference_zh_starts(tokenizer, sentence: str) -> list[int]:
    """Reference word_starts of one Chinese sentence, token by token with offsets: a token that is
    one ideograph (or [UNK] for one) starts a word where rjieba starts one; any other token by its
    spelling (WordPiece: not '##'; SentencePiece: '▁'); the first token always starts a word.
    `tokenizer` is a `tokenizers.Tokenizer`."""
    import rjieba

    starts, pos = set(), 0
    for word in rjieba.cut(sentence):
        starts.add(pos)
        pos += len(word)
    wordpiece = type(tokenizer.model).__name__ == "WordPiece"
    e = tokenizer.encode(sentence, add_special_tokens=False)
    out = []
    for j, (token, (lo, hi)) in enumerate(zip(e.tokens, e.offsets)):
        piece = sentence[lo:hi]
        if j == 0:
            out.append(1)
        elif len(piece) == 1 and "\u4e00" <= piece <= "\u9fff" and token in (piece, "[UNK]"):
            out.append(int(lo in starts))
        elif wordpiece:
            out.append(int(not token.startswith("##")))
        else:
            out.append(int(token.startswith("▁")))
    return out


# ---- fixtures and helpers of the Ray builds ---------------------------------------------------
def ray_on_loopback():
    """Body of a module fixture: one Ray on 127.0.0.1 (conftest sets
    RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0); the builder reuses an initialised Ray instead of
    starting its own. Use as `yield from ray_on_loopback()`."""
    import ray

    started = not ray.is_initialized()
    if started:
        ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level=logging.WARNING)
    assert ray.util.get_node_ip_address() == "127.0.0.1"
    yield ray
    if started:
        ray.shutdown()


def small_corpus(d: Path) -> SimpleNamespace:
    """60 English documents (en.txt), the Chinese sample corpus (zh.jsonl) and a WordPiece
    tokenizer trained on both, in folder d."""
    en, zh = english_docs(60, seed=11), chinese_docs()
    write_bert_text(d / "en.txt", en)
    write_jsonl(d / "zh.jsonl", zh)
    tok_dir = train_tokenizer_dir(d / "tok", en + zh, vocab_size=3000)
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    return SimpleNamespace(
        dir=d,
        en=en,
        zh=zh,
        tok_dir=tok_dir,
        hf=AutoTokenizer.from_pretrained(tok_dir),
        raw=Tokenizer.from_file(str(tok_dir / "tokenizer.json")),
    )


def config(corpus, out, **overrides):
    """A BuildConfig over the `corpus` fixture's two files (small chunks, packed, 2 workers)."""
    from preprocessing.config import BuildConfig

    base = dict(output=str(out), format="packed", max_seq_len=32, chunk_mb=0.004, num_workers=2, progress=False)
    if corpus is not None:
        base.update(
            inputs=[f"en:{corpus.dir / 'en.txt'}", f"zh:{corpus.dir / 'zh.jsonl'}"], tokenizer=str(corpus.tok_dir)
        )
    base.update(overrides)
    return BuildConfig(**base)


def kill_tree(proc) -> None:
    """SIGKILL a process we started, its process group and every descendant (Ray's workers leave
    the group), by pid."""
    import os
    import signal

    import psutil

    kids = psutil.Process(proc.pid).children(recursive=True)
    os.killpg(proc.pid, signal.SIGKILL)
    for kid in kids:
        try:
            kid.kill()
        except psutil.NoSuchProcess:
            pass
    proc.wait(timeout=30)
    psutil.wait_procs(kids, timeout=30)
