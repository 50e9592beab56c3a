"""Simulated asynchronous RL (``async_mode: simulated``, ``rlbits.loops.staleness``) on a tiny GPT-2: the
schedule (step t trains on the rows version max(0, t - k) sampled), a reference check against rollouts of
separately kept weights with the same generator draws, k = 0 equal to the synchronous loop, exact resume."""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path

import pytest
import torch
from tensordict import NonTensorStack, TensorDict

from rlbits.distributed.env import DistEnv
from rlbits.loops import ppo, reinforce
from rlbits.loops.config import ConfigError, config_from_dict
from rlbits.loops.metrics import StepMetrics
from rlbits.loops.run import read_metrics
from rlbits.loops.runtime import generator
from rlbits.loops.staleness import RolloutQueue, decode_batch, encode_batch, next_rollouts
from rlbits.models.tiny import tiny_causal_lm, tiny_tokenizer
from tests.metrics_compare import untimed_by_step

V = 32
STALENESS_KEYS = ("staleness/mean", "staleness/max", "staleness/dropped_frac")


def length_reward(prompts, responses):
    return [float(len(r) % 3) for r in responses]


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_policy")
    tiny_causal_lm("gpt2", V, seed=0).save_pretrained(path)
    tiny_tokenizer(V).save_pretrained(path)
    return str(path)


def make_cfg(cls, tiny_path, run_dir, **overrides):
    values = dict(
        task="arithmetic", policy=tiny_path, run_dir=str(run_dir), max_num_steps=3, num_prompts_per_step=2,
        num_generations_per_prompt=2, max_new_tokens=4, microbatch_size=4, learning_rate=1e-2, max_val_samples=2,
        val_period=0, val_at_start=False, val_at_end=False, save_period=0, progress=False, tensorboard=False,
        cpu_threads=1, log_samples=4,
    )
    values.update(overrides)
    return config_from_dict(cls, values)


# --- the schedule, without models ---------------------------------------------------------------------------


@pytest.mark.parametrize("k", [0, 1, 2])
def test_step_t_trains_on_the_batch_version_t_minus_k_produced(k):
    state = type("S", (), {})()
    state.step, state.metrics, state.rollout_queue, state.env = 0, StepMetrics(), RolloutQueue(), DistEnv()
    cfg = type("C", (), {"async_mode": "simulated", "max_staleness": k})()
    made = []

    def produce():
        made.append(state.step)  # the version producing batch len(made) - 1
        state.metrics.mean("gen_rewards", float(len(made)), 1)
        return TensorDict({"action_mask": torch.ones(2, 3, dtype=torch.bool),
                           "index": torch.full((2,), len(made) - 1)}, batch_size=[2])

    for t in range(6):
        state.metrics = StepMetrics()
        batch = next_rollouts(state, cfg, produce)
        assert batch["index"].tolist() == [t, t] and batch["policy_version"].tolist() == [max(0, t - k)] * 2
        assert len(state.rollout_queue) == k and state.rollout_queue.produced == t + k + 1
        logged = state.metrics.reduce(DistEnv())
        assert logged["gen_rewards"] == t + 1  # the statistics of the batch's own production
        assert logged["staleness/max"] == logged["staleness/mean"] == min(t, k)
        assert logged["staleness/dropped_frac"] == 0
        state.step += 1
    assert made == [0] * (k + 1) + list(range(1, 6))


def test_a_batch_older_than_max_staleness_is_dropped_and_counted():
    state = type("S", (), {})()
    state.step, state.metrics, state.rollout_queue, state.env = 5, StepMetrics(), RolloutQueue(), DistEnv()
    old = TensorDict({"action_mask": torch.ones(2, 1, dtype=torch.bool), "policy_version": torch.tensor([2, 2])}, [2])
    state.rollout_queue.pending.append((old, []))
    state.rollout_queue.produced = 6
    cfg = type("C", (), {"async_mode": "simulated", "max_staleness": 1})()  # a resume with a smaller bound

    def produce():
        return TensorDict({"action_mask": torch.ones(2, 1, dtype=torch.bool)}, batch_size=[2])

    batch = next_rollouts(state, cfg, produce)
    assert batch["policy_version"].tolist() == [5, 5]
    assert state.metrics.reduce(DistEnv())["staleness/dropped_frac"] == 0.5


def test_the_saved_queue_loads_bit_exact():
    batch = TensorDict({
        "logprobs": torch.randn(3, 4), "half": torch.randn(3, 2).bfloat16(), "mask": torch.rand(3, 4) > 0.5,
        "ids": torch.randint(0, 99, (3, 5)), "empty": torch.zeros(3, 0),
    }, batch_size=[3])
    batch.set("response_text", NonTensorStack.from_list(["a", "b é", ""]))
    queue = RolloutQueue()
    queue.pending, queue.produced = [(batch, [["num", "x", 1.5], ["den", "x", 2.0]])], 3
    loaded = RolloutQueue()
    loaded.load_state_dict(json.loads(json.dumps(queue.state_dict())))
    (got, rows), = loaded.pending
    assert loaded.produced == 3 and rows == [["num", "x", 1.5], ["den", "x", 2.0]]
    for key in ("logprobs", "half", "mask", "ids", "empty"):
        assert got[key].dtype == batch[key].dtype and torch.equal(got[key], batch[key])
    assert list(got["response_text"]) == ["a", "b é", ""]
    empty = RolloutQueue()
    empty.load_state_dict({"step": 3})  # a checkpoint written without a queue
    assert empty.produced == 0 and not empty.pending
    with pytest.raises(ValueError, match="does not load"):
        decode_batch({"rows": 1, "columns": {"x": {"dtype": "nope", "shape": [1], "data": ""}}})
    assert encode_batch(batch)["rows"] == 3


def test_a_queue_of_shards_resumes_only_at_its_world_size():
    """At world size N every rank's queue holds the N shards of each batch; a checkpoint's queue is refused
    at another world size (each rank would train on another rank's rows) and a malformed one on load."""
    shard = TensorDict({"action_mask": torch.ones(2, 1, dtype=torch.bool), "policy_version": torch.tensor([0, 0])}, [2])
    queue = RolloutQueue()
    queue.pending, queue.produced, queue.shards = [(shard, []), (shard.clone(), [])], 1, 2
    saved = json.loads(json.dumps(queue.state_dict()))
    assert saved["shards"] == 2
    for bad in ({**saved, "shards": 0}, {**saved, "shards": True}, {**saved, "pending": saved["pending"][:1]}):
        with pytest.raises(ValueError, match="rollout queue"):
            RolloutQueue().load_state_dict(bad)
    state = type("S", (), {})()
    state.step, state.metrics, state.rollout_queue, state.env = 0, StepMetrics(), RolloutQueue(), DistEnv()
    state.rollout_queue.load_state_dict(saved)
    cfg = type("C", (), {"async_mode": "simulated", "max_staleness": 1})()
    with pytest.raises(RuntimeError, match="2 shards .* this run has 1 ranks"):
        next_rollouts(state, cfg, lambda: shard)


def test_max_staleness_needs_the_simulated_mode(tiny_path, tmp_path):
    with pytest.raises(ConfigError, match="max_staleness=1 needs async_mode: simulated"):
        make_cfg(reinforce.ReinforceConfig, tiny_path, tmp_path, max_staleness=1)
    with pytest.raises(ConfigError, match="async_mode"):
        make_cfg(reinforce.ReinforceConfig, tiny_path, tmp_path, async_mode="ranks")


# --- the loops ----------------------------------------------------------------------------------------------


def samples_by_step(run_dir: Path) -> dict[int, list[dict]]:
    out: dict[int, list[dict]] = {}
    for line in (Path(run_dir) / "samples.jsonl").read_text().splitlines():
        row = json.loads(line)
        out.setdefault(row["step"], []).append(row)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("k", [1, 2])
def test_rows_trained_at_step_t_are_those_of_the_weights_at_version_t_minus_k(tiny_path, tmp_path, k):
    # decoupled correction: old_logprobs recomputed by the trainer, the sampler's kept in logprobs
    cfg = make_cfg(
        reinforce.ReinforceConfig, tiny_path, tmp_path / "run", async_mode="simulated", max_staleness=k,
        rollout_correction={"mode": "decoupled"}, max_num_steps=4,
    )
    state = reinforce.init_state(cfg, DistEnv(), reward=length_reward)
    weights, trained = [], []

    def produce():
        batch = reinforce.rollout(state, state.stream.next_batch(cfg.num_prompts_per_step), cfg)
        return reinforce.score(state, batch, cfg)

    for _ in range(cfg.max_num_steps):  # the loop's phases, as train() runs them
        state.metrics = StepMetrics()
        weights.append(copy.deepcopy(state.policy.state_dict()))  # version state.step
        batch = next_rollouts(state, cfg, produce)
        trained.append(batch.clone())
        for phase in (reinforce.reference, reinforce.advantages, reinforce.rollout_correction, reinforce.update):
            batch = phase(state, batch, cfg)
        assert not torch.equal(batch["old_logprobs"], batch["logprobs"]) or state.step < k  # stale: they differ
        state.step += 1

    # the reference: a separate copy of the policy at version max(0, t - k), the same prompt and noise draws
    ref = reinforce.init_state(cfg, DistEnv(), reward=length_reward)
    ref.sampling_generator = generator(cfg.seed, 0, "sampling", "cpu")
    for t, rows in enumerate(trained):
        version = max(0, t - k)
        ref.policy.load_state_dict(weights[version])
        want = reinforce.rollout(ref, ref.stream.next_batch(cfg.num_prompts_per_step), cfg)
        assert rows["policy_version"].tolist() == [version] * rows.batch_size[0]
        assert torch.equal(rows["responses"], want["responses"]) and torch.equal(rows["logprobs"], want["logprobs"])
    assert not all(torch.equal(a, b) for a, b in zip(weights[0].values(), weights[-1].values(), strict=True))

    # train() runs that same schedule: the same rows at every step, and the samples log shows the versions
    run_dir = reinforce.train(cfg, reward=length_reward)
    logged = samples_by_step(run_dir)
    for t, rows in enumerate(trained):
        got = logged[t + 1]
        assert [r["policy_version"] for r in got] == [max(0, t - k)] * len(got)
        assert [r["response"] for r in got] == list(rows["response_text"])[: len(got)]
    metrics = read_metrics(run_dir)
    assert [m["staleness/max"] for m in metrics] == [min(t, k) for t in range(cfg.max_num_steps)]
    assert all("rollout_corr/rollout_is_mean" in m for m in metrics)


@pytest.mark.slow
@pytest.mark.parametrize("loop", [reinforce, ppo])
def test_max_staleness_0_is_the_synchronous_loop(tiny_path, tmp_path, loop):
    cls = reinforce.ReinforceConfig if loop is reinforce else ppo.PPOConfig
    sync = loop.train(make_cfg(cls, tiny_path, tmp_path / "sync"), reward=length_reward)
    sim = loop.train(make_cfg(cls, tiny_path, tmp_path / "sim", async_mode="simulated"), reward=length_reward)
    a, b = untimed_by_step(read_metrics(sync)), untimed_by_step(read_metrics(sim))
    assert all(b[s].pop(key) == 0 for s in b for key in STALENESS_KEYS)
    assert a == b
    assert samples_by_step(sync) == samples_by_step(sim)
    assert {r["policy_version"] for rows in samples_by_step(sync).values() for r in rows} == {0, 1, 2}


@pytest.mark.slow
@pytest.mark.parametrize("loop", [reinforce, ppo])
def test_simulated_resume_is_exact(tiny_path, tmp_path, loop):
    # the queue (k batches produced ahead, with their statistics) is saved in the checkpoint
    cls = reinforce.ReinforceConfig if loop is reinforce else ppo.PPOConfig
    opts = dict(async_mode="simulated", max_staleness=2, save_period=2)
    full = loop.train(make_cfg(cls, tiny_path, tmp_path / "a", max_num_steps=4, **opts), reward=length_reward)
    part = make_cfg(cls, tiny_path, tmp_path / "b", max_num_steps=2, **opts)
    loop.train(part, reward=length_reward)
    saved = json.loads((tmp_path / "b" / "checkpoints" / "step_2" / "state.json").read_text())
    assert saved["rollout_queue"]["produced"] == 4 and len(saved["rollout_queue"]["pending"]) == 2
    resumed = loop.train(dataclasses.replace(part, max_num_steps=4), reward=length_reward, resume=True)
    a, b = untimed_by_step(read_metrics(full), 3), untimed_by_step(read_metrics(resumed), 3)
    assert sorted(a) == [3, 4] and a == b
    later = lambda run_dir: {s: v for s, v in samples_by_step(run_dir).items() if s > 2}  # noqa: E731
    assert later(full) == later(resumed) and sorted(later(full)) == [3, 4]
