"""Sequence balancing across data-parallel ranks: every rank gets about the same number of tokens of each
minibatch (verl's ``trainer.balance_batch``, ``RayPPOTrainer._balance_batch``; docs/packing.md).

Each rank samples its own rollouts, so one rank may hold the long responses of a step while another holds
short ones, and the short one waits at every collective of the update. ``balance_rows`` moves rows between
ranks: all ranks gather every rank's rows of a minibatch, split them into ``world_size`` sets of equal row
counts and about equal tokens (``rlbits.functional.packing.balanced_partition(equal_size=True)``), and each
rank keeps its set. The union of the minibatch's rows over ranks is unchanged, so the losses over the global
denominators, and their gradients, are those of the unbalanced update to float rounding. The split depends
on the rows' lengths only (deterministic, so a resumed run splits alike).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from tensordict import TensorDictBase

from rlbits.batch import collate, trim_padding
from rlbits.distributed.async_ranks import all_gather_json
from rlbits.distributed.env import DistEnv
from rlbits.functional.packing import balanced_partition


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where ``balance_rows`` put the rows: ``counts[r]`` rows came from rank r (the minibatch's rows in
    rank order are the global rows ``0 .. sum(counts) - 1``), and this rank holds the global rows ``rows``
    (ascending)."""

    counts: tuple[int, ...]
    rows: tuple[int, ...]


def _row_tokens(batch: TensorDictBase) -> torch.Tensor:
    """[B] int64: each row's real tokens (prompt and response)."""
    if "attention_mask" in batch.keys():
        return batch.get("attention_mask").sum(-1)
    mask = batch.get("response_mask") if "response_mask" in batch.keys() else batch.get("action_mask")
    return batch.get("prompt_mask").sum(-1) + mask.sum(-1)


def all_gather_batch(batch: TensorDictBase, env: DistEnv) -> list[TensorDictBase]:
    """Every rank's ``batch`` (tensor entries only, the same keys and dtypes on every rank, any batch size
    and widths), in rank order: a collective of ``env.group``, one all-gather per key after one for the
    shapes. ``[batch]`` at world size 1.

    Raises:
        ValueError: an entry that is not a tensor (it would not cross ranks).
    """
    if env.world_size == 1:
        return [batch]
    keys = sorted(batch.keys(include_nested=True, leaves_only=True), key=str)
    for key in keys:
        if not isinstance(batch.get(key), torch.Tensor):
            raise ValueError(f"all_gather_batch gathers tensors only; {key!r} is {type(batch.get(key)).__name__}")
    shapes = all_gather_json({str(k): list(batch.get(k).shape) for k in keys}, env)
    out = [batch.empty() for _ in range(env.world_size)]
    for r, td in enumerate(out):
        td.batch_size = torch.Size([shapes[r][str(keys[0])][0]]) if keys else torch.Size([0])
    for key in keys:
        t = batch.get(key)
        wire = t.to(torch.uint8) if t.dtype == torch.bool else t  # gloo has no bool all-gather
        sizes = [shape[str(key)] for shape in shapes]
        width = [max(s[d] for s in sizes) for d in range(t.dim())]
        padded = wire.new_zeros(width)
        padded[tuple(slice(0, n) for n in t.shape)] = wire
        parts = [torch.empty_like(padded) for _ in range(env.world_size)]
        dist.all_gather(parts, padded.contiguous(), group=env.group)
        for td, part, size in zip(out, parts, sizes, strict=True):
            td.set(key, part[tuple(slice(0, n) for n in size)].to(t.dtype))
    return out


def balance_rows(
    batch: TensorDictBase, env: DistEnv, pad_token_id: int | None = None
) -> tuple[TensorDictBase, Placement]:
    """This rank's rows of ``batch`` after balancing the tokens over ranks (module docstring).

    Args:
        batch: this rank's rows of one minibatch (a rollout batch: ``rlbits.batch.SCHEMA`` keys, with
            ``attention_mask`` or ``prompt_mask`` and ``action_mask``/``response_mask``).
        env: the ranks; a collective of ``env.group`` (every rank calls it).
        pad_token_id: the fill of token ids where rows of different widths meet (``collate``); None pads
            with 0 (masked out everywhere).

    Returns:
        ``(rows, placement)``: the rows this rank now holds, global rows ``placement.rows`` in that order,
        trimmed to their own widths (``trim_padding``), and where every row came from (``Placement``). At world size 1, ``batch`` itself. ``group`` ids are renumbered (``collate``:
        groups of different ranks stay distinct).
    """
    if env.world_size == 1:
        n = batch.batch_size[0]
        return batch, Placement((n,), tuple(range(n)))
    gathered = all_gather_batch(batch, env)
    lengths = torch.cat([_row_tokens(b) for b in gathered]).tolist()
    mine = balanced_partition(lengths, env.world_size, equal_size=True)[env.rank]
    rows = collate(gathered, pad_token_id=0 if pad_token_id is None else pad_token_id)  # groups renumbered
    index = torch.tensor(mine, dtype=torch.int64, device=rows.device)
    placement = Placement(tuple(b.batch_size[0] for b in gathered), tuple(mine))
    return trim_padding(rows[index]), placement


__all__ = ["Placement", "all_gather_batch", "balance_rows"]
