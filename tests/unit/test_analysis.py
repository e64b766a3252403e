"""Representation metrics against known answers and loop references; the data readers; plots."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from pipeline.evaluation.representation import plots
from pipeline.evaluation.representation.inputs import (
    read_text_sequences,
    sentence_ids_from_specials,
)
from pipeline.modeling import similarity as analysis
from tests.support.png import assert_png
from tests.support.tiny_bert import write_tokenizer

REPO = Path(__file__).resolve().parents[2]
WORDS = "the cat sat on a mat dog ran to park . it was sunny and warm we like tea".split()


def cos(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.dot(a.double(), b.double()) / (a.double().norm() * b.double().norm()))


def loop_group_similarity(hidden_ND: torch.Tensor, group_N: list[int]) -> dict[int, float]:
    """Reference: mean cosine over ordered pairs of different tokens, group by group, with loops."""
    out = {}
    for g in sorted(set(group_N) - {-1}):
        idx = [i for i, x in enumerate(group_N) if x == g]
        pairs = [(i, j) for i in idx for j in idx if i != j]
        if pairs:
            out[g] = sum(cos(hidden_ND[i], hidden_ND[j]) for i, j in pairs) / len(pairs)
    return out


# --------------------------------------------------------------------------- known answers


def test_identical_vectors_give_one_and_orthogonal_give_zero():
    v = torch.randn(16)
    identical_BLD = torch.stack([v * s for s in (1.0, 2.0, 0.5, 3.0)])[None]  # one sentence, scaled copies
    sentence_BL = torch.zeros(1, 4, dtype=torch.long)
    assert analysis.intra_sentence_similarity(identical_BLD, sentence_BL=sentence_BL).item() == pytest.approx(
        1.0, abs=1e-12
    )
    orthogonal_BLD = torch.eye(16)[:5][None] * 7.0
    assert analysis.intra_sentence_similarity(
        orthogonal_BLD, sentence_BL=torch.zeros(1, 5, dtype=torch.long)
    ).item() == pytest.approx(0.0, abs=1e-12)
    # Opposite vectors: cosine -1.
    opposite_BLD = torch.stack([v, -v])[None]
    assert analysis.intra_sentence_similarity(
        opposite_BLD, sentence_BL=torch.zeros(1, 2, dtype=torch.long)
    ).item() == pytest.approx(-1.0, abs=1e-12)


def test_special_tokens_and_padding_are_left_out():
    e = torch.eye(8)
    # Sentence 0: tokens e0, e0 (similarity 1); specials / pads are huge e1 vectors that would pull it down.
    hidden_BLD = torch.stack([e[1] * 100, e[0], e[0] * 3, e[1] * 100, e[1] * 100])[None]
    sentence_BL = torch.tensor([[-1, 0, 0, -1, -1]])
    assert analysis.intra_sentence_similarity(hidden_BLD, sentence_BL=sentence_BL).tolist() == pytest.approx([1.0])
    ctx = analysis.context_similarity(hidden_BLD, token_mask_BL=sentence_BL >= 0)
    assert ctx["intra"] == pytest.approx(1.0)
    assert math.isnan(ctx["inter"])  # one sequence: no pair of contexts


def test_intra_and_inter_context_on_constructed_sequences():
    e = torch.eye(6)
    # Sequence 0 lies along e0, sequence 1 along e1: intra 1, inter 0, gap 1.
    hidden_BLD = torch.stack([torch.stack([e[0], 2 * e[0], 3 * e[0]]), torch.stack([e[1], e[1], 5 * e[1]])])
    mask_BL = torch.ones(2, 3, dtype=torch.bool)
    assert analysis.context_similarity(hidden_BLD, token_mask_BL=mask_BL) == pytest.approx(
        {"intra": 1.0, "inter": 0.0, "gap": 1.0}
    )
    # Every token the same direction: intra 1, inter 1, gap 0 (the anisotropic cone).
    same_BLD = torch.ones(3, 4, 6) * torch.arange(1, 5)[None, :, None]
    assert analysis.context_similarity(same_BLD, token_mask_BL=torch.ones(3, 4, dtype=torch.bool)) == pytest.approx(
        {"intra": 1.0, "inter": 1.0, "gap": 0.0}
    )
    # Sequence 1 = -sequence 0: inter -1.
    v_LD = torch.randn(1, 6).expand(4, 6)
    assert analysis.context_similarity(torch.stack([v_LD, -v_LD]), token_mask_BL=torch.ones(2, 4, dtype=torch.bool))[
        "inter"
    ] == pytest.approx(-1.0)


def test_metrics_match_loop_reference_on_random_inputs():
    g = torch.Generator().manual_seed(1)
    hidden_BLD = torch.randn(3, 7, 5, generator=g) + 0.7  # a shared offset makes cosines nonzero
    sentence_BL = torch.tensor([[-1, 0, 0, 0, -1, 1, 1], [-1, 0, 0, 0, 0, -1, -1], [-1, 0, -1, 1, 1, 1, -1]])
    got = analysis.intra_sentence_similarity(hidden_BLD, sentence_BL=sentence_BL).tolist()
    want = []
    for b in range(3):
        want += list(loop_group_similarity(hidden_BLD[b], sentence_BL[b].tolist()).values())
    # Row 2 sentence 0 has one token: no pair, so it is dropped.
    assert len(got) == 4 and got == pytest.approx(want, abs=1e-12)

    mask_BL = sentence_BL >= 0
    ctx = analysis.context_similarity(hidden_BLD, token_mask_BL=mask_BL)
    rows = [[hidden_BLD[b, i] for i in range(7) if mask_BL[b, i]] for b in range(3)]
    intra = np.mean([np.mean([cos(x, y) for x, y in itertools.permutations(r, 2)]) for r in rows])
    inter = np.mean(
        [np.mean([cos(x, y) for x in rows[a] for y in rows[b]]) for a, b in itertools.permutations(range(3), 2)]
    )
    assert ctx["intra"] == pytest.approx(intra, abs=1e-12)
    assert ctx["inter"] == pytest.approx(inter, abs=1e-12)


def test_accumulated_stats_equal_one_big_batch():
    g = torch.Generator().manual_seed(2)
    hidden_BLD = torch.randn(5, 6, 4, generator=g) + 0.5
    sentence_BL = torch.tensor([[-1, 0, 0, -1, 1, 1]] * 5)
    sentence_BL[3, 4:] = -1  # a row ending early (padding)
    whole = analysis.SimilarityStats()
    whole.update(hidden_BLD, sentence_BL=sentence_BL)
    parts = analysis.SimilarityStats()
    parts.update(hidden_BLD[:2], sentence_BL=sentence_BL[:2])
    parts.update(hidden_BLD[2:], sentence_BL=sentence_BL[2:])
    a, b = whole.result(), parts.result()
    assert a == pytest.approx(b, abs=1e-12)
    ctx = analysis.context_similarity(hidden_BLD, token_mask_BL=sentence_BL >= 0)
    assert a["intra_context"] == pytest.approx(ctx["intra"]) and a["inter_context"] == pytest.approx(ctx["inter"])
    assert a["num_sentences"] == 9 and a["num_contexts"] == 5 and a["num_tokens"] == 18


def test_isotropy_summary_known_answers():
    gen = torch.Generator().manual_seed(0)
    v = torch.randn(8)
    assert analysis.random_pair_cosine(
        v.expand(10, 8) * torch.arange(1, 11)[:, None], num_pairs=500, generator=gen
    ) == pytest.approx(1.0)
    # Distinct orthonormal vectors: every pair i != j has cosine exactly 0.
    assert analysis.random_pair_cosine(torch.eye(8) * 3, num_pairs=500, generator=gen) == pytest.approx(0.0, abs=1e-12)
    # Points on one line through their mean: all variance in one direction.
    line_ND = torch.linspace(-2, 3, 20)[:, None] * torch.randn(1, 8) + torch.randn(1, 8)
    assert analysis.top_direction_variance_share(line_ND) == pytest.approx(1.0)
    # +-3 e0 and +-1 e1 (equally often): variances 9 and 1, share 0.9; the symmetric cross +-e0, +-e1: 0.5.
    ellipse_ND = torch.tensor([[3.0, 0], [-3, 0], [0, 1], [0, -1]])
    assert analysis.top_direction_variance_share(ellipse_ND) == pytest.approx(0.9)
    assert analysis.top_direction_variance_share(torch.tensor([[1.0, 0], [-1, 0], [0, 1], [0, -1]])) == pytest.approx(
        0.5
    )


def test_token_similarity_matrix_matches_pairwise_cosine():
    x_LD = torch.randn(5, 7)
    sim_LL = analysis.token_similarity_matrix(x_LD)
    for i, j in itertools.product(range(5), repeat=2):
        assert sim_LL[i, j].item() == pytest.approx(cos(x_LD[i], x_LD[j]), abs=1e-6)


# --------------------------------------------------------------------------- inputs


def test_sentence_ids_from_special_tokens():
    specials = {0, 2, 3}  # PAD CLS SEP
    # nsp: [CLS] a a [SEP] b b b [SEP] [PAD]
    assert sentence_ids_from_specials(
        [2, 7, 8, 3, 9, 9, 9, 3, 0], special_ids=specials, token_type_ids=[0, 0, 0, 0, 1, 1, 1, 1, 0]
    ) == [-1, 0, 0, -1, 1, 1, 1, -1, -1]
    # A segment change without a separator still starts a new sentence.
    assert sentence_ids_from_specials([2, 7, 8, 9], special_ids=specials, token_type_ids=[0, 0, 1, 1]) == [-1, 0, 1, 1]
    # packed: [CLS] doc tail [SEP] next doc (no trailing SEP)
    assert sentence_ids_from_specials([2, 5, 6, 3, 7, 8, 9], special_ids=specials) == [-1, 0, 0, -1, 1, 1, 1]


def test_text_reader_lines_and_packing(tmp_path):
    tok = write_tokenizer(tmp_path / "tok", WORDS)
    text = tmp_path / "t.txt"
    text.write_text(
        "the cat sat on a mat .\nthe dog ran\n\n   \nit was sunny and warm .\nwe like tea\n", encoding="utf-8"
    )
    seqs, stats = read_text_sequences(text, tokenizer=tok, max_seq_len=16, max_sequences=100)
    assert [s.sentence_ids.count(-1) for s in seqs] == [2, 2, 2, 2] and stats.sentences == 4
    assert tok.convert_ids_to_tokens(seqs[1].input_ids) == ["[CLS]", "the", "dog", "ran", "[SEP]"]
    packed, pstats = read_text_sequences(text, tokenizer=tok, max_seq_len=12, max_sequences=100, pack=True)
    # Document 1 (7 + 3 tokens) needs two sequences of <= 12; document 2 (6 + 3) fits one.
    assert [len(s.input_ids) for s in packed] == [9, 5, 12]
    assert packed[2].sentence_ids == [-1, 0, 0, 0, 0, 0, 0, -1, 1, 1, 1, -1]
    assert pstats.sequences == 3 and pstats.sentences == 4
    cut, cstats = read_text_sequences(text, tokenizer=tok, max_seq_len=6, max_sequences=2)
    assert len(cut) == 2 and cstats.skipped == {"truncated_lines": 1, "lines_beyond_max_sequences": 2}


def test_text_reader_chinese_one_token_per_character_and_unk_count(tmp_path):
    tok = write_tokenizer(tmp_path / "tok", list("我们喜欢喝茶。今天很好"))
    text = tmp_path / "zh.jsonl"
    text.write_text(json.dumps({"text": "我们喜欢喝茶。\n今天天气很好。"}, ensure_ascii=False) + "\n", encoding="utf-8")
    seqs, stats = read_text_sequences(text, tokenizer=tok, max_seq_len=32, max_sequences=10, pack=True)
    assert len(seqs) == 1 and seqs[0].sentence_ids == [-1] + [0] * 7 + [-1] + [1] * 7 + [-1]
    assert stats.unk_tokens == 1  # 气 is not in the vocabulary: kept as a position, counted


# --------------------------------------------------------------------------- plots


def test_plots_are_written_and_non_empty(tmp_path):
    layers = lambda k: [
        {
            "layer": i,
            "intra_sentence": 0.2 + k * i / 10,
            "intra_context": 0.3 + i / 20,
            "inter_context": 0.1 + k * i / 30,
            "gap": 0.2 - i / 50,
        }
        for i in range(7)
    ]
    assert_png(plots.plot_layerwise({"mlm": layers(1), "tacl": layers(0.3)}, path=tmp_path / "layerwise.png"))
    sim = np.random.default_rng(0).uniform(0, 1, (6, 6))
    assert_png(
        plots.plot_heatmaps(
            [("a", list("abcdef"), sim), ("b", ["中", "国", "x", "y", "z", "w"], sim.T)], path=tmp_path / "heatmap.png"
        )
    )
    points = [
        {"step": s, "intra_context": 0.5, "inter_context": 0.5 - s / 1000, "gap": s / 1000, "intra_sentence": 0.4}
        for s in (0, 100, 200)
    ]
    assert_png(plots.plot_training_gap(points, path=tmp_path / "gap.png", title="run"))


# --------------------------------------------------------------------------- the CLI, end to end


def test_sentence_ids_of_a_batch_equal_the_text_readers():
    from pipeline.modeling.similarity import sentence_ids

    specials = {0, 1, 2, 3, 4}
    rows = [[2, 7, 8, 3, 9, 3, 0, 0], [2, 5, 6, 7, 3, 8, 9, 3], [2, 5, 3, 3, 6, 6, 6, 3]]
    types = [[0, 0, 0, 0, 1, 1, 0, 0], [0, 0, 0, 0, 0, 1, 1, 1], [0, 0, 0, 0, 0, 0, 1, 1]]
    ids_BL, types_BL = torch.tensor(rows), torch.tensor(types)
    got = sentence_ids(
        ids_BL, token_type_ids_BL=types_BL, special_BL=torch.isin(ids_BL, torch.tensor(sorted(specials)))
    )
    for row, row_types, out in zip(rows, types, got.tolist()):
        assert out == sentence_ids_from_specials(row, special_ids=specials, token_type_ids=row_types)
