"""Statistics over the True entries of a mask.

Masked entries never reach a result: they are replaced by 0 with ``torch.where`` (not multiplied by the
mask), so a NaN or inf in padding cannot leak into a sum or a gradient. Sums accumulate in float32 for
half-precision inputs and are returned in the input's dtype.
"""

from __future__ import annotations

import torch

from rlbits.functional import _checks


def _prepare(x: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    _checks.tensor("x", x)
    _checks.tensor("mask", mask)
    if mask.shape != x.shape:
        raise ValueError(f"mask has shape {tuple(mask.shape)} but x has shape {tuple(x.shape)}; they must match")
    _checks.floating("x", x)
    mask = mask.to(torch.bool)
    x = x.to(_checks.compute_dtype(x))
    return torch.where(mask, x, torch.zeros((), dtype=x.dtype, device=x.device)), mask


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of ``x`` over entries where ``mask`` is True.

    Args:
        x: any shape, floating point.
        mask: same shape as ``x``; bool (or 0/1), True marks entries that count.
        dim: reduce over this dimension only; None reduces over everything (0-dim result).

    Returns:
        The sum, in ``x.dtype`` (accumulated in float32 for bf16/fp16).

    Raises:
        ValueError: ``mask`` and ``x`` shapes differ, or ``x`` is not floating point.
    """
    xm, _ = _prepare(x, mask)
    out = xm.sum() if dim is None else xm.sum(dim)
    return out.to(x.dtype)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of ``x`` over entries where ``mask`` is True.

    ``sum(x[mask]) / count(mask)``; where the count is 0 the result is 0 (not NaN), so an all-padding
    microbatch contributes nothing instead of poisoning a metric.

    Args:
        x: any shape, floating point.
        mask: same shape as ``x``; bool (or 0/1).
        dim: reduce over this dimension only; None reduces over everything (0-dim result).

    Returns:
        The mean, in ``x.dtype``.

    Raises:
        ValueError: ``mask`` and ``x`` shapes differ, or ``x`` is not floating point.
    """
    xm, m = _prepare(x, mask)
    if dim is None:
        total, count = xm.sum(), m.sum()
    else:
        total, count = xm.sum(dim), m.sum(dim)
    return (total / count.clamp(min=1).to(total.dtype)).to(x.dtype)


def _centered(x: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``(m, count, mean, centered)`` of ``_prepare(x, mask)``: the bool mask, the count and mean of the masked
    entries (in the dtype ``_prepare`` computes in) and ``x - mean`` on them, 0 elsewhere."""
    xm, m = _prepare(x, mask)
    count = m.sum().to(xm.dtype)
    mean = xm.sum() / count.clamp(min=1)
    return m, count, mean, torch.where(m, xm - mean, torch.zeros((), dtype=xm.dtype, device=xm.device))


def masked_var(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of ``x`` over all entries where ``mask`` is True (0-dim result).

    ``sum((x - mean)^2) / (n - 1)`` with Bessel's correction when ``unbiased`` (as ``torch.var``), else
    ``/ n``. The denominator is clamped to at least 1, so n <= 1 gives 0 instead of NaN or inf.

    Args:
        x: any shape, floating point.
        mask: same shape as ``x``; bool (or 0/1).
        unbiased: Bessel's correction.

    Returns:
        0-dim tensor in ``x.dtype``.

    Raises:
        ValueError: ``mask`` and ``x`` shapes differ, or ``x`` is not floating point.
    """
    _, count, _, centered = _centered(x, mask)
    denom = (count - 1) if unbiased else count
    return ((centered * centered).sum() / denom.clamp(min=1)).to(x.dtype)


def masked_whiten(
    x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8
) -> torch.Tensor:
    """Whiten ``x`` over its masked entries: ``(x - mean) / sqrt(var + eps)``.

    Mean and unbiased variance are taken over every True entry of ``mask`` (the whole batch, as advantage
    whitening in PPO implementations does; e.g. trlx ``whiten``). With ``shift_mean=False`` the mean is
    added back, so only the scale changes (used for rewards, whose sign carries meaning).

    Args:
        x: any shape, floating point.
        mask: same shape; bool (or 0/1).
        shift_mean: subtract the mean (True) or keep it (False).
        eps: added to the variance before the square root.

    Returns:
        Same shape and dtype as ``x``; 0 where ``mask`` is False.

    Raises:
        ValueError: ``mask`` and ``x`` shapes differ, or ``x`` is not floating point.
    """
    m, count, mean, centered = _centered(x, mask)
    var = (centered * centered).sum() / (count - 1).clamp(min=1)
    out = centered * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return torch.where(m, out, torch.zeros((), dtype=out.dtype, device=out.device)).to(x.dtype)
