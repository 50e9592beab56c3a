"""Rollout corrections: importance weights and rejection masks for the mismatch between the policy that
sampled a batch (the behaviour policy, e.g. a bf16 sampler) and the trainer's own recomputation of it.

Every function in ``ROLLOUT_CORRECTIONS`` is called as::

    weights, mask, metrics = fn(old_logprobs, rollout_logprobs, action_mask, *, level=..., threshold=...,
                                threshold_low=...)

with ``old_logprobs`` [B, R] float (log pi_old of the sampled tokens, recomputed by the trainer before the
update: the proximal policy), ``rollout_logprobs`` [B, R] float (log pi_rollout, the sampler's behaviour
log-probs) and ``action_mask`` [B, R] bool. Both log-probs are constants (detached). It returns
``weights`` [B, R] (detached, 0 off ``action_mask``; multiply the per-token policy loss by them: every
policy loss takes them as ``rollout_is_weights``), ``mask`` [B, R] bool (``action_mask`` without the
rejected tokens or rows; use it as the loss mask and count the loss denominators over it) and ``metrics``, a
dict of detached 0-dim tensors named as verl names them (no host sync: every function compiles with
``torch.compile(fullgraph=True)``). The IS ratio is ``r = pi_old / pi_rollout = exp(old - rollout)``.

Source of truth: verl 0.9's ``verl/trainer/ppo/rollout_corr_helper.py`` (tag v0.9.0, commit 483b8a0) for
``tis``, ``icepop``, ``mis``, ``geo_rs`` and ``rs``; NeMo-RL's ``ClippedPGLossFn`` (``loss_functions.py``)
for ``tis``'s lower clamp, ``icepop`` and ``seq_mask_tis``; AReaL's ``ppo_actor_loss_fn`` (v0.5.3,
``behav_imp_weight_cap``) for ``decoupled``. The method is Yao et al. 2025, "Your efficient RL framework
secretly brings you off-policy RL training" (TIS) and Liu et al. 2025, "When speed kills stability:
demystifying RL collapse from the training-inference mismatch" (MIS, Geo-RS); IcePop is from the Ring-1T
report (Ling team 2025); the decoupled PPO objective from Fu et al. 2025, "AReaL", arXiv:2505.24298.

Conventions shared by all functions that differ from the peers:

- padding never reaches ``exp`` (its log-ratio is set to 0 first), so padding holding any value leaves the
  outputs finite.
- rows without action tokens are left out of every average over rows (``*_seq_*``, the perplexities,
  ``chi2_seq``); verl averages over all B rows (an empty row counts with a zero statistic).
- an empty ``action_mask`` gives 0 for every metric instead of verl's ``ValueError`` (no host sync).
- the bounds of the ``k1`` rejection options are bounds on the IS ratio, ``threshold_low <= r <= threshold``
  (token ``r``, row product or row geometric mean). verl bounds its ``k1`` statistic ``-log r`` by
  ``log(lower) <= -log r <= log(upper)``, i.e. ``1 / upper <= r <= 1 / lower``; the two agree whenever
  ``threshold_low = 1 / threshold``, as in all of verl's presets' symmetric defaults.
- one rejection option per call (verl chains comma-separated options); call twice and AND the masks.
- verl's ``rollout_is_batch_normalize`` is not here (it needs the all-rank mean).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from rlbits.functional import _checks
from rlbits.functional.losses import _check_per_token
from rlbits.functional.masked import masked_mean
from rlbits.functional.policy_losses import vanilla_loss

__all__ = [
    "ROLLOUT_CORRECTIONS",
    "decoupled_is",
    "decoupled_ppo_loss",
    "geo_mean_mask",
    "icepop",
    "masked_is",
    "rejection_mask",
    "rollout_mismatch_metrics",
    "seq_mask_tis",
    "truncated_is",
]

SAFETY_BOUND = 20.0
"""Log-ratios are clamped to [-20, 20] before ``exp`` in the IS weights and chi-square metrics (verl's
``SAFETY_BOUND``)."""

RS_OPTIONS = (
    "token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3",
    "seq_mean_k1", "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3",
)
"""verl's rejection-sampling options (``rollout_rs``): where (token, row sum, row mean, row max) which
divergence estimate of the token log-ratio is bounded (k1 = -log r, k2 = (log r)^2 / 2, k3 = r - 1 - log r)."""

Correction = Callable[..., tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]]


# --- shared pieces ------------------------------------------------------------------------------------------


def _prepare(old_logprobs, rollout_logprobs, action_mask):
    """Checks, then (mask, log-ratio with padding 0, old, rollout) in the compute dtype."""
    _check_per_token(action_mask, old_logprobs=old_logprobs, rollout_logprobs=rollout_logprobs)
    dtype = _checks.compute_dtype(old_logprobs, rollout_logprobs)
    mask = action_mask.to(torch.bool)
    zero = torch.zeros((), dtype=dtype, device=old_logprobs.device)
    old = torch.where(mask, old_logprobs.detach().to(dtype), zero)
    rollout = torch.where(mask, rollout_logprobs.detach().to(dtype), zero)
    return mask, old - rollout, old, rollout


def _level(name: str, level: str, allowed: tuple[str, ...]) -> None:
    if level not in allowed:
        raise ValueError(f"{name}: level must be one of {', '.join(allowed)}; got {level!r}")


def _bounds(name: str, threshold, threshold_low, *, low_allowed: bool = True) -> None:
    """``threshold`` > 0; ``threshold_low`` None, or in (0, threshold] (``>= 0`` where a 0 bound is meaningful)."""
    _checks.in_range(f"{name}: threshold", threshold, 0, math.inf, low_open=True, high_open=True)
    if threshold_low is None:
        return
    if not low_allowed:
        raise ValueError(f"{name}: threshold_low must be None (only an upper bound applies); got {threshold_low!r}")
    _checks.in_range(f"{name}: threshold_low", threshold_low, 0, math.inf, low_open=True, high_open=True)
    if threshold_low > threshold:
        raise ValueError(f"{name}: threshold_low ({threshold_low}) must be <= threshold ({threshold})")


def _row_sum(x, mask):
    return torch.where(mask, x, torch.zeros((), dtype=x.dtype, device=x.device)).sum(dim=-1)


def _row_mean(x, mask):
    return _row_sum(x, mask) / mask.sum(dim=-1).clamp(min=1)


def _masked_max(x, mask):
    top = torch.where(mask, x, torch.full((), -math.inf, dtype=x.dtype, device=x.device)).amax()
    return torch.where(mask.any(), top, torch.zeros((), dtype=x.dtype, device=x.device))


def _masked_min(x, mask):
    return -_masked_max(-x, mask)


def _frac(cond, mask):
    return masked_mean(cond.to(torch.float32), mask)


def _std_over(x, mask):
    """Unbiased std of the masked entries of a 1-D ``x`` (``torch.std``), 0 for fewer than two."""
    n = mask.sum()
    mean = _row_sum(x, mask) / n.clamp(min=1)
    var = torch.where(mask, (x - mean).square(), 0.0).sum() / (n - 1).clamp(min=1)
    return torch.where(n > 1, var.sqrt(), torch.zeros((), dtype=x.dtype, device=x.device))


def _seq_log_ratio(log_ratio, mask, level):
    """[B, R]: the log-ratio each token's IS weight is built from: its own (token) or its row's sum."""
    if level == "token":
        return log_ratio
    return _row_sum(log_ratio, mask).unsqueeze(-1).expand_as(log_ratio)


def _raw_weights(log_ratio, mask, level):
    """verl's raw IS weights: ``exp`` of the clamped token (or row-summed) log-ratio, 0 off ``mask``."""
    lr = torch.clamp(_seq_log_ratio(log_ratio, mask, level), -SAFETY_BOUND, SAFETY_BOUND)
    return torch.where(mask, torch.exp(lr), torch.zeros((), dtype=lr.dtype, device=lr.device))


def rollout_mismatch_metrics(
    old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, action_mask: torch.Tensor
) -> dict[str, torch.Tensor]:
    """verl's off-policy diagnostics of the sampler/trainer mismatch (``compute_offpolicy_metrics``).

    Args:
        old_logprobs, rollout_logprobs: [B, R] float, the trainer's and the sampler's log-probs.
        action_mask: [B, R] bool.

    Returns:
        Detached 0-dim tensors: ``kl`` (k1 estimate of KL(pi_rollout || pi_old), token mean of
        ``rollout - old``), ``k3_kl`` (token mean of ``r - 1 - log r``), ``training_ppl`` / ``rollout_ppl``
        (mean over rows of ``exp(-row mean logprob)``), ``training_log_ppl`` / ``rollout_log_ppl``,
        ``log_ppl_diff`` (mean over rows of the rollout minus training row mean logprob) with
        ``log_ppl_abs_diff``, ``log_ppl_diff_max``, ``log_ppl_diff_min``, ``ppl_ratio`` (row mean of
        ``exp(log_ppl_diff)``), ``chi2_token`` (``E[r^2] - 1`` over tokens) and ``chi2_seq`` (``E[(prod r)^2]
        - 1`` over rows). Rows without action tokens are left out of the row means.

    Raises:
        ValueError: mismatched shapes, non-float log-probs.
    """
    mask, log_ratio, old, rollout = _prepare(old_logprobs, rollout_logprobs, action_mask)
    rows = mask.any(dim=-1)
    n_rows = rows.sum().clamp(min=1)
    zero = torch.zeros((), dtype=old.dtype, device=old.device)

    def over_rows(x):
        return torch.where(rows, x, zero).sum() / n_rows

    train_mean, rollout_mean = _row_mean(old, mask), _row_mean(rollout, mask)
    diff = rollout_mean - train_mean
    seq_lr = torch.clamp(_row_sum(log_ratio, mask), -SAFETY_BOUND, SAFETY_BOUND)
    token_r = torch.exp(torch.clamp(log_ratio, -SAFETY_BOUND, SAFETY_BOUND))
    metrics = {
        "training_ppl": over_rows(torch.exp(-train_mean)),
        "training_log_ppl": over_rows(-train_mean),
        "kl": masked_mean(rollout - old, mask),
        "k3_kl": masked_mean(torch.expm1(log_ratio) - log_ratio, mask),
        "rollout_ppl": over_rows(torch.exp(-rollout_mean)),
        "rollout_log_ppl": over_rows(-rollout_mean),
        "log_ppl_diff": over_rows(diff),
        "log_ppl_abs_diff": over_rows(diff.abs()),
        "log_ppl_diff_max": _masked_max(diff, rows),
        "log_ppl_diff_min": _masked_min(diff, rows),
        "ppl_ratio": over_rows(torch.exp(diff)),
        "chi2_token": masked_mean(token_r.square(), mask) - 1.0,
        "chi2_seq": over_rows(torch.exp(2.0 * seq_lr)) - 1.0,
    }
    return {k: v.detach() for k, v in metrics.items()}


def _is_metrics(weights, raw, log_ratio, mask, level, upper, lower):
    """verl's ``compute_is_metrics`` (``rollout_is_*``) of the applied ``weights`` and the ``raw`` ones."""
    rows = mask.any(dim=-1)
    n_rows = rows.sum().clamp(min=1)
    zero = torch.zeros((), dtype=weights.dtype, device=weights.device)
    out = {"rollout_is_mean": masked_mean(weights, mask)}
    if level == "sequence":
        seq_lr = _row_sum(log_ratio, mask)
        out["rollout_is_max"] = torch.exp(torch.clamp(_masked_max(seq_lr, rows), max=SAFETY_BOUND))
        out["rollout_is_min"] = torch.exp(_masked_min(seq_lr, rows))
        out["rollout_is_ratio_fraction_high"] = _frac(seq_lr > math.log(upper), rows)
        out["rollout_is_ratio_fraction_low"] = _frac(seq_lr < math.log(lower), rows) if lower > 0 else zero
    else:
        out["rollout_is_ratio_fraction_high"] = _frac(raw > upper, mask)
        out["rollout_is_ratio_fraction_low"] = _frac(raw < lower, mask)
        out["rollout_is_max"] = _masked_max(weights, mask)
        out["rollout_is_min"] = _masked_min(weights, mask)
    clamped = weights.clamp(min=0.0, max=upper)
    mean = masked_mean(clamped, mask)
    # two passes, not E[w^2] - E[w]^2 (verl's): at weights of 1 +- 1e-7 that difference is fp32 rounding, and
    # its square root reads about 3e-4 where the true spread is 1e-7
    var = masked_mean((clamped - mean).square(), mask)
    out["rollout_is_std"] = torch.where(mask.sum() > 1, var.sqrt(), zero)
    normalized = clamped / (mean + 1e-8)
    second_moment = masked_mean(normalized.square(), mask)  # 0 when every weight is 0 (verl: ZeroDivisionError)
    out["rollout_is_eff_sample_size"] = torch.where(second_moment > 0, 1.0 / second_moment, zero)
    seq_w, raw_seq_w = _row_mean(weights, mask), _row_mean(raw, mask)
    out["rollout_is_seq_mean"] = torch.where(rows, seq_w, zero).sum() / n_rows
    out["rollout_is_seq_std"] = _std_over(seq_w, rows)
    out["rollout_is_seq_max"] = _masked_max(seq_w, rows)
    out["rollout_is_seq_min"] = _masked_min(seq_w, rows)
    out["rollout_is_seq_max_deviation"] = _masked_max((seq_w - 1.0).abs(), rows)
    out["rollout_is_seq_fraction_high"] = _frac(raw_seq_w > upper, rows)
    out["rollout_is_seq_fraction_low"] = _frac(raw_seq_w < lower, rows)
    return out


def _reject(log_ratio, mask, option, threshold, threshold_low):
    """verl's ``compute_rollout_rejection_mask`` for one option: (keep [B, R] bool, ``rollout_rs_*`` metrics)."""
    lr = torch.clamp(log_ratio, -SAFETY_BOUND, SAFETY_BOUND)
    k1 = -lr
    stats = {"k1": k1, "k2": 0.5 * lr.square(), "k3": torch.expm1(lr) - lr}
    estimator = option[-2:]
    token_stat = stats[estimator]
    if estimator == "k1":  # bounds on r, as bounds on -log r (see the module docstring)
        low = 1.0 / threshold if threshold_low is None else threshold_low
        lower, upper = -math.log(threshold), -math.log(low)
    else:
        lower, upper = 0.0, threshold
    rows = mask.any(dim=-1)
    zero = torch.zeros((), dtype=lr.dtype, device=lr.device)
    if option.startswith("token"):
        stat = token_stat
        keep = (stat >= lower) & (stat <= upper) if estimator == "k1" else stat <= upper
        per_token = stat
        high, below = _frac(stat > upper, mask), _frac(stat < lower, mask) if estimator == "k1" else zero
        stat_max, stat_min = _masked_max(stat, mask), _masked_min(stat, mask)
    else:
        if option.startswith("seq_sum"):
            seq = _row_sum(token_stat, mask)
        elif option.startswith("seq_mean"):
            seq = _row_mean(token_stat, mask)
        else:
            seq = torch.where(rows, torch.where(mask, token_stat, -math.inf).amax(dim=-1), zero)
        seq_keep = (seq >= lower) & (seq <= upper) if estimator == "k1" else seq <= upper
        keep = seq_keep.unsqueeze(-1).expand_as(mask)
        per_token = seq.unsqueeze(-1).expand_as(lr)
        high, below = _frac(seq > upper, rows), _frac(seq < lower, rows) if estimator == "k1" else zero
        stat_max, stat_min = _masked_max(seq, rows), _masked_min(seq, rows)
    rejected = mask & ~keep
    prefix = f"rollout_rs_{option}"
    seq_rejected = _frac(rejected.any(dim=-1), rows)
    metrics = {
        f"{prefix}_mean": masked_mean(per_token, mask),
        f"{prefix}_max": stat_max,
        f"{prefix}_min": stat_min,
        f"{prefix}_fraction_high": high,
        f"{prefix}_fraction_low": below,
        f"{prefix}_masked_fraction": _frac(rejected, mask),
        f"{prefix}_seq_masked_fraction": seq_rejected,
        "rollout_rs_masked_fraction": _frac(rejected, mask),
        "rollout_rs_seq_masked_fraction": seq_rejected,
    }
    return mask & keep, metrics


def _done(weights, mask, metrics, old, rollout, action_mask):
    metrics = {**metrics, **rollout_mismatch_metrics(old, rollout, action_mask)}
    return weights.detach(), mask, {k: v.detach() for k, v in metrics.items()}


# --- the corrections ----------------------------------------------------------------------------------------


def truncated_is(
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    action_mask: torch.Tensor,
    *,
    level: str = "token",
    threshold: float = 2.0,
    threshold_low: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Truncated importance sampling (TIS, Yao 2025): verl's ``rollout_is: token|sequence`` with a float
    ``rollout_is_threshold`` (Token-TIS, Seq-TIS), NeMo-RL's ``truncated_importance_sampling_type: tis``.

    ``w_t = min(r_t, threshold)`` (token) or ``w_t = min(prod_s r_s, threshold)`` for every token of a row
    (sequence), with the log-ratio clamped to [-20, 20] before ``exp`` as verl does. ``threshold_low``
    (NeMo-RL's ``truncated_importance_sampling_ratio_min``) also clamps from below; verl has no lower clamp.
    No token is rejected: ``mask`` is ``action_mask``.

    Args:
        old_logprobs, rollout_logprobs, action_mask: [B, R]; see the module docstring.
        level: ``token`` or ``sequence``.
        threshold: the truncation C > 0 (verl: 1.5-5 token, 2-10 sequence; default 2.0).
        threshold_low: optional lower clamp in (0, threshold].

    Returns:
        ``(weights, mask, metrics)``: ``rollout_is_*`` (mean, max, min, std, eff_sample_size,
        ratio_fraction_high/low, seq_mean/std/max/min/max_deviation, seq_fraction_high/low; the lower
        fraction uses ``threshold_low`` or ``1 / threshold``) and ``rollout_mismatch_metrics``.

    Raises:
        ValueError: mismatched shapes, unknown ``level``, thresholds out of range.
    """
    mask, log_ratio, old, rollout = _prepare(old_logprobs, rollout_logprobs, action_mask)
    _level("truncated_is", level, ("token", "sequence"))
    _bounds("truncated_is", threshold, threshold_low)
    raw = _raw_weights(log_ratio, mask, level)
    low = 0.0 if threshold_low is None else threshold_low
    weights = torch.where(mask, raw.clamp(min=low, max=threshold), 0.0)
    lower = 1.0 / threshold if threshold_low is None else threshold_low
    metrics = _is_metrics(weights, raw, log_ratio, mask, level, threshold, lower)
    return _done(weights, mask, metrics, old, rollout, mask)


def icepop(
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    action_mask: torch.Tensor,
    *,
    level: str = "token",
    threshold: float = 5.0,
    threshold_low: float | None = 0.5,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """IcePop (Ring-1T report, Ling team 2025): verl's ``rollout_is`` with a ``"low_high"``
    ``rollout_is_threshold``, NeMo-RL's ``truncated_importance_sampling_type: icepop``.

    ``w_t = r_t`` where ``threshold_low <= r_t <= threshold`` and 0 elsewhere (token; sequence: the row's
    product ``prod_s r_s`` for all its tokens). As in both peers the zeroed tokens stay in ``mask``: they
    still count in the loss denominators.

    Args:
        old_logprobs, rollout_logprobs, action_mask: [B, R]; see the module docstring.
        level: ``token`` (NeMo-RL's only level) or ``sequence``.
        threshold, threshold_low: the band, ``0 < threshold_low <= threshold`` (defaults 0.5 and 5.0, verl's
            ``decoupled_token_icepop`` and NeMo-RL's reference bounds).

    Returns:
        ``(weights, mask, metrics)``: as ``truncated_is`` plus ``rollout_is_oob_ratio`` (fraction of tokens
        whose weight was zeroed).

    Raises:
        ValueError: mismatched shapes, unknown ``level``, thresholds out of range or ``threshold_low`` None.
    """
    mask, log_ratio, old, rollout = _prepare(old_logprobs, rollout_logprobs, action_mask)
    _level("icepop", level, ("token", "sequence"))
    if threshold_low is None:
        raise ValueError("icepop: threshold_low is required (the lower end of the kept band)")
    _bounds("icepop", threshold, threshold_low)
    raw = _raw_weights(log_ratio, mask, level)
    kept = (raw >= threshold_low) & (raw <= threshold)
    weights = torch.where(kept, raw, 0.0)
    metrics = _is_metrics(weights, raw, log_ratio, mask, level, threshold, threshold_low)
    metrics["rollout_is_oob_ratio"] = _frac(~kept, mask)
    return _done(weights, mask, metrics, old, rollout, mask)


def masked_is(
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    action_mask: torch.Tensor,
    *,
    level: str = "sequence",
    threshold: float = 2.0,
    threshold_low: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Masked importance sampling (MIS, Liu 2025): verl's Seq-MIS preset ``decoupled_seq_is_rs``
    (``rollout_is: sequence`` + ``rollout_rs: seq_sum_k1``) and its token form (``rollout_is: token`` +
    ``rollout_rs: token_k1``).

    Tokens (token level) or whole rows (sequence level: the row product ``prod_s r_s``) whose ratio leaves
    ``[threshold_low, threshold]`` are rejected from ``mask``; the rest keep the TIS weight
    ``min(ratio, threshold)`` (which is the ratio itself, as kept ratios are at most ``threshold``).

    Args:
        old_logprobs, rollout_logprobs, action_mask: [B, R]; see the module docstring.
        level: ``token`` or ``sequence``.
        threshold: upper bound C > 0 of a kept ratio and the TIS truncation (verl's default 2.0).
        threshold_low: lower bound of a kept ratio in (0, threshold]; None = ``1 / threshold`` (verl's).

    Returns:
        ``(weights, mask, metrics)``: ``truncated_is``'s metrics, the rejection's ``rollout_rs_*`` (see
        ``rejection_mask``) and ``rollout_mismatch_metrics``.

    Raises:
        ValueError: mismatched shapes, unknown ``level``, thresholds out of range.
    """
    mask, log_ratio, old, rollout = _prepare(old_logprobs, rollout_logprobs, action_mask)
    _level("masked_is", level, ("token", "sequence"))
    _bounds("masked_is", threshold, threshold_low)
    raw = _raw_weights(log_ratio, mask, level)
    weights = raw.clamp(max=threshold)
    metrics = _is_metrics(weights, raw, log_ratio, mask, level, threshold, 1.0 / threshold)
    option = "token_k1" if level == "token" else "seq_sum_k1"
    kept, rs = _reject(log_ratio, mask, option, threshold, threshold_low)
    return _done(weights, kept, {**metrics, **rs}, old, rollout, mask)


def rejection_mask(
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    action_mask: torch.Tensor,
    *,
    level: str = "seq_mean_k3",
    threshold: float | None = None,
    threshold_low: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Rejection sampling on a divergence estimate: verl's ``rollout_rs`` (``compute_rollout_rejection_mask``)
    for one option, without IS weights (verl's ``rollout_is: null``).

    ``level`` is the verl option, ``{token, seq_sum, seq_mean, seq_max}_{k1, k2, k3}`` (``RS_OPTIONS``): the
    token statistic ``k1 = -log r``, ``k2 = (log r)^2 / 2`` or ``k3 = r - 1 - log r`` (log-ratio clamped to
    [-20, 20]) is bounded per token, or its row sum, mean or max per row (a row is kept or rejected whole).
    ``k2``/``k3`` keep a statistic ``<= threshold``; ``k1`` keeps ``threshold_low <= r <= threshold`` with
    ``r`` the token ratio, the row product (``seq_sum``) or geometric mean (``seq_mean``).

    Args:
        old_logprobs, rollout_logprobs, action_mask: [B, R]; see the module docstring.
        level: one of ``RS_OPTIONS`` (default ``seq_mean_k3``, verl's ``bypass_ppo_clip_k3_rs``).
        threshold: the upper bound, > 0, required (verl's k3 preset: 0.01).
        threshold_low: ``k1`` only: the lower ratio bound; None = ``1 / threshold`` (verl's).

    Returns:
        ``(weights, mask, metrics)``: weights 1 on the action tokens (0 elsewhere); ``rollout_rs_{level}_*``
        (mean, max, min, fraction_high, fraction_low, masked_fraction, seq_masked_fraction),
        ``rollout_rs_masked_fraction``, ``rollout_rs_seq_masked_fraction`` and ``rollout_mismatch_metrics``.
        verl's ``_std`` and ``_seq_*`` statistics of each option are not reported.

    Raises:
        ValueError: mismatched shapes, unknown ``level``, a missing or out-of-range threshold,
            ``threshold_low`` for a k2/k3 option.
    """
    mask, log_ratio, old, rollout = _prepare(old_logprobs, rollout_logprobs, action_mask)
    _level("rejection_mask", level, RS_OPTIONS)
    if threshold is None:
        raise ValueError(f"rejection_mask: threshold is required for {level}")
    _bounds("rejection_mask", threshold, threshold_low, low_allowed=level.endswith("k1"))
    kept, rs = _reject(log_ratio, mask, level, threshold, threshold_low)
    return _done(mask.to(log_ratio.dtype), kept, rs, old, rollout, mask)


def geo_mean_mask(
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    action_mask: torch.Tensor,
    *,
    level: str = "sequence",
    threshold: float = 1.001,
    threshold_low: float | None = 0.999,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Geometric-mean rejection (Geo-RS, Liu 2025): verl's ``decoupled_geo_rs`` preset
    (``rollout_rs: seq_mean_k1``, ``rollout_rs_threshold: "0.999_1.001"``).

    A row is rejected whole unless its geometric-mean ratio ``exp(mean_t log r_t)`` lies in
    ``[threshold_low, threshold]`` (a length-normalised test, so long rows are not rejected for their
    length). No IS weights. This is ``rejection_mask(level="seq_mean_k1")`` with verl's defaults.

    Args:
        old_logprobs, rollout_logprobs, action_mask: [B, R]; see the module docstring.
        level: ``sequence`` (the only one).
        threshold, threshold_low: the band of the geometric mean (defaults 1.001 and 0.999; None = 1 / threshold).

    Returns:
        ``(weights, mask, metrics)`` as ``rejection_mask``.

    Raises:
        ValueError: mismatched shapes, a level other than ``sequence``, thresholds out of range.
    """
    _level("geo_mean_mask", level, ("sequence",))
    return rejection_mask(
        old_logprobs, rollout_logprobs, action_mask, level="seq_mean_k1", threshold=threshold,
        threshold_low=threshold_low,
    )


def seq_mask_tis(
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    action_mask: torch.Tensor,
    *,
    level: str = "token",
    threshold: float = 1.002,
    threshold_low: float | None = 0.999,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """NeMo-RL's ``truncated_importance_sampling_type: seq-mask-tis``: zero whole rows by their
    geometric-mean ratio, keep raw (untruncated) token IS weights in the rest.

    ``w_t = r_t`` if ``threshold_low <= exp(mean_s log r_s) <= threshold`` for the token's row, else 0 (a
    non-finite ``r_t`` becomes 0, NeMo-RL's ``nan_to_num``). As in NeMo-RL the zeroed rows stay in ``mask``
    (they still count in the loss denominators); no log-ratio clamp before ``exp``.

    Args:
        old_logprobs, rollout_logprobs, action_mask: [B, R]; see the module docstring.
        level: ``token`` (the weights' level; the only one: NeMo-RL refuses sequence-level ratios here).
        threshold, threshold_low: the kept band of the geometric mean (NeMo-RL's reference bounds 0.999 and
            1.002); ``threshold_low`` is required.

    Returns:
        ``(weights, mask, metrics)``: as ``truncated_is`` plus ``rollout_is_oob_ratio`` (fraction of rows
        outside the band: NeMo-RL's ``is_oob_ratio``).

    Raises:
        ValueError: mismatched shapes, a level other than ``token``, thresholds out of range or missing.
    """
    mask, log_ratio, old, rollout = _prepare(old_logprobs, rollout_logprobs, action_mask)
    _level("seq_mask_tis", level, ("token",))
    if threshold_low is None:
        raise ValueError("seq_mask_tis: threshold_low is required (the lower end of the kept band)")
    _bounds("seq_mask_tis", threshold, threshold_low)
    zero = torch.zeros((), dtype=log_ratio.dtype, device=log_ratio.device)
    token_w = torch.nan_to_num(torch.exp(log_ratio), nan=0.0, posinf=0.0, neginf=0.0)
    geo = torch.exp(_row_mean(log_ratio, mask))
    row_kept = (geo >= threshold_low) & (geo <= threshold)
    weights = torch.where(mask & row_kept.unsqueeze(-1), token_w, zero)
    metrics = _is_metrics(weights, torch.where(mask, token_w, zero), log_ratio, mask, "token", threshold, threshold_low)
    metrics["rollout_is_oob_ratio"] = _frac(~row_kept, mask.any(dim=-1))
    return _done(weights, mask, metrics, old, rollout, mask)


def decoupled_is(
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    action_mask: torch.Tensor,
    *,
    level: str = "token",
    threshold: float | None = 5.0,
    threshold_low: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """The behaviour importance weight of AReaL's decoupled PPO objective (Fu 2025, arXiv:2505.24298;
    ``ppo_actor_loss_fn``'s ``behav_imp_weight`` with ``behav_imp_weight_cap``).

    ``w_t = pi_prox / pi_behav = r_t`` (the proximal policy is the trainer's recomputed ``old_logprobs``,
    the behaviour policy the sampler's), set to 0 where ``r_t > threshold``. As in AReaL the zeroed tokens
    stay in ``mask`` (AReaL divides by the whole ``loss_mask`` count). With a PPO loss whose old policy is
    ``old_logprobs`` this is the decoupled objective (``decoupled_ppo_loss``).

    Args:
        old_logprobs, rollout_logprobs, action_mask: [B, R]; see the module docstring.
        level: ``token`` (the only one).
        threshold: ``behav_imp_weight_cap`` (AReaL requires > 1; its recommended 5.0), or None for no cap.
        threshold_low: must be None (AReaL has no lower cap).

    Returns:
        ``(weights, mask, metrics)``: ``rollout_is_*`` as ``truncated_is`` (with ``threshold`` as the upper
        bound, infinite without a cap, and 0 as the lower), ``rollout_is_oob_ratio`` (fraction of tokens
        above the cap) and ``rollout_mismatch_metrics``.

    Raises:
        ValueError: mismatched shapes, a level other than ``token``, ``threshold <= 1``, a ``threshold_low``.
    """
    mask, log_ratio, old, rollout = _prepare(old_logprobs, rollout_logprobs, action_mask)
    _level("decoupled_is", level, ("token",))
    if threshold is not None:
        _checks.in_range("decoupled_is: threshold", threshold, 1, math.inf, low_open=True, high_open=True)
    if threshold_low is not None:
        raise ValueError(f"decoupled_is: threshold_low must be None (AReaL caps from above only); got {threshold_low!r}")
    raw = torch.where(mask, torch.exp(log_ratio), 0.0)
    kept = mask if threshold is None else mask & (raw <= threshold)
    weights = torch.where(kept, raw, 0.0)
    upper = math.inf if threshold is None else threshold
    metrics = _is_metrics(weights, raw, log_ratio, mask, "token", upper, 0.0)
    metrics["rollout_is_oob_ratio"] = _frac(mask & ~kept, mask)
    return _done(weights, mask, metrics, old, rollout, mask)


ROLLOUT_CORRECTIONS: dict[str, Correction] = {
    "tis": truncated_is,
    "icepop": icepop,
    "mis": masked_is,
    "geo_rs": geo_mean_mask,
    "rs": rejection_mask,
    "seq_mask_tis": seq_mask_tis,
    "decoupled": decoupled_is,
}
"""Mode name (a loop's ``rollout_correction: {mode: ...}``) -> correction with the shared signature (see
this module's docstring)."""


def decoupled_ppo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    action_mask: torch.Tensor,
    *,
    rollout_logprobs: torch.Tensor,
    agg: str = "token-mean",
    num_tokens: int | torch.Tensor | None = None,
    num_seqs: int | torch.Tensor | None = None,
    clip_eps: float = 0.2,
    clip_eps_high: float | None = None,
    clip_ratio_c: float | None = None,
    behav_imp_weight_cap: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """AReaL's decoupled PPO objective (Fu 2025, "AReaL", arXiv:2505.24298; ``ppo_actor_loss_fn``
    with ``use_decoupled_loss``).

    ``J(theta) = E[ pi_prox / pi_behav * min(u A, clip(u, 1 - clip_eps, 1 + clip_eps_high) A) ]`` with
    ``u = pi_theta / pi_prox``: PPO's clip is taken around the proximal policy ``old_logprobs`` (the
    trainer's recomputation), and the gap to the behaviour policy ``rollout_logprobs`` (the sampler's, which
    may be several versions stale) is corrected by the detached weight ``pi_prox / pi_behav``, zeroed above
    ``behav_imp_weight_cap``. It is ``vanilla_loss(..., clip_ratio_c=clip_ratio_c,
    rollout_is_weights=decoupled_is(old_logprobs, rollout_logprobs, action_mask, threshold=cap)[0])``: in a
    loop, ``rollout_correction: {mode: decoupled, threshold: cap}`` with ``policy_loss: vanilla``.

    Args:
        logprobs: [B, R] log pi_theta, with grad.
        old_logprobs: [B, R] log pi_prox (recomputed before the update).
        advantages, action_mask: [B, R].
        rollout_logprobs: [B, R] log pi_behav (the sampler's).
        agg, num_tokens, num_seqs: see ``aggregate_loss`` (AReaL: ``token-mean``).
        clip_eps, clip_eps_high: AReaL's ``eps_clip`` / ``eps_clip_higher``.
        clip_ratio_c: AReaL's dual-clip ``c_clip`` (> 1), or None (AReaL's default).
        behav_imp_weight_cap: cap on ``pi_prox / pi_behav`` (> 1), or None for none.

    Returns:
        ``(loss, metrics)``: ``vanilla_loss``'s metrics plus ``decoupled_is``'s.

    Raises:
        ValueError: as ``vanilla_loss`` and ``decoupled_is``.
    """
    weights, _, corr = decoupled_is(old_logprobs, rollout_logprobs, action_mask, threshold=behav_imp_weight_cap)
    loss, metrics = vanilla_loss(
        logprobs, old_logprobs, advantages, action_mask, agg=agg, num_tokens=num_tokens, num_seqs=num_seqs,
        clip_eps=clip_eps, clip_eps_high=clip_eps_high, clip_ratio_c=clip_ratio_c, rollout_is_weights=weights,
    )
    return loss, {**metrics, **corr}
