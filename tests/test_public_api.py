"""The public API contract of docs/design.md: every name importable from ``rlbits`` with its documented signature."""

from __future__ import annotations

import inspect

import pytest

import rlbits

CONTRACT = {
    "masked_mean": ["x", "mask", "dim"],
    "masked_sum": ["x", "mask", "dim"],
    "masked_var": ["x", "mask", "unbiased"],
    "masked_whiten": ["x", "mask", "shift_mean", "eps"],
    "logprobs_from_logits": ["logits", "tokens", "temperature"],
    "entropy_from_logits": ["logits"],
    "kl_penalty": ["logprobs", "ref_logprobs", "estimator"],
    "token_rewards": ["rewards", "action_mask", "kl", "kl_coef"],
    "gae": ["token_rewards", "values", "action_mask", "gamma", "lam"],
    "rloo_baseline": ["rewards", "group_size"],
    "group_normalize": ["rewards", "group_size", "scale", "eps"],
    "ppo_loss": ["logprobs", "old_logprobs", "advantages", "action_mask", "clip_eps", "clip_eps_high", "dual_clip", "agg", "num_tokens"],
    "value_loss": ["values", "old_values", "returns", "action_mask", "clip_eps", "agg", "num_tokens"],
    "reinforce_loss": ["logprobs", "advantages", "action_mask", "agg", "num_tokens"],
    "ilql_targets": ["token_rewards", "values", "action_mask", "gamma"],
    "q_loss": ["q_values", "targets", "action_mask"],
    "expectile_loss": ["values", "target_q", "action_mask", "tau"],
    "cql_loss": ["q_logits", "actions", "action_mask"],
    "awac_loss": ["logits", "actions", "action_mask"],
    "ilql_logits": ["logits", "q", "v", "beta"],
    "bradley_terry_loss": ["chosen_rewards", "rejected_rewards", "margin", "center_coef"],
    "pointwise_reward_loss": ["rewards", "labels"],
    "sequence_logprobs": ["logprobs", "action_mask", "average"],
    "dpo_loss": ["chosen_logratios", "rejected_logratios", "beta", "loss_type", "label_smoothing"],
    "generate": ["policy", "prompts_td", "max_new_tokens", "temperature", "top_k", "top_p", "eos_token_id", "pad_token_id", "num_samples", "logits_processor"],
    "score": ["batch", "reward"],
    "generate_episodes": ["policy", "tokenizer", "envs", "prompts", "temperature", "generator", "max_episode_tokens", "reward_placement", "max_env_workers", "env_timeout_s", "compile", "logits_processor"],
    "evaluate": ["policy", "tokenizer", "task_or_prompts", "reward", "config", "env"],
    "sweep": ["config", "grid", "out_dir", "processes", "verbose"],
}
DEFAULTS = {
    ("masked_whiten", "shift_mean"): True,
    ("masked_whiten", "eps"): 1e-8,
    ("masked_var", "unbiased"): True,
    ("logprobs_from_logits", "temperature"): 1.0,
    ("kl_penalty", "estimator"): "k1",
    ("token_rewards", "kl_coef"): 0.0,
    ("gae", "gamma"): 1.0,
    ("gae", "lam"): 0.95,
    ("group_normalize", "scale"): True,
    ("group_normalize", "eps"): 1e-6,
    ("ppo_loss", "clip_eps"): 0.2,
    ("ppo_loss", "agg"): "token-mean",
    ("value_loss", "clip_eps"): None,
    ("expectile_loss", "tau"): 0.7,
    ("bradley_terry_loss", "margin"): None,
    ("bradley_terry_loss", "center_coef"): 0.0,
    ("sequence_logprobs", "average"): False,
    ("dpo_loss", "loss_type"): "sigmoid",
    ("dpo_loss", "label_smoothing"): 0.0,
    ("generate", "temperature"): 1.0,
    ("generate", "num_samples"): 1,
    ("generate_episodes", "reward_placement"): "token",
    ("generate_episodes", "max_env_workers"): 8,
    ("generate_episodes", "env_timeout_s"): 60.0,
    ("evaluate", "reward"): None,
    ("evaluate", "config"): None,
    ("sweep", "processes"): None,
}


@pytest.mark.parametrize("name", sorted(CONTRACT))
def test_contract_names_and_parameters(name):
    fn = getattr(rlbits, name)
    params = inspect.signature(fn).parameters
    names = list(params)
    assert names[: len(CONTRACT[name])] == CONTRACT[name], names  # positional order is part of the contract
    for (fn_name, arg), default in DEFAULTS.items():
        if fn_name == name:
            assert params[arg].default == default, (arg, params[arg].default)
    assert fn.__doc__ and len(fn.__doc__) > 200, f"{name} needs a docstring with shapes, errors and source"


def test_every_exported_name_resolves():
    for name in rlbits.__all__:
        assert getattr(rlbits, name) is not None


def test_unknown_attribute_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no_such_thing"):
        rlbits.no_such_thing  # noqa: B018


def test_evaluate_a_policy_in_memory():
    """``rlbits.evaluate``: a task's test prompts and reward, or prompts and a reward, without a run folder."""
    from rlbits.models.tiny import tiny_causal_lm, tiny_tokenizer

    policy, tokenizer = tiny_causal_lm("gpt2", 32, seed=0), tiny_tokenizer(32)
    metrics, batch = rlbits.evaluate(policy, tokenizer, "arithmetic", max_val_samples=3, max_new_tokens=3)
    names = {"val_reward", "val_reward_std", "val_response_len", "val_fraction_of_samples_properly_ended"}
    assert set(metrics) == names and batch.batch_size[0] == 3
    again, _ = rlbits.evaluate(policy, tokenizer, "arithmetic", max_val_samples=3, max_new_tokens=3)
    assert again == metrics  # its own seeded generator: the same noise every call

    def length(prompts, responses):
        return [float(len(r)) for r in responses]

    metrics, batch = rlbits.evaluate(policy, tokenizer, ["a b", "c d"], length, max_new_tokens=2)
    assert batch.batch_size[0] == 2 and batch["rewards"].tolist() == [float(len(r)) for r in batch["response_text"]]
    assert metrics["val_reward"] == pytest.approx(batch["rewards"].mean().item())
    # NeMo-Aligner's is_end.float().mean(): the responses not cut at max_new_tokens
    ended = (~batch["truncated"]).double().mean().item()
    assert metrics["val_fraction_of_samples_properly_ended"] == pytest.approx(ended)
    with pytest.raises(ValueError, match="needs reward="):
        rlbits.evaluate(policy, tokenizer, ["a b"])
