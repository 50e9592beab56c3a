"""Each kernel against the slow reference loops of reference_impl, on random inputs with left/right padding,
holes (non-contiguous masks) and empty rows; values and gradients, in float64 (tight) and float32."""

from __future__ import annotations

import pytest
import reference_impl as ref
import torch
from hypothesis import given
from hypothesis import strategies as st
from strategies import masked_case, randn

import rlbits

F64 = dict(atol=1e-10, rtol=1e-9)
F32 = dict(atol=2e-5, rtol=1e-4)


def grads(out, *inputs):
    return torch.autograd.grad(out, inputs, allow_unused=True)


def leaf(t):
    return t.detach().clone().requires_grad_(True)


# --- masked statistics -------------------------------------------------------------------------------


@given(masked_case())
def test_masked_stats_match_reference(case):
    B, R, mask, gen = case
    x = leaf(randn(gen, B, R, scale=3.0))
    torch.testing.assert_close(rlbits.masked_sum(x, mask), ref.masked_sum(x, mask), **F64)
    torch.testing.assert_close(rlbits.masked_mean(x, mask), ref.masked_mean(x, mask), **F64)
    for unbiased in (True, False):
        torch.testing.assert_close(rlbits.masked_var(x, mask, unbiased), ref.masked_var(x, mask, unbiased), **F64)
    for dim in (0, 1):
        other = 1 - dim  # reducing over `dim` leaves one mean per index of the other dimension
        expected = torch.stack(
            [ref.masked_mean(x.select(other, i), mask.select(other, i)) for i in range(x.shape[other])]
        )
        torch.testing.assert_close(rlbits.masked_mean(x, mask, dim=dim), expected, **F64)
    if mask.sum() >= 2:
        got = rlbits.masked_whiten(x, mask)
        want = ref.masked_whiten(x, mask)
        torch.testing.assert_close(got, want, **F64)
        torch.testing.assert_close(grads(got.square().sum(), x)[0], grads(want.square().sum(), x)[0], **F64)
        torch.testing.assert_close(
            rlbits.masked_whiten(x, mask, shift_mean=False), ref.masked_whiten(x, mask, shift_mean=False), **F64
        )


@given(masked_case())
def test_masked_stats_ignore_nan_in_padding(case):
    B, R, mask, gen = case
    x = leaf(randn(gen, B, R))
    nan = torch.tensor(float("nan"), dtype=x.dtype)
    for fn in (rlbits.masked_sum, rlbits.masked_mean, rlbits.masked_var):
        out = fn(torch.where(mask, x, nan), mask)
        assert torch.isfinite(out).all()
        (g,) = grads(out, x)
        assert torch.isfinite(g).all() and (g[~mask] == 0).all()
    white = rlbits.masked_whiten(torch.where(mask, x, nan), mask)
    assert torch.isfinite(white).all() and (white[~mask] == 0).all()


# --- logprobs and entropy ----------------------------------------------------------------------------


@given(st.integers(1, 3), st.integers(1, 5), st.integers(2, 9), st.sampled_from([1.0, 0.7, 1.3]), st.integers(0, 10**6))
def test_logprobs_and_entropy_match_reference(batch, length, vocab, temperature, seed):
    gen = torch.Generator().manual_seed(seed)
    logits = leaf(randn(gen, batch, length, vocab, scale=4.0))
    tokens = torch.randint(0, vocab, (batch, length), generator=gen)
    got = rlbits.logprobs_from_logits(logits, tokens, temperature)
    want = ref.logprobs(logits, tokens, temperature)
    torch.testing.assert_close(got, want, **F64)
    weights = randn(gen, batch, length)
    torch.testing.assert_close(
        grads((got * weights).sum(), logits)[0], grads((want * weights).sum(), logits)[0], **F64
    )
    torch.testing.assert_close(rlbits.entropy_from_logits(logits.detach(), temperature), ref.entropy(logits, temperature), **F64)
    # the differentiable path (entropy bonus) agrees with the chunked no-grad path
    torch.testing.assert_close(rlbits.entropy_from_logits(logits, temperature).detach(), ref.entropy(logits, temperature), **F64)


@given(st.integers(1, 3), st.integers(1, 5), st.integers(2, 9), st.sampled_from([1.0, 0.7, 1.3]), st.integers(0, 10**6))
def test_logprobs_with_entropy_match_reference(batch, length, vocab, temperature, seed):
    """``return_entropy=True``: the entropy of the same chunked pass, detached; the logprobs and their
    gradient are those of the plain call."""
    gen = torch.Generator().manual_seed(seed)
    logits = leaf(randn(gen, batch, length, vocab, scale=4.0))
    tokens = torch.randint(0, vocab, (batch, length), generator=gen)
    got, ent = rlbits.logprobs_from_logits(logits, tokens, temperature, return_entropy=True)
    torch.testing.assert_close(got, ref.logprobs(logits, tokens, temperature), **F64)
    torch.testing.assert_close(ent, ref.entropy(logits, temperature), **F64)
    assert not ent.requires_grad and ent.shape == tokens.shape
    weights = randn(gen, batch, length)
    want = ref.logprobs(logits, tokens, temperature)
    torch.testing.assert_close(
        grads((got * weights).sum(), logits)[0], grads((want * weights).sum(), logits)[0], **F64
    )


@pytest.mark.parametrize("temperature", [1.0, 0.9])
def test_logprobs_entropy_chunked_float32(monkeypatch, temperature):
    """The entropy of the chunked float32 pass (several chunks, a partial last one) equals the reference's."""
    import rlbits.functional.logprobs as lp_module

    gen = torch.Generator().manual_seed(3)
    logits = randn(gen, 3, 7, 11, scale=3.0, dtype=torch.float32)
    tokens = torch.randint(0, 11, (3, 7), generator=gen)
    monkeypatch.setattr(lp_module, "_CHUNK_ELEMENTS", 11 * 4)  # 4 rows per chunk: 21 rows -> 6 chunks
    lp, ent = rlbits.logprobs_from_logits(logits, tokens, temperature, return_entropy=True)
    torch.testing.assert_close(lp, rlbits.logprobs_from_logits(logits, tokens, temperature), atol=1e-6, rtol=0)
    torch.testing.assert_close(ent, ref.entropy(logits.double(), temperature).float(), **F32)


@pytest.mark.parametrize("temperature", [1.0, 0.9])
def test_logprobs_chunked_path_matches_unchunked(monkeypatch, temperature):
    """The eager chunked path (in-place backward per chunk) equals the one-pass path."""
    import rlbits.functional.logprobs as lp_module

    gen = torch.Generator().manual_seed(1)
    logits = leaf(randn(gen, 3, 7, 11, dtype=torch.float32))
    tokens = torch.randint(0, 11, (3, 7), generator=gen)
    full = rlbits.logprobs_from_logits(logits, tokens, temperature)
    (g_full,) = grads(full.sum(), logits)
    monkeypatch.setattr(lp_module, "_CHUNK_ELEMENTS", 11 * 4)  # 4 rows per chunk: 21 rows -> 6 chunks
    chunked = rlbits.logprobs_from_logits(logits, tokens, temperature)
    (g_chunked,) = grads(chunked.sum(), logits)
    torch.testing.assert_close(chunked, full, atol=0, rtol=0)
    torch.testing.assert_close(g_chunked, g_full, atol=1e-7, rtol=0)
    ref_grad = grads(ref.logprobs(logits.double(), tokens, temperature).sum(), logits)[0]
    torch.testing.assert_close(g_chunked, ref_grad, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(rlbits.entropy_from_logits(logits.detach()), torch.distributions.Categorical(logits=logits.detach()).entropy())


def test_logprobs_bf16_logits_are_computed_in_float32():
    gen = torch.Generator().manual_seed(2)
    logits = randn(gen, 2, 5, 300, scale=5.0, dtype=torch.bfloat16)
    tokens = torch.randint(0, 300, (2, 5), generator=gen)
    got = rlbits.logprobs_from_logits(logits, tokens)
    assert got.dtype == torch.float32
    want = torch.log_softmax(logits.double(), -1).gather(-1, tokens[..., None]).squeeze(-1)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
    leaf_bf16 = logits.clone().requires_grad_(True)
    (g,) = grads(rlbits.logprobs_from_logits(leaf_bf16, tokens).sum(), leaf_bf16)
    assert g.dtype == torch.bfloat16 and torch.isfinite(g.float()).all()
    got2, ent = rlbits.logprobs_from_logits(logits, tokens, return_entropy=True)
    assert got2.dtype == ent.dtype == torch.float32
    torch.testing.assert_close(got2.double(), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent.double(), ref.entropy(logits.double()), atol=1e-5, rtol=1e-5)


def test_logprobs_keeps_no_vocab_sized_tensor_for_backward():
    """Only the input logits (alive anyway) and [B, R]-sized tensors are saved: nothing else of size V."""
    gen = torch.Generator().manual_seed(3)
    logits = leaf(randn(gen, 2, 3, 1000, dtype=torch.bfloat16))
    tokens = torch.randint(0, 1000, (2, 3), generator=gen)
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        rlbits.logprobs_from_logits(logits, tokens, temperature=0.7)
    big = [t for t in saved if t.numel() >= 1000]
    assert len(big) == 1 and big[0].data_ptr() == logits.data_ptr(), [(t.shape, t.dtype) for t in saved]


# --- KL, token rewards, GAE ----------------------------------------------------------------------------


@given(masked_case(), st.sampled_from(rlbits.KL_ESTIMATORS), st.sampled_from([None, 0.3, 1.0, 10.0]))
def test_kl_penalty_matches_reference(case, estimator, clamp):
    B, R, mask, gen = case
    lp, ref_lp = leaf(randn(gen, B, R, scale=1.5)), leaf(randn(gen, B, R, scale=1.5))  # some |d| past a clamp
    lp_pad = torch.where(mask, lp, torch.zeros((), dtype=lp.dtype))  # the batch schema: 0 on padding
    ref_pad = torch.where(mask, ref_lp, torch.zeros((), dtype=lp.dtype))
    got = rlbits.kl_penalty(lp_pad, ref_pad, estimator, clamp=clamp)
    torch.testing.assert_close(got, ref.kl(lp_pad, ref_pad, estimator, clamp), **F64)
    assert (got[~mask] == 0).all()
    # the gradient, per token, of a masked sum (as a KL loss term): the reference's on the mask, 0 off it
    g_lp, g_ref = grads(rlbits.masked_sum(got, mask), lp, ref_lp)
    want = torch.where(mask, ref.kl_grad(lp_pad, ref_pad, estimator, clamp), torch.zeros((), dtype=torch.float64))
    torch.testing.assert_close(g_lp if g_lp is not None else torch.zeros_like(want), want, **F64)
    torch.testing.assert_close(g_ref if g_ref is not None else torch.zeros_like(want), -want, **F64)


def test_kl_straight_through_value_and_gradient():
    """k1+ / k3+: the value of k1 / k3 and the gradient of k2, also where a clamp cuts the value."""
    gen = torch.Generator().manual_seed(5)
    lp, ref_lp = leaf(randn(gen, 3, 6, scale=2.0)), randn(gen, 3, 6, scale=2.0)
    for plus, base in (("k1+", "k1"), ("k3+", "k3")):
        for clamp in (None, 0.5):
            got = rlbits.kl_penalty(lp, ref_lp, plus, clamp=clamp)
            torch.testing.assert_close(got, rlbits.kl_penalty(lp, ref_lp, base, clamp=clamp), atol=0, rtol=0)
            (g,) = grads(got.sum(), lp)
            (g_k2,) = grads(rlbits.kl_penalty(lp, ref_lp, "k2").sum(), lp)
            torch.testing.assert_close(g, g_k2, atol=0, rtol=0)
            torch.testing.assert_close(g, (lp - ref_lp).detach(), **F64)


def test_kl_clamp_none_is_unchanged_and_extremes_stay_finite():
    gen = torch.Generator().manual_seed(6)
    lp, ref_lp = randn(gen, 2, 5, scale=3.0), randn(gen, 2, 5, scale=3.0)
    for estimator in ("k1", "abs", "k2", "k3"):
        torch.testing.assert_close(
            rlbits.kl_penalty(lp, ref_lp, estimator, clamp=None), rlbits.kl_penalty(lp, ref_lp, estimator), atol=0, rtol=0
        )
    # float32, log-ratios of +-200: exp(200) overflows, yet the clamped values and gradients are finite
    x = torch.tensor([[-200.0, 200.0, 0.5]], requires_grad=True)
    for estimator in rlbits.KL_ESTIMATORS:
        out = rlbits.kl_penalty(x, torch.zeros(1, 3), estimator, clamp=10.0)
        (g,) = grads(out.sum(), x)
        assert torch.isfinite(out).all() and torch.isfinite(g).all(), (estimator, out, g)
        assert out.abs().max() <= 10.0


@given(masked_case(), st.sampled_from([0.0, 0.1, 2.0]))
def test_token_rewards_match_reference(case, kl_coef):
    B, R, mask, gen = case
    rewards, kl = randn(gen, B), randn(gen, B, R)
    torch.testing.assert_close(rlbits.token_rewards(rewards, mask), ref.token_rewards(rewards, mask), **F64)
    torch.testing.assert_close(
        rlbits.token_rewards(rewards, mask, kl=kl, kl_coef=kl_coef), ref.token_rewards(rewards, mask, kl, kl_coef), **F64
    )


@given(masked_case(max_len=12), st.sampled_from([1.0, 0.99, 0.5]), st.sampled_from([0.95, 1.0, 0.0, 0.3]))
def test_gae_matches_reference_loop(case, gamma, lam):
    B, R, mask, gen = case
    rewards, values = leaf(randn(gen, B, R)), leaf(randn(gen, B, R))
    adv, ret = rlbits.gae(rewards, values, mask, gamma=gamma, lam=lam)
    ref_adv, ref_ret = ref.gae(rewards, values, mask, gamma, lam)
    torch.testing.assert_close(adv, ref_adv, **F64)
    torch.testing.assert_close(ret, ref_ret, **F64)
    w = randn(gen, B, R)
    got = grads((adv * w).sum() + (ret * w).sum(), rewards, values)
    want = grads((ref_adv * w).sum() + (ref_ret * w).sum(), rewards, values)
    for g, h in zip(got, want, strict=False):
        torch.testing.assert_close(g if g is not None else torch.zeros_like(h), h if h is not None else torch.zeros_like(g), **F64)


@pytest.mark.parametrize("length", [1, 63, 64, 65, 200])
def test_gae_block_boundaries(length):
    """Lengths around the 64-token block of the blocked scan, in float32 against the float64 loop."""
    gen = torch.Generator().manual_seed(length)
    from strategies import make_mask

    mask = make_mask(3, length, "holes", gen)
    rewards, values = randn(gen, 3, length), randn(gen, 3, length)
    adv, ret = rlbits.gae(rewards.float(), values.float(), mask, gamma=0.99, lam=0.95)
    ref_adv, ref_ret = ref.gae(rewards, values, mask, 0.99, 0.95)
    assert adv.dtype == torch.float32
    torch.testing.assert_close(adv.double(), ref_adv, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(ret.double(), ref_ret, atol=1e-4, rtol=1e-4)


def test_gae_equals_torchrl_on_contiguous_masks():
    """On right-padded (contiguous) responses rlbits' GAE equals torchrl's, row by row."""
    from torchrl.objectives.value.functional import generalized_advantage_estimate

    gen = torch.Generator().manual_seed(0)
    B, R = 5, 17
    lengths = torch.tensor([17, 1, 9, 16, 4])
    mask = torch.arange(R)[None, :] < lengths[:, None]
    rewards, values = randn(gen, B, R), randn(gen, B, R)
    adv, _ = rlbits.gae(rewards, values, mask, gamma=0.98, lam=0.9)
    for b in range(B):
        n = int(lengths[b])
        v = values[b, :n, None]
        next_v = torch.cat([values[b, 1:n], torch.zeros(1, dtype=values.dtype)])[:, None]
        done = torch.zeros(n, 1, dtype=torch.bool)
        done[-1] = True
        tr_adv, _ = generalized_advantage_estimate(0.98, 0.9, v, next_v, rewards[b, :n, None], done, done)
        torch.testing.assert_close(adv[b, :n], tr_adv[:, 0].double(), **F32)  # torchrl works in float32
        assert (adv[b, n:] == 0).all()


# --- baselines -------------------------------------------------------------------------------------------


@given(st.integers(1, 4), st.integers(2, 5), st.integers(0, 10**6))
def test_group_baselines_match_reference(groups, k, seed):
    gen = torch.Generator().manual_seed(seed)
    rewards = randn(gen, groups * k)
    torch.testing.assert_close(rlbits.rloo_baseline(rewards, k), ref.rloo_baseline(rewards, k), **F64)
    for scale in (True, False):
        torch.testing.assert_close(
            rlbits.group_normalize(rewards, k, scale=scale), ref.group_normalize(rewards, k, scale=scale), **F64
        )


@given(st.integers(1, 4), st.integers(3, 6), st.booleans(), st.sampled_from([1e-6, 0.0, 0.1]), st.integers(0, 10**6))
def test_group_normalize_leave_one_out_matches_reference(groups, k, binary, eps, seed):
    """NeMo-RL's leave-one-out std: values and gradients against the loop, on real-valued rewards and on 0/1
    rewards (whose groups often have all-equal others, where the advantage is not divided)."""
    gen = torch.Generator().manual_seed(seed)
    raw = (torch.rand(groups * k, generator=gen) > 0.6).double() if binary else randn(gen, groups * k)
    rewards = leaf(raw)
    for scale in (True, False):
        got = rlbits.group_normalize(rewards, k, scale=scale, eps=eps, std="leave_one_out")
        want = ref.group_normalize(rewards, k, scale=scale, eps=eps, std="leave_one_out")
        torch.testing.assert_close(got, want, **F64)
        w = randn(gen, groups * k)
        (g,) = grads((got * w).sum(), rewards)
        (h,) = grads((want * w).sum(), rewards)
        assert torch.isfinite(g).all()
        torch.testing.assert_close(g, h, **F64)
    # scale=False is the RLOO advantage
    torch.testing.assert_close(
        rlbits.group_normalize(raw, k, scale=False, std="leave_one_out"), raw - rlbits.rloo_baseline(raw, k), **F64
    )
    # the default is unchanged by the keyword
    torch.testing.assert_close(rlbits.group_normalize(raw, k, std="group"), rlbits.group_normalize(raw, k), atol=0, rtol=0)


# --- losses ----------------------------------------------------------------------------------------------

AGGS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")


@given(
    masked_case(),
    st.sampled_from(AGGS),
    st.sampled_from([(0.2, None, None), (0.2, 0.28, None), (0.1, None, 3.0), (0.2, 0.3, 2.0)]),
    st.booleans(),
)
def test_ppo_loss_matches_reference(case, agg, clips, global_denominator):
    B, R, mask, gen = case
    clip_eps, clip_eps_high, dual_clip = clips
    old = randn(gen, B, R)
    logprobs = leaf(old + randn(gen, B, R, scale=0.3))  # ratios spread around 1, many clipped
    adv = randn(gen, B, R)
    num_tokens = 7 if global_denominator else None
    num_seqs = 3 if global_denominator else None
    loss, metrics = rlbits.ppo_loss(
        logprobs, old, adv, mask, clip_eps, clip_eps_high, dual_clip, agg, num_tokens=num_tokens, num_seqs=num_seqs
    )
    per_token = ref.ppo_per_token(logprobs, old, adv, mask, clip_eps, clip_eps_high, dual_clip)
    want = ref.aggregate(per_token, mask, agg, num_tokens, num_seqs)
    torch.testing.assert_close(loss, want, **F64)
    (g,) = grads(loss, logprobs)
    torch.testing.assert_close(g, grads(want, logprobs)[0] if want.requires_grad else torch.zeros_like(g), **F64)
    assert (g[~mask] == 0).all()
    ratio = torch.exp(logprobs - old).detach()
    hi = clip_eps if clip_eps_high is None else clip_eps_high
    clipped = ((adv > 0) & (ratio > 1 + hi)) | ((adv < 0) & (ratio < 1 - clip_eps))
    torch.testing.assert_close(metrics["clipfrac"], ref.masked_mean(clipped.double(), mask), **F64)
    torch.testing.assert_close(metrics["ratio_mean"], ref.masked_mean(ratio, mask), **F64)
    lr = (logprobs - old).detach()
    torch.testing.assert_close(metrics["approx_kl"], ref.masked_mean(torch.exp(lr) - 1 - lr, mask), **F64)
    assert all(not m.requires_grad and m.dim() == 0 for m in metrics.values())


@given(masked_case(), st.sampled_from(AGGS), st.sampled_from([None, 0.2]))
def test_value_loss_matches_reference(case, agg, clip_eps):
    B, R, mask, gen = case
    old, returns = randn(gen, B, R), randn(gen, B, R)
    values = leaf(old + randn(gen, B, R, scale=0.5))
    loss, metrics = rlbits.value_loss(values, old, returns, mask, clip_eps, agg)
    want = ref.aggregate(ref.value_per_token(values, old, returns, mask, clip_eps), mask, agg)
    torch.testing.assert_close(loss, want, **F64)
    torch.testing.assert_close(
        grads(loss, values)[0], grads(want, values)[0] if want.requires_grad else torch.zeros_like(values), **F64
    )
    if mask.sum() >= 2:
        ev = 1 - ref.masked_var(returns - values.detach(), mask) / ref.masked_var(returns, mask)
        torch.testing.assert_close(metrics["explained_variance"], ev, **F64)


@given(masked_case(), st.sampled_from(AGGS))
def test_reinforce_loss_matches_reference(case, agg):
    B, R, mask, gen = case
    logprobs, adv = leaf(randn(gen, B, R)), randn(gen, B, R)
    loss, _ = rlbits.reinforce_loss(logprobs, adv, mask, agg)
    per_token = torch.stack(
        [torch.stack([-float(adv[b, t]) * logprobs[b, t] for t in range(R)]) for b in range(B)]
    )
    want = ref.aggregate(per_token, mask, agg)
    torch.testing.assert_close(loss, want, **F64)
    torch.testing.assert_close(grads(loss, logprobs)[0], grads(want, logprobs)[0] if want.requires_grad else torch.zeros_like(logprobs), **F64)


def test_token_mean_with_global_count_is_microbatch_invariant():
    """Summing microbatch losses normalised by the global token count == the full-batch loss (and grads)."""
    gen = torch.Generator().manual_seed(4)
    from strategies import make_mask

    mask = make_mask(8, 10, "right", gen)
    old = randn(gen, 8, 10)
    logprobs = leaf(old + randn(gen, 8, 10, scale=0.3))
    adv = randn(gen, 8, 10)
    full, _ = rlbits.ppo_loss(logprobs, old, adv, mask)
    (g_full,) = grads(full, logprobs)
    n = int(mask.sum())
    total = sum(
        rlbits.ppo_loss(logprobs[i : i + 3], old[i : i + 3], adv[i : i + 3], mask[i : i + 3], num_tokens=n)[0]
        for i in range(0, 8, 3)
    )
    (g_micro,) = grads(total, logprobs)
    torch.testing.assert_close(total, full, **F64)
    torch.testing.assert_close(g_micro, g_full, **F64)


# --- ILQL --------------------------------------------------------------------------------------------------


@given(masked_case(), st.sampled_from([1.0, 0.9]))
def test_ilql_targets_match_reference(case, gamma):
    B, R, mask, gen = case
    rewards, values = randn(gen, B, R), randn(gen, B, R)
    torch.testing.assert_close(
        rlbits.ilql_targets(rewards, values, mask, gamma), ref.ilql_targets(rewards, values, mask, gamma), **F64
    )


@given(masked_case(), st.sampled_from([0.5, 0.7, 0.9]))
def test_ilql_losses_match_reference(case, tau):
    B, R, mask, gen = case
    V = 6
    q = leaf(randn(gen, B, R))
    targets = randn(gen, B, R)
    loss, _ = rlbits.q_loss(q, targets, mask)
    per_token = torch.stack([torch.stack([(q[b, t] - float(targets[b, t])) ** 2 if mask[b, t] else torch.zeros((), dtype=torch.float64) for t in range(R)]) for b in range(B)])
    want = ref.aggregate(per_token, mask, "token-mean")
    torch.testing.assert_close(loss, want, **F64)
    torch.testing.assert_close(grads(loss, q)[0], grads(want, q)[0] if want.requires_grad else torch.zeros_like(q), **F64)

    v = leaf(randn(gen, B, R))
    loss, _ = rlbits.expectile_loss(v, targets, mask, tau)
    want = ref.aggregate(ref.expectile_per_token(v, targets, mask, tau), mask, "token-mean")
    torch.testing.assert_close(loss, want, **F64)
    torch.testing.assert_close(grads(loss, v)[0], grads(want, v)[0] if want.requires_grad else torch.zeros_like(v), **F64)

    q_logits = leaf(randn(gen, B, R, V))
    actions = torch.randint(0, V, (B, R), generator=gen)
    for fn in (rlbits.cql_loss, rlbits.awac_loss):
        want = ref.aggregate(-ref.logprobs(q_logits, actions), mask, "token-mean")
        loss, _ = fn(q_logits, actions, mask)
        torch.testing.assert_close(loss, want, **F64)
        torch.testing.assert_close(grads(loss, q_logits)[0], grads(want, q_logits)[0] if want.requires_grad else torch.zeros_like(q_logits), **F64)


@given(masked_case(), st.sampled_from([0.0, 0.5, 1.0, -0.3]), st.booleans())
def test_awac_weighted_loss_matches_reference(case, beta, global_denominator):
    """trlx's AWAC weight exp(beta (Q - V)): a constant per token (no gradient into the advantages)."""
    B, R, mask, gen = case
    V = 5
    logits = leaf(randn(gen, B, R, V, scale=2.0))
    actions = torch.randint(0, V, (B, R), generator=gen)
    adv = leaf(randn(gen, B, R))
    adv_pad = torch.where(mask, adv, torch.tensor(float("inf"), dtype=adv.dtype))  # padding must not matter
    num_tokens = 11 if global_denominator else None
    loss, metrics = rlbits.awac_loss(logits, actions, mask, num_tokens, advantages=adv_pad, beta=beta)
    want = ref.aggregate(ref.awac_per_token(logits, actions, mask, adv, beta), mask, "token-mean", num_tokens)
    torch.testing.assert_close(loss, want, **F64)
    g_logits, g_adv = grads(loss, logits, adv)
    h = grads(want, logits)[0] if want.requires_grad else torch.zeros_like(logits)
    torch.testing.assert_close(g_logits, h, **F64)
    assert g_adv is None or (g_adv == 0).all()
    weights = torch.exp(beta * adv.detach())
    torch.testing.assert_close(metrics["awac_weight_mean"], ref.masked_mean(weights, mask), **F64)
    want_max = max((float(w) for w, m in zip(weights.reshape(-1), mask.reshape(-1), strict=True) if m), default=0.0)
    torch.testing.assert_close(metrics["awac_weight_max"], torch.tensor(want_max, dtype=torch.float64), **F64)
    assert all(not m.requires_grad and m.dim() == 0 for m in metrics.values())
    # beta = 0 (trlx's default) is today's unweighted NLL, with or without advantages
    plain, extra = rlbits.awac_loss(logits, actions, mask, num_tokens)
    assert extra == {}
    torch.testing.assert_close(rlbits.awac_loss(logits, actions, mask, num_tokens, advantages=adv, beta=0.0)[0], plain, **F64)


# --- float32 and bf16 inputs -----------------------------------------------------------------------------


@given(masked_case())
def test_float32_and_bf16_inputs_agree_with_float64(case):
    B, R, mask, gen = case
    a, b_, c = randn(gen, B, R), randn(gen, B, R), randn(gen, B, R)
    rewards = randn(gen, B)
    checks = [
        (lambda x, y, z: rlbits.masked_mean(x, mask), 1e-2),
        (lambda x, y, z: rlbits.kl_penalty(x, y, "k3"), 5e-2),
        (lambda x, y, z: rlbits.gae(x, y, mask, 1.0, 0.95)[0], 5e-2),
        (lambda x, y, z: rlbits.ppo_loss(x, y, z, mask)[0], 5e-2),
        (lambda x, y, z: rlbits.value_loss(x, y, z, mask, 0.2)[0], 5e-2),
        (lambda x, y, z: rlbits.ilql_targets(x, y, mask), 5e-2),
        (lambda x, y, z: rlbits.token_rewards(rewards.to(x.dtype), mask, kl=y, kl_coef=0.1), 5e-2),
    ]
    for fn, bf16_tol in checks:
        want = fn(a, b_, c)
        for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, bf16_tol)):
            got = fn(a.to(dtype), b_.to(dtype), c.to(dtype))
            assert got.dtype in (dtype, torch.float32)
            torch.testing.assert_close(got.double(), want, atol=tol * (1 + want.abs().max().item()), rtol=tol)


@given(masked_case(max_len=12), st.sampled_from([1.0, 0.99]), st.sampled_from([0.05, 0.3, 1.0, 5.0]))
def test_gae_per_row_lambda_matches_nemo_rl(case, gamma, alpha):
    """Length-adaptive (VAPO) lambdas per row: ``gae`` with a [B] ``lam`` against NeMo-RL's carry-forward loop."""
    from rlbits.functional.advantages import length_adaptive_lambda

    B, R, mask, gen = case
    rewards, values = randn(gen, B, R), randn(gen, B, R)
    lam = length_adaptive_lambda(mask, alpha)
    assert lam.dtype == torch.float32  # as NeMo-RL's ``mask.sum(dim=1).float()``
    torch.testing.assert_close(lam.double(), ref.length_adaptive_lambda(mask, alpha), atol=1e-6, rtol=1e-6)
    lam = lam.double()
    adv, ret = rlbits.gae(rewards, values, mask, gamma=gamma, lam=lam)
    ref_adv, ref_ret = ref.gae_nemo_rl(rewards, values, mask, gamma, lam)
    torch.testing.assert_close(adv, ref_adv, **F64)
    torch.testing.assert_close(ret, ref_ret, **F64)
    for b in range(B):  # a row's lambda gives that row what a scalar lambda gives it
        one, _ = rlbits.gae(rewards[b : b + 1], values[b : b + 1], mask[b : b + 1], gamma=gamma, lam=float(lam[b]))
        torch.testing.assert_close(adv[b : b + 1], one, **F64)


@pytest.mark.parametrize("length", [65, 200])
def test_gae_per_row_lambda_block_boundaries(length):
    gen = torch.Generator().manual_seed(length)
    from strategies import make_mask

    mask = make_mask(3, length, "holes", gen)
    rewards, values = randn(gen, 3, length), randn(gen, 3, length)
    lam = torch.tensor([0.0, 0.9, 0.99])
    adv, _ = rlbits.gae(rewards.float(), values.float(), mask, gamma=0.99, lam=lam)
    ref_adv, _ = ref.gae_nemo_rl(rewards, values, mask, 0.99, lam.double())
    torch.testing.assert_close(adv.double(), ref_adv, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="lam as a tensor"):
        rlbits.gae(rewards, values, mask, lam=torch.ones(4))


def _ref_positive_example_nll(curr_logprobs, mask, rewards):
    """NeMo-RL ``ClippedPGLossFn`` (loss_functions.py), the VAPO term re-written: rows with reward > 0, the
    masked mean of ``-logprobs`` over their tokens, 0 when there are none."""
    correct_mask = mask.to(torch.float64) * (rewards > 0).to(torch.float64).unsqueeze(-1)
    correct_valid_toks = correct_mask.sum()
    if correct_valid_toks > 0:
        return (-curr_logprobs * correct_mask).sum() / correct_valid_toks
    return torch.zeros((), dtype=torch.float64)


@given(masked_case(max_len=9))
def test_positive_example_nll_matches_nemo_rl(case):
    B, R, mask, gen = case
    logprobs = leaf(-randn(gen, B, R).abs())
    rewards = torch.where(randn(gen, B) > 0, 1.0, -0.5).to(torch.float64)
    rewards[0] = 0.0  # reward 0 is not positive
    got, metrics = rlbits.positive_example_nll_loss(logprobs, mask, rewards)
    want = _ref_positive_example_nll(logprobs, mask, rewards)
    torch.testing.assert_close(got, want, **F64)
    assert metrics["positive_tokens"] == (mask & (rewards > 0)[:, None]).sum()
    if want.requires_grad:
        for g, h in zip(grads(got, logprobs), grads(want, logprobs), strict=True):
            torch.testing.assert_close(g, h, **F64)
    none, _ = rlbits.positive_example_nll_loss(logprobs, mask, torch.zeros(B, dtype=torch.float64))
    assert none.item() == 0.0
    with pytest.raises(ValueError, match="rewards"):
        rlbits.positive_example_nll_loss(logprobs, mask, torch.zeros(B + 1))


@given(st.integers(1, 4), st.integers(2, 5), st.integers(0, 10**6))
def test_rloo_baseline_ended_matches_nemo_aligner(groups, k, seed):
    from rlbits.functional.advantages import rloo_baseline_ended

    gen = torch.Generator().manual_seed(seed)
    rewards = randn(gen, groups * k)
    is_end = torch.rand(groups * k, generator=gen) > 0.4
    prompts = torch.arange(groups).repeat_interleave(k)
    got = rloo_baseline_ended(rewards, is_end, k)
    torch.testing.assert_close(got, ref.aligner_rloo_baseline(prompts, rewards, is_end.double()), **F64)
    everyone = rloo_baseline_ended(rewards, torch.ones(groups * k, dtype=torch.bool), k)
    torch.testing.assert_close(everyone, rlbits.rloo_baseline(rewards, k), **F64)
    with pytest.raises(ValueError, match="is_end"):
        rloo_baseline_ended(rewards, is_end[:-1], k)
