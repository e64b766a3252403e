"""The closing summary of `make demo`: did the run learn, how fast, where everything is, and what the
exported model predicts for a masked word.

    python -m pipeline.demo_summary --run demo/run --shards demo/shards --plot demo/run/curves.png \
        --export demo/export --fill_mask "the process takes place mainly in the [MASK] ."

Reads RUN/metrics.jsonl and RUN/config.json; the fill-mask line runs the exported Hugging Face folder
through transformers' `fill-mask` pipeline on CPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional

if __package__ in (None, ""):  # run as a script: import the repository's packages, not this folder's modules
    _HERE = Path(__file__).resolve().parent
    sys.path[:] = [str(_HERE.parent)] + [p for p in sys.path if Path(p or ".").resolve() != _HERE]

from preprocessing import cli  # noqa: E402
from preprocessing.errors import UsageError  # noqa: E402


def learning_table(records: list[dict[str, Any]], *, prefix: str = "") -> list[str]:
    """First and last value of every loss term and accuracy (of the held-out evaluation with prefix
    "eval/", from the first and last records that have one), and the change."""
    if prefix:
        records = [r for r in records if any(k.startswith(prefix) for k in r)]
        if not records:
            return []
    first, last = records[0], records[-1]
    keys = [k for k in first if (k.startswith(prefix) if prefix else "/" not in k)]
    keys = [k for k in keys if k == "loss" or k.endswith(("_loss", "_acc"))]
    keys = [k for k in keys if k.endswith("loss")] + [k for k in keys if k.endswith("_acc")]
    width = max([10, *map(len, keys)])
    rows = [f"  {'':<{width}} {'step ' + str(first['step']):>12} {'step ' + str(last['step']):>12}"]
    for k in keys:
        a, b = first.get(k), last.get(k)
        if isinstance(a, (int, float)) and isinstance(b, (int, float)):
            trend = "falls" if b < a else "rises" if b > a else "flat"
            rows.append(f"  {k:<{width}} {a:>12.4f} {b:>12.4f}   {trend}")
    return rows


def throughput(records: list[dict[str, Any]]) -> str:
    """Median tokens/s over the log intervals after the first (which holds the start-up)."""
    values = [r["tokens_per_s"] for r in records[1:] or records if isinstance(r.get("tokens_per_s"), (int, float))]
    if not values:
        return "tokens/s   not recorded"
    steps = [r["step_time_s"] for r in records[1:] or records if isinstance(r.get("step_time_s"), (int, float))]
    per_step = f", {statistics.median(steps):.3f} s/step" if steps else ""
    return f"tokens/s   {statistics.median(values):,.0f} (all ranks, median over the log intervals{per_step})"


def fill_mask_lines(export: Path, text: str, *, top_k: int = 3) -> list[str]:
    from transformers import pipeline

    fill = pipeline("fill-mask", model=str(export), tokenizer=str(export), device=-1, top_k=top_k)
    mask = fill.tokenizer.mask_token
    if mask not in text:
        raise UsageError(f"--fill_mask {text!r}: the text needs the tokenizer's mask token {mask}")
    guesses = ", ".join(f"{p['token_str']!r} {p['score']:.2f}" for p in fill(text))
    return [f"fill-mask  {text}", f"           -> {guesses}"]


def summary(
    run: Path, *, shards: Optional[Path], plot: Optional[Path], export: Optional[Path], fill_mask: Optional[str]
) -> list[str]:
    from pipeline.training.curves import read_run

    records = read_run(str(run)).records
    config_path = run / "config.json"
    config = json.loads(config_path.read_text()) if config_path.is_file() else {}
    objective = config.get("objective", {}).get("objective", "?")
    engine = config.get("engine", {})
    head = f"run        {run}  ({objective}, {records[-1]['step']} steps"
    if engine:
        head += f", {engine.get('world_size')} rank(s) x micro-batch {engine.get('micro_batch_per_rank')}"
    lines = ["", "== demo summary ==", head + ")", *learning_table(records)]
    held_out = learning_table(records, prefix="eval/")
    if held_out:
        lines += ["held-out (eval/: the same masked positions at every evaluation)", *held_out]
    lines.append(throughput(records))
    if shards is not None:
        manifest = shards / "build_manifest.json"
        samples = json.loads(manifest.read_text()).get("counts", {}).get("samples") if manifest.is_file() else None
        lines.append(f"shards     {shards}" + (f"  ({samples} samples, tokenizer in tokenizer/)" if samples else ""))
    lines.append(f"metrics    {run / 'metrics.jsonl'}  (TensorBoard: {run / 'tensorboard'})")
    if plot is not None:
        lines.append(f"plot       {plot}")
    if export is not None:
        lines.append(f"export     {export}  (AutoModelForMaskedLM / fill-mask)")
        if fill_mask:
            lines += fill_mask_lines(export, fill_mask)
    return lines


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="demo_summary", description=__doc__.split("\n")[0])
    p.add_argument("--run", required=True, help="the run folder (--save_dir)")
    p.add_argument("--shards", help="the shard folder the run read")
    p.add_argument("--plot", help="the curves image")
    p.add_argument("--export", help="the exported Hugging Face folder")
    p.add_argument("--fill_mask", help="a sentence with the tokenizer's mask token, for the exported model")
    args = p.parse_args(argv)

    def go() -> int:
        path = lambda s: Path(s) if s else None
        lines = summary(
            Path(args.run),
            shards=path(args.shards),
            plot=path(args.plot),
            export=path(args.export),
            fill_mask=args.fill_mask,
        )
        print("\n".join(lines))
        return 0

    return cli.run(go, prog="demo_summary")


if __name__ == "__main__":
    sys.exit(main())
