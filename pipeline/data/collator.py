"""The masking collator: a list of samples in, one masked batch out, with every index and count the step
needs already computed here, on the CPU of a loader worker.

The model and the losses then never boolean-mask a device tensor nor read a count back from it: they
`index_select` with these indices, on sizes the host knows. Three layouts:
- "packed": every sequence has the same length (packed shards attended as whole blocks): [B, L]
  tensors with no padding, run without an attention mask;
- "unpadded": sequences of different lengths (NSP pairs; packed blocks cut into their documents),
  concatenated into one [T] token stream split by `cu_seqlens` (the default);
- "padded": the same sequences right-padded to [B, L_max] (`padding="keep"`, the reference path).

Document-aware packing (`document_sep_id`, the trainer's default for packed shards): each packed block
is cut after every [SEP] (`cut_documents`), so that attention, positions and the losses' notion of a
sequence stay inside each document. Masking is drawn on the samples before the cut, so it is the same
with or without it; `num_samples` counts the samples, `num_sequences` the documents.

Out (torch tensors; the model's token rows are [B, L] flattened, or the T stream):
  input_ids, original_ids, token_type_ids: the model's rows (masked ids / the unmasked ones / segments)
  position_ids, cu_seqlens [B + 1] int32: the unpadded layout only
  attention_mask_BL, masked_BL: the padded grid view (1 / True at real tokens / at masked ones)
  grid_index_T: each real token's flat position in the [B, L_max] grid
  masked_index_N: the masked tokens among the model's rows; masked_grid_index_N: the same in the grid;
  unmasked_grid_index: the real tokens that are not masked, in the grid
  mlm_labels_N: their original ids; sample_ids_B; nsp_labels_B (NSP)
  and host values: layout, num_sequences (what attention sees as sequences), num_samples (the samples
  read), num_tokens, num_masked, max_len, sum_len_sq, blocks (full packed blocks cut into documents:
  every rank's micro-batch holds the same number of tokens, which TACO's draws use).

Legend: B sequences, L the longest sequence of the batch, T real tokens, N masked positions, S documents.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch

from pipeline.data.masking import MaskingSpec, SampleKeys, mask_batch
from pipeline.data.padding import pad_right
from pipeline.data.shards import ShardError

LAYOUTS = ("packed", "unpadded", "padded")


class MaskingCollator:
    """Pads (or unpads), masks and indexes a list of samples (see the module docstring).

    `padding`: "remove" (batches of unequal lengths become the unpadded layout) or "keep" (padded).
    `document_sep_id`: cut batches of full blocks into their documents after this id ([SEP]).
    """

    def __init__(
        self,
        *,
        spec: MaskingSpec,
        pad_id: int,
        seed: int,
        nsp: bool,
        max_seq_len: Optional[int],
        padding: str = "remove",
        document_sep_id: Optional[int] = None,
    ) -> None:
        assert padding in ("remove", "keep"), padding
        self.document_sep_id = document_sep_id
        self.spec = spec
        self.pad_id = pad_id
        self.seed = seed
        self.nsp = nsp
        self.max_seq_len = max_seq_len
        self.padding = padding
        self.pool = spec.replacement_pool()

    def __call__(self, samples: Sequence[dict[str, Any]]) -> dict[str, Any]:
        rows = self._masked_rows(samples)
        full = bool((rows.lengths_B == rows.lengths_B.max()).all())
        if self.document_sep_id is not None and full:
            rows = cut_documents(rows, sep_id=self.document_sep_id)
        batch = self._layout(rows)
        # Blocks of one length (packed shards): every rank's micro-batch holds as many tokens as this one.
        batch["blocks"] = full and self.document_sep_id is not None
        batch["sample_ids"] = torch.from_numpy(
            np.fromiter((int(s["sample_id"]) for s in samples), np.int64, len(samples))
        )
        batch["num_samples"] = len(samples)
        if self.nsp:
            batch["nsp_labels"] = torch.tensor([int(s["nsp_label"]) for s in samples], dtype=torch.int64)
        return batch

    def _masked_rows(self, samples: Sequence[dict[str, Any]]) -> Rows:
        lengths_B = np.fromiter((len(s["input_ids"]) for s in samples), np.int64, len(samples))
        B, L = len(samples), int(lengths_B.max())
        if self.max_seq_len is not None and L > self.max_seq_len:
            sid = samples[int(lengths_B.argmax())]["sample_id"]
            raise ShardError(f"sample {sid} has {L} tokens, more than max_seq_len {self.max_seq_len}")
        ids_BL = pad_right([s["input_ids"] for s in samples], fill=self.pad_id, length=L)
        types_BL = pad_right([s["token_type_ids"] for s in samples], fill=0, length=L)
        real_BL = np.arange(L)[None, :] < lengths_B[:, None]
        starts_BL = pad_right([s["word_starts"] for s in samples], fill=1, length=L) if self.spec.whole_word else None
        keys = SampleKeys(
            seed=self.seed,
            epoch_B=np.fromiter((int(s.get("epoch", 0)) for s in samples), np.int64, B),
            sample_id_B=np.fromiter((int(s["sample_id"]) for s in samples), np.int64, B),
        )
        masked_ids_BL, labels_BL = mask_batch(
            ids_BL, real_BL=real_BL, word_starts_BL=starts_BL, spec=self.spec, replacement_pool=self.pool, keys=keys
        )
        return Rows(
            ids_BL=ids_BL,
            masked_ids_BL=masked_ids_BL,
            types_BL=types_BL,
            chosen_BL=labels_BL >= 0,
            real_BL=real_BL,
            lengths_B=lengths_B,
        )

    def _layout(self, r: Rows) -> dict[str, Any]:
        """The batch of the model's layout for these rows (module docstring), without the per-sample
        fields."""
        B, L = r.ids_BL.shape
        equal = bool((r.lengths_B == L).all())
        layout = "packed" if equal else ("unpadded" if self.padding == "remove" else "padded")
        grid_index_T = np.flatnonzero(r.real_BL.ravel())
        masked_grid_N = np.flatnonzero(r.chosen_BL.ravel())
        batch: dict[str, Any] = {
            "layout": layout,
            "attention_mask": torch.from_numpy(r.real_BL.astype(np.int64)),
            "masked": torch.from_numpy(r.chosen_BL),
            "grid_index": torch.from_numpy(grid_index_T),
            "masked_grid_index": torch.from_numpy(masked_grid_N),
            "unmasked_grid_index": torch.from_numpy(np.flatnonzero((r.real_BL & ~r.chosen_BL).ravel())),
            "mlm_labels": torch.from_numpy(r.ids_BL.ravel()[masked_grid_N]),
            "num_sequences": B,
            "num_tokens": int(r.lengths_B.sum()),
            "num_masked": len(masked_grid_N),
            "max_len": L,
            "sum_len_sq": int((r.lengths_B**2).sum()),
        }
        if layout != "unpadded":
            batch.update(
                input_ids=torch.from_numpy(r.masked_ids_BL),
                original_ids=torch.from_numpy(r.ids_BL),
                token_type_ids=torch.from_numpy(r.types_BL.astype(np.int64)),
                masked_index=batch["masked_grid_index"],
            )
            return batch
        # The model's rows are the T real tokens; a masked token's row is its rank among them.
        row_of_grid = np.cumsum(r.real_BL.ravel()) - 1
        batch.update(
            input_ids=torch.from_numpy(r.masked_ids_BL.ravel()[grid_index_T]),
            original_ids=torch.from_numpy(r.ids_BL.ravel()[grid_index_T]),
            token_type_ids=torch.from_numpy(r.types_BL.ravel()[grid_index_T].astype(np.int64)),
            position_ids=torch.from_numpy(np.broadcast_to(np.arange(L), (B, L)).ravel()[grid_index_T].copy()),
            cu_seqlens=torch.from_numpy(np.concatenate([[0], np.cumsum(r.lengths_B)]).astype(np.int32)),
            masked_index=torch.from_numpy(row_of_grid[masked_grid_N]),
        )
        return batch


@dataclass(frozen=True)
class Rows:
    """A batch's sequences after masking, right-padded to [B, L] (numpy): the ids, the masked ids the
    model sees, segment ids, which positions were chosen for MLM, which are real, and the lengths."""

    ids_BL: np.ndarray
    masked_ids_BL: np.ndarray
    types_BL: np.ndarray
    chosen_BL: np.ndarray
    real_BL: np.ndarray
    lengths_B: np.ndarray


def cut_documents(rows: Rows, *, sep_id: int) -> Rows:
    """Packed blocks (every row full) cut into their documents: a new sequence starts after every
    [SEP] that is not a row's last token. Out: the documents as rows of their own, in order, right-padded
    to the longest; their positions restart at 0. The token stream itself is unchanged (the documents
    of a row are contiguous), so the masking and the masked tokens' order stay what they were."""
    B, L = rows.ids_BL.shape
    start_BL = np.zeros((B, L), dtype=bool)
    start_BL[:, 0] = True
    start_BL[:, 1:] = rows.ids_BL[:, :-1] == sep_id
    if not start_BL[:, 1:].any():
        return rows
    start_T = start_BL.ravel()
    first_S = np.flatnonzero(start_T)
    lengths_S = np.diff(np.append(first_S, B * L))
    segment_T = np.cumsum(start_T) - 1
    position_T = np.arange(B * L) - first_S[segment_T]
    S, width = len(first_S), int(lengths_S.max())

    def regrid(x_BL: np.ndarray, fill: Any) -> np.ndarray:
        out = np.full((S, width), fill, dtype=x_BL.dtype)
        out[segment_T, position_T] = x_BL.ravel()
        return out

    return Rows(
        ids_BL=regrid(rows.ids_BL, 0),
        masked_ids_BL=regrid(rows.masked_ids_BL, 0),
        types_BL=regrid(rows.types_BL, 0),
        chosen_BL=regrid(rows.chosen_BL, False),
        real_BL=np.arange(width)[None, :] < lengths_S[:, None],
        lengths_B=lengths_S,
    )


def grid_inputs(batch: dict[str, Any], *, pad_id: int = 0) -> dict[str, torch.Tensor]:
    """The batch's unmasked inputs as an HF model takes them, whatever the layout: [B, L] input_ids,
    token_type_ids, attention_mask (padding at `pad_id`), on the batch's device."""
    mask_BL = batch["attention_mask"]
    if batch["layout"] != "unpadded":
        return {
            "input_ids": batch["original_ids"],
            "token_type_ids": batch["token_type_ids"],
            "attention_mask": mask_BL,
        }
    B, L = mask_BL.shape
    index = batch["grid_index"]
    ids = torch.full((B * L,), pad_id, dtype=torch.int64, device=mask_BL.device).index_copy(
        0, index, batch["original_ids"]
    )
    types = torch.zeros(B * L, dtype=torch.int64, device=mask_BL.device).index_copy(0, index, batch["token_type_ids"])
    return {"input_ids": ids.view(B, L), "token_type_ids": types.view(B, L), "attention_mask": mask_BL}
