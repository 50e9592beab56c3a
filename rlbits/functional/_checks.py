"""Argument checks shared by the kernels.

They run on shapes, dtypes and Python values only (never on tensor contents), so they cost no host sync and
are evaluated once at trace time under ``torch.compile(fullgraph=True)``.
"""

from __future__ import annotations

import math
import numbers

import torch

AGGREGATIONS = (
    "token-mean",
    "token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-sum-norm",
)


def tensor(name: str, t: object) -> None:
    """Raise TypeError unless ``t`` is a ``torch.Tensor`` (a list or None would fail deep inside torch)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")


def same_shape(**tensors: torch.Tensor) -> None:
    """Raise ValueError unless every named tensor has the shape of the first (TypeError for a non-tensor)."""
    for name, t in tensors.items():
        tensor(name, t)
    items = list(tensors.items())
    first_name, first = items[0]
    for name, t in items[1:]:
        if t.shape != first.shape:
            raise ValueError(
                f"{name} has shape {tuple(t.shape)} but {first_name} has shape {tuple(first.shape)}; "
                "they must match"
            )


def ndim(name: str, t: torch.Tensor, expected: int, dims: str) -> None:
    """Raise ValueError unless ``t`` has ``expected`` dimensions (``dims`` names them, e.g. "[B, R]")."""
    tensor(name, t)
    if t.dim() != expected:
        raise ValueError(f"{name} must be {dims} ({expected}-D) but has shape {tuple(t.shape)}")


def floating(name: str, t: torch.Tensor) -> None:
    tensor(name, t)
    if not t.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor, got dtype {t.dtype}")


def integer(name: str, t: torch.Tensor) -> None:
    tensor(name, t)
    if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        raise ValueError(f"{name} must be an integer tensor of token ids, got dtype {t.dtype}")


def is_number(value: object) -> bool:
    """True for real numbers (int, float, numpy scalars), not for bool or str."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)  # np.float32 counts; np.bool_ is no Real


def in_range(
    name: str, value: object, low: float, high: float, *, low_open: bool = False, high_open: bool = False
) -> None:
    """Raise ValueError unless the Python number ``value`` lies in the interval (tensors pass: no host sync).

    NaN fails every comparison, so it is rejected too; bools and strings are rejected as not numbers.
    """
    if isinstance(value, torch.Tensor):
        return
    if not is_number(value):
        raise ValueError(f"{name} must be a number, got {type(value).__name__} {value!r}")
    above = value > low if low_open else value >= low
    below = value < high if high_open else value <= high
    if not (above and below):
        lo, hi = ("(" if low_open else "[") + f"{low:g}", f"{high:g}" + (")" if high_open else "]")
        raise ValueError(f"{name} must be in {lo}, {hi}, got {value!r}")


def clip_range(clip_eps: float, clip_eps_high: float | None) -> tuple[float, float]:
    """``(clip_eps, clip_eps_high)`` with ``clip_eps_high`` None meaning ``clip_eps``; raises ValueError unless
    both are finite and >= 0."""
    clip_eps_high = clip_eps if clip_eps_high is None else clip_eps_high
    in_range("clip_eps", clip_eps, 0, math.inf, high_open=True)
    in_range("clip_eps_high", clip_eps_high, 0, math.inf, high_open=True)
    return clip_eps, clip_eps_high


def finite(name: str, value: object) -> None:
    """Raise ValueError unless the Python number ``value`` is finite (tensors pass: no host sync)."""
    in_range(name, value, -math.inf, math.inf, low_open=True, high_open=True)


def aggregation(agg: str) -> None:
    if not isinstance(agg, str) or agg not in AGGREGATIONS:
        raise ValueError(f"unknown agg {agg!r}; expected one of {', '.join(AGGREGATIONS)}")


def compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """float32 for half-precision inputs, else the promoted input dtype (float64 stays float64)."""
    dtype = tensors[0].dtype
    for t in tensors[1:]:
        dtype = torch.promote_types(dtype, t.dtype)
    if dtype in (torch.float16, torch.bfloat16) or not dtype.is_floating_point:
        return torch.float32
    return dtype
