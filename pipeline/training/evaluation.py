"""Held-out evaluation during training: every --eval_every steps (and at the last step) the student
reads the first --eval_samples samples of each held-out shard folder (`--eval_data`, by default each
--data folder's eval/, which `build_shards.py --eval_share` writes) and the run logs, with an `eval/`
prefix (over all the folders; with more than one, also each folder's own as `eval/NAME/...`, so that
the languages or sources of a mixed run are seen one by one):

- masked-LM loss and accuracy over the masked positions, the same positions every time (the collator's
  masking is a function of the run's seed and the sample, and the held-out samples are always read at
  epoch 0), so successive evaluations are comparable;
- NSP loss and accuracy where the run trains NSP, and the objective's own term (TaCL, TACO) on the same
  batches, with the same draws every time;
- every --eval_health_every-th evaluation, the representation health figures the analysis computes
  (pipeline.modeling.similarity), on the unmasked input's last layer: the intra-sentence similarity
  (TaCL's), and the intra- and inter-context similarity and their gap (TACO's).

Every rank evaluates its own share of the samples (the same number of micro-batches on every rank, as
the contrastive terms' collectives need), and the sums are reduced over ranks in one collective. The
student runs in eval mode (no dropout) without gradients; the training mode is restored afterwards.

Legend: B sequences, L positions, D hidden size.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any, Optional

import torch

from pipeline import distributed
from pipeline.data.loader import open_dataset
from pipeline.data.shards import DataInfo
from pipeline.objectives import LossInputs
from pipeline.training.step import StepProgram, mixed_seed, to_device

# The seed of the contrastive terms' draws in evaluation: fixed, so that every evaluation draws alike.
_EVAL_DRAWS = 0xE7A1


@dataclass
class HeldOutSet:
    """One held-out folder's samples of this rank, collated once."""

    name: str
    samples: int  # evaluated over all ranks
    micro: int
    batches: int  # micro-batches per rank
    collated: list[dict[str, Any]]


class Evaluator:
    """The held-out samples of this rank, collated once per folder, and the evaluation over them
    (`__call__`). `sets`: name -> the folder's shards (pipeline.training.preflight.held_out_data)."""

    def __init__(
        self,
        program: StepProgram,
        *,
        sets: dict[str, DataInfo],
        collator: Any,
        vocab_size: int,
        samples: int,
        run_id: str,
    ) -> None:
        self.program = program
        self.special_ids = torch.tensor(sorted(set(collator.spec.special_ids)), dtype=torch.int64)
        # One dataset over every folder (their samples one folder after the other), so that the run holds
        # one more streaming dataset whatever the number of folders.
        every = dataclasses.replace(next(iter(sets.values())), sources=[s for i in sets.values() for s in i.sources])
        dataset = open_dataset(
            every, vocab_size=vocab_size, batch_size=_micro(program), shuffle=False, seed=0, run_id=run_id
        )
        self.sets, offset = [], 0
        for name, info in sets.items():
            self.sets.append(self._load(name, dataset, offset=offset, available=info.samples, collator=collator,
                                        samples=samples))  # fmt: skip
            offset += info.samples
        self.samples = sum(s.samples for s in self.sets)
        self.done = 0  # evaluations made by this process

    def _load(self, name: str, dataset: Any, *, offset: int, available: int, collator: Any, samples: int) -> HeldOutSet:
        """The folder whose `available` samples start at `offset` of `dataset`: this rank's share of its
        first `samples`, collated."""
        n, micro, batches = self._plan(available, samples=samples, micro=_micro(self.program))
        # This rank's share: consecutive blocks of micro-batches, the same count on every rank.
        first = distributed.rank() * micro * batches
        # A sample is masked by its place in its own folder (the collator keys its draws by sample_id): a
        # folder's figures are the same whatever other folders are evaluated beside it.
        collated = [
            collator(
                [{**dataset[offset + i], "sample_id": i} for i in range(first + k * micro, first + (k + 1) * micro)]
            )
            for k in range(batches)
        ]
        return HeldOutSet(name=name, samples=n, micro=micro, batches=batches, collated=collated)

    @staticmethod
    def _plan(available: int, *, samples: int, micro: int) -> tuple[int, int, int]:
        """(samples evaluated, micro-batch, micro-batches per rank): at most `samples`, a whole number of
        micro-batches on every rank (a smaller micro-batch where the held-out set is small)."""
        world = distributed.world_size()
        wanted = min(samples, available)
        assert wanted >= world, (available, world)  # pre-flight refuses fewer held-out samples than ranks
        micro = min(micro, wanted // world)
        batches = wanted // (world * micro)
        return batches * world * micro, micro, batches

    def __call__(self, *, health: bool) -> dict[str, Optional[float]]:
        """One evaluation (a collective: every rank calls it at the same step). `health`: also the
        representation health figures. Returns the `eval/` fields of the metrics line."""
        p, t0 = self.program, time.perf_counter()
        module = p.engine.module
        was_training = module.training
        module.eval()
        try:
            with torch.no_grad():
                sums_KS = torch.stack([self._sums(held, health=health) for held in self.sets])
        finally:
            module.train(was_training)
        totals_KS = distributed.sum_over_ranks(sums_KS).tolist()  # one collective for every folder
        self.done += 1
        fields = self._fields([sum(col) for col in zip(*totals_KS)], batches=sum(h.batches for h in self.sets),
                              samples=self.samples, health=health, prefix="eval/")  # fmt: skip
        if len(self.sets) > 1:
            for held, totals in zip(self.sets, totals_KS):
                fields.update(self._fields(totals, batches=held.batches, samples=held.samples, health=health,
                                           prefix=f"eval/{held.name}/"))  # fmt: skip
        fields["eval/time_s"] = time.perf_counter() - t0
        return fields

    # -- the sums (legend: K folders, S sums) ---------------------------------------------------------

    _SUMS = ("masked", "mlm_loss", "mlm_acc", "samples", "nsp_loss", "nsp_acc", "batches", "term_loss", "term_acc",
             "health_batches", "intra_sentence", "intra_context", "inter_context")  # fmt: skip

    def _sums(self, held: HeldOutSet, *, health: bool) -> torch.Tensor:
        """The sums (_SUMS) over one folder's micro-batches of this rank."""
        p = self.program
        sums = torch.zeros(len(self._SUMS), dtype=torch.float64, device=p.device)
        for k, batch in enumerate(held.collated):
            dev = to_device(batch, p.device)
            out = p.engine(dev, with_embeddings=p.objective.needs_embeddings, with_nsp=p.nsp)
            # The k-th micro-batch of a folder draws alike in every evaluation, whatever other folders there are.
            gen = torch.Generator().manual_seed(mixed_seed(_EVAL_DRAWS, k))
            res = p.objective.losses(
                out, dev, nsp=p.nsp, inputs=LossInputs(args=p.args, teacher=p.teacher, generator=gen)
            )
            v, masked, n = res.values, float(batch["num_masked"]), float(batch["num_samples"])
            term = p.objective.term
            row = [masked, v["mlm_loss"] * masked, v["mlm_acc"] * masked, n]
            row += [v["nsp_loss"] * n, v["nsp_acc"] * n] if p.nsp else [0.0, 0.0]
            row += [1.0, *([v[f"{term}_loss"], v[f"{term}_acc"]] if term else [0.0, 0.0])]
            row += self._health(dev) if health else [0.0] * 4
            sums += torch.stack([torch.as_tensor(x, dtype=torch.float64, device=p.device) for x in row])
        return sums

    def _health(self, batch: dict[str, Any]) -> list[Any]:
        """[1, intra-sentence, intra-context, inter-context] of one batch: the student's last layer on the
        unmasked input, special tokens and padding left out."""
        from pipeline.data.collator import grid_inputs
        from pipeline.modeling.similarity import context_similarity, intra_sentence_similarity, sentence_ids
        from pipeline.modeling.student import run_encoder

        grid = grid_inputs(batch)
        hidden_BLD = run_encoder(self.program.engine.module.encoder, batch, ids="original_ids")[0]
        special_BL = torch.isin(grid["input_ids"], self.special_ids.to(hidden_BLD.device)) | (
            grid["attention_mask"] == 0
        )
        sentence_BL = sentence_ids(grid["input_ids"], token_type_ids_BL=grid["token_type_ids"], special_BL=special_BL)
        intra_sentence = intra_sentence_similarity(hidden_BLD.float(), sentence_BL=sentence_BL).mean()
        context = context_similarity(hidden_BLD.float(), token_mask_BL=~special_BL)
        return [1.0, intra_sentence, context["intra"], context["inter"]]

    def _fields(
        self, totals: list[float], *, batches: int, samples: int, health: bool, prefix: str
    ) -> dict[str, Optional[float]]:
        """The fields of summed figures (_SUMS, over every rank) of `batches` micro-batches per rank."""
        s = dict(zip(self._SUMS, totals))
        term = self.program.objective.term
        fields: dict[str, Optional[float]] = {
            f"{prefix}mlm_loss": s["mlm_loss"] / max(s["masked"], 1.0),
            f"{prefix}mlm_acc": s["mlm_acc"] / max(s["masked"], 1.0),
        }
        if self.program.nsp:
            fields.update({f"{prefix}nsp_loss": s["nsp_loss"] / s["samples"],
                           f"{prefix}nsp_acc": s["nsp_acc"] / s["samples"]})  # fmt: skip
        if term:
            # Each batch's term is already its mean over every rank's anchors: average the batches.
            fields.update({f"{prefix}{term}_loss": s["term_loss"] / s["batches"],
                           f"{prefix}{term}_acc": s["term_acc"] / s["batches"]})  # fmt: skip
            assert s["batches"] == batches * distributed.world_size(), (s["batches"], batches)
        if health:
            n = max(s["health_batches"], 1.0)
            intra_sentence, intra, inter = s["intra_sentence"] / n, s["intra_context"] / n, s["inter_context"] / n
            fields.update({f"{prefix}intra_sentence": intra_sentence, f"{prefix}intra_context": intra,
                           f"{prefix}inter_context": inter, f"{prefix}context_gap": intra - inter})  # fmt: skip
        fields[f"{prefix}samples"] = samples
        fields[f"{prefix}masked"] = int(s["masked"])  # the positions behind mlm_loss and mlm_acc
        return fields


def _micro(program: StepProgram) -> int:
    return int(program.engine.train_micro_batch_size_per_gpu())
