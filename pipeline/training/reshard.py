"""Resuming a ZeRO-1/2 checkpoint written by N ranks on M ranks: the optimizer state is resharded.

DeepSpeed refuses to load ZeRO optimizer state saved at another data-parallel world size. Each rank's
file holds its slice of every parameter group flattened into one vector (the parameters one after
another, in the group's order, then zeros up to a multiple of 2 x world size): the fp32 master
weights (`single_partition_of_fp32_groups`, stored without that tail padding) and each tensor of the
base optimizer's state (AdamW's exp_avg and exp_avg_sq, stored with it; its `step` is a scalar). The
layout of the flat vector without the tail padding does not depend on the world size, so resharding
is: concatenate the N slices, cut off each one's padding, split the vector into M slices exactly as
DeepSpeed partitions it at M ranks (equal slices of the vector zero-padded to a multiple of 2 x M),
and write the files DeepSpeed itself would have written at M ranks, with the model-states file's
`dp_world_size` set to M. DeepSpeed then loads them through its ordinary path, with all its checks.

The files go to CHECKPOINT/resharded_world_M/, a folder inside the source checkpoint: nothing takes
it for a checkpoint of the run (those are RUN/checkpoints/step_* with their complete.json), it goes
when its checkpoint is pruned, and it is removed once the engine has loaded it. Every rank writes
its own optimizer file (reading only the byte ranges it needs: the source files are memory-mapped),
rank 0 the model states; a copy left by a job that died is replaced. Everything is read weights-only
(pipeline.training.checkpoint.weights_only_loads).

Why not DeepSpeed's universal checkpoint (deepspeed/checkpoint/ds_to_universal.py and
"load_universal"): the converter unpickles every file with weights_only=False, writes a folder per
parameter, and the load then takes another code path than every other resume, switched on by a
setting in the DeepSpeed JSON (which a resume compares).

Not handled (refused, naming the reason): ZeRO-3 and no-ZeRO checkpoints, model parallelism,
`round_robin_gradients` (its parameter order depends on the world size), elastic-format files.
"""

from __future__ import annotations

import json
import shutil
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from pipeline import distributed
from pipeline.training import log
from preprocessing.errors import UsageError

MODEL_STATES = "mp_rank_00_model_states.pt"
RESHARDED_PREFIX = "resharded_world_"
PROVENANCE = "resharded.json"
# DeepSpeed's names for the parts of a ZeRO-1/2 optimizer file (deepspeed.checkpoint.constants).
_FP32 = "single_partition_of_fp32_groups"
_BASE = "base_optimizer_state"
_GROUP_PADDINGS = "group_paddings"
_PARAM_PADDINGS = "param_alignment_paddings"
_PARTITION_COUNT = "partition_count"
_SLICE_MAPPINGS = "param_slice_mappings"
# DeepSpeedZeroOptimizer aligns a group's flat vector to nccl_start_alignment_factor x world size.
ALIGNMENT_FACTOR = 2


def optimizer_file(folder: Path, *, rank: int, prefix: str) -> Path:
    """The ZeRO optimizer file of data-parallel rank `rank` (`prefix`: "bf16_" or "")."""
    return folder / f"{prefix}zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"


def _load(path: Path) -> Any:
    from pipeline.training.checkpoint import weights_only_loads

    with weights_only_loads():  # tensors memory-mapped: only the ranges used are read
        return torch.load(path, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(path))


def saved_world(path: Path) -> Optional[int]:
    """The data-parallel world size checkpoint folder `path` was written by (its model states' record),
    or None when it has no model-states file."""
    file = path / MODEL_STATES
    if not file.is_file():
        return None
    return int(_load(file)["dp_world_size"])


def partition_size(total: int, *, world: int) -> int:
    """Elements per rank of a group whose flat vector (without the tail padding) has `total`
    elements, at `world` ranks: DeepSpeed pads it to a multiple of ALIGNMENT_FACTOR x world."""
    alignment = ALIGNMENT_FACTOR * world
    return -(-total // alignment) * alignment // world


def flat_range(parts: list[torch.Tensor], *, start: int, stop: int) -> torch.Tensor:
    """Elements [start, stop) of the concatenation of the 1-D `parts`, as a new tensor (never a view:
    torch.save of a view would write the whole memory-mapped storage behind it)."""
    pieces, offset = [], 0
    for t in parts:
        lo, hi = max(start, offset), min(stop, offset + t.numel())
        if lo < hi:
            pieces.append(t[lo - offset : hi - offset])
        offset += t.numel()
    if not pieces:
        return parts[0].new_zeros(0)
    return torch.cat(pieces)


def new_partition(
    parts: list[torch.Tensor], *, rank: int, world: int, size: int, padded: bool
) -> tuple[torch.Tensor, int]:
    """(rank `rank`'s slice at `world` ranks of the vector the unpadded `parts` make, its tail
    padding). `size`: the elements per rank (`partition_size`). `padded`: zeros appended up to `size`
    (optimizer states are stored so), else not (the fp32 weights)."""
    total = sum(t.numel() for t in parts)
    assert size * world >= total, (size, world, total)
    start = rank * size
    stop = min(start + size, total)
    piece = flat_range(parts, start=start, stop=max(start, stop))
    padding = size - piece.numel()
    if padded and padding:
        piece = torch.cat([piece, piece.new_zeros(padding)])
    return piece, padding


@dataclass
class Source:
    """A checkpoint's ZeRO files: the model states and the optimizer state of each of its ranks
    (memory-mapped), read weights-only."""

    path: Path
    states: dict[str, Any]
    files: list[dict[str, Any]]  # each rank's optimizer file
    prefix: str

    @property
    def optimizers(self) -> list[dict[str, Any]]:
        return [f["optimizer_state_dict"] for f in self.files]

    @property
    def world(self) -> int:
        return len(self.files)

    @property
    def groups(self) -> int:
        return len(self.optimizers[0][_FP32])


def read_source(path: Path) -> Source:
    """The ZeRO files of checkpoint folder `path`; UsageError naming what a reshard cannot handle."""
    states = _load(path / MODEL_STATES)
    world = int(states["dp_world_size"])
    prefix = "bf16_" if optimizer_file(path, rank=0, prefix="bf16_").is_file() else ""
    files = [optimizer_file(path, rank=r, prefix=prefix) for r in range(world)]
    missing = [f.name for f in files if not f.is_file()]
    if missing or int(states.get("mp_world_size", 1)) != 1:
        raise UsageError(
            f"checkpoint {path} cannot be resharded: it needs one ZeRO optimizer file per rank of its "
            f"{world} (and no model parallelism); missing {missing}. Resume it on {world} ranks"
        )
    loaded = [_load(f) for f in files]
    optimizers = [f["optimizer_state_dict"] for f in loaded]
    zero = (states.get("ds_config") or {}).get("zero_optimization") or {}
    stage = int(optimizers[0].get("zero_stage") or 0)
    why = ""
    if stage not in (1, 2):
        why = f"its ZeRO stage is {stage} (only stages 1 and 2 are resharded)"
    elif zero.get("round_robin_gradients"):
        why = "it was trained with zero_optimization.round_robin_gradients (its order depends on the world size)"
    elif not isinstance(optimizers[0][_BASE], dict):
        why = "its optimizer state is in DeepSpeed's elastic format"
    if why:
        raise UsageError(
            f"checkpoint {path} was written by {world} rank(s) and cannot be resharded: {why}; "
            f"resume it on {world} ranks"
        )
    return Source(path=path, states=states, files=loaded, prefix=prefix)


def param_table(src: Source, group: int) -> list[tuple[str, int, int]]:
    """(name, offset in the group's flat vector, elements) of each parameter of a group, in order:
    the model states' parameter shapes, with the alignment gaps DeepSpeed may leave between them."""
    import math

    shapes = src.states["param_shapes"][group]
    gaps = src.optimizers[0].get(_PARAM_PADDINGS, [])
    gaps = gaps[group] if group < len(gaps) else [0] * len(shapes)
    table, offset = [], 0
    for (name, shape), gap in zip(shapes.items(), gaps):
        numel = math.prod(shape)
        table.append((name, offset, numel))
        offset += numel + gap
    return table


def slice_mappings(table: list[tuple[str, int, int]], *, rank: int, size: int) -> dict[str, Any]:
    """{name: fragment_address} of the parameters (or parts) in rank `rank`'s slice of `size`
    elements, as DeepSpeed records them (its universal-checkpoint converter reads them)."""
    from deepspeed.utils.tensor_fragment import fragment_address

    start, stop = rank * size, (rank + 1) * size
    out = {}
    for name, offset, numel in table:
        lo, hi = max(start, offset), min(stop, offset + numel)
        if lo < hi:
            out[name] = fragment_address(numel=hi - lo, start=lo - start)
    return out


def _group_state(src: Source, group: int, *, rank: int, world: int, size: int) -> dict[str, Any]:
    """The base optimizer's state of one group for rank `rank` of `world`: each tensor the size of a
    slice (exp_avg, exp_avg_sq) resliced, the rest (AdamW's scalar step) as rank 0 saved it."""
    opts = src.optimizers
    pid = opts[0][_BASE]["param_groups"][group]["params"][0]
    lengths = [o[_FP32][group].numel() for o in opts]
    saved_sizes = [n + o[_GROUP_PADDINGS][group] for n, o in zip(lengths, opts)]
    out = {}
    for key, value in opts[0][_BASE]["state"].get(pid, {}).items():
        if torch.is_tensor(value) and value.dim() == 1 and value.numel() == saved_sizes[0]:
            parts = [o[_BASE]["state"][pid][key][:n] for o, n in zip(opts, lengths)]  # each without its padding
            out[key], _ = new_partition(parts, rank=rank, world=world, size=size, padded=True)
        else:
            out[key] = value.clone() if torch.is_tensor(value) else value
    return out


def rank_optimizer(src: Source, *, rank: int, world: int, sizes: list[int]) -> dict[str, Any]:
    """The `optimizer_state_dict` DeepSpeed would have saved on rank `rank` of `world` ranks.
    `sizes`: the elements per rank of each group (the engine's slices at `world`)."""
    first = src.optimizers[0]
    fp32, paddings, state, mappings = [], [], {}, []
    for g in range(src.groups):
        parts = [o[_FP32][g] for o in src.optimizers]
        total = sum(t.numel() for t in parts)
        table = param_table(src, g)
        if not table or table[-1][1] + table[-1][2] != total:
            raise UsageError(
                f"checkpoint {src.path}: the parameter shapes in {MODEL_STATES} do not add up to the {total} "
                f"elements of group {g} in its optimizer files; it cannot be resharded: resume it on {src.world} ranks"
            )
        if sizes[g] != partition_size(total, world=world):
            raise RuntimeError(
                f"DeepSpeed splits parameter group {g} ({total} elements) into {sizes[g]} per rank at {world} "
                f"ranks, resharding expected {partition_size(total, world=world)}: this DeepSpeed version lays "
                f"out ZeRO state otherwise; resume on {src.world} ranks"
            )
        piece, padding = new_partition(parts, rank=rank, world=world, size=sizes[g], padded=False)
        fp32.append(piece)
        paddings.append(padding)
        pid = first[_BASE]["param_groups"][g]["params"][0]
        state[pid] = _group_state(src, g, rank=rank, world=world, size=sizes[g])
        mappings.append(slice_mappings(table, rank=rank, size=sizes[g]))
    # Settings every rank saved alike (loss scaler, clipping, stage, versions) as rank 0 did.
    return {
        **first,
        _FP32: fp32,
        _GROUP_PADDINGS: paddings,
        _PARTITION_COUNT: [world] * src.groups,
        _BASE: {"state": state, "param_groups": first[_BASE]["param_groups"]},
        _SLICE_MAPPINGS: mappings,
    }


def write_rank(src: Source, folder: Path, *, rank: int, world: int, sizes: list[int]) -> None:
    """Rank `rank`'s optimizer file of `world` ranks into `folder`."""
    top = {k: v for k, v in src.files[0].items() if k != "optimizer_state_dict"}  # ds_config, ds_version
    body = rank_optimizer(src, rank=rank, world=world, sizes=sizes)
    torch.save({"optimizer_state_dict": body, **top}, optimizer_file(folder, rank=rank, prefix=src.prefix))


def write_model_states(src: Source, folder: Path, *, world: int) -> None:
    """The model states (weights, scheduler, client state) with `world` as their data-parallel size.
    The client state keeps its own `world_size`: the per-rank RNG states it holds are of the old world."""
    torch.save({**src.states, "dp_world_size": world}, folder / MODEL_STATES)


def engine_partition_sizes(engine: Any) -> list[int]:
    """The elements per rank of each parameter group of a ZeRO-1/2 engine (its fp32 slices, padded)."""
    groups = getattr(engine.optimizer, _FP32, None)
    if groups is None:
        raise UsageError(
            "resuming on another number of ranks needs ZeRO stage 1 or 2 (zero_optimization.stage in the "
            "--ds_config); resume on the checkpoint's number of ranks"
        )
    return [t.numel() for t in groups]


def resharded(path: Path, *, world: int, sizes: list[int]) -> Path:
    """Every rank (a collective): write checkpoint `path`'s ZeRO state for `world` ranks into
    PATH/resharded_world_WORLD/ (each rank its optimizer file, rank 0 the model states) and return
    that folder, for engine.load_checkpoint. `sizes`: `engine_partition_sizes`. Raises UsageError on
    every rank when any rank failed."""
    target = path / f"{RESHARDED_PREFIX}{world}"
    if distributed.is_main():
        shutil.rmtree(target, ignore_errors=True)  # left by a job that died while resharding or loading
    distributed.barrier()
    t0 = time.perf_counter()
    error: Optional[BaseException] = None
    try:
        src = read_source(path)
        target.mkdir(exist_ok=True)  # on every rank: nothing to wait for on storage shared by nodes
        write_rank(src, target, rank=distributed.rank(), world=world, sizes=sizes)
        if distributed.is_main():
            write_model_states(src, target, world=world)
    except (UsageError, OSError, RuntimeError) as e:
        error = e
    failed = [r for r, row in enumerate(distributed.all_gather_ints([int(error is not None)])) if row[0]]
    if failed and distributed.is_main():
        shutil.rmtree(target, ignore_errors=True)
    if isinstance(error, UsageError):
        raise error
    if error is not None or failed:
        raise UsageError(
            f"resharding checkpoint {path} for {world} ranks failed on rank(s) {failed}"
            f"{f' ({error})' if error else ''}; the checkpoint itself is unchanged: free space in {path.parent} "
            f"if it ran out, or resume on the ranks it was written by"
        ) from error
    if distributed.is_main():
        record = {"source": path.name, "from_world": src.world, "to_world": world}
        (target / PROVENANCE).write_text(json.dumps(record) + "\n")
        elements = sum(t.numel() for o in src.optimizers for t in o[_FP32])
        log.info(
            f"world size changed {src.world} -> {world}: resharded the ZeRO optimizer state of {path.name} "
            f"({elements:,} fp32 master weights and their optimizer moments) in {time.perf_counter() - t0:.1f} s; "
            f"the per-rank RNG states are not restored, so the run is not bit-exact across this resume"
        )
    distributed.barrier()
    return target


def remove(folder: Path) -> None:
    """Every rank, once the engine has loaded `folder` (a `resharded` one): rank 0 removes it."""
    distributed.barrier()
    if distributed.is_main():
        shutil.rmtree(folder, ignore_errors=True)
