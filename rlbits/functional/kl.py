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
