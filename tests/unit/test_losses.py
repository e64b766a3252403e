"""Single-process checks of pipeline.losses against loop references, upstream formulas and
sampling-free identities. The 2-rank checks are in test_losses_distributed.py."""

import math

import pytest
import torch
import torch.nn.functional as F

from pipeline.losses import TACO_POOL_SIZE, gather_bytes_per_call, mlm_loss, nsp_loss, tacl_loss, taco_kernel, taco_loss
from pipeline.losses import sampling as loss_sampling
from pipeline.losses.reference import upstream_tacl

# ---------------------------------------------------------------------------------------------------
# Inputs and loop references
# ---------------------------------------------------------------------------------------------------


def make_batch(seed, *, B=4, L=10, D=12, dtype=torch.float32, p_mask=0.3):
    """Random vectors with ragged padding (one sequence has a single real token) and masks."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, L + 1, (B,), generator=g)
    lengths[0] = L
    lengths[-1] = 1
    attention_BL = (torch.arange(L)[None, :] < lengths[:, None]).long()
    masked_BL = (torch.rand(B, L, generator=g) < p_mask) & attention_BL.bool()
    masked_BL[0, 1] = True
    x = [torch.randn(B, L, D, generator=g).to(dtype) for _ in range(3)]
    return x, attention_BL, masked_BL


def unit(v):
    return v / v.norm().clamp_min(1e-12)


def ref_tacl(student, teacher, masked_BL, attention_BL, *, tau, negatives, num_pool, seed):
    """Loops over anchors in float64. Returns (mean loss, accuracy, anchor count)."""
    B, L, _ = student.shape
    real = attention_BL.bool()
    pool = []
    if negatives == "global":
        tokens = [(b, l) for b in range(B) for l in range(L) if real[b, l]]
        pool = [tokens[i] for i in ref_pool_picks(len(tokens), num_pool, seed)]
    losses, correct = [], 0
    for b in range(B):
        for i in range(L):
            if not masked_BL[b, i]:
                continue
            s = unit(student[b, i].double())
            terms = [(j == i, s @ unit(teacher[b, j].double()) / tau) for j in range(L) if real[b, j]]
            terms += [(False, s @ unit(teacher[pb, pl].double()) / tau) for pb, pl in pool if pb != b]
            logits = torch.stack([t for _, t in terms])
            positive = next(t for is_pos, t in terms if is_pos)
            losses.append(torch.logsumexp(logits, 0) - positive)
            correct += int(all(positive > t for is_pos, t in terms if not is_pos))
    return torch.stack(losses).mean(), correct / len(losses), len(losses)


def ref_pool_picks(total, pool_size, seed):
    count = min(pool_size, total)
    u = loss_sampling.pool_uniforms(seed, count, device=torch.device("cpu")).tolist()
    picks = []
    for k in range(count):
        low, high = k * total // count, (k + 1) * total // count
        picks.append(low + min(int(u[k] * (high - low)), high - low - 1))
    return picks


def ref_taco(hidden, embeddings, attention_BL, *, anchors, masked_BL, window, K, tau, detach, pool_size, seed, dtype):
    """Loops over anchors in float64, drawing from the same uniform streams as the loss.
    Returns (mean loss, accuracy, anchor count, skipped count)."""
    B, L, _ = hidden.shape
    half = window // 2
    real = attention_BL.bool()
    g = hidden - embeddings
    real_positions = [[l for l in range(L) if real[b, l]] for b in range(B)]
    tokens = [(b, l) for b in range(B) for l in real_positions[b]]
    pool = [tokens[i] for i in ref_pool_picks(len(tokens), pool_size, seed)]
    # The pool travels in the input dtype.
    pool_vectors = [unit((g[b, l] if not detach else g[b, l].detach()).to(dtype).double()) for b, l in pool]
    chosen = {
        "all": real,
        "masked": real & masked_BL if masked_BL is not None else None,
        "unmasked": real & ~masked_BL if masked_BL is not None else None,
    }[anchors]
    anchor_list = [(b, l) for b in range(B) for l in range(L) if chosen[b, l] and len(real_positions[b]) >= 2]
    skipped = sum(int(chosen[b].sum()) for b in range(B) if len(real_positions[b]) < 2)
    u = loss_sampling.anchor_uniforms(
        seed, start=0, count=len(anchor_list), columns=2 + K, device=torch.device("cpu")
    ).tolist()
    losses, correct = [], 0
    for n, (b, l) in enumerate(anchor_list):
        j = min(int(u[n][0] * 2 * half), 2 * half - 1)
        t = l + (j - half if j < half else j - half + 1)
        if not (0 <= t < L and real[b, t]):
            others = [p for p in real_positions[b] if p != l]
            t = others[min(int(u[n][1] * len(others)), len(others) - 1)]
        eligible = [r for r, (pb, _) in enumerate(pool) if pb != b]
        if not eligible:
            skipped += 1
            continue
        negatives = [eligible[min(int(u[n][2 + k] * len(eligible)), len(eligible) - 1)] for k in range(K)]
        a = unit(g[b, l].double())
        p = unit((g[b, t].detach() if detach else g[b, t]).double())
        positive = a @ p / tau
        negative = torch.stack([a @ pool_vectors[r] / tau for r in negatives])
        losses.append(torch.logsumexp(torch.cat([positive[None], negative]), 0) - positive)
        correct += int(bool(positive > negative.max()))
    return torch.stack(losses).mean(), correct / len(losses), len(losses), skipped


def leaves(*tensors):
    return [t.detach().clone().requires_grad_(True) for t in tensors]


def double_leaves(*tensors):
    return [t.detach().double().requires_grad_(True) for t in tensors]


# ---------------------------------------------------------------------------------------------------
# TaCL
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("negatives,num_pool", [("sequence", 0), ("global", 7), ("global", 10_000)])
def test_tacl_matches_loop_reference(dtype, negatives, num_pool):
    (student, teacher, _), attention_BL, masked_BL = make_batch(1, dtype=dtype)
    student, teacher = leaves(student, teacher)
    loss, metrics = tacl_loss(
        student,
        teacher_BLD=teacher,
        masked_BL=masked_BL,
        attention_mask_BL=attention_BL,
        temperature=0.05,
        negatives=negatives,
        num_pool=num_pool,
        generator=torch.Generator().manual_seed(5),
    )
    loss.backward()
    seed = loss_sampling.draw_seed(torch.Generator().manual_seed(5))
    s64, t64 = double_leaves(student, teacher)
    ref, acc, count = ref_tacl(
        s64, t64, masked_BL, attention_BL, tau=0.05, negatives=negatives, num_pool=num_pool, seed=seed
    )
    ref.backward()
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss.double(), ref.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(metrics["loss"].double(), ref.detach(), rtol=1e-5, atol=1e-5)
    assert metrics["acc"].item() == pytest.approx(acc)
    assert metrics["num_anchors"].item() == count == int(masked_BL.sum())
    tol = dict(rtol=1e-4, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-3)
    torch.testing.assert_close(student.grad.double(), s64.grad, **tol)
    assert teacher.grad is None, "the teacher must never get a gradient"


def test_tacl_equals_upstream_without_padding_at_tau_001():
    g = torch.Generator().manual_seed(3)
    B, L, D = 3, 16, 32
    # Anisotropic like BERT (tokens of a sequence share a direction) so that at tau = 0.01 the loss
    # is not saturated at 0: cosines differ by a few hundredths.
    teacher = torch.randn(B, 1, D, generator=g) + 0.2 * torch.randn(B, L, D, generator=g)
    student = teacher + 0.2 * torch.randn(B, L, D, generator=g)
    masked_BL = torch.rand(B, L, generator=g) < 0.2
    masked_BL[0, 0] = True
    attention_BL = torch.ones(B, L, dtype=torch.long)
    loss, _ = tacl_loss(
        student, teacher_BLD=teacher, masked_BL=masked_BL, attention_mask_BL=attention_BL, temperature=0.01
    )
    expected = upstream_tacl(student.double(), teacher.double(), masked_BL.double(), temperature=0.01)
    assert 0.1 < expected.item() < 5
    torch.testing.assert_close(loss.double(), expected, rtol=1e-5, atol=1e-5)
    # Upstream sums over [PAD] too: with padding, ours must differ from it.
    attention_BL[:, L - 4 :] = 0
    masked_BL[:, L - 4 :] = False
    padded, _ = tacl_loss(
        student, teacher_BLD=teacher, masked_BL=masked_BL, attention_mask_BL=attention_BL, temperature=0.01
    )
    assert not torch.isclose(
        padded.double(),
        upstream_tacl(student.double(), teacher.double(), masked_BL.double(), temperature=0.01),
        rtol=1e-3,
    )


def test_tacl_bf16_inputs_give_fp32_logits():
    """At tau = 0.01 a bf16 cosine would be off by up to ~0.4 logits; ours matches the fp32 loss."""
    (student, teacher, _), attention_BL, masked_BL = make_batch(4, D=64)
    student = teacher + 0.5 * student
    bf = dict(masked_BL=masked_BL, attention_mask_BL=attention_BL, temperature=0.01)
    loss_bf16, _ = tacl_loss(student.bfloat16(), teacher_BLD=teacher.bfloat16(), **bf)
    loss_fp32, _ = tacl_loss(student.bfloat16().float(), teacher_BLD=teacher.bfloat16().float(), **bf)
    assert loss_bf16.dtype == torch.float32
    torch.testing.assert_close(loss_bf16, loss_fp32, rtol=1e-6, atol=1e-6)


def test_losses_ignore_an_autocast_context():
    (student, teacher, _), attention_BL, masked_BL = make_batch(8, D=64)
    student = teacher + 0.5 * student
    kw = dict(teacher_BLD=teacher, masked_BL=masked_BL, attention_mask_BL=attention_BL, temperature=0.01)
    taco_kw = dict(embeddings_BLD=teacher, attention_mask_BL=attention_BL, num_negatives=5)
    expected = (
        tacl_loss(student, **kw)[0],
        taco_loss(student, generator=torch.Generator().manual_seed(0), **taco_kw)[0],
    )
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = (
            tacl_loss(student, **kw)[0],
            taco_loss(student, generator=torch.Generator().manual_seed(0), **taco_kw)[0],
        )
    for g, e in zip(got, expected):
        assert g.dtype == torch.float32
        torch.testing.assert_close(g, e)


def test_tacl_global_pool_excludes_the_anchors_sequence():
    """If the pool held the anchor's own position, a perfect student (s = t) would see its positive
    twice and the loss would be >= log 2; excluding the own sequence keeps it near 0."""
    (_, teacher, _), attention_BL, masked_BL = make_batch(5, D=64)
    loss, metrics = tacl_loss(
        teacher.clone(),
        teacher_BLD=teacher,
        masked_BL=masked_BL,
        attention_mask_BL=attention_BL,
        temperature=0.01,
        negatives="global",
        num_pool=10_000,
    )
    assert loss.item() < 0.05
    assert metrics["acc"].item() == 1.0


def test_tacl_rejects_bad_arguments():
    (student, teacher, _), attention_BL, masked_BL = make_batch(6)
    kw = dict(teacher_BLD=teacher, attention_mask_BL=attention_BL)
    with pytest.raises(ValueError, match="padding"):
        tacl_loss(student, masked_BL=masked_BL | ~attention_BL.bool(), **kw)
    with pytest.raises(ValueError, match="num_pool"):
        tacl_loss(student, masked_BL=masked_BL, negatives="global", **kw)
    with pytest.raises(ValueError, match="num_pool"):
        tacl_loss(student, masked_BL=masked_BL, num_pool=8, **kw)
    with pytest.raises(ValueError, match="torch.bool"):
        tacl_loss(student, masked_BL=masked_BL.long(), **kw)
    with pytest.raises(ValueError, match="negatives"):
        tacl_loss(student, masked_BL=masked_BL, negatives="batch", **kw)


def test_tacl_without_masked_tokens_is_zero_not_nan():
    (student, teacher, _), attention_BL, masked_BL = make_batch(7)
    student.requires_grad_(True)
    loss, metrics = tacl_loss(
        student, teacher_BLD=teacher, masked_BL=torch.zeros_like(masked_BL), attention_mask_BL=attention_BL
    )
    loss.backward()
    assert loss.item() == 0.0 and metrics["num_anchors"].item() == 0
    assert torch.count_nonzero(student.grad) == 0


# ---------------------------------------------------------------------------------------------------
# TACO
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "anchors,detach,pool_size,dtype",
    [
        ("all", True, TACO_POOL_SIZE, torch.float32),
        ("all", False, TACO_POOL_SIZE, torch.float32),
        ("all", True, 9, torch.float32),
        ("all", False, 9, torch.float32),
        ("masked", True, 9, torch.float32),
        ("unmasked", False, 9, torch.float32),
        ("all", True, 9, torch.bfloat16),
    ],
)
def test_taco_matches_loop_reference(anchors, detach, pool_size, dtype):
    (hidden, embeddings, _), attention_BL, masked_BL = make_batch(11, dtype=dtype)
    hidden, embeddings = leaves(hidden, embeddings)
    loss, metrics = taco_loss(
        hidden,
        embeddings_BLD=embeddings,
        attention_mask_BL=attention_BL,
        anchors=anchors,
        masked_BL=masked_BL,
        window=5,
        num_negatives=6,
        temperature=0.1,
        detach=detach,
        generator=torch.Generator().manual_seed(9),
        pool_size=pool_size,
    )
    loss.backward()
    seed = loss_sampling.draw_seed(torch.Generator().manual_seed(9))
    h64, e64 = double_leaves(hidden, embeddings)
    ref, acc, count, skipped = ref_taco(
        h64,
        e64,
        attention_BL,
        anchors=anchors,
        masked_BL=masked_BL,
        window=5,
        K=6,
        tau=0.1,
        detach=detach,
        pool_size=pool_size,
        seed=seed,
        dtype=dtype,
    )
    ref.backward()
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss.double(), ref.detach(), rtol=1e-5, atol=1e-5)
    assert metrics["acc"].item() == pytest.approx(acc)
    assert (metrics["num_anchors"].item(), metrics["num_skipped"].item()) == (count, skipped)
    assert skipped >= (1 if anchors != "masked" else 0)  # the one-token sequence has no positive
    tol = dict(rtol=1e-4, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-3)
    torch.testing.assert_close(hidden.grad.double(), h64.grad, **tol)
    torch.testing.assert_close(embeddings.grad.double(), e64.grad, **tol)


@pytest.mark.parametrize("pool_size", [TACO_POOL_SIZE, 12])
def test_taco_identical_g_gives_log_k_plus_1(pool_size):
    B, L, D, K = 5, 9, 8, 7
    attention_BL = torch.ones(B, L, dtype=torch.long)
    attention_BL[2, 6:] = 0
    hidden = torch.randn(D, generator=torch.Generator().manual_seed(3)).expand(B, L, D).clone()
    loss, _ = taco_loss(
        hidden,
        embeddings_BLD=torch.zeros_like(hidden),
        attention_mask_BL=attention_BL,
        num_negatives=K,
        pool_size=pool_size,
        generator=torch.Generator().manual_seed(0),
    )
    assert loss.item() == pytest.approx(math.log(K + 1), rel=1e-5)  # to fp32 rounding


@pytest.mark.parametrize("tau", [0.07, 0.5])
def test_taco_orthogonal_sequences_give_log_1_plus_k_exp(tau):
    """g identical inside a sequence, orthogonal across sequences: any negative drawn from the
    anchor's own sequence (or padding, which is zero) would move the loss off this value."""
    B, L, D, K = 4, 10, 6, 9
    attention_BL = torch.ones(B, L, dtype=torch.long)
    attention_BL[1, 4:] = 0
    attention_BL[3, 7:] = 0
    embeddings = torch.randn(B, L, D, generator=torch.Generator().manual_seed(4))
    hidden = embeddings + 3.0 * torch.eye(D)[:B, None, :].expand(B, L, D)
    hidden = hidden * attention_BL[..., None]  # padding rows: g = -embeddings, not orthogonal
    for pool_size in (TACO_POOL_SIZE, 8):
        loss, metrics = taco_loss(
            hidden,
            embeddings_BLD=embeddings,
            attention_mask_BL=attention_BL,
            num_negatives=K,
            temperature=tau,
            pool_size=pool_size,
            generator=torch.Generator().manual_seed(1),
        )
        assert loss.item() == pytest.approx(math.log(1 + K * math.exp(-1 / tau)), rel=1e-5, abs=1e-7)
        assert metrics["acc"].item() == 1.0


def test_taco_gradients_reach_only_anchors_when_detached():
    (hidden, embeddings, _), attention_BL, masked_BL = make_batch(12, B=5)
    masked_BL[4] = False
    kw = dict(attention_mask_BL=attention_BL, anchors="masked", masked_BL=masked_BL, num_negatives=5)
    hidden, embeddings = leaves(hidden, embeddings)
    taco_loss(hidden, embeddings_BLD=embeddings, detach=True, **kw)[0].backward()
    has_grad_BL = hidden.grad.abs().sum(-1) > 0
    assert torch.equal(has_grad_BL, masked_BL & (attention_BL.sum(1) >= 2)[:, None])
    assert torch.equal(embeddings.grad.abs().sum(-1) > 0, has_grad_BL)
    hidden, embeddings = leaves(hidden, embeddings)
    taco_loss(hidden, embeddings_BLD=embeddings, detach=False, **kw)[0].backward()
    reached_BL = hidden.grad.abs().sum(-1) > 0
    assert (reached_BL & ~masked_BL).any(), "detach=False: positives and negatives get gradient too"
    assert not (reached_BL & ~attention_BL.bool()).any(), "padding never gets gradient"


def test_taco_draws_are_fresh_each_call_and_reproducible():
    (hidden, embeddings, _), attention_BL, _ = make_batch(13)
    kw = dict(embeddings_BLD=embeddings, attention_mask_BL=attention_BL, num_negatives=4, pool_size=10)
    generator = torch.Generator().manual_seed(2)
    first, second = taco_loss(hidden, generator=generator, **kw)[0], taco_loss(hidden, generator=generator, **kw)[0]
    again = taco_loss(hidden, generator=torch.Generator().manual_seed(2), **kw)[0]
    assert first.item() != second.item()
    assert first.item() == again.item()


def test_taco_rejects_bad_arguments():
    (hidden, embeddings, _), attention_BL, masked_BL = make_batch(14)
    kw = dict(embeddings_BLD=embeddings, attention_mask_BL=attention_BL)
    for bad, match in [
        (dict(window=4), "window"),
        (dict(window=1), "window"),
        (dict(anchors="some"), "anchors"),
        (dict(anchors="masked"), "masked_BL"),
        (dict(num_negatives=0), "num_negatives"),
        (dict(temperature=0.0), "temperature"),
        (dict(pool_size=0), "pool_size"),
    ]:
        with pytest.raises(ValueError, match=match):
            taco_loss(hidden, **kw, **bad)
    with pytest.raises(ValueError, match="2 sequences"):
        taco_loss(hidden[:1], embeddings_BLD=embeddings[:1], attention_mask_BL=attention_BL[:1])
    with pytest.raises(ValueError, match="embeddings_BLD"):
        taco_loss(hidden, embeddings_BLD=embeddings[:, :3], attention_mask_BL=attention_BL)


@pytest.mark.parametrize("all_rows", [False, True])
@pytest.mark.parametrize("detach", [True, False])
def test_taco_kernel_gradients_across_chunks(monkeypatch, detach, all_rows):
    """The hand-written backward (chunks of 2 anchors) against autograd through the plain formula,
    and against finite differences where no stop-gradient is involved."""
    monkeypatch.setattr(taco_kernel, "_CHUNK_ELEMENTS", 2 * 7)
    g = torch.Generator().manual_seed(0)
    M, D, P, N, K, tau = 9, 5, 7, 6, 4, 0.3
    inputs = [torch.randn(n, D, generator=g, dtype=torch.float64) for n in (M, M, P)]
    anchor = torch.tensor([0, 2, 3, 5, 7, 8])
    positive = torch.tensor([1, 1, 4, 6, 8, 6])  # shared positives: their gradients must add up
    if all_rows:  # every row an anchor (no padding): the kernel slices instead of gathering
        N, anchor, positive = M, torch.arange(M), torch.tensor([1, 0, 8, 2, 5, 4, 5, 8, 0])
    negative = torch.randint(0, P, (N, K), generator=g)

    def kernel(h, e, p):
        return taco_kernel.taco_anchor_losses(
            h, e, p, anchor_N=anchor, positive_N=positive, negative_NK=negative, temperature=tau, detach=detach
        )[0]

    def plain(h, e, p):
        unit = F.normalize(h - e, dim=-1)
        a, pos = unit[anchor], (unit.detach() if detach else unit)[positive]
        logits = torch.cat([(a * pos).sum(1, keepdim=True), (a @ p.T).gather(1, negative)], dim=1) / tau
        return torch.logsumexp(logits, dim=1) - logits[:, 0]

    weights = torch.rand(N, generator=g, dtype=torch.float64)
    got, want = leaves(*inputs), leaves(*inputs)
    (weights * kernel(*got)).sum().backward()
    (weights * plain(*want)).sum().backward()
    torch.testing.assert_close(kernel(*inputs), plain(*inputs))
    for x, y in zip(got, want):
        torch.testing.assert_close(x.grad, y.grad)
    if detach:
        assert torch.equal(got[0].grad.abs().sum(1) > 0, torch.isin(torch.arange(M), anchor))
    else:
        assert torch.autograd.gradcheck(kernel, leaves(*inputs))


# ---------------------------------------------------------------------------------------------------
# Sampling
# ---------------------------------------------------------------------------------------------------


def test_taco_positives_and_negatives_respect_the_rules():
    g = torch.Generator().manual_seed(21)
    B, L, window, K = 24, 40, 5, 50
    lengths = torch.randint(2, L + 1, (B,), generator=g)
    real_BL = torch.arange(L)[None, :] < lengths[:, None]
    anchor_flat = real_BL.reshape(-1).nonzero().squeeze(1)
    u = torch.rand(len(anchor_flat), 2 + K, generator=g, dtype=torch.float64)
    positive = loss_sampling.positive_positions(u[:, :2], anchor_flat_N=anchor_flat, real_BL=real_BL, window=window)
    b, l, pb, pl = anchor_flat // L, anchor_flat % L, positive // L, positive % L
    assert torch.equal(pb, b) and (pl != l).all() and real_BL[pb, pl].all()
    offset = pl - l
    interior = (l >= 2) & (l + 2 < lengths[b])
    assert (offset[interior].abs() <= window // 2).all()
    counts = torch.bincount(offset[interior] + 2, minlength=5)
    assert counts[2] == 0 and (counts[[0, 1, 3, 4]] > 0.2 * interior.sum()).all()
    # Near the edges upstream falls back to a random other token: it happens, and only there.
    assert (offset[~interior].abs() > window // 2).any()

    seed = 77
    picks = loss_sampling.pool_token_indices(int(real_BL.sum()), 300, seed=seed, device=torch.device("cpu"))
    assert torch.equal(picks, picks.unique())
    real_flat = real_BL.reshape(-1).nonzero().squeeze(1)
    pool_sequence = real_flat[picks] // L
    index, has = loss_sampling.negative_pool_indices(u[:, 2:], anchor_sequence_N=b, pool_sequence_P=pool_sequence)
    assert has.all()
    assert (pool_sequence[index] != b[:, None]).all(), "a negative from the anchor's own sequence"
    # Uniform over the other sequences' pool rows: hits per row against K / (eligible rows) per anchor.
    hits = torch.bincount(index.reshape(-1), minlength=len(picks)).double()
    eligible_NP = (pool_sequence[None, :] != b[:, None]).double()
    expected = (K * eligible_NP / eligible_NP.sum(1, keepdim=True)).sum(0)
    chi2_per_dof = (((hits - expected) ** 2) / expected).sum() / (len(picks) - 1)
    assert chi2_per_dof < 1.5 and ((hits - expected).abs() < 0.5 * expected).all()


@pytest.mark.parametrize("pool_size,bound", [(TACO_POOL_SIZE, None), (512, 9), (4096, 65), (5000, 80)])
def test_pool_is_stratified_and_balanced_across_64_ranks(pool_size, bound):
    tokens_per_rank, world = 32 * 256, 64
    computed = loss_sampling.max_pool_rows_per_rank(tokens_per_rank, world_size=world, pool_size=pool_size)
    assert bound is None or computed == bound
    for seed in range(3):
        picks = loss_sampling.pool_token_indices(
            tokens_per_rank * world, pool_size, seed=seed, device=torch.device("cpu")
        )
        per_rank = torch.bincount(picks // tokens_per_rank, minlength=world)
        assert per_rank.sum() == pool_size and per_rank.max() <= computed
        assert torch.equal(picks, picks.unique())
    # Small, ragged case: every token is drawn exactly once when the pool is larger than the batch.
    assert torch.equal(loss_sampling.pool_token_indices(50, 80, seed=1, device=torch.device("cpu")), torch.arange(50))


def test_gathered_bytes_stay_under_5_percent_of_bert_base_gradient_allreduce():
    """Arithmetic, not timing: BERT-base's bf16 gradients (110M parameters, 2 bytes each) against
    what one rank receives per loss call at our defaults on 64 ranks, B=32, L=256, D=768, bf16."""
    gradient_bytes = 110e6 * 2
    kw = dict(world_size=64, tokens_per_rank=32 * 256, hidden_size=768, itemsize=2)
    taco = gather_bytes_per_call(pool_size=TACO_POOL_SIZE, **kw)
    tacl_global = gather_bytes_per_call(pool_size=4096, **kw)
    tacl_sequence = gather_bytes_per_call(pool_size=0, **kw)
    assert taco / gradient_bytes < 0.05
    assert tacl_global / gradient_bytes < 0.05
    assert tacl_sequence < 4096
    # What the pool replaces: all-gathering whole hidden states would exceed the gradients.
    assert 64 * 32 * 256 * 768 * 2 > gradient_bytes


# ---------------------------------------------------------------------------------------------------
# MLM / NSP
# ---------------------------------------------------------------------------------------------------


def test_mlm_loss_matches_cross_entropy_and_counts():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 7, 50, generator=g).bfloat16()
    labels = torch.randint(0, 50, (3, 7), generator=g)
    labels[torch.rand(3, 7, generator=g) < 0.6] = -100
    loss, metrics = mlm_loss(logits, labels)
    expected = F.cross_entropy(logits.float().reshape(-1, 50), labels.reshape(-1), ignore_index=-100)
    torch.testing.assert_close(loss, expected)
    keep = labels != -100
    acc = (logits.float().argmax(-1)[keep] == labels[keep]).float().mean()
    assert metrics["acc"].item() == pytest.approx(acc.item())
    assert metrics["num_anchors"].item() == keep.sum().item()
    empty, _ = mlm_loss(logits, torch.full_like(labels, -100))
    assert empty.item() == 0.0
    with pytest.raises(ValueError, match="labels"):
        mlm_loss(logits, labels[:, :3])


def test_nsp_loss_matches_cross_entropy():
    logits, labels = torch.randn(6, 2, generator=torch.Generator().manual_seed(0)), torch.tensor([0, 1, 1, 0, 0, 1])
    loss, metrics = nsp_loss(logits, labels)
    torch.testing.assert_close(loss, F.cross_entropy(logits, labels))
    assert metrics["num_anchors"].item() == 6
