"""Official metrics of the downstream tasks, as pure functions over Python lists.

GLUE: accuracy, binary F1 (MRPC, QQP), Matthews correlation (CoLA), Pearson and Spearman correlation
(STS-B); macro-F1 for any-label classification folders. Token tasks (Chinese NER, word segmentation):
span extraction from BIO or BMES/BIOES tags and micro span F1, the conlleval way.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

Span = tuple[str, int, int]  # (type, start, end exclusive)


def accuracy(pred: Sequence, gold: Sequence) -> float:
    _same_length(pred, gold)
    return sum(p == g for p, g in zip(pred, gold)) / len(gold) if gold else float("nan")


def f1_binary(pred: Sequence, *, gold: Sequence, positive=1) -> float:
    """F1 of the positive class; 0.0 when there is no true positive."""
    _same_length(pred, gold)
    tp = sum(p == positive and g == positive for p, g in zip(pred, gold))
    fp = sum(p == positive and g != positive for p, g in zip(pred, gold))
    fn = sum(p != positive and g == positive for p, g in zip(pred, gold))
    return 2 * tp / (2 * tp + fp + fn) if tp else 0.0


def macro_f1(pred: Sequence, gold: Sequence) -> float:
    """The unweighted mean of every class's F1, over the classes that occur in `gold` or `pred` (as
    scikit-learn's f1_score(average="macro") takes them); a class with no true positive scores 0."""
    _same_length(pred, gold)
    classes = set(pred) | set(gold)
    per_class = [f1_binary(pred, gold=gold, positive=c) for c in classes]
    return sum(per_class) / len(per_class) if per_class else float("nan")


def matthews_corrcoef(pred: Sequence, gold: Sequence) -> float:
    """Matthews correlation (Gorodkin's multiclass form; the usual one for two classes).

    0.0 when a denominator is zero (all predictions, or all gold labels, one class), as sklearn does.
    """
    _same_length(pred, gold)
    s = len(gold)
    classes = sorted(set(pred) | set(gold), key=str)
    correct = sum(p == g for p, g in zip(pred, gold))
    p_k = [sum(p == c for p in pred) for c in classes]
    t_k = [sum(g == c for g in gold) for c in classes]
    num = correct * s - sum(p * t for p, t in zip(p_k, t_k))
    den = math.sqrt((s * s - sum(p * p for p in p_k)) * (s * s - sum(t * t for t in t_k)))
    return num / den if den else 0.0


def pearson(x: Sequence[float], y: Sequence[float]) -> float:
    _same_length(x, y)
    n = len(x)
    mx, my = sum(x) / n, sum(y) / n
    cov = sum((a - mx) * (b - my) for a, b in zip(x, y))
    vx = sum((a - mx) ** 2 for a in x)
    vy = sum((b - my) ** 2 for b in y)
    return cov / math.sqrt(vx * vy) if vx and vy else float("nan")


def average_ranks(x: Sequence[float]) -> list[float]:
    """Ranks 1..n; tied values share the mean of their ranks."""
    order = sorted(range(len(x)), key=lambda i: x[i])
    ranks = [0.0] * len(x)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and x[order[j + 1]] == x[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return ranks


def spearman(x: Sequence[float], y: Sequence[float]) -> float:
    """Pearson correlation of the average ranks."""
    return pearson(average_ranks(x), average_ranks(y))


def split_tag(tag: str) -> tuple[str, str]:
    """ "B-PER" -> ("B", "PER"); "S" -> ("S", ""); "O" -> ("O", "")."""
    if tag == "O":
        return "O", ""
    prefix, _, kind = tag.partition("-")
    return prefix, kind


def detect_scheme(tags: Sequence[str]) -> str:
    """ "bmes" when any tag uses M/E/S (BMES, BIOES: I is read as M), else "bio"."""
    return "bmes" if any(split_tag(t)[0] in ("M", "E", "S") for t in tags) else "bio"


def extract_spans(tags: Sequence[str], *, scheme: str) -> set[Span]:
    """Spans of one sentence's tags.

    bio: B-X opens a span; I-X extends an open X span, else opens one (conlleval's lenient reading of
    an I without its B); O closes.
    bmes: B-X opens; M-X / I-X extends an open X span, else opens one; E-X closes an open X span (with
    itself), else is a span of its own; S-X is a span of its own; O closes.
    A prefix that the scheme does not have raises ValueError.
    """
    allowed = {"bio": {"B", "I", "O"}, "bmes": {"B", "I", "M", "E", "S", "O"}}[scheme]
    spans: set[Span] = set()
    open_kind, open_start = None, 0

    def close(end: int) -> None:
        nonlocal open_kind
        if open_kind is not None:
            spans.add((open_kind, open_start, end))
            open_kind = None

    for i, tag in enumerate(tags):
        prefix, kind = split_tag(tag)
        if prefix not in allowed:
            raise ValueError(f"tag {tag!r} at position {i} is not a {scheme.upper()} tag")
        if prefix == "O":
            close(i)
        elif prefix == "B":
            close(i)
            open_kind, open_start = kind, i
        elif prefix in ("I", "M"):
            if open_kind != kind:
                close(i)
                open_kind, open_start = kind, i
        elif prefix == "E":
            if open_kind != kind:
                close(i)
                open_kind, open_start = kind, i
            close(i + 1)
        else:  # S
            close(i)
            spans.add((kind, i, i + 1))
    close(len(tags))
    return spans


def span_f1(gold: Sequence[Sequence[str]], *, pred: Sequence[Sequence[str]], scheme: str) -> dict[str, float]:
    """Micro precision, recall and F1 over exact (type, start, end) spans of all sentences."""
    _same_length(gold, pred)
    n_gold = n_pred = n_correct = 0
    for g_tags, p_tags in zip(gold, pred):
        _same_length(p_tags, g_tags)
        g, p = extract_spans(g_tags, scheme=scheme), extract_spans(p_tags, scheme=scheme)
        n_gold, n_pred, n_correct = n_gold + len(g), n_pred + len(p), n_correct + len(g & p)
    precision = n_correct / n_pred if n_pred else 0.0
    recall = n_correct / n_gold if n_gold else 0.0
    f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
    return {
        "precision": precision,
        "recall": recall,
        "f1": f1,
        "gold_spans": n_gold,
        "pred_spans": n_pred,
        "correct_spans": n_correct,
    }


def _same_length(a: Sequence, b: Sequence) -> None:
    if len(a) != len(b):
        raise ValueError(f"length mismatch: {len(a)} predictions against {len(b)} gold values")
