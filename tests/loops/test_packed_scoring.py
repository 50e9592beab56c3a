"""The scoring passes before the update split and pack as the update does (``phases.scoring_args``): with
``pack_sequences`` and ``max_tokens_per_microbatch`` the reference's ``ref_logprobs``, the rollout
correction's ``old_logprobs`` (and its weights and mask) and PPO's critic ``values`` equal the padded
row-count passes' to 1e-5 relative, on rows of random prompt and response lengths with padding, for REINFORCE
and PPO, multi-turn episodes (observation tokens inside the response) and the preference loop's reference.
A run with the switches on logs the metrics of one with them off. Also: every ``generate`` call of the
loops, the greedy baseline and the offline pairs included, follows ``continuous_batching``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from tensordict import TensorDict

from rlbits.functional.packing import pack_bins, token_budget_partitions
from rlbits.loops import phases, ppo, preference, reinforce
from rlbits.loops.metrics import StepMetrics
from rlbits.loops.preference import stack_pairs
from rlbits.loops.runtime import disable_dropout
from rlbits.models import forward
from rlbits.models.heads import ValueModel
from rlbits.models.tiny import tiny_causal_lm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dist_worker import V, fixed_batch  # noqa: E402
from test_golden import mismatches, run_pinned_setup  # noqa: E402
from test_packed_update import SPLITS as UPDATE_SPLITS  # noqa: E402
from test_packed_update import multiturn, policy  # noqa: E402

OFF = {"microbatch_size": 3, "pack_sequences": False}
SPLITS = {name: split for name, split in UPDATE_SPLITS.items() if split != OFF}  # the update tests' splits
SCORES = ("ref_logprobs", "old_logprobs", "rollout_is_weights", "values")


def assert_close(want: torch.Tensor, got: torch.Tensor, name: str) -> None:
    assert want.shape == got.shape, name
    assert (want - got).abs().max() <= 1e-5 * want.abs().max() + 1e-7, name


class Spy:
    """Counts ``forward._packed_rows`` calls (one per packed pass) while installed."""

    def __init__(self, monkeypatch):
        self.calls = 0
        original = forward._packed_rows

        def spy(*args):
            self.calls += 1
            return original(*args)

        monkeypatch.setattr(forward, "_packed_rows", spy)


def score(loop, split, episodes=False):
    """The phases between the rollout and the update on ``fixed_batch``: reference, (PPO) values, rollout
    correction (``tis``: the sampler's logprobs are the policy's plus noise)."""
    model = policy().eval()
    batch = fixed_batch(model)
    batch = multiturn(batch) if episodes else batch
    del batch["ref_logprobs"]
    reference = disable_dropout(tiny_causal_lm("gpt2", V, seed=1)).eval()
    fields = {"rollout_correction": {"mode": "tis"}, **split}
    if loop is ppo:
        cfg = ppo.PPOConfig(kl_in_reward=True, **fields)
    else:
        cfg = reinforce.ReinforceConfig(kl_loss_coef=0.05, **fields)
    state = SimpleNamespace(
        policy=model, reference=reference, value_model=ValueModel.from_policy(model, seed=1).eval(),
        critic=None, metrics=StepMetrics(),
    )
    batch = loop.reference(state, batch, cfg)
    if loop is ppo:
        batch = ppo.values(state, batch, cfg)
    return loop.rollout_correction(state, batch, cfg)


@pytest.mark.parametrize("split", sorted(SPLITS))
@pytest.mark.parametrize("loop", [reinforce, ppo], ids=["reinforce", "ppo"])
def test_scored_batch_equals_the_padded_one(loop, split, monkeypatch):
    want = score(loop, OFF)
    spy = Spy(monkeypatch)
    got = score(loop, SPLITS[split])
    for key in SCORES if loop is ppo else SCORES[:3]:
        assert_close(want[key], got[key], key)
    assert torch.equal(want["loss_mask"], got["loss_mask"])
    passes = 3 if loop is ppo else 2  # reference, old logprobs (and values)
    if split == "packed":
        assert spy.calls == passes * 3  # 8 rows, 3 a pass
    elif split == "packed_budget":
        lengths = want["attention_mask"].sum(-1).tolist()
        assert spy.calls == passes * len(token_budget_partitions(lengths, 24)) > passes
    else:
        assert spy.calls == 0


@pytest.mark.parametrize("loop", [reinforce, ppo], ids=["reinforce", "ppo"])
def test_multiturn_episodes_scored_batch_equals_the_padded_one(loop):
    want, got = score(loop, OFF, episodes=True), score(loop, SPLITS["packed_budget"], episodes=True)
    for key in SCORES if loop is ppo else SCORES[:3]:
        assert_close(want[key], got[key], key)


@pytest.mark.parametrize("split", ["packed", "packed_budget"])
def test_preference_reference_equals_the_padded_one(split):
    flat = fixed_batch(policy())
    pairs = stack_pairs(flat, torch.tensor([0, 2, 4, 7]), torch.tensor([1, 3, 5, 6]))
    ref = disable_dropout(tiny_causal_lm("gpt2", V, seed=1)).eval()
    state = SimpleNamespace(reference=ref, policy=ref)
    want = preference.reference(state, pairs.clone(), preference.PreferenceConfig(beta=0.2, **OFF))
    got = preference.reference(state, pairs.clone(), preference.PreferenceConfig(beta=0.2, **SPLITS[split]))
    assert_close(want["ref_logps"], got["ref_logps"], "ref_logps")


def test_scoring_args():
    cfg = reinforce.ReinforceConfig(microbatch_size=5)  # packing is on by default
    assert phases.scoring_args(cfg) == {"microbatch_size": 5, "max_tokens": None, "pack": True}
    cfg = reinforce.ReinforceConfig(microbatch_size=5, pack_sequences=False)
    assert phases.scoring_args(cfg) == {"microbatch_size": 5, "max_tokens": None, "pack": False}
    cfg = reinforce.ReinforceConfig(microbatch_size=5, pack_sequences=True, max_tokens_per_microbatch=64)
    assert phases.scoring_args(cfg) == {"microbatch_size": None, "max_tokens": 64, "pack": True}


@pytest.mark.parametrize("pack", [False, True])
def test_token_budget_of_a_forward_pass(pack):
    """``max_tokens``: the passes of ``token_budget_partitions``, the results back in row order; a budget under
    the longest row, or a budget beside ``microbatch_size``, is refused."""
    model = policy().eval()
    batch = fixed_batch(model)
    lengths = batch["attention_mask"].sum(-1).tolist()
    seen = []
    backbone = model.base_model  # the output layer runs apart (``split_head``)
    handle = backbone.register_forward_pre_hook(lambda m, a, kw: seen.append(kw["input_ids"].shape), with_kwargs=True)
    with torch.no_grad():
        want = forward.policy_logprobs(model, batch, microbatch_size=1)
        forward.policy_logprobs(model, batch, pack=True)  # the model's one-off row check (two [1, 4] calls)
        seen.clear()
        got = forward.policy_logprobs(model, batch, max_tokens=20, pack=pack)
    handle.remove()
    assert_close(want, got, "logprobs")
    parts = token_budget_partitions(lengths, 20, padded=not pack)
    assert len(seen) == len(parts) > 1
    if pack:  # each pass: its rows in first-fit-decreasing bins as long as its longest row
        want_shapes = []
        for part in parts:
            part_lengths = [lengths[i] for i in part]
            want_shapes.append((len(pack_bins(part_lengths, max(part_lengths))), max(part_lengths)))
        assert [tuple(s) for s in seen] == want_shapes
        assert any(n > 1 for n, _ in want_shapes) and any(n < len(p) for (n, _), p in zip(want_shapes, parts, strict=True))
    with pytest.raises(ValueError, match="more than the budget max_tokens=3"):
        forward.policy_logprobs(model, batch, max_tokens=3, pack=pack)
    with pytest.raises(ValueError, match="give microbatch_size .* or max_tokens"):
        forward.critic_values(ValueModel.from_policy(model), batch, microbatch_size=2, max_tokens=20, pack=pack)


def test_every_generate_call_of_the_loops_follows_continuous_batching(monkeypatch):
    """The greedy baseline (ReMax) and the preference loop's offline pairs pass ``continuous_batching`` on."""
    seen = []

    def fake(*args, **kw):
        seen.append(kw["continuous_batching"])
        n = len(args[2]) * kw.get("num_samples", 1)
        ones = torch.ones(n, 2, dtype=torch.long)
        keys = {"prompts": ones, "prompt_mask": ones, "responses": ones, "action_mask": ones.bool()}
        return TensorDict({**keys, "rewards": torch.zeros(n)}, batch_size=[n])

    monkeypatch.setattr(phases, "generate_rollout", fake)
    monkeypatch.setattr(phases, "score_rollout", lambda batch, reward: batch["rewards"])
    batch = TensorDict({"prompt_text": ["a", "a", "b", "b"], "action_mask": torch.ones(4, 2)}, batch_size=[4])
    for flag in (False, True):
        cfg = reinforce.ReinforceConfig(adv_estimator="remax", num_generations_per_prompt=2, continuous_batching=flag)
        state = SimpleNamespace(
            policy=torch.nn.Linear(1, 1), make_env=None, tokenizer=None, reward=None, metrics=StepMetrics()
        )
        reinforce.greedy_baseline(state, batch, cfg)
        pcfg = preference.PreferenceConfig(num_generations_per_prompt=2, continuous_batching=flag)
        preference.sample_pairs(None, None, ["a", "b"], None, pcfg, torch.Generator())
    assert seen == [False, False, True, True]


@pytest.mark.slow
@pytest.mark.parametrize("loop", ["ppo", "reinforce"])
def test_a_run_logs_the_same_metrics_with_the_switches_on(loop, tmp_path, monkeypatch):
    """The golden setups of tests/loops/test_golden.py (3 steps, validation) with the rollout correction on
    (the old-logprob pass): ``pack_sequences: true`` and a token budget log the metrics of the padded run
    (the golden tolerance: 1e-4 relative + 1e-6), and the scoring passes did pack."""
    scoring_packs = []
    original = forward._packed_rows
    monkeypatch.setattr(
        forward, "_packed_rows", lambda *a: scoring_packs.append(torch.is_grad_enabled()) or original(*a)
    )
    correction = {"rollout_correction": {"mode": "tis"}}
    off = run_pinned_setup(loop, tmp_path, "off", **correction, pack_sequences=False)
    assert not scoring_packs
    on = run_pinned_setup(loop, tmp_path, "on", **correction, pack_sequences=True, max_tokens_per_microbatch=40)
    assert scoring_packs.count(False) >= 2 * 3  # the scoring passes (no gradient) of every step packed
    assert len(off) == len(on) > 1
    assert not mismatches(off, on), "\n".join(mismatches(off, on))
