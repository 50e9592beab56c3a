"""The rollout corrections of ``rlbits.functional.rollout_correction`` against references that follow the
peers' code line by line, on float64 tensors with padding (holding garbage) and empty rows:

- verl v0.9.0 (commit 483b8a0) ``verl/trainer/ppo/rollout_corr_helper.py``: ``compute_rollout_correction_weights``,
  ``compute_is_metrics``, ``compute_rollout_rejection_mask``, ``compute_rs_metrics``,
  ``compute_offpolicy_metrics``;
- NeMo-RL (NVIDIA-NeMo/RL 7ea279a) ``nemo_rl/algorithms/loss/loss_functions.py``, ``ClippedPGLossFn.__call__``'s
  truncated importance sampling block (``tis``, ``icepop``, ``seq-mask-tis``);
- AReaL v0.5.3 ``areal/utils/functional/functional.py`` ``ppo_actor_loss_fn`` (token level, decoupled loss with
  ``behav_imp_weight_cap``).

verl averages its row statistics over all B rows (empty rows count with a zero statistic); rlbits leaves empty
rows out, so the metric references run on the batch without its empty rows (the adjusted value the module
docstring names), while weights and masks are compared on the whole batch."""

from __future__ import annotations

import math

import pytest
import torch

import rlbits
from rlbits.functional import rollout_correction as rc

B, T = 7, 9
SAFETY = 20.0


def _inputs(seed=0, spread=0.3):
    gen = torch.Generator().manual_seed(seed)
    mask = torch.rand(B, T, generator=gen) > 0.25
    mask[2] = False  # an empty row
    mask[4, 5:] = False  # right padding
    mask[5, :] = False
    mask[5, 0] = True  # a one-token row
    rollout = -3.0 * torch.rand(B, T, generator=gen, dtype=torch.float64) - 0.01
    old = rollout + spread * torch.randn(B, T, generator=gen, dtype=torch.float64)
    old[6] = rollout[6] + 0.0005 * torch.randn(T, generator=gen, dtype=torch.float64)  # a row near r = 1
    old = old.masked_fill(~mask, 7.0)  # padding garbage (finite, so verl's x * mask stays defined)
    rollout = rollout.masked_fill(~mask, -9.0)
    return old, rollout, mask


def _close(actual, expected, name=""):
    torch.testing.assert_close(
        torch.as_tensor(actual, dtype=torch.float64), torch.as_tensor(expected, dtype=torch.float64),
        rtol=1e-5, atol=1e-7, msg=lambda m: f"{name}: {m}",
    )


# ---------------------------------------------------------------------------------------------------------
# verl's helpers (verl.utils.torch_functional)
# ---------------------------------------------------------------------------------------------------------


def v_masked_sum(x, mask, axis=None):
    return (x * mask).sum(axis) if axis is not None else (x * mask).sum()


def v_masked_mean(x, mask, axis=None):
    s = v_masked_sum(x, mask, axis)
    return s / (mask.sum(axis) + 1e-8) if axis is not None else s / (mask.sum() + 1e-8)


# ---------------------------------------------------------------------------------------------------------
# verl references
# ---------------------------------------------------------------------------------------------------------


def verl_weights(log_ratio, mask, rollout_is, upper, lower=None):
    """compute_rollout_correction_weights (no batch normalisation): weights, raw, log_ratio_for_metrics."""
    m = mask.double()
    if rollout_is == "token":
        lr_metrics = log_ratio
        raw = torch.exp(torch.clamp(log_ratio, min=-SAFETY, max=SAFETY))
    else:
        lr_sum = v_masked_sum(log_ratio, m, axis=-1).unsqueeze(-1)
        lr_metrics = lr_sum
        raw = torch.exp(torch.clamp(lr_sum, min=-SAFETY, max=SAFETY)).expand_as(log_ratio)
    raw = raw * m
    if lower is None:
        w = raw.clamp(max=upper)
    else:
        kept = (raw >= lower) & (raw <= upper)
        w = torch.where(kept, raw, torch.zeros_like(raw))
    return w, raw, lr_metrics


def verl_is_metrics(w, raw, lr_metrics, mask, rollout_is, upper, lower=None):
    """compute_is_metrics."""
    m = mask.double()
    out = {}
    lower = 1.0 / upper if lower is None else lower
    log_up, log_low = math.log(upper), math.log(lower)
    if rollout_is == "sequence":
        out["rollout_is_max"] = math.exp(min(float(lr_metrics.max()), SAFETY))
        out["rollout_is_min"] = math.exp(float(lr_metrics.min()))
        out["rollout_is_mean"] = float(v_masked_mean(w, m))
        out["rollout_is_ratio_fraction_high"] = float((lr_metrics > log_up).double().mean())
        out["rollout_is_ratio_fraction_low"] = float((lr_metrics < log_low).double().mean())
    else:
        out["rollout_is_mean"] = float(v_masked_mean(w, m))
        out["rollout_is_ratio_fraction_high"] = float(v_masked_mean((raw > upper).double(), m))
        out["rollout_is_ratio_fraction_low"] = float(v_masked_mean((raw < lower).double(), m))
        out["rollout_is_max"] = float(w.masked_fill(~mask, float("-inf")).max())
        out["rollout_is_min"] = float(w.masked_fill(~mask, float("inf")).min())
    if m.sum() > 1:
        ws = w.clamp(min=0.0, max=upper)
        mean = v_masked_mean(ws, m)
        var = v_masked_mean(ws.square(), m) - mean.square()
        out["rollout_is_std"] = float(torch.sqrt(torch.clamp(var, min=0.0)))
    else:
        out["rollout_is_std"] = 0.0
    we = w.clamp(min=0.0, max=upper)
    mean_e = v_masked_mean(we, m)
    out["rollout_is_eff_sample_size"] = 1.0 / float(v_masked_mean((we / (mean_e + 1e-8)).square(), m))
    seq = v_masked_mean(w, m, axis=-1)
    out["rollout_is_seq_mean"] = float(seq.mean())
    out["rollout_is_seq_std"] = float(seq.std()) if seq.numel() > 1 else 0.0
    out["rollout_is_seq_max"] = float(seq.max())
    out["rollout_is_seq_min"] = float(seq.min())
    out["rollout_is_seq_max_deviation"] = float((seq - 1.0).abs().max())
    raw_seq = v_masked_mean(raw, m, axis=-1)
    out["rollout_is_seq_fraction_high"] = float((raw_seq > upper).double().mean())
    out["rollout_is_seq_fraction_low"] = float((raw_seq < lower).double().mean())
    return out


def verl_reject(log_ratio, mask, option, spec):
    """compute_rollout_rejection_mask + compute_rs_metrics for one option; ``spec`` verl's threshold string."""
    m = mask.double()
    is_k1 = option.endswith("k1")
    if is_k1:
        if "_" in spec:
            lo_s, up_s = spec.split("_", 1)
        else:
            up_s, lo_s = spec, str(1.0 / float(spec))
        lower_log, upper_log = math.log(float(lo_s)), math.log(float(up_s))
        upper_value = float(up_s)
    else:
        upper_value = float(spec)
    lrs = torch.clamp(log_ratio, min=-SAFETY, max=SAFETY)
    stats = {"k1": -lrs, "k2": 0.5 * lrs**2, "k3": torch.exp(lrs) - 1.0 - lrs}
    tok = stats[option[-2:]]
    seq_valid = mask.sum(-1) > 0
    per_seq = None
    if option.startswith("token"):
        per_token = tok
        keep = (tok >= lower_log) & (tok <= upper_log) if is_k1 else tok <= upper_value
        level = "token"
    else:
        if option.startswith("seq_sum"):
            seq = v_masked_sum(tok, m, axis=-1)
        elif option.startswith("seq_mean"):
            seq = v_masked_mean(tok, m, axis=-1)
        else:
            mx = tok.masked_fill(~mask, float("-inf")).max(dim=-1).values
            seq = torch.where(mx == float("-inf"), torch.zeros_like(mx), mx)
        sk = (seq >= lower_log) & (seq <= upper_log) if is_k1 else seq <= upper_value
        keep = sk.unsqueeze(-1).expand_as(mask)
        per_token = seq.unsqueeze(-1).expand_as(m)
        per_seq = seq
        level = "sequence"
    up_thr = upper_log if is_k1 else upper_value
    low_thr = lower_log if is_k1 else 0.0
    p = f"rollout_rs_{option}"
    out = {f"{p}_mean": float(v_masked_mean(per_token, m))}
    seq_vals = (per_seq if per_seq is not None else v_masked_mean(per_token, m, axis=-1))[seq_valid]
    if level == "sequence":
        out[f"{p}_max"], out[f"{p}_min"] = float(seq_vals.max()), float(seq_vals.min())
        out[f"{p}_fraction_high"] = float((seq_vals > up_thr).double().mean())
        out[f"{p}_fraction_low"] = float((seq_vals < low_thr).double().mean()) if is_k1 else 0.0
    else:
        out[f"{p}_max"] = float(per_token.masked_fill(~mask, float("-inf")).max())
        out[f"{p}_min"] = float(per_token.masked_fill(~mask, float("inf")).min())
        out[f"{p}_fraction_high"] = float(v_masked_mean((per_token > up_thr).double(), m))
        out[f"{p}_fraction_low"] = float(v_masked_mean((per_token < low_thr).double(), m)) if is_k1 else 0.0
    keep_f = keep.double()
    seq_keep = (~((~keep) & mask)).all(dim=-1)
    out[f"{p}_masked_fraction"] = float(v_masked_mean(1 - keep_f, m))
    valid = seq_valid.double()
    out[f"{p}_seq_masked_fraction"] = float(((1.0 - seq_keep.double()) * valid).sum() / valid.sum())
    out["rollout_rs_masked_fraction"] = float(v_masked_mean(1 - keep_f, m))
    final_keep = (keep_f > 0.5) & mask
    out["rollout_rs_seq_masked_fraction"] = float((~final_keep & mask).any(dim=-1).double().mean())
    return (m * keep_f).bool(), out


def verl_offpolicy(old, rollout, mask):
    """compute_offpolicy_metrics."""
    m = mask.double()
    out = {}
    mlt = v_masked_mean(old, m, axis=-1)
    out["training_ppl"] = float(torch.exp(-mlt).mean())
    out["training_log_ppl"] = float((-mlt).mean())
    out["kl"] = float(v_masked_mean(rollout - old, m))
    lr = old - rollout
    out["k3_kl"] = float(v_masked_mean(torch.exp(lr) - lr - 1, m))
    mlr = v_masked_mean(rollout, m, axis=-1)
    out["rollout_ppl"] = float(torch.exp(-mlr).mean())
    out["rollout_log_ppl"] = float((-mlr).mean())
    d = mlr - mlt
    out["log_ppl_diff"] = float(d.mean())
    out["log_ppl_abs_diff"] = float(d.abs().mean())
    out["log_ppl_diff_max"] = float(d.max())
    out["log_ppl_diff_min"] = float(d.min())
    out["ppl_ratio"] = float(torch.exp(d).mean())
    rho = torch.exp(torch.clamp(lr, min=-SAFETY, max=SAFETY))
    out["chi2_token"] = float(v_masked_mean(rho.square(), m) - 1.0)
    s = torch.clamp(v_masked_sum(lr, m, axis=-1), min=-SAFETY, max=SAFETY)
    out["chi2_seq"] = float(torch.exp(2.0 * s).mean() - 1.0)
    return out


def _nonempty(old, rollout, mask):
    rows = mask.any(-1)
    return old[rows], rollout[rows], mask[rows]


def _check_metrics(metrics, expected):
    for key, value in expected.items():
        assert key in metrics, f"{key} missing"
        _close(metrics[key], value, key)


def _common(metrics, old, rollout, mask):
    _check_metrics(metrics, verl_offpolicy(*_nonempty(old, rollout, mask)))
    assert all(not v.requires_grad and v.dim() == 0 and torch.isfinite(v) for v in metrics.values())


# ---------------------------------------------------------------------------------------------------------
# verl: TIS, IcePop, MIS, rejection sampling, Geo-RS
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("threshold", [1.2, 2.0])
def test_tis_matches_verl(seed, level, threshold):
    old, rollout, mask = _inputs(seed)
    w, out_mask, metrics = rc.truncated_is(old, rollout, mask, level=level, threshold=threshold)
    ref_w, _, _ = verl_weights(old - rollout, mask, level, threshold)
    _close(w, ref_w, "weights")
    assert torch.equal(out_mask, mask)
    o, r, m = _nonempty(old, rollout, mask)
    rw, raw, lrm = verl_weights(o - r, m, level, threshold)
    _check_metrics(metrics, verl_is_metrics(rw, raw, lrm, m, level, threshold))
    _common(metrics, old, rollout, mask)


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_icepop_matches_verl(level):
    old, rollout, mask = _inputs(2)
    w, out_mask, metrics = rc.icepop(old, rollout, mask, level=level, threshold=1.3, threshold_low=0.8)
    ref_w, raw, _ = verl_weights(old - rollout, mask, level, 1.3, 0.8)
    _close(w, ref_w, "weights")
    assert torch.equal(out_mask, mask), "IcePop zeroes weights; verl keeps response_mask"
    assert (w[mask] == 0).any() and (w[mask] > 0).any()
    o, r, m = _nonempty(old, rollout, mask)
    rw, rraw, lrm = verl_weights(o - r, m, level, 1.3, 0.8)
    expected = verl_is_metrics(rw, rraw, lrm, m, level, 1.3, 0.8)
    oob = (rraw < 0.8) | (rraw > 1.3)
    expected["rollout_is_oob_ratio"] = float(v_masked_mean(oob.double(), m.double()))
    _check_metrics(metrics, expected)
    _common(metrics, old, rollout, mask)


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_mis_matches_verl(level):
    """verl's Seq-MIS preset (rollout_is=sequence + rollout_rs=seq_sum_k1) and its token form."""
    old, rollout, mask = _inputs(3, spread=0.15)
    threshold = 1.1 if level == "token" else 1.3
    w, out_mask, metrics = rc.masked_is(old, rollout, mask, level=level, threshold=threshold)
    ref_w, _, _ = verl_weights(old - rollout, mask, level, threshold)
    option = "token_k1" if level == "token" else "seq_sum_k1"
    ref_mask, _ = verl_reject(old - rollout, mask, option, f"{1 / threshold}_{threshold}")
    _close(w, ref_w, "weights")
    assert torch.equal(out_mask, ref_mask)
    assert out_mask.sum() < mask.sum(), "the inputs must reject something"
    o, r, m = _nonempty(old, rollout, mask)
    rw, raw, lrm = verl_weights(o - r, m, level, threshold)
    _, rs = verl_reject(o - r, m, option, f"{1 / threshold}_{threshold}")
    _check_metrics(metrics, {**verl_is_metrics(rw, raw, lrm, m, level, threshold), **rs})
    _common(metrics, old, rollout, mask)


@pytest.mark.parametrize("option", rc.RS_OPTIONS)
def test_rejection_matches_verl(option):
    old, rollout, mask = _inputs(4, spread=0.2)
    if option.endswith("k1"):
        threshold, low = (1.25, 0.7) if option.startswith("token") else (1.05, 0.9)
        if option.startswith("seq_sum"):
            threshold, low = 1.3, 0.8
        spec = f"{1 / threshold}_{1 / low}"  # verl bounds -log r: the same band of r
        kwargs = {"threshold": threshold, "threshold_low": low}
    else:
        threshold = {"token": 0.02, "seq_sum": 0.1, "seq_mean": 0.015, "seq_max": 0.05}[option.rsplit("_", 1)[0]]
        spec = str(threshold)
        kwargs = {"threshold": threshold}
    w, out_mask, metrics = rc.rejection_mask(old, rollout, mask, level=option, **kwargs)
    ref_mask, _ = verl_reject(old - rollout, mask, option, spec)
    assert torch.equal(out_mask, ref_mask)
    assert 0 < out_mask.sum() < mask.sum(), "the inputs must reject some tokens, not all"
    _close(w, mask.double(), "weights")
    o, r, m = _nonempty(old, rollout, mask)
    _, expected = verl_reject(o - r, m, option, spec)
    _check_metrics(metrics, expected)
    _common(metrics, old, rollout, mask)


def test_geo_rs_is_verl_preset():
    """verl's decoupled_geo_rs: rollout_rs=seq_mean_k1, rollout_rs_threshold="0.999_1.001" (a symmetric band
    up to rounding: verl keeps r in [1/1.001, 1/0.999])."""
    old, rollout, mask = _inputs(5, spread=0.002)
    w, out_mask, metrics = rc.geo_mean_mask(old, rollout, mask, threshold=1 / 0.999, threshold_low=1 / 1.001)
    ref_mask, _ = verl_reject(old - rollout, mask, "seq_mean_k1", "0.999_1.001")
    assert torch.equal(out_mask, ref_mask)
    assert 0 < out_mask.sum() < mask.sum()
    o, r, m = _nonempty(old, rollout, mask)
    _check_metrics(metrics, verl_reject(o - r, m, "seq_mean_k1", "0.999_1.001")[1])
    _common(metrics, old, rollout, mask)


def test_k1_single_threshold_is_symmetric_as_verl():
    old, rollout, mask = _inputs(6, spread=0.2)
    _, out_mask, _ = rc.rejection_mask(old, rollout, mask, level="token_k1", threshold=1.3)
    assert torch.equal(out_mask, verl_reject(old - rollout, mask, "token_k1", "1.3")[0])


# ---------------------------------------------------------------------------------------------------------
# NeMo-RL: tis (with a lower clamp), icepop, seq-mask-tis
# ---------------------------------------------------------------------------------------------------------


def n_masked_mean(values, mask, dim=None):
    """nemo_rl.algorithms.utils.masked_mean without a global factor."""
    return torch.sum(values * mask, dim=dim) / (torch.sum(mask, dim=dim) + 1e-8)


def nemo_weights(prev, gen, token_mask, kind, ratio, ratio_min):
    """ClippedPGLossFn's token-level actor importance weights after its truncation block, and is_oob_ratio."""
    sample_mask = torch.ones(prev.shape[0], dtype=prev.dtype)
    mask = token_mask * sample_mask.unsqueeze(-1)
    w = torch.nan_to_num(torch.exp(prev - gen), nan=0.0, posinf=0.0, neginf=0.0)
    if kind == "tis":
        tis_min = 0.0 if ratio_min is None else ratio_min
        oob = (w > ratio) | (w < tis_min)
        metric = n_masked_mean(oob.double(), mask)
        w = torch.clamp(w, min=tis_min, max=ratio)
    elif kind == "icepop":
        kept = (w >= ratio_min) & (w <= ratio)
        metric = n_masked_mean((~kept).double(), mask)
        w = torch.where(kept, w, torch.zeros_like(w))
    else:
        log_is = torch.nan_to_num(prev - gen, nan=0.0, posinf=0.0, neginf=0.0)
        geo = torch.exp(n_masked_mean(log_is, token_mask, dim=-1))
        seq_kept = ((geo >= ratio_min) & (geo <= ratio)).double()
        metric = n_masked_mean(1.0 - seq_kept, sample_mask)
        w = w * seq_kept.unsqueeze(-1)
    return w, metric


@pytest.mark.parametrize(
    ("kind", "ratio", "ratio_min"), [("tis", 1.3, None), ("tis", 1.3, 0.8), ("icepop", 1.3, 0.8)]
)
def test_nemo_tis_and_icepop(kind, ratio, ratio_min):
    old, rollout, mask = _inputs(7)
    fn = rc.truncated_is if kind == "tis" else rc.icepop
    w, out_mask, metrics = fn(old, rollout, mask, level="token", threshold=ratio, threshold_low=ratio_min)
    ref_w, oob = nemo_weights(old, rollout, mask.double(), kind, ratio, ratio_min)
    _close(w[mask], ref_w[mask], "weights")  # NeMo-RL keeps values on padding; its loss masks them
    assert torch.equal(out_mask, mask)
    if kind == "icepop":
        _close(metrics["rollout_is_oob_ratio"], oob)


def test_nemo_seq_mask_tis():
    old, rollout, mask = _inputs(8, spread=0.003)
    w, out_mask, metrics = rc.seq_mask_tis(old, rollout, mask, threshold=1.0005, threshold_low=0.9995)
    ref_w, oob = nemo_weights(
        old.masked_fill(~mask, 0.0), rollout.masked_fill(~mask, 0.0), mask.double(), "seq", 1.0005, 0.9995
    )
    _close(w, ref_w * mask, "weights")
    assert torch.equal(out_mask, mask), "NeMo-RL zeroes the rows' weights and keeps them in the mask"
    rows = mask.any(-1)
    assert 0 < (w[rows].abs().sum(-1) == 0).sum() < rows.sum(), "some rows but not all must be zeroed"
    o, r, m = _nonempty(old, rollout, mask)
    _close(metrics["rollout_is_oob_ratio"], nemo_weights(o, r, m.double(), "seq", 1.0005, 0.9995)[1])
    _common(metrics, old, rollout, mask)


# ---------------------------------------------------------------------------------------------------------
# AReaL: decoupled PPO
# ---------------------------------------------------------------------------------------------------------


def areal_ppo_actor_loss(logprobs, proximal, old, advantages, eps_clip, loss_mask, eps_clip_higher, c_clip, cap):
    """ppo_actor_loss_fn (importance_sampling_level='token', decoupled: proximal = recomputed, old = behaviour)."""
    count = loss_mask.count_nonzero() or 1
    ratio = torch.where(loss_mask, torch.exp(logprobs - proximal), 0)
    clipped = torch.clamp(ratio, 1.0 - eps_clip, 1.0 + (eps_clip if eps_clip_higher is None else eps_clip_higher))
    l1, l2 = -advantages * ratio, -advantages * clipped
    pg = torch.max(l1, l2)
    if c_clip is not None:
        pg = torch.min(pg, torch.sign(advantages) * c_clip * advantages)
    behav_kl = proximal - old
    behav_w = behav_kl.exp()
    behav_mask = (behav_w <= cap).logical_and(loss_mask) if cap is not None else loss_mask
    behav_w = torch.where(behav_mask, behav_w, 0.0)
    pg = pg * behav_w
    return torch.where(loss_mask, pg, 0).sum() / count


@pytest.mark.parametrize(("cap", "c_clip", "high"), [(None, None, None), (1.2, None, 0.28), (1.1, 3.0, None)])
def test_decoupled_ppo_matches_areal(cap, c_clip, high):
    prox, behav, mask = _inputs(9, spread=0.2)
    gen = torch.Generator().manual_seed(9)
    adv = torch.randn(B, T, generator=gen, dtype=torch.float64)
    new = (prox + 0.3 * torch.randn(B, T, generator=gen, dtype=torch.float64)).masked_fill(~mask, 0.0)
    leaf = new.clone().requires_grad_(True)
    loss, metrics = rc.decoupled_ppo_loss(
        leaf, prox, adv, mask, rollout_logprobs=behav, clip_eps=0.2, clip_eps_high=high, clip_ratio_c=c_clip,
        behav_imp_weight_cap=cap,
    )
    (grad,) = torch.autograd.grad(loss, leaf)
    ref_leaf = new.clone().requires_grad_(True)
    ref = areal_ppo_actor_loss(ref_leaf, prox, behav, adv, 0.2, mask, high, c_clip, cap)
    (ref_grad,) = torch.autograd.grad(ref, ref_leaf)
    _close(loss, ref)
    _close(grad, ref_grad)
    if cap is not None:
        w = torch.exp(prox - behav)
        _close(metrics["rollout_is_oob_ratio"], float(((w > cap) & mask).sum() / mask.sum()))
        assert metrics["rollout_is_oob_ratio"] > 0
    # the loop's form: the decoupled correction's weights into vanilla with pi_old = the proximal policy
    weights, out_mask, _ = rc.ROLLOUT_CORRECTIONS["decoupled"](prox, behav, mask, threshold=cap)
    assert torch.equal(out_mask, mask)
    loop_loss, _ = rlbits.POLICY_LOSSES["vanilla"](
        leaf, prox, adv, mask, clip_eps=0.2, clip_eps_high=high, clip_ratio_c=c_clip, rollout_is_weights=weights
    )
    _close(loop_loss, ref)


# ---------------------------------------------------------------------------------------------------------
# properties
# ---------------------------------------------------------------------------------------------------------


def _call(mode, old, rollout, mask):
    kwargs = {"threshold": 0.05} if mode == "rs" else {}
    return rc.ROLLOUT_CORRECTIONS[mode](old, rollout, mask, **kwargs)


@pytest.mark.parametrize("mode", sorted(rc.ROLLOUT_CORRECTIONS))
def test_padding_values_do_not_leak(mode):
    old, rollout, mask = _inputs(10)
    w, m, metrics = _call(mode, old, rollout, mask)
    w2, m2, metrics2 = _call(mode, old.masked_fill(~mask, float("inf")), rollout.masked_fill(~mask, float("nan")), mask)
    assert torch.equal(w, w2) and torch.equal(m, m2)
    assert (w[~mask] == 0).all() and not (m & ~mask).any()
    for k in metrics:
        _close(metrics2[k], metrics[k], k)


@pytest.mark.parametrize("mode", sorted(rc.ROLLOUT_CORRECTIONS))
def test_on_policy_weights_are_one(mode):
    """Sampler and trainer agree: every weight is 1, nothing is rejected, the mismatch KL is 0."""
    _, rollout, mask = _inputs(11)
    w, m, metrics = _call(mode, rollout, rollout, mask)
    assert torch.equal(m, mask)
    _close(w[mask], torch.ones(int(mask.sum())))
    _close(metrics["kl"], 0.0)
    _close(metrics["k3_kl"], 0.0)


def test_is_std_of_near_one_weights_is_their_spread_not_rounding():
    """fp32 weights 1 +- 1e-6: the std is their true spread (float64 reference), not the square root of the
    rounding left in E[w^2] - E[w]^2 (about 3e-4; seen as a pack_sequences run's rollout_is_std of 3.5e-4
    beside the padded run's 0.0)."""
    _, rollout, mask = _inputs(13)
    gen = torch.Generator().manual_seed(13)
    rollout = rollout.float()
    old = rollout + 1e-6 * torch.randn(rollout.shape, generator=gen)
    w, _, metrics = rc.ROLLOUT_CORRECTIONS["tis"](old, rollout, mask)
    ref = w.double()[mask]
    want = float(((ref - ref.mean()) ** 2).mean().sqrt())
    assert 0 < want < 1e-5
    assert abs(float(metrics["rollout_is_std"]) - want) < 1e-7


@pytest.mark.parametrize("mode", sorted(rc.ROLLOUT_CORRECTIONS))
def test_empty_mask_gives_zeros(mode):
    old, rollout, _ = _inputs(12)
    mask = torch.zeros(B, T, dtype=torch.bool)
    w, m, metrics = _call(mode, old, rollout, mask)
    assert (w == 0).all() and not m.any()
    assert all(torch.isfinite(v) for v in metrics.values())


def test_outputs_are_detached_and_float32_for_half_inputs():
    old, rollout, mask = _inputs(13)
    w, _, metrics = rc.truncated_is(old.bfloat16().requires_grad_(True), rollout.bfloat16(), mask)
    assert not w.requires_grad and w.dtype == torch.float32
    assert all(not v.requires_grad for v in metrics.values())


@pytest.mark.parametrize(
    ("fn", "bad"),
    [
        (rc.truncated_is, {"level": "row"}),
        (rc.truncated_is, {"threshold": 0.0}),
        (rc.truncated_is, {"threshold": 2.0, "threshold_low": 3.0}),
        (rc.icepop, {"threshold_low": None}),
        (rc.masked_is, {"threshold": -1.0}),
        (rc.rejection_mask, {"level": "seq_k3", "threshold": 0.1}),
        (rc.rejection_mask, {}),
        (rc.rejection_mask, {"level": "token_k3", "threshold": 0.1, "threshold_low": 0.01}),
        (rc.geo_mean_mask, {"level": "token"}),
        (rc.seq_mask_tis, {"level": "sequence"}),
        (rc.decoupled_is, {"threshold": 1.0}),
        (rc.decoupled_is, {"threshold_low": 0.5}),
    ],
)
def test_bad_arguments_raise(fn, bad):
    old, rollout, mask = _inputs(0)
    with pytest.raises(ValueError):
        fn(old, rollout, mask, **bad)


def test_shape_mismatch_raises():
    old, rollout, mask = _inputs(0)
    with pytest.raises(ValueError, match="shape"):
        rc.truncated_is(old[:, :-1], rollout, mask)
