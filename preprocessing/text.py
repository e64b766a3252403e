"""Text clean-up, language detection and sentence splitting: pure string functions.

The builder applies, per line: `clean_text` (control characters out, NFKC with full-width ASCII
folded to half-width, whitespace collapsed), then per document `detect_language` (share of CJK
ideographs) unless the input names its language, then `split_sentences`.
"""

from __future__ import annotations

import re
import sys
import unicodedata

import numpy as np

# The CJK ideograph blocks BERT's tokenizer isolates as one token per character
# (BasicTokenizer._is_chinese_char); the same set drives language detection and word alignment.
CJK_RANGES: tuple[tuple[int, int], ...] = (
    (0x4E00, 0x9FFF),
    (0x3400, 0x4DBF),
    (0x20000, 0x2A6DF),
    (0x2A700, 0x2B73F),
    (0x2B740, 0x2B81F),
    (0x2B820, 0x2CEAF),
    (0xF900, 0xFAFF),
    (0x2F800, 0x2FA1F),
)
_CJK_CLASS = "".join(f"{chr(lo)}-{chr(hi)}" for lo, hi in CJK_RANGES)
_CJK_RE = re.compile(f"[{_CJK_CLASS}]")

# Control (Cc) and format (Cf) characters: NUL, escape codes, BOM, zero-width and bidi marks.
# Tab, newline and carriage return are whitespace and handled by the whitespace collapse.


def _control_class() -> str:
    codes = [
        c for c in range(sys.maxunicode + 1) if unicodedata.category(chr(c)) in ("Cc", "Cf") and chr(c) not in "\t\n\r"
    ]
    ranges, lo = [], codes[0]
    for prev, cur in zip(codes, codes[1:] + [-1]):
        if cur != prev + 1:
            ranges.append(re.escape(chr(lo)) + ("" if lo == prev else "-" + re.escape(chr(prev))))
            lo = cur
    return "[" + "".join(ranges) + "]"


_CONTROL_RE = re.compile(_control_class())

MAX_SENTENCE_CHARS = 2000
"""Longer 'sentences' (tables, lists, text with no punctuation) are cut at whitespace so one
tokenizer call never sees megabytes; BERT's tokenization does not change at whitespace cuts."""


def is_cjk_codepoints(codepoints: np.ndarray) -> np.ndarray:
    """Boolean mask over an array of Unicode code points: True for CJK ideographs."""
    mask = np.zeros(codepoints.shape, dtype=bool)
    for lo, hi in CJK_RANGES:
        mask |= (codepoints >= lo) & (codepoints <= hi)
    return mask


def clean_text(text: str) -> str:
    """Remove control/format characters, apply NFKC (which folds full-width ASCII and the
    ideographic space to half-width) and collapse every whitespace run to one space."""
    # The common case (printable, already clean) costs three C-level scans and no copies.
    if not text.isprintable():
        text = _CONTROL_RE.sub("", text)
    if not text.isascii():
        text = unicodedata.normalize("NFKC", text)
    if "  " in text or text[:1] == " " or text[-1:] == " " or not text.isprintable():
        text = " ".join(text.split())
    return text


def detect_language(text: str, *, sample_chars: int = 2000, threshold: float = 0.3) -> str:
    """'zh' when CJK ideographs are at least `threshold` of the non-space characters of the
    first `sample_chars` characters, else 'en'."""
    sample = text[:sample_chars]
    if sample.isascii():
        return "en"
    visible = len(sample) - sample.count(" ")
    cjk = len(_CJK_RE.findall(sample))
    return "zh" if visible and cjk / visible >= threshold else "en"


# English: a run of terminators, optional closing quotes/brackets, whitespace, and then something
# that can start a sentence. Decimals ("3.14") never match because no whitespace follows the dot.
_EN_BOUNDARY = re.compile(r"""([.!?]+|…)["'”’)\]]*\s+(?=["'“‘(\[]?[A-Z0-9])""")
_INITIALISM = re.compile(r"(?:[A-Za-z]\.)+[A-Za-z]")
EN_ABBREVIATIONS = frozenset(
    """
    mr mrs ms dr prof sr jr st mt ft rev hon gen col lt capt sgt maj cmdr adm gov sen rep pres
    vs etc e.g i.e cf viz al approx ca no nos fig figs eq eqs vol vols pp ed eds op dept univ
    inc ltd co corp bros assn ave blvd rd jan feb mar apr jun jul aug sep sept oct nov dec
    u.s u.k u.n e.u a.m p.m ph.d b.a m.a b.sc m.sc d.c
""".split()
)

# Chinese: 。！？； (NFKC folds the full-width ！？； to !?;) or …… (NFKC: six dots), then any
# closing quotes or brackets, which stay with the sentence they close.
_ZH_BOUNDARY = re.compile(r"""(?:[。!?;]|…{2}|\.{6})+[”’"'」』)\]】》〉]*""")


def _is_abbreviation(text: str, dot: int) -> bool:
    """True when the word ending at text[dot] == '.' is an abbreviation or an initial ('J.',
    'U.S.'), so the dot does not end the sentence."""
    word = text[text.rfind(" ", 0, dot) + 1 : dot].lstrip("([\"'“‘")
    if len(word) <= 1:
        return word.isalpha()  # an initial: "J. K. Rowling"
    return word.lower() in EN_ABBREVIATIONS or ("." in word and _INITIALISM.fullmatch(word) is not None)


def _split_en(text: str) -> list[str]:
    out, start = [], 0
    for m in _EN_BOUNDARY.finditer(text):
        if m.group(1) == "." and _is_abbreviation(text, m.start(1)):
            continue
        out.append(text[start : m.end()].strip())
        start = m.end()
    out.append(text[start:].strip())
    return out


def _split_zh(text: str) -> list[str]:
    out, start = [], 0
    for m in _ZH_BOUNDARY.finditer(text):
        out.append(text[start : m.end()].strip())
        start = m.end()
    out.append(text[start:].strip())
    return out


def split_long(text: str, *, limit: int = MAX_SENTENCE_CHARS) -> list[str]:
    """Cut `text` into pieces of at most `limit` characters, at the last space of each window
    (or anywhere when a window has none, e.g. unpunctuated Chinese, where BERT-style tokenizers
    isolate each ideograph anyway)."""
    pieces = []
    while len(text) > limit:
        cut = text.rfind(" ", limit // 2, limit + 1)
        if cut <= 0:
            cut = limit
        pieces.append(text[:cut].strip())
        text = text[cut:].lstrip()
    pieces.append(text)
    return [p for p in pieces if p]


def split_sentences(text: str, lang: str) -> list[str]:
    """Split one cleaned line into sentences ('en' or 'zh' rules); none longer than
    MAX_SENTENCE_CHARS. Empty pieces are dropped."""
    if not text:
        return []
    raw = _split_zh(text) if lang == "zh" else _split_en(text)
    out: list[str] = []
    for sentence in raw:
        if len(sentence) > MAX_SENTENCE_CHARS:
            out.extend(split_long(sentence))
        elif sentence:
            out.append(sentence)
    return out
