"""Training curves of one or more runs, side by side: every loss term, accuracy, learning rate, gradient
norm and throughput against the optimizer step, one panel per field, one colour per run.

Reads RUN/metrics.jsonl only (the trainer's record, pipeline.training.metrics), so it works on a run in
progress, a finished one, or a copy of the file. A field that some runs lack (TaCL has no tc_loss, a
run without NSP no nsp_acc) is drawn for the runs that have it; which runs lack it is returned, said
on the command line, and written in the panel. The held-out evaluation's fields (eval/mlm_loss, ...)
are drawn dashed, with markers, in the panel of the training field they measure; its representation
health figures have panels of their own.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from preprocessing.errors import UsageError

# The panels, in this order; other *_loss / *_acc fields a run records follow their group.
LOSS_FIELDS = ("loss", "mlm_loss", "nsp_loss", "tacl_loss", "tc_loss")
ACC_FIELDS = ("mlm_acc", "nsp_acc", "tacl_acc", "tc_acc")
OTHER_FIELDS = ("lr", "grad_norm", "tokens_per_s", "eval/intra_sentence", "eval/context_gap")
TITLES = {
    "lr": "learning rate",
    "grad_norm": "gradient norm",
    "tokens_per_s": "tokens/s (all ranks)",
    "eval/intra_sentence": "held-out intra-sentence similarity",
    "eval/context_gap": "held-out intra - inter-context similarity",
}
EVAL = "eval/"  # the held-out evaluation's fields: eval/<training field> joins that field's panel


def _x(record: dict[str, Any]) -> int:
    """Where a record is drawn: its step counted from the first phase's start (global_step), so that a
    second phase (--continue_from) continues to the right of the first; a run from before phases had
    only "step"."""
    g = _number(record.get("global_step"))
    return int(g) if g is not None else record["step"]


@dataclass
class RunCurves:
    """One run's metrics.jsonl: its label and records sorted by step."""

    label: str
    path: Path
    records: list[dict[str, Any]]
    bad_lines: int = 0  # lines that were not JSON records with a step (a line being written, a cut file)

    def fields(self) -> set[str]:
        """The fields with at least one number that can be drawn."""
        return {k for r in self.records for k, v in r.items() if _number(v) is not None}

    def series(self, name: str) -> tuple[list[int], list[float]]:
        """(steps, values) of one field; records without a number for it that can be drawn are left out."""
        pts = [(_x(r), _number(r.get(name))) for r in self.records]
        pts = [(s, v) for s, v in pts if v is not None]
        return [s for s, _ in pts], [v for _, v in pts]

    def left_out(self) -> dict[str, list[tuple[int, Any]]]:
        """field -> (step, value) of the numbers `series` leaves out: NaN, infinities, and values beyond
        PLOT_LIMIT."""
        out: dict[str, list[tuple[int, Any]]] = {}
        for r in self.records:
            for k, v in r.items():
                if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool) and _number(v) is None:
                    out.setdefault(k, []).append((_x(r), v))
        return out


@dataclass
class Plan:
    """What a figure shows: the fields in panel order, and per field the runs that lack it."""

    fields: list[str]
    missing: dict[str, list[str]] = field(default_factory=dict)


# matplotlib computes a panel's limits and ticks from the span of its values: a span near the largest
# float (~1.8e308) overflows there ("arange: cannot compute length"). Values beyond this are left out.
PLOT_LIMIT = 1e300


def _number(v: Any) -> Optional[float]:
    """v as a float that can be drawn, else None (not a number, NaN, infinite, beyond PLOT_LIMIT)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    try:
        x = float(v)  # an int of 400 digits: OverflowError
    except OverflowError:
        return None
    return x if math.isfinite(x) and abs(x) <= PLOT_LIMIT else None


def read_run(spec: str) -> RunCurves:
    """A run folder (RUN/metrics.jsonl) or a metrics file. UsageError naming the path when it has no
    metrics."""
    path = Path(spec)
    if path.is_dir():
        path = path / "metrics.jsonl"
    if not path.is_file():
        raise UsageError(f"{spec}: no metrics.jsonl here; give a run folder (--save_dir) or its metrics.jsonl")
    records, bad = {}, 0
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            r = json.loads(line)
            if _number(r["step"]) is None:  # 1e400 reads as inf: no step to draw it at
                raise ValueError
            step = int(r["step"])
        except (json.JSONDecodeError, KeyError, TypeError, ValueError):
            bad += int(bool(line.strip()))
            continue
        records[step] = r  # a step written twice (a copy of an older file): the later line wins
    if not records:
        raise UsageError(f"{path}: no metrics lines yet (the trainer writes one every --log_every steps)")
    folder = path.parent if path.name == "metrics.jsonl" else path
    label = folder.resolve().name if path.name == "metrics.jsonl" else path.stem
    return RunCurves(label=label, path=path, records=[records[s] for s in sorted(records)], bad_lines=bad)


def unique_labels(runs: list[RunCurves]) -> None:
    """Runs named alike (two folders called run/) get their parent folder's name in front."""
    counts: dict[str, int] = {}
    for r in runs:
        counts[r.label] = counts.get(r.label, 0) + 1
    for r in runs:
        if counts[r.label] > 1:
            folder = r.path.parent.resolve()
            r.label = f"{folder.parent.name}/{r.label}"
    seen: dict[str, int] = {}
    for r in runs:  # still alike: number them in the order given
        seen[r.label] = seen.get(r.label, 0) + 1
        if seen[r.label] > 1:
            r.label = f"{r.label} ({seen[r.label]})"


def plan(runs: list[RunCurves], only: Optional[list[str]] = None) -> Plan:
    """The panels: the known fields any run has, in LOSS/ACC/OTHER order, with the other *_loss and
    *_acc fields after their group; `only` chooses (and orders) them instead."""
    present = set().union(*(r.fields() for r in runs))
    # A held-out field draws in its training field's panel (a run may have only the held-out one).
    present |= {f[len(EVAL) :] for f in present if f.startswith(EVAL) and f[len(EVAL) :] in (*LOSS_FIELDS, *ACC_FIELDS)}
    if only:
        unknown = [f for f in only if f not in present]
        if unknown:
            raise UsageError(
                f"--fields {','.join(only)}: {', '.join(unknown)} in none of the runs; they have "
                f"{', '.join(sorted(present))}"
            )
        fields = list(dict.fromkeys(only))
    else:
        extra_loss = sorted(f for f in present if re.fullmatch(r"\w+_loss", f) and f not in LOSS_FIELDS)
        extra_acc = sorted(f for f in present if re.fullmatch(r"\w+_acc", f) and f not in ACC_FIELDS)
        order = [*LOSS_FIELDS, *extra_loss, *ACC_FIELDS, *extra_acc, *OTHER_FIELDS]
        fields = [f for f in order if f in present]
    missing = {f: [r.label for r in runs if f not in r.fields() and EVAL + f not in r.fields()] for f in fields}
    return Plan(fields=fields, missing={f: labels for f, labels in missing.items() if labels})


def draw(runs: list[RunCurves], p: Plan, *, title: Optional[str] = None):
    """The figure: a panel per field (3 columns), a line per run in that run's colour, the legend once."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on a cluster node
    import matplotlib.pyplot as plt

    ncols = min(3, len(p.fields))
    nrows = math.ceil(len(p.fields) / ncols)
    legend_rows = math.ceil(len(runs) / 4)
    title_in, header_in = (0.4 if title else 0.0), (0.4 if title else 0.0) + 0.3 * legend_rows + 0.1  # inches
    height = 3.4 * nrows + header_in
    fig, axes = plt.subplots(nrows, ncols, figsize=(5.2 * ncols, height), squeeze=False)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, name in zip(axes.flat, p.fields):
        held_out = False
        for i, run in enumerate(runs):
            steps, values = run.series(name)
            if steps:
                marker = "o" if len(steps) == 1 else None  # one point draws no line
                ax.plot(steps, values, color=colours[i % len(colours)], label=run.label, marker=marker, lw=1.4)
            steps, values = run.series(EVAL + name) if not name.startswith(EVAL) else ([], [])
            if steps:
                held_out = True
                ax.plot(steps, values, color=colours[i % len(colours)], ls="--", marker="o", ms=3, lw=1.2)
        ax.set_title(TITLES.get(name, name) + (" (dashed: held-out)" if held_out else ""), fontsize=10)
        ax.set_xlabel("step (counted from the first phase)", fontsize=8)
        ax.tick_params(labelsize=8)
        ax.grid(alpha=0.3)
        if name == "lr":
            ax.ticklabel_format(axis="y", style="sci", scilimits=(-2, 3))
        if name in p.missing:
            ax.text(
                0.98,
                0.96,
                "not in: " + ", ".join(p.missing[name]),
                transform=ax.transAxes,
                ha="right",
                va="top",
                fontsize=7,
                color="0.4",
            )
    for ax in list(axes.flat)[len(p.fields) :]:
        ax.set_visible(False)
    handles = [plt.Line2D([], [], color=colours[i % len(colours)], lw=2, label=r.label) for i, r in enumerate(runs)]
    if title:
        fig.suptitle(title, y=1 - 0.12 / height, va="top", fontsize=12)
    fig.legend(
        handles=handles, loc="upper center", bbox_to_anchor=(0.5, 1 - title_in / height), ncol=min(len(runs), 4),
        frameon=False, fontsize=9,
    )  # fmt: skip
    fig.tight_layout(rect=(0, 0, 1, 1 - header_in / height))
    return fig


def plot_runs(specs: list[str], out: str, *, fields: Optional[list[str]] = None, title: Optional[str] = None):
    """Read the runs, draw them, write `out` (the format from its suffix: .png, .pdf, .svg).
    Returns (runs, plan)."""
    runs = [read_run(s) for s in specs]
    unique_labels(runs)
    p = plan(runs, fields)
    fig = draw(runs, p, title=title)
    out_path = Path(out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return runs, p
