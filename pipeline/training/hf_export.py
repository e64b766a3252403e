"""A training checkpoint as a Hugging Face folder (BertForPreTraining weights, config, tokenizer) that
loads with AutoModelForMaskedLM / AutoModel and works in a fill-mask pipeline; and the check that an
export reproduces the engine it came from.

The weights are the fp32 master weights of the ZeRO optimizer (DeepSpeed's zero_to_fp32 merges the
per-rank shards), not the bf16 copies the engine computes with: cast to bf16 they are those copies.
"""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path
from typing import Any

import torch

from pipeline.training.checkpoint import HF_SUBDIR, MARKER, is_complete, verify_loadable, weights_only_loads
from preprocessing.errors import UsageError

# Exported weights cast to the engine's dtype must reproduce its logits to within this many steps of
# that dtype (relative to the largest logit): the same kernels on the same device give 0.
SAME_DTYPE_TOLERANCE_ULPS = 1.0
STATE_PREFIX = "net."  # pipeline.modeling.student.Student keeps the BertForPreTraining under `net`


def load_student(checkpoint_dir: str | Path):
    """(transformers.BertForPreTraining in fp32, eval mode; its tokenizer) from a complete checkpoint
    folder RUN/checkpoints/step_XXXXXXXX."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from transformers import AutoTokenizer, BertConfig, BertForPreTraining

    ckpt = Path(checkpoint_dir)
    if not ckpt.is_dir():
        raise UsageError(f"--checkpoint {ckpt}: no such folder")
    if not is_complete(ckpt):
        raise UsageError(f"--checkpoint {ckpt}: incomplete (no {MARKER}); the save did not finish")
    # zero_to_fp32 prints a line per parameter group; keep the user's terminal readable.
    verify_loadable(ckpt)
    with weights_only_loads(), contextlib.redirect_stdout(io.StringIO()):
        state = get_fp32_state_dict_from_zero_checkpoint(str(ckpt.parent), tag=ckpt.name)
    if not all(k.startswith(STATE_PREFIX) for k in state):
        raise UsageError(f"--checkpoint {ckpt}: not a pipeline.train checkpoint (unexpected keys)")
    state = {k[len(STATE_PREFIX) :]: v for k, v in state.items()}
    config = BertConfig.from_pretrained(ckpt / HF_SUBDIR)
    model = BertForPreTraining(config)
    missing, unexpected = model.load_state_dict(state, strict=False)
    # Tied weights (the MLM decoder shares the word embeddings) may be stored once.
    tied = {"cls.predictions.decoder.weight", "cls.predictions.decoder.bias"}
    if set(missing) - tied or unexpected:
        raise UsageError(
            f"--checkpoint {ckpt}: weights do not match the saved config "
            f"(missing {sorted(set(missing) - tied)}, unexpected {sorted(unexpected)})"
        )
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


def verify_export(net: Any, export_dir: str | Path, *, batch: dict[str, Any], dtype: Any, out: Path) -> dict[str, Any]:
    """Compare the exported folder with the live model it came from, on one batch, and record it.

    `net`: the engine's BertForPreTraining (its weights in the engine's dtype). The exported fp32
    weights cast to that dtype are those weights, so the same forward must give the same MLM logits
    (up to `SAME_DTYPE_TOLERANCE_ULPS` bf16/fp16 steps, for kernels that may reorder sums); in fp32
    they differ by the engine dtype's rounding. Writes `out`.json (the differences) and `out`.pt (the
    inputs and the engine's logits). Raises RuntimeError when the same-dtype logits differ more.
    In: a collated batch (pipeline.data.collator), any layout.
    """
    from transformers import AutoModelForMaskedLM

    from pipeline.data.collator import grid_inputs

    device = next(net.parameters()).device
    inputs = {k: v.to(device) for k, v in grid_inputs(batch).items()}
    real_BL = inputs["attention_mask"].bool()
    was_training = net.training
    net.eval()
    with torch.no_grad():
        engine_BLV = net(**inputs).prediction_logits.float()
    net.train(was_training)
    model = AutoModelForMaskedLM.from_pretrained(export_dir).to(device).eval()
    with torch.no_grad():
        fp32_BLV = model(**inputs).logits.float()
        same_BLV = model.to(dtype)(**inputs).logits.float()
    scale = float(engine_BLV[real_BL].abs().max())
    ulp = scale * float(torch.finfo(dtype).eps) if dtype != torch.float32 else scale * 1e-6
    result = {
        "dtype": str(dtype).replace("torch.", ""),
        "max_abs_logit": scale,
        "max_abs_diff_same_dtype": float((same_BLV - engine_BLV)[real_BL].abs().max()),
        "max_abs_diff_fp32": float((fp32_BLV - engine_BLV)[real_BL].abs().max()),
        "tolerance_same_dtype": SAME_DTYPE_TOLERANCE_ULPS * ulp,
        "positions": int(real_BL.sum()),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    torch.save(
        {**{k: v.cpu() for k, v in inputs.items()}, "engine_logits": engine_BLV.cpu(), "dtype": result["dtype"]},
        out.with_suffix(".pt"),
    )
    if result["max_abs_diff_same_dtype"] > result["tolerance_same_dtype"]:
        raise RuntimeError(
            f"the export in {export_dir} does not reproduce the engine's logits: max |diff| "
            f"{result['max_abs_diff_same_dtype']:.4g} > {result['tolerance_same_dtype']:.4g} "
            f"({out.with_suffix('.json')})"
        )
    return result
