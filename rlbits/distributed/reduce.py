"""Reductions across ranks: global token counts and one all-reduce of a step's metrics."""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist

from rlbits.distributed.env import DistEnv


def all_reduce_sum(x: torch.Tensor, env: DistEnv) -> torch.Tensor:
    """Sum of ``x`` over ranks (``x`` itself at world size 1). Returns a new tensor."""
    out = x.detach().clone()
    if env.world_size > 1:
        dist.all_reduce(out, op=dist.ReduceOp.SUM)
    return out


def all_reduce_max(x: torch.Tensor, env: DistEnv) -> torch.Tensor:
    """Elementwise maximum of ``x`` over ranks (``x`` itself at world size 1). Returns a new tensor."""
    out = x.detach().clone()
    if env.world_size > 1:
        dist.all_reduce(out, op=dist.ReduceOp.MAX)
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


def reduce_metrics(metrics: Mapping[str, torch.Tensor | float], env: DistEnv) -> dict[str, float]:
    """Mean of each metric over ranks, with a single all-reduce, returned as Python floats (one host sync).

    Args:
        metrics: name -> 0-dim tensor or float, the same names on every rank.
        env: the ``DistEnv``.

    Returns:
        name -> float.
    """
    names = sorted(metrics)
    if not names:
        return {}
    values = torch.stack([torch.as_tensor(metrics[k], dtype=torch.float64).detach().cpu().reshape(()) for k in names])
    if env.world_size > 1:
        values = values.to(env.device)
        dist.all_reduce(values, op=dist.ReduceOp.SUM)
        values = values / env.world_size
    return dict(zip(names, values.tolist()))
