"""Argument checks shared by the kernels.

They run on shapes, dtypes and Python values only (never on tensor contents), so they cost no host sync and
are evaluated once at trace time under ``torch.compile(fullgraph=True)``.
"""

from __future__ import annotations

import torch

AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")


def same_shape(**tensors: torch.Tensor) -> None:
    """Raise ValueError unless every named tensor has the shape of the first."""
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
    if t.dim() != expected:
        raise ValueError(f"{name} must be {dims} ({expected}-D) but has shape {tuple(t.shape)}")


def floating(name: str, t: torch.Tensor) -> None:
    if not t.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor, got dtype {t.dtype}")


def aggregation(agg: str) -> None:
    if agg not in AGGREGATIONS:
        raise ValueError(f"unknown agg {agg!r}; expected one of {', '.join(AGGREGATIONS)}")


def compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """float32 for half-precision inputs, else the promoted input dtype (float64 stays float64)."""
    dtype = tensors[0].dtype
    for t in tensors[1:]:
        dtype = torch.promote_types(dtype, t.dtype)
    if dtype in (torch.float16, torch.bfloat16) or not dtype.is_floating_point:
        return torch.float32
    return dtype
