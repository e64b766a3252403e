"""TACO (Fu et al., ACL 2022): MLM + lambda x a token-alignment contrastive term on the tokens' global
semantics (last layer minus embeddings), trained from scratch on packed blocks (pipeline.losses.taco
has the formula).

Legend: B sequences, L positions, D hidden size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pipeline.objectives.base import Defaults, Objective, register
from preprocessing import cli
from preprocessing.errors import UsageError


@dataclass
class TacoKnobs:
    taco_temperature: float = cli.knob(0.07, "TACO's tau")
    taco_window: int = cli.knob(5, "TACO's positive window (odd; 5 = offsets -2..+2)")
    taco_num_negatives: int = cli.knob(50, "TACO's negatives per anchor")
    taco_anchors: str = cli.knob("all", "which tokens are TACO anchors", choices=("all", "masked", "unmasked"))
    taco_lambda: float = cli.knob(1.0, "weight of TACO's TC loss")
    taco_detach: bool = cli.knob(
        True,
        "let gradients flow into TACO's positives and negatives (an ablation)",
        flag="--taco_no_detach",
        invert=True,
    )


class TACO(Objective):
    name = "taco"
    help = "MLM + lambda x TACO's token-alignment term on packed blocks (pre-training from scratch)"
    # Upstream: lr 1e-4, 10k warm-up steps (base), linear decay, no NSP.
    defaults = Defaults(lr=1e-4, nsp="off", warmup_steps=10_000)
    formats = ("packed",)
    trains_on = "packed blocks"
    term = "tc"
    needs_embeddings = True
    knobs = TacoKnobs

    def check_knobs(self, args: Any) -> None:
        if args.taco_window < 3 or args.taco_window % 2 == 0:
            raise UsageError(f"--taco_window must be odd and >= 3, got {args.taco_window}")

    def check_selected(self, args: Any) -> None:
        if args.nsp == "on":
            raise UsageError("--nsp on with --objective taco: TACO trains MLM + TC on packed blocks, without NSP")

    def weight(self, args: Any) -> float:
        return args.taco_lambda

    def extra_term(self, out, batch, *, inputs):
        from pipeline.losses import taco_loss

        a = inputs.args
        anchors = {
            "all": batch["grid_index"],
            "masked": batch["masked_grid_index"],
            "unmasked": batch["unmasked_grid_index"],
        }[a.taco_anchors]
        return taco_loss(
            out["hidden"],
            embeddings_BLD=out["embeddings"],
            attention_mask_BL=batch["attention_mask"],
            anchors=a.taco_anchors,
            masked_BL=batch["masked"],
            window=a.taco_window,
            num_negatives=a.taco_num_negatives,
            temperature=a.taco_temperature,
            detach=a.taco_detach,
            generator=inputs.generator,
            anchor_flat_N=anchors,
            real_flat_T=batch["grid_index"],
            # Every rank must take the same path (their gathers must match): with documents cut out of
            # blocks, a rank whose blocks happened to hold no [SEP] still takes the equal-tokens one.
            uniform=batch["layout"] == "packed" and a.taco_anchors == "all" and not batch.get("blocks", False),
            equal_tokens=batch.get("blocks", False) and a.taco_anchors == "all",
        )


TACO_OBJECTIVE = register(TACO())
