"""Random test inputs: shapes, masks with every padding pattern, and seeded tensors."""

from __future__ import annotations

import torch
from hypothesis import strategies as st

MASK_KINDS = ("right", "left", "holes", "empty_row", "full")


def make_mask(batch: int, length: int, kind: str, gen: torch.Generator) -> torch.Tensor:
    pos = torch.arange(length)
    if kind == "full":
        return torch.ones(batch, length, dtype=torch.bool)
    lengths = torch.randint(0, length + 1, (batch,), generator=gen)
    if kind == "right":  # responses: real tokens then padding
        return pos[None, :] < lengths[:, None]
    if kind == "left":  # prompts: padding then real tokens
        return pos[None, :] >= (length - lengths)[:, None]
    mask = torch.rand(batch, length, generator=gen) > 0.4  # tool/observation tokens inside a response
    if kind == "empty_row":
        mask[0] = False
    return mask


@st.composite
def masked_case(draw, max_batch: int = 4, max_len: int = 9):
    """(batch, length, mask, generator) with a mask of one of MASK_KINDS."""
    batch = draw(st.integers(1, max_batch))
    length = draw(st.integers(1, max_len))
    kind = draw(st.sampled_from(MASK_KINDS))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    return batch, length, make_mask(batch, length, kind, gen), gen


def randn(gen: torch.Generator, *shape: int, scale: float = 1.0, dtype=torch.float64) -> torch.Tensor:
    return (scale * torch.randn(*shape, generator=gen, dtype=torch.float64)).to(dtype)
