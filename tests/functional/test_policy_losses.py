"""The policy losses of ``rlbits.POLICY_LOSSES`` against slow references that follow verl's ``core_algos.py``
(verl v0.9.0, commit 483b8a0 of verl-project/verl; its core_algos.py is unchanged up to 1dda039, 0.10.0.dev)
line by line, in Python loops over rows and tokens on float64 torch scalars: values and gradients."""

from __future__ import annotations

import math

import pytest
import torch

import rlbits
from rlbits.functional import policy_losses

B, T = 6, 7
AGGS = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
IMPLEMENTED = {
    "vanilla",
    "gspo",
    "cispo",
    "geo_mean",
    "sapo",
    "gpg",
    "dppo_tv",
    "dppo_kl",
    "dro",
    "clip_cov",
    "kl_cov",
}
# verl's registered loss modes that rlbits does not register; the module docstring says why.
NOT_REGISTERED = {"bypass_mode"}
HYPER = {
    "vanilla": {"clip_eps": 0.2, "clip_eps_high": 0.28, "clip_ratio_c": 1.3},
    "gspo": {"clip_eps": 0.03, "clip_eps_high": 0.04},
    "cispo": {"clip_eps": 0.2, "clip_eps_high": 0.25},
    "geo_mean": {"clip_eps": 0.2, "clip_eps_high": 0.3},
    "sapo": {"tau_pos": 1.0, "tau_neg": 1.05},
    "gpg": {},
    "dro": {"dro_beta": 0.7},
    # clip_cov_ratio 1: every candidate is detached, so no random draw decides the value (see the test below)
    "clip_cov": {
        "clip_eps": 0.2,
        "clip_eps_high": 0.28,
        "clip_cov_ratio": 1.0,
        "clip_cov_lb": 0.1,
        "clip_cov_ub": 1.0,
    },
    "kl_cov": {"kl_cov_ratio": 0.2, "ppo_kl_coef": 1.5},
    "dppo_tv": {"clip_eps": 0.05, "clip_eps_high": 0.08, "clip_ratio_c": 1.3},
    "dppo_kl": {"clip_eps": 0.003, "clip_eps_high": 0.01, "clip_ratio_c": 1.3},
}


def _inputs(seed=0):
    gen = torch.Generator().manual_seed(seed)
    mask = torch.rand(B, T, generator=gen) > 0.3
    mask[2] = False  # an empty row
    mask[4, 4:] = False  # right padding
    old = -2.0 * torch.rand(B, T, generator=gen) - 0.01
    new = (old + 0.4 * torch.randn(B, T, generator=gen)).clamp(max=-1e-3)
    adv = torch.randn(B, T, generator=gen)
    adv[0, :3] = 0.0  # sign(0) in geo_mean, A > 0 vs A <= 0 branches
    adv[3] = adv[3, 0]  # one row with a sequence-level advantage
    return new, old, adv, mask


# ---------------------------------------------------------------------------------------------------------
# references: verl's code, token by token
# ---------------------------------------------------------------------------------------------------------


def _agg_ref(mat, mask, mode, num_tokens=None, num_seqs=None):
    """verl's agg_loss with dp_size 1; its batch_num_tokens / global_batch_size are num_tokens / num_seqs."""
    zero = torch.zeros((), dtype=torch.float64)
    if mode == "token-mean":
        total, count = zero, 0
        for i in range(B):
            for t in range(T):
                total = total + mat[i][t] * float(mask[i, t])
                count += int(mask[i, t])
        return total / (count if num_tokens is None else num_tokens)
    if mode == "token-sum":
        total = zero
        for i in range(B):
            for t in range(T):
                total = total + mat[i][t] * float(mask[i, t])
        return total
    total, rows = zero, 0
    for i in range(B):
        n = int(mask[i].sum())
        row = zero
        for t in range(T):
            row = row + mat[i][t] * float(mask[i, t])
        if mode == "seq-mean-token-mean":
            row = row / (n + 1e-8)
        if n > 0:
            total = total + row
            rows += 1
    loss = total / (rows if num_seqs is None else num_seqs)
    return loss / T if mode == "seq-mean-token-sum-norm" else loss


def _t(x):
    return torch.as_tensor(x, dtype=torch.float64)


def ref_vanilla(lp, old, adv, mask, clip_eps, clip_eps_high, clip_ratio_c):
    mat = [[None] * T for _ in range(B)]
    for i in range(B):
        for t in range(T):
            nkl = torch.clamp(lp[i, t] - old[i, t], -20.0, 20.0)
            ratio = torch.exp(nkl)
            a = adv[i, t]
            l1 = -a * ratio
            l2 = -a * torch.clamp(ratio, 1 - clip_eps, 1 + clip_eps_high)
            c1 = torch.maximum(l1, l2)
            c2 = torch.minimum(-a * clip_ratio_c, c1)
            mat[i][t] = c2 if a < 0 else c1
    return mat


def ref_gspo(lp, old, adv, mask, clip_eps, clip_eps_high):
    mat = [[None] * T for _ in range(B)]
    for i in range(B):
        n = max(int(mask[i].sum()), 1)
        seq = sum((lp[i, t] - old[i, t]) * float(mask[i, t]) for t in range(T)) / n
        for t in range(T):
            log_s = torch.clamp(lp[i, t] - lp[i, t].detach() + seq.detach(), max=10.0)
            s = torch.exp(log_s)
            l1 = -adv[i, t] * s
            l2 = -adv[i, t] * torch.clamp(s, 1 - clip_eps, 1 + clip_eps_high)
            mat[i][t] = torch.maximum(l1, l2)
    return mat


def ref_cispo(lp, old, adv, mask, clip_eps, clip_eps_high):
    mat = [[None] * T for _ in range(B)]
    for i in range(B):
        for t in range(T):
            ratio = torch.exp(torch.clamp(lp[i, t] - old[i, t], -20.0, 20.0))
            w = torch.clamp(ratio, 1 - clip_eps, 1 + clip_eps_high).detach()
            mat[i][t] = -w * adv[i, t] * lp[i, t]
    return mat


def ref_sapo(lp, old, adv, mask, tau_pos, tau_neg):
    mat = [[None] * T for _ in range(B)]
    for i in range(B):
        for t in range(T):
            ratio = torch.exp(torch.clamp(lp[i, t] - old[i, t], -20.0, 20.0))
            tau = tau_pos if adv[i, t] > 0 else tau_neg
            gate = torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)
            mat[i][t] = -gate * adv[i, t]
    return mat


def ref_gpg(lp, old, adv, mask):
    return [[-lp[i, t] * adv[i, t] for t in range(T)] for i in range(B)]


def ref_dro(lp, old, adv, mask, dro_beta):
    mat = [[None] * T for _ in range(B)]
    for i in range(B):
        for t in range(T):
            log_ratio = lp[i, t] - old[i, t]
            mat[i][t] = -(lp[i, t] * adv[i, t] - 0.5 * dro_beta * log_ratio**2)
    return mat


def _masked_mean_ref(x, mask):
    vals = [x[i, t] for i in range(B) for t in range(T) if mask[i, t]]
    return sum(vals) / len(vals) if vals else 0.0


def _cov_ref(lp, adv, mask):
    mean_adv = _masked_mean_ref(adv, mask)
    mean_lp = _masked_mean_ref(lp.detach(), mask)
    return [
        [float((adv[i, t] - mean_adv) * (lp[i, t].detach() - mean_lp)) for t in range(T)] for i in range(B)
    ]


def ref_clip_cov(
    lp, old, adv, mask, clip_eps, clip_eps_high, clip_cov_ratio, clip_cov_lb, clip_cov_ub, keys=None
):
    """verl's clip_cov; ``keys`` (random, [B, T]) picks the subset when there are more candidates than
    clip_num: the candidates with the largest keys (rlbits' draw; verl draws with randperm)."""
    mat = [[None] * T for _ in range(B)]
    cov = _cov_ref(lp, adv, mask)
    candidates = []
    for i in range(B):
        for t in range(T):
            ratio = torch.exp(lp[i, t] - old[i, t])
            l1 = -adv[i, t] * ratio
            l2 = -adv[i, t] * torch.clamp(ratio, 1 - clip_eps, 1 + clip_eps_high)
            mat[i][t] = torch.maximum(l1, l2)
            clip_by_origin = bool(l2 > l1) and bool(mask[i, t])
            c = -math.inf if (not mask[i, t] or clip_by_origin) else cov[i][t]
            if clip_cov_lb < c < clip_cov_ub and mask[i, t]:
                candidates.append((i, t))
    clip_num = max(int(clip_cov_ratio * int(mask.sum())), 1)
    if len(candidates) > clip_num:
        candidates = sorted(candidates, key=lambda it: -float(keys[it]))[:clip_num]
    for i, t in candidates:
        mat[i][t] = mat[i][t] * 0.0
    return mat


def ref_kl_cov(lp, old, adv, mask, kl_cov_ratio, ppo_kl_coef):
    mat = [[None] * T for _ in range(B)]
    for i in range(B):
        for t in range(T):
            mat[i][t] = -adv[i, t] * torch.exp(lp[i, t] - old[i, t])
    cov = _cov_ref(lp, adv, mask)
    valid = [(i, t) for i in range(B) for t in range(T) if mask[i, t]]
    if valid:
        k = max(1, int(len(valid) * kl_cov_ratio))
        for i, t in sorted(valid, key=lambda it: -cov[it[0]][it[1]])[:k]:
            log_ratio = lp[i, t] - old[i, t]
            mat[i][t] = -adv[i, t] * torch.exp(log_ratio) + ppo_kl_coef * log_ratio.abs()
    return mat


def _ref_dppo(lp, old, adv, clip_ratio_c, keep):
    mat = [[None] * T for _ in range(B)]
    for i in range(B):
        for t in range(T):
            ratio = torch.exp(torch.clamp(lp[i, t] - old[i, t], -20.0, 20.0))
            w = torch.clamp(ratio, max=clip_ratio_c).detach()
            valid = float(keep(i, t))
            mat[i][t] = -adv[i, t] * w * lp[i, t] * valid
    return mat


def ref_dppo_tv(lp, old, adv, mask, clip_eps, clip_eps_high, clip_ratio_c):
    def keep(i, t):
        d = math.exp(float(lp[i, t].detach())) - math.exp(float(old[i, t]))
        return d <= clip_eps_high if adv[i, t] > 0 else d >= -clip_eps

    return _ref_dppo(lp, old, adv, clip_ratio_c, keep)


def ref_dppo_kl(lp, old, adv, mask, clip_eps, clip_eps_high, clip_ratio_c):
    def keep(i, t):
        p, q = math.exp(float(lp[i, t].detach())), math.exp(float(old[i, t]))
        kl = q * (float(old[i, t]) - float(lp[i, t].detach())) + (1 - q) * math.log(
            (1 - q + 1e-8) / (1 - p + 1e-8)
        )
        if adv[i, t] > 0:
            return kl <= clip_eps_high or p <= q
        return kl <= clip_eps or p >= q

    return _ref_dppo(lp, old, adv, clip_ratio_c, keep)


def ref_geo_mean(lp, old, adv, mask, clip_eps, clip_eps_high):
    """verl's value: the mean over all B rows (empty rows contribute 0)."""
    total = torch.zeros((), dtype=torch.float64)
    for i in range(B):
        n = float(mask[i].sum())
        log_sum, adv_sum = torch.zeros((), dtype=torch.float64), torch.zeros((), dtype=torch.float64)
        for t in range(T):
            d = lp[i, t] - old[i, t]
            sgn = torch.sign(adv[i, t])
            d_clamp = torch.clamp(d, -clip_eps, clip_eps_high)
            d_min = sgn * torch.minimum(sgn * d, sgn * d_clamp)
            log_sum = log_sum + d_min * float(mask[i, t])
            adv_sum = adv_sum + adv[i, t] * float(mask[i, t])
        ratio = torch.exp(log_sum / (n + 1e-8))
        total = total - adv_sum / (n + 1e-8) * ratio
    return total / B


TOKEN_REFS = {
    "vanilla": ref_vanilla,
    "gspo": ref_gspo,
    "cispo": ref_cispo,
    "sapo": ref_sapo,
    "gpg": ref_gpg,
    "dro": ref_dro,
    "clip_cov": ref_clip_cov,
    "kl_cov": ref_kl_cov,
    "dppo_tv": ref_dppo_tv,
    "dppo_kl": ref_dppo_kl,
}


def _reference(name, new, old, adv, mask, agg, num_tokens=None, num_seqs=None):
    lp = new.double().requires_grad_(True)
    args = (lp, old.double(), adv.double(), mask)
    if name == "geo_mean":
        nonempty = int((mask.sum(dim=1) > 0).sum())
        value = ref_geo_mean(*args, **HYPER[name]) * B / (nonempty if num_seqs is None else num_seqs)
    else:
        value = _agg_ref(TOKEN_REFS[name](*args, **HYPER[name]), mask, agg, num_tokens, num_seqs)
    (grad,) = torch.autograd.grad(value, lp)
    return value.detach(), grad


def _close(actual, expected):
    torch.testing.assert_close(actual.double(), expected.double(), rtol=1e-5, atol=1e-7)


# ---------------------------------------------------------------------------------------------------------
# tests
# ---------------------------------------------------------------------------------------------------------


def test_registry_names():
    assert set(rlbits.POLICY_LOSSES) == IMPLEMENTED
    assert rlbits.POLICY_LOSSES is policy_losses.POLICY_LOSSES
    doc = policy_losses.__doc__
    for name in NOT_REGISTERED:
        assert f"``{name}``" in doc, f"{name}: the module docstring must say why it is not registered"


@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize("name", sorted(IMPLEMENTED))
@pytest.mark.parametrize("seed", [0, 1])
def test_matches_verl_reference(name, agg, seed):
    new, old, adv, mask = _inputs(seed)
    new = new.clone().requires_grad_(True)
    loss, metrics = rlbits.POLICY_LOSSES[name](new, old, adv, mask, agg=agg, **HYPER[name])
    (grad,) = torch.autograd.grad(loss, new)
    ref_value, ref_grad = _reference(name, new.detach(), old, adv, mask, agg)
    _close(loss, ref_value)
    _close(grad, ref_grad)
    assert loss.dtype == torch.float32
    assert all(not v.requires_grad and v.dim() == 0 and torch.isfinite(v) for v in metrics.values())
    assert {"approx_kl", "ratio_mean"} <= set(metrics)


@pytest.mark.parametrize("name", sorted(IMPLEMENTED))
def test_global_denominators(name):
    new, old, adv, mask = _inputs(2)
    new = new.clone().requires_grad_(True)
    for agg in AGGS:
        loss, _ = rlbits.POLICY_LOSSES[name](
            new, old, adv, mask, agg=agg, num_tokens=50, num_seqs=9, **HYPER[name]
        )
        (grad,) = torch.autograd.grad(loss, new)
        ref_value, ref_grad = _reference(name, new.detach(), old, adv, mask, agg, num_tokens=50, num_seqs=9)
        _close(loss, ref_value)
        _close(grad, ref_grad)


@pytest.mark.parametrize("name", sorted(IMPLEMENTED))
def test_padding_values_do_not_leak(name):
    new, old, adv, mask = _inputs(3)
    fn = rlbits.POLICY_LOSSES[name]
    poisoned = new.masked_fill(~mask, float("inf")).requires_grad_(True)
    clean = new.clone().requires_grad_(True)
    loss_p, _ = fn(poisoned, old.masked_fill(~mask, -float("inf")), adv, mask, **HYPER[name])
    loss_c, _ = fn(clean, old, adv, mask, **HYPER[name])
    (g_p,) = torch.autograd.grad(loss_p, poisoned)
    (g_c,) = torch.autograd.grad(loss_c, clean)
    _close(loss_p, loss_c)
    assert torch.isfinite(g_p).all()
    _close(g_p, g_c)


@pytest.mark.parametrize("name", sorted(IMPLEMENTED))
def test_all_masked_batch_gives_zero(name):
    new, old, adv, _ = _inputs(0)
    new = new.clone().requires_grad_(True)
    loss, metrics = rlbits.POLICY_LOSSES[name](
        new, old, adv, torch.zeros(B, T, dtype=torch.bool), **HYPER[name]
    )
    (grad,) = torch.autograd.grad(loss, new)
    assert loss.item() == 0.0 and (grad == 0).all()
    assert all(torch.isfinite(v) for v in metrics.values())


@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize("dual", [None, 3.0])
def test_vanilla_is_ppo_loss(agg, dual):
    new, old, adv, mask = _inputs(4)
    kwargs = {"clip_eps": 0.2, "clip_eps_high": 0.28, "agg": agg}
    a, ma = rlbits.POLICY_LOSSES["vanilla"](new, old, adv, mask, clip_ratio_c=dual, **kwargs)
    b, mb = rlbits.ppo_loss(new, old, adv, mask, dual_clip=dual, **kwargs)
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert ma.keys() == mb.keys()
    for k in ma:
        torch.testing.assert_close(ma[k], mb[k], rtol=0, atol=0)


def test_gspo_ratio_is_the_sequence_mean():
    new, old, adv, mask = _inputs(5)
    _, metrics = rlbits.gspo_loss(new, old, adv, mask)
    rows = mask.sum(1) > 0
    n = mask.sum(1).clamp(min=1)
    s = torch.exp(((new - old) * mask).sum(1) / n)
    expected = (s * mask.sum(1))[rows].sum() / mask.sum()  # the token-weighted mean of s_i
    torch.testing.assert_close(metrics["ratio_mean"], expected)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_clip_cov_detaches_a_random_subset_of_the_candidates(seed):
    new, old, adv, mask = _inputs(seed)
    hyper = {"clip_eps": 0.2, "clip_cov_ratio": 0.1, "clip_cov_lb": 0.0, "clip_cov_ub": 5.0}
    leaf = new.clone().requires_grad_(True)
    loss, metrics = rlbits.clip_cov_loss(
        leaf, old, adv, mask, generator=torch.Generator().manual_seed(7), **hyper
    )
    (grad,) = torch.autograd.grad(loss, leaf)
    keys = torch.rand(B, T, generator=torch.Generator().manual_seed(7))
    lp = new.double().requires_grad_(True)
    ref = _agg_ref(
        ref_clip_cov(lp, old.double(), adv.double(), mask, clip_eps_high=0.2, keys=keys, **hyper),
        mask,
        "token-mean",
    )
    (ref_grad,) = torch.autograd.grad(ref, lp)
    _close(loss, ref)
    _close(grad, ref_grad)
    clip_num = max(int(0.1 * int(mask.sum())), 1)
    torch.testing.assert_close(metrics["clipfrac"], torch.tensor(clip_num / int(mask.sum())))


def test_geo_mean_ignores_agg():
    new, old, adv, mask = _inputs(6)
    values = [rlbits.geo_mean_loss(new, old, adv, mask, agg=agg)[0] for agg in AGGS]
    for v in values[1:]:
        torch.testing.assert_close(v, values[0], rtol=0, atol=0)


def test_seq_mean_token_sum_norm_aggregation():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, generator=gen)
    mask = torch.tensor([[1, 1, 0, 1, 0], [0, 0, 0, 0, 0], [1, 0, 1, 1, 1]], dtype=torch.bool)
    mask[1] = False  # an empty row: left out of the row mean
    out = rlbits.aggregate_loss(x, mask, "seq-mean-token-sum-norm")
    torch.testing.assert_close(out, (x * mask).sum() / 2 / 5)
    out = rlbits.aggregate_loss(x, mask, "seq-mean-token-sum-norm", num_seqs=4, loss_scale_factor=128)
    torch.testing.assert_close(out, (x * mask).sum() / 4 / 128)


def test_token_sum_aggregation():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, generator=gen)
    mask = torch.tensor([[1, 1, 0, 1, 0], [0, 0, 0, 0, 0], [1, 0, 1, 1, 1]], dtype=torch.bool)
    for kwargs in ({}, {"num_tokens": 50, "num_seqs": 9}):  # no denominator: the counts are ignored
        torch.testing.assert_close(rlbits.aggregate_loss(x, mask, "token-sum", **kwargs), (x * mask).sum())


@pytest.mark.parametrize(
    ("name", "bad"),
    [
        ("vanilla", {"clip_ratio_c": 1.0}),
        ("gspo", {"clip_eps": -0.1}),
        ("cispo", {"clip_eps_high": -1.0}),
        ("sapo", {"tau_pos": 0.0}),
        ("dppo_tv", {"clip_ratio_c": 0.0}),
        ("gpg", {"agg": "sum"}),
        ("dro", {}),
        ("dro", {"dro_beta": 0.0}),
        ("clip_cov", {"clip_cov_ratio": 0.0}),
        ("kl_cov", {"kl_cov_ratio": -1.0}),
    ],
)
def test_bad_hyperparameters_raise(name, bad):
    new, old, adv, mask = _inputs(0)
    with pytest.raises(ValueError):
        rlbits.POLICY_LOSSES[name](new, old, adv, mask, **bad)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(IMPLEMENTED))
def test_compiled_matches_eager(name):
    new, old, adv, mask = _inputs(7)
    fn = rlbits.POLICY_LOSSES[name]
    compiled = torch.compile(fn, fullgraph=True)
    leaf_e = new.clone().requires_grad_(True)
    leaf_c = new.clone().requires_grad_(True)
    loss_e, m_e = fn(leaf_e, old, adv, mask, agg="seq-mean-token-mean", num_tokens=30, **HYPER[name])
    loss_c, m_c = compiled(leaf_c, old, adv, mask, agg="seq-mean-token-mean", num_tokens=30, **HYPER[name])
    torch.testing.assert_close(loss_c, loss_e, rtol=1e-5, atol=1e-6)
    assert m_c.keys() == m_e.keys()
    for k in m_e:
        torch.testing.assert_close(m_c[k], m_e[k], rtol=1e-5, atol=1e-6)
    (g_e,) = torch.autograd.grad(loss_e, leaf_e)
    (g_c,) = torch.autograd.grad(loss_c, leaf_c)
    torch.testing.assert_close(g_c, g_e, rtol=1e-5, atol=1e-6)
