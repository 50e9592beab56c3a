"""Reward-model losses: pairwise Bradley-Terry (with margin and reward centering) and pointwise.

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


__all__ = ["bradley_terry_loss", "pointwise_reward_loss"]
