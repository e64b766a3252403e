"""Text clean-up, language detection and sentence splitting (pure functions)."""

import pytest

from preprocessing.text import MAX_SENTENCE_CHARS, clean_text, detect_language, split_long, split_sentences


def test_clean_text_folds_full_width_removes_controls_and_collapses_spaces():
    raw = "\ufeffＨｅｌｌｏ，\u3000ｗｏｒｌｄ！\x00\x07 one\u200b\ttwo\u00a0 three  "
    assert clean_text(raw) == "Hello, world! one two three"
    assert clean_text("  \x01\x02 \u200e ") == ""
    assert clean_text("already clean text") == "already clean text"


@pytest.mark.parametrize(
    "text, lang",
    [
        ("The court heard the case on Monday.", "en"),
        ("本院于2018年6月28日立案后，依法组成合议庭。", "zh"),
        ("He visited 北京 and 上海 last year, then flew home to London again.", "en"),
        ("在 Python 中，列表推导式写起来很方便。", "zh"),
        ("", "en"),
    ],
)
def test_detect_language_by_share_of_ideographs(text, lang):
    assert detect_language(text) == lang


@pytest.mark.parametrize(
    "text, expected",
    [
        (
            "Dr. Smith paid $3.50 for it. Then he left! Did he? Yes.",
            ["Dr. Smith paid $3.50 for it.", "Then he left!", "Did he?", "Yes."],
        ),
        (
            "J. K. Rowling moved to the U.S. in 1997. The book sold well.",
            ["J. K. Rowling moved to the U.S. in 1997.", "The book sold well."],
        ),
        (
            'He said "Stop." Then silence... Later it rained.',
            ['He said "Stop."', "Then silence...", "Later it rained."],
        ),
        (
            "Values e.g. 3.14 and i.e. pi are common, cf. Fig. 2 in the appendix. Next one.",
            ["Values e.g. 3.14 and i.e. pi are common, cf. Fig. 2 in the appendix.", "Next one."],
        ),
        (
            "Version 2.0 ships on Jan. 5 with 3.5 GB. it stays lower case here.",
            ["Version 2.0 ships on Jan. 5 with 3.5 GB. it stays lower case here."],
        ),
        ("no terminal punctuation at all", ["no terminal punctuation at all"]),
    ],
)
def test_english_sentences_survive_abbreviations_and_decimals(text, expected):
    assert split_sentences(text, "en") == expected


def test_chinese_sentences_keep_closing_quotes_after_nfkc():
    raw = "他说：“你好！”然后走了。真的吗？是的；好吧……结束了。「走吧。」她说"
    got = split_sentences(clean_text(raw), "zh")
    assert got == ["他说:“你好!”", "然后走了。", "真的吗?", "是的;", "好吧......", "结束了。", "「走吧。」", "她说"]
    assert "".join(got) == clean_text(raw).replace(" ", "")


def test_long_sentences_are_cut_at_spaces_and_ideographs():
    words = " ".join(f"w{i}" for i in range(3000))
    pieces = split_sentences(words, "en")
    assert all(len(p) <= MAX_SENTENCE_CHARS for p in pieces) and len(pieces) > 1
    assert " ".join(pieces) == words  # cut at spaces only: nothing lost, no word broken
    han = "中" * 5000
    pieces = split_long(han, limit=1000)
    assert [len(p) for p in pieces] == [1000] * 5 and "".join(pieces) == han
