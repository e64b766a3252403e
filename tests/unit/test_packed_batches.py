"""A worker's batch crosses to the rank as one buffer (pipeline.data.loader.PackingCollate): unpacked,
it is the collator's dict, tensor for tensor (dtype, shape, values), aliases kept, host values kept."""

from __future__ import annotations

import pickle

import torch

from pipeline.data.loader import PackingCollate, unpack_batch


def test_a_packed_batch_unpacks_to_the_collators_dict():
    shared = torch.tensor([3, 1, 4], dtype=torch.int64)
    batch = {
        "layout": "unpadded",
        "num_sequences": 2,
        "input_ids": torch.arange(6, dtype=torch.int64).reshape(2, 3),
        "masked": torch.tensor([[True, False, True], [False, False, True]]),
        "cu_seqlens": torch.tensor([0, 1, 3], dtype=torch.int32),  # 12 bytes: the next one must realign
        "masked_grid_index": shared,
        "masked_index": shared,
        "nsp_labels": torch.tensor([1, 0]),
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, dtype=torch.int64),
    }
    packed = PackingCollate(lambda samples: batch)([{}])
    assert [k for k, v in packed.items() if isinstance(v, torch.Tensor)] == ["_packed_tensors"]
    out = unpack_batch(pickle.loads(pickle.dumps(packed)))  # as it crosses the worker queue
    assert list(out) == [k for k in batch if not isinstance(batch[k], torch.Tensor)] + [
        k for k in batch if isinstance(batch[k], torch.Tensor)
    ]
    for key, value in batch.items():
        if isinstance(value, torch.Tensor):
            assert out[key].dtype == value.dtype and out[key].shape == value.shape and torch.equal(out[key], value), key
        else:
            assert out[key] == value
    assert out["masked_index"] is out["masked_grid_index"]
    assert unpack_batch(batch) is batch  # an in-process batch passes through
