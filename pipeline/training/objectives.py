"""The objectives as loss terms: MLM (+ NSP) for mlm, + TaCL against the frozen teacher for tacl,
+ lambda * TC for taco (docs/objectives.md). One micro-batch in, the total loss and each term out.

Legend: B sequences, L positions, D hidden size, N masked positions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch

if TYPE_CHECKING:
    from pipeline.modeling.encoder import Encoder
    from pipeline.training.preflight import Prepared


def metric_keys(objective: str, *, nsp: bool) -> list[str]:
    """The loss terms and accuracies an objective logs, in order."""
    return (
        ["loss", "mlm_loss", "mlm_acc"]
        + (["nsp_loss", "nsp_acc"] if nsp else [])
        + {"tacl": ["tacl_loss", "tacl_acc"], "taco": ["tc_loss", "tc_acc"], "mlm": []}[objective]
    )


@dataclass
class StepLosses:
    """One micro-batch's loss terms and metrics (detached fp32 scalars)."""

    total: torch.Tensor
    values: dict[str, torch.Tensor]


def compute_losses(
    prep: Prepared, out: dict[str, torch.Tensor], batch: dict, *, teacher: Optional[Encoder], generator: torch.Generator
) -> StepLosses:
    """The objective's total loss for one micro-batch, and each term with its accuracy. `batch` is the
    collator's (pipeline.data.collator) on the device: its indices and counts spare every term a
    device read."""
    from pipeline import losses
    from pipeline.modeling.student import run_encoder

    o = prep.cfg.objective
    total, mlm_m = losses.mlm_loss(out["mlm_logits"], batch["mlm_labels"], compact=True)
    values = {"mlm_loss": mlm_m["loss"], "mlm_acc": mlm_m["acc"]}
    if prep.use_nsp:
        nsp, nsp_m = losses.nsp_loss(out["nsp_logits"], batch["nsp_labels"])
        total = total + nsp
        values.update(nsp_loss=nsp_m["loss"], nsp_acc=nsp_m["acc"])
    if o.objective == "tacl":
        with torch.no_grad():
            teacher_BLD = run_encoder(teacher, batch, ids="original_ids")[0]
        tacl, m = losses.tacl_loss(
            out["hidden"],
            teacher_BLD=teacher_BLD,
            masked_BL=batch["masked"],
            attention_mask_BL=batch["attention_mask"],
            temperature=o.tacl_temperature,
            negatives=o.tacl_negatives,
            num_pool=o.tacl_num_pool,
            generator=generator,
            anchor_flat_N=batch["masked_grid_index"],
            real_flat_T=batch["grid_index"],
        )
        total = total + tacl
        values.update(tacl_loss=m["loss"], tacl_acc=m["acc"])
    elif o.objective == "taco":
        anchors = {
            "all": batch["grid_index"],
            "masked": batch["masked_grid_index"],
            "unmasked": batch["unmasked_grid_index"],
        }[o.taco_anchors]
        tc, m = losses.taco_loss(
            out["hidden"],
            embeddings_BLD=out["embeddings"],
            attention_mask_BL=batch["attention_mask"],
            anchors=o.taco_anchors,
            masked_BL=batch["masked"],
            window=o.taco_window,
            num_negatives=o.taco_num_negatives,
            temperature=o.taco_temperature,
            detach=o.taco_detach,
            generator=generator,
            anchor_flat_N=anchors,
            real_flat_T=batch["grid_index"],
            uniform=batch["layout"] == "packed" and o.taco_anchors == "all",
        )
        total = total + o.taco_lambda * tc
        values.update(tc_loss=m["loss"], tc_acc=m["acc"])
    # The logged total is the sum of the logged terms. `total` itself is this rank's share of each
    # global mean (what back-propagates), not a value of its own: on a step where another rank skips
    # a micro-batch, averaging the shares would not give the sum of the terms.
    values["loss"] = (
        values["mlm_loss"]
        + values.get("nsp_loss", 0.0)
        + values.get("tacl_loss", 0.0)
        + o.taco_lambda * values.get("tc_loss", 0.0)
    ).float()
    return StepLosses(total=total, values=values)
