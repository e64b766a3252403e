"""Representation analysis of one or more models (and of one run's checkpoints): the entry point.

    python pipeline/analyze.py --model DIR [--model LABEL=DIR ...] --data SHARDS_OR_TEXT --out report/
                               [--run RUN_DIR] [--max_sequences N] [--heatmap_text "..."]

Writes report/metrics.json, report/layerwise.png, report/heatmap.png, report/training_gap.png (with
--run) and report/README.md. The logic is in pipeline/analysis_run.py.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipeline.analysis_run import AnalyzeConfig, run_analysis  # noqa: E402
from pipeline.model_args import parse_model, unique_labels  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", action="append", default=[], metavar="[LABEL=]DIR",
                   help="HF model folder (trainer export or any BERT folder); repeat to compare models")
    p.add_argument("--data", required=True, type=Path,
                   help="MDS shard folder (with index.json and tokenizer/) or a .txt/.jsonl text file")
    p.add_argument("--out", required=True, type=Path, help="report folder")
    p.add_argument("--run", type=Path, help="a trainer save_dir: plot the intra/inter gap over its checkpoints")
    p.add_argument("--run_start", type=Path, help="the HF folder the run started from (--init_from), plotted as "
                   "step 0 (default: RUN/config.json's init_from when it still exists)")
    p.add_argument("--tokenizer", type=Path, help="tokenizer folder for model folders that have none")
    p.add_argument("--max_sequences", type=int, default=512)
    p.add_argument("--max_seq_len", type=int, default=128, help="text input: tokens per sequence")
    p.add_argument("--pack_text", action="store_true",
                   help="text input: pack consecutive lines of a document into one sequence (default: a line each)")
    p.add_argument("--batch_size", type=int, default=32)
    p.add_argument("--isotropy_tokens", type=int, default=10000)
    p.add_argument("--isotropy_pairs", type=int, default=20000)
    p.add_argument("--heatmap_text", help="the sentence of the heatmap (default: the first sentence of --data)")
    p.add_argument("--heatmap_max_tokens", type=int, default=24)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="auto", help="auto (cuda when available), cpu, cuda, cuda:1, ...")
    a = p.parse_args(argv)
    for flag in ("max_sequences", "batch_size", "isotropy_tokens", "isotropy_pairs", "heatmap_max_tokens"):
        if getattr(a, flag) < 2:
            p.error(f"--{flag} must be >= 2 (got {getattr(a, flag)})")
    cfg = AnalyzeConfig(
        models=unique_labels([parse_model(m) for m in a.model]), data=a.data, out=a.out, run=a.run, run_start=a.run_start,
        tokenizer=a.tokenizer, max_sequences=a.max_sequences, max_seq_len=a.max_seq_len, pack_text=a.pack_text,
        batch_size=a.batch_size, isotropy_tokens=a.isotropy_tokens, isotropy_pairs=a.isotropy_pairs,
        heatmap_text=a.heatmap_text, heatmap_max_tokens=a.heatmap_max_tokens, seed=a.seed, device=a.device)
    try:
        metrics = run_analysis(cfg)
    except ValueError as e:
        print(f"analyze.py: error: {e}", file=sys.stderr)
        return 2
    for label, m in metrics["models"].items():
        s = m["last_layer"]
        if m["unk_share"] > 0.05:
            print(f"[analyze] warning: {100 * m['unk_share']:.0f}% of {label}'s tokens are [UNK]: its vocabulary "
                  "does not cover this text, so its similarities say little", file=sys.stderr)
        print(f"[analyze] {label}: last layer intra-sentence {s['intra_sentence']:.4f} intra-context "
              f"{s['intra_context']:.4f} inter-context {s['inter_context']:.4f} gap {s['gap']:.4f} "
              f"random-pair {s['random_pair_cosine']:.4f} top-PC {s['top_direction_variance_share']:.4f}")
    print(f"[analyze] wrote {a.out}/metrics.json and README.md ({metrics['wall_s']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
