"""The seeds' sequence-reward transforms against references re-written from their code, line by line.

NeMo-RL ``scale_rewards`` (grpo.py) and ``apply_reward_shaping`` (reward_functions.py), NeMo-Aligner's
``reward_standardization`` (megatron_gpt_reward_model.py), trlx's ``RunningMoments`` (utils/modeling.py). Random
rewards, lengths with padding (rows shorter than the batch) and truncated rows.
"""

from __future__ import annotations

import math

import pytest
import torch

from rlbits.functional.reward import (
    RUNNING_MOMENTS_INIT,
    linear_reward_scaling,
    overlong_reward_shaping,
    running_moments_update,
    standardize_rewards,
)


def ref_scale_rewards(rewards, source_min, source_max, target_min, target_max):
    out = []
    for r in rewards.tolist():
        r = min(max(r, source_min), source_max)
        out.append(target_min + (r - source_min) / (source_max - source_min) * (target_max - target_min))
    return torch.tensor(out, dtype=torch.float64)


def ref_apply_reward_shaping(rewards, lengths, truncated, cfg):
    rewards = [float(r) for r in rewards]
    if cfg.get("stop_properly_penalty_coef") is not None:
        c = cfg["stop_properly_penalty_coef"]
        return torch.tensor(
            [r * c if t else r for r, t in zip(rewards, truncated.tolist(), strict=True)], dtype=torch.float64
        )
    expected = cfg["max_response_length"] - cfg["overlong_buffer_length"]
    out = []
    for i, length in enumerate(lengths.tolist()):
        exceed = length - expected
        out.append(
            rewards[i] + min(-exceed / cfg["overlong_buffer_length"] * cfg["overlong_buffer_penalty"], 0)
        )
    return torch.tensor(out, dtype=torch.float64)


class RefRunningMoments:
    def __init__(self):
        self.mean, self.std, self.var, self.count = 0.0, 1.0, 1.0, 1e-24

    def update(self, xs):
        xs_count = len(xs)
        xs_mean = sum(xs) / xs_count
        xs_var = sum((x - xs_mean) ** 2 for x in xs) / xs_count
        delta = xs_mean - self.mean
        tot_count = self.count + xs_count
        new_sum = xs_var * xs_count
        old_sum = self.var * self.count + delta**2 * self.count * xs_count / tot_count
        self.mean += delta * xs_count / tot_count
        self.var = (old_sum + new_sum) / tot_count
        self.std = math.sqrt(self.var * tot_count / (tot_count - 1))
        self.count = tot_count


def _batch(seed, b=16, r=12):
    g = torch.Generator().manual_seed(seed)
    rewards = torch.randn(b, generator=g, dtype=torch.float64) * 2
    lengths = torch.randint(1, r + 1, (b,), generator=g)  # padded to r: each row's own length
    truncated = lengths == r
    truncated[0] = True
    return rewards, lengths, truncated


@pytest.mark.parametrize("seed", range(4))
def test_linear_reward_scaling_matches_nemo_rl(seed):
    rewards, _, _ = _batch(seed)
    args = (-1.0, 1.5, -0.5, 2.0)
    torch.testing.assert_close(linear_reward_scaling(rewards, *args), ref_scale_rewards(rewards, *args))
    # a flipped target
    torch.testing.assert_close(
        linear_reward_scaling(rewards, 0.0, 1.0, 1.0, 0.0), ref_scale_rewards(rewards, 0, 1, 1, 0)
    )


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize(
    "cfg",
    [
        {"max_response_length": 12, "overlong_buffer_length": 4, "overlong_buffer_penalty": 1.0},
        {"max_response_length": 10, "overlong_buffer_length": 3, "overlong_buffer_penalty": 0.5},
        {
            "max_response_length": 10,
            "overlong_buffer_length": 3,
            "overlong_buffer_penalty": 0.5,
            "stop_properly_penalty_coef": 0.25,
        },
        {"stop_properly_penalty_coef": 0.0},
    ],
)
def test_overlong_reward_shaping_matches_nemo_rl(seed, cfg):
    rewards, lengths, truncated = _batch(seed)
    got = overlong_reward_shaping(rewards, lengths, truncated, **cfg)
    torch.testing.assert_close(got, ref_apply_reward_shaping(rewards, lengths, truncated, cfg))


def test_standardize_rewards_matches_aligner():
    rewards, _, _ = _batch(0)
    torch.testing.assert_close(standardize_rewards(rewards, 5.3735, 1.2), (rewards - 5.3735) / 1.2)


def test_running_moments_match_trlx():
    ref, moments = RefRunningMoments(), torch.tensor(RUNNING_MOMENTS_INIT, dtype=torch.float64)
    for seed in range(5):
        xs, _, _ = _batch(seed, b=8 + seed)
        ref.update(xs.tolist())
        mean, var = xs.mean(), xs.var(unbiased=False)
        moments = running_moments_update(moments, mean, var, torch.tensor(float(xs.numel())))
        torch.testing.assert_close(
            moments, torch.tensor([ref.mean, ref.var, ref.count, ref.std], dtype=torch.float64)
        )


def test_bad_inputs_are_named():
    rewards, lengths, truncated = _batch(0)
    with pytest.raises(ValueError, match="source_max"):
        linear_reward_scaling(rewards, 1.0, 1.0, 0.0, 1.0)
    with pytest.raises(ValueError, match="std must be > 0"):
        standardize_rewards(rewards, 0.0, 0.0)
    with pytest.raises(ValueError, match="stop_properly_penalty_coef"):
        overlong_reward_shaping(rewards, lengths, truncated, stop_properly_penalty_coef=1.5)
    with pytest.raises(ValueError, match="max_response_length"):
        overlong_reward_shaping(rewards, lengths, truncated, overlong_buffer_length=2)
    with pytest.raises(ValueError, match="truncated must be bool"):
        overlong_reward_shaping(rewards, lengths, truncated.long(), stop_properly_penalty_coef=0.5)
    with pytest.raises(ValueError, match="moments"):
        running_moments_update(torch.zeros(3), 0.0, 1.0, 2.0)
