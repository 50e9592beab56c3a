"""Every kernel compiles with torch.compile(fullgraph=True) (no graph breaks, so no host syncs) and gives
the eager values and gradients."""

from __future__ import annotations

import pytest
import torch
from strategies import make_mask

import rlbits
from rlbits.functional.rollout_correction import ROLLOUT_CORRECTIONS, decoupled_ppo_loss

pytestmark = pytest.mark.slow

B, R, V = 4, 9, 13


def _inputs():
    gen = torch.Generator().manual_seed(0)
    mask = make_mask(B, R, "holes", gen)
    mask[1] = False  # an empty row

    def rnd(*shape, grad=False):
        x = torch.randn(*shape, generator=gen)
        return x.requires_grad_(grad)

    tokens = torch.randint(0, V, (B, R), generator=gen)
    return mask, rnd, tokens


def _cases():
    mask, rnd, tokens = _inputs()
    old = rnd(B, R)
    return {
        "masked_mean": (rlbits.masked_mean, (rnd(B, R, grad=True), mask), {}),
        "masked_sum": (rlbits.masked_sum, (rnd(B, R, grad=True), mask), {"dim": 1}),
        "masked_var": (rlbits.masked_var, (rnd(B, R, grad=True), mask), {}),
        "masked_whiten": (rlbits.masked_whiten, (rnd(B, R, grad=True), mask), {"shift_mean": False}),
        "logprobs_from_logits": (rlbits.logprobs_from_logits, (rnd(B, R, V, grad=True), tokens), {"temperature": 0.7}),
        "entropy_from_logits": (rlbits.entropy_from_logits, (rnd(B, R, V, grad=True),), {}),
        "kl_penalty": (rlbits.kl_penalty, (rnd(B, R, grad=True), rnd(B, R)), {"estimator": "k3"}),
        "kl_penalty_clamp": (rlbits.kl_penalty, (rnd(B, R, grad=True), rnd(B, R)), {"estimator": "k3", "clamp": 0.5}),
        "kl_penalty_k1+": (rlbits.kl_penalty, (rnd(B, R, grad=True), rnd(B, R)), {"estimator": "k1+", "clamp": 1.0}),
        "kl_penalty_k3+": (rlbits.kl_penalty, (rnd(B, R, grad=True), rnd(B, R)), {"estimator": "k3+"}),
        "token_rewards": (rlbits.token_rewards, (rnd(B, grad=True), mask), {"kl": rnd(B, R), "kl_coef": 0.1}),
        "gae": (rlbits.gae, (rnd(B, R, grad=True), rnd(B, R, grad=True), mask), {"gamma": 0.99, "lam": 0.95}),
        "rloo_baseline": (rlbits.rloo_baseline, (rnd(B, grad=True),), {"group_size": 2}),
        "group_normalize": (rlbits.group_normalize, (rnd(B, grad=True),), {"group_size": 2}),
        "group_normalize_leave_one_out": (
            rlbits.group_normalize,
            (torch.tensor([1.0, 0.0, 0.0, 0.3, -1.2, 2.0, 0.5, 0.5, 0.5], requires_grad=True),),  # equal others, spread, a tie
            {"group_size": 3, "std": "leave_one_out"},
        ),
        "ppo_loss": (
            rlbits.ppo_loss,
            ((old + 0.3 * rnd(B, R)).requires_grad_(True), old, rnd(B, R), mask),
            {"clip_eps_high": 0.28, "dual_clip": 3.0, "agg": "seq-mean-token-mean"},
        ),
        "ppo_loss_is_weighted": (
            rlbits.ppo_loss,
            ((old + 0.3 * rnd(B, R)).requires_grad_(True), old, rnd(B, R), mask),
            {"rollout_is_weights": rnd(B, R).exp()},
        ),
        "decoupled_ppo_loss": (
            decoupled_ppo_loss,
            ((old + 0.3 * rnd(B, R)).requires_grad_(True), old, rnd(B, R), mask),
            {"rollout_logprobs": old + 0.2 * rnd(B, R), "behav_imp_weight_cap": 1.5, "clip_ratio_c": 3.0},
        ),
        "value_loss": (rlbits.value_loss, (rnd(B, R, grad=True), rnd(B, R), rnd(B, R), mask), {"clip_eps": 0.2}),
        "reinforce_loss": (rlbits.reinforce_loss, (rnd(B, R, grad=True), rnd(B, R), mask), {"num_tokens": 50}),
        "ilql_targets": (rlbits.ilql_targets, (rnd(B, R), rnd(B, R, grad=True), mask), {"gamma": 0.9}),
        "q_loss": (rlbits.q_loss, (rnd(B, R, grad=True), rnd(B, R), mask), {}),
        "expectile_loss": (rlbits.expectile_loss, (rnd(B, R, grad=True), rnd(B, R), mask), {"tau": 0.8}),
        "cql_loss": (rlbits.cql_loss, (rnd(B, R, V, grad=True), tokens, mask), {}),
        "awac_loss": (rlbits.awac_loss, (rnd(B, R, V, grad=True), tokens, mask), {}),
        "awac_loss_weighted": (
            rlbits.awac_loss,
            (rnd(B, R, V, grad=True), tokens, mask),
            {"advantages": rnd(B, R), "beta": 0.5, "num_tokens": 20},
        ),
        "bradley_terry_loss": (
            rlbits.bradley_terry_loss,
            (rnd(B, grad=True), rnd(B, grad=True)),
            {"margin": rnd(B).abs(), "center_coef": 0.01},
        ),
        "sequence_logprobs": (rlbits.sequence_logprobs, (rnd(B, R, grad=True), mask), {"average": True}),
        **{
            f"dpo_loss_{loss_type}": (
                rlbits.dpo_loss,
                (rnd(B, grad=True), rnd(B, grad=True), 0.3, loss_type),
                {
                    "label_smoothing": 0.1 if loss_type in ("robust", "simpo") else 0.0,
                    "chosen_lengths": torch.tensor([3, 0, 5, 9]),
                    "rejected_lengths": torch.tensor([4, 2, 0, 7]),
                },
            )
            for loss_type in rlbits.DPO_LOSS_TYPES
        },
        "pointwise_reward_loss": (rlbits.pointwise_reward_loss, (rnd(B, grad=True), torch.tensor([1, 0, 1, 1])), {}),
        "ilql_logits": (rlbits.ilql_logits, (rnd(B, R, V, grad=True), rnd(B, R, V), rnd(B, R)), {"beta": 0.5}),
    }


def _flatten(out):
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, dict):
        return [out[k] for k in sorted(out)]
    return [t for item in out for t in _flatten(item)]


CASES = _cases()


@pytest.mark.parametrize("name", sorted(CASES))
def test_compiled_kernel_matches_eager(name):
    fn, args, kwargs = CASES[name]
    if name.startswith("dpo_loss_"):  # one compilation per loss_type: past dynamo's recompile limit of dpo_loss
        torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True)
    eager_out = _flatten(fn(*args, **kwargs))
    compiled_out = _flatten(compiled(*args, **kwargs))
    assert len(eager_out) == len(compiled_out)
    for e, c in zip(eager_out, compiled_out, strict=False):
        torch.testing.assert_close(c, e, atol=1e-5, rtol=1e-5)
    leaves = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
    weights = [torch.randn(e.shape, generator=torch.Generator().manual_seed(1)) for e in eager_out]
    differentiable = [i for i, e in enumerate(eager_out) if e.requires_grad]
    assert differentiable, f"{name}: no differentiable output"
    g_eager = torch.autograd.grad(sum((eager_out[i] * weights[i]).sum() for i in differentiable), leaves)
    g_compiled = torch.autograd.grad(sum((compiled_out[i] * weights[i]).sum() for i in differentiable), leaves)
    for e, c in zip(g_eager, g_compiled, strict=False):
        torch.testing.assert_close(c, e, atol=1e-5, rtol=1e-5)


def _estimator_cases():
    """Every ``ADVANTAGE_ESTIMATORS`` entry on groups of 2 (one with equal rewards), with its extra inputs. The
    estimators detach their inputs (advantages are constants of the update): values only."""
    mask, rnd, _ = _inputs()
    rewards = torch.where(mask, rnd(B, R), 0.0)
    rewards[2:] = 0.0  # group 1: all rewards 0
    extra = {
        "gae": {"values": rnd(B, R), "gamma": 0.99, "lam": 0.95},
        "reinforce_plus_plus": {"gamma": 0.9},
        "remax": {"reward_baselines": rnd(B)},
        "gpg": {"f_norm": 2.0},
        "optimal_token_baseline": {"old_logprobs": -rnd(B, R).abs(), "sum_pi_squared": rnd(B, R).abs() * 0.1},
        "gdpo": {"reward_components": rnd(B, 2), "gdpo_reward_weights": [1.0, 0.5]},
    }
    cases = {
        name: (fn, (rewards, mask), {"group_size": 2, **extra.get(name, {})})
        for name, fn in rlbits.ADVANTAGE_ESTIMATORS.items()
    }
    cases["gae_global_sum"] = (
        rlbits.gae_advantage,
        (rewards, mask),
        {"global_sum": lambda t: 2 * t, **extra["gae"]},
    )
    return cases


ESTIMATOR_CASES = _estimator_cases()


@pytest.mark.parametrize("name", sorted(ESTIMATOR_CASES))
def test_compiled_advantage_estimator_matches_eager(name):
    fn, args, kwargs = ESTIMATOR_CASES[name]
    compiled = torch.compile(fn, fullgraph=True)
    for e, c in zip(_flatten(fn(*args, **kwargs)), _flatten(compiled(*args, **kwargs)), strict=True):
        torch.testing.assert_close(c, e, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("mode", sorted(ROLLOUT_CORRECTIONS))
def test_compiled_rollout_correction_matches_eager(mode):
    """The corrections are not differentiable (their outputs are detached): values, masks and metrics."""
    mask, rnd, _ = _inputs()
    old = rnd(B, R) - 2.0
    rollout = old + 0.1 * rnd(B, R)
    kwargs = {"threshold": 0.01} if mode == "rs" else {}
    fn = ROLLOUT_CORRECTIONS[mode]
    eager_out = _flatten(fn(old, rollout, mask, **kwargs))
    compiled_out = _flatten(torch.compile(fn, fullgraph=True)(old, rollout, mask, **kwargs))
    assert len(eager_out) == len(compiled_out)
    for e, c in zip(eager_out, compiled_out, strict=True):
        torch.testing.assert_close(c, e, atol=1e-5, rtol=1e-5)
