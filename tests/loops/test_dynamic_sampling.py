"""Dynamic sampling (DAPO; NeMo-RL's ``use_dynamic_sampling``, ``dynamic_sampling_max_gen_batches`` and
``batch_multiplier``): ``phases.keep_informative_groups`` against NeMo-RL's ``dynamic_sampling`` written out
line by line (tests/reference_impl.py), the PPO loop with it, REINFORCE's ``batch_multiplier``, the config
checks."""

from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace

import pytest
import torch
from reference_impl import nemo_rl_dynamic_sampling_step
from tensordict import TensorDict

from rlbits.data.stream import PromptStream
from rlbits.distributed.env import DistEnv
from rlbits.loops import phases
from rlbits.loops.config import MAX_ROWS, ConfigError, config_from_dict
from rlbits.loops.metrics import StepMetrics
from rlbits.loops.ppo import PPOConfig
from rlbits.loops.ppo import train as ppo_train
from rlbits.loops.reinforce import ReinforceConfig
from rlbits.loops.reinforce import train as reinforce_train
from rlbits.loops.run import read_metrics
from rlbits.models.load import save_pretrained
from rlbits.models.tiny import tiny_causal_lm, tiny_tokenizer

PROMPTS = ["the plot", "a film", "it was", "my day", "so this", "hello", "we saw", "an end"]

# --- against NeMo-RL's dynamic_sampling -----------------------------------------------------------------


def reward_table(seed: int, rows: int, k: int, p_flat: float) -> torch.Tensor:
    """Rewards of every row the step may generate, in draw order: a fraction ``p_flat`` of the groups all
    0 or all 1 (std 0), the others 0/1 at random (some of them flat too)."""
    gen = torch.Generator().manual_seed(seed)
    groups = rows // k
    flat = torch.rand(groups, generator=gen) < p_flat
    level = (torch.rand(groups, generator=gen) < 0.5).float()
    noisy = (torch.rand(groups, k, generator=gen) < 0.5).float()
    return torch.where(flat[:, None], level[:, None].expand(groups, k), noisy).flatten()


def run_rlbits(table: torch.Tensor, n: int, k: int, multiplier: float, max_gen_batches: int):
    """``keep_informative_groups`` with a rollout that hands out ``table``'s rows in order; returns the kept
    rows' indices, the metrics and the rows generated."""
    drawn = {"rows": 0}

    def rollout(state, prompts, cfg):
        start, rows = drawn["rows"], prompts.batch_size[0] * k
        drawn["rows"] += rows
        return TensorDict(
            {"rewards": table[start : start + rows], "row": torch.arange(start, start + rows)}, [rows]
        )

    cfg = SimpleNamespace(
        num_prompts_per_step=n, num_generations_per_prompt=k, dynamic_sampling=True, batch_multiplier=multiplier,
        dynamic_sampling_max_gen_batches=max_gen_batches,
    )
    state = SimpleNamespace(
        env=DistEnv(), stream=PromptStream(list(range(1000)), seed=0), metrics=StepMetrics(), step=0, policy=None
    )
    first = rollout(state, state.stream.next_batch(phases.generation_batch_size(cfg)), cfg)
    kept = phases.keep_informative_groups(
        state, first, cfg, rollout=rollout, score=lambda state, batch, cfg: batch, exhausted="error"
    )
    rows = torch.cat([part["row"] for part in kept]).tolist()
    return rows, state.metrics.reduce(DistEnv()), drawn["rows"], state.stream.consumed_samples


def run_nemo_rl(table: torch.Tensor, n: int, k: int, multiplier: float, max_gen_batches: int):
    """NeMo-RL's step over the same rows; its ``dynamic_sampling_max_gen_batches`` is rlbits' minus 1."""
    size = int(n * multiplier) * k  # its dataloader batch of int(num_prompts_per_step * batch_multiplier)

    def batches():
        for start in range(0, len(table), size):
            yield {"rewards": table[start : start + size].tolist(), "row": list(range(start, start + size))}

    return nemo_rl_dynamic_sampling_step(batches(), n, k, max_gen_batches - 1)


CASES = [  # num_prompts_per_step, K, batch_multiplier, dynamic_sampling_max_gen_batches, fraction of flat groups
    (4, 4, 1.0, 4, 0.5),
    (4, 2, 2.0, 3, 0.7),
    (3, 4, 1.5, 5, 0.8),
    (5, 3, 1.3, 2, 0.4),
    (8, 2, 1.0, 6, 0.9),
    (2, 8, 3.0, 1, 0.6),
]


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("n, k, multiplier, max_gen_batches, p_flat", CASES)
def test_keep_informative_groups_is_nemo_rl_dynamic_sampling(seed, n, k, multiplier, max_gen_batches, p_flat):
    """The same rows kept in the same order, the same number of generation batches and of informative rows
    dropped by the slice, or an error in both."""
    table = reward_table(seed, 64 * int(n * multiplier) * k, k, p_flat)
    try:
        expected, metrics = run_nemo_rl(table, n, k, multiplier, max_gen_batches)
    except ValueError:
        with pytest.raises(RuntimeError, match="dynamic_sampling_max_gen_batches"):
            run_rlbits(table, n, k, multiplier, max_gen_batches)
        return
    rows, got, generated, consumed = run_rlbits(table, n, k, multiplier, max_gen_batches)
    assert rows == expected["row"] and len(rows) == n * k
    assert got["gen_batches"] == metrics["dynamic_sampling_num_gen_batches"]
    assert got["kept_groups"] == n
    assert got["discarded_groups"] * k == metrics["dynamic_sampling_num_discarded_valid_samples"]
    assert generated == got["gen_batches"] * int(n * multiplier) * k
    assert consumed == got["gen_batches"] * int(n * multiplier)


def test_the_cases_cover_several_batches_the_slice_and_the_error():
    """The reference comparison above meets each path: several generation batches, informative groups
    dropped by the slice, and the error past dynamic_sampling_max_gen_batches."""
    seen = set()
    for seed in range(6):
        for n, k, multiplier, max_gen_batches, p_flat in CASES:
            table = reward_table(seed, 64 * int(n * multiplier) * k, k, p_flat)
            try:
                _, metrics = run_nemo_rl(table, n, k, multiplier, max_gen_batches)
            except ValueError:
                seen.add("error")
                continue
            seen.add("several" if metrics["dynamic_sampling_num_gen_batches"] > 1 else "one")
            if metrics["dynamic_sampling_num_discarded_valid_samples"] > 0:
                seen.add("sliced")
    assert seen == {"error", "several", "one", "sliced"}


def test_exhausted_train_returns_what_was_kept():
    """REINFORCE's ``exhausted="train"``: short after the batches, the kept groups; none kept, the first
    ``num_prompts_per_step`` groups of the last batch."""
    n, k = 2, 2
    cfg = SimpleNamespace(
        num_prompts_per_step=n, num_generations_per_prompt=k, dynamic_sampling=True, batch_multiplier=2.0,
        dynamic_sampling_max_gen_batches=2,
    )
    for rewards, kept_rows in (([0.0] * 8, [8, 9, 10, 11]), ([0.0, 1.0] + [0.0] * 6, [0, 1])):
        table = torch.tensor(rewards + [0.0] * 8)
        state = SimpleNamespace(
            env=DistEnv(), stream=PromptStream(list(range(100)), seed=0), metrics=StepMetrics(), step=0, policy=None
        )
        calls = {"start": 0}

        def rollout(state, prompts, cfg, table=table, calls=calls):
            start, rows = calls["start"], prompts.batch_size[0] * k
            calls["start"] += rows
            return TensorDict({"rewards": table[start : start + rows], "row": torch.arange(start, start + rows)}, [rows])

        first = rollout(state, state.stream.next_batch(4), cfg)
        kept = phases.keep_informative_groups(state, first, cfg, rollout=rollout, score=lambda s, b, c: b)
        assert torch.cat([p["row"] for p in kept]).tolist() == kept_rows
        assert state.metrics.reduce(DistEnv())["gen_batches"] == 2


# --- the loops ------------------------------------------------------------------------------------------


def parity_reward(prompts, responses):
    """0 or 1 by the parity of the response's characters: about half of the groups of 2 differ."""
    return [float(sum(map(ord, r)) % 2) for r in responses]


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("dynsamp") / "policy"
    save_pretrained(tiny_causal_lm("gpt2", seed=0), tiny_tokenizer(), path)
    return str(path)


def make_cfg(cls, policy_dir, run_dir, **overrides):
    values = dict(
        policy=policy_dir, run_dir=str(run_dir), max_num_steps=2, num_prompts_per_step=4,
        num_generations_per_prompt=2, max_new_tokens=6, microbatch_size=4, num_minibatches=2,
        learning_rate=1e-3, max_val_samples=4, val_period=0, val_at_start=False, val_at_end=False, save_period=0,
        log_samples=0, progress=False, tensorboard=False, dynamic_sampling=True, batch_multiplier=1.5,
        dynamic_sampling_max_gen_batches=6,
    )
    if cls is PPOConfig:
        values["ppo_epochs"] = 1
    values.update(overrides)
    return config_from_dict(cls, values)


@pytest.mark.slow
def test_ppo_dynamic_sampling_run(policy_dir, tmp_path):
    """Each step trains on exactly num_prompts_per_step informative groups, drawn 6 prompts
    (int(4 * 1.5)) per generation batch; the metrics say how many batches it took."""
    cfg = make_cfg(PPOConfig, policy_dir, tmp_path / "run", save_period=2)
    ppo_train(cfg, reward=parity_reward, prompts=PROMPTS)
    rows = [r for r in read_metrics(tmp_path / "run") if r["step"] > 0]
    assert len(rows) == 2
    for row in rows:
        assert row["kept_groups"] == 4 and row["gen_batches"] >= 1 and row["discarded_groups"] >= 0
        assert 0 <= row["zero_std_frac"] < 1 and "gen_rewards" in row
        assert 0 < row["rewards"] < 1  # the kept groups' rows: each group has a 0 and a 1
    state = json.loads((tmp_path / "run/checkpoints/step_2/state.json").read_text())
    assert state["stream"]["consumed_samples"] == 6 * sum(r["gen_batches"] for r in rows)


@pytest.mark.slow
def test_ppo_dynamic_sampling_error_past_max_gen_batches(policy_dir, tmp_path):
    cfg = make_cfg(PPOConfig, policy_dir, tmp_path / "run", dynamic_sampling_max_gen_batches=2, max_num_steps=1)
    with pytest.raises(RuntimeError, match=r"step 1, phase rollout: dynamic sampling: after "
                       r"dynamic_sampling_max_gen_batches=2 generation batches of 6 prompts .*this rank: 0"):
        ppo_train(cfg, reward=lambda prompts, responses: [1.0] * len(responses), prompts=PROMPTS)


@pytest.mark.slow
def test_ppo_without_dynamic_sampling_logs_no_new_metrics(policy_dir, tmp_path):
    cfg = make_cfg(PPOConfig, policy_dir, tmp_path / "run", dynamic_sampling=False, batch_multiplier=1.0,
                   max_num_steps=1)
    ppo_train(cfg, reward=parity_reward, prompts=PROMPTS)
    (row,) = [r for r in read_metrics(tmp_path / "run") if r["step"] > 0]
    assert not {"gen_batches", "kept_groups", "discarded_groups", "zero_std_frac", "gen_rewards"} & set(row)


@pytest.mark.slow
def test_ppo_dynamic_sampling_resumes_exactly(policy_dir, tmp_path):
    """The kept groups live within a step: a run resumed after step 1 draws and trains as the
    uninterrupted one."""
    full = make_cfg(PPOConfig, policy_dir, tmp_path / "full", save_period=1)
    ppo_train(full, reward=parity_reward, prompts=PROMPTS)
    part = make_cfg(PPOConfig, policy_dir, tmp_path / "part", save_period=1, max_num_steps=1)
    ppo_train(part, reward=parity_reward, prompts=PROMPTS)
    ppo_train(dataclasses.replace(part, max_num_steps=2), resume=True, reward=parity_reward, prompts=PROMPTS)

    def step2(run):
        (row,) = [r for r in read_metrics(run) if r["step"] == 2]
        return {k: v for k, v in row.items() if k not in ("time_s", "tokens_per_s") and not k.startswith("time/")}

    assert step2(tmp_path / "full") == step2(tmp_path / "part")


@pytest.mark.slow
def test_reinforce_batch_multiplier(policy_dir, tmp_path):
    cfg = make_cfg(ReinforceConfig, policy_dir, tmp_path / "run", batch_multiplier=2.0, max_num_steps=1,
                   save_period=1, adv_estimator="grpo")
    reinforce_train(cfg, reward=parity_reward, prompts=PROMPTS)
    (row,) = [r for r in read_metrics(tmp_path / "run") if r["step"] > 0]
    assert row["kept_groups"] == 4 and "discarded_groups" in row
    state = json.loads((tmp_path / "run/checkpoints/step_1/state.json").read_text())
    assert state["stream"]["consumed_samples"] == 8 * row["gen_batches"]


# --- config ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cls", [PPOConfig, ReinforceConfig])
@pytest.mark.parametrize(
    "values, match",
    [
        ({"dynamic_sampling": True, "num_generations_per_prompt": 1}, "dynamic_sampling needs num_generations"),
        ({"batch_multiplier": 2.0}, "batch_multiplier=2.0 needs dynamic_sampling: true"),
        ({"dynamic_sampling": True, "batch_multiplier": 0.5}, "batch_multiplier must be in"),
        ({"dynamic_sampling": True, "dynamic_sampling_max_gen_batches": 0}, "dynamic_sampling_max_gen_batches"),
        (
            {"dynamic_sampling": True, "batch_multiplier": 1000.0, "num_prompts_per_step": 512,
             "num_generations_per_prompt": 4, "num_minibatches": 1},
            f"must be <= {MAX_ROWS} responses per generation batch",
        ),
    ],
)
def test_config_checks(cls, values, match):
    values = {"num_generations_per_prompt": 2, **values}
    if cls is ReinforceConfig:  # its grouped estimators refuse K = 1 themselves
        values["adv_estimator"] = "none"
    with pytest.raises(ConfigError, match=match):
        config_from_dict(cls, values)
