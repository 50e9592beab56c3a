"""Reward-model losses (pairwise Bradley-Terry with margin and reward centering, pointwise) and the sequence-reward
transforms of the seeds' RL loops (linear scaling, fixed standardisation, DAPO overlong shaping, running moments).

A reward model maps a text to one scalar (a logit). Trained on preference pairs it is a Bradley-Terry model
(Bradley & Terry 1952; as a reward model: Stiennon 2020, Ouyang 2022 eq. 1): ``P(chosen > rejected) =
sigmoid(r_c - r_r)``. Trained on labelled texts (say sentiment 0/1) it is a logistic-regression head:
``P(label = 1) = sigmoid(r)``. Both return a 0-dim loss; inputs in bf16/fp16 are computed in float32.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from rlbits.functional import _checks


def _check_scores(**tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        _checks.ndim(name, t, 1, "[B]")
        _checks.floating(name, t)
    _checks.same_shape(**tensors)
    first_name, first = next(iter(tensors.items()))
    if first.shape[0] == 0:
        raise ValueError(f"{first_name} is empty (B = 0); the loss is a mean over at least one sample")


def bradley_terry_loss(
    chosen_rewards: torch.Tensor,
    rejected_rewards: torch.Tensor,
    *,
    margin: torch.Tensor | None = None,
    center_coef: float = 0.0,
) -> torch.Tensor:
    """Pairwise reward-model loss: ``mean_i -log sigmoid(r_c,i - r_r,i - m_i) + center_coef * mean_i (r_c,i + r_r,i)^2``.

    - The first term is the Bradley-Terry negative log-likelihood of the preferences (Bradley & Terry 1952;
      Ouyang 2022 "Training language models to follow instructions with human feedback", eq. 1), with the
      margin ``m`` of Llama 2 (Touvron 2023, eq. 2): a pair labelled "much better" must be separated by at
      least ``m`` to reach the same loss. ``-log sigmoid`` is computed as ``softplus(-x)`` (``F.logsigmoid``),
      stable for any difference.
    - The second term is the reward-centering auxiliary loss of Eisenstein 2023 ("Helping or Herding? Reward
      model ensembles mitigate but do not eliminate reward hacking", arXiv 2312.09244, sec. 3: ``eta = 0.01``).
      The Bradley-Terry term sees only differences, so the scores' offset drifts freely; this term pins the
      mean score of each pair near 0. Same form as TRL's ``RewardTrainer`` (``center_rewards_coefficient *
      mean((rewards_chosen + rewards_rejected) ** 2)``). OpenRLHF's ``aux_loss_coef`` is a different thing
      (the Mixtral load-balancing loss); its ``PairWiseLoss`` is the first term with the same margin.

    Args:
        chosen_rewards: [B] float, the reward model's score of the preferred text of each pair.
        rejected_rewards: [B] float, the score of the other text.
        margin: [B] float or None (no margin): how much ``r_c`` should exceed ``r_r`` (in reward units).
        center_coef: weight of the centering term, >= 0 (0 disables it).

    Returns:
        0-dim tensor: float32 for half-precision inputs, else the promoted input dtype.

    Raises:
        TypeError: an argument is not a tensor.
        ValueError: not 1-D, shapes differ, an integer/bool tensor, B = 0, or ``center_coef`` < 0 or not finite.
    """
    _check_scores(chosen_rewards=chosen_rewards, rejected_rewards=rejected_rewards)
    if margin is not None:
        _check_scores(chosen_rewards=chosen_rewards, margin=margin)
    _checks.in_range("center_coef", center_coef, 0.0, math.inf, high_open=True)
    dtype = _checks.compute_dtype(chosen_rewards, rejected_rewards, *([margin] if margin is not None else []))
    chosen, rejected = chosen_rewards.to(dtype), rejected_rewards.to(dtype)
    diff = chosen - rejected
    if margin is not None:
        diff = diff - margin.to(dtype)
    loss = -F.logsigmoid(diff).mean()
    if isinstance(center_coef, torch.Tensor) or center_coef != 0:
        loss = loss + center_coef * (chosen + rejected).square().mean()
    return loss


def pointwise_reward_loss(rewards: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Pointwise reward-model loss: binary cross-entropy with logits, ``mean_i BCE(sigmoid(r_i), y_i)``
    ``= mean_i softplus(r_i) - y_i * r_i``.

    The reward is the logit of ``P(label = 1 | text)`` (logistic regression on the model's features; the
    classifier reward of Ziegler 2019's sentiment task). Labels are 0/1 (float, integer or bool), or soft
    targets in [0, 1] (a fraction of annotators, a teacher's probability): the loss is the cross-entropy
    against them, minimal at ``sigmoid(r) = y``. Values are not checked (that would need a host sync): a
    label outside [0, 1] gives a loss without a minimum.

    Args:
        rewards: [B] float, the model's scores (logits).
        labels: [B] float, integer or bool targets.

    Returns:
        0-dim tensor: float32 for half-precision ``rewards``, else their dtype.

    Raises:
        TypeError: an argument is not a tensor.
        ValueError: not 1-D, shapes differ, ``rewards`` not floating point, B = 0.
    """
    _check_scores(rewards=rewards)
    _checks.ndim("labels", labels, 1, "[B]")
    _checks.same_shape(rewards=rewards, labels=labels)
    if labels.is_complex():
        raise ValueError(f"labels must be float, integer or bool, got dtype {labels.dtype}")
    dtype = _checks.compute_dtype(rewards)
    return F.binary_cross_entropy_with_logits(rewards.to(dtype), labels.to(dtype))


def _check_rewards(rewards: torch.Tensor) -> None:
    _checks.tensor("rewards", rewards)
    _checks.ndim("rewards", rewards, 1, "[B]")
    _checks.floating("rewards", rewards)


def linear_reward_scaling(
    rewards: torch.Tensor, source_min: float, source_max: float, target_min: float, target_max: float
) -> torch.Tensor:
    """Clamp each reward to [source_min, source_max] and map it linearly onto [target_min, target_max].

    ``target_min + (clamp(r, source_min, source_max) - source_min) / (source_max - source_min) * (target_max -
    target_min)``: NeMo-RL ``scale_rewards`` with ``grpo.reward_scaling`` (``RewardScalingConfig``,
    nemo_rl/algorithms/grpo.py), applied before the reward shaping (``overlong_reward_shaping``).

    Args:
        rewards: [B] float, the sequence rewards.
        source_min, source_max: the interval the rewards are clamped to; ``source_max > source_min``.
        target_min, target_max: the interval it maps onto (``target_max < target_min`` flips the order).

    Returns:
        [B], the dtype of ``rewards``.

    Raises:
        TypeError: ``rewards`` is not a tensor. ValueError: not 1-D or not floating point, or
        ``source_max <= source_min``.
    """
    _check_rewards(rewards)
    if not source_max > source_min:
        raise ValueError(f"source_max ({source_max}) must be > source_min ({source_min})")
    r = rewards.clamp(min=source_min, max=source_max)
    return target_min + (r - source_min) / (source_max - source_min) * (target_max - target_min)


def standardize_rewards(rewards: torch.Tensor, mean: float, std: float) -> torch.Tensor:
    """``(r - mean) / std`` with fixed statistics: NeMo-Aligner's ``reward_standardization`` (``enable``,
    ``mean``, ``std`` of the reward model's config; megatron_gpt_reward_model.py divides each inferred reward
    this way before PPO or REINFORCE sees it).

    Args:
        rewards: [B] float. mean: subtracted. std: the divisor, > 0.

    Returns:
        [B], the dtype of ``rewards``.

    Raises:
        TypeError: ``rewards`` is not a tensor. ValueError: not 1-D or not floating point, ``std <= 0``.
    """
    _check_rewards(rewards)
    if not std > 0:
        raise ValueError(f"std must be > 0, got {std}")
    return (rewards - mean) / std


def overlong_reward_shaping(
    rewards: torch.Tensor,
    response_lengths: torch.Tensor,
    truncated: torch.Tensor,
    *,
    max_response_length: int | None = None,
    overlong_buffer_length: int | None = None,
    overlong_buffer_penalty: float | None = None,
    stop_properly_penalty_coef: float | None = None,
) -> torch.Tensor:
    """NeMo-RL's ``apply_reward_shaping`` (nemo_rl/algorithms/reward_functions.py, ``RewardShapingConfig``).

    - With ``stop_properly_penalty_coef`` (in [0, 1]; it takes precedence, the overlong fields are then
      ignored): a truncated response's reward times the coefficient, the others unchanged.
    - Otherwise DAPO's soft overlong punishment (Yu 2025, arXiv 2503.14476, eq. 13): with ``L_exp =
      max_response_length - overlong_buffer_length``, ``r += min(-(len - L_exp) / overlong_buffer_length *
      overlong_buffer_penalty, 0)``. The penalty is not capped at ``overlong_buffer_penalty`` (as NeMo-RL:
      lengths past ``max_response_length`` lose more).

    Args:
        rewards: [B] float, the (scaled) sequence rewards.
        response_lengths: [B] integer, the response's token count (NeMo-RL: the assistant message's tokens).
        truncated: [B] bool, True for a response that hit the token limit without an end.
        max_response_length, overlong_buffer_length, overlong_buffer_penalty: DAPO's fields; all three are
            needed without ``stop_properly_penalty_coef`` (``overlong_buffer_length > 0``, penalty >= 0).
        stop_properly_penalty_coef: the truncated rows' reward factor, in [0, 1]; None: DAPO's shaping.

    Returns:
        [B], the dtype of ``rewards``.

    Raises:
        TypeError: an argument is not a tensor. ValueError: shapes differ, ``rewards`` not floating point,
        a coefficient out of range, or DAPO's fields missing.
    """
    _check_rewards(rewards)
    _checks.tensor("response_lengths", response_lengths)
    _checks.tensor("truncated", truncated)
    _checks.same_shape(rewards=rewards, response_lengths=response_lengths, truncated=truncated)
    if truncated.dtype != torch.bool:
        raise ValueError(f"truncated must be bool, got {truncated.dtype}")
    if stop_properly_penalty_coef is not None:
        if not 0 <= stop_properly_penalty_coef <= 1:
            raise ValueError(
                f"stop_properly_penalty_coef must be in [0, 1], got {stop_properly_penalty_coef}"
            )
        return torch.where(truncated, rewards * stop_properly_penalty_coef, rewards)
    if max_response_length is None or overlong_buffer_length is None or overlong_buffer_penalty is None:
        raise ValueError(
            "DAPO overlong shaping needs max_response_length, overlong_buffer_length and overlong_buffer_penalty "
            "(or stop_properly_penalty_coef instead)"
        )
    if overlong_buffer_length <= 0 or overlong_buffer_penalty < 0:
        raise ValueError(
            f"overlong_buffer_length must be > 0 and overlong_buffer_penalty >= 0, got {overlong_buffer_length} "
            f"and {overlong_buffer_penalty}"
        )
    exceed = response_lengths.to(rewards.dtype) - (max_response_length - overlong_buffer_length)
    return rewards + (-exceed / overlong_buffer_length * overlong_buffer_penalty).clamp(max=0.0)


def running_moments_update(
    moments: torch.Tensor, batch_mean: torch.Tensor, batch_var: torch.Tensor, batch_count: torch.Tensor
) -> torch.Tensor:
    """One update of trlx's ``RunningMoments`` (trlx/utils/modeling.py, the parallel-variance merge of Chan et
    al. 1979) with a batch's moments.

    Args:
        moments: [4] float64 ``(mean, var, count, std)``; the initial state is ``(0, 1, 1e-24, 1)`` (trlx's).
        batch_mean, batch_var, batch_count: 0-dim, the batch's mean, biased variance (``unbiased=False``)
            and size (over every rank: trlx's ``get_global_statistics``).

    Returns:
        [4] float64, the merged ``(mean, var, count, std)``; ``std`` is the unbiased running std
        ``sqrt(var * count / (count - 1))`` that ``scale_reward: running`` divides by.

    Raises:
        ValueError: ``moments`` is not of shape [4].
    """
    _checks.tensor("moments", moments)
    if moments.shape != (4,):
        raise ValueError(f"moments must be [4] (mean, var, count, std), got shape {tuple(moments.shape)}")
    mean, var, count = moments[0], moments[1], moments[2]
    x_mean, x_var, x_count = (
        torch.as_tensor(v, dtype=moments.dtype) for v in (batch_mean, batch_var, batch_count)
    )
    delta = x_mean - mean
    total = count + x_count
    old_sum = var * count + delta**2 * count * x_count / total
    new_var = (old_sum + x_var * x_count) / total
    return torch.stack(
        [mean + delta * x_count / total, new_var, total, (new_var * total / (total - 1)).sqrt()]
    )


RUNNING_MOMENTS_INIT = (0.0, 1.0, 1e-24, 1.0)
"""trlx ``RunningMoments()``: mean 0, var 1, count 1e-24, std 1 (the ``moments`` of ``running_moments_update``)."""


__all__ = [
    "RUNNING_MOMENTS_INIT",
    "bradley_terry_loss",
    "linear_reward_scaling",
    "overlong_reward_shaping",
    "pointwise_reward_loss",
    "running_moments_update",
    "standardize_rewards",
]
