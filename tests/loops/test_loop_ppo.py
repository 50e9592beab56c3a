"""The PPO loop on a tiny GPT-2: phases one by one, a two-step run, exact resume, KL options, warm-up, errors."""

from __future__ import annotations

import copy
import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from rlbits.distributed.env import DistEnv
from rlbits.functional import POLICY_LOSSES, kl_penalty, token_rewards
from rlbits.loops.config import ConfigError, config_from_dict, load_config
from rlbits.loops.metrics import StepMetrics
from rlbits.loops.optim import make_optimizer
from rlbits.loops.phases import prompt_batch
from rlbits.loops.ppo import (
    PPOConfig,
    advantages,
    init_state,
    kl_control,
    objective,
    reference,
    rollout,
    scale_rewards,
    score,
    train,
    update,
    values,
)
from rlbits.loops.run import NonFiniteError, read_metrics, total_steps
from rlbits.loops.runtime import head_args, setup
from rlbits.loops.update import Denominators
from rlbits.models.forward import policy_logprobs
from rlbits.models.load import save_pretrained
from rlbits.models.tiny import tiny_causal_lm, tiny_tokenizer

PROMPTS = ["the plot", "a film", "it was", "my day", "so this", "hello", "we saw", "an end"]
VOLATILE = ("time_s", "tokens_per_s")
CONFIG = Path(__file__).resolve().parents[2] / "configs" / "ppo_sentiment.yaml"


def reward(prompts, responses):
    """Likes the letter a: a reward the tiny model can move."""
    return [min(r.count("a"), 4) / 4 for r in responses]


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("ppo") / "policy"
    save_pretrained(tiny_causal_lm("gpt2", seed=0), tiny_tokenizer(), path)
    return str(path)


def make_cfg(policy_dir, run_dir, **overrides) -> PPOConfig:
    values = dict(
        policy=policy_dir,
        run_dir=str(run_dir),
        max_num_steps=2,
        num_prompts_per_step=4,
        num_generations_per_prompt=2,
        max_new_tokens=6,
        microbatch_size=3,
        ppo_epochs=2,
        num_minibatches=2,
        learning_rate=1e-3,
        max_val_samples=4,
        val_period=0,
        val_at_start=False,
        val_at_end=False,
        save_period=0,
        log_samples=2,
        progress=False,
        tensorboard=False,
    )
    values.update(overrides)
    return config_from_dict(PPOConfig, values)


def flat_weights(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


# --------------------------------------------------------------------------------------------------------
# Phases
# --------------------------------------------------------------------------------------------------------


def phase_batch(cfg):
    env = setup(cfg)
    state = init_state(cfg, env, reward=reward, prompts=PROMPTS)
    batch = rollout(state, prompt_batch(PROMPTS[:4]), cfg)
    return env, state, batch


def fresh_update(state, batch, cfg, **changes):
    """``update`` on copies of the models with fresh optimizers and minibatch generator; returns the
    weights and the logged metrics."""
    policy, critic = copy.deepcopy(state.policy), copy.deepcopy(state.value_model)
    opts = [make_optimizer(m.parameters(), 1e-3, 0.0) for m in (policy, critic)]
    copy_state = dataclasses.replace(
        state, policy=policy, value_model=critic, policy_optimizer=opts[0], value_optimizer=opts[1],
        minibatch_generator=torch.Generator().manual_seed(0), metrics=StepMetrics(), **changes,
    )
    update(copy_state, batch, cfg)
    return flat_weights(policy), flat_weights(critic), copy_state.metrics.reduce(DistEnv())


def test_phases_add_their_keys(policy_dir, tmp_path):
    cfg = make_cfg(policy_dir, tmp_path / "run")
    env, state, batch = phase_batch(cfg)
    rollout_keys = {"prompts", "prompt_mask", "responses", "action_mask", "input_ids", "attention_mask", "logprobs",
                    "group", "prompt_text", "response_text"}
    assert rollout_keys <= set(batch.keys())
    assert batch.batch_size == torch.Size([8])
    assert batch["group"].tolist() == [0, 0, 1, 1, 2, 2, 3, 3]

    batch = score(state, batch, cfg)
    assert batch["rewards"].shape == (8,) and batch["rewards"].dtype == torch.float32
    batch = reference(state, batch, cfg)
    assert batch["ref_logprobs"].shape == batch["logprobs"].shape
    # Policy and reference start equal: the sampler's logprobs match a teacher-forced forward of the reference.
    torch.testing.assert_close(batch["ref_logprobs"], batch["logprobs"], atol=1e-5, rtol=0)
    batch = values(state, batch, cfg)
    assert batch["values"].shape == batch["logprobs"].shape and not batch["values"].requires_grad

    batch = advantages(state, batch, cfg)
    metrics = state.metrics.names()
    for key in ("token_rewards", "advantages", "returns"):
        assert batch[key].shape == batch["logprobs"].shape
        assert (batch[key][~batch["action_mask"]] == 0).all()
    assert {"rewards", "rewards_with_kl", "init_policy_kl", "advantages", "returns", "values",
            "explained_variance"} <= set(metrics)
    mask = batch["action_mask"]
    assert abs(batch["advantages"][mask].mean().item()) < 1e-5  # whitened
    assert abs(batch["advantages"][mask].std().item() - 1) < 1e-3

    before = flat_weights(state.policy)
    assert update(state, batch, cfg) is batch
    stats = state.metrics.reduce(env)
    assert {"actor_loss", "critic_loss", "clipfrac", "approx_kl", "entropy", "grad_norm", "critic_grad_norm",
            "value_clipfrac"} <= set(stats)
    assert all(math.isfinite(v) for v in stats.values())
    assert not torch.equal(before, flat_weights(state.policy))


def test_token_rewards_hold_kl_in_reward_only(policy_dir, tmp_path):
    cfg = make_cfg(policy_dir, tmp_path / "run", kl_coef=0.5)
    env, state, batch = phase_batch(cfg)
    score(state, batch, cfg)
    batch["ref_logprobs"] = batch["logprobs"] - 0.25 * batch["action_mask"]  # a known KL of 0.25 per token
    values(state, batch, cfg)
    advantages(state, batch, cfg)
    kl = kl_penalty(batch["logprobs"], batch["ref_logprobs"], "k1")
    torch.testing.assert_close(
        batch["token_rewards"], token_rewards(batch["rewards"], batch["action_mask"], kl, 0.5)
    )
    lengths = batch["action_mask"].sum(-1)
    torch.testing.assert_close(batch["token_rewards"].sum(-1), batch["rewards"] - 0.125 * lengths)

    no_kl = dataclasses.replace(cfg, kl_in_reward=False)
    advantages(state, batch, no_kl)
    torch.testing.assert_close(batch["token_rewards"].sum(-1), batch["rewards"])

    clamped = dataclasses.replace(cfg, kl_clamp=0.1)  # the config's clamp reaches the kernel: 0.25 -> 0.1
    advantages(state, batch, clamped)
    torch.testing.assert_close(batch["token_rewards"].sum(-1), batch["rewards"] - 0.5 * 0.1 * lengths)
    in_clamped = dataclasses.replace(cfg, kl_input_clamp=0.2)  # the log-ratio clamp too: 0.25 -> 0.2
    advantages(state, batch, in_clamped)
    torch.testing.assert_close(batch["token_rewards"].sum(-1), batch["rewards"] - 0.5 * 0.2 * lengths)


def test_length_adaptive_alpha_gives_each_row_its_lambda(policy_dir, tmp_path):
    """NeMo-RL ``length_adaptive_alpha``: per-row policy lambdas, the critic's returns on ``critic_lam``."""
    from rlbits.functional import gae
    from rlbits.functional.advantages import length_adaptive_lambda

    cfg = make_cfg(policy_dir, tmp_path / "run", length_adaptive_alpha=0.5, critic_lam=0.9, whiten_advantages=False)
    env, state, batch = phase_batch(cfg)
    score(state, batch, cfg)
    reference(state, batch, cfg)
    values(state, batch, cfg)
    advantages(state, batch, cfg)
    mask = batch["action_mask"]
    lam = length_adaptive_lambda(mask, 0.5)
    want_adv, _ = gae(batch["token_rewards"], batch["values"], mask, gamma=cfg.gamma, lam=lam)
    _, want_ret = gae(batch["token_rewards"], batch["values"], mask, gamma=cfg.gamma, lam=0.9)
    torch.testing.assert_close(batch["advantages"], want_adv)
    torch.testing.assert_close(batch["returns"], want_ret)
    assert "policy_lam" in state.metrics.names()
    off = dataclasses.replace(cfg, length_adaptive_alpha=0.0)  # 0 = the fixed ``lam``
    advantages(state, batch, off)
    torch.testing.assert_close(batch["advantages"], gae(batch["token_rewards"], batch["values"], mask, lam=0.95)[0])


def test_kl_in_loss_changes_the_policy_update(policy_dir, tmp_path):
    cfg = make_cfg(policy_dir, tmp_path / "run", kl_in_reward=False, kl_estimator="k3", kl_loss_coef=1.0)
    env, state, batch = phase_batch(cfg)
    score(state, batch, cfg)
    values(state, batch, cfg)
    batch["ref_logprobs"] = batch["logprobs"] - 0.5 * batch["action_mask"]
    advantages(state, batch, cfg)
    with_kl, critic_a, stats = fresh_update(state, batch, cfg, kl_coef=1.0)
    without, critic_b, stats0 = fresh_update(state, batch, cfg, kl_coef=0.0)
    assert "kl_loss" in stats and "kl_loss" not in stats0
    assert stats["kl_loss"] > 0
    assert not torch.allclose(with_kl, without)
    torch.testing.assert_close(critic_a, critic_b)  # the KL term touches the policy only


def test_update_does_not_depend_on_microbatch_size(policy_dir, tmp_path):
    cfg = make_cfg(policy_dir, tmp_path / "run", loss_agg="seq-mean-token-mean", entropy_coef=0.01)
    env, state, batch = phase_batch(cfg)
    for phase in (score, reference, values, advantages):
        batch = phase(state, batch, cfg)
    results = [fresh_update(state, batch, dataclasses.replace(cfg, microbatch_size=mbs)) for mbs in (1, 3, 8)]
    for policy_w, critic_w, logged in results[1:]:
        torch.testing.assert_close(policy_w, results[0][0], atol=5e-6, rtol=0)  # Adam amplifies float32 summation order
        torch.testing.assert_close(critic_w, results[0][1], atol=5e-6, rtol=0)
        for name, value in logged.items():  # the logged metrics do not depend on it either
            assert value == pytest.approx(results[0][2][name], rel=1e-5, abs=1e-6), name


def test_non_finite_loss_names_step_and_phase(policy_dir, tmp_path):
    cfg = make_cfg(policy_dir, tmp_path / "run")
    env, state, batch = phase_batch(cfg)
    for phase in (score, reference, values, advantages):
        batch = phase(state, batch, cfg)
    batch["advantages"] = torch.where(batch["action_mask"], torch.nan, 0.0)
    before = flat_weights(state.policy)
    where = r"step 1, phase update, epoch 0, minibatch 0, microbatch 0"
    with pytest.raises(NonFiniteError, match=where + r": non-finite loss nan \(.*actor_loss=nan"):
        update(state, batch, cfg)
    assert torch.equal(before, flat_weights(state.policy))


LOSS_KWARGS = {"dro": {"dro_beta": 0.1}, "clip_cov": {"clip_cov_ratio": 0.2}, "kl_cov": {"kl_cov_ratio": 0.2}}


@pytest.fixture(scope="module")
def ppo_batch(policy_dir, tmp_path_factory):
    """The state and one batch through the phases before the update, shared by the policy-loss tests."""
    cfg = make_cfg(policy_dir, tmp_path_factory.mktemp("losses") / "run")
    env, state, batch = phase_batch(cfg)
    for phase in (score, reference, values, advantages):
        batch = phase(state, batch, cfg)
    return state, batch


@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
def test_every_policy_loss_trains_and_logs_its_metrics(name, policy_dir, tmp_path, ppo_batch):
    """2 epochs x 2 minibatches (ratios off 1 after the first step): finite losses, the policy moves, the
    loss's metrics are logged."""
    state, batch = ppo_batch
    cfg = make_cfg(policy_dir, tmp_path / "run", policy_loss=name, policy_loss_kwargs=LOSS_KWARGS.get(name, {}))
    before = flat_weights(state.policy)
    policy, _, logged = fresh_update(state, batch, cfg)
    m = batch["action_mask"]
    _, own = POLICY_LOSSES[name](batch["logprobs"], batch["logprobs"], batch["advantages"], m, **cfg.policy_loss_args)
    names = {"actor_loss", "critic_loss", "clipfrac", "approx_kl", "ratio_mean", "entropy", "grad_norm"}
    names |= set(own) if name != "vanilla" else set()
    assert names <= set(logged)
    assert all(math.isfinite(logged[k]) for k in names)
    assert logged["approx_kl"] > 0  # later minibatches ran off-policy
    assert not torch.equal(before, policy)


def test_positive_example_nll_weight_adds_its_term(policy_dir, tmp_path, ppo_batch):
    """NeMo-RL ``positive_example_nll_weight``: the objective gains ``mu * positive_example_nll_loss``."""
    from rlbits.functional import positive_example_nll_loss

    state, batch = ppo_batch
    micro = batch.clone()
    micro["rewards"] = torch.tensor([1.0, 0.0, 0.5, -1.0, 0.25, 0.0, 2.0, 0.0])
    mask = micro["action_mask"]
    den = Denominators(num_tokens=mask.sum().float(), num_seqs=torch.tensor(8.0), num_rows=torch.tensor(8.0))
    off, _ = objective(state, micro, make_cfg(policy_dir, tmp_path / "a"), den)
    on, stats = objective(state, micro, make_cfg(policy_dir, tmp_path / "b", positive_example_nll_weight=0.3), den)
    logprobs = policy_logprobs(state.policy, micro, temperature=1.0).float()
    nll, _ = positive_example_nll_loss(logprobs, mask, micro["rewards"])
    torch.testing.assert_close(on - off, 0.3 * nll, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(stats["positive_nll_loss"], nll.detach(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["gspo", "cispo"])
def test_the_objective_calls_the_registered_loss(name, policy_dir, tmp_path, ppo_batch):
    """The objective's policy term is ``POLICY_LOSSES[name]`` on the same microbatch: value and gradient."""
    state, batch = ppo_batch
    cfg = make_cfg(
        policy_dir, tmp_path / "run", policy_loss=name, clip_eps=0.05, clip_eps_high=0.08,
        loss_agg="seq-mean-token-sum",
    )
    micro = batch.clone()
    noise = 0.1 * torch.randn(micro["logprobs"].shape, generator=torch.Generator().manual_seed(0))
    micro["logprobs"] = micro["logprobs"] + noise  # an old policy off the current one: ratios != 1
    mask = micro["action_mask"]
    den = Denominators(num_tokens=mask.sum().float() + 5, num_seqs=torch.tensor(11.0), num_rows=torch.tensor(11.0))
    params = [p for p in state.policy.parameters() if p.requires_grad]

    loss, stats = objective(state, micro, cfg, den)
    got = torch.autograd.grad(loss, params)  # the critic's term has no gradient in the policy
    logprobs = policy_logprobs(state.policy, micro, temperature=cfg.temperature, **head_args(cfg)).float()
    want, metrics = POLICY_LOSSES[name](
        logprobs, micro["logprobs"], micro["advantages"], mask, agg="seq-mean-token-sum",
        num_tokens=den.num_tokens, num_seqs=den.num_seqs, clip_eps=0.05, clip_eps_high=0.08,
    )
    expected = torch.autograd.grad(want, params)
    torch.testing.assert_close(stats["actor_loss"], want.detach(), rtol=1e-6, atol=1e-7)
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-7)
    assert metrics["clipfrac"] > 0  # the clip range acts on this batch
    share = den.share(mask)
    for key in ("clipfrac", "approx_kl", "ratio_mean"):
        torch.testing.assert_close(stats[key], metrics[key] * share)


def test_reward_scaling_order():
    cfg = PPOConfig(reward_subtract_reference=True, reward_whiten=True, reward_clip=1.5)
    from tensordict import TensorDict

    batch = TensorDict(
        {
            "rewards": torch.tensor([1.0, 2.0, 3.0, 10.0]),
            "reference_rewards": torch.tensor([0.0, 0.0, 1.0, 2.0]),
        },
        [4],
    )
    out = scale_rewards(batch, cfg, DistEnv())
    diff = torch.tensor([1.0, 2.0, 2.0, 8.0])
    expected = ((diff - diff.mean()) / diff.std() + diff.mean()).clamp(-1.5, 1.5)
    torch.testing.assert_close(out, expected)
    plain = scale_rewards(batch, PPOConfig(), DistEnv())
    assert torch.equal(plain, batch["rewards"])


def test_adaptive_kl_controller():
    from types import SimpleNamespace

    from tensordict import TensorDict

    def after(kl_per_token, cfg, n=50, length=2):
        batch = TensorDict({"logprobs": torch.full((n, length), kl_per_token), "ref_logprobs": torch.zeros(n, length),
                            "action_mask": torch.ones(n, length, dtype=torch.bool)}, [n])
        state = SimpleNamespace(kl_coef=0.1, env=DistEnv(), metrics=StepMetrics())
        kl_control(state, batch, cfg)
        assert state.metrics.reduce(DistEnv())["kl_coef"] == 0.1  # logs the coefficient the step used
        return state.kl_coef

    cfg = PPOConfig(adaptive_kl=True, kl_target=1.0, kl_horizon=100)
    assert after(5.0, cfg) == pytest.approx(0.1 * (1 + 0.2 * 0.5))  # KL 10 per sequence, too high: beta grows
    assert after(0.25, cfg) == pytest.approx(0.1 * (1 - 0.2 * 0.5))  # too low (error clipped at -0.2): shrinks
    assert after(5.0, PPOConfig()) == 0.1  # off: unchanged


# --------------------------------------------------------------------------------------------------------
# Whole runs
# --------------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_two_step_run_writes_the_run(policy_dir, tmp_path):
    run_dir = tmp_path / "run"
    cfg = make_cfg(policy_dir, run_dir, val_at_start=True, val_at_end=True, tensorboard=True, save_period=1,
                   checkpoint_hf_folders=True)
    assert train(cfg, reward=reward, prompts=PROMPTS) == run_dir
    for name in ("config.yaml", "metrics.jsonl", "samples.jsonl", "final/model.safetensors", "final/tokenizer.json",
                 "checkpoints/step_1/policy/model.safetensors", "checkpoints/step_2/value_model/value_head.safetensors",
                 "checkpoints/step_2/state.json"):
        assert (run_dir / name).is_file(), name
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [0, 1, 2]
    val_keys = {"val_reward", "val_reward_std", "val_response_len", "val_fraction_of_samples_properly_ended"}
    assert set(rows[0]) == {"step", "time_s", *val_keys}
    expected = {"rewards", "rewards_with_kl", "init_policy_kl", "kl_coef", "advantages", "returns", "values",
                "actor_loss", "critic_loss", "clipfrac", "approx_kl", "entropy", "value_clipfrac",
                "explained_variance", "grad_norm", "critic_grad_norm", "response_len", "tokens_per_s",
                "time/rollout", "time/score", "time/reference", "time/values", "time/advantages", "time/update",
                "time/step", "epoch"}
    for row in rows[1:]:
        assert expected <= set(row), expected - set(row)
        assert all(v is not None and math.isfinite(v) for v in row.values())
    assert "val_reward" in rows[2] and "val_reward" not in rows[1]
    state = json.loads((run_dir / "checkpoints/step_2/state.json").read_text())
    assert state["step"] == 2 and state["stream"] == {"consumed_samples": 8} and rows[2]["epoch"] == 1
    assert state["total_valid_tokens"] > 0 and state["val_reward"] == rows[2]["val_reward"]
    samples = [json.loads(ln) for ln in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert {s["step"] for s in samples} == {0, 1, 2} and all("response" in s for s in samples)
    final = AutoModelForCausalLM.from_pretrained(run_dir / "final")
    saved = AutoModelForCausalLM.from_pretrained(run_dir / "checkpoints/step_2/policy")
    assert torch.equal(flat_weights(final), flat_weights(saved))
    with pytest.raises(FileExistsError, match="already holds a run"):
        train(cfg, reward=reward, prompts=PROMPTS)


@pytest.mark.slow
def test_resume_reproduces_the_uninterrupted_run(policy_dir, tmp_path):
    options = dict(max_num_steps=4, save_period=2, adaptive_kl=True, kl_target=0.01, kl_horizon=20, val_period=2,
                   value_clip_eps=0.2)
    full = make_cfg(policy_dir, tmp_path / "full", **options)
    train(full, reward=reward, prompts=PROMPTS)
    part = make_cfg(policy_dir, tmp_path / "part", **{**options, "max_num_steps": 2})
    train(part, reward=reward, prompts=PROMPTS)
    train(dataclasses.replace(part, max_num_steps=4), resume=True, reward=reward, prompts=PROMPTS)

    def stable(rows):
        return [{k: v for k, v in r.items() if k not in VOLATILE and not k.startswith("time/")} for r in rows]

    a, b = stable(read_metrics(tmp_path / "full")), stable(read_metrics(tmp_path / "part"))
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    assert a[2:] == b[2:]
    assert a[3]["kl_coef"] != a[0]["kl_coef"]  # the controller state went through the checkpoint
    wa = flat_weights(AutoModelForCausalLM.from_pretrained(tmp_path / "full/final"))
    wb = flat_weights(AutoModelForCausalLM.from_pretrained(tmp_path / "part/final"))
    assert torch.equal(wa, wb)


@pytest.mark.slow
def test_critic_warmup_leaves_the_policy_unchanged(policy_dir, tmp_path):
    cfg = make_cfg(policy_dir, tmp_path / "run", policy_training_start_step=2, save_period=1, checkpoint_hf_folders=True)
    train(cfg, reward=reward, prompts=PROMPTS)
    initial = flat_weights(AutoModelForCausalLM.from_pretrained(policy_dir))
    assert torch.equal(flat_weights(AutoModelForCausalLM.from_pretrained(tmp_path / "run/final")), initial)
    rows = read_metrics(tmp_path / "run")
    assert all("actor_loss" not in r and "critic_loss" in r for r in rows)
    from rlbits.models.heads import ValueModel

    critic1 = ValueModel.from_pretrained(tmp_path / "run/checkpoints/step_1/value_model")
    critic2 = ValueModel.from_pretrained(tmp_path / "run/checkpoints/step_2/value_model")
    assert not torch.equal(flat_weights(critic1), flat_weights(critic2))


@pytest.mark.slow
def test_critic_warmup_steps_are_not_training_steps(policy_dir, tmp_path):
    """NeMo-Aligner's critic_warmup_steps: critic-only updates on extra rollouts before step 1, outside the
    step count; they are logged in the step-0 row and change the critic step 1 starts from."""
    settings = dict(max_num_steps=1, val_at_start=False, val_at_end=False, save_period=0)
    train(make_cfg(policy_dir, tmp_path / "warm", critic_warmup_steps=2, **settings), reward=reward, prompts=PROMPTS)
    train(make_cfg(policy_dir, tmp_path / "cold", **settings), reward=reward, prompts=PROMPTS)
    warm, cold = read_metrics(tmp_path / "warm"), read_metrics(tmp_path / "cold")
    assert [r["step"] for r in warm] == [0, 1] and [r["step"] for r in cold] == [1]
    assert "critic_warmup/critic_loss" in warm[0] and "critic_warmup/actor_loss" not in warm[0]
    assert "actor_loss" in warm[1] and warm[1]["values"] != cold[0]["values"]

@pytest.mark.slow
def test_adaptive_kl_and_skip_reference_in_a_run(policy_dir, tmp_path):
    cfg = make_cfg(
        policy_dir, tmp_path / "a", adaptive_kl=True, kl_target=1e-4, kl_horizon=10, max_num_steps=3
    )
    train(cfg, reward=reward, prompts=PROMPTS)
    coefs = [r["kl_coef"] for r in read_metrics(tmp_path / "a")]
    assert coefs[0] == pytest.approx(0.05) and len(set(coefs)) == 3

    skip = make_cfg(policy_dir, tmp_path / "b", skip_reference_policy_logprobs=True)
    train(skip, reward=reward, prompts=PROMPTS)
    rows = read_metrics(tmp_path / "b")
    assert rows and not any("init_policy_kl" in r for r in rows)  # no reference pass: no KL to report


@pytest.mark.slow
def test_reference_skipped_when_no_term_uses_it(policy_dir, tmp_path):
    """kl_coef = 0: no reference model is loaded or run, and training is the same as with the reference kept
    for monitoring (which logs init_policy_kl and nothing else changes)."""
    base = dict(kl_coef=0.0, max_num_steps=2)
    assert not make_cfg(policy_dir, tmp_path / "x", **base).uses_ref_logprobs
    assert make_cfg(policy_dir, tmp_path / "x", **base, monitor_init_policy_kl=True).uses_ref_logprobs
    assert make_cfg(policy_dir, tmp_path / "x", kl_in_reward=False, kl_loss_coef=0.01).uses_ref_logprobs
    assert not make_cfg(policy_dir, tmp_path / "x", kl_in_reward=False, kl_loss_coef=0.0).uses_ref_logprobs
    assert init_state(make_cfg(policy_dir, tmp_path / "x", **base), DistEnv(), reward=reward, prompts=PROMPTS).reference is None
    train(make_cfg(policy_dir, tmp_path / "skip", **base), reward=reward, prompts=PROMPTS)
    train(make_cfg(policy_dir, tmp_path / "mon", **base, monitor_init_policy_kl=True), reward=reward, prompts=PROMPTS)
    skip, mon = read_metrics(tmp_path / "skip"), read_metrics(tmp_path / "mon")
    assert not any("init_policy_kl" in r for r in skip) and all("init_policy_kl" in r for r in mon if r["step"] > 0)
    for a, b in zip(skip, mon, strict=True):
        for key in ("rewards", "actor_loss", "critic_loss", "val_reward"):
            if key in a:
                assert a[key] == pytest.approx(b[key], rel=1e-6, abs=1e-7), key


@pytest.mark.slow
def test_reward_subtract_reference_run(policy_dir, tmp_path):
    cfg = make_cfg(
        policy_dir, tmp_path / "run", reward_subtract_reference=True, reward_whiten=True, max_num_steps=1
    )
    train(cfg, reward=reward, prompts=PROMPTS)
    (row,) = read_metrics(tmp_path / "run")
    assert {"reference_rewards", "rewards_scaled"} <= set(row)


# --------------------------------------------------------------------------------------------------------
# Config errors
# --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "values, match",
    [
        ({"ppo_epochs": 0}, "ppo_epochs must be >= 1"),
        (
            {"num_minibatches": 64, "num_prompts_per_step": 8},
            "num_minibatches .* must be <= num_prompts_per_step",
        ),
        ({"clip_eps": -0.1}, "clip_eps must be >= 0"),
        ({"policy_loss_kwargs": {"clip_ratio_c": 1.0}}, "policy_loss 'vanilla' .*clip_ratio_c.*must be > 1"),
        ({"lam": 1.5}, r"lam must be in \[0, 1\]"),
        ({"critic_lam": -1.0}, r"critic_lam must be in \[0, 1\]"),
        ({"length_adaptive_alpha": -1.0}, r"length_adaptive_alpha"),
        ({"reward_clip": 0.0}, "reward_clip must be > 0 or null"),
        ({"value_clip_eps": -1.0}, "value_clip_eps must be > 0 or null"),
        ({"critic_learning_rate": 0.0}, "critic_learning_rate must be > 0"),
        ({"kl_target": 0.0}, "kl_target must be > 0"),
        ({"kl_estimator": "k4"}, "kl_estimator must be one of"),
        ({"loss_agg": "sum"}, "loss_agg must be one of"),
        ({"adaptive_kl": True, "skip_reference_policy_logprobs": True}, "adaptive_kl needs the reference"),
        ({"loop": "reinforce"}, "loop must be 'ppo'"),
        ({"ppo_epoch": 2}, "unknown config key 'ppo_epoch'.*did you mean ppo_epochs"),
        ({"kl_coef": "big"}, "kl_coef must be float"),
        ({"policy_training_start_step": -1}, "policy_training_start_step must be >= 0"),
        ({"policy_loss": "grpo"}, "policy_loss must be one of vanilla, gspo"),
        ({"policy_loss_kwargs": {"clip_eps_high": 0.3}}, "must not set clip_eps_high: it is the config field"),
    ],
)
def test_config_errors(values, match):
    with pytest.raises(ConfigError, match=match):
        config_from_dict(PPOConfig, values)


@pytest.mark.slow
def test_config_file_and_runtime_errors(policy_dir, tmp_path):
    cfg = load_config(PPOConfig, CONFIG, [f"run_dir={tmp_path / 'r'}"])
    assert cfg.loop == "ppo" and cfg.task == "sentiment"
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        train(make_cfg(policy_dir, tmp_path / "none"), resume=True, reward=reward, prompts=PROMPTS)
    with pytest.raises(ConfigError, match="critic_init"):
        train(
            make_cfg(policy_dir, tmp_path / "c", critic_init=str(tmp_path / "missing")),
            reward=reward,
            prompts=PROMPTS,
        )
    assert total_steps(make_cfg(policy_dir, tmp_path, max_num_steps=100, max_num_epochs=2), len(PROMPTS), 4) == 4


@pytest.mark.slow
def test_stop_request_ends_after_the_step_with_a_checkpoint(policy_dir, tmp_path):
    class StopAfterFirstStep:
        def __init__(self):
            self.seen = []

        def on_metrics(self, step, metrics):
            self.seen.append(step)

        def should_stop(self):
            return 1 in self.seen

    cb = StopAfterFirstStep()
    cfg = make_cfg(policy_dir, tmp_path / "run", max_num_steps=5, save_period=0)
    train(cfg, callbacks=[cb], reward=reward, prompts=PROMPTS)
    assert cb.seen == [1]
    assert [p.name for p in (tmp_path / "run/checkpoints").iterdir()] == ["step_1"]
    assert (tmp_path / "run/final/model.safetensors").is_file()
