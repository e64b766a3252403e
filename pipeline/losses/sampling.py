"""What the contrastive losses draw, and from where: the layout of tokens across ranks, the
cross-device pool of token vectors, and TACO's positives and negatives.

Every draw is defined on the *global* index space: all ranks' micro-batches concatenated in rank
order, positions row-major. Draws come from one seed that every rank takes from an identically
seeded generator (the trainer seeds it from the step, not the rank; a layout gather checks it),
through private generators keyed by what is drawn, so R ranks draw exactly what one process holding
the concatenated batch draws, and the per-anchor draws of rank r cost O(its own anchors), not O(all).

Nothing here reads a device tensor on the host. The layout is host numbers (counts the collator
made); where every rank holds the same counts by construction (packed blocks, every token an
anchor) it needs no collective at all, else one small all-gather of host integers. The pool's
picks are drawn on the CPU from the seed, so every rank knows how many rows each rank sends without
asking the device; the rows themselves are gathered in one collective, their sequence ids either
computed from the picks (uniform layouts) or carried in the same gather.

The pool is a *stratified* sample of the real tokens of all ranks: the global token range is cut
into P equal strata and one token is drawn from each. Every token has the same chance P/T to be in
it, a rank holding 1/R of the tokens sends at most P/R + 2 rows (so padding the all-gather to the
busiest rank wastes almost nothing), and the pool spreads evenly over the sequences.

Legend: B sequences (this rank), L positions, D hidden size, T real tokens, N anchors (this rank),
P pool rows (all ranks), K negatives per anchor, R ranks; `_flat` = index into this rank's B*L.
"""

from __future__ import annotations

import hashlib
import itertools
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from pipeline import distributed

# Streams of the shared seed (keys of the private generators).
_POOL_STREAM = 1
_ANCHOR_STREAM = 2
# A layout gather: 4 int64 per rank (sequences, tokens, anchors, seed).
LAYOUT_BYTES_PER_RANK = 4 * 8
# Per-anchor draws come in globally aligned blocks of this many anchors, one generator per block,
# so a rank only draws the blocks that overlap its own anchors.
ANCHOR_BLOCK = 4096


@dataclass(frozen=True)
class Layout:
    """Per-rank counts (in rank order) of sequences, real tokens and anchors, and the shared seed.
    `tokens_per_sequence`: set when every sequence of every rank holds exactly that many real tokens
    (packed blocks), so a global token index determines its sequence. `gathered`: whether the counts
    travelled between ranks (or every rank knew them)."""

    rank: int
    sequences: tuple[int, ...]
    tokens: tuple[int, ...]
    anchors: tuple[int, ...]
    seed: int
    tokens_per_sequence: Optional[int] = None
    gathered: bool = True

    @property
    def world_size(self) -> int:
        return len(self.sequences)

    @property
    def sequence_offset(self) -> int:
        return sum(self.sequences[: self.rank])

    @property
    def token_offset(self) -> int:
        return sum(self.tokens[: self.rank])

    @property
    def anchor_offset(self) -> int:
        return sum(self.anchors[: self.rank])


def draw_seed(generator: Optional[torch.Generator]) -> int:
    """One int drawn from `generator` (torch's default generator if None): the only draw the losses
    take from the caller's generator, so its state advances the same way on every rank. A CPU
    generator (what the trainer passes) costs no device read."""
    device = generator.device if generator is not None else torch.device("cpu")
    return int(torch.randint(0, 2**62, (1,), generator=generator, device=device).item())


def gather_layout(
    *,
    sequences: int,
    tokens: int,
    anchors: int,
    seed: int,
    group: Optional[dist.ProcessGroup],
    tokens_per_sequence: Optional[int] = None,
    equal_tokens: bool = False,
) -> Layout:
    """Every rank's counts. `tokens_per_sequence` set (the caller's promise that every rank holds
    `sequences` sequences of exactly that many real tokens, all anchors included): no collective.
    `equal_tokens` (the promise that every rank holds `tokens` real tokens and `anchors` anchors, in
    sequences of any length and number: packed blocks cut into their documents): no collective either;
    the global sequence ids are then spaced by the token count (rank r's are r * tokens + its own), an
    upper bound of any rank's sequences, so that no rank needs another's count; they keep the order and
    the equalities of the concatenated batch's, which is all the draws use. Otherwise one small
    all-gather of host integers, which also checks that every rank draws with the same seed."""
    world, rank = distributed.world_size(group), distributed.rank(group)
    if tokens_per_sequence is not None or world == 1 or equal_tokens:
        spaced = equal_tokens and tokens_per_sequence is None and world > 1
        return Layout(
            rank=rank,
            sequences=((tokens if spaced else sequences),) * world,
            tokens=(tokens,) * world,
            anchors=(anchors,) * world,
            seed=seed,
            tokens_per_sequence=tokens_per_sequence,
            gathered=False,
        )
    rows = distributed.all_gather_ints([sequences, tokens, anchors, seed], group=group)
    assert len({r[3] for r in rows}) == 1, (
        f"ranks draw with different seeds {[r[3] for r in rows]}: seed the loss generator from the step, not the rank"
    )
    return Layout(
        rank=rank,
        sequences=tuple(r[0] for r in rows),
        tokens=tuple(r[1] for r in rows),
        anchors=tuple(r[2] for r in rows),
        seed=seed,
    )


def layout_bytes(layout: Layout) -> int:
    """Bytes one rank receives from `gather_layout` (0 when it gathered nothing)."""
    if layout.world_size <= 1 or not layout.gathered:
        return 0
    return layout.world_size * LAYOUT_BYTES_PER_RANK


def private_generator(seed: int, *keys: int, device: torch.device) -> torch.Generator:
    """A generator for one named stream of `seed` (same keys -> same numbers on every rank)."""
    digest = hashlib.blake2b(repr((seed, *keys)).encode(), digest_size=8).digest()
    generator = torch.Generator(device=device)
    generator.manual_seed(int.from_bytes(digest, "little") >> 1)
    return generator


# ---------------------------------------------------------------------------------------------------
# The cross-device pool
# ---------------------------------------------------------------------------------------------------


def pool_token_indices(total_tokens: int, pool_size: int, *, seed: int, device: torch.device) -> torch.Tensor:
    """Global real-token indices of the pool, ascending: one uniform pick in each of
    min(pool_size, total_tokens) integer strata [floor(k*T/P), floor((k+1)*T/P)). Out: [P] int64."""
    count = min(pool_size, total_tokens)
    k_P = torch.arange(count, device=device, dtype=torch.int64)
    if count == 0:
        return k_P
    low_P = k_P * total_tokens // count
    width_P = (k_P + 1) * total_tokens // count - low_P
    u_P = pool_uniforms(seed, count, device=device)
    # min() guards the float rounding of u * width up to width.
    return low_P + torch.minimum((u_P * width_P).long(), width_P - 1)


def pool_uniforms(seed: int, count: int, *, device: torch.device) -> torch.Tensor:
    """The pool draw's uniforms in [0, 1): one per stratum. Out: [count] float64."""
    generator = private_generator(seed, _POOL_STREAM, device=device)
    return torch.rand(count, generator=generator, dtype=torch.float64, device=device)


def max_pool_rows_per_rank(tokens_per_rank: int, *, world_size: int, pool_size: int) -> int:
    """The most pool rows one rank sends when every rank holds `tokens_per_rank` real tokens: a run
    of n consecutive tokens meets at most floor((n - 1) / w) + 2 strata of width >= w."""
    total = tokens_per_rank * world_size
    count = min(pool_size, total)
    if count == 0:
        return 0
    narrowest = total // count
    return min(tokens_per_rank, count, (tokens_per_rank - 1) // narrowest + 2)


@dataclass(frozen=True)
class PoolDraw:
    """This rank's part of the pool: its rows (flat positions, ascending) and their global sequence
    ids, how many rows every rank sends, and, for uniform layouts, the whole pool's sequence ids."""

    flat_n: torch.Tensor
    sequence_n: torch.Tensor
    sizes: list[int]
    sequence_P: Optional[torch.Tensor] = None


@dataclass(frozen=True)
class Pool:
    """The gathered pool: rows in global token order, their global sequence ids, bytes received."""

    vectors_PD: torch.Tensor
    sequence_P: torch.Tensor
    gathered_bytes: int


def to_device(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small host tensor on `device` without stalling the host (pinned, asynchronous on CUDA)."""
    if device.type == "cuda":
        return x.pin_memory().to(device, non_blocking=True)
    return x.to(device)


def draw_pool(*, real_flat_T: torch.Tensor, width: int, layout: Layout, pool_size: int) -> PoolDraw:
    """Draw the pool (module docstring) and find this rank's rows. No collective and no device read:
    the picks are drawn on the CPU, so every rank knows how many fall in each rank's token range.
    In: real_flat_T [T] int64, the flat positions (in this rank's [B, width] grid) of its real tokens."""
    device = real_flat_T.device
    picks_P = pool_token_indices(sum(layout.tokens), pool_size, seed=layout.seed, device=torch.device("cpu"))
    bounds = torch.tensor([0, *itertools.accumulate(layout.tokens)])
    sizes = torch.searchsorted(picks_P, bounds).diff().tolist()
    start = layout.token_offset
    mine = picks_P[(picks_P >= start) & (picks_P < start + layout.tokens[layout.rank])] - start
    flat_n = real_flat_T.index_select(0, to_device(mine, device))
    sequence_P = None
    if layout.tokens_per_sequence is not None:
        sequence_P = to_device(picks_P // layout.tokens_per_sequence, device)
    return PoolDraw(
        flat_n=flat_n, sequence_n=flat_n // width + layout.sequence_offset, sizes=sizes, sequence_P=sequence_P
    )


def gather_pool(rows_nD: torch.Tensor, *, draw: PoolDraw, group: Optional[dist.ProcessGroup], autograd: bool) -> Pool:
    """Gather every rank's pool rows (this rank's: `rows_nD`, the vectors at draw.flat_n) in the dtype
    they come in, in one collective; `autograd=True` lets gradients flow back to the rows' owners.
    Where the sequence ids are not known already they travel in the same gather, their int64 bits
    appended to each row. Out: Pool with vectors_PD [P, D] and sequence_P [P] (global ids, ascending)."""
    D = rows_nD.shape[1]
    if draw.sequence_P is not None or len(draw.sizes) <= 1:
        vectors_PD = distributed.all_gather_uneven(rows_nD, sizes=draw.sizes, group=group, autograd=autograd)
        sequence_P = draw.sequence_P if draw.sequence_P is not None else draw.sequence_n
        row_bytes = D * rows_nD.element_size()
    else:
        id_bits_nk = draw.sequence_n.to(torch.int64).contiguous().view(rows_nD.dtype).view(rows_nD.shape[0], -1)
        both_PDk = distributed.all_gather_uneven(
            torch.cat([rows_nD, id_bits_nk], dim=1), sizes=draw.sizes, group=group, autograd=autograd
        )
        vectors_PD = both_PDk[:, :D]
        sequence_P = both_PDk[:, D:].detach().contiguous().view(torch.int64).view(-1)
        row_bytes = D * rows_nD.element_size() + 8
    gathered = distributed.uneven_gather_bytes(draw.sizes, row_bytes=row_bytes)
    return Pool(vectors_PD=vectors_PD, sequence_P=sequence_P, gathered_bytes=gathered)


# ---------------------------------------------------------------------------------------------------
# TACO's per-anchor draws
# ---------------------------------------------------------------------------------------------------


def anchor_uniforms(seed: int, *, start: int, count: int, columns: int, device: torch.device) -> torch.Tensor:
    """Rows [start, start + count) of the global per-anchor stream of uniforms in [0, 1).
    Out: [count, columns] float64 (float64 so that floor(u * n) stays below n for large n)."""
    if count == 0:
        return torch.empty(0, columns, dtype=torch.float64, device=device)
    first, last = start // ANCHOR_BLOCK, (start + count - 1) // ANCHOR_BLOCK
    blocks = [
        torch.rand(
            ANCHOR_BLOCK,
            columns,
            dtype=torch.float64,
            device=device,
            generator=private_generator(seed, _ANCHOR_STREAM, block, device=device),
        )
        for block in range(first, last + 1)
    ]
    skip = start - first * ANCHOR_BLOCK
    return torch.cat(blocks)[skip : skip + count]


def _pick(u: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    """floor(u * n) as int64, kept in [0, n - 1] (n >= 1 where the result is used)."""
    return torch.minimum((u * n).long(), (n - 1).clamp_min(0))


def positive_positions(
    u_N2: torch.Tensor, *, anchor_flat_N: torch.Tensor, real_BL: torch.Tensor, window: int
) -> torch.Tensor:
    """TACO positives, as upstream samples them but padding-aware.

    Column 0 picks an offset uniformly from {-h..-1, 1..h}, h = window // 2. If that lands outside
    the sequence or on padding (near the edges), column 1 picks a uniformly random *other* real token
    of the anchor's sequence instead. Every anchor's sequence must hold >= 2 real tokens.
    In: u_N2 float64, anchor_flat_N int64. Out: pos_flat_N int64 (same sequence, never the anchor).
    """
    B, L = real_BL.shape
    half = window // 2
    b_N, l_N = anchor_flat_N // L, anchor_flat_N % L
    j_N = _pick(u_N2[:, 0], torch.full_like(b_N, 2 * half))
    offset_N = torch.where(j_N < half, j_N - half, j_N - half + 1)
    target_N = l_N + offset_N
    inside_N = (target_N >= 0) & (target_N < L)
    target_N = target_N.clamp(0, L - 1)
    usable_N = inside_N & real_BL[b_N, target_N]
    # The fallback: the k-th real token of the sequence, skipping the anchor's own rank.
    real_positions_BL = torch.argsort((~real_BL).to(torch.int8), dim=1, stable=True)
    others_N = real_BL.sum(1)[b_N] - 1
    k_N = _pick(u_N2[:, 1], others_N)
    own_rank_N = real_BL.cumsum(1)[b_N, l_N] - 1
    k_N = k_N + (k_N >= own_rank_N).long()
    fallback_N = real_positions_BL[b_N, k_N.clamp_max(L - 1)]
    return b_N * L + torch.where(usable_N, target_N, fallback_N)


def negative_pool_indices(
    u_NK: torch.Tensor, *, anchor_sequence_N: torch.Tensor, pool_sequence_P: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """K pool rows per anchor, uniformly with replacement (as upstream) among the pool rows of *other*
    sequences. The pool is in global token order, so a sequence's rows are one contiguous run that
    the draw skips over.
    In: u_NK float64, anchor_sequence_N and pool_sequence_P (ascending) global sequence ids.
    Out: index_NK int64 into the pool, has_negatives_N bool (False where every row is the anchor's).
    """
    P = pool_sequence_P.shape[0]
    first_N = torch.searchsorted(pool_sequence_P, anchor_sequence_N, right=False)
    own_N = torch.searchsorted(pool_sequence_P, anchor_sequence_N, right=True) - first_N
    eligible_N = P - own_N
    j_NK = _pick(u_NK, eligible_N[:, None])
    index_NK = j_NK + own_N[:, None] * (j_NK >= first_N[:, None]).long()
    return index_NK.clamp_max(max(P - 1, 0)), eligible_N > 0
