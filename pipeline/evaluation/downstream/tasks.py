"""Downstream task data from local files: the GLUE TSVs and CoNLL-format tagging files.

GLUE: point to a task folder of the standard GLUE download (glue_data/CoLA, glue_data/MNLI, ...). The
labelled splits are train.tsv and dev.tsv (MNLI: dev_matched.tsv and dev_mismatched.tsv); test.tsv has
no labels, so evaluation is on dev, as in both papers' GLUE dev tables. Columns are found by header
name, except CoLA, whose train/dev files have no header (source, label, original label, sentence), and
ChnSentiCorp (`chnsenti`: label, text; no header).
Rows with too few columns or an unknown label are skipped and counted, never dropped silently.

Any labelled text classification folder (`NAME=classify:DIR`) reads as ChnSentiCorp does (`label<TAB>text`,
no header; train.tsv, dev.tsv, and test.tsv when there is one), with the training file's labels: a label
of another split that the training file lacks is an error naming the file and line, not a skipped row.

Tagging (Chinese NER, word segmentation): one token per line, the token in the first column and its
tag in the last; a blank line ends a sentence; `-DOCSTART-` lines are skipped. Splits are the files of
the folder whose names contain train, dev/valid/val, and test.
"""

from __future__ import annotations

import csv
import dataclasses
import math
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple, NoReturn, Optional, Union

from pipeline.evaluation.downstream.scoring import detect_scheme, split_tag
from preprocessing.errors import UsageError

Column = Union[int, str]


@dataclass(frozen=True)
class GlueTask:
    """How one GLUE task's files read, and how it is scored."""

    name: str
    folder_hint: str  # the folder name in the GLUE download
    text_a: Column
    text_b: Optional[Column]
    label: Column
    labels: Optional[tuple[str, ...]]  # None: regression (STS-B)
    metrics: tuple[str, ...]  # the first one is the task's headline metric
    eval_files: tuple[tuple[str, str], ...] = (("dev", "dev.tsv"),)
    header: bool = True
    positive: str = "1"  # the F1 class
    strict_labels: bool = False  # a label outside `labels`: an error naming the line, not a skipped row


GLUE_TASKS: dict[str, GlueTask] = {
    t.name: t
    for t in (
        GlueTask("cola", "CoLA", 3, None, 1, ("0", "1"), ("mcc",), header=False),
        GlueTask("sst2", "SST-2", "sentence", None, "label", ("0", "1"), ("accuracy",)),
        GlueTask("mrpc", "MRPC", "#1 String", "#2 String", "Quality", ("0", "1"), ("f1", "accuracy")),
        GlueTask("stsb", "STS-B", "sentence1", "sentence2", "score", None, ("pearson", "spearman")),
        GlueTask("qqp", "QQP", "question1", "question2", "is_duplicate", ("0", "1"), ("f1", "accuracy")),
        GlueTask(
            "mnli",
            "MNLI",
            "sentence1",
            "sentence2",
            "gold_label",
            ("contradiction", "entailment", "neutral"),
            ("accuracy",),
            eval_files=(("matched", "dev_matched.tsv"), ("mismatched", "dev_mismatched.tsv")),
        ),
        GlueTask("qnli", "QNLI", "question", "sentence", "label", ("entailment", "not_entailment"), ("accuracy",)),
        GlueTask("rte", "RTE", "sentence1", "sentence2", "label", ("entailment", "not_entailment"), ("accuracy",)),
        GlueTask("wnli", "WNLI", "sentence1", "sentence2", "label", ("0", "1"), ("accuracy",)),
        # ChnSentiCorp as distributed with the Chinese BERT baselines: `label<TAB>text`, no header,
        # train.tsv / dev.tsv (test.tsv is labelled too, but dev is what model selection reads).
        GlueTask("chnsenti", "ChnSentiCorp", 1, None, 0, ("0", "1"), ("accuracy",), header=False),
    )
}

TAGGING_TASKS = ("ner", "cws")
CLASSIFY = "classify"  # the kind of a NAME=classify:DIR task: any label<TAB>text folder


class TaskSpec(NamedTuple):
    """One task of a command line: a built-in task (a GLUE name, chnsenti, ner, cws) read from `folder`,
    or, with kind CLASSIFY, any labelled text classification folder under the name the user gave it."""

    name: str
    folder: Path
    kind: str = "builtin"


_CLASSIFY_SPEC = re.compile(r"([\w.-]+)=classify:(.+)")


def classify_spec(text: str) -> Optional[TaskSpec]:
    """TaskSpec of `NAME=classify:DIR`, or None when `text` is not one."""
    m = _CLASSIFY_SPEC.fullmatch(text.strip())
    return TaskSpec(m[1], Path(m[2]), CLASSIFY) if m else None


TASK_CHOICES = (
    f"choose from {sorted(GLUE_TASKS) + list(TAGGING_TASKS)}, or NAME=classify:DIR for any label<TAB>text folder"
)


@dataclass
class Examples:
    """One split: texts (and pair texts) with labels (class index, or float for regression)."""

    path: Path
    text_a: list[str] = field(default_factory=list)
    text_b: Optional[list[str]] = None
    labels: list = field(default_factory=list)
    skipped: dict[str, int] = field(default_factory=dict)

    def skip(self, reason: str) -> None:
        self.skipped[reason] = self.skipped.get(reason, 0) + 1

    def __len__(self) -> int:
        return len(self.labels)


def _read_tsv(path: Path) -> list[list[str]]:
    if not path.is_file():
        raise UsageError(f"{path}: file not found (expected the GLUE download's layout)")
    # GLUE's TSVs contain stray quote characters: no quoting at all, as the GLUE baselines read them.
    # utf-8-sig drops the byte-order mark that MRPC's files start with.
    csv.field_size_limit(sys.maxsize)
    try:
        with path.open(encoding="utf-8-sig", newline="") as f:
            return list(csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE))
    except UnicodeDecodeError:
        raise_not_utf8(path)


def raise_not_utf8(path: Path) -> NoReturn:
    """UsageError naming the first line of `path` that is not UTF-8, and how to convert the file. The
    encoding is not guessed: GBK, Big5 and Latin-1 bytes are not told apart reliably, and a wrong guess
    would fine-tune on garbled text without a word."""
    with path.open("rb") as f:
        for lineno, line in enumerate(f, 1):
            try:
                line.decode("utf-8")
            except UnicodeDecodeError as e:
                raise UsageError(
                    f"{path}:{lineno}: not UTF-8 (bytes {line[e.start : e.start + 4].hex(' ')} at column "
                    f"{e.start + 1}); the task readers take UTF-8 only: convert the file, e.g. for Chinese "
                    f"GBK/GB18030 text: iconv -f GB18030 -t UTF-8 {path} > {path}.utf8, and use that in its place"
                ) from None
    raise AssertionError(f"{path}: a decode error, but every line decodes")  # a split multi-byte character


def read_glue_split(task: GlueTask, path: Path) -> Examples:
    """Read one labelled GLUE TSV (train or dev) of `task`."""
    rows = _read_tsv(path)
    if task.header:
        if not rows:
            raise UsageError(f"{path}: empty file (expected a header row)")
        header = [h.strip() for h in rows[0]]
        cols = {}
        for role, name in (("a", task.text_a), ("b", task.text_b), ("label", task.label)):
            if name is None:
                continue
            if name not in header:
                raise UsageError(
                    f"{path}: no column {name!r} in the header {header}; is this the "
                    f"{task.folder_hint} file of the GLUE download?"
                )
            # MNLI's gold_label is the last column; header names are unique, so index() is exact.
            cols[role] = header.index(name)
        rows = rows[1:]
    else:
        cols = {"a": task.text_a, "label": task.label}
        if rows and rows[0] and rows[0][0] == "index":
            raise UsageError(
                f"{path}: has a header row; {task.folder_hint}'s labelled files have none (is this test.tsv?)"
            )
    ex = Examples(path=path, text_b=[] if task.text_b is not None else None)
    need = max(cols.values()) + 1
    for lineno, row in enumerate(rows, 2 if task.header else 1):  # QUOTE_NONE: one row per line
        if len(row) < need:
            ex.skip("too_few_columns")
            continue
        raw = row[cols["label"]].strip()
        if task.labels is None:
            try:
                label = float(raw)
            except ValueError:
                ex.skip("unparsable_score")
                continue
            if not math.isfinite(label):  # float() reads "nan" and "inf": a loss of nan, then metrics of nan
                raise UsageError(f"{path}:{lineno}: score {raw!r} is not a finite number; fix or remove the row")
        elif raw in task.labels:
            label = task.labels.index(raw)
        elif task.strict_labels:
            raise UsageError(
                f"{path}:{lineno}: label {raw!r} is not among the training file's labels {list(task.labels)}; "
                f"fix the row, or add examples of it to {path.parent / 'train.tsv'}"
            )
        else:
            ex.skip("unknown_label")
            continue
        ex.text_a.append(row[cols["a"]])
        if ex.text_b is not None:
            ex.text_b.append(row[cols["b"]])
        ex.labels.append(label)
    if not ex.labels:
        raise UsageError(f"{path}: no usable rows ({ex.skipped or 'empty'}); expected {task.folder_hint}'s layout")
    return ex


def read_glue_task(task: GlueTask, folder: Path) -> tuple[Examples, dict[str, Examples]]:
    """(train, {eval split name: examples}) from a GLUE task folder."""
    if not folder.is_dir():
        raise UsageError(f"{folder}: not a folder (expected glue_data/{task.folder_hint})")
    train = read_glue_split(task, folder / "train.tsv")
    return train, {name: read_glue_split(task, folder / fname) for name, fname in task.eval_files}


def classify_task(name: str, folder: Path) -> GlueTask:
    """A `label<TAB>text` folder read as ChnSentiCorp is (no header), with the labels its train.tsv holds
    (sorted), scored by accuracy and macro-F1 on dev.tsv and on test.tsv when there is one."""
    for need in ("train.tsv", "dev.tsv"):
        if not (folder / need).is_file():
            raise UsageError(
                f"{name}=classify:{folder}: no {need} (expected label<TAB>text files train.tsv, dev.tsv and "
                f"optionally test.tsv, no header)"
            )
    train = folder / "train.tsv"
    labels = sorted({row[0].strip() for row in _read_tsv(train) if len(row) >= 2 and row[0].strip()})
    if len(labels) < 2:
        raise UsageError(f"{train}: {len(labels)} label(s) {labels}; a classification task needs at least 2")
    evals = (("dev", "dev.tsv"),) + ((("test", "test.tsv"),) if (folder / "test.tsv").is_file() else ())
    return dataclasses.replace(
        GLUE_TASKS["chnsenti"],
        name=name,
        folder_hint=f"{name} (label<TAB>text)",
        labels=tuple(labels),
        metrics=("accuracy", "macro_f1"),
        eval_files=evals,
        strict_labels=True,
    )


@dataclass
class TaggedSentences:
    """One split of a tagging task: tokens and tags per sentence."""

    path: Path
    tokens: list[list[str]] = field(default_factory=list)
    tags: list[list[str]] = field(default_factory=list)
    skipped: dict[str, int] = field(default_factory=dict)


def read_conll(path: Path) -> TaggedSentences:
    """Sentences of a CoNLL file: first column the token, last column the tag."""
    out = TaggedSentences(path=path)
    tokens: list[str] = []
    tags: list[str] = []

    def flush() -> None:
        nonlocal tokens, tags
        if tokens:
            out.tokens.append(tokens)
            out.tags.append(tags)
        tokens, tags = [], []

    try:
        with path.open(encoding="utf-8-sig") as f:
            for lineno, line in enumerate(f, 1):
                line = line.rstrip("\n\r")
                if not line.strip():
                    flush()
                    continue
                if line.startswith("-DOCSTART-"):
                    out.skipped["docstart_lines"] = out.skipped.get("docstart_lines", 0) + 1
                    continue
                parts = line.split()
                if len(parts) < 2:
                    raise UsageError(f"{path}:{lineno}: expected 'TOKEN ... TAG', got {line!r}")
                prefix, _ = split_tag(parts[-1])
                if prefix not in ("B", "I", "M", "E", "S", "O"):
                    raise UsageError(f"{path}:{lineno}: tag {parts[-1]!r} is neither BIO nor BMES")
                tokens.append(parts[0])
                tags.append(parts[-1])
    except UnicodeDecodeError:
        raise_not_utf8(path)
    flush()
    if not out.tokens:
        raise UsageError(f"{path}: no sentences (expected CoNLL: one token and its tag per line)")
    return out


_SPLIT_PATTERNS = {"train": r"train", "dev": r"dev|valid|val\b|val\.", "test": r"test"}


def find_tagging_splits(folder: Path) -> dict[str, Path]:
    """{"train": path, "dev": path?, "test": path?} from the file names in `folder`."""
    if not folder.is_dir():
        raise UsageError(f"{folder}: not a folder (expected CoNLL files named *train*, *dev*, *test*)")
    files = sorted(p for p in folder.iterdir() if p.is_file() and not p.name.startswith("."))
    found: dict[str, Path] = {}
    for split, pattern in _SPLIT_PATTERNS.items():
        hits = [p for p in files if re.search(pattern, p.name.lower())]
        if len(hits) > 1:
            raise UsageError(f"{folder}: several {split} files {[p.name for p in hits]}; keep one per split")
        if hits:
            found[split] = hits[0]
    if "train" not in found or len(found) < 2:
        raise UsageError(f"{folder}: needs a *train* file and a *dev* or *test* file, found {[p.name for p in files]}")
    return found


def read_tagging_task(folder: Path) -> tuple[TaggedSentences, dict[str, TaggedSentences], list[str], str]:
    """(train, {eval split: sentences}, tag list with "O" first, scheme) of a CoNLL task folder."""
    splits = find_tagging_splits(folder)
    train = read_conll(splits["train"])
    evals = {name: read_conll(p) for name, p in splits.items() if name != "train"}
    train_tags = sorted({t for s in train.tags for t in s})
    tag_list = (["O"] if "O" in train_tags else []) + [t for t in train_tags if t != "O"]
    scheme = detect_scheme(tag_list)
    return train, evals, tag_list, scheme
