"""Reductions across ranks (those of ``env.group``): sums, maxima, an any-rank flag, global token counts, whitening
and variance."""

from __future__ import annotations

import torch
import torch.distributed as dist

from rlbits.distributed.env import DistEnv


def all_reduce_sum(x: torch.Tensor, env: DistEnv) -> torch.Tensor:
    """Sum of ``x`` over ranks (``x`` itself at world size 1). Returns a new tensor."""
    out = x.detach().clone()
    if env.world_size > 1:
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=env.group)
    return out


def all_reduce_max(x: torch.Tensor, env: DistEnv) -> torch.Tensor:
    """Elementwise maximum of ``x`` over ranks (``x`` itself at world size 1). Returns a new tensor."""
    out = x.detach().clone()
    if env.world_size > 1:
        dist.all_reduce(out, op=dist.ReduceOp.MAX, group=env.group)
    return out


def any_rank(flag: bool | torch.Tensor, env: DistEnv) -> bool:
    """True if ``flag`` is true on any rank (``bool(flag)`` at world size 1): ranks that must raise, skip or
    stop together agree with it. One all-reduce and one host sync at world size > 1."""
    if env.world_size == 1:
        return bool(flag)
    return bool(all_reduce_max(torch.as_tensor(flag).to(env.device, torch.int64), env).item())


def global_count(mask: torch.Tensor, env: DistEnv) -> torch.Tensor:
    """Number of True entries of ``mask`` over all ranks, as a 0-dim float tensor (a loss denominator)."""
    return all_reduce_sum(mask.sum().to(torch.float32), env)


def masked_whiten(
    x: torch.Tensor, mask: torch.Tensor, env: DistEnv, *, shift_mean: bool = True, eps: float = 1e-8
) -> torch.Tensor:
    """``rlbits.masked_whiten`` with the mean and (unbiased) variance taken over every rank's masked entries:
    N ranks whiten exactly as one process holding the whole batch would."""
    mask = mask.bool()
    zero = torch.zeros((), dtype=x.dtype, device=x.device)
    count = global_count(mask, env)
    mean = all_reduce_sum(torch.where(mask, x, zero).sum(), env) / count.clamp(min=1)
    centered = torch.where(mask, x - mean, zero)
    var = all_reduce_sum((centered * centered).sum(), env) / (count - 1).clamp(min=1)
    out = centered * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return torch.where(mask, out, zero)


def masked_var(x: torch.Tensor, mask: torch.Tensor, env: DistEnv) -> torch.Tensor:
    """``rlbits.masked_var`` (unbiased) over every rank's masked entries, from one all-reduce of
    ``(n, sum x, sum x^2)`` in float64. Returns a 0-dim float32 tensor, the same on every rank."""
    xm = torch.where(mask.bool(), x.detach().double(), 0.0)
    n, total, squares = all_reduce_sum(torch.stack([mask.sum().double(), xm.sum(), (xm * xm).sum()]), env)
    mean = total / n.clamp(min=1)
    return ((squares - n * mean * mean) / (n - 1).clamp(min=1)).clamp(min=0).float()


__all__ = [
    "all_reduce_max",
    "all_reduce_sum",
    "any_rank",
    "global_count",
    "masked_var",
    "masked_whiten",
]
