"""Policy-gradient and critic losses: PPO (clip, clip-higher, dual clip), REINFORCE, value loss.

Every loss returns ``(loss, metrics)``: ``loss`` a 0-dim tensor to call ``backward`` on, ``metrics`` a dict
of detached 0-dim tensors (no ``.item()``, no host sync), so the functions compile with
``torch.compile(fullgraph=True)``. Per-token terms are aggregated by ``aggregate_loss``; pass the global
number of action tokens as ``num_tokens`` when a batch is split into microbatches or ranks, so that the
summed gradients equal one big batch's.
"""

from __future__ import annotations

import math

import torch

from rlbits.functional import _checks
from rlbits.functional.masked import masked_mean, masked_var


def aggregate_loss(
    per_token: torch.Tensor,
    action_mask: torch.Tensor,
    agg: str = "token-mean",
    num_tokens: int | torch.Tensor | None = None,
    num_seqs: int | torch.Tensor | None = None,
    loss_scale_factor: int | torch.Tensor | None = None,
) -> torch.Tensor:
    """Reduce a [B, R] per-token loss to a scalar over action tokens.

    - ``token-mean``: sum over action tokens / their count (``num_tokens`` if given). Every token weighs
      the same whatever its sequence's length (DAPO, Yu 2025, sec. 3.3).
    - ``token-sum``: sum over action tokens, no denominator (verl 0.9's ``agg_loss``); the loss and its
      gradient grow with the number of tokens.
    - ``seq-mean-token-mean``: each row's mean over its action tokens, averaged over rows (the original
      GRPO; long sequences' tokens weigh less).
    - ``seq-mean-token-sum``: each row's sum over its action tokens, averaged over rows.
    - ``seq-mean-token-sum-norm``: ``seq-mean-token-sum`` divided by the constant ``loss_scale_factor``
      (default ``R``, the padded length): each row's token sum over a fixed horizon instead of the row's
      own length, Dr. GRPO's normaliser (Liu 2025, "Understanding R1-Zero-like training", sec. 3.1), as
      verl 0.9's ``agg_loss`` defines it (rows averaged over ``num_seqs``, then divided by the factor).

    Rows with no action token (e.g. filtered overlong samples) are left out of the row average instead of
    counting as zeros; ``num_seqs`` overrides that row count (the global one across microbatches/ranks).

    Args:
        per_token: [B, R] float.
        action_mask: [B, R] bool.
        agg: aggregation mode.
        num_tokens: denominator of ``token-mean`` (int or 0-dim tensor); default the local token count.
        num_seqs: the row-average denominator of the ``seq-*`` modes; default the local count of rows with
            action tokens.
        loss_scale_factor: the constant horizon of ``seq-mean-token-sum-norm`` (verl's name); default ``R``.
            Set it to the maximum response length to keep the normaliser fixed across batches.

    Returns:
        0-dim tensor in the dtype of ``per_token``. An empty mask gives 0.

    Raises:
        ValueError: unknown ``agg`` or mismatched shapes.
    """
    _checks.aggregation(agg)
    _checks.ndim("per_token", per_token, 2, "[B, R]")
    _checks.same_shape(per_token=per_token, action_mask=action_mask)
    mask = action_mask.to(torch.bool)
    masked = torch.where(mask, per_token, torch.zeros((), dtype=per_token.dtype, device=per_token.device))
    if agg == "token-mean":
        denom = mask.sum().clamp(min=1) if num_tokens is None else num_tokens
        return masked.sum() / denom
    if agg == "token-sum":
        return masked.sum()
    row_count = mask.sum(dim=1)
    row = masked.sum(dim=1)
    if agg == "seq-mean-token-mean":
        row = row / row_count.clamp(min=1)
    denom = (row_count > 0).sum().clamp(min=1) if num_seqs is None else num_seqs
    if agg == "seq-mean-token-sum-norm":
        return row.sum() / denom / (per_token.shape[-1] if loss_scale_factor is None else loss_scale_factor)
    return row.sum() / denom


def _is_weighted(
    per_token: torch.Tensor, rollout_is_weights: torch.Tensor | None, action_mask: torch.Tensor
) -> torch.Tensor:
    """``per_token * rollout_is_weights`` (detached; 0 off ``action_mask``, so padding holding any value stays
    out of the gradient), or ``per_token`` when the weights are None: how every policy loss applies a rollout
    correction's weights before aggregating (verl's ``pg_losses * rollout_is_weights``).

    Raises:
        ValueError: the weights' shape differs from the mask's, or they are not floating point.
    """
    if rollout_is_weights is None:
        return per_token
    _check_per_token(action_mask, rollout_is_weights=rollout_is_weights)
    zero = torch.zeros((), dtype=per_token.dtype, device=per_token.device)
    w = torch.where(action_mask.to(torch.bool), rollout_is_weights.detach().to(per_token.dtype), zero)
    return per_token * w


def _check_per_token(action_mask: torch.Tensor, **tensors: torch.Tensor) -> None:
    _checks.ndim("action_mask", action_mask, 2, "[B, R]")
    for name, t in tensors.items():
        _checks.floating(name, t)
    _checks.same_shape(action_mask=action_mask, **tensors)


def ppo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    action_mask: torch.Tensor,
    clip_eps: float = 0.2,
    clip_eps_high: float | None = None,
    dual_clip: float | None = None,
    agg: str = "token-mean",
    num_tokens: int | torch.Tensor | None = None,
    num_seqs: int | torch.Tensor | None = None,
    *,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped surrogate policy loss of PPO (Schulman 2017, eq. 7), with clip-higher and dual clip.

    With ``ratio = exp(logprobs - old_logprobs)`` per action token:
    ``l = max(-A ratio, -A clip(ratio, 1 - clip_eps, 1 + clip_eps_high))``; ``clip_eps_high`` defaults to
    ``clip_eps`` and a larger value is DAPO's clip-higher (Yu 2025, eq. 10). With ``dual_clip = c > 1``,
    tokens with ``A < 0`` are capped at ``-c A`` (Ye 2020, "Mastering complex control in MOBA games",
    eq. 5). Aggregated by ``aggregate_loss``. ``old_logprobs`` and ``advantages`` are constants (detached).

    Args:
        logprobs: [B, R] log pi_theta(token), with grad.
        old_logprobs: [B, R] log pi_old(token) from the rollout.
        advantages: [B, R].
        action_mask: [B, R] bool.
        clip_eps: lower clip range (and upper, unless ``clip_eps_high``), >= 0.
        clip_eps_high: upper clip range, >= 0.
        dual_clip: c > 1, or None.
        agg, num_tokens, num_seqs: see ``aggregate_loss``.
        rollout_is_weights: [B, R] rollout-correction weights multiplying each token's loss before
            aggregation (``rlbits.functional.rollout_correction``; detached), or None.

    Returns:
        ``(loss, metrics)``: loss 0-dim float32; metrics (detached, over local action tokens):
        ``clipfrac`` (fraction of tokens where the clipped term is the active one), ``approx_kl``
        (k3 estimate of KL(pi_old || pi_theta)), ``ratio_mean``, ``dual_clipfrac``.

    Raises:
        ValueError: mismatched shapes, negative clip ranges, ``dual_clip <= 1``, unknown ``agg``.
    """
    _check_per_token(action_mask, logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages)
    _checks.aggregation(agg)
    clip_eps, clip_eps_high = _checks.clip_range(clip_eps, clip_eps_high)
    if dual_clip is not None and not (
        isinstance(dual_clip, torch.Tensor) or (_checks.is_number(dual_clip) and 1 < dual_clip < math.inf)
    ):
        raise ValueError(f"dual_clip must be > 1 (Ye 2020) and finite, or None; got {dual_clip!r}")
    dtype = _checks.compute_dtype(logprobs, old_logprobs, advantages)
    mask = action_mask.to(torch.bool)
    zero = torch.zeros((), dtype=dtype, device=logprobs.device)
    # Mask before exp: padding logprobs can be anything, and exp(inf) * 0 would put NaN in the gradient.
    log_ratio = torch.where(mask, logprobs.to(dtype) - old_logprobs.detach().to(dtype), zero)
    ratio = torch.exp(log_ratio)
    adv = advantages.detach().to(dtype)
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1.0 - clip_eps, 1.0 + clip_eps_high)
    per_token = torch.maximum(unclipped, clipped)
    dual_clipped = torch.zeros_like(mask)
    if dual_clip is not None:
        cap = -dual_clip * adv
        dual_clipped = (adv < 0) & (per_token > cap)
        per_token = torch.where(dual_clipped, cap, per_token)
    loss = aggregate_loss(_is_weighted(per_token, rollout_is_weights, mask), mask, agg, num_tokens, num_seqs)
    with torch.no_grad():
        metrics = {
            "clipfrac": masked_mean((clipped > unclipped).to(dtype), mask),
            "approx_kl": masked_mean(torch.expm1(log_ratio) - log_ratio, mask),
            "ratio_mean": masked_mean(ratio, mask),
            "dual_clipfrac": masked_mean(dual_clipped.to(dtype), mask),
        }
    return loss, {k: v.detach() for k, v in metrics.items()}


def reinforce_loss(
    logprobs: torch.Tensor,
    advantages: torch.Tensor,
    action_mask: torch.Tensor,
    agg: str = "token-mean",
    num_tokens: int | torch.Tensor | None = None,
    num_seqs: int | torch.Tensor | None = None,
    *,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """REINFORCE policy-gradient loss ``-A_t log pi(a_t | s_t)`` (Williams 1992), aggregated over action tokens.

    With RLOO (``rloo_baseline``) or GRPO (``group_normalize``) advantages broadcast over a response's tokens
    this is the on-policy loss of Ahmadian 2024 / Shao 2024. ``advantages`` are constants (detached).

    Args:
        logprobs: [B, R] log pi_theta(token), with grad.
        advantages: [B, R].
        action_mask: [B, R] bool.
        agg, num_tokens, num_seqs: see ``aggregate_loss``.
        rollout_is_weights: [B, R] rollout-correction weights (``-w A log pi``, verl's IS-weighted
            REINFORCE), or None.

    Returns:
        ``(loss, metrics)``: loss 0-dim float32; metrics ``advantages_mean``, ``logprobs_mean`` (detached).

    Raises:
        ValueError: mismatched shapes or unknown ``agg``.
    """
    _check_per_token(action_mask, logprobs=logprobs, advantages=advantages)
    _checks.aggregation(agg)
    dtype = _checks.compute_dtype(logprobs, advantages)
    mask = action_mask.to(torch.bool)
    lp = logprobs.to(dtype)
    adv = advantages.detach().to(dtype)
    loss = aggregate_loss(_is_weighted(-adv * lp, rollout_is_weights, mask), mask, agg, num_tokens, num_seqs)
    metrics = {"advantages_mean": masked_mean(adv, mask), "logprobs_mean": masked_mean(lp.detach(), mask)}
    return loss, metrics


def positive_example_nll_loss(
    logprobs: torch.Tensor,
    action_mask: torch.Tensor,
    rewards: torch.Tensor,
    num_tokens: int | torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """VAPO's positive-example NLL: ``mean(-log pi(a_t | s_t))`` over the action tokens of the rows with reward
    > 0 (Yue 2025, VAPO eq. 10; NeMo-RL ``ClippedPGLossFn``, ``positive_example_nll_weight``,
    nemo_rl/algorithms/loss/loss_functions.py). The caller adds ``mu *`` it to the policy loss.

    Args:
        logprobs: [B, R] log pi_theta(token), with grad.
        action_mask: [B, R] bool (the loss mask).
        rewards: [B] the rows' rewards; a row counts when its reward is > 0.
        num_tokens: the divisor; None = this call's positive action tokens (NeMo-RL's ``correct_valid_toks``,
            counted per microbatch).

    Returns:
        ``(loss, metrics)``: loss 0-dim float32, 0 when no row has a positive reward; metrics
        ``positive_tokens`` (this call's count, detached).

    Raises:
        ValueError: mismatched shapes.
    """
    _check_per_token(action_mask, logprobs=logprobs)
    _checks.ndim("rewards", rewards, 1, "[B]")
    if rewards.shape[0] != action_mask.shape[0]:
        raise ValueError(f"rewards has {rewards.shape[0]} rows but action_mask has {action_mask.shape[0]}")
    mask = action_mask.to(torch.bool) & (rewards.detach() > 0)[:, None]
    lp = logprobs.to(_checks.compute_dtype(logprobs))
    count = mask.sum()
    den = count.clamp(min=1) if num_tokens is None else num_tokens
    loss = torch.where(mask, -lp, torch.zeros((), dtype=lp.dtype, device=lp.device)).sum() / den
    return loss, {"positive_tokens": count.detach().float()}


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    action_mask: torch.Tensor,
    clip_eps: float | None = None,
    agg: str = "token-mean",
    num_tokens: int | torch.Tensor | None = None,
    num_seqs: int | torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Critic regression loss ``0.5 (V - R)^2``, optionally with PPO2 value clipping.

    With ``clip_eps``: ``0.5 max((V - R)^2, (V_old + clip(V - V_old, -eps, eps) - R)^2)`` (the clipped value
    objective of OpenAI baselines' PPO2; Andrychowicz 2021 found it often hurts, so it is off by default).
    ``old_values`` and ``returns`` are constants (detached).

    Args:
        values: [B, R] current critic values, with grad.
        old_values: [B, R] values from the rollout.
        returns: [B, R] targets (e.g. from ``gae``).
        action_mask: [B, R] bool.
        clip_eps: value clip range (> 0), or None.
        agg, num_tokens, num_seqs: see ``aggregate_loss``.

    Returns:
        ``(loss, metrics)``: loss 0-dim float32; metrics ``clipfrac`` (tokens where the clipped error is
        the larger), ``values_mean``, ``explained_variance`` (1 - Var[R - V] / Var[R]), detached.

    Raises:
        ValueError: mismatched shapes, ``clip_eps <= 0``, unknown ``agg``.
    """
    _check_per_token(action_mask, values=values, old_values=old_values, returns=returns)
    _checks.aggregation(agg)
    if clip_eps is not None:
        _checks.in_range("clip_eps", clip_eps, 0, math.inf, low_open=True, high_open=True)
    dtype = _checks.compute_dtype(values, old_values, returns)
    mask = action_mask.to(torch.bool)
    v = values.to(dtype)
    ret = returns.detach().to(dtype)
    error = (v - ret) ** 2
    clipped_larger = torch.zeros_like(mask)
    if clip_eps is not None:
        old = old_values.detach().to(dtype)
        clipped_error = (old + torch.clamp(v - old, -clip_eps, clip_eps) - ret) ** 2
        clipped_larger = clipped_error > error
        error = torch.maximum(error, clipped_error)
    loss = aggregate_loss(0.5 * error, mask, agg, num_tokens, num_seqs)
    with torch.no_grad():
        var_returns = masked_var(ret, mask)
        explained = 1.0 - masked_var(ret - v, mask) / var_returns.clamp(min=1e-8)
        metrics = {
            "clipfrac": masked_mean(clipped_larger.to(dtype), mask),
            "values_mean": masked_mean(v, mask),
            "explained_variance": explained,
        }
    return loss, {k: val.detach() for k, val in metrics.items()}
