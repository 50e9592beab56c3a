"""REINFORCE/RLOO/GRPO loop: phases on hand-made batches, a two-step smoke run, exact resume, config errors."""

from __future__ import annotations

import dataclasses
import json
import math
from types import SimpleNamespace

import pytest
import torch
from metrics_compare import untimed_by_step
from tensordict import TensorDict

import rlbits
from rlbits.distributed.env import DistEnv
from rlbits.functional import POLICY_LOSSES
from rlbits.loops import reinforce
from rlbits.loops.config import ConfigError, config_from_dict
from rlbits.loops.metrics import StepMetrics
from rlbits.loops.phases import informative_groups
from rlbits.loops.reinforce import (
    ReinforceConfig,
    init_state,
    objective,
    train,
    update,
)
from rlbits.loops.run import read_metrics
from rlbits.loops.runtime import head_args
from rlbits.loops.update import Denominators
from rlbits.models.forward import policy_logprobs
from rlbits.models.tiny import tiny_causal_lm, tiny_tokenizer

V = 32


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_policy")
    tiny_causal_lm("gpt2", V, seed=0).save_pretrained(path)
    tiny_tokenizer(V).save_pretrained(path)
    return str(path)


def length_reward(prompts, responses):
    """A reward with spread inside most groups: the response length mod 3."""
    return [float(len(r) % 3) for r in responses]


def make_cfg(tiny_path, tmp_path, **overrides):
    kw = dict(
        task="arithmetic",
        policy=tiny_path,
        run_dir=str(tmp_path / "run"),
        max_num_steps=2,
        num_prompts_per_step=4,
        num_generations_per_prompt=4,
        max_new_tokens=5,
        microbatch_size=8,
        learning_rate=1e-3,
        max_val_samples=8,
        progress=False,
        tensorboard=False,
        log_samples=2,
    )
    kw.update(overrides)
    return ReinforceConfig(**kw)


# --- advantages on hand-computed tensors ---------------------------------------------------------------


def advantages(batch, cfg):
    """The advantages phase on a hand-made batch; returns the metrics it logged."""
    state = SimpleNamespace(metrics=StepMetrics(), env=DistEnv())
    reinforce.advantages(state, batch, cfg)
    return {k: torch.tensor(v) for k, v in state.metrics.reduce(DistEnv()).items()}


def sample_batch(state, cfg, reward):
    """Phases 1-2b: rollout, score, dynamic sampling; returns the batch and the metrics logged."""
    state.reward, state.metrics = reward, StepMetrics()
    batch = reinforce.rollout(state, state.stream.next_batch(cfg.num_prompts_per_step), cfg)
    batch = reinforce.dynamic_sampling(state, reinforce.score(state, batch, cfg), cfg)
    return batch, state.metrics.reduce(DistEnv())


def hand_batch(rewards, lengths, truncated=None, kl=0.0):
    b, r = len(rewards), max(lengths)
    mask = torch.arange(r)[None, :] < torch.tensor(lengths)[:, None]
    lp = torch.where(mask, torch.full((b, r), -1.0), 0.0)
    return TensorDict(
        {
            "rewards": torch.tensor(rewards),
            "action_mask": mask,
            "logprobs": lp,
            "ref_logprobs": torch.where(mask, lp - kl, 0.0),
            "truncated": torch.tensor(truncated or [False] * b),
        },
        batch_size=[b],
    )


def test_rloo_advantages_broadcast_over_action_tokens():
    cfg = ReinforceConfig(num_generations_per_prompt=2, num_prompts_per_step=2)
    batch = hand_batch([1.0, 0.0, 3.0, 1.0], [2, 3, 1, 2])
    m = advantages(batch, cfg)
    # leave-one-out: baseline of row i is the other row of its group
    expected = torch.tensor([1.0, -1.0, 2.0, -2.0])
    assert torch.equal(batch["advantages"], torch.where(batch["action_mask"], expected[:, None], 0.0))
    assert m["baseline"].item() == pytest.approx((0 + 1 + 1 + 3) / 4)
    assert m["rewards"].item() == pytest.approx(1.25)


def test_grpo_and_dr_grpo_advantages():
    batch = hand_batch([1.0, 0.0, 0.0, 0.0, 2.0, 2.0, 2.0, 2.0], [1] * 8)
    cfg = ReinforceConfig(num_generations_per_prompt=4, num_prompts_per_step=2, adv_estimator="grpo")
    advantages(batch, cfg)
    std = torch.tensor([1.0, 0.0, 0.0, 0.0]).std()
    expected = torch.tensor([0.75, -0.25, -0.25, -0.25]) / (std + 1e-6)
    torch.testing.assert_close(batch["advantages"][:4, 0], expected)
    assert torch.equal(batch["advantages"][4:], torch.zeros(4, 1))  # zero spread -> zero advantage
    advantages(batch, dataclasses.replace(cfg, adv_estimator="dr_grpo"))  # Dr. GRPO: no division by the std
    torch.testing.assert_close(batch["advantages"][:4, 0], torch.tensor([0.75, -0.25, -0.25, -0.25]))


def test_kl_in_reward_is_subtracted_before_the_baseline():
    # k1 KL of 0.5 per token; lengths 2 and 4 -> sequence KL 1 and 2
    batch = hand_batch([1.0, 1.0], [2, 4], kl=0.5)
    cfg = ReinforceConfig(
        num_generations_per_prompt=2, num_prompts_per_step=1, kl_in_reward=True, kl_coef=0.1
    )
    m = advantages(batch, cfg)
    shaped = torch.tensor([1.0 - 0.1, 1.0 - 0.2])
    assert m["rewards_with_kl"].item() == pytest.approx(shaped.mean().item())
    assert m["init_policy_kl"].item() == pytest.approx(1.5)
    torch.testing.assert_close(batch["advantages"][:, 0], torch.tensor([0.1, -0.1]))
    # the config's clamp reaches the kernel: KL 0.5 per token clamped to 0.2 -> sequence KL 0.4 and 0.8
    m = advantages(batch, dataclasses.replace(cfg, kl_clamp=0.2))
    assert m["rewards_with_kl"].item() == pytest.approx((1.0 - 0.04 + 1.0 - 0.08) / 2)


def test_nemo_aligner_kl_mean_and_rloo_without_truncated():
    """``kl_reward_reduction: mean`` (Aligner's masked_mean of the KL) and ``rloo_exclude_truncated`` (Aligner's
    ``calculate_rloo_baseline`` with ``mask=is_end``)."""
    from reference_impl import aligner_rloo_baseline

    batch = hand_batch([1.0, 1.0], [2, 4], kl=0.5)
    cfg = ReinforceConfig(num_generations_per_prompt=2, num_prompts_per_step=1, kl_in_reward=True, kl_coef=0.1,
                          kl_reward_reduction="mean")
    m = advantages(batch, cfg)
    assert m["rewards_with_kl"].item() == pytest.approx(1.0 - 0.1 * 0.5)  # mean KL 0.5 on both rows
    torch.testing.assert_close(batch["advantages"][:, 0], torch.tensor([0.0, 0.0]))

    rewards = [1.0, 0.0, 3.0, 2.0, 5.0, 1.0, 4.0, 0.5]
    truncated = [False, True, False, False, True, True, False, True]  # groups of 4: 3 ended, then 1 ended
    batch = hand_batch(rewards, [2, 3, 1, 2, 1, 2, 3, 1], truncated=truncated)
    cfg = ReinforceConfig(num_generations_per_prompt=4, num_prompts_per_step=2, rloo_exclude_truncated=True)
    m = advantages(batch, cfg)
    r = torch.tensor(rewards)
    want = r - aligner_rloo_baseline(torch.arange(2).repeat_interleave(4), r, (~torch.tensor(truncated)).float())
    torch.testing.assert_close(batch["advantages"], torch.where(batch["action_mask"], want[:, None], 0.0))
    assert torch.equal(want[4:], torch.zeros(4))  # one ended response: the group's advantages are 0
    off = advantages(batch, dataclasses.replace(cfg, rloo_exclude_truncated=False))
    assert off["baseline"].item() != m["baseline"].item()


def test_loop_advantages_are_the_registry_estimators():
    """The advantages phase is ``ADVANTAGE_ESTIMATORS[adv_estimator]`` on the batch's token rewards: the
    per-token estimators see each token's KL penalty (verl's token_level_rewards), the others the sequence's."""
    batch = hand_batch([1.0, 0.0, 2.0, 2.0], [2, 4, 3, 1], kl=0.5)
    kl = torch.where(batch["action_mask"], 0.5, 0.0)
    base = dict(num_generations_per_prompt=2, num_prompts_per_step=2, kl_in_reward=True, kl_coef=0.1)
    cfg = ReinforceConfig(adv_estimator="reinforce_plus_plus", gamma=0.9, **base)
    advantages(batch, cfg)
    token_level = rlbits.token_rewards(batch["rewards"], batch["action_mask"], kl, 0.1)
    want, _ = rlbits.reinforce_plus_plus_advantage(token_level, batch["action_mask"], gamma=0.9)
    torch.testing.assert_close(batch["advantages"], want)
    m = advantages(batch, dataclasses.replace(cfg, adv_estimator="opo", gamma=1.0))
    shaped = batch["rewards"] - 0.1 * kl.sum(-1)
    want, _ = rlbits.opo_advantage(rlbits.token_rewards(shaped, batch["action_mask"]), batch["action_mask"], group_size=2)
    torch.testing.assert_close(batch["advantages"], want)
    assert m["baseline"].item() == pytest.approx(shaped.mean().item())  # the group means' mean


def test_raw_reward_advantages_whiten_the_rewards():
    """NeMo-RL's ``raw_reward``: the reward on every token, whitened over the batch's tokens; one response per
    prompt is enough (no groups)."""
    batch = hand_batch([1.0, 0.0, 2.0, 2.0], [2, 3, 1, 2])
    cfg = config_from_dict(ReinforceConfig, {"adv_estimator": "raw_reward", "num_generations_per_prompt": 1,
                                             "num_prompts_per_step": 4})
    m = advantages(batch, cfg)
    mask = batch["action_mask"]
    tokens = batch["rewards"][:, None].expand(mask.shape)[mask]
    want = (tokens - tokens.mean()) / tokens.var(unbiased=False).sqrt()
    torch.testing.assert_close(batch["advantages"][mask], want)
    assert m["baseline"].item() == 0.0


def test_remax_advantages_subtract_the_greedy_reward():
    batch = hand_batch([1.0, 0.0, 2.0, 2.0], [2, 3, 1, 2])
    batch["reward_baselines"] = torch.tensor([0.5, 0.5, 3.0, 3.0])
    cfg = ReinforceConfig(num_generations_per_prompt=2, num_prompts_per_step=2, adv_estimator="remax")
    m = advantages(batch, cfg)
    expected = torch.tensor([0.5, -0.5, -1.0, -1.0])
    assert torch.equal(batch["advantages"], torch.where(batch["action_mask"], expected[:, None], 0.0))
    assert m["baseline"].item() == pytest.approx(1.75)


def test_overlong_filtering_masks_truncated_rows_out_of_the_loss():
    batch = hand_batch([1.0, 0.0], [3, 1], truncated=[True, False])
    cfg = ReinforceConfig(num_generations_per_prompt=2, num_prompts_per_step=1, overlong_filtering=True)
    m = advantages(batch, cfg)
    assert not batch["loss_mask"][0].any() and batch["loss_mask"][1, 0]
    assert m["truncated_frac"].item() == 0.5 and m["loss_tokens"].item() == 1
    advantages(batch, dataclasses.replace(cfg, overlong_filtering=False))
    assert torch.equal(batch["loss_mask"], batch["action_mask"])


def test_informative_groups():
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0])
    assert informative_groups(rewards, 2).tolist() == [False, True, False]


# --- phases on a tiny model ---------------------------------------------------------------------------


def test_dynamic_sampling_keeps_only_informative_groups(tiny_path, tmp_path):
    cfg = make_cfg(tiny_path, tmp_path, dynamic_sampling=True, dynamic_sampling_max_gen_batches=3)
    state = init_state(cfg, DistEnv())

    def first_char_reward(prompts, responses):  # depends on the prompt only for half the prompts
        return [
            float(len(r)) if p.startswith(("1", "2", "3", "4")) else 0.0
            for p, r in zip(prompts, responses, strict=True)
        ]

    batch, stats = sample_batch(state, cfg, first_char_reward)
    k = cfg.num_generations_per_prompt
    assert batch.batch_size[0] % k == 0 and batch.batch_size[0] // k == stats["kept_groups"] <= 4
    assert informative_groups(batch["rewards"], k).all()
    assert 1 <= stats["gen_batches"] <= 3
    assert state.stream.consumed_samples == 4 * stats["gen_batches"]
    assert batch["group"].tolist() == torch.arange(batch.batch_size[0] // k).repeat_interleave(k).tolist()


def test_pack_decode_weights_reaches_generate(tiny_path, tmp_path, monkeypatch):
    """``pack_decode_weights`` decides whether the rollout packs the policy's weights (on CPU), and the
    samples are the same either way."""
    import rlbits.rollout.generate as gen_module

    calls = []
    original = gen_module.packed_linears
    monkeypatch.setattr(gen_module, "packed_linears", lambda *a, **k: calls.append(1) or original(*a, **k))
    batches = []
    for flag in (True, False):
        cfg = make_cfg(tiny_path, tmp_path / str(flag), pack_decode_weights=flag)
        state = init_state(cfg, DistEnv())
        before = len(calls)
        batches.append(sample_batch(state, cfg, length_reward)[0])
        assert (len(calls) > before) == flag
    assert torch.equal(batches[0]["responses"], batches[1]["responses"])
    torch.testing.assert_close(batches[0]["logprobs"], batches[1]["logprobs"], atol=1e-5, rtol=0)


def test_reinforce_and_unclipped_ppo_give_the_same_gradient(tiny_path, tmp_path):
    cfg = make_cfg(tiny_path, tmp_path)
    state = init_state(cfg, DistEnv())
    batch, _ = sample_batch(state, cfg, length_reward)
    batch["ref_logprobs"] = batch["logprobs"].clone()
    advantages(batch, cfg)
    grads = []
    n = batch["loss_mask"].sum().float()
    den = Denominators(num_tokens=n, num_seqs=torch.tensor(16.0), num_rows=torch.tensor(16.0))
    for c in (cfg, dataclasses.replace(cfg, num_iterations=2)):
        assert c.clipped == (c is not cfg)
        state.policy.zero_grad()
        loss, m = objective(state, batch, c, den)
        loss.backward()
        grads.append(torch.cat([p.grad.flatten() for p in state.policy.parameters() if p.grad is not None]))
        assert m["clipfrac"][0].item() == 0.0
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-4, atol=1e-6)


def test_positive_example_nll_weight_adds_its_term(tiny_path, tmp_path):
    """NeMo-RL ``positive_example_nll_weight``: the objective gains ``mu * positive_example_nll_loss`` over the
    rows with reward > 0."""
    cfg = make_cfg(tiny_path, tmp_path)
    state = init_state(cfg, DistEnv())
    batch, _ = sample_batch(state, cfg, length_reward)
    batch["ref_logprobs"] = batch["logprobs"].clone()
    batch["rewards"] = torch.linspace(-1, 1, batch.batch_size[0])
    advantages(batch, cfg)
    n = batch["loss_mask"].sum().float()
    den = Denominators(num_tokens=n, num_seqs=torch.tensor(16.0), num_rows=torch.tensor(16.0))
    off, _ = objective(state, batch, cfg, den)
    on, m = objective(state, batch, dataclasses.replace(cfg, positive_example_nll_weight=0.5), den)
    logprobs = policy_logprobs(state.policy, batch, temperature=cfg.temperature).float()
    nll, _ = rlbits.positive_example_nll_loss(logprobs, batch["loss_mask"], batch["rewards"])
    torch.testing.assert_close(on - off, 0.5 * nll, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(m["positive_nll_loss"], nll.detach(), rtol=1e-5, atol=1e-6)


def test_non_finite_loss_names_step_and_phase(tiny_path, tmp_path):
    cfg = make_cfg(tiny_path, tmp_path)
    state = init_state(cfg, DistEnv())
    batch, _ = sample_batch(state, cfg, length_reward)
    batch["ref_logprobs"] = batch["logprobs"].clone()
    advantages(batch, cfg)
    with torch.no_grad():
        next(state.policy.parameters()).fill_(float("nan"))
    with pytest.raises(FloatingPointError, match="step 1, phase update"):
        update(state, batch, cfg)


# --- the policy losses (rlbits.POLICY_LOSSES) ------------------------------------------------------------

LOSS_KWARGS = {"dro": {"dro_beta": 0.1}, "clip_cov": {"clip_cov_ratio": 0.2}, "kl_cov": {"kl_cov_ratio": 0.2}}


@pytest.fixture(scope="module")
def scored_batch(tiny_path, tmp_path_factory):
    """One rollout of the tiny policy with its GRPO advantages (16 rows), shared by the policy-loss tests."""
    cfg = make_cfg(tiny_path, tmp_path_factory.mktemp("losses"), adv_estimator="grpo")
    batch, _ = sample_batch(init_state(cfg, DistEnv()), cfg, length_reward)
    advantages(batch, cfg)
    return batch


@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
def test_every_policy_loss_trains_and_logs_its_metrics(name, tiny_path, tmp_path, scored_batch):
    """Two passes (the second one's ratios are off 1): a finite loss, the weights move, the loss's metrics are
    logged as step means."""
    cfg = make_cfg(
        tiny_path, tmp_path, adv_estimator="grpo", num_iterations=2, policy_loss=name,
        policy_loss_kwargs=LOSS_KWARGS.get(name, {}),
    )
    state = init_state(cfg, DistEnv())
    before = torch.cat([p.detach().flatten() for p in state.policy.parameters()])
    update(state, scored_batch.clone(), cfg)
    logged = state.metrics.reduce(DistEnv())
    b = scored_batch
    _, own = POLICY_LOSSES[name](b["logprobs"], b["logprobs"], b["advantages"], b["loss_mask"], **cfg.policy_loss_args)
    names = {"actor_loss", "clipfrac", "approx_kl", "entropy", "grad_norm"} | (set(own) if name != "vanilla" else set())
    assert names <= set(logged)
    assert all(math.isfinite(logged[k]) for k in names)
    assert logged["approx_kl"] > 0  # the second pass ran off-policy
    assert not torch.equal(before, torch.cat([p.detach().flatten() for p in state.policy.parameters()]))


@pytest.mark.parametrize("name", ["gspo", "cispo"])
def test_the_objective_calls_the_registered_loss(name, tiny_path, tmp_path, scored_batch):
    """The objective's policy term is ``POLICY_LOSSES[name]`` on the same microbatch: value and gradient."""
    cfg = make_cfg(
        tiny_path, tmp_path, adv_estimator="grpo", policy_loss=name, clip_eps=0.05, clip_eps_high=0.08,
        loss_agg="seq-mean-token-mean",
    )
    state = init_state(cfg, DistEnv())
    micro = scored_batch.clone()
    noise = 0.1 * torch.randn(micro["logprobs"].shape, generator=torch.Generator().manual_seed(0))
    micro["logprobs"] = micro["logprobs"] + noise  # an old policy off the current one: ratios != 1
    mask = micro["loss_mask"]
    den = Denominators(num_tokens=mask.sum().float() + 5, num_seqs=torch.tensor(19.0), num_rows=torch.tensor(19.0))
    params = [p for p in state.policy.parameters() if p.requires_grad]

    loss, stats = objective(state, micro, cfg, den)
    got = torch.autograd.grad(loss, params, allow_unused=True)
    logprobs = policy_logprobs(state.policy, micro, temperature=cfg.temperature, **head_args(cfg)).float()
    want, metrics = POLICY_LOSSES[name](
        logprobs, micro["logprobs"], micro["advantages"], mask, agg="seq-mean-token-mean",
        num_tokens=den.num_tokens, num_seqs=den.num_seqs, clip_eps=0.05, clip_eps_high=0.08,
    )
    expected = torch.autograd.grad(want, params, allow_unused=True)
    torch.testing.assert_close(loss, want, rtol=1e-6, atol=1e-7)
    for g, e in zip(got, expected, strict=True):
        assert (g is None) == (e is None)
        if g is not None:
            torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-7)
    assert metrics["clipfrac"] > 0  # the clip range acts on this batch
    for key in ("clipfrac", "approx_kl", "ratio_mean"):
        total, count = stats[key]
        torch.testing.assert_close(total / count, metrics[key])


# --- the whole loop ------------------------------------------------------------------------------------


@pytest.mark.slow
def test_two_step_smoke_run(tiny_path, tmp_path):
    from transformers import AutoModelForCausalLM

    cfg = make_cfg(tiny_path, tmp_path, adv_estimator="grpo", kl_loss_coef=0.05, tensorboard=True)
    run_dir = train(cfg, reward=length_reward)
    assert {"config.yaml", "metrics.jsonl", "samples.jsonl", "tensorboard", "checkpoints", "final"} <= {
        p.name for p in run_dir.iterdir()
    }
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert "val_reward" in rows[0] and "val_reward" in rows[2]
    names = {
        "rewards",
        "rewards_with_kl",
        "gen_rewards",
        "baseline",
        "advantages",
        "init_policy_kl",
        "kl_loss",
        "actor_loss",
        "clipfrac",
        "approx_kl",
        "entropy",
        "grad_norm",
        "response_len",
        "truncated_frac",
        "zero_std_frac",
        "kept_groups",
        "gen_batches",
        "tokens_per_s",
        "time/rollout",
        "time/update",
    }
    assert names <= rows[1].keys(), names - rows[1].keys()
    assert rows[1]["entropy"] > 0 and rows[1]["clipfrac"] == 0.0
    state = json.loads((run_dir / "checkpoints" / "step_2" / "state.json").read_text())
    assert state["step"] == 2 and state["stream"] == {"consumed_samples": 8} and state["total_valid_tokens"] > 0
    assert AutoModelForCausalLM.from_pretrained(run_dir / "final") is not None
    assert (run_dir / "final" / "tokenizer.json").exists()
    samples = [json.loads(ln) for ln in (run_dir / "samples.jsonl").read_text().splitlines()]
    train_rows = [s for s in samples if "split" not in s]  # the rest: validations (step 0 and the last step)
    assert len(train_rows) == 4 and {"step", "prompt", "response", "reward"} <= train_rows[0].keys()
    assert {s["step"] for s in samples if s.get("split") == "test"} == {0, 2}


@pytest.mark.slow
@pytest.mark.parametrize("estimator", reinforce.ADV_ESTIMATORS)
def test_every_estimator_runs(tiny_path, tmp_path, estimator):
    """One step of each estimator on the tiny setup, with the KL in the reward (per token for the per-token
    estimators); remax adds its greedy phase."""
    cfg = make_cfg(
        tiny_path, tmp_path, adv_estimator=estimator, max_num_steps=1, num_prompts_per_step=2, kl_in_reward=True,
        kl_coef=0.05, val_at_start=False, val_at_end=False, save_period=0, log_samples=0,
        gamma=0.9 if estimator == "reinforce_plus_plus" else 1.0,
    )
    (row,) = read_metrics(train(cfg, reward=length_reward))
    assert all(v == v for v in row.values() if isinstance(v, float)), row  # no NaN
    assert ("greedy_rewards" in row) == ("time/greedy" in row) == (estimator == "remax")
    assert row["loss_tokens"] > 0


@pytest.mark.slow
def test_exact_resume(tiny_path, tmp_path):
    # every piece of state in play: clipping with minibatch shuffles, dynamic sampling, KL in reward and loss
    opts = dict(
        num_iterations=2,
        num_minibatches=2,
        clip_eps_high=0.28,
        dynamic_sampling=True,
        kl_in_reward=True,
        kl_coef=0.05,
        kl_loss_coef=0.01,
        save_period=2,
        val_at_start=False,
        val_period=0,
    )
    full = train(make_cfg(tiny_path, tmp_path / "a", max_num_steps=4, **opts), reward=length_reward)
    part = make_cfg(tiny_path, tmp_path / "b", max_num_steps=2, **opts)
    train(part, reward=length_reward)
    resumed = train(dataclasses.replace(part, max_num_steps=4), reward=length_reward, resume=True)

    a, b = untimed_by_step(read_metrics(full), 3), untimed_by_step(read_metrics(resumed), 3)
    assert sorted(a) == [3, 4] and a == b
    assert [r["step"] for r in read_metrics(resumed)] == [1, 2, 3, 4]


@pytest.mark.slow
def test_resume_without_checkpoint_is_an_error(tiny_path, tmp_path):
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        train(make_cfg(tiny_path, tmp_path), resume=True)


# --- config errors --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "values, match",
    [
        ({"adv_estimator": "ppo"}, "adv_estimator must be one of"),
        ({"num_generations_per_prompt": 1}, "num_generations_per_prompt must be >= 2"),
        ({"num_generations_per_prompt": 1, "adv_estimator": "opo"}, "adv_estimator='opo'"),
        ({"gamma": 0.9}, "gamma=0.9 has no effect with adv_estimator='rloo'"),
        ({"gamma": 1.5, "adv_estimator": "reinforce_plus_plus"}, "gamma"),
        ({"adv_estimator": "gae"}, "adv_estimator must be one of"),
        ({"rloo_exclude_truncated": True, "adv_estimator": "grpo"}, "rloo_exclude_truncated needs"),
        ({"kl_reward_reduction": "mean", "adv_estimator": "remax", "num_generations_per_prompt": 1},
         "kl_reward_reduction='mean' does not apply"),
        ({"kl_coef": 0.1}, "kl_in_reward"),
        ({"kl_in_reward": True}, "kl_coef > 0"),
        ({"kl_estimator": "k4"}, "kl_estimator must be one of"),
        ({"loss_agg": "sum"}, "loss_agg must be one of"),
        ({"num_minibatches": 17}, "num_minibatches"),
        ({"num_iterations": 0}, "num_iterations"),
        ({"clip_eps_high": -0.1}, "clip_eps"),
        ({"loop": "ppo"}, "loop must be 'reinforce'"),
        ({"num_generation_per_prompt": 4}, "did you mean num_generations_per_prompt"),
        ({"dynamic_sampling": "yes"}, "dynamic_sampling must be bool"),
        ({"policy_loss": "ppo"}, "policy_loss must be one of vanilla, gspo"),
        ({"policy_loss": "cispo", "policy_loss_kwargs": {"tau_pos": 1.0}}, "not a hyperparameter of policy_loss"),
    ],
)
def test_config_errors(values, match):
    with pytest.raises(ConfigError, match=match):
        config_from_dict(ReinforceConfig, values)


def test_config_defaults_and_plain_reinforce():
    cfg = config_from_dict(ReinforceConfig, {"adv_estimator": "none", "num_generations_per_prompt": 1})
    assert cfg.loop == "reinforce" and not cfg.clipped
    for name in ("reinforce_plus_plus", "remax", "raw_reward"):  # no groups: one response per prompt is enough
        config_from_dict(ReinforceConfig, {"adv_estimator": name, "num_generations_per_prompt": 1})
    assert set(reinforce.ADV_ESTIMATORS) <= set(rlbits.ADVANTAGE_ESTIMATORS)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.kl_coef = 1.0  # type: ignore[misc]


@pytest.mark.parametrize(
    "name", ["rloo_arithmetic.yaml", "grpo_arithmetic.yaml", "gspo_arithmetic.yaml", "cispo_arithmetic.yaml"]
)
def test_shipped_configs_load(name):
    from pathlib import Path

    from rlbits.loops.config import load_config

    cfg = load_config(ReinforceConfig, Path(__file__).resolve().parents[2] / "configs" / name)
    assert cfg.task == "arithmetic" and cfg.val_greedy


@pytest.mark.slow
def test_stop_request_ends_after_the_step_with_a_checkpoint(tiny_path, tmp_path):
    class StopAfterFirst:
        def __init__(self):
            self.steps = []

        def on_metrics(self, step, metrics):
            self.steps.append(step)

        def should_stop(self):
            return bool(self.steps) and self.steps[-1] >= 1

    cb = StopAfterFirst()
    cfg = make_cfg(tiny_path, tmp_path, max_num_steps=5, val_at_start=False, val_at_end=False, save_period=0)
    run_dir = train(cfg, reward=length_reward, callbacks=[cb])
    # the stop flag is read after step 1 is logged (as in every loop): no step 2; checkpoint + final/
    assert [r["step"] for r in read_metrics(run_dir)] == [1]
    assert (run_dir / "checkpoints" / "step_1").is_dir() and (run_dir / "final" / "config.json").exists()


@pytest.mark.slow
def test_reference_skipped_when_no_term_uses_it(tiny_path, tmp_path):
    """GRPO without KL terms (TRL's beta = 0): no reference model, no init_policy_kl, the same training as
    with the reference kept for monitoring."""
    base = dict(adv_estimator="grpo", kl_loss_coef=0.0)
    assert not make_cfg(tiny_path, tmp_path / "x", **base).uses_ref_logprobs
    assert make_cfg(tiny_path, tmp_path / "x", adv_estimator="grpo", kl_loss_coef=0.05).uses_ref_logprobs
    assert make_cfg(tiny_path, tmp_path / "x", kl_in_reward=True, kl_coef=0.1).uses_ref_logprobs
    state = reinforce.init_state(make_cfg(tiny_path, tmp_path / "x", **base), DistEnv(), reward=length_reward)
    assert state.reference is None
    skip = train(make_cfg(tiny_path, tmp_path / "skip", **base), reward=length_reward)
    mon = train(make_cfg(tiny_path, tmp_path / "mon", **base, monitor_init_policy_kl=True), reward=length_reward)
    a, b = read_metrics(skip), read_metrics(mon)
    assert not any("init_policy_kl" in r for r in a) and all("init_policy_kl" in r for r in b if r["step"] > 0)
    for ra, rb in zip(a, b, strict=True):
        for key in ("rewards", "actor_loss", "val_reward"):
            if key in ra:
                assert ra[key] == pytest.approx(rb[key], rel=1e-6, abs=1e-7), key


@pytest.mark.parametrize("arch", ["gpt2", "llama", "qwen2"])
def test_bf16_rollouts_decode_from_a_refreshed_bf16_copy(arch):
    """precision=bf16: the rollout decodes from a bfloat16 copy of the policy (rotary buffers kept in
    float32), refreshed from the policy's weights before each rollout; the sampler's logprobs stay close
    to the trainer's autocast forward (the step-1 mismatch init_policy_kl would show)."""
    from rlbits.loops import phases
    from rlbits.models.forward import policy_logprobs
    from rlbits.rollout.generate import generate
    from rlbits.text import make_prompts

    policy = tiny_causal_lm(arch, V, seed=1)
    state = SimpleNamespace(policy=policy, decode_copy=None)
    cfg = ReinforceConfig(precision="bf16")
    with phases.decoding(state, cfg) as model:
        assert model is state.decode_copy and model is not policy
        assert all(p.dtype == torch.bfloat16 for p in model.parameters())
        assert all(b.dtype == ob.dtype for b, ob in zip(model.buffers(), policy.buffers(), strict=True))
        g = torch.Generator().manual_seed(0)
        prompts = make_prompts([torch.randint(3, V - 1, (n,), generator=g).tolist() for n in (3, 6, 4)], 0)
        out = generate(model, prompts, max_new_tokens=8, eos_token_id=None, pad_token_id=0, num_samples=2, generator=g)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        trainer = policy_logprobs(policy, out)
    diff = (out["logprobs"] - trainer)[out["action_mask"]]
    assert diff.abs().max().item() < 0.1
    assert abs(diff.sum().item() / out.batch_size[0]) < 0.1  # k1 KL per sequence at step 1
    with torch.no_grad():  # an optimizer step changes the policy: the next rollout sees the new weights
        for p in policy.parameters():
            p.add_(0.01)
    copy_before = state.decode_copy
    with phases.decoding(state, cfg) as model:
        assert model is copy_before  # refreshed in place, not rebuilt
        for p, q in zip(model.parameters(), policy.parameters(), strict=True):
            assert torch.equal(p, q.to(torch.bfloat16))
    fp32 = SimpleNamespace(policy=policy, decode_copy=None)
    with phases.decoding(fp32, ReinforceConfig()) as model:
        assert model is policy and fp32.decode_copy is None
