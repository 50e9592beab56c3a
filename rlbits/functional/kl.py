"""Per-token estimators of KL(pi || pi_ref) from log-probabilities of sampled tokens."""

from __future__ import annotations

import math

import torch

from rlbits.functional import _checks

KL_ESTIMATORS = ("k1", "abs", "k2", "k3", "k1+", "k3+")


def kl_penalty(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    estimator: str = "k1",
    *,
    clamp: float | None = None,
    input_clamp: float | None = None,
) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) for tokens sampled from pi.

    With ``d = logprobs - ref_logprobs`` (Schulman 2020, "Approximating KL divergence"):

    - ``k1``: ``d``. Unbiased, high variance, can be negative per token.
    - ``abs``: ``|d|``.
    - ``k2``: ``0.5 d^2``. Biased, low variance; its gradient is that of the true KL (on-policy).
    - ``k3``: ``exp(-d) + d - 1``. Unbiased and always >= 0 (used by GRPO, Shao 2024, as a loss term).
    - ``k1+``, ``k3+``: straight-through estimators (verl's names, ``kl_loss_type``, verl >= 0.6): the
      *value* of ``k1`` (resp. ``k3``) and the *gradient* of ``k2``, i.e. ``value.detach() + k2 -
      k2.detach()``. As a loss term, the expected gradient of ``k2`` on-policy is the gradient of the true
      KL, which the gradients of ``k1`` (0 in expectation) and ``k3`` are not.

    ``clamp=c`` clips the per-token estimate to ``[-c, c]`` (verl clamps ``k3`` to ``[-10, 10]``;
    OpenRLHF 0.11 clamps ``k1``-``k3`` to ``[-10, 10]``; NeMo-RL's ``calculate_kl`` clamps its output to
    ``[-10, 10]`` by default), so one token far off the reference cannot dominate a loss or a reward. Where
    the clamp is active the gradient is 0, except for ``k1+`` / ``k3+``, whose gradient is always that of
    the unclamped ``k2`` (only their value is clamped, as verl clamps only the forward score). ``d`` is
    clipped to ``[-(c + 1), c + 1]`` before ``exp``: every estimator is already beyond ``c`` there, so
    values are unchanged, and ``exp`` cannot overflow into an ``inf * 0 = NaN`` gradient. ``clamp=None``
    (default) applies no clip at all.

    ``input_clamp=c_in`` clips the log-ratio ``d`` itself to ``[-c_in, c_in]`` before any estimator is
    computed (NeMo-RL's ``kl_input_clamp_value``, ``ClippedPGLossConfig`` in
    ``nemo_rl/algorithms/loss/loss_functions.py``, applied in ``calculate_kl``, ``nemo_rl/algorithms/utils.py``;
    its default 20, with ``kl_output_clamp_value`` = ``clamp`` 10). Every estimator, the straight-through
    ``k2`` gradient of ``k1+`` / ``k3+`` included, then sees the clipped ``d``: where the clip is active the
    gradient is 0. ``None`` (default) = no input clip. With both, the input clip comes first.

    No mask is applied: where both inputs hold 0 (padding, as in the batch schema) every estimator is 0.
    Mask before reducing.

    Args:
        logprobs: [B, R] log pi(token), float32 or bf16.
        ref_logprobs: [B, R] log pi_ref(token), same shape.
        estimator: one of ``k1``, ``abs``, ``k2``, ``k3``, ``k1+``, ``k3+``.
        clamp: keyword-only; a finite number > 0, or None (no clip of the estimate).
        input_clamp: keyword-only; a finite number > 0, or None (no clip of ``d``).

    Returns:
        [B, R] in the promoted input dtype (computed in float32 for half precision), in nats.

    Raises:
        ValueError: unknown estimator, ``clamp`` or ``input_clamp`` not a finite number > 0, or shapes differ.
    """
    if not isinstance(estimator, str) or estimator not in KL_ESTIMATORS:
        raise ValueError(f"unknown KL estimator {estimator!r}; expected one of {', '.join(KL_ESTIMATORS)}")
    if clamp is not None:
        _checks.in_range("clamp", clamp, 0, math.inf, low_open=True, high_open=True)
    if input_clamp is not None:
        _checks.in_range("input_clamp", input_clamp, 0, math.inf, low_open=True, high_open=True)
    _checks.same_shape(logprobs=logprobs, ref_logprobs=ref_logprobs)
    out_dtype = torch.promote_types(logprobs.dtype, ref_logprobs.dtype)
    dtype = _checks.compute_dtype(logprobs, ref_logprobs)
    d = logprobs.to(dtype) - ref_logprobs.to(dtype)
    if input_clamp is not None:
        d = torch.clamp(d, -input_clamp, input_clamp)
    base = estimator.rstrip("+")
    # Past |d| = c + 1 every estimator exceeds c (k3: exp(c + 1) - c - 2 > c and d - 1 >= c), so this clip
    # changes no value and keeps exp finite.
    x = d if clamp is None else torch.clamp(d, -(clamp + 1), clamp + 1)
    if base == "k1":
        kl = x
    elif base == "abs":
        kl = x.abs()
    elif base == "k2":
        kl = 0.5 * x * x
    else:
        # exp(ref - logp) - (ref - logp) - 1; expm1 keeps precision where d is near 0.
        kl = torch.expm1(-x) + x
    if clamp is not None:
        kl = torch.clamp(kl, -clamp, clamp)
    if estimator.endswith("+"):
        k2 = 0.5 * d * d
        kl = kl.detach() + (k2 - k2.detach())
    return kl.to(out_dtype)


def adaptive_kl_coef(
    kl_coef: float | torch.Tensor, current_kl: float | torch.Tensor, target: float, horizon: float, n_steps: int
) -> float | torch.Tensor:
    """One update of the adaptive KL controller (Ziegler 2019, "Fine-tuning language models from human
    preferences", sec. 2.2): ``beta <- beta * (1 + clip(KL / target - 1, -0.2, 0.2) * n_steps / horizon)``.

    Args:
        kl_coef: the current beta.
        current_kl: the observed KL per sequence (nats), a float or 0-dim tensor.
        target: the KL the controller steers towards (> 0).
        horizon: how many samples a full proportional correction takes (> 0).
        n_steps: samples (sequences) seen since the last update.

    Returns:
        The new beta, the type of ``kl_coef`` (tensor or float).

    Raises:
        ValueError: ``target <= 0`` or ``horizon <= 0``.
    """
    if not target > 0 or not horizon > 0:
        raise ValueError(f"target and horizon must be > 0, got target={target} and horizon={horizon}")
    error = current_kl / target - 1
    error = torch.clamp(error, -0.2, 0.2) if isinstance(error, torch.Tensor) else min(max(error, -0.2), 0.2)
    return kl_coef * (1 + error * n_steps / horizon)
