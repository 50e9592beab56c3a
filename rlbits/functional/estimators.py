"""Advantage estimators of the RL-for-LLM literature behind one signature, keyed by verl's ``adv_estimator``
names.

Every function in ``ADVANTAGE_ESTIMATORS`` is called as::

    advantages, returns = fn(token_level_rewards, action_mask, *, group_size, global_sum=None, **inputs)

- ``token_level_rewards`` [B, R] float: the reward of each response token, as verl's ``token_level_rewards``
  (an outcome reward on the last action token, minus ``kl_coef * KL_t`` on every action token when the KL
  is in the reward: ``rlbits.token_rewards`` builds it). Outcome estimators use the row sum over action
  tokens; ``reinforce_plus_plus``, ``remax`` and ``optimal_token_baseline`` use the rewards per token.
- ``action_mask`` [B, R] bool: True on the response tokens the policy chose (verl's ``response_mask``).
- ``group_size``: K, the responses per prompt. rlbits' groups are K *contiguous rows* (rows ``g K .. g K +
  K - 1`` answer prompt g, as ``rloo_baseline`` and ``group_normalize`` take them), where verl passes an
  ``index`` array of prompt ids; B must be a multiple of K. Estimators without groups (``gae``,
  ``reinforce_plus_plus``, ``remax``, ``none``) accept it and do not use it, so every entry takes one call.
- ``global_sum``: for the estimators with statistics over the whole batch (the whitening of ``gae``,
  ``reinforce_plus_plus``, ``reinforce_plus_plus_baseline`` and ``gdpo``; ``gpg``'s alpha), a callable that
  sums a tensor over every process's rows (e.g. ``lambda t: all_reduce_sum(t, env)``), so data-parallel
  ranks compute what verl's driver computes on the whole batch; None: this call's rows are the batch. The
  other estimators use only groups, which never straddle ranks, and ignore it.
- ``inputs``: what an estimator needs beyond rewards (documented on each function): ``values`` (``gae``),
  ``reward_baselines`` (``remax``), ``old_logprobs`` / ``sum_pi_squared`` (``optimal_token_baseline``),
  ``reward_components`` (``gdpo``), and hyperparameters under verl's names (``epsilon``,
  ``norm_adv_by_std_in_grpo``, ``gamma``, ``lam``, ``f_norm``, ...).

Returns ``(advantages, returns)``, each [B, R] in the rewards' floating dtype (computed in float32 for half
precision), 0 where ``action_mask`` is False. Outcome estimators return the advantages twice, as verl does.
The inputs are detached: advantages are constants of the policy update (verl computes them under
``torch.no_grad``), so the outputs carry no gradient. No host sync: every estimator compiles with
``torch.compile(fullgraph=True)``.

Source of truth: verl 0.9's ``verl/trainer/ppo/core_algos.py`` (tag v0.9.0, commit 483b8a0), the
``compute_*_advantage`` functions of its ``register_adv_est`` registry. Conventions shared by all that differ
from verl:

- rewards and values on positions where ``action_mask`` is False are ignored (verl's outcome estimators sum
  the whole row, whose padding verl keeps at 0), and the outputs there are 0 (verl leaves reward-to-go or
  whitened values on masked positions of some estimators; a loss masks them out either way).
- groups need K >= 2 (verl gives a lone response baseline 0 and std 1); use ``none`` for K = 1.
- whitening (``masked_whiten``) of a batch with one action token gives 0 (verl raises).

``rloo_vectorized`` and ``grpo_vectorized`` in verl are ``rloo`` and ``grpo`` computed without the Python
loop; here every estimator is vectorised, so they are not separate entries. ``tir_optimal_token_baseline``
(the multi-turn optimal token baseline) is not here. ``dr_grpo`` is rlbits' name for verl's ``grpo`` with
``norm_adv_by_std_in_grpo=False`` (Liu 2025).
"""

from __future__ import annotations

from collections.abc import Callable

import einops
import torch

from rlbits.functional import _checks
from rlbits.functional.advantages import _groups, gae, group_normalize, rloo_baseline

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "dr_grpo_advantage",
    "gae_advantage",
    "gdpo_advantage",
    "gpg_advantage",
    "grpo_advantage",
    "grpo_loo_advantage",
    "grpo_passk_advantage",
    "no_baseline_advantage",
    "opo_advantage",
    "optimal_token_baseline_advantage",
    "raw_reward_advantage",
    "reinforce_plus_plus_advantage",
    "reinforce_plus_plus_baseline_advantage",
    "remax_advantage",
    "rloo_advantage",
]

GlobalSum = Callable[[torch.Tensor], torch.Tensor] | None


def _prepare(token_level_rewards, action_mask, **more):
    """Checks, then (mask, rewards in the compute dtype with masked positions 0, output dtype)."""
    _checks.ndim("token_level_rewards", token_level_rewards, 2, "[B, R]")
    _checks.ndim("action_mask", action_mask, 2, "[B, R]")
    _checks.same_shape(token_level_rewards=token_level_rewards, action_mask=action_mask, **more)
    dtype = _checks.compute_dtype(token_level_rewards)
    out_dtype = token_level_rewards.dtype if token_level_rewards.is_floating_point() else torch.float32
    mask = action_mask.to(torch.bool)
    zero = torch.zeros((), dtype=dtype, device=token_level_rewards.device)
    rewards = torch.where(mask, token_level_rewards.detach().to(dtype), zero)
    return mask, rewards, out_dtype


def _outcome(
    seq: torch.Tensor, mask: torch.Tensor, out_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """A sequence advantage [B] broadcast over the action tokens, returned twice (verl's outcome form)."""
    adv = torch.where(mask, seq[:, None], torch.zeros((), dtype=seq.dtype, device=seq.device)).to(out_dtype)
    return adv, adv


def _sum(x: torch.Tensor, global_sum: GlobalSum) -> torch.Tensor:
    return x if global_sum is None else global_sum(x)


def _whiten(x: torch.Tensor, mask: torch.Tensor, global_sum: GlobalSum) -> torch.Tensor:
    """``masked_whiten`` (mean and unbiased variance over the action tokens, ``rsqrt(var + 1e-8)``) with the
    sums taken by ``global_sum``; verl's ``verl_F.masked_whiten``. 0 where ``mask`` is False."""
    zero = torch.zeros((), dtype=x.dtype, device=x.device)
    count = _sum(mask.sum().to(x.dtype), global_sum)
    mean = _sum(torch.where(mask, x, zero).sum(), global_sum) / count.clamp(min=1)
    centered = torch.where(mask, x - mean, zero)
    var = _sum((centered * centered).sum(), global_sum) / (count - 1).clamp(min=1)
    return centered * torch.rsqrt(var + 1e-8)


def _reward_to_go(rewards: torch.Tensor) -> torch.Tensor:
    """``G_t = sum_{s >= t} r_s`` along dim 1 (undiscounted)."""
    return rewards.flip(-1).cumsum(-1).flip(-1)


def grpo_advantage(
    token_level_rewards: torch.Tensor,
    action_mask: torch.Tensor,
    *,
    group_size: int,
    global_sum: GlobalSum = None,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO: ``A_i = (r_i - mean_g r) / (std_g r + epsilon)`` (unbiased std), broadcast over the response;
    without ``norm_adv_by_std_in_grpo`` the numerator only (Dr. GRPO). Shao 2024, DeepSeekMath, sec. 4.1.2;
    verl's ``grpo``. ``r_i`` is the row sum of ``token_level_rewards``; this is ``group_normalize``.

    Args:
        token_level_rewards, action_mask, group_size, global_sum: see the module docstring.
        epsilon: added to the group std.
        norm_adv_by_std_in_grpo: divide by the group std.

    Returns:
        ``(advantages, returns)`` [B, R], equal (see the module docstring).

    Raises:
        ValueError: shapes, ``group_size`` (not an int >= 2 dividing B), ``epsilon < 0``.
    """
    mask, rewards, out_dtype = _prepare(token_level_rewards, action_mask)
    seq = group_normalize(rewards.sum(-1), group_size, scale=norm_adv_by_std_in_grpo, eps=epsilon)
    return _outcome(seq, mask, out_dtype)


def dr_grpo_advantage(
    token_level_rewards: torch.Tensor,
    action_mask: torch.Tensor,
    *,
    group_size: int,
    global_sum: GlobalSum = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dr. GRPO: ``A_i = r_i - mean_g r`` (Liu 2025, "Understanding R1-Zero-Like Training", eq. 4), verl's
    ``grpo`` with ``norm_adv_by_std_in_grpo=False``. Arguments, returns and errors as ``grpo_advantage``."""
    return grpo_advantage(
        token_level_rewards, action_mask, group_size=group_size, norm_adv_by_std_in_grpo=False
    )


def grpo_loo_advantage(
    token_level_rewards: torch.Tensor,
    action_mask: torch.Tensor,
    *,
    group_size: int,
    global_sum: GlobalSum = None,
    epsilon: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """NeMo-RL's GRPO advantage with its defaults (``grpo.adv_estimator: {name: grpo, normalize_rewards: true,
    use_leave_one_out_baseline: true}``; ``GRPOAdvantageEstimator`` with ``calculate_baseline_and_std_per_prompt``
    in ``nemo_rl/algorithms/advantage_estimator.py`` and ``utils.py``): ``A_i = (r_i - mean_{j != i} r_j) /
    (std_{j != i} r_j + epsilon)``, the mean and unbiased std of the *other* K - 1 rewards of the group,
    broadcast over the response; not divided where the others are all equal (NeMo-RL's ``std > 0`` mask), so
    with K = 2 (one other reward, whose unbiased std NeMo-RL sets to 0) it is the RLOO advantage. This is
    ``group_normalize(r, K, std="leave_one_out")`` (which documents the rounding difference: rlbits tests
    "all equal" exactly). No verl name: verl's ``grpo`` uses the whole group's mean and std.

    Args:
        token_level_rewards, action_mask, group_size, global_sum: see the module docstring.
        epsilon: added to the leave-one-out std (NeMo-RL's fixed 1e-6).

    Returns:
        ``(advantages, returns)`` [B, R], equal.

    Raises:
        ValueError: shapes, ``group_size`` (not an int >= 2 dividing B), ``epsilon < 0``.
    """
    mask, rewards, out_dtype = _prepare(token_level_rewards, action_mask)
    scale = group_size != 2  # one other reward: NeMo-RL's std is 0 (nan_to_num), the division is skipped
    seq = group_normalize(rewards.sum(-1), group_size, scale=scale, eps=epsilon, std="leave_one_out")
    return _outcome(seq, mask, out_dtype)


def rloo_advantage(
    token_level_rewards: torch.Tensor,
    action_mask: torch.Tensor,
    *,
    group_size: int,
    global_sum: GlobalSum = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RLOO: ``A_i = r_i - mean_{j != i} r_j`` within the group (Kool 2019; Ahmadian 2024, eq. 6), verl's
    ``rloo`` (which writes it as ``K / (K - 1) (r_i - mean_g r)``): ``r - rloo_baseline(r, K)``.

    Returns:
        ``(advantages, returns)`` [B, R], equal.

    Raises:
        ValueError: shapes, ``group_size``.
    """
    mask, rewards, out_dtype = _prepare(token_level_rewards, action_mask)
    scores = rewards.sum(-1)
    return _outcome(scores - rloo_baseline(scores, group_size), mask, out_dtype)


def no_baseline_advantage(
    token_level_rewards: torch.Tensor,
    action_mask: torch.Tensor,
    *,
    group_size: int | None = None,
    global_sum: GlobalSum = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain REINFORCE: ``A_i = r_i``, the sequence reward itself on every action token (Williams 1992). Not in
    verl; rlbits' ``none``. ``group_size`` is not used.

    Returns:
        ``(advantages, returns)`` [B, R], equal.

    Raises:
        ValueError: shapes.
    """
    mask, rewards, out_dtype = _prepare(token_level_rewards, action_mask)
    return _outcome(rewards.sum(-1), mask, out_dtype)


def gae_advantage(
    token_level_rewards: torch.Tensor,
    action_mask: torch.Tensor,
    *,
    values: torch.Tensor,
    group_size: int | None = None,
    global_sum: GlobalSum = None,
    gamma: float = 1.0,
    lam: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE (Schulman 2016, eq. 16) with the advantages whitened over the batch's action tokens: verl's ``gae``.

    ``gae(token_level_rewards, values, action_mask, gamma, lam)`` (action tokens only; verl's recursion
    skips masked positions the same way), then ``advantages = whiten(advantages)``; ``returns = A + V``
    before whitening (the critic's targets). ``gamma`` and ``lam`` default to verl's ``algorithm`` config
    (1.0, 1.0). ``group_size`` is not used.

    Args:
        token_level_rewards, action_mask, global_sum: see the module docstring.
        values: [B, R] critic values V(s_t).
        gamma, lam: discount and GAE lambda, in [0, 1].

    Returns:
        ``(advantages, returns)`` [B, R]: whitened advantages and the return targets.

    Raises:
        ValueError: shapes, ``gamma`` or ``lam`` outside [0, 1].
    """
    mask, rewards, out_dtype = _prepare(token_level_rewards, action_mask, values=values)
    adv, returns = gae(rewards, values.detach().to(rewards.dtype), mask, gamma=gamma, lam=lam)
    return _whiten(adv, mask, global_sum).to(out_dtype), returns.to(out_dtype)


def reinforce_plus_plus_advantage(
    token_level_rewards: torch.Tensor,
    action_mask: torch.Tensor,
    *,
    group_size: int | None = None,
    global_sum: GlobalSum = None,
    gamma: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++: the discounted return to go of each action token, whitened over the batch (Hu 2025,
    "REINFORCE++", arXiv 2501.03262, sec. 3.2), verl's ``reinforce_plus_plus``.

    ``G_t = r_t + gamma G_t'`` over consecutive action tokens t, t' (masked positions skipped, as verl's
    recursion carries the return past them), ``A = whiten(G)``. The per-token KL penalty is part of
    ``token_level_rewards`` (REINFORCE++ puts the KL in the reward). ``group_size`` is not used.

    Args:
        token_level_rewards, action_mask, global_sum: see the module docstring.
        gamma: discount per action token, in [0, 1] (verl's ``algorithm.gamma``).

    Returns:
        ``(advantages, returns)`` [B, R]: the whitened and the raw returns to go.

    Raises:
        ValueError: shapes, ``gamma`` outside [0, 1].
    """
    mask, rewards, out_dtype = _prepare(token_level_rewards, action_mask)
    # GAE with V = 0 and lambda = 1 is the discounted return to go over action tokens.
    returns, _ = gae(rewards, torch.zeros_like(rewards), mask, gamma=gamma, lam=1.0)
    return _whiten(returns, mask, global_sum).to(out_dtype), returns.to(out_dtype)


def reinforce_plus_plus_baseline_advantage(
    token_level_rewards: torch.Tensor,
    action_mask: torch.Tensor,
    *,
    group_size: int,
    global_sum: GlobalSum = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ with a group baseline: ``r_i - mean_g r`` on every action token, then whitened over all
    the batch's action tokens (Hu 2025, arXiv 2501.03262, sec. 3.3 "REINFORCE++-baseline"), verl's
    ``reinforce_plus_plus_baseline``. The whitening weighs a response by its length.

    Returns:
        ``(advantages, returns)`` [B, R], equal.

    Raises:
        ValueError: shapes, ``group_size``.
    """
    mask, rewards, out_dtype = _prepare(token_level_rewards, action_mask)
    seq = group_normalize(rewards.sum(-1), group_size, scale=False)
    token = torch.where(mask, seq[:, None], torch.zeros((), dtype=seq.dtype, device=seq.device))
    adv = _whiten(token, mask, global_sum).to(out_dtype)
    return adv, adv


def remax_advantage(
    token_level_rewards: torch.Tensor,
    action_mask: torch.Tensor,
    *,
    reward_baselines: torch.Tensor,
    group_size: int | None = None,
    global_sum: GlobalSum = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """ReMax: the return to go minus the reward of the prompt's greedy response (Li 2024, "ReMax", arXiv
    2310.10505, Algorithm 1), verl's ``remax``: ``G_t = sum_{s >= t} r_s``, ``A_t = G_t - b``.
    ``group_size`` is not used.

    Args:
        token_level_rewards, action_mask: see the module docstring.
        reward_baselines: [B] the reward of a greedy response to each row's prompt.

    Returns:
        ``(advantages, returns)`` [B, R].

    Raises:
        ValueError: shapes (``reward_baselines`` must be [B]).
    """
    mask, rewards, out_dtype = _prepare(token_level_rewards, action_mask)
    _checks.ndim("reward_baselines", reward_baselines, 1, "[B]")
    if reward_baselines.shape[0] != rewards.shape[0]:
        raise ValueError(
            f"reward_baselines has {reward_baselines.shape[0]} rows but the rewards {rewards.shape[0]}"
        )
    zero = torch.zeros((), dtype=rewards.dtype, device=rewards.device)
    returns = torch.where(mask, _reward_to_go(rewards), zero)
    adv = torch.where(mask, returns - reward_baselines.detach().to(rewards.dtype)[:, None], zero)
    return adv.to(out_dtype), returns.to(out_dtype)


def opo_advantage(
    token_level_rewards: torch.Tensor,
    action_mask: torch.Tensor,
    *,
    group_size: int,
    global_sum: GlobalSum = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """OPO: ``A_i = r_i - sum_j l_j r_j / sum_j l_j`` over the group, ``l_j`` the response's action-token
    count: the optimal baseline under an exact on-policy update (Hao 2025, "On-Policy RL with Optimal Reward
    Baseline", arXiv 2505.23585, eq. 5), verl's ``opo``. A group whose responses are all empty gets
    baseline 0 (verl: 0/0).

    Returns:
        ``(advantages, returns)`` [B, R], equal.

    Raises:
        ValueError: shapes, ``group_size``.
    """
    mask, rewards, out_dtype = _prepare(token_level_rewards, action_mask)
    scores = _groups(rewards.sum(-1), group_size)
    lengths = _groups(mask.sum(-1).to(rewards.dtype), group_size)
    total = lengths.sum(1, keepdim=True)
    baseline = (lengths * scores).sum(1, keepdim=True) / total.clamp(min=1)
    return _outcome(einops.rearrange(scores - baseline, "g k -> (g k)"), mask, out_dtype)


def gpg_advantage(
    token_level_rewards: torch.Tensor,
    action_mask: torch.Tensor,
    *,
    group_size: int,
    global_sum: GlobalSum = None,
    f_norm: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GPG: ``A_i = alpha (r_i - mean_g r) / f_norm`` with ``alpha = B / M``, M the number of responses of
    the batch whose reward is not 0 (at least 1): a correction for the groups without signal (Chu 2025,
    "GPG: A Simple and Strong RL Baseline", arXiv 2504.02546, eq. 12), verl's ``gpg``. verl's ``alpha`` and
    ``epsilon`` arguments are overwritten or unused there, so they are not taken here.

    Args:
        token_level_rewards, action_mask, group_size, global_sum: see the module docstring (``global_sum``
            counts B and M over every rank).
        f_norm: divisor of the advantage (> 0; verl's default 1.0).

    Returns:
        ``(advantages, returns)`` [B, R], equal.

    Raises:
        ValueError: shapes, ``group_size``, ``f_norm <= 0``.
    """
    mask, rewards, out_dtype = _prepare(token_level_rewards, action_mask)
    _checks.in_range("f_norm", f_norm, 0, float("inf"), low_open=True, high_open=True)
    scores = rewards.sum(-1)
    size = _sum(torch.tensor(float(scores.shape[0]), dtype=scores.dtype, device=scores.device), global_sum)
    nonzero = _sum((scores != 0).sum().to(scores.dtype), global_sum)
    alpha = size / nonzero.clamp(min=1)
    return _outcome(alpha * group_normalize(scores, group_size, scale=False) / f_norm, mask, out_dtype)


def grpo_passk_advantage(
    token_level_rewards: torch.Tensor,
    action_mask: torch.Tensor,
    *,
    group_size: int,
    global_sum: GlobalSum = None,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pass@k training: only the best response of each group gets an advantage, ``r_max - r_second_max``
    (divided by the group's unbiased std + ``epsilon`` with ``norm_adv_by_std_in_grpo``); every other
    response gets 0 (Chen 2025, "Pass@k Training", arXiv 2503.19595 as cited by verl), verl's
    ``grpo_passk``. With a tie for the best the difference is 0, so which row holds it does not matter.

    Returns:
        ``(advantages, returns)`` [B, R], equal.

    Raises:
        ValueError: shapes, ``group_size``, ``epsilon < 0``.
    """
    mask, rewards, out_dtype = _prepare(token_level_rewards, action_mask)
    _checks.in_range("epsilon", epsilon, 0, float("inf"), high_open=True)
    groups = _groups(rewards.sum(-1), group_size)
    k = group_size
    top, top_idx = groups.topk(2, dim=1)
    gap = top[:, :1] - top[:, 1:]
    if norm_adv_by_std_in_grpo:
        gap = gap / (groups.std(dim=1, keepdim=True) + epsilon)
    best = torch.arange(k, device=groups.device)[None, :] == top_idx[:, :1]
    seq = torch.where(best, gap, torch.zeros((), dtype=gap.dtype, device=gap.device))
    return _outcome(einops.rearrange(seq, "g k -> (g k)"), mask, out_dtype)


def optimal_token_baseline_advantage(
    token_level_rewards: torch.Tensor,
    action_mask: torch.Tensor,
    *,
    group_size: int,
    old_logprobs: torch.Tensor,
    sum_pi_squared: torch.Tensor,
    rollout_is_weights: torch.Tensor | None = None,
    global_sum: GlobalSum = None,
    handle_zero_tail: bool = True,
    epsilon: float = 1e-8,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Optimal token baseline: a baseline per position, ``B_t = sum_i G_it W_it / (sum_i W_it + epsilon)``
    over the group's responses that reach position t, with ``G_t`` the return to go and ``W_t = sum_{j<=t}
    (1 - 2 pi_j + sum_v pi_v^2) rho_j^2`` the accumulated path variance of the score function (verl's
    ``optimal_token_baseline``, from the verl authors' optimal-baseline derivation; ``rho`` the rollout IS
    weights, 1 without them). ``A_t = G_t - B_t``.

    With ``handle_zero_tail``: when one response of a group is strictly the longest, its baseline from the
    second-longest response's length on is 0 (no other response estimates it there).

    Args:
        token_level_rewards, action_mask, group_size: see the module docstring.
        old_logprobs: [B, R] log pi_old of the sampled tokens (pi_j = exp).
        sum_pi_squared: [B, R] ``sum_v pi_old(v)^2`` over the vocabulary at each position.
        rollout_is_weights: optional [B, R] rollout importance weights.
        handle_zero_tail: zero the lone longest response's tail baseline.
        epsilon: added to the weight sum.

    Returns:
        ``(advantages, returns)`` [B, R]: ``returns`` is the return to go.

    Raises:
        ValueError: shapes, ``group_size``.
    """
    more = dict(old_logprobs=old_logprobs, sum_pi_squared=sum_pi_squared)
    if rollout_is_weights is not None:
        more["rollout_is_weights"] = rollout_is_weights
    mask, rewards, out_dtype = _prepare(token_level_rewards, action_mask, **more)
    _groups(rewards.sum(-1), group_size)  # the group checks
    k = group_size
    dtype, zero = rewards.dtype, torch.zeros((), dtype=rewards.dtype, device=rewards.device)
    returns = torch.where(mask, _reward_to_go(rewards), zero)
    w = 1 - 2 * torch.exp(old_logprobs.detach().to(dtype)) + sum_pi_squared.detach().to(dtype)
    if rollout_is_weights is not None:
        w = w * rollout_is_weights.detach().to(dtype) ** 2
    w_cum = torch.where(mask, w, zero).cumsum(-1)
    w_group = einops.rearrange(torch.where(mask, w_cum, zero), "(g k) r -> g k r", k=k)
    g_group = einops.rearrange(returns, "(g k) r -> g k r", k=k)
    baseline = (g_group * w_group).sum(1, keepdim=True) / (w_group.sum(1, keepdim=True) + epsilon)
    baseline = baseline.expand(-1, k, -1)
    if handle_zero_tail:
        lengths = einops.rearrange(mask.sum(-1), "(g k) -> g k", k=k)
        top = lengths.topk(2, dim=1).values  # [G, 2]: the longest and the second-longest
        longest = lengths == top[:, :1]
        lone = (longest.sum(1, keepdim=True) == 1) & (top[:, :1] > top[:, 1:])  # [G, 1]
        positions = torch.arange(rewards.shape[1], device=rewards.device)
        tail = (lone & longest)[..., None] & (positions >= top[:, 1:, None])  # [G, K, R]
        baseline = torch.where(tail, zero, baseline)
    adv = torch.where(mask, returns - einops.rearrange(baseline, "g k r -> (g k) r"), zero)
    return adv.to(out_dtype), returns.to(out_dtype)


def gdpo_advantage(
    token_level_rewards: torch.Tensor,
    action_mask: torch.Tensor,
    *,
    group_size: int,
    reward_components: torch.Tensor | None = None,
    gdpo_reward_weights: torch.Tensor | list[float] | None = None,
    global_sum: GlobalSum = None,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GDPO: each reward component normalised within the group on its own (GRPO's advantage per
    component), the weighted sum whitened over the batch's action tokens (Liu 2026, "GDPO: Group reward-
    Decoupled Normalization Policy Optimization", arXiv 2601.05242), verl's ``gdpo``:
    ``A = whiten(sum_c w_c grpo(r_c))``.

    rlbits' rewards are one scalar per response; GDPO is for a reward made of several scores (format,
    accuracy, ...), which the caller passes as ``reward_components``. Without them the one component is the
    row sum of ``token_level_rewards``, and GDPO is GRPO whitened over the tokens (as verl without
    ``gdpo_reward_keys``).

    Args:
        token_level_rewards, action_mask, group_size, global_sum: see the module docstring.
        reward_components: optional [B, C] float, one column per reward component.
        gdpo_reward_weights: optional [C] weights w_c (verl's ``gdpo_reward_weights``); default all 1.
        epsilon, norm_adv_by_std_in_grpo: as ``grpo_advantage``, per component.

    Returns:
        ``(advantages, returns)`` [B, R], equal.

    Raises:
        ValueError: shapes (``reward_components`` not [B, C], weights not [C]), ``group_size``.
    """
    mask, rewards, out_dtype = _prepare(token_level_rewards, action_mask)
    if reward_components is None:
        components = rewards.sum(-1)[:, None]
    else:
        _checks.ndim("reward_components", reward_components, 2, "[B, C]")
        if reward_components.shape[0] != rewards.shape[0]:
            raise ValueError(
                f"reward_components has {reward_components.shape[0]} rows but the rewards {rewards.shape[0]}"
            )
        components = reward_components.detach().to(rewards.dtype)
    n = components.shape[1]
    if gdpo_reward_weights is None:
        weights = torch.ones(n, dtype=rewards.dtype, device=rewards.device)
    else:
        weights = torch.as_tensor(gdpo_reward_weights, dtype=rewards.dtype, device=rewards.device)
        if weights.shape != (n,):
            raise ValueError(f"gdpo_reward_weights must be [C] = [{n}], got shape {tuple(weights.shape)}")
    k = group_size
    normalised = torch.stack(
        [group_normalize(components[:, c], k, scale=norm_adv_by_std_in_grpo, eps=epsilon) for c in range(n)],
        -1,
    )
    seq = (normalised * weights).sum(-1)
    token = torch.where(mask, seq[:, None], torch.zeros((), dtype=seq.dtype, device=seq.device))
    adv = _whiten(token, mask, global_sum).to(out_dtype)
    return adv, adv


def raw_reward_advantage(
    token_level_rewards: torch.Tensor,
    action_mask: torch.Tensor,
    *,
    group_size: int | None = None,
    global_sum: GlobalSum = None,
    normalize_advantages: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The raw reward as the advantage: NeMo-RL's ``raw_reward`` estimator (``RawRewardAdvantageEstimator``,
    nemo_rl/algorithms/advantage_estimator.py): no value model, no baseline.

    ``A_t = r`` (the row sum) on every action token; with ``normalize_advantages`` (NeMo-RL's
    ``adv_estimator.normalize_advantages``, default True) ``A = (A - mean) * rsqrt(max(var, 1e-8))`` with the
    mean and the *biased* variance over the batch's action tokens, as NeMo-RL whitens it (not
    ``masked_whiten``'s unbiased ``rsqrt(var + 1e-8)``). Without it this is ``none``. NeMo-RL returns no value
    targets; here the advantages are returned twice, as by the other outcome estimators. NeMo-RL's estimator
    reads the sequence reward, so a KL in the reward (in the row sum here) is rlbits' addition: leave it out
    for NeMo-RL's numbers. ``group_size`` is not used.

    Args:
        token_level_rewards, action_mask, global_sum: see the module docstring.
        normalize_advantages: whiten over the batch's action tokens (every rank's with ``global_sum``).

    Returns:
        ``(advantages, advantages)`` [B, R].

    Raises:
        ValueError: shapes.
    """
    mask, rewards, out_dtype = _prepare(token_level_rewards, action_mask)
    zero = torch.zeros((), dtype=rewards.dtype, device=rewards.device)
    adv = torch.where(mask, rewards.sum(-1)[:, None], zero)
    if normalize_advantages:
        count = _sum(mask.sum().to(adv.dtype), global_sum).clamp(min=1)
        mean = _sum(adv.sum(), global_sum) / count
        centered = torch.where(mask, adv - mean, zero)
        var = _sum((centered * centered).sum(), global_sum) / count
        adv = centered * var.clamp(min=1e-8).rsqrt()
    adv = adv.to(out_dtype)
    return adv, adv


ADVANTAGE_ESTIMATORS: dict[str, Callable[..., tuple[torch.Tensor, torch.Tensor]]] = {
    "gae": gae_advantage,
    "grpo": grpo_advantage,
    "grpo_loo": grpo_loo_advantage,
    "dr_grpo": dr_grpo_advantage,
    "rloo": rloo_advantage,
    "none": no_baseline_advantage,
    "reinforce_plus_plus": reinforce_plus_plus_advantage,
    "reinforce_plus_plus_baseline": reinforce_plus_plus_baseline_advantage,
    "remax": remax_advantage,
    "opo": opo_advantage,
    "gpg": gpg_advantage,
    "grpo_passk": grpo_passk_advantage,
    "optimal_token_baseline": optimal_token_baseline_advantage,
    "gdpo": gdpo_advantage,
    "raw_reward": raw_reward_advantage,
}
"""verl's ``adv_estimator`` name (plus rlbits' ``dr_grpo``, ``none`` and ``grpo_loo`` (NeMo-RL's default
``grpo``), and NeMo-RL's ``raw_reward``) ->
advantage estimator with the shared signature (see this module's docstring)."""
