"""Per-token rewards, GAE, and group baselines (RLOO, GRPO).

Masked (non-action) positions inside a response - tool output, observations, padding - are *skipped*:
the recursions run over action tokens only, as if the non-action tokens were not there. The
implementation compacts each row's action tokens to the front with a scatter (an O(R) permutation), runs
a vectorised recursion on the compacted rows, and scatters the result back.
"""

from __future__ import annotations

import math
import numbers

import einops
import torch

from rlbits.functional import _checks

# Block length of the blocked discounted reverse cumsum in ``gae``: a [C, C] matmul per block plus one
# carry per block, so R / C Python steps instead of R.
_GAE_BLOCK = 64


def _check_2d(**tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        _checks.ndim(name, t, 2, "[B, R]")
    _checks.same_shape(**tensors)


def _compaction(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Move each row's True entries to the front, in order.

    Returns ``(idx, compact_mask)``: ``idx`` [B, R] int64 is the destination of each position (action
    tokens go to ``0..n-1``, n = the row's action count, the rest to ``n..R-1``: a permutation of each row,
    so ``compact = zeros.scatter(1, idx, x)`` and ``x = compact.gather(1, idx)``); ``compact_mask`` [B, R]
    bool is True on ``0..n-1``.
    """
    m = mask.to(torch.int64)
    running = m.cumsum(1)
    n_actions = running[:, -1:]
    positions = torch.arange(mask.shape[1], device=mask.device)
    idx = torch.where(mask, running - 1, n_actions + positions - running)
    return idx, positions[None, :] < n_actions


def _compact(x: torch.Tensor, idx: torch.Tensor, compact_mask: torch.Tensor) -> torch.Tensor:
    """Action-token values of ``x`` moved to the front of each row, zeros after them."""
    moved = torch.zeros_like(x).scatter(1, idx, x)
    return torch.where(compact_mask, moved, torch.zeros((), dtype=x.dtype, device=x.device))


def _shift_left(x: torch.Tensor) -> torch.Tensor:
    """``y_t = x_{t+1}``, with 0 after the end."""
    return torch.nn.functional.pad(x[:, 1:], (0, 1))


def next_action_values(values: torch.Tensor, action_mask: torch.Tensor) -> torch.Tensor:
    """V of the state before the *next* action token of each action token (0 after the row's last one).

    Args:
        values: [B, R] floating point.
        action_mask: [B, R] bool.

    Returns:
        [B, R] in ``values.dtype``; 0 where ``action_mask`` is False.

    Raises:
        ValueError: shapes differ or are not 2-D.
    """
    _check_2d(values=values, action_mask=action_mask)
    if values.shape[1] == 0:
        return values
    mask = action_mask.to(torch.bool)
    idx, compact_mask = _compaction(mask)
    shifted = _shift_left(_compact(values, idx, compact_mask)).gather(1, idx)
    return torch.where(mask, shifted, torch.zeros((), dtype=values.dtype, device=values.device))


def _discounted_reverse_cumsum(x: torch.Tensor, discount: float | torch.Tensor) -> torch.Tensor:
    """``y_t = sum_{s >= t} discount^(s - t) x_s`` along dim 1 of [B, R], blocked: matmul within a block,
    a carried value across blocks. ``discount`` is a float or a [B] tensor (one discount per row)."""
    if isinstance(discount, torch.Tensor):
        return _discounted_reverse_cumsum_rows(x, discount)
    batch, length = x.shape
    if length == 0:
        return x
    block = min(length, _GAE_BLOCK)
    n_blocks = -(-length // block)
    padded = torch.nn.functional.pad(x, (0, n_blocks * block - length)).view(batch, n_blocks, block)
    k = torch.arange(block, device=x.device)
    lag = k[None, :] - k[:, None]  # [s, t] -> t - s; the weight of x_t in y_s is discount^(t - s) for t >= s
    base = torch.as_tensor(discount, dtype=x.dtype, device=x.device)
    weights = torch.where(lag >= 0, torch.pow(base, lag.clamp(min=0).to(x.dtype)), torch.zeros((), dtype=x.dtype, device=x.device))
    within = torch.einsum("bnt,st->bns", padded, weights)
    carry_weight = torch.pow(base, (block - k).to(x.dtype))  # y_s gets discount^(block - s) * y_{next block start}
    carry = torch.zeros(batch, dtype=x.dtype, device=x.device)
    blocks = []
    for j in range(n_blocks - 1, -1, -1):
        y = within[:, j] + carry_weight * carry[:, None]
        carry = y[:, 0]
        blocks.append(y)
    return torch.cat(blocks[::-1], dim=1)[:, :length]


def _discounted_reverse_cumsum_rows(x: torch.Tensor, discount: torch.Tensor) -> torch.Tensor:
    """``_discounted_reverse_cumsum`` with a [B] discount: one [block, block] weight matrix per row."""
    batch, length = x.shape
    if length == 0:
        return x
    block = min(length, _GAE_BLOCK)
    n_blocks = -(-length // block)
    padded = torch.nn.functional.pad(x, (0, n_blocks * block - length)).view(batch, n_blocks, block)
    k = torch.arange(block, device=x.device)
    lag = k[None, :] - k[:, None]
    base = discount.to(x.dtype)[:, None, None]  # [B, 1, 1]
    zero = torch.zeros((), dtype=x.dtype, device=x.device)
    weights = torch.where(lag >= 0, torch.pow(base, lag.clamp(min=0).to(x.dtype)), zero)  # [B, s, t]
    within = torch.einsum("bnt,bst->bns", padded, weights)
    carry_weight = torch.pow(base[:, :, 0], (block - k).to(x.dtype))  # [B, block]
    carry = torch.zeros(batch, dtype=x.dtype, device=x.device)
    blocks = []
    for j in range(n_blocks - 1, -1, -1):
        y = within[:, j] + carry_weight * carry[:, None]
        carry = y[:, 0]
        blocks.append(y)
    return torch.cat(blocks[::-1], dim=1)[:, :length]


def length_adaptive_lambda(action_mask: torch.Tensor, alpha: float) -> torch.Tensor:
    """VAPO's length-adaptive GAE lambda of the policy, one per row: ``clamp(1 - 1 / max(alpha * len, 1), 0, 1)``
    with ``len`` the row's number of action tokens (Yue 2025, VAPO eq. 7; NeMo-RL
    ``GAEAdvantageEstimator._resolve_lambda_policy``, nemo_rl/algorithms/advantage_estimator.py).

    Args:
        action_mask: [B, R] bool.
        alpha: > 0; a row of ``len`` tokens gets lambda ``1 - 1 / (alpha * len)`` (0 for ``alpha * len <= 1``).

    Returns:
        [B] float32 lambdas in [0, 1].

    Raises:
        ValueError: ``action_mask`` is not 2-D, or ``alpha`` is not > 0.
    """
    _checks.ndim("action_mask", action_mask, 2, "[B, R]")
    if isinstance(alpha, bool) or not isinstance(alpha, numbers.Real) or not alpha > 0:
        raise ValueError(f"alpha must be a number > 0, got {alpha!r}")
    lengths = action_mask.to(torch.bool).sum(dim=1).to(torch.float32)
    return (1.0 - 1.0 / (alpha * lengths).clamp(min=1.0)).clamp(0.0, 1.0)


def token_rewards(
    rewards: torch.Tensor,
    action_mask: torch.Tensor,
    kl: torch.Tensor | None = None,
    kl_coef: float | torch.Tensor = 0.0,
    *,
    turn_rewards: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-token rewards for RLHF: the sequence score on the last action token, minus a KL penalty.

    ``r_t = score * 1[t == last action token] - kl_coef * kl_t * 1[t is an action token]``
    (Ziegler 2019; Ouyang 2022, eq. 2 with the KL spread over tokens). A row without action tokens gets
    no reward anywhere. With ``turn_rewards`` (multi-turn episodes: each turn's reward already on that
    turn's last action token, ``rlbits.rollout.multiturn``) ``r_t += turn_rewards_t * 1[t is an action
    token]``; pass ``rewards`` = 0 for the turn rewards alone.

    Args:
        rewards: [B] sequence-level scores.
        action_mask: [B, R] bool.
        kl: optional [B, R] per-token KL estimate (see ``kl_penalty``).
        kl_coef: beta, a float or 0-dim tensor (e.g. from an adaptive controller).
        turn_rewards: optional [B, R] rewards already placed on tokens, added on action tokens.

    Returns:
        [B, R] in the promoted dtype of ``rewards``, ``kl`` and ``turn_rewards``; 0 where ``action_mask`` is
        False.

    Raises:
        ValueError: ``rewards`` is not [B], or shapes disagree.
    """
    _checks.ndim("rewards", rewards, 1, "[B]")
    _checks.ndim("action_mask", action_mask, 2, "[B, R]")
    if kl is not None:
        _checks.tensor("kl", kl)
    if rewards.shape[0] != action_mask.shape[0]:
        raise ValueError(
            f"rewards has {rewards.shape[0]} rows but action_mask has shape {tuple(action_mask.shape)}"
        )
    mask = action_mask.to(torch.bool)
    out_dtype = rewards.dtype if kl is None else torch.promote_types(rewards.dtype, kl.dtype)
    dtype = _checks.compute_dtype(rewards) if kl is None else _checks.compute_dtype(rewards, kl)
    positions = torch.arange(mask.shape[1], device=mask.device)
    last = torch.where(mask, positions, -1).amax(dim=1, keepdim=True) if mask.shape[1] else None
    zero = torch.zeros((), dtype=dtype, device=rewards.device)
    if last is None:
        out = torch.zeros(mask.shape, dtype=dtype, device=rewards.device)
    else:
        out = torch.where(positions[None, :] == last, rewards.to(dtype)[:, None], zero)
    if kl is not None:
        _checks.same_shape(action_mask=action_mask, kl=kl)
        _checks.finite("kl_coef", kl_coef)
        out = out - kl_coef * torch.where(mask, kl.to(dtype), zero)
    if turn_rewards is not None:
        _checks.same_shape(action_mask=action_mask, turn_rewards=turn_rewards)
        out_dtype = torch.promote_types(out_dtype, turn_rewards.dtype)
        out = out + torch.where(mask, turn_rewards.to(dtype), zero)
    return out.to(out_dtype)


def gae(
    token_rewards: torch.Tensor,
    values: torch.Tensor,
    action_mask: torch.Tensor,
    gamma: float = 1.0,
    lam: float | torch.Tensor = 0.95,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over action tokens (Schulman 2016, eq. 11-16).

    For consecutive action tokens t and t' (positions in between, where ``action_mask`` is False, are
    skipped: their rewards and values are ignored):
    ``delta_t = r_t + gamma V_t' - V_t`` and ``A_t = delta_t + gamma lam A_t'``; after a row's last action
    token the state is terminal (V = 0, A = 0). ``returns = advantages + values`` on action tokens.

    verl (0.9, ``compute_gae_advantage_return``) skips masked positions the same way; trl and OpenRLHF step
    through every position of the response, so a tool-output token in the middle of a response breaks their
    bootstrap chain; on contiguous masks all agree.

    Vectorised over B; the reverse recursion runs as a blocked discounted cumsum (R / 64 Python steps).

    Args:
        token_rewards: [B, R] per-token rewards (see ``token_rewards``).
        values: [B, R] critic values V(s_t) of the state before token t.
        action_mask: [B, R] bool; True on action tokens.
        gamma: discount per action token.
        lam: GAE lambda: a float, or a [B] tensor of one lambda per row (``length_adaptive_lambda``).

    Returns:
        ``(advantages, returns)``, each [B, R] in the promoted dtype of the inputs (computed in float32 for
        half precision), 0 where ``action_mask`` is False. Differentiable w.r.t. both inputs (callers
        normally detach them).

    Raises:
        ValueError: inputs are not all [B, R] of one shape; a tensor ``lam`` is not [B] (its values are not
            checked: no device sync).
    """
    _check_2d(token_rewards=token_rewards, values=values, action_mask=action_mask)
    _checks.in_range("gamma", gamma, 0, 1)
    if isinstance(lam, torch.Tensor):
        if lam.shape != (values.shape[0],):
            raise ValueError(f"lam as a tensor must be [B] = [{values.shape[0]}], got shape {tuple(lam.shape)}")
    else:
        _checks.in_range("lam", lam, 0, 1)
    out_dtype = torch.promote_types(token_rewards.dtype, values.dtype)
    dtype = _checks.compute_dtype(token_rewards, values)
    if values.shape[1] == 0:
        return token_rewards.to(out_dtype), values.to(out_dtype)
    mask = action_mask.to(torch.bool)
    vals = values.to(dtype)
    zero = torch.zeros((), dtype=dtype, device=vals.device)
    # In compacted rows action tokens are consecutive, so "next action token" is just t + 1.
    idx, compact_mask = _compaction(mask)
    compact_rewards = _compact(token_rewards.to(dtype), idx, compact_mask)
    compact_values = _compact(vals, idx, compact_mask)
    deltas = compact_rewards + gamma * _shift_left(compact_values) - compact_values  # 0 past the last action
    discount = gamma * lam.to(dtype) if isinstance(lam, torch.Tensor) else gamma * lam
    advantages = torch.where(mask, _discounted_reverse_cumsum(deltas, discount).gather(1, idx), zero)
    returns = torch.where(mask, advantages + vals, zero)
    return advantages.to(out_dtype), returns.to(out_dtype)


def _groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """``rewards`` [B = G * K] as [G, K], one row per prompt, in the compute dtype.

    The checks come first so that a bad ``group_size`` or batch size raises a ValueError that names both
    sizes, not einops' shape-mismatch error.
    """
    _checks.ndim("rewards", rewards, 1, "[B]")
    if isinstance(group_size, bool) or not isinstance(group_size, numbers.Integral):
        raise ValueError(f"group_size must be an int, got {type(group_size).__name__}")
    if group_size < 2:
        raise ValueError(f"group_size must be >= 2 (a group needs other samples for a baseline), got {group_size}")
    if rewards.shape[0] % group_size != 0:
        raise ValueError(
            f"batch size {rewards.shape[0]} is not divisible by group_size {group_size}; "
            "groups must be contiguous rows of equal size"
        )
    return einops.rearrange(rewards.to(_checks.compute_dtype(rewards)), "(g k) -> g k", k=group_size)


def _float_dtype(rewards: torch.Tensor) -> torch.dtype:
    """``rewards.dtype`` if floating point, else float32 (0/1 or integer rewards must not round advantages)."""
    return rewards.dtype if rewards.is_floating_point() else torch.float32


def rloo_baseline(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """Leave-one-out baseline: the mean reward of the *other* samples of the same prompt.

    ``b_i = (sum_j r_j - r_i) / (K - 1)`` within each group of K contiguous rows (Kool 2019, "Buy 4
    REINFORCE samples, get a baseline for free"; Ahmadian 2024, RLOO). The advantage is ``r - b``.

    Args:
        rewards: [B] float, B = num_prompts * K, the samples of one prompt contiguous.
        group_size: K >= 2.

    Returns:
        [B] in ``rewards.dtype``.

    Raises:
        ValueError: ``rewards`` is not 1-D, ``K < 2``, or ``B % K != 0``.
    """
    groups = _groups(rewards, group_size)
    baseline = (einops.reduce(groups, "g k -> g 1", "sum") - groups) / (group_size - 1)
    return einops.rearrange(baseline, "g k -> (g k)").to(_float_dtype(rewards))


def rloo_baseline_ended(rewards: torch.Tensor, is_end: torch.Tensor, group_size: int) -> torch.Tensor:
    """NeMo-Aligner's RLOO baseline: the samples that did not end (truncated) are left out of the others'
    baselines (``calculate_rloo_baseline``, nemo_aligner/utils/ppo_utils.py at af2b3bd).

    In each group of K contiguous rows with M ended samples: ``b_i = sum_{j != i, ended} r_j / (M - 1)`` for
    every sample i (ended or not: a truncated sample's baseline is the ended samples' sum over M - 1, as
    Aligner's), and ``b_i = r_i`` for the whole group when M <= 1 (its advantages are 0). With every sample
    ended it is ``rloo_baseline``.

    Args:
        rewards: [B] float, B = num_prompts * K, the samples of one prompt contiguous.
        is_end: [B] bool, True where the response ended (Aligner's ``is_end``; not truncated).
        group_size: K >= 2.

    Returns:
        [B] in ``rewards``' floating dtype.

    Raises:
        ValueError: ``rewards`` is not 1-D, ``K < 2``, ``B % K != 0``, or ``is_end`` is not [B].
    """
    groups = _groups(rewards, group_size)
    if is_end.shape != rewards.shape:
        raise ValueError(f"is_end must be [B] = {tuple(rewards.shape)}, got shape {tuple(is_end.shape)}")
    ended = einops.rearrange(is_end.to(torch.bool), "(g k) -> g k", k=group_size).to(groups.dtype)
    count = einops.reduce(ended, "g k -> g 1", "sum")
    kept = groups * ended
    others = (einops.reduce(kept, "g k -> g 1", "sum") - kept) / (count - 1).clamp(min=1)
    baseline = torch.where(count <= 1, groups, others)
    return einops.rearrange(baseline, "g k -> (g k)").to(_float_dtype(rewards))


GROUP_STDS = ("group", "leave_one_out")


def _leave_one_out_stats(groups: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For each sample of [G, K] groups, statistics of the *other* K - 1 samples of its group.

    Returns ``(mean, std, spread)``, each [G, K]: the mean, the unbiased std (divisor K - 2), and whether
    the others differ at all (``max != min``, exact, where a computed std could be a rounding residue).
    Built on a [G, K, K] "others" view (row i of group g: the group without sample i): K is a group size
    (tens), so K^2 per prompt is small. Where the others are all equal the std is that of a constant 1
    (its value is unused there), so no ``sqrt(0)`` sends a NaN into the gradient.
    """
    k = groups.shape[1]
    others = ~torch.eye(k, dtype=torch.bool, device=groups.device)  # [i, j]: j is one of i's others
    zero = torch.zeros((), dtype=groups.dtype, device=groups.device)
    row = groups[:, None, :].expand(-1, k, -1)  # [g, i, j] = r[g, j]
    mean = torch.where(others, row, zero).sum(-1) / (k - 1)
    dev = torch.where(others, row - mean[..., None], zero)
    var = (dev * dev).sum(-1) / (k - 2)
    big = torch.tensor(torch.finfo(groups.dtype).max, dtype=groups.dtype, device=groups.device)
    spread = torch.where(others, row, big).amin(-1) != torch.where(others, row, -big).amax(-1)
    std = torch.sqrt(torch.where(spread, var, torch.ones((), dtype=groups.dtype, device=groups.device)))
    return mean, std, spread


def group_normalize(
    rewards: torch.Tensor,
    group_size: int,
    scale: bool = True,
    eps: float = 1e-6,
    *,
    std: str = "group",
) -> torch.Tensor:
    """GRPO advantage: reward minus its group's mean, divided by the group's std.

    ``std="group"`` (default): ``A_i = (r_i - mean_g) / (std_g + eps)`` with the unbiased std (as
    ``torch.std``) over the K contiguous samples of each prompt (Shao 2024, DeepSeekMath, eq. 3 / sec.
    4.1.2). A group whose rewards are all equal gets advantage 0.

    ``std="leave_one_out"``: NeMo-RL's GRPO advantage with ``use_leave_one_out_baseline: true`` (its
    default; ``calculate_baseline_and_std_per_prompt`` and ``GRPOAdvantageEstimator`` in
    ``nemo_rl/algorithms/``, read at NVIDIA-NeMo/RL main, commit 7ea279ab of 2026-08-22, the same in its
    v0.7.0 tag): both the mean and the std come from the *other* K - 1 samples of the group,
    ``A_i = (r_i - mean_{-i}) / (std_{-i} + eps)``, ``std_{-i}`` the unbiased std of those K - 1 rewards
    (NeMo-RL's ``(E[r^2] - E[r]^2) (n / (n - 1))``, ``n = K - 1``). As in NeMo-RL, where the other K - 1
    rewards are all equal (std 0) the advantage is not divided: ``A_i = r_i - mean_{-i}`` (e.g. 0/1
    rewards ``[1, 0, 0]`` give ``A_0 = 1 - 0 = 1``; ``A_1 = A_2 = -0.5 / (0.707 + eps)``). rlbits tests "all equal" exactly (max == min) and
    computes the std in two passes; NeMo-RL tests its one-pass std for ``> 0``, which rounding can miss.
    Needs K >= 3 (one other sample has no unbiased std; NeMo-RL silently skips the division then).

    ``scale=False`` returns the numerator only: ``r_i - mean_g`` (Dr. GRPO, Liu 2025, which drops the std
    to remove a difficulty bias), or with ``std="leave_one_out"`` ``r_i - mean_{-i}`` (the RLOO advantage,
    ``r - rloo_baseline(r, K)``; NeMo-RL with ``normalize_rewards: false``), for any K >= 2.

    Args:
        rewards: [B] float, B = num_prompts * K.
        group_size: K >= 2 (K >= 3 for ``std="leave_one_out"`` with ``scale``).
        scale: divide by the std.
        eps: added to the std.
        std: keyword-only; ``"group"`` or ``"leave_one_out"``.

    Returns:
        [B] in ``rewards.dtype``.

    Raises:
        ValueError: ``rewards`` is not 1-D, ``K < 2``, ``B % K != 0``, an unknown ``std``, or ``K < 3``
        with ``std="leave_one_out"`` and ``scale``.
    """
    if not isinstance(std, str) or std not in GROUP_STDS:
        raise ValueError(f"unknown std {std!r}; expected one of {', '.join(GROUP_STDS)}")
    _checks.in_range("eps", eps, 0, math.inf, high_open=True)
    groups = _groups(rewards, group_size)
    if std == "group":
        out = groups - einops.reduce(groups, "g k -> g 1", "mean")
        if scale:
            out = out / (groups.std(dim=1, keepdim=True) + eps)  # over k; einops.reduce has no (unbiased) std
    else:
        if scale and group_size < 3:
            raise ValueError(
                f'std="leave_one_out" needs group_size >= 3 (the std of the other K - 1 samples needs two of '
                f"them), got {group_size}"
            )
        if scale:
            loo_mean, loo_std, spread = _leave_one_out_stats(groups)
            out = groups - loo_mean
            out = torch.where(spread, out / (loo_std + eps), out)
        else:
            out = groups - (einops.reduce(groups, "g k -> g 1", "sum") - groups) / (group_size - 1)
    return einops.rearrange(out, "g k -> (g k)").to(_float_dtype(rewards))
