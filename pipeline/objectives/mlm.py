"""MLM (+ NSP on nsp shards): BERT's objective, the baseline every other objective adds a term to."""

from __future__ import annotations

from pipeline.objectives.base import Defaults, Objective, register


class MLM(Objective):
    name = "mlm"
    help = "masked-language modelling (+ NSP on nsp shards, --nsp auto)"
    # BERT: lr 1e-4, 10k warm-up steps, linear decay (docs/objectives.md).
    defaults = Defaults(lr=1e-4, nsp="auto", warmup_steps=10_000)


MLM_OBJECTIVE = register(MLM())
