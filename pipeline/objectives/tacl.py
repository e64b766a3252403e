"""TaCL (Su et al., NAACL 2022): MLM + NSP + a token-level contrastive term against a frozen teacher,
the student's own initial encoder, run on the unmasked input (pipeline.losses.tacl has the formula).

Legend: B sequences, L positions, D hidden size.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pipeline.objectives.base import Defaults, Objective, register
from preprocessing import cli
from preprocessing.errors import UsageError


@dataclass
class TaclKnobs:
    tacl_temperature: float = cli.knob(0.01, "TaCL's tau")
    tacl_negatives: str = cli.knob(
        "sequence", "sequence (paper) | global (adds a cross-rank pool)", choices=("sequence", "global")
    )
    tacl_num_pool: int = cli.knob(0, "TaCL's cross-rank pool rows (with --tacl_negatives global)")


class TaCL(Objective):
    name = "tacl"
    help = "MLM + NSP + TaCL against a frozen copy of the initial encoder (continual pre-training)"
    # The paper: lr 1e-4, 10% warm-up, linear decay, with NSP.
    defaults = Defaults(lr=1e-4, nsp="on", warmup_ratio=0.10)
    formats = ("nsp",)
    term = "tacl"
    needs_teacher = True
    knobs = TaclKnobs

    def check_knobs(self, args: Any) -> None:
        if args.tacl_negatives == "global" and args.tacl_num_pool < 1:
            raise UsageError("--tacl_negatives global needs --tacl_num_pool >= 1")
        if args.tacl_negatives == "sequence" and args.tacl_num_pool:
            raise UsageError(f"--tacl_num_pool {args.tacl_num_pool} only applies to --tacl_negatives global")

    def check_data(self, *, fmt: str, nsp: str, paths: Sequence[str]) -> bool:
        if fmt != "nsp" and nsp == "off":  # TaCL's term needs no pairs: packed shards without NSP
            return False
        if fmt != "nsp":
            raise UsageError(
                f"--objective tacl trains on NSP pairs, but --data {', '.join(paths)} holds {fmt} shards: build "
                f"them with --format nsp, or pass --nsp off to run TaCL without NSP"
            )
        return super().check_data(fmt=fmt, nsp=nsp, paths=paths)

    def extra_term(self, out, batch, *, inputs):
        import torch

        from pipeline.losses import tacl_loss
        from pipeline.modeling.student import run_encoder

        a = inputs.args
        with torch.no_grad():
            teacher_BLD = run_encoder(inputs.teacher, batch, ids="original_ids")[0]
        return tacl_loss(
            out["hidden"],
            teacher_BLD=teacher_BLD,
            masked_BL=batch["masked"],
            attention_mask_BL=batch["attention_mask"],
            temperature=a.tacl_temperature,
            negatives=a.tacl_negatives,
            num_pool=a.tacl_num_pool,
            generator=inputs.generator,
            anchor_flat_N=batch["masked_grid_index"],
            real_flat_T=batch["grid_index"],
        )


TACL_OBJECTIVE = register(TaCL())
