"""Per-token estimators of KL(pi || pi_ref) from log-probabilities of sampled tokens."""

from __future__ import annotations

import torch

from rlbits.functional import _checks

KL_ESTIMATORS = ("k1", "abs", "k2", "k3")


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str = "k1") -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) for tokens sampled from pi.

    With ``d = logprobs - ref_logprobs`` (Schulman 2020, "Approximating KL divergence"):

    - ``k1``: ``d``. Unbiased, high variance, can be negative per token.
    - ``abs``: ``|d|``.
    - ``k2``: ``0.5 d^2``. Biased, low variance; its gradient is that of the true KL (on-policy).
    - ``k3``: ``exp(-d) + d - 1``. Unbiased and always >= 0 (used by GRPO, Shao 2024, as a loss term).

    No mask is applied: where both inputs hold 0 (padding, as in the batch schema) every estimator is 0.
    Mask before reducing.

    Args:
        logprobs: [B, R] log pi(token), float32 or bf16.
        ref_logprobs: [B, R] log pi_ref(token), same shape.
        estimator: one of ``k1``, ``abs``, ``k2``, ``k3``.

    Returns:
        [B, R] in the promoted input dtype (computed in float32 for half precision), in nats.

    Raises:
        ValueError: unknown estimator, or shapes differ.
    """
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"unknown KL estimator {estimator!r}; expected one of {', '.join(KL_ESTIMATORS)}")
    _checks.same_shape(logprobs=logprobs, ref_logprobs=ref_logprobs)
    out_dtype = torch.promote_types(logprobs.dtype, ref_logprobs.dtype)
    dtype = _checks.compute_dtype(logprobs, ref_logprobs)
    d = logprobs.to(dtype) - ref_logprobs.to(dtype)
    if estimator == "k1":
        kl = d
    elif estimator == "abs":
        kl = d.abs()
    elif estimator == "k2":
        kl = 0.5 * d * d
    else:
        # exp(ref - logp) - (ref - logp) - 1; expm1 keeps precision where d is near 0.
        kl = torch.expm1(-d) + d
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
