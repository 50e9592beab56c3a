"""The rollout-correction phase in the REINFORCE and PPO loops on a tiny GPT-2: off changes nothing, in fp32
the recomputed old logprobs equal the sampler's (weights 1), every mode runs an update, and a run trains."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from rlbits.distributed.env import DistEnv
from rlbits.functional import ROLLOUT_CORRECTIONS
from rlbits.loops import phases, ppo, reinforce
from rlbits.loops.config import ConfigError, config_from_dict
from rlbits.loops.metrics import StepMetrics
from rlbits.loops.run import read_metrics
from rlbits.models.tiny import tiny_causal_lm, tiny_tokenizer

V = 32
MODES = {
    "tis": {"mode": "tis", "level": "sequence", "threshold": 2.0},
    "icepop": {"mode": "icepop"},
    "mis": {"mode": "mis", "level": "token", "threshold": 1.05},
    "geo_rs": {"mode": "geo_rs"},
    "rs": {"mode": "rs", "level": "seq_max_k3", "threshold": 0.001},
    "seq_mask_tis": {"mode": "seq_mask_tis"},
    "decoupled": {"mode": "decoupled", "threshold": 1.05},
}


def length_reward(prompts, responses):
    return [float(len(r) % 3) for r in responses]


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_policy")
    tiny_causal_lm("gpt2", V, seed=0).save_pretrained(path)
    tiny_tokenizer(V).save_pretrained(path)
    return str(path)


def make_cfg(cls, tiny_path, tmp_path, **overrides):
    values = dict(
        task="arithmetic", policy=tiny_path, run_dir=str(tmp_path / "run"), max_num_steps=1, num_prompts_per_step=4,
        num_generations_per_prompt=2, max_new_tokens=5, microbatch_size=3, learning_rate=1e-3, max_val_samples=4,
        val_period=0, val_at_start=False, val_at_end=False, save_period=0, progress=False, tensorboard=False,
        num_minibatches=2,
    )
    values.update(overrides)
    return config_from_dict(cls, values)


def scored_batch(loop, state, cfg):
    """Phases up to the advantages (PPO: with the critic's values)."""
    state.reward, state.metrics = length_reward, StepMetrics()
    batch = loop.rollout(state, state.stream.next_batch(cfg.num_prompts_per_step), cfg)
    batch = loop.score(state, batch, cfg)
    batch = loop.reference(state, batch, cfg)
    if loop is ppo:
        batch = ppo.values(state, batch, cfg)
    return loop.advantages(state, batch, cfg)


@pytest.fixture(scope="module", params=["reinforce", "ppo"])
def loop_state(request, tiny_path, tmp_path_factory):
    loop = reinforce if request.param == "reinforce" else ppo
    cls = reinforce.ReinforceConfig if loop is reinforce else ppo.PPOConfig
    cfg = make_cfg(cls, tiny_path, tmp_path_factory.mktemp("run"), rollout_correction={"mode": "tis"})
    state = loop.init_state(cfg, DistEnv(), reward=length_reward)
    return loop, cfg, state, scored_batch(loop, state, cfg)


def test_off_leaves_the_batch_and_config_as_today(loop_state):
    loop, cfg, state, batch = loop_state
    off = dataclasses.replace(cfg, rollout_correction={"mode": "none"})
    assert type(cfg)().rollout_correction == {"mode": "none"}  # off by default
    before = batch.clone()
    out = loop.rollout_correction(state, batch.clone(), off)
    assert set(out.keys()) == set(before.keys())
    for key in before.keys():
        if isinstance(before[key], torch.Tensor):
            assert torch.equal(out[key], before[key]), key
    assert loop.rollout_correction in loop.PHASES


def test_fp32_old_logprobs_equal_the_samplers(loop_state):
    """Same weights, same precision: the trainer's recomputation is the sampler's logprobs, every weight 1."""
    loop, cfg, state, batch = loop_state
    state.metrics = StepMetrics()
    out = loop.rollout_correction(state, batch.clone(), cfg)
    mask = out["action_mask"]
    torch.testing.assert_close(out["old_logprobs"], out["logprobs"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out["rollout_is_weights"][mask], torch.ones(int(mask.sum())), rtol=1e-4, atol=1e-4)
    assert (out["rollout_is_weights"][~mask] == 0).all()
    logged = state.metrics.reduce(DistEnv())
    assert abs(logged["rollout_corr/kl"]) < 1e-5 and logged["rollout_corr/rollout_is_mean"] == pytest.approx(1, abs=1e-4)


@pytest.mark.parametrize("mode", sorted(MODES))
def test_each_mode_runs_an_update(loop_state, mode):
    """A sampler whose logprobs are off by noise: the correction weighs and rejects, the update steps."""
    loop, cfg, state, batch = loop_state
    cfg = dataclasses.replace(cfg, rollout_correction=MODES[mode])
    batch = batch.clone()
    mask = batch["action_mask"]
    noise = 0.05 * torch.randn(mask.shape, generator=torch.Generator().manual_seed(0))
    batch["logprobs"] = torch.where(mask, batch["logprobs"] + noise, 0.0)
    work = copy.copy(state)
    work.policy = copy.deepcopy(state.policy)
    work.metrics = StepMetrics()
    if loop is ppo:
        work.value_model = copy.deepcopy(state.value_model)
        work.policy_optimizer = torch.optim.AdamW(work.policy.parameters(), lr=1e-3)
        work.value_optimizer = torch.optim.AdamW(work.value_model.parameters(), lr=1e-3)
    else:
        work.optimizer = torch.optim.AdamW(work.policy.parameters(), lr=1e-3)
    batch = loop.rollout_correction(work, batch, cfg)
    assert {"old_logprobs", "rollout_is_weights", "loss_mask"} <= set(batch.keys())
    assert not (batch["loss_mask"] & ~mask).any()
    if mode in ("mis", "geo_rs", "rs"):
        assert batch["loss_mask"].sum() < mask.sum(), "this noise must reject some tokens"
    before = torch.cat([p.detach().flatten() for p in work.policy.parameters()])
    loop.update(work, batch, cfg)
    after = torch.cat([p.detach().flatten() for p in work.policy.parameters()])
    assert not torch.equal(before, after)
    logged = work.metrics.reduce(DistEnv())
    assert "rollout_corr/k3_kl" in logged and logged["rollout_corr/k3_kl"] > 0
    assert all(torch.isfinite(torch.tensor(v)) for v in logged.values())


def test_config_errors_name_the_problem(tiny_path, tmp_path):
    for bad, match in [
        ({"mode": "tiss"}, "mode must be none or one of"),
        ({"mode": "tis", "cap": 2}, "unknown key"),
        ({"mode": "none", "threshold": 2.0}, "mode none"),
        ({"mode": "rs", "level": "seq_mean_k3"}, "threshold is required"),
        ({"mode": "decoupled", "threshold": 0.5}, "threshold must be in"),
    ]:
        with pytest.raises(ConfigError, match=match):
            make_cfg(reinforce.ReinforceConfig, tiny_path, tmp_path, rollout_correction=bad)
    assert set(MODES) == set(ROLLOUT_CORRECTIONS)
    assert phases.rollout_correction is reinforce.rollout_correction is ppo.rollout_correction


@pytest.mark.slow
@pytest.mark.parametrize("name", ["reinforce", "ppo"])
def test_a_run_logs_the_correction(tiny_path, tmp_path, name):
    cls = reinforce.ReinforceConfig if name == "reinforce" else ppo.PPOConfig
    loop = reinforce if name == "reinforce" else ppo
    cfg = make_cfg(cls, tiny_path, tmp_path, max_num_steps=2, rollout_correction={"mode": "mis", "threshold": 2.0})
    rows = read_metrics(loop.train(cfg, reward=length_reward))
    assert [r["step"] for r in rows[-2:]] == [1, 2]
    assert {"rollout_corr/kl", "rollout_corr/rollout_is_mean", "rollout_corr/rollout_rs_masked_fraction",
            "time/rollout_correction"} <= rows[-1].keys()
