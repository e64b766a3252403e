"""The miniature's text and vocabulary (its shards: commands.build_shards).

From each language's BERT-format files (--corpora en/*.txt, zh/*.txt): the last documents of every file
are held out (evaluation only), and the first documents, taken from the files in turn, fill the
pre-training budget (--en_mb, --zh_mb). One joint WordPiece vocabulary is trained on both languages'
pre-training text; four shard folders are built with it: packed (MLM start, TACO) and NSP (the TaCL
arms, as in the paper), one per language, so that runs mix them with --data_weights.
"""

from __future__ import annotations

import math
from pathlib import Path

from pipeline.experiments.mini.settings import MiniConfig
from pipeline.experiments.mini.stages import Stage
from preprocessing.errors import UsageError

LANGS = ("en", "zh")
MB = 1 << 20


def read_documents(path: Path) -> list[list[str]]:
    """Documents of a BERT-format text file: non-blank lines, a blank line after each document."""
    docs, doc = [], []
    with path.open(encoding="utf-8") as f:
        for line in f:
            if line.strip():
                doc.append(line.strip())
            elif doc:
                docs.append(doc)
                doc = []
    if doc:
        docs.append(doc)
    return docs


def split_language(files: list[Path], *, budget_bytes: int, heldout_docs: int) -> tuple[list, list, dict]:
    """(train documents, held-out documents, counts). Each file gives its last documents to the
    held-out set (heldout_docs in all, shared out over the files) and its first ones to training, in
    equal byte shares, until the budget is met."""
    per_file = [read_documents(f) for f in files]
    hold = math.ceil(heldout_docs / len(files))
    heldout, pools = [], []
    for f, docs in zip(files, per_file):
        if len(docs) < hold + 1:
            raise UsageError(
                f"{f}: {len(docs)} documents; the miniature holds out {hold} of each file and trains on the rest"
            )
        heldout += docs[-hold:]
        pools.append(docs[:-hold])
    # The next document always comes from the file that has given the fewest bytes so far, so every
    # file gets an equal share of the budget whatever its document sizes (novels' chapters are long).
    train, taken, nxt = [], [0] * len(pools), [0] * len(pools)
    while sum(taken) < budget_bytes:
        open_ = [i for i, p in enumerate(pools) if nxt[i] < len(p)]
        if not open_:
            break
        i = min(open_, key=lambda k: taken[k])
        doc = pools[i][nxt[i]]
        nxt[i] += 1
        train.append(doc)
        taken[i] += sum(len(x.encode("utf-8")) + 1 for x in doc) + 1
    size = sum(taken)
    counts = {
        "train_bytes_by_file": {str(f): n for f, n in zip(files, taken)},
        "train_documents": len(train),
        "train_bytes": size,
        "heldout_documents": len(heldout),
    }
    if size < budget_bytes:
        counts["note"] = f"the files hold only {size / MB:.2f} MB besides the held-out documents"
    return train, heldout, counts


def write_bert_format(docs: list[list[str]], path: Path) -> Path:
    path.write_text("".join("\n".join(d) + "\n\n" for d in docs), encoding="utf-8")
    return path


def prepare_text(cfg: MiniConfig, stage: Stage) -> dict:
    """OUT/data/{train,heldout}_{en,zh}.txt and analysis.txt (held-out, one sentence a line)."""
    from preprocessing.text import split_sentences

    data = stage.dir
    counts, analysis = {}, []
    for lang in LANGS:
        files = sorted((cfg.text.corpora / lang).glob("*.txt"))
        budget = int((cfg.text.en_mb if lang == "en" else cfg.text.zh_mb) * MB)
        train, heldout, counts[lang] = split_language(files, budget_bytes=budget, heldout_docs=cfg.text.heldout_docs)
        write_bert_format(train, data / f"train_{lang}.txt")
        write_bert_format(heldout, data / f"heldout_{lang}.txt")
        for doc in heldout:
            analysis.append("\n".join(s for line in doc for s in split_sentences(line, lang)) + "\n\n")
    (data / "analysis.txt").write_text("".join(analysis), encoding="utf-8")
    return counts


def train_tokenizer(cfg: MiniConfig, stage: Stage, text: Path) -> dict:
    """A joint lower-cased WordPiece vocabulary on both languages' pre-training text (OUT/tokenizer)."""
    from preprocessing.text import clean_text
    from preprocessing.tokenization import prepare_tokenizer

    def texts():
        for lang in LANGS:
            with (text / f"train_{lang}.txt").open(encoding="utf-8") as f:
                for line in f:
                    line = clean_text(line)
                    if line:
                        yield line

    size = cfg.text.vocab_size
    info = prepare_tokenizer(
        tokenizer=None, train="wordpiece", vocab_size=size, lowercase=True, out_dir=stage.dir, texts=texts
    )
    return {"vocab_size": info.vocab_size, "sha256": info.sha256}
