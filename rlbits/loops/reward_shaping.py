"""The sequence-reward transforms of ``RewardShapingConfig`` and the truncation mask, for the ppo and reinforce
loops (the math: ``rlbits.functional.reward``)."""

from __future__ import annotations

import torch
from tensordict import TensorDictBase

from rlbits.functional.reward import linear_reward_scaling, overlong_reward_shaping, standardize_rewards
from rlbits.loops.config import RewardShapingConfig


def truncated_rows(batch: TensorDictBase) -> torch.Tensor:
    """[B] bool: ``truncated`` (responses that reached the token limit without an end), all False without it."""
    if "truncated" in batch.keys():
        return batch["truncated"].bool()
    return torch.zeros(batch.batch_size[0], dtype=torch.bool, device=batch["action_mask"].device)


def shape_rewards(rewards: torch.Tensor, batch: TensorDictBase, cfg: RewardShapingConfig) -> torch.Tensor:
    """[B] the rewards after the seeds' transforms, in their order: NeMo-Aligner's standardisation ``(r - mean)
    / std`` (its reward model applies it), NeMo-RL's ``scale_rewards`` (clamp and map linearly), then NeMo-RL's
    ``apply_reward_shaping`` (``stop_properly_penalty_coef`` on truncated rows, else DAPO's overlong penalty on
    the action-token count). ``rewards`` [B] float; returns it unchanged when every transform is off."""
    if cfg.reward_standardization_std is not None:
        rewards = standardize_rewards(
            rewards, cfg.reward_standardization_mean, cfg.reward_standardization_std
        )
    if cfg.reward_scaling:
        rewards = linear_reward_scaling(
            rewards,
            cfg.reward_scaling_source_min,
            cfg.reward_scaling_source_max,
            cfg.reward_scaling_target_min,
            cfg.reward_scaling_target_max,
        )
    if cfg.stop_properly_penalty_coef is not None or cfg.overlong_shaping:
        rewards = overlong_reward_shaping(
            rewards,
            batch["action_mask"].sum(-1),
            truncated_rows(batch).to(rewards.device),
            max_response_length=cfg.response_length_limit,
            overlong_buffer_length=cfg.overlong_buffer_length,
            overlong_buffer_penalty=cfg.overlong_buffer_penalty,
            stop_properly_penalty_coef=cfg.stop_properly_penalty_coef,
        )
    return rewards


def loss_mask(batch: TensorDictBase, cfg: RewardShapingConfig) -> torch.Tensor:
    """[B, R] bool: ``action_mask``, without the truncated rows when ``overlong_filtering``."""
    mask = batch["action_mask"]
    return mask & ~truncated_rows(batch)[:, None].to(mask.device) if cfg.overlong_filtering else mask


__all__ = ["loss_mask", "shape_rewards", "truncated_rows"]
