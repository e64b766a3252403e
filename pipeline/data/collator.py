"""The masking collator: a list of samples in, one masked batch out, with every index and count the step
needs already computed here, on the CPU of a loader worker.

The model and the losses then never boolean-mask a device tensor nor read a count back from it: they
`index_select` with these indices, on sizes the host knows. Three layouts:
- "packed": every sample has the same length (packed shards): [B, L] tensors with no padding, run
  without an attention mask;
- "unpadded": samples of different lengths (NSP pairs), concatenated into one [T] token stream split by
  `cu_seqlens` (the default for NSP shards);
- "padded": the same samples right-padded to [B, L_max] (`padding="keep"`, the reference path).

Out (torch tensors; the model's token rows are [B, L] flattened, or the T stream):
  input_ids, original_ids, token_type_ids: the model's rows (masked ids / the unmasked ones / segments)
  position_ids, cu_seqlens [B + 1] int32: the unpadded layout only
  attention_mask_BL, masked_BL: the padded grid view (1 / True at real tokens / at masked ones)
  grid_index_T: each real token's flat position in the [B, L_max] grid
  masked_index_N: the masked tokens among the model's rows; masked_grid_index_N: the same in the grid;
  unmasked_grid_index: the real tokens that are not masked, in the grid
  mlm_labels_N: their original ids; sample_ids_B; nsp_labels_B (NSP)
  and host values: layout, num_sequences (what attention sees as sequences), num_samples (the samples
  read), num_tokens, num_masked, max_len, sum_len_sq.

Legend: B sequences, L the longest sequence of the batch, T real tokens, N masked positions.
"""

from __future__ import annotations

from collections.abc import Sequence
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
    ) -> None:
        assert padding in ("remove", "keep"), padding
        self.spec = spec
        self.pad_id = pad_id
        self.seed = seed
        self.nsp = nsp
        self.max_seq_len = max_seq_len
        self.padding = padding
        self.pool = spec.replacement_pool()

    def __call__(self, samples: Sequence[dict[str, Any]]) -> dict[str, Any]:
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
        chosen_BL = labels_BL >= 0
        layout = "packed" if bool((lengths_B == L).all()) else ("unpadded" if self.padding == "remove" else "padded")
        grid_index_T = np.flatnonzero(real_BL.ravel())
        masked_grid_N = np.flatnonzero(chosen_BL.ravel())
        batch: dict[str, Any] = {
            "layout": layout,
            "attention_mask": torch.from_numpy(real_BL.astype(np.int64)),
            "masked": torch.from_numpy(chosen_BL),
            "grid_index": torch.from_numpy(grid_index_T),
            "masked_grid_index": torch.from_numpy(masked_grid_N),
            "unmasked_grid_index": torch.from_numpy(np.flatnonzero((real_BL & ~chosen_BL).ravel())),
            "mlm_labels": torch.from_numpy(ids_BL.ravel()[masked_grid_N]),
            "sample_ids": torch.from_numpy(keys.sample_id_B.copy()),
            "num_sequences": B,
            "num_samples": B,
            "num_tokens": int(lengths_B.sum()),
            "num_masked": len(masked_grid_N),
            "max_len": L,
            "sum_len_sq": int((lengths_B**2).sum()),
        }
        if layout == "unpadded":
            # The model's rows are the T real tokens; a masked token's row is its rank among them.
            row_of_grid = np.cumsum(real_BL.ravel()) - 1
            batch.update(
                {
                    "input_ids": torch.from_numpy(masked_ids_BL.ravel()[grid_index_T]),
                    "original_ids": torch.from_numpy(ids_BL.ravel()[grid_index_T]),
                    "token_type_ids": torch.from_numpy(types_BL.ravel()[grid_index_T].astype(np.int64)),
                    "position_ids": torch.from_numpy(
                        np.broadcast_to(np.arange(L), (B, L)).ravel()[grid_index_T].copy()
                    ),
                    "cu_seqlens": torch.from_numpy(np.concatenate([[0], np.cumsum(lengths_B)]).astype(np.int32)),
                    "masked_index": torch.from_numpy(row_of_grid[masked_grid_N]),
                }
            )
        else:
            batch.update(
                {
                    "input_ids": torch.from_numpy(masked_ids_BL),
                    "original_ids": torch.from_numpy(ids_BL),
                    "token_type_ids": torch.from_numpy(types_BL.astype(np.int64)),
                    "masked_index": batch["masked_grid_index"],
                }
            )
        if self.nsp:
            batch["nsp_labels"] = torch.tensor([int(s["nsp_label"]) for s in samples], dtype=torch.int64)
        return batch


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
