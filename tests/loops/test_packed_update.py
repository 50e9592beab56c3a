"""Packed updates (``pack_sequences``) and token-budget microbatches (``max_tokens_per_microbatch``) equal the
padded update of every loop that packs, against a slow, obviously right reference: the padded update with
one row per microbatch, where each forward pass sees one row cut to its own tokens (a per-row forward).

Each optimizer step's gradients (recorded before the step) and the logged losses agree to 1e-5 relative, for
PPO (policy and critic), REINFORCE (RLOO), the preference loop (DPO), multi-turn episodes (observation tokens
inside the response: ``action_mask`` False, attention on) and a LoRA policy; ILQL's token budget (its
objective does not pack). FSDP2 at 2 ranks: tests/distributed/test_packed_dist.py.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from tensordict import TensorDict

from rlbits.data.stream import PromptStream
from rlbits.distributed.env import DistEnv
from rlbits.loops import ppo, preference, reinforce
from rlbits.loops.metrics import StepMetrics
from rlbits.loops.preference import stack_pairs
from rlbits.loops.runtime import disable_dropout, with_lora
from rlbits.loops.update import Trained, optimize
from rlbits.models.forward import critic_values
from rlbits.models.heads import ValueModel
from rlbits.models.tiny import tiny_causal_lm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dist_worker import K, V, fixed_batch  # noqa: E402

# The split under test: packed rows, token budgets (packed and padded), beside the reference (one row each).
REFERENCE = {"microbatch_size": 1, "pack_sequences": False}
SPLITS = {
    "packed": {"pack_sequences": True, "microbatch_size": 3},
    "packed_budget": {"pack_sequences": True, "max_tokens_per_microbatch": 24},
    "padded_budget": {"max_tokens_per_microbatch": 30, "pack_sequences": False},
    "padded_rows": {"microbatch_size": 3, "pack_sequences": False},
}


class RecordingSGD(torch.optim.SGD):
    """SGD that keeps a copy of every gradient it steps with (after clipping)."""

    def __init__(self, params, lr):
        super().__init__(params, lr=lr)
        self.grads: list[list[torch.Tensor]] = []

    def step(self, closure=None):
        self.grads.append([p.grad.clone() for g in self.param_groups for p in g["params"] if p.grad is not None])
        return super().step(closure)


def assert_grads_equal(want: list[list[torch.Tensor]], got: list[list[torch.Tensor]]) -> None:
    assert len(want) == len(got) > 0
    for step_want, step_got in zip(want, got, strict=True):
        assert len(step_want) == len(step_got) > 0
        for a, b in zip(step_want, step_got, strict=True):
            assert (a - b).abs().max() <= 1e-5 * a.abs().max() + 1e-9


def assert_metrics_equal(want: dict[str, float], got: dict[str, float]) -> None:
    assert set(want) == set(got)
    for name, a in want.items():
        assert got[name] == pytest.approx(a, rel=1e-5, abs=1e-7), name


def multiturn(batch):
    """The layout of ``rlbits.rollout.multiturn`` episodes: an observation (tool output) of two tokens inside
    the responses of the rows long enough, trained on by nothing (``action_mask`` False) but attended to."""
    batch = batch.clone()
    long = batch["action_mask"].sum(-1) >= 5
    obs = torch.zeros_like(batch["action_mask"])
    obs[:, 2:4] = long[:, None]
    batch["response_mask"] = batch["action_mask"].clone()
    for key in ("action_mask", "loss_mask"):
        batch[key] = batch[key] & ~obs
    for key in ("advantages", "returns", "logprobs", "ref_logprobs"):
        batch[key] = torch.where(batch["action_mask"], batch[key], 0.0)
    return batch


def policy(lora: bool = False):
    model = disable_dropout(tiny_causal_lm("gpt2", V, seed=0)).train()
    if lora:
        model = with_lora(model, reinforce.ReinforceConfig(lora_rank=4))
        g = torch.Generator().manual_seed(7)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.copy_(0.3 * torch.randn(p.shape, generator=g))
    return model


def run_reinforce(split, *, episodes=False, lora=False):
    model = policy(lora)
    batch = fixed_batch(model)
    batch = multiturn(batch) if episodes else batch
    cfg = reinforce.ReinforceConfig(
        num_generations_per_prompt=K, num_prompts_per_step=2, num_iterations=2, num_minibatches=2,
        kl_loss_coef=0.05, max_grad_norm=0.5, lora_rank=4 if lora else 0, **split,
    )
    opt = RecordingSGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    state = reinforce.State(
        env=DistEnv(), policy=model, optimizer=opt, sampling_generator=torch.Generator(),
        minibatch_generator=torch.Generator().manual_seed(1), stream=PromptStream(["unused"], seed=0),
    )
    reinforce.update(state, batch, cfg)
    return [opt.grads], state.metrics.reduce(state.env)


def run_ppo(split, *, episodes=False):
    model = policy()
    batch = fixed_batch(model)
    batch = multiturn(batch) if episodes else batch
    value_model = disable_dropout(ValueModel.from_policy(model, seed=1)).train()
    with torch.no_grad():
        batch["values"] = torch.where(batch["action_mask"], critic_values(value_model, batch), 0.0)
    cfg = ppo.PPOConfig(
        ppo_epochs=2, num_minibatches=2, clip_eps=0.1, value_clip_eps=0.2, entropy_coef=0.01, kl_in_reward=False,
        kl_loss_coef=0.05, max_grad_norm=0.5, **split,
    )
    opts = RecordingSGD(model.parameters(), lr=0.5), RecordingSGD(value_model.parameters(), lr=0.5)
    state = ppo.State(
        env=DistEnv(), policy=model, value_model=value_model, policy_optimizer=opts[0], value_optimizer=opts[1],
        sampling_generator=torch.Generator(), minibatch_generator=torch.Generator().manual_seed(1),
        stream=PromptStream(["unused"], seed=0), kl_coef=cfg.kl_loss_coef,
    )
    ppo.update(state, batch, cfg)
    return [o.grads for o in opts], state.metrics.reduce(state.env)


def run_preference(split):
    model = policy()
    flat = fixed_batch(model)
    pairs = stack_pairs(flat, torch.tensor([0, 2, 4, 7]), torch.tensor([1, 3, 5, 6]))
    pairs["ref_logps"] = -torch.rand(4, 2, generator=torch.Generator().manual_seed(3)) * 10
    cfg = preference.PreferenceConfig(beta=0.2, max_grad_norm=0.5, **split)
    opt = RecordingSGD(model.parameters(), lr=0.5)
    state = preference.State(
        env=DistEnv(), policy=model, optimizer=opt, sampling_generator=torch.Generator(),
        minibatch_generator=torch.Generator().manual_seed(1), stream=PromptStream(["unused"], seed=0),
    )
    preference.update(state, pairs, cfg)
    return [opt.grads], state.metrics.reduce(state.env)


@functools.cache
def reference(run, **kwargs):
    """The reference run (one row per microbatch) of ``run``, once per test session."""
    return run(REFERENCE, **kwargs)


def check(run, split, **kwargs):
    grads, logged = run(SPLITS[split], **kwargs)
    want_grads, want_logged = reference(run, **kwargs)
    for want, got in zip(want_grads, grads, strict=True):
        assert_grads_equal(want, got)
    assert_metrics_equal(want_logged, logged)


@pytest.mark.parametrize("split", ["packed", "packed_budget", "padded_budget"])
def test_reinforce(split):
    check(run_reinforce, split)


@pytest.mark.parametrize("split", ["packed", "packed_budget"])
def test_ppo(split):
    check(run_ppo, split)


def test_ppo_multiturn_episodes_packed():
    check(run_ppo, "packed_budget", episodes=True)


@pytest.mark.parametrize("split", ["packed", "padded_rows"])
def test_reinforce_multiturn_episodes(split):
    check(run_reinforce, split, episodes=True)


def test_reinforce_lora_packed():
    check(run_reinforce, "packed_budget", lora=True)


@pytest.mark.parametrize("split", ["packed", "packed_budget"])
def test_preference(split):
    check(run_preference, split)


def test_token_budget_equals_row_microbatches():
    """The token budget changes which rows share a microbatch, not the step: equal to row microbatches."""
    grads, logged = run_reinforce(SPLITS["padded_budget"])
    want_grads, want_logged = run_reinforce(SPLITS["padded_rows"])
    assert_grads_equal(want_grads[0], grads[0])
    assert_metrics_equal(want_logged, logged)


def test_an_objective_that_does_not_pack_refuses_pack_sequences():
    """ILQL's and the reward model's objectives run their own forward passes: ``pack_sequences`` is refused."""
    model = torch.nn.Linear(2, 1)
    batch = TensorDict({"x": torch.randn(4, 2), "action_mask": torch.ones(4, 3, dtype=torch.bool)}, [4])
    cfg = SimpleNamespace(
        microbatch_size=2, max_grad_norm=0.0, precision="fp32", max_tokens_per_microbatch=None, pack_sequences=True
    )
    state = SimpleNamespace(env=DistEnv(), metrics=StepMetrics(), step=0)

    def objective(state, micro, cfg, den):
        return model(micro["x"]).sum() / den.num_rows, {}

    with pytest.raises(ValueError, match="pack_sequences=True but the update objective ran no packed forward"):
        optimize(state, batch, cfg, objective, trained=[Trained(model, torch.optim.SGD(model.parameters(), lr=0.1))])


def test_token_budget_keeps_per_row_statistics_in_row_order():
    """``optimize`` returns the per-row statistics in the minibatch's row order whatever rows share a
    microbatch (the token budget regroups them by length)."""
    model = torch.nn.Linear(2, 1)
    lengths = torch.tensor([7, 1, 5, 2, 8, 3])
    batch = TensorDict(
        {"x": torch.randn(6, 2), "attention_mask": torch.arange(8)[None] < lengths[:, None]}, [6]
    )
    batch["action_mask"] = batch["attention_mask"]
    cfg = SimpleNamespace(
        microbatch_size=2, max_grad_norm=0.0, precision="fp32", max_tokens_per_microbatch=10, pack_sequences=False
    )
    state = SimpleNamespace(env=DistEnv(), metrics=StepMetrics(), step=0)

    def objective(state, micro, cfg, den):
        return model(micro["x"]).sum() / den.num_rows, {"first": micro["x"][:, 0]}

    out = optimize(state, batch, cfg, objective, trained=[Trained(model, torch.optim.SGD(model.parameters(), lr=0.1))])
    torch.testing.assert_close(out["first"], batch["x"][:, 0])


@pytest.mark.parametrize("pack", [False, True])
def test_ilql_token_budget_equals_one_row_microbatches_and_refuses_packing(pack):
    """ILQL through the engine: a token budget gives the one-row-per-microbatch step; its objective calls
    its model itself, so ``pack_sequences`` is refused."""
    from test_loop_ilql import _dataset

    from rlbits.loops import ilql
    from rlbits.models.heads import ILQLModel

    data = _dataset()
    longest = int(data["attention_mask"].sum(-1).max())

    def step(**fields):
        model = ILQLModel(tiny_causal_lm(vocab_size=64, seed=0), head_layers=1, seed=0)
        opt = RecordingSGD(model.parameters(), lr=0.1)
        state = SimpleNamespace(env=DistEnv(), metrics=StepMetrics(), step=0, model=model)
        optimize(state, data, ilql.ILQLConfig(**fields), ilql.objective, trained=[Trained(model, opt)])
        return opt.grads

    if pack:
        with pytest.raises(ValueError, match="pack_sequences=True but the update objective"):
            step(pack_sequences=True)
        return
    assert_grads_equal(step(microbatch_size=1), step(max_tokens_per_microbatch=2 * longest))
