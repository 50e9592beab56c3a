"""Packing rows into microbatches: balanced partitions by length, token budgets, bins, and the index maps of
a packed batch.

Pure functions of lengths (Python ints) and masks (tensors). ``balanced_partition`` is the largest
differencing method of Karmarkar and Karp (1982, "The differencing method of set partitioning"), the
algorithm verl's ``get_seqlen_balanced_partitions`` (``verl/utils/seqlen_balancing.py``) uses to give
every microbatch and rank about the same number of tokens; ``token_budget_partitions`` forms microbatches
by a token budget as verl's ``rearrange_micro_batches`` does for ``ppo_max_token_len_per_gpu``.
Every result is deterministic: ties are broken by row index, so a resumed run forms the same microbatches.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence

import torch

__all__ = ["balanced_partition", "pack_bins", "pack_index", "token_budget_partitions"]


def _check_lengths(lengths: Sequence[int]) -> list[int]:
    out = [int(x) for x in lengths]
    if any(x < 0 for x in out):
        raise ValueError(f"lengths must be >= 0, got {out}")
    return out


def balanced_partition(lengths: Sequence[int], k: int, *, equal_size: bool = False) -> list[list[int]]:
    """Split rows ``0 .. n-1`` into ``k`` sets whose summed ``lengths`` are about equal (Karmarkar-Karp).

    Each row starts as a k-way partial partition (itself in one set, k - 1 empty sets); repeatedly the two
    partial partitions with the largest spread (largest sum minus smallest) are merged, the heaviest set of
    one joined with the lightest of the other, until one partition remains. Ties go to the lower row index,
    so the result depends on ``lengths`` only.

    With ``equal_size`` every set gets ``n // k`` or ``n // k + 1`` rows (verl's ``equal_size=True``, used to
    give data-parallel ranks the same row count): the rows, longest first, are taken ``k`` at a time, each
    group a partial partition with one row per set (the last group filled up with rows of length 0 that are
    dropped at the end); merging such partitions keeps the set sizes equal.

    Args:
        lengths: n non-negative ints, the cost of each row (its tokens).
        k: number of sets, >= 1.
        equal_size: sets of equal row counts (to within one), above.

    Returns:
        ``k`` lists of row indices, each sorted ascending, the lists ordered by their first index (empty
        lists, when n < k, last). Every row is in exactly one list.

    Raises:
        ValueError: ``k < 1`` or a negative length.
    """
    lengths = _check_lengths(lengths)
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    if not lengths:
        return [[] for _ in range(k)]
    # A heap entry: (-spread, tie-break, sets); sets is a list of (sum, rows) sorted by sum descending.
    heap = []
    if equal_size:
        order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
        for start in range(0, len(order), k):
            group = order[start : start + k]
            sets = [(lengths[i], [i]) for i in group] + [(0, []) for _ in range(k - len(group))]
            heapq.heappush(heap, (sets[-1][0] - sets[0][0], min(group), sets))
    else:
        for i, x in enumerate(lengths):
            sets = [(x, [i])] + [(0, []) for _ in range(k - 1)]
            heapq.heappush(heap, (-x, i, sets))
    while len(heap) > 1:
        _, tie_a, a = heapq.heappop(heap)
        _, tie_b, b = heapq.heappop(heap)
        # the heaviest set of a with the lightest of b, and so on down
        merged = [(sa + sb, ra + rb) for (sa, ra), (sb, rb) in zip(a, reversed(b), strict=True)]
        merged.sort(key=lambda s: (-s[0], min(s[1], default=math.inf)))
        heapq.heappush(heap, (merged[-1][0] - merged[0][0], min(tie_a, tie_b), merged))
    parts = [sorted(rows) for _, rows in heap[0][2]]
    return sorted(parts, key=lambda rows: rows[0] if rows else math.inf)


def token_budget_partitions(
    lengths: Sequence[int], max_tokens: int, *, padded: bool = False, min_count: int = 1
) -> list[list[int]]:
    """Microbatches of rows under a token budget: each holds at most ``max_tokens`` tokens.

    Packed (``padded=False``): a microbatch's tokens are the sum of its rows' lengths. The fewest sets
    ``k >= max(min_count, ceil(sum / max_tokens))`` for which ``balanced_partition(lengths, k)`` keeps every
    set within the budget (verl ``rearrange_micro_batches``), so the microbatches also hold about the same
    number of tokens. Padded (``padded=True``): a microbatch costs its row count times its longest row; rows
    sorted by length (longest first, ties by index) are cut greedily into runs within the budget (rows of
    similar length together: little padding). ``min_count`` is not used there.

    Args:
        lengths: n non-negative ints, each row's tokens.
        max_tokens: the budget, >= the longest row.
        padded: the cost rule (above).
        min_count: packed: at least this many sets (e.g. the count agreed over ranks), as long as there are
            rows to fill them.

    Returns:
        The non-empty microbatches, each a list of row indices sorted ascending, ordered by first index;
        every row in exactly one. ``[]`` for no rows.

    Raises:
        ValueError: ``max_tokens < 1``, a row longer than ``max_tokens``, a negative length.
    """
    lengths = _check_lengths(lengths)
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    if not lengths:
        return []
    longest = max(lengths)
    if longest > max_tokens:
        raise ValueError(
            f"a row has {longest} tokens, more than the budget max_tokens={max_tokens}; raise the budget to at "
            "least the longest row (prompt plus response)"
        )
    if padded:
        order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
        runs: list[list[int]] = []
        for i in order:  # the run's first row is its longest
            if runs and (len(runs[-1]) + 1) * lengths[runs[-1][0]] <= max_tokens:
                runs[-1].append(i)
            else:
                runs.append([i])
        return sorted((sorted(r) for r in runs), key=lambda r: r[0])
    k = min(len(lengths), max(min_count, math.ceil(sum(lengths) / max_tokens), 1))
    while True:  # ends at k = n at the latest (each row alone fits)
        parts = [p for p in balanced_partition(lengths, k) if p]
        if max(sum(lengths[i] for i in p) for p in parts) <= max_tokens:
            return parts
        k += 1


def pack_bins(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Rows into bins of at most ``capacity`` tokens each, first-fit decreasing.

    Rows are taken longest first (ties by row index) and each goes into the first bin it fits; a bin lists
    its rows in the order they were placed. First-fit decreasing uses at most 11/9 OPT + 6/9 bins (Dósa
    2007, "The tight bound of first fit decreasing bin-packing algorithm is FFD(I) <= 11/9 OPT(I) + 6/9"),
    and it is what TRL's ``pack_dataset(strategy="bfd")`` and OpenRLHF's packing approximate too. Rows of
    length 0 go in no bin. Deterministic.

    Args:
        lengths: [B] token counts (ints >= 0).
        capacity: the most tokens a bin holds (>= the longest row).

    Returns:
        The bins, each a list of row indices, in the order the bins were opened.

    Raises:
        ValueError: a negative length, or a row longer than ``capacity``.
    """
    lengths = _check_lengths(lengths)
    if lengths and max(lengths) > capacity:
        raise ValueError(f"a row has {max(lengths)} tokens, more than the bin capacity {capacity}")
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        if lengths[i] == 0:
            continue
        for b, free in enumerate(room):
            if lengths[i] <= free:
                bins[b].append(i)
                room[b] -= lengths[i]
                break
        else:
            bins.append([i])
            room.append(capacity - lengths[i])
    return bins


def pack_index(mask: torch.Tensor, capacity: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Where each real token of a padded [B, T] batch goes in a packed batch [n, L] of bins.

    The rows' real tokens are packed, without padding, into n bins of L = ``capacity`` columns (default: the
    longest row's real tokens), rows assigned by ``pack_bins`` (first-fit decreasing), each row's tokens
    contiguous and in order (padding may sit anywhere in the padded row). A token's position id counts the
    real tokens before it in its row, so it restarts at 0 on every row, as the padded forward's
    ``cumsum(mask) - 1``. A bin's unused tail is filler whose positions restart at 0 too, so a model that
    reads row boundaries off the position ids treats it as one more sequence of its own. With L the longest
    row, attention over a bin costs at most what the padded row costs (uniform lengths give the padded
    layout itself), while the matmuls see about N real tokens (n x L >= N, the filler being the rest).

    Args:
        mask: [B, T] bool (or 0/1), True on real tokens.
        capacity: the columns of a bin, >= the longest row; None: the longest row (at least 1).

    Returns:
        ``(src, positions, packed_at)``: ``src`` [n, L] int64, the index into ``mask.flatten()`` of the real
        token in each packed slot, -1 on filler (``x.flatten(0, 1)[src.clamp(min=0)]`` packs any
        [B, T, ...] tensor); ``positions`` [n, L] int64, the position ids of the packed batch;
        ``packed_at`` [B, T] int64, each real token's index into the flattened packed batch (``n * L``
        slots), -1 on padding. Reads the row lengths on the host (one sync).

    Raises:
        ValueError: ``mask`` is not 2-D, or ``capacity`` is shorter than a row.
    """
    if mask.dim() != 2:
        raise ValueError(f"mask must be [B, T] (2-D) but has shape {tuple(mask.shape)}")
    m = mask.bool()
    device = m.device
    lengths = m.sum(-1).tolist()
    longest = max(lengths, default=0)
    L = max(longest, 1) if capacity is None else int(capacity)
    if L < longest or L < 1:
        raise ValueError(f"capacity {capacity} is shorter than the longest row ({longest} real tokens)")
    bins = pack_bins(lengths, L) or [[]]
    start = [0] * len(lengths)  # each row's first slot in the flattened packed batch
    used = []
    for b, rows in enumerate(bins):
        offset = 0
        for r in rows:
            start[r] = b * L + offset
            offset += lengths[r]
        used.append(offset)
    rank = m.long().cumsum(-1) - 1  # a real token's index within its row = its position id
    slot = torch.tensor(start, dtype=torch.long, device=device)[:, None] + rank
    packed_at = torch.where(m, slot, torch.full_like(slot, -1))
    n = len(bins)
    # Scatter every [B, T] entry to its slot; padding goes to one spare slot past the end, dropped (no
    # host sync to find the real entries).
    target = torch.where(m, slot, n * L).flatten()
    src = torch.full((n * L + 1,), -1, dtype=torch.long, device=device)
    src.index_put_((target,), torch.arange(m.numel(), device=device))
    # filler restarts at 0 after each bin's rows; real slots then take their own position ids
    positions = torch.arange(L, device=device)[None, :] - torch.tensor(used, device=device)[:, None]
    positions = torch.cat([positions.flatten(), positions.new_zeros(1)])
    positions.index_put_((target,), rank.flatten())
    return src[:-1].view(n, L), positions[:-1].view(n, L), packed_at
