"""What an objective is, in one place: its knobs and the papers' defaults, the shard formats it trains
on, what it needs from the model (TaCL's teacher, the embedding output), the metric keys it logs, its
loss terms, and its share of the FLOPs model.

Config, pre-flight, the data checks, the trainer and the benchmarks ask an `Objective` (found by name
with `get`), never compare names. Every objective trains MLM (+ NSP where the data has pairs and NSP is
on); an objective adds at most one term of its own (`term`, weighted by `weight(args)`).

Adding one: a module in this package that subclasses `Objective`, implements `extra_term` and calls
`register` (the built-in ones are pipeline.objectives.mlm, .tacl and .taco; the package imports every
module, and config merges each one's `knobs` into its ObjectiveArgs). tests/unit/test_train_step.py
registers a toy one from the test itself and trains it.

Legend: B sequences, L positions, D hidden size, N masked positions.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Optional

from preprocessing.errors import UsageError

if TYPE_CHECKING:
    import torch

    from pipeline.modeling.encoder import Encoder

FORMATS = ("nsp", "packed")  # the shard builder's formats (preprocessing/shard_format.py)


@dataclass(frozen=True)
class Defaults:
    """An objective's paper defaults for what the user leaves unset. The warm-up is either a share of
    --max_steps (`warmup_ratio`) or a number of steps (`warmup_steps`, capped at 10% of a shorter run).
    `nsp`: "on", "off" or "auto" (on where the shards hold NSP pairs)."""

    lr: float
    nsp: str
    warmup_ratio: Optional[float] = None
    warmup_steps: Optional[int] = None


@dataclass(frozen=True)
class LossInputs:
    """What a loss term may use besides the student's outputs and the batch: the objective's knobs
    (`args`, the config's ObjectiveArgs), TaCL's frozen teacher, and the generator of the losses' draws
    (seeded identically on every rank)."""

    args: Any
    teacher: Optional[Encoder]
    generator: torch.Generator


@dataclass
class StepLosses:
    """One micro-batch's loss to back-propagate (`total`: this rank's share of each global mean) and
    each logged term and accuracy (`values`: detached fp32 scalars, keys = Objective.metric_keys)."""

    total: torch.Tensor
    values: dict[str, torch.Tensor]


class Objective:
    """One pre-training objective (see the module docstring). Subclasses set the class attributes and
    implement `extra_term`; instances are stateless and shared."""

    name: ClassVar[str]
    help: ClassVar[str]  # one line, for --help and the docs
    defaults: ClassVar[Defaults]
    formats: ClassVar[tuple[str, ...]] = FORMATS  # shard formats it trains on
    trains_on: ClassVar[str] = ""  # what those shards hold, for the error message ("packed blocks")
    term: ClassVar[Optional[str]] = None  # its own loss term's metric prefix ("tacl" -> tacl_loss, tacl_acc)
    needs_teacher: ClassVar[bool] = False  # TaCL's frozen copy of the initial encoder (+ its forward in FLOPs)
    needs_embeddings: ClassVar[bool] = False  # the embedding layer's output (HF hidden_states[0])
    knobs: ClassVar[Optional[type]] = None  # a dataclass of cli.knob fields, merged into ObjectiveArgs

    # -- configuration and data ---------------------------------------------------------------------

    def check_knobs(self, args: Any) -> None:
        """Refuse values of its own knobs that are wrong whatever the objective (UsageError naming the
        flag). `args`: the config's ObjectiveArgs."""

    def check_selected(self, args: Any) -> None:
        """Refuse other settings that cannot go with this objective when it is the one trained."""

    def check_data(self, *, fmt: str, nsp: str, paths: Sequence[str]) -> bool:
        """Whether NSP runs on shards of format `fmt` with --nsp `nsp`; UsageError when this objective
        cannot train on them."""
        where = ", ".join(paths)
        if fmt not in self.formats:
            raise UsageError(
                f"--objective {self.name} trains on {self.trains_on or ' or '.join(self.formats) + ' shards'}, but "
                f"--data {where} holds "
                f"{fmt} shards: build them with --format {self.formats[0]}"
            )
        if nsp == "on" and fmt != "nsp":
            raise UsageError(f"--nsp on needs nsp shards, but --data {where} holds {fmt} shards")
        return fmt == "nsp" and nsp != "off"

    # -- what it logs and computes ------------------------------------------------------------------

    def metric_keys(self, *, nsp: bool) -> list[str]:
        """The loss terms and accuracies it logs, in order."""
        own = [f"{self.term}_loss", f"{self.term}_acc"] if self.term else []
        return ["loss", "mlm_loss", "mlm_acc"] + (["nsp_loss", "nsp_acc"] if nsp else []) + own

    def weight(self, args: Any) -> float:
        """The weight of its own term in the total loss."""
        return 1.0

    def extra_term(
        self, out: dict[str, torch.Tensor], batch: dict[str, Any], *, inputs: LossInputs
    ) -> Optional[tuple[torch.Tensor, dict[str, torch.Tensor]]]:
        """Its own term for one micro-batch: (loss to back-propagate, {"loss", "acc", ...} metrics), or
        None for an objective without one. `out`: the student's outputs (hidden [B, L, D], mlm_logits
        [N, V], embeddings and nsp_logits when asked for); `batch`: the collator's batch on the device."""
        return None

    def losses(
        self, out: dict[str, torch.Tensor], batch: dict[str, Any], *, nsp: bool, inputs: LossInputs
    ) -> StepLosses:
        """Every term of one micro-batch: MLM, NSP when `nsp`, and its own term, weighted."""
        from pipeline import losses

        total, mlm_m = losses.mlm_loss(out["mlm_logits"], batch["mlm_labels"], compact=True)
        values = {"mlm_loss": mlm_m["loss"], "mlm_acc": mlm_m["acc"]}
        logged = values["mlm_loss"]
        if nsp:
            nsp_loss, nsp_m = losses.nsp_loss(out["nsp_logits"], batch["nsp_labels"])
            total = total + nsp_loss
            values.update(nsp_loss=nsp_m["loss"], nsp_acc=nsp_m["acc"])
            logged = logged + values["nsp_loss"]
        own = self.extra_term(out, batch, inputs=inputs)
        if own is not None:
            weight = self.weight(inputs.args)
            loss, m = own
            total = total + weight * loss
            values.update({f"{self.term}_loss": m["loss"], f"{self.term}_acc": m["acc"]})
            logged = logged + weight * m["loss"]
        # The logged total is the weighted sum of the logged terms. `total` itself is this rank's share
        # of each global mean (what back-propagates), not a value of its own: on a step where another
        # rank skips a micro-batch, averaging the shares would not give the sum of the terms.
        values["loss"] = logged.float()
        return StepLosses(total=total, values={k: values[k] for k in self.metric_keys(nsp=nsp)})


_REGISTRY: dict[str, Objective] = {}


def register(objective: Objective) -> Objective:
    """Make `objective` available by name (to --objective, pre-flight, the trainer and the benchmarks).
    Registering a name again replaces it (a test's toy objective)."""
    assert objective.name and objective.name == objective.name.strip(), objective.name
    _REGISTRY[objective.name] = objective
    return objective


def get(name: str) -> Objective:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise UsageError(f"--objective {name!r}: unknown; expected one of {', '.join(names())}") from None


def names() -> tuple[str, ...]:
    return tuple(_REGISTRY)
