"""The verdict rules of the miniature, as pure functions of the stages' numbers.

A difference between two models is called real only where it exceeds the seeds' spread (the sum of the
two standard deviations over the fine-tuning seeds), and a downstream verdict counts only when the start
model has clearly left the held-out MLM floor. The verdicts are reported as the rules give them.
"""

from __future__ import annotations

import math
import statistics

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


FLOOR_SE = 3  # "clearly left the floor": above it by more than this many standard errors


def left_floor(acc: dict) -> bool:
    """Whether a held-out MLM accuracy ({accuracy, floor, masked}) is clearly above its floor: by more than
    FLOOR_SE standard errors of a binomial with the floor's rate over the masked positions."""
    p, n = acc["floor"], acc["masked"]
    return acc["accuracy"] - p > FLOOR_SE * math.sqrt(max(p * (1 - p), 1e-12) / n)
