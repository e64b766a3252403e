"""Turn a training checkpoint into a Hugging Face folder (BertForPreTraining weights, config,
tokenizer) that loads with AutoModelForMaskedLM / AutoModel and works in a fill-mask pipeline.

    python pipeline/export.py --checkpoint RUN/checkpoints/step_00001000 --out HF_DIR

The weights are the fp32 master weights of the ZeRO optimizer (DeepSpeed's zero_to_fp32 merges the
per-rank shards), not the bf16 copies the engine computes with: cast to bf16 they are those copies.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import sys
from pathlib import Path
from typing import Optional, Sequence

if __package__ in (None, ""):  # run as a script: make `pipeline` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipeline.checkpoint import HF_SUBDIR, MARKER, is_complete  # noqa: E402

STATE_PREFIX = "net."  # pipeline.model.Student keeps the BertForPreTraining under `net`


def load_student(checkpoint_dir: str | Path):
    """(transformers.BertForPreTraining in fp32, eval mode; its tokenizer) from a complete checkpoint
    folder RUN/checkpoints/step_XXXXXXXX."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from transformers import AutoTokenizer, BertConfig, BertForPreTraining

    ckpt = Path(checkpoint_dir)
    if not ckpt.is_dir():
        raise ValueError(f"--checkpoint {ckpt}: no such folder")
    if not is_complete(ckpt):
        raise ValueError(f"--checkpoint {ckpt}: incomplete (no {MARKER}); the save did not finish")
    # zero_to_fp32 prints a line per parameter group; keep the user's terminal readable.
    with contextlib.redirect_stdout(io.StringIO()):
        state = get_fp32_state_dict_from_zero_checkpoint(str(ckpt.parent), tag=ckpt.name)
    if not all(k.startswith(STATE_PREFIX) for k in state):
        raise ValueError(f"--checkpoint {ckpt}: not a pipeline.train checkpoint (unexpected keys)")
    state = {k[len(STATE_PREFIX):]: v for k, v in state.items()}
    config = BertConfig.from_pretrained(ckpt / HF_SUBDIR)
    model = BertForPreTraining(config)
    missing, unexpected = model.load_state_dict(state, strict=False)
    # Tied weights (the MLM decoder shares the word embeddings) may be stored once.
    tied = {"cls.predictions.decoder.weight", "cls.predictions.decoder.bias"}
    if set(missing) - tied or unexpected:
        raise ValueError(f"--checkpoint {ckpt}: weights do not match the saved config "
                         f"(missing {sorted(set(missing) - tied)}, unexpected {sorted(unexpected)})")
    model.tie_weights()
    model.eval()
    tokenizer = AutoTokenizer.from_pretrained(ckpt / HF_SUBDIR)
    return model, tokenizer


def export(checkpoint_dir: str | Path, out_dir: str | Path) -> Path:
    """Write the checkpoint's student as a Hugging Face folder; returns it."""
    model, tokenizer = load_student(checkpoint_dir)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description="Export a training checkpoint as a Hugging Face BERT folder.")
    p.add_argument("--checkpoint", required=True, help="RUN/checkpoints/step_XXXXXXXX")
    p.add_argument("--out", required=True, help="output folder")
    args = p.parse_args(argv)
    try:
        out = export(args.checkpoint, args.out)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"[pipeline] exported {args.checkpoint} to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
