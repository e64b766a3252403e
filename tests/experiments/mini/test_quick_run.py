"""The miniature reproduction (python -m pipeline.experiments.mini --quick): the whole pipeline as a user
runs it, real text from ../shared/corpora, real tasks from ../shared/downstream, tiny sizes. The report's
structure, that every number in it is computed by the run (traced back to the stage that produced it,
and the verdicts recomputed from the numbers by their stated rules), and that every run is its arm's
config file through train.py; not what the verdicts say.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.png import assert_png

pytestmark = [pytest.mark.corpora, pytest.mark.multiproc]

REPO = Path(__file__).resolve().parents[3]
VERDICTS = {"reproduces", "does not reproduce", "inconclusive at this scale"}


def reproduce(out: Path, *extra: str) -> str:
    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    proc = subprocess.run(
        [sys.executable, "-m", "pipeline.experiments.mini", "--out", str(out), "--quick", *extra],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=840,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


@pytest.fixture(scope="module")
def data(corpora, downstream) -> list[str]:
    """The shared corpora and the four tasks of the committed runs, as the command takes them."""
    tasks = {"sst2": "glue/SST-2", "mrpc": "glue/MRPC", "ner": "zh_ner", "chnsenti": "zh_senti"}
    return ["--corpora", str(corpora), "--tasks", ",".join(f"{k}={downstream / v}" for k, v in tasks.items())]


@pytest.fixture(scope="module")
def mini(data, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("mini")
    stdout = reproduce(out, *data)
    return {"out": out, "stdout": stdout, "report": json.loads((out / "report.json").read_text())}


def finite(x) -> bool:
    return isinstance(x, float) and math.isfinite(x)


def test_report_has_every_section_and_figure(mini):
    readme = (mini["out"] / "README.md").read_text(encoding="utf-8")
    for heading in (
        "## Verdicts",
        "## Start model",
        "## Downstream",
        "## Representation analysis",
        "## Pre-training runs",
        "## Figures",
        "## Budget",
        "## Settings",
    ):
        assert heading in readme, heading
    rep = mini["report"]
    for rel in rep["figures"].values():
        assert_png(mini["out"] / rel)
    assert set(rep["figures"]) >= {"score against steps", "loss curves", "analysis: layerwise"}
    assert "[mini] report:" in mini["stdout"]


def test_every_model_task_and_seed_is_a_computed_score(mini):
    rep, out = mini["report"], mini["out"]
    steps = rep["curve_steps"]
    models = [f"{a}@{s}" for a in ("mlm", "taco") for s in steps] + ["cont_mlm", "cont_tacl"]
    assert [m for m in rep["downstream"] if m != "reference"] == models
    assert rep["tasks"] == ["sst2", "mrpc", "ner (zh_ner)", "chnsenti"]
    seeds = [int(s) for s in rep["settings"]["finetune"]["ft_seeds"].split(",")]
    for model in models:
        # The numbers in the table are the fine-tuning stage's own, seed by seed.
        stage = json.loads((out / "downstream" / model / "stage.json").read_text())["result"]["tasks"]
        for task in rep["tasks"]:
            cell = rep["downstream"][model][task]
            assert cell["per_seed"] == stage[task]["splits"]["dev"]["score"]["per_seed"]
            assert len(cell["per_seed"]) == len(seeds) and all(finite(v) and 0 <= v <= 1 for v in cell["per_seed"])
            assert cell["mean"] == pytest.approx(statistics.fmean(cell["per_seed"]))
            assert cell["std"] == pytest.approx(statistics.stdev(cell["per_seed"]))
        avg = rep["downstream"][model]["average"]["per_seed"]
        for i, v in enumerate(avg):
            assert v == pytest.approx(
                statistics.fmean(rep["downstream"][model][t]["per_seed"][i] for t in rep["tasks"])
            )
    assert list(rep["downstream"]["reference"]) == ["sst2"]
    for accs in rep["heldout_mlm"].values():
        for lang in ("en", "zh"):
            assert 0 <= accs[lang]["accuracy"] <= 1 and 0 < accs[lang]["floor"] < 1 and accs[lang]["masked"] > 50
            assert finite(accs[lang]["cross_entropy"]) and accs[lang]["cross_entropy"] > 0
            assert finite(accs[lang]["unigram_cross_entropy"]) and accs[lang]["unigram_cross_entropy"] > 0
    for model in models:
        s = rep["last_layer"][model]
        assert all(finite(s[k]) for k in ("intra_sentence", "intra_context", "inter_context", "gap"))
    for run in ("mlm", "taco", "cont_mlm", "cont_tacl"):
        assert rep["runs"][run]["steps"] == (
            steps[-1] if run in ("mlm", "taco") else rep["settings"]["pretrain"]["continue_steps"]
        )
        assert finite(rep["runs"][run]["last"]["mlm_loss"])
    assert rep["runs"]["taco"]["last"].get("tc_loss") is not None
    assert rep["runs"]["cont_tacl"]["last"].get("tacl_loss") is not None
    assert rep["runs"]["cont_mlm"]["last"].get("nsp_loss") is not None
    assert rep["budget_minutes"]["total"] == pytest.approx(sum(rep["timings_s"].values()) / 60, rel=1e-6)


def test_held_out_figures_are_each_runs_own_evaluation_at_the_checkpoint(mini):
    """The report's held-out accuracy, cross-entropy and masked positions of every model are the eval/LANG/
    fields of its run's RUN/metrics.jsonl at the model's step; every run evaluated the held-out shards
    of its own format, built from the held-out documents, at every checkpoint."""
    rep, out = mini["report"], mini["out"]
    steps, cont = rep["curve_steps"], rep["settings"]["pretrain"]["continue_steps"]
    models = {**{f"{a}@{s}": (a, s) for a in ("mlm", "taco") for s in steps}, "cont_mlm": ("cont_mlm", cont),
              "cont_tacl": ("cont_tacl", cont)}  # fmt: skip
    for label, (arm, step) in models.items():
        run = out / "runs" / arm / "run"
        rows = {r["step"]: r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}
        fmt = "packed" if arm in ("mlm", "taco") else "nsp"
        ran = json.loads((run / "config.json").read_text())["eval"]
        assert ran["eval_data"] == [f"{x}={out / 'shards' / f'heldout_{fmt}_{x}' / 'mds'}" for x in ("en", "zh")]
        assert ran["eval_every"] == json.loads((run / "config.json").read_text())["run"]["save_every"]
        assert {s for s, r in rows.items() if "eval/en/mlm_loss" in r} >= (set(steps) if fmt == "packed" else {cont})
        for lang in ("en", "zh"):
            got, logged = rep["heldout_mlm"][label][lang], rows[step]
            assert got["accuracy"] == logged[f"eval/{lang}/mlm_acc"], (label, lang)
            assert got["cross_entropy"] == logged[f"eval/{lang}/mlm_loss"], (label, lang)
            assert got["masked"] == logged[f"eval/{lang}/masked"] and got["samples"] == logged[f"eval/{lang}/samples"]
    for fmt in ("packed", "nsp"):
        for lang in ("en", "zh"):
            built = json.loads((out / "shards" / f"heldout_{fmt}_{lang}" / "stage.json").read_text())["result"]
            assert built["documents_written"] == rep["text"][lang]["heldout_documents"], (fmt, lang)


def test_verdicts_follow_their_rules_from_the_numbers(mini):
    rep = mini["report"]
    table, steps = rep["downstream"], rep["curve_steps"]

    def spread_diff(a, b):
        return a["mean"] - b["mean"], a["std"] + b["std"]

    tacl = rep["verdicts"]["tacl"]
    d, s = spread_diff(table["cont_tacl"]["average"], table["cont_mlm"]["average"])
    assert tacl["average"]["difference"] == pytest.approx(d) and tacl["average"]["spread"] == pytest.approx(s)
    expected = "reproduces" if d > s else "does not reproduce" if d < -s else "inconclusive at this scale"
    assert tacl["by_rule"] == expected
    # Downstream verdicts count only when the start model clearly left the held-out MLM floor.
    start = rep["heldout_mlm"][f"mlm@{steps[-1]}"]
    left = all(
        a["accuracy"] - a["floor"] > 3 * (a["floor"] * (1 - a["floor"]) / a["masked"]) ** 0.5 for a in start.values()
    )
    for v in (tacl, rep["verdicts"]["taco"]):
        assert v["verdict"] == (v["by_rule"] if left else "inconclusive at this scale")

    taco = rep["verdicts"]["taco"]
    assert taco["verdict"] in VERDICTS and taco["by_rule"] in VERDICTS
    final = table[f"mlm@{steps[-1]}"]["average"]
    for arm in ("taco", "mlm"):
        reached = [x for x in steps if table[f"{arm}@{x}"]["average"]["mean"] >= final["mean"] - final["std"]]
        assert taco["steps_to_reach"][arm] == (reached[0] if reached else None)
    assert taco["steps_to_reach"]["mlm"] is not None  # MLM's own final point is always within its spread
    for x in steps:
        d, s = spread_diff(table[f"taco@{x}"]["average"], table[f"mlm@{x}"]["average"])
        assert taco["taco_minus_mlm_at_step"][str(x)]["difference"] == pytest.approx(d)
    last = rep["last_layer"]
    check = rep["verdicts"]["representation"]["tacl_intra_sentence_below_mlm"]
    assert check["holds"] == (last["cont_tacl"]["intra_sentence"] < last["cont_mlm"]["intra_sentence"])
    readme = (mini["out"] / "README.md").read_text(encoding="utf-8")
    assert f"**TaCL**: {tacl['verdict']}" in readme and f"**TACO**: {taco['verdict']}" in readme


def test_every_run_is_its_arm_file_through_train_py(mini):
    """train.py's own record of each run (RUN/config.json): the arm's config file, the shipped DeepSpeed
    config, and the per-run values the experiment adds."""
    rep, out = mini["report"], mini["out"]
    for arm, fmt in (("mlm", "packed"), ("taco", "packed"), ("cont_mlm", "nsp"), ("cont_tacl", "nsp")):
        ran = json.loads((out / "runs" / arm / "run" / "config.json").read_text())
        assert ran["objective"] == {**ran["objective"], **rep["arms"][arm]["objective"]}, arm
        assert ran["schedule"]["lr"] == rep["arms"][arm]["schedule"]["lr"] and ran["data"]["data_weights"] == [1, 1]
        assert [Path(d).parent.name for d in ran["data"]["data"]] == [f"{fmt}_en", f"{fmt}_zh"]
        assert ran["run"]["ds_config"].endswith("deepspeed_fp32.json")  # --quick pre-trains in fp32
        steps = rep["runs"][arm]["steps"]
        assert ran["schedule"]["max_steps"] == steps
        assert ran["schedule"]["warmup_steps"] == round(rep["settings"]["pretrain"]["warmup_share"] * steps)
    assert json.loads((out / "runs" / "mlm" / "run" / "config.json").read_text())["model"]["model_config"] == "tiny"


def test_a_rerun_keeps_the_finished_stages_and_a_changed_knob_reruns_what_depends_on_it(mini, data):
    out = mini["out"]
    stdout = reproduce(out, *data, "--ft_seeds", "1,2")
    kept = {
        line.split()[1].rstrip(":")
        for line in stdout.splitlines()
        if line.endswith("(done before with the same settings)")
    }
    # Text, shards, pre-training and analysis do not depend on the fine-tuning seeds ...
    assert {"data", "tokenizer", "shards/packed_en", "shards/nsp_zh", "shards/heldout_nsp_zh", "runs/mlm", "runs/taco",
            "runs/cont_mlm", "runs/cont_tacl", "analysis"} <= kept, stdout  # fmt: skip
    # ... every fine-tuning stage does.
    assert not [k for k in kept if k.startswith("downstream/")], stdout
    rep = json.loads((out / "report.json").read_text())
    assert all(len(rep["downstream"][m]["sst2"]["per_seed"]) == 2 for m in rep["downstream"])
    assert rep["runs"] == mini["report"]["runs"] and rep["heldout_mlm"] == mini["report"]["heldout_mlm"]


def test_start_only_scores_the_start_at_every_checkpoint_reusing_the_stages(mini, data):
    # --start_only on the same folder and settings: nothing is pre-trained again, and its held-out numbers
    # are the full report's for the same checkpoints (the run's own evaluation, the same reference).
    out, full = mini["out"], mini["report"]
    stdout = reproduce(out, *data, "--start_only")
    kept = {line.split()[1].rstrip(":") for line in stdout.splitlines() if line.endswith("same settings)")}
    assert {"data", "tokenizer", "shards/packed_en", "shards/heldout_packed_zh", "runs/mlm"} <= kept, stdout
    assert "runs/taco" not in stdout and "downstream/" not in stdout, stdout
    rep = json.loads((out / "start.json").read_text())
    steps = full["curve_steps"]
    assert [r["step"] for r in rep["checkpoints"]] == steps
    for row in rep["checkpoints"]:
        accs = row["heldout_mlm"]
        assert accs == full["heldout_mlm"][f"mlm@{row['step']}"]
        micro, seq_len = rep["deepspeed"]["train_micro_batch_size_per_gpu"], rep["settings"]["text"]["max_seq_len"]
        assert row["tokens"] == row["step"] * micro * seq_len
        assert row["left_floor"] == {
            lang: a["accuracy"] - a["floor"] > 3 * (a["floor"] * (1 - a["floor"]) / a["masked"]) ** 0.5
            for lang, a in accs.items()
        }
    first = [r["step"] for r in rep["checkpoints"] if all(r["left_floor"].values())]
    assert rep["left_floor_at"] == (first[0] if first else None)
    md = (out / "START.md").read_text(encoding="utf-8")
    assert all(f"| {s} |" in md for s in steps) and "start_loss.png" in md
    assert_png(out / "start_loss.png")
    assert "[mini] start model:" in stdout
