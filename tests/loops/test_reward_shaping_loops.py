"""RewardShapingConfig and trlx's scale_reward in the ppo and reinforce loops: each field changes the rewards the
optimisation sees as the seeds' references say (tests/functional/test_reward_shaping.py), the truncation mask
keeps truncated rows out of PPO's losses, and a resumed run continues the running statistics exactly."""

from __future__ import annotations

import copy
import dataclasses
import math
from types import SimpleNamespace

import pytest
import torch
from tensordict import TensorDict

from rlbits.distributed.env import DistEnv
from rlbits.loops import reinforce
from rlbits.loops.config import ConfigError, config_from_dict
from rlbits.loops.metrics import StepMetrics
from rlbits.loops.optim import make_optimizer
from rlbits.loops.phases import prompt_batch
from rlbits.loops.ppo import (
    PPOConfig,
    State,
    advantages,
    init_state,
    reference,
    rollout,
    scale_rewards,
    score,
    train,
    update,
    values,
)
from rlbits.loops.reinforce import ReinforceConfig
from rlbits.loops.run import read_metrics
from rlbits.loops.runtime import setup
from rlbits.models.load import save_pretrained
from rlbits.models.tiny import tiny_causal_lm, tiny_tokenizer

PROMPTS = ["the plot", "a film", "it was", "my day", "so this", "hello", "we saw", "an end"]
SHAPING = [
    dict(reward_standardization_mean=0.5, reward_standardization_std=2.0),
    dict(
        reward_scaling=True,
        reward_scaling_source_min=0.0,
        reward_scaling_source_max=2.0,
        reward_scaling_target_min=-1.0,
        reward_scaling_target_max=1.0,
    ),
    dict(overlong_buffer_length=2, overlong_buffer_penalty=1.0, max_response_length=4),
    dict(overlong_buffer_length=2, overlong_buffer_penalty=1.0, stop_properly_penalty_coef=0.5),
]


def ref_shape(rewards, lengths, truncated, f):
    """The seeds' order, written from their code: Aligner's standardisation, NeMo-RL scale_rewards, then
    apply_reward_shaping (stop-properly first)."""
    out = []
    for r, n, t in zip(rewards, lengths, truncated, strict=True):
        if f.get("reward_standardization_std") is not None:
            r = (r - f["reward_standardization_mean"]) / f["reward_standardization_std"]
        if f.get("reward_scaling"):
            lo, hi = f["reward_scaling_source_min"], f["reward_scaling_source_max"]
            r = min(max(r, lo), hi)
            r = f["reward_scaling_target_min"] + (r - lo) / (hi - lo) * (
                f["reward_scaling_target_max"] - f["reward_scaling_target_min"]
            )
        if f.get("stop_properly_penalty_coef") is not None:
            r = r * f["stop_properly_penalty_coef"] if t else r
        elif f.get("overlong_buffer_length") is not None:
            expected = f.get("max_response_length", 6) - f["overlong_buffer_length"]
            r = r + min(-(n - expected) / f["overlong_buffer_length"] * f["overlong_buffer_penalty"], 0)
        out.append(r)
    return out


def hand_batch(rewards, lengths, truncated):
    b, r = len(rewards), max(lengths)
    mask = torch.arange(r)[None, :] < torch.tensor(lengths)[:, None]
    lp = torch.where(mask, torch.full((b, r), -1.0), 0.0)
    return TensorDict(
        {
            "rewards": torch.tensor(rewards),
            "action_mask": mask,
            "logprobs": lp,
            "ref_logprobs": lp,
            "truncated": torch.tensor(truncated),
        },
        batch_size=[b],
    )


REWARDS, LENGTHS, TRUNCATED = [1.0, 0.0, 2.5, -0.5], [3, 1, 6, 4], [False, False, True, True]


@pytest.mark.parametrize("fields", SHAPING)
def test_reinforce_advantages_see_the_shaped_rewards(fields):
    batch = hand_batch(REWARDS, LENGTHS, TRUNCATED)
    cfg = ReinforceConfig(
        num_generations_per_prompt=2,
        num_prompts_per_step=2,
        adv_estimator="dr_grpo",
        max_new_tokens=6,
        **fields,
    )
    cfg.check()
    state = SimpleNamespace(metrics=StepMetrics(), env=DistEnv())
    reinforce.advantages(state, batch, cfg)
    m = state.metrics.reduce(DistEnv())
    shaped = torch.tensor(ref_shape(REWARDS, LENGTHS, TRUNCATED, fields))
    assert m["rewards_scaled"] == pytest.approx(shaped.mean().item())
    assert m["rewards"] == pytest.approx(
        sum(REWARDS) / 4
    )  # the task's reward stays what is logged as rewards
    expected = shaped - shaped.view(2, 2).mean(1).repeat_interleave(2)  # dr_grpo: r - group mean
    torch.testing.assert_close(batch["advantages"][:, 0], expected)


@pytest.mark.parametrize("fields", SHAPING)
def test_ppo_scale_rewards_shape_first(fields):
    cfg = PPOConfig(max_new_tokens=6, reward_subtract_reference=True, reward_clip=0.7, **fields)
    cfg.check()
    batch = hand_batch(REWARDS, LENGTHS, TRUNCATED)
    batch["reference_rewards"] = torch.tensor([0.1, 0.2, 0.3, 0.4])
    shaped = torch.tensor(ref_shape(REWARDS, LENGTHS, TRUNCATED, fields))
    expected = (shaped - batch["reference_rewards"]).clamp(-0.7, 0.7)
    torch.testing.assert_close(scale_rewards(batch, cfg, DistEnv()), expected)


class RefTrlx:
    """trlx accelerate_ppo_trainer.make_experience's reward scaling, one process, written from its code."""

    def __init__(self, scale_reward, cliprange_reward, ref_std=None):
        self.scale_reward, self.clip = scale_reward, cliprange_reward
        self.ref_mean, self.ref_std = (0.0, ref_std) if ref_std is not None else (None, None)
        self.mean, self.std, self.var, self.count = 0.0, 1.0, 1.0, 1e-24

    def __call__(self, scores):
        scores = [min(max(s, -self.clip), self.clip) for s in scores] if self.clip else list(scores)
        n = len(scores)
        mean = sum(scores) / n
        if self.ref_mean is None:
            self.ref_mean, self.ref_std = mean, math.sqrt(sum((s - mean) ** 2 for s in scores) / (n - 1))
        var = sum((s - mean) ** 2 for s in scores) / n
        delta, tot = mean - self.mean, self.count + n
        old_sum = self.var * self.count + delta**2 * self.count * n / tot
        self.mean += delta * n / tot
        self.var = (old_sum + var * n) / tot
        self.std = math.sqrt(self.var * tot / (tot - 1))
        self.count = tot
        div = self.std if self.scale_reward == "running" else self.ref_std
        return [s / div for s in scores]


@pytest.mark.parametrize("mode,ref_std", [("ref", None), ("running", None), ("ref", 3.0)])
def test_trlx_scale_reward_matches_trlx(mode, ref_std):
    cfg = PPOConfig(scale_reward=mode, reward_clip=2.0, reward_ref_std=ref_std)
    cfg.check()
    fields = {f.name: f.default for f in dataclasses.fields(State) if f.name.startswith("reward_")}
    state = SimpleNamespace(metrics=StepMetrics(), **fields)
    ref, g = RefTrlx(mode, 2.0, ref_std), torch.Generator().manual_seed(0)
    for _ in range(4):
        rewards = (torch.randn(6, generator=g, dtype=torch.float64) * 3).tolist()
        batch = TensorDict({"rewards": torch.tensor(rewards, dtype=torch.float64)}, batch_size=[6])
        got = scale_rewards(batch, cfg, DistEnv(), state)
        torch.testing.assert_close(got, torch.tensor(ref(rewards), dtype=torch.float64))
    assert state.reward_running_std == pytest.approx(ref.std) and state.reward_ref_std == pytest.approx(
        ref.ref_std
    )


def test_config_errors():
    with pytest.raises(ConfigError, match="reward_whiten"):
        PPOConfig(scale_reward="ref", reward_whiten=True).check()
    with pytest.raises(ConfigError, match="reward_ref_std"):
        PPOConfig(scale_reward="running", reward_ref_std=1.0).check()
    with pytest.raises(ConfigError, match="go together"):
        ReinforceConfig(overlong_buffer_length=2).check()
    with pytest.raises(ConfigError, match="go together"):
        PPOConfig(reward_standardization_std=2.0).check()
    with pytest.raises(ConfigError, match="must be <= max_response_length"):
        PPOConfig(overlong_buffer_length=30, overlong_buffer_penalty=1.0).check()
    with pytest.raises(ValueError, match="needs the loop state"):
        scale_rewards(hand_batch(REWARDS, LENGTHS, TRUNCATED), PPOConfig(scale_reward="ref"), DistEnv())


# --- on a tiny model -----------------------------------------------------------------------------------


def reward(prompts, responses):
    return [min(r.count("a"), 4) / 4 for r in responses]


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("shaping") / "policy"
    save_pretrained(tiny_causal_lm("gpt2", seed=0), tiny_tokenizer(), path)
    return str(path)


def make_cfg(policy_dir, run_dir, **overrides) -> PPOConfig:
    values = dict(
        policy=policy_dir,
        run_dir=str(run_dir),
        max_num_steps=2,
        num_prompts_per_step=4,
        num_generations_per_prompt=2,
        max_new_tokens=4,
        microbatch_size=3,
        ppo_epochs=1,
        num_minibatches=2,
        learning_rate=1e-3,
        max_val_samples=4,
        val_period=0,
        val_at_start=False,
        val_at_end=False,
        save_period=0,
        log_samples=0,
        progress=False,
        tensorboard=False,
    )
    return config_from_dict(PPOConfig, {**values, **overrides})


def flat(model):
    return torch.cat([p.detach().flatten() for p in model.parameters()])


@pytest.mark.slow
def test_ppo_overlong_filtering_keeps_truncated_rows_out_of_both_losses(policy_dir, tmp_path):
    cfg = make_cfg(policy_dir, tmp_path, overlong_filtering=True)
    env = setup(cfg)
    state = init_state(cfg, env, reward=reward, prompts=PROMPTS)
    batch = rollout(state, prompt_batch(PROMPTS[:4]), cfg)
    for phase in (score, reference, values, advantages):
        batch = phase(state, batch, cfg)
    truncated = batch["truncated"]
    assert truncated.any() and not truncated.all(), "the tiny model should truncate some rows, not all"
    assert torch.equal(batch["loss_mask"], batch["action_mask"] & ~truncated[:, None])
    assert state.metrics.reduce(env)["loss_tokens"] == batch["loss_mask"].sum().item()

    def updated(b):
        policy, critic = copy.deepcopy(state.policy), copy.deepcopy(state.value_model)
        opts = [make_optimizer(m.parameters(), 1e-3, 0.0) for m in (policy, critic)]
        s = dataclasses.replace(
            state,
            policy=policy,
            value_model=critic,
            policy_optimizer=opts[0],
            value_optimizer=opts[1],
            minibatch_generator=torch.Generator().manual_seed(0),
            metrics=StepMetrics(),
        )
        update(s, b, cfg)
        return flat(policy), flat(critic)

    moved = batch.clone()
    rows = truncated[:, None].expand_as(moved["advantages"])
    moved["advantages"] = torch.where(rows, moved["advantages"] + 5.0, moved["advantages"])
    moved["returns"] = torch.where(rows, moved["returns"] - 3.0, moved["returns"])
    a, b = updated(batch), updated(moved)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])  # truncated rows move neither model
    without = batch.exclude("loss_mask")
    assert not torch.equal(updated(without)[1], updated(moved.exclude("loss_mask"))[1])


@pytest.mark.slow
def test_resume_continues_the_running_reward_statistics(policy_dir, tmp_path):
    options = dict(
        max_num_steps=3,
        save_period=1,
        scale_reward="running",
        reward_clip=5.0,
        overlong_buffer_length=2,
        overlong_buffer_penalty=0.5,
        overlong_filtering=True,
    )
    train(make_cfg(policy_dir, tmp_path / "full", **options), reward=reward, prompts=PROMPTS)
    part = make_cfg(policy_dir, tmp_path / "part", **{**options, "max_num_steps": 2})
    train(part, reward=reward, prompts=PROMPTS)
    train(dataclasses.replace(part, max_num_steps=3), resume=True, reward=reward, prompts=PROMPTS)

    def stable(rows):
        return [
            {k: v for k, v in r.items() if k not in ("time_s", "tokens_per_s") and not k.startswith("time/")}
            for r in rows
        ]

    a, b = stable(read_metrics(tmp_path / "full")), stable(read_metrics(tmp_path / "part"))
    assert a[2] == b[2]
    assert a[2]["reward_running_std"] != a[0]["reward_running_std"]
    assert a[0]["rewards_scaled"] != a[0]["rewards"]


@pytest.mark.slow
def test_reinforce_run_logs_the_standardised_rewards(policy_dir, tmp_path):
    values = dict(
        policy=policy_dir,
        run_dir=str(tmp_path),
        max_num_steps=2,
        num_prompts_per_step=2,
        num_generations_per_prompt=2,
        max_new_tokens=4,
        microbatch_size=4,
        learning_rate=1e-3,
        val_at_start=False,
        val_at_end=False,
        save_period=0,
        log_samples=0,
        progress=False,
        tensorboard=False,
        reward_standardization_mean=0.25,
        reward_standardization_std=0.5,
        overlong_filtering=True,
    )
    reinforce.train(config_from_dict(ReinforceConfig, values), reward=reward, prompts=PROMPTS)
    for row in read_metrics(tmp_path):
        assert row["rewards_scaled"] == pytest.approx((row["rewards"] - 0.25) / 0.5)
