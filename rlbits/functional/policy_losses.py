"""Policy-gradient losses of the RL-for-LLM literature behind one signature, keyed by verl's ``loss_mode``
names.

Every function in ``POLICY_LOSSES`` is called as::

    loss, metrics = fn(logprobs, old_logprobs, advantages, action_mask, *, agg=..., num_tokens=None,
                       num_seqs=None, **hyper)

with ``logprobs`` [B, R] float (log pi_theta of the sampled tokens, with grad), ``old_logprobs`` [B, R]
(log pi_old from the rollout), ``advantages`` [B, R] and ``action_mask`` [B, R] bool. Every loss also takes
``rollout_is_weights`` [B, R] (verl's name; default None): a rollout correction's detached weights
(``rlbits.functional.rollout_correction``), which multiply each token's loss before aggregation, as in
verl 0.9 (``pg_losses * rollout_is_weights``); ``geo_mean`` instead multiplies each row's loss by the
row's geometric mean of the weights, as verl does. ``old_logprobs`` and
``advantages`` are constants (detached). The clip range is ``clip_eps`` / ``clip_eps_high`` (verl's
``clip_ratio_low`` / ``clip_ratio_high``); other hyperparameters take verl's config names. ``agg``,
``num_tokens``, ``num_seqs`` are those of ``aggregate_loss``. ``loss`` is a 0-dim tensor (float32 for
half-precision inputs); ``metrics`` a dict of detached 0-dim tensors over the local action tokens (no host
sync, so every loss compiles with ``torch.compile(fullgraph=True)``).

Source of truth: verl 0.9's ``verl/trainer/ppo/core_algos.py`` (tag v0.9.0, commit 483b8a0; the file is the
same in 0.10.0.dev). Conventions shared by all losses that differ from verl:

- padding tokens never reach ``exp`` (their log-ratio is set to 0 first), so padding holding any value,
  even ``inf``, leaves the loss and gradient finite; verl computes on padding and masks afterwards.
- ``approx_kl`` is the k3 estimate ``mean(r - 1 - log r)`` of KL(pi_old || pi_theta), as ``ppo_loss``
  reports; verl's ``ppo_kl`` is k1 ``mean(-log r)``.
- rows without action tokens are left out of the ``seq-*`` row averages (as verl's ``agg_loss`` does).

``clip_cov`` and ``kl_cov`` pick the tokens they change by a count that depends on the data; they do it with
a fixed-shape sort over the batch instead of verl's host-side ``nonzero`` / ``topk``, so they compile
without a graph break. Their covariance statistics are over the tokens of the call (a microbatch), as in
verl.

Of verl's registry only ``bypass_mode`` is not here, as it is not a loss of its own: inside verl's trainer
it takes the sampler's logprobs as ``old_log_prob``, computes rollout-correction IS weights and rejection
masks from its ``rollout_correction`` config, and forwards to ``vanilla`` or an IS-weighted REINFORCE loss;
in rlbits that is ``vanilla`` (or ``gpg``) called with the sampler's logprobs as ``old_logprobs``, plus a
rollout correction.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from rlbits.functional import _checks
from rlbits.functional.losses import _check_per_token, _is_weighted, aggregate_loss, ppo_loss, reinforce_loss
from rlbits.functional.masked import masked_mean

__all__ = [
    "POLICY_LOSSES",
    "cispo_loss",
    "clip_cov_loss",
    "dppo_kl_loss",
    "dppo_tv_loss",
    "dro_loss",
    "geo_mean_loss",
    "gpg_loss",
    "gspo_loss",
    "kl_cov_loss",
    "sapo_loss",
    "vanilla_loss",
]


def _prepare(logprobs, old_logprobs, advantages, action_mask, agg):
    """Checks, the compute dtype, and (mask, logprobs, log-ratio, advantages) with padding zeroed."""
    _check_per_token(action_mask, logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages)
    _checks.aggregation(agg)
    dtype = _checks.compute_dtype(logprobs, old_logprobs, advantages)
    mask = action_mask.to(torch.bool)
    zero = torch.zeros((), dtype=dtype, device=logprobs.device)
    lp = torch.where(mask, logprobs.to(dtype), zero)
    old = torch.where(mask, old_logprobs.detach().to(dtype), zero)
    adv = advantages.detach().to(dtype)
    return mask, lp, old, lp - old, adv


def _k3(log_ratio, mask):
    return masked_mean(torch.expm1(log_ratio) - log_ratio, mask)


def _detached(metrics):
    return {k: v.detach() for k, v in metrics.items()}


def vanilla_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    action_mask: torch.Tensor,
    *,
    agg: str = "token-mean",
    num_tokens: int | torch.Tensor | None = None,
    num_seqs: int | torch.Tensor | None = None,
    clip_eps: float = 0.2,
    clip_eps_high: float | None = None,
    clip_ratio_c: float | None = 3.0,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO's clipped surrogate with clip-higher and dual clip: verl's ``loss_mode: vanilla``.

    ``l = max(-A r, -A clip(r, 1 - clip_eps, 1 + clip_eps_high))`` with ``r = exp(logprobs - old_logprobs)``
    (Schulman 2017, eq. 7; clip-higher: Yu 2025, DAPO, eq. 10), and for ``A < 0`` capped at
    ``-clip_ratio_c A`` (dual clip, Ye 2020, eq. 5). This is ``ppo_loss(..., dual_clip=clip_ratio_c)``.

    Args:
        logprobs, old_logprobs, advantages, action_mask: [B, R]; see the module docstring.
        rollout_is_weights: [B, R] rollout-correction weights, or None; see the module docstring.
        agg, num_tokens, num_seqs: see ``aggregate_loss``.
        clip_eps, clip_eps_high: verl's ``clip_ratio_low`` / ``clip_ratio_high`` (>= 0).
        clip_ratio_c: verl's dual-clip bound (> 1; verl's default 3.0), or None for no dual clip.

    Returns:
        ``(loss, metrics)`` as ``ppo_loss``: ``clipfrac``, ``approx_kl``, ``ratio_mean``, ``dual_clipfrac``.

    Differs from verl: verl clamps the log-ratio to [-20, 20] before ``exp``; this does not (the values agree
    unless a ratio passes e^20).

    Raises:
        ValueError: mismatched shapes, negative clip ranges, ``clip_ratio_c <= 1``, unknown ``agg``.
    """
    return ppo_loss(
        logprobs,
        old_logprobs,
        advantages,
        action_mask,
        clip_eps=clip_eps,
        clip_eps_high=clip_eps_high,
        dual_clip=clip_ratio_c,
        agg=agg,
        num_tokens=num_tokens,
        num_seqs=num_seqs,
        rollout_is_weights=rollout_is_weights,
    )


def gspo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    action_mask: torch.Tensor,
    *,
    agg: str = "seq-mean-token-mean",
    num_tokens: int | torch.Tensor | None = None,
    num_seqs: int | torch.Tensor | None = None,
    clip_eps: float = 0.2,
    clip_eps_high: float | None = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Group Sequence Policy Optimization (Zheng 2025, arXiv:2507.18071, eqs. 5-7; GSPO-token, eq. 13):
    verl's ``loss_mode: gspo``.

    The sequence ratio ``s_i = exp(mean_t log(pi_theta / pi_old))`` over row i's action tokens is applied at
    every token through GSPO-token's ``s_it = sg[s_i] * pi_theta(y_it) / sg[pi_theta(y_it)]`` (equal to
    ``s_i`` in value; its gradient flows through each token's own logprob), then
    ``l_it = max(-A_it s_it, -A_it clip(s_it, 1 - clip_eps, 1 + clip_eps_high))``. As in verl, ``log s_it`` is
    clamped at 10 before ``exp`` (no gradient flows above it). GSPO uses small clip ranges (the paper:
    3e-4 / 4e-4).

    Args:
        logprobs, old_logprobs, advantages, action_mask: [B, R]; see the module docstring.
        rollout_is_weights: [B, R] rollout-correction weights, or None; see the module docstring.
        agg, num_tokens, num_seqs: see ``aggregate_loss``. The default is GSPO's sequence mean.
        clip_eps, clip_eps_high: verl's ``clip_ratio_low`` / ``clip_ratio_high`` (>= 0).

    Returns:
        ``(loss, metrics)``: ``clipfrac`` (tokens where the clipped term is active), ``approx_kl`` (token k3),
        ``ratio_mean`` (mean of ``s_i`` over action tokens).

    Differs from verl: verl always aggregates GSPO with ``seq-mean-token-mean`` whatever ``loss_agg_mode``
    says; here ``agg`` is honoured and defaults to that mode.

    Raises:
        ValueError: mismatched shapes, negative clip ranges, unknown ``agg``.
    """
    mask, lp, _, log_ratio, adv = _prepare(logprobs, old_logprobs, advantages, action_mask, agg)
    low, high = _checks.clip_range(clip_eps, clip_eps_high)
    seq_log_ratio = log_ratio.sum(dim=1) / mask.sum(dim=1).clamp(min=1)
    log_s = lp - lp.detach() + seq_log_ratio.detach().unsqueeze(-1)
    s = torch.exp(torch.clamp(log_s, max=10.0))
    unclipped = -adv * s
    clipped = -adv * torch.clamp(s, 1.0 - low, 1.0 + high)
    per_token = _is_weighted(torch.maximum(unclipped, clipped), rollout_is_weights, mask)
    loss = aggregate_loss(per_token, mask, agg, num_tokens, num_seqs)
    with torch.no_grad():
        metrics = {
            "clipfrac": masked_mean((clipped > unclipped).to(s.dtype), mask),
            "approx_kl": _k3(log_ratio, mask),
            "ratio_mean": masked_mean(s, mask),
        }
    return loss, _detached(metrics)


def cispo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    action_mask: torch.Tensor,
    *,
    agg: str = "token-mean",
    num_tokens: int | torch.Tensor | None = None,
    num_seqs: int | torch.Tensor | None = None,
    clip_eps: float = 0.2,
    clip_eps_high: float | None = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped IS-weight Policy Optimization (MiniMax-M1, arXiv:2506.13585, eqs. 4-5): verl's
    ``loss_mode: cispo``.

    ``l_t = -sg[clip(r_t, 1 - clip_eps, 1 + clip_eps_high)] A_t log pi_theta(y_t)``: the importance weight
    is clipped and detached, so every token keeps a REINFORCE gradient (no token is dropped as in PPO). The
    log-ratio is clamped to [-20, 20] before ``exp``, as verl does. The paper sets no lower bound
    (a large ``clip_eps``) and tunes only the upper one.

    Args:
        logprobs, old_logprobs, advantages, action_mask: [B, R]; see the module docstring.
        rollout_is_weights: [B, R] rollout-correction weights, or None; see the module docstring.
        agg, num_tokens, num_seqs: see ``aggregate_loss``.
        clip_eps, clip_eps_high: verl's ``clip_ratio_low`` / ``clip_ratio_high`` (>= 0).

    Returns:
        ``(loss, metrics)``: ``clipfrac`` (tokens whose weight was clipped), ``approx_kl``, ``ratio_mean``.

    Raises:
        ValueError: mismatched shapes, negative clip ranges, unknown ``agg``.
    """
    mask, lp, _, log_ratio, adv = _prepare(logprobs, old_logprobs, advantages, action_mask, agg)
    low, high = _checks.clip_range(clip_eps, clip_eps_high)
    ratio = torch.exp(torch.clamp(log_ratio, -20.0, 20.0))
    weight = torch.clamp(ratio, 1.0 - low, 1.0 + high).detach()
    loss = aggregate_loss(_is_weighted(-weight * adv * lp, rollout_is_weights, mask), mask, agg, num_tokens, num_seqs)
    with torch.no_grad():
        metrics = {
            "clipfrac": masked_mean((ratio != weight).to(ratio.dtype), mask),
            "approx_kl": _k3(log_ratio, mask),
            "ratio_mean": masked_mean(ratio, mask),
        }
    return loss, _detached(metrics)


def geo_mean_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    action_mask: torch.Tensor,
    *,
    agg: str = "seq-mean-token-mean",
    num_tokens: int | torch.Tensor | None = None,
    num_seqs: int | torch.Tensor | None = None,
    clip_eps: float = 0.2,
    clip_eps_high: float | None = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Geometric-Mean Policy Optimization (GMPO, Zhao 2025, arXiv:2507.20673, eq. 4): verl's
    ``loss_mode: geo_mean``.

    Per row: each token's log-ratio is clipped in log space, ``c_t = sgn(A) min(sgn(A) d_t,
    sgn(A) clip(d_t, -clip_eps, clip_eps_high))`` with ``d_t = log pi_theta - log pi_old``; the row's ratio is
    the geometric mean ``rho = exp(mean_t c_t)`` and its loss ``-mean_t(A_t) rho``. The row losses are
    averaged over rows. GMPO's advantage is per sequence (a constant over the row's tokens).

    Args:
        logprobs, old_logprobs, advantages, action_mask: [B, R]; see the module docstring.
        rollout_is_weights: [B, R] rollout-correction weights, or None; see the module docstring.
        agg: validated and ignored: the loss is a sequence mean by definition (verl ignores it too).
        num_tokens: unused (the signature is shared).
        num_seqs: the row-average denominator; default the local count of rows with action tokens.
        clip_eps, clip_eps_high: verl's ``clip_ratio_low`` / ``clip_ratio_high`` (>= 0; GMPO uses 0.4).

    Returns:
        ``(loss, metrics)``: ``clipfrac`` (tokens with A > 0 whose log-ratio was clipped),
        ``clipfrac_lower`` (same for A < 0), ``approx_kl``, ``ratio_mean`` (mean of ``rho`` over rows with
        action tokens).

    Differs from verl: verl averages over all B rows, empty ones included (each contributing 0); this
    leaves empty rows out (rlbits' ``num_seqs`` convention), so verl's value is this one times
    ``(non-empty rows) / B``.

    Raises:
        ValueError: mismatched shapes, negative clip ranges, unknown ``agg``.
    """
    del num_tokens
    mask, _, _, log_ratio, adv = _prepare(logprobs, old_logprobs, advantages, action_mask, agg)
    low, high = _checks.clip_range(clip_eps, clip_eps_high)
    sign = torch.sign(adv)
    clamped = torch.clamp(log_ratio, -low, high)
    chosen = sign * torch.minimum(sign * log_ratio, sign * clamped)
    count = mask.sum(dim=1)
    zero = torch.zeros((), dtype=adv.dtype, device=adv.device)
    denom = count.clamp(min=1)
    rho = torch.exp(torch.where(mask, chosen, zero).sum(dim=1) / denom)
    adv_row = torch.where(mask, adv, zero).sum(dim=1) / denom
    rows = count > 0
    row_loss = -adv_row * rho
    if rollout_is_weights is not None:  # verl: the row's geometric mean of the weights, log(w + 1e-10)
        _check_per_token(action_mask, rollout_is_weights=rollout_is_weights)
        log_w = torch.log(rollout_is_weights.detach().to(adv.dtype) + 1e-10)
        row_loss = row_loss * torch.exp(torch.where(mask, log_w, zero).sum(dim=1) / denom)
    row_loss = torch.where(rows, row_loss, zero)
    loss = row_loss.sum() / (rows.sum().clamp(min=1) if num_seqs is None else num_seqs)
    with torch.no_grad():
        was_clipped = (log_ratio != clamped).to(adv.dtype)
        metrics = {
            "clipfrac": masked_mean(was_clipped * (adv > 0), mask),
            "clipfrac_lower": masked_mean(was_clipped * (adv < 0), mask),
            "approx_kl": _k3(log_ratio, mask),
            "ratio_mean": masked_mean(rho, rows),
        }
    return loss, _detached(metrics)


def sapo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    action_mask: torch.Tensor,
    *,
    agg: str = "seq-mean-token-mean",
    num_tokens: int | torch.Tensor | None = None,
    num_seqs: int | torch.Tensor | None = None,
    tau_pos: float = 1.0,
    tau_neg: float = 1.05,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Soft Adaptive Policy Optimization (Gao 2025, arXiv:2511.20347, eq. 5): verl's ``loss_mode: sapo``.

    A smooth gate replaces the hard clip: ``l_t = -f(r_t) A_t`` with ``f(r) = (4 / tau) sigmoid(tau (r - 1))``
    (its gradient ``sigmoid'`` peaks at ``r = 1`` and decays smoothly away from it), ``tau = tau_pos`` where
    ``A_t > 0`` and ``tau_neg`` elsewhere. The log-ratio is clamped to [-20, 20] before ``exp``, as verl does.

    Args:
        logprobs, old_logprobs, advantages, action_mask: [B, R]; see the module docstring.
        rollout_is_weights: [B, R] rollout-correction weights, or None; see the module docstring.
        agg, num_tokens, num_seqs: see ``aggregate_loss``; the default is SAPO's sequence mean.
        tau_pos, tau_neg: verl's temperatures (> 0; verl's defaults 1.0 and 1.05).

    Returns:
        ``(loss, metrics)``: ``approx_kl``, ``ratio_mean`` (no clip fraction: nothing is clipped).

    Differs from verl: verl always aggregates SAPO with ``seq-mean-token-mean``; here ``agg`` is honoured
    and defaults to that mode.

    Raises:
        ValueError: mismatched shapes, non-positive temperatures, unknown ``agg``.
    """
    mask, _, _, log_ratio, adv = _prepare(logprobs, old_logprobs, advantages, action_mask, agg)
    _checks.in_range("tau_pos", tau_pos, 0, math.inf, low_open=True, high_open=True)
    _checks.in_range("tau_neg", tau_neg, 0, math.inf, low_open=True, high_open=True)
    ratio = torch.exp(torch.clamp(log_ratio, -20.0, 20.0))
    tau = torch.where(adv > 0, tau_pos, tau_neg).to(adv.dtype)
    gate = torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)
    loss = aggregate_loss(_is_weighted(-gate * adv, rollout_is_weights, mask), mask, agg, num_tokens, num_seqs)
    with torch.no_grad():
        metrics = {"approx_kl": _k3(log_ratio, mask), "ratio_mean": masked_mean(ratio, mask)}
    return loss, _detached(metrics)


def gpg_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    action_mask: torch.Tensor,
    *,
    agg: str = "token-mean",
    num_tokens: int | torch.Tensor | None = None,
    num_seqs: int | torch.Tensor | None = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Group Policy Gradient (Chu 2025, arXiv:2504.02546, eq. 4): verl's ``loss_mode: gpg``.

    The plain policy gradient ``l_t = -A_t log pi_theta(y_t)`` with no ratio and no clip (GPG's
    corrections live in its advantage estimator). ``old_logprobs`` enters only the metrics.

    Args:
        logprobs, old_logprobs, advantages, action_mask: [B, R]; see the module docstring.
        rollout_is_weights: [B, R] rollout-correction weights, or None; see the module docstring.
        agg, num_tokens, num_seqs: see ``aggregate_loss``.

    Returns:
        ``(loss, metrics)``: ``approx_kl``, ``ratio_mean`` (verl returns none).

    Raises:
        ValueError: mismatched shapes, unknown ``agg``.
    """
    mask, _, _, log_ratio, _ = _prepare(logprobs, old_logprobs, advantages, action_mask, agg)
    loss, _ = reinforce_loss(
        logprobs, advantages, action_mask, agg, num_tokens, num_seqs, rollout_is_weights=rollout_is_weights
    )
    with torch.no_grad():
        metrics = {"approx_kl": _k3(log_ratio, mask), "ratio_mean": masked_mean(torch.exp(log_ratio), mask)}
    return loss, _detached(metrics)


def dro_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    action_mask: torch.Tensor,
    *,
    agg: str = "token-mean",
    num_tokens: int | torch.Tensor | None = None,
    num_seqs: int | torch.Tensor | None = None,
    dro_beta: float | None = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Direct Reward Optimization with a quadratic log-ratio penalty: verl's ``loss_mode: dro``.

    ``l_t = -(A_t log pi_theta(y_t) - (dro_beta / 2) (log pi_theta(y_t) - log pi_old(y_t))^2)``: the policy
    gradient with a proximal penalty on the log-ratio in place of a clip. Direct Reward Optimisation is
    Richemond 2024 ("Offline regularised reinforcement learning for large language models alignment",
    arXiv:2405.19107); this is the per-token form verl writes in its ``docs/algo/dro.md``, which expects the
    caller to supply advantages suited to DRO's soft off-policy setting.

    Args:
        logprobs, old_logprobs, advantages, action_mask: [B, R]; see the module docstring.
        rollout_is_weights: [B, R] rollout-correction weights, or None; see the module docstring.
        agg, num_tokens, num_seqs: see ``aggregate_loss``.
        dro_beta: penalty strength, > 0; verl's ``policy_loss.dro_beta`` (no default there either).

    Returns:
        ``(loss, metrics)``: ``approx_kl``, ``ratio_mean``.

    Raises:
        ValueError: ``dro_beta`` missing or <= 0, mismatched shapes, unknown ``agg``.
    """
    if dro_beta is None:
        raise ValueError("dro_loss needs dro_beta > 0 (the weight of its log-ratio penalty); got None")
    mask, lp, _, log_ratio, adv = _prepare(logprobs, old_logprobs, advantages, action_mask, agg)
    _checks.in_range("dro_beta", dro_beta, 0, math.inf, low_open=True, high_open=True)
    per_token = -(lp * adv - 0.5 * dro_beta * log_ratio.square())
    loss = aggregate_loss(_is_weighted(per_token, rollout_is_weights, mask), mask, agg, num_tokens, num_seqs)
    with torch.no_grad():
        metrics = {"approx_kl": _k3(log_ratio, mask), "ratio_mean": masked_mean(torch.exp(log_ratio), mask)}
    return loss, _detached(metrics)


def _rank_descending(key: torch.Tensor) -> torch.Tensor:
    """Each element's position when ``key`` (any shape) is sorted in descending order (0 = largest)."""
    flat = key.reshape(-1)
    order = torch.argsort(flat, descending=True)
    rank = torch.empty_like(order)
    rank.scatter_(0, order, torch.arange(flat.numel(), device=flat.device))
    return rank.reshape(key.shape)


def _count_at_ratio(mask: torch.Tensor, ratio: float) -> torch.Tensor:
    """``max(int(ratio * action tokens), 1)``, as a tensor (no host sync)."""
    return torch.floor(mask.sum().to(torch.float64) * ratio).clamp(min=1)


def clip_cov_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    action_mask: torch.Tensor,
    *,
    agg: str = "token-mean",
    num_tokens: int | torch.Tensor | None = None,
    num_seqs: int | torch.Tensor | None = None,
    clip_eps: float = 0.2,
    clip_eps_high: float | None = None,
    clip_cov_ratio: float = 0.0002,
    clip_cov_lb: float = 1.0,
    clip_cov_ub: float = 5.0,
    generator: torch.Generator | None = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clip-Cov (Cui 2025, "The Entropy Mechanism of RL for Reasoning LMs", arXiv:2505.22617, sec. 4.2):
    verl's ``loss_mode: clip_cov``.

    PPO's clipped surrogate (as ``vanilla``, without dual clip), with the gradient removed from a few tokens
    of high covariance ``cov_t = (A_t - mean A) (log pi_t - mean log pi)`` (means over the action tokens):
    among the tokens PPO does not already clip whose ``clip_cov_lb < cov_t < clip_cov_ub``, a uniformly
    random subset of ``max(int(clip_cov_ratio * action tokens), 1)`` (all of them if fewer) gets loss 0.
    This keeps entropy from collapsing.

    Args:
        logprobs, old_logprobs, advantages, action_mask: [B, R]; see the module docstring.
        rollout_is_weights: [B, R] rollout-correction weights, or None; see the module docstring.
        agg, num_tokens, num_seqs: see ``aggregate_loss``.
        clip_eps, clip_eps_high: verl's ``clip_ratio_low`` / ``clip_ratio_high`` (>= 0).
        clip_cov_ratio: fraction of the action tokens to detach (> 0); verl's default 0.0002.
        clip_cov_lb, clip_cov_ub: the covariance window of the candidates; verl's defaults 1.0 and 5.0.
        generator: the random source of the subset (``torch.rand``'s), or None for the global one.

    Returns:
        ``(loss, metrics)``: ``clipfrac`` (fraction of tokens detached by the covariance rule, verl's
        ``pg_clipfrac``), ``approx_kl``, ``ratio_mean``.

    Differs from verl: the subset is drawn by sorting random keys, not by ``randperm`` of the candidates'
    indices: the same distribution (a uniform subset of that size), not the same draw for a given seed.

    Raises:
        ValueError: mismatched shapes, negative clip ranges, ``clip_cov_ratio <= 0``, unknown ``agg``.
    """
    mask, lp, _, log_ratio, adv = _prepare(logprobs, old_logprobs, advantages, action_mask, agg)
    low, high = _checks.clip_range(clip_eps, clip_eps_high)
    _checks.in_range("clip_cov_ratio", clip_cov_ratio, 0, math.inf, low_open=True, high_open=True)
    ratio = torch.exp(log_ratio)
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1.0 - low, 1.0 + high)
    with torch.no_grad():
        lp_d = lp.detach()
        cov = (adv - masked_mean(adv, mask)) * (lp_d - masked_mean(lp_d, mask))
        candidate = mask & ~(clipped > unclipped) & (cov > clip_cov_lb) & (cov < clip_cov_ub)
        key = torch.where(candidate, torch.rand(adv.shape, generator=generator, device=adv.device), -1.0)
        detached = candidate & (_rank_descending(key) < _count_at_ratio(mask, clip_cov_ratio))
    per_token = torch.where(detached, 0.0, torch.maximum(unclipped, clipped))
    loss = aggregate_loss(_is_weighted(per_token, rollout_is_weights, mask), mask, agg, num_tokens, num_seqs)
    with torch.no_grad():
        metrics = {
            "clipfrac": masked_mean(detached.to(adv.dtype), mask),
            "approx_kl": _k3(log_ratio, mask),
            "ratio_mean": masked_mean(ratio, mask),
        }
    return loss, _detached(metrics)


def kl_cov_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    action_mask: torch.Tensor,
    *,
    agg: str = "token-mean",
    num_tokens: int | torch.Tensor | None = None,
    num_seqs: int | torch.Tensor | None = None,
    kl_cov_ratio: float = 0.0002,
    ppo_kl_coef: float = 0.1,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """KL-Cov (Cui 2025, "The Entropy Mechanism of RL for Reasoning LMs", arXiv:2505.22617, sec. 4.2):
    verl's ``loss_mode: kl_cov``.

    The unclipped surrogate ``-A_t r_t``, plus ``ppo_kl_coef |log r_t|`` on the
    ``max(int(kl_cov_ratio * action tokens), 1)`` tokens of largest covariance
    ``cov_t = (A_t - mean A) (log pi_t - mean log pi)`` (means over the action tokens, detached).

    Args:
        logprobs, old_logprobs, advantages, action_mask: [B, R]; see the module docstring.
        rollout_is_weights: [B, R] rollout-correction weights, or None; see the module docstring.
        agg, num_tokens, num_seqs: see ``aggregate_loss``.
        kl_cov_ratio: fraction of the action tokens penalised (> 0); verl's default 0.0002.
        ppo_kl_coef: weight of the ``|log r|`` penalty; verl's default 0.1 (``actor.policy_loss.ppo_kl_coef``;
            the 1.0 inside verl's function applies only when the config holds None).

    Returns:
        ``(loss, metrics)``: ``kl_abs`` (mean ``|log r|``, verl's ``ppo_kl`` for this loss),
        ``penalised_frac``, ``approx_kl``, ``ratio_mean``.

    Raises:
        ValueError: mismatched shapes, ``kl_cov_ratio <= 0``, unknown ``agg``.
    """
    mask, lp, _, log_ratio, adv = _prepare(logprobs, old_logprobs, advantages, action_mask, agg)
    _checks.in_range("kl_cov_ratio", kl_cov_ratio, 0, math.inf, low_open=True, high_open=True)
    ratio = torch.exp(log_ratio)
    with torch.no_grad():
        lp_d = lp.detach()
        cov = (adv - masked_mean(adv, mask)) * (lp_d - masked_mean(lp_d, mask))
        key = torch.where(mask, cov, -math.inf)
        penalised = mask & (_rank_descending(key) < _count_at_ratio(mask, kl_cov_ratio))
    per_token = -adv * ratio + torch.where(penalised, ppo_kl_coef * log_ratio.abs(), 0.0)
    loss = aggregate_loss(_is_weighted(per_token, rollout_is_weights, mask), mask, agg, num_tokens, num_seqs)
    with torch.no_grad():
        metrics = {
            "kl_abs": masked_mean(log_ratio.abs(), mask),
            "penalised_frac": masked_mean(penalised.to(adv.dtype), mask),
            "approx_kl": _k3(log_ratio, mask),
            "ratio_mean": masked_mean(ratio, mask),
        }
    return loss, _detached(metrics)


def _dppo(lp, old, log_ratio, adv, mask, agg, num_tokens, num_seqs, clip_ratio_c, valid, rollout_is_weights):
    ratio = torch.exp(torch.clamp(log_ratio, -20.0, 20.0))
    weight = torch.clamp(ratio, max=clip_ratio_c).detach()
    valid = valid.detach().to(adv.dtype)
    per_token = _is_weighted(-adv * weight * lp * valid, rollout_is_weights, mask)
    loss = aggregate_loss(per_token, mask, agg, num_tokens, num_seqs)
    with torch.no_grad():
        metrics = {
            "clipfrac": masked_mean(1.0 - valid, mask),
            "truncfrac": masked_mean((ratio > clip_ratio_c).to(adv.dtype) * valid, mask),
            "approx_kl": _k3(log_ratio, mask),
            "ratio_mean": masked_mean(ratio, mask),
        }
    return loss, _detached(metrics)


def _dppo_args(clip_eps, clip_eps_high, clip_ratio_c):
    low, high = _checks.clip_range(clip_eps, clip_eps_high)
    _checks.in_range("clip_ratio_c", clip_ratio_c, 0, math.inf, low_open=True, high_open=True)
    return low, high


def dppo_tv_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    action_mask: torch.Tensor,
    *,
    agg: str = "token-mean",
    num_tokens: int | torch.Tensor | None = None,
    num_seqs: int | torch.Tensor | None = None,
    clip_eps: float = 0.2,
    clip_eps_high: float | None = None,
    clip_ratio_c: float = 3.0,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DPPO-Binary-TV (divergence-bounded PPO, arXiv:2602.04879): verl's ``loss_mode: dppo_tv``.

    ``l_t = -A_t sg[min(r_t, clip_ratio_c)] log pi_theta(y_t) m_t``: a truncated-IS policy gradient where the
    trust-region mask ``m_t`` drops a token whose probability moved past the total-variation bound in the
    direction its advantage pushes: ``p - p_old <= clip_eps_high`` where ``A > 0``, ``p - p_old >= -clip_eps``
    elsewhere (``p = exp(logprobs)``). Here ``clip_eps`` / ``clip_eps_high`` are probability differences,
    not ratio ranges. The log-ratio is clamped to [-20, 20] before ``exp``, as verl does.

    Args:
        logprobs, old_logprobs, advantages, action_mask: [B, R]; see the module docstring.
        rollout_is_weights: [B, R] rollout-correction weights, or None; see the module docstring.
        agg, num_tokens, num_seqs: see ``aggregate_loss``.
        clip_eps, clip_eps_high: TV bounds (verl's ``clip_ratio_low`` / ``clip_ratio_high``), >= 0.
        clip_ratio_c: truncation of the detached IS weight (> 0); verl's default 3.0 (``actor.clip_ratio_c``,
            which verl's DPPO reads; its fallback 20.0 applies only to a config without that field).

    Returns:
        ``(loss, metrics)``: ``clipfrac`` (tokens masked out), ``truncfrac`` (kept tokens whose weight was
        truncated; verl's ``pg_clipfrac_lower``), ``approx_kl``, ``ratio_mean``.

    Raises:
        ValueError: mismatched shapes, negative bounds, ``clip_ratio_c <= 0``, unknown ``agg``.
    """
    mask, lp, old, log_ratio, adv = _prepare(logprobs, old_logprobs, advantages, action_mask, agg)
    low, high = _dppo_args(clip_eps, clip_eps_high, clip_ratio_c)
    diff = torch.exp(lp) - torch.exp(old)
    valid = torch.where(adv > 0, diff <= high, diff >= -low)
    return _dppo(
        lp, old, log_ratio, adv, mask, agg, num_tokens, num_seqs, clip_ratio_c, valid, rollout_is_weights
    )


def dppo_kl_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    action_mask: torch.Tensor,
    *,
    agg: str = "token-mean",
    num_tokens: int | torch.Tensor | None = None,
    num_seqs: int | torch.Tensor | None = None,
    clip_eps: float = 0.2,
    clip_eps_high: float | None = None,
    clip_ratio_c: float = 3.0,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DPPO-Binary-KL (divergence-bounded PPO, arXiv:2602.04879): verl's ``loss_mode: dppo_kl``.

    As ``dppo_tv_loss`` with the trust region measured by the KL between the Bernoulli distributions
    "this token / any other":
    ``D = p_old log(p_old / p) + (1 - p_old) log((1 - p_old + 1e-8) / (1 - p + 1e-8))``.
    A token is kept where ``A > 0`` if ``D <= clip_eps_high`` or ``p <= p_old``, and elsewhere if
    ``D <= clip_eps`` or ``p >= p_old`` (moves against the advantage's push always stay).

    Args:
        logprobs, old_logprobs, advantages, action_mask: [B, R]; see the module docstring.
        rollout_is_weights: [B, R] rollout-correction weights, or None; see the module docstring.
        agg, num_tokens, num_seqs: see ``aggregate_loss``.
        clip_eps, clip_eps_high: binary-KL bounds (verl's ``clip_ratio_low`` / ``clip_ratio_high``), >= 0.
        clip_ratio_c: truncation of the detached IS weight (> 0); verl's default 3.0 (``actor.clip_ratio_c``,
            which verl's DPPO reads; its fallback 20.0 applies only to a config without that field).

    Returns:
        ``(loss, metrics)`` as ``dppo_tv_loss``.

    Raises:
        ValueError: mismatched shapes, negative bounds, ``clip_ratio_c <= 0``, unknown ``agg``.
    """
    mask, lp, old, log_ratio, adv = _prepare(logprobs, old_logprobs, advantages, action_mask, agg)
    low, high = _dppo_args(clip_eps, clip_eps_high, clip_ratio_c)
    p, p_old = torch.exp(lp), torch.exp(old)
    binary_kl = p_old * (old - lp) + (1.0 - p_old) * torch.log((1.0 - p_old + 1e-8) / (1.0 - p + 1e-8))
    valid = torch.where(adv > 0, (binary_kl <= high) | (p <= p_old), (binary_kl <= low) | (p >= p_old))
    return _dppo(
        lp, old, log_ratio, adv, mask, agg, num_tokens, num_seqs, clip_ratio_c, valid, rollout_is_weights
    )


POLICY_LOSSES: dict[str, Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]] = {
    "vanilla": vanilla_loss,
    "gspo": gspo_loss,
    "cispo": cispo_loss,
    "geo_mean": geo_mean_loss,
    "sapo": sapo_loss,
    "gpg": gpg_loss,
    "dppo_tv": dppo_tv_loss,
    "dppo_kl": dppo_kl_loss,
    "dro": dro_loss,
    "clip_cov": clip_cov_loss,
    "kl_cov": kl_cov_loss,
}
"""verl's ``loss_mode`` name -> policy loss with the shared signature (see this module's docstring)."""
