"""Keeping the best checkpoints (``keep_top_k``, ``metric_name``, ``higher_is_better``): the ranking, the
checkpoints a run keeps (the top k by its logged validation metric, and the newest), ``best.json``, resume."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from rlbits.loops import reinforce
from rlbits.loops.config import config_from_dict
from rlbits.loops.run import BEST_FILE, check_best, rank_best, read_metrics
from rlbits.models.tiny import tiny_causal_lm, tiny_tokenizer

V = 32


def test_rank_best_orders_by_value_then_the_later_step():
    best = []
    for step, value in [(1, 0.5), (2, 0.7), (3, 0.5), (4, 0.2), (5, 0.7)]:
        best = rank_best(best, step, value, 3, higher_is_better=True)
    assert [e["step"] for e in best] == [5, 2, 3]  # 0.7 (later first), 0.7, then the later 0.5
    low = []
    for step, value in [(1, 0.5), (2, 0.7), (3, 0.5), (4, 0.2)]:
        low = rank_best(low, step, value, 2, higher_is_better=False)
    assert [e["step"] for e in low] == [4, 3]
    assert rank_best([{"step": 2, "value": 1.0}], 2, 0.1, 2, True) == [
        {"step": 2, "value": 0.1}
    ]  # a redone step


def test_check_best_refuses_other_shapes():
    assert check_best([{"step": 2, "value": 1}], 3) == [{"step": 2, "value": 1.0}]
    for bad in (
        {"step": 2},
        [{"step": 4, "value": 1.0}],
        [{"step": 1, "value": math.nan}],
        [{"step": True, "value": 1}],
    ):
        with pytest.raises(ValueError, match="best_checkpoints"):
            check_best(bad, 3)


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_policy")
    tiny_causal_lm("gpt2", V, seed=0).save_pretrained(path)
    tiny_tokenizer(V).save_pretrained(path)
    return str(path)


def length_reward(prompts, responses, **_):
    return [(sum(map(ord, r)) % 7) / 6 for r in responses]  # sensitive to every token: values move


def make_cfg(tiny_path, run_dir, **kw):
    values = dict(
        task="arithmetic",
        policy=tiny_path,
        run_dir=str(run_dir),
        max_num_steps=6,
        num_prompts_per_step=4,
        num_generations_per_prompt=2,
        max_new_tokens=6,
        microbatch_size=8,
        learning_rate=5e-2,
        max_val_samples=8,
        val_at_start=True,
        val_period=1,
        save_period=0,
        keep_checkpoints=1,
        keep_top_k=2,
        log_samples=0,
        progress=False,
        tensorboard=False,
    )
    return config_from_dict(reinforce.ReinforceConfig, {**values, **kw})


def kept_steps(run_dir):
    return sorted(int(p.name[5:]) for p in (run_dir / "checkpoints").iterdir() if p.name.startswith("step_"))


def expected_best(run_dir, metric, k, higher):
    """The top k steps by the logged metric (step 0 has no checkpoint), equal values: the later first."""
    values = {r["step"]: r[metric] for r in read_metrics(run_dir) if metric in r and r["step"] > 0}
    sign = -1 if higher else 1
    return sorted(values, key=lambda s: (sign * values[s], -s))[:k], values


@pytest.mark.slow
@pytest.mark.parametrize("metric, higher", [("val_reward", True), ("val_response_len", False)])
def test_a_run_keeps_the_top_k_by_the_metric_and_the_newest(tiny_path, tmp_path, metric, higher):
    cfg = make_cfg(tiny_path, tmp_path / "run", metric_name=metric, higher_is_better=higher)
    run_dir = reinforce.train(cfg, reward=length_reward)
    best, values = expected_best(run_dir, metric, 2, higher)
    assert len(values) == 6 and len(set(values.values())) >= 3  # validated after every step; values differ
    assert kept_steps(run_dir) == sorted({*best, 6})
    record = json.loads((run_dir / BEST_FILE).read_text())
    assert record["metric_name"] == metric and record["keep_top_k"] == 2
    assert [e["step"] for e in record["best"]] == best
    assert [e["value"] for e in record["best"]] == [values[s] for s in best]
    assert all((run_dir / e["checkpoint"]).is_dir() for e in record["best"])


@pytest.mark.slow
def test_without_keep_top_k_only_the_newest_are_kept(tiny_path, tmp_path):
    run_dir = reinforce.train(
        make_cfg(tiny_path, tmp_path / "run", keep_top_k=None, max_num_steps=3), reward=length_reward
    )
    assert kept_steps(run_dir) == [3] and not (run_dir / BEST_FILE).exists()


@pytest.mark.slow
def test_a_metric_validation_does_not_log_is_an_error(tiny_path, tmp_path):
    with pytest.raises(ValueError, match="metric_name .val_accuracy.*val_reward"):
        reinforce.train(
            make_cfg(tiny_path, tmp_path / "run", metric_name="val_accuracy", max_num_steps=1),
            reward=length_reward,
        )
    assert not (tmp_path / "run" / "checkpoints").exists()  # refused at the validation before the first step


@pytest.mark.slow
def test_resume_keeps_the_bookkeeping(tiny_path, tmp_path):
    class StopAfterThree:
        def __init__(self):
            self.steps = []

        def on_metrics(self, step, metrics):
            self.steps.append(step)

        def should_stop(self):
            return bool(self.steps) and self.steps[-1] >= 3

    full = reinforce.train(make_cfg(tiny_path, tmp_path / "a"), reward=length_reward)
    part = make_cfg(tiny_path, tmp_path / "b")
    reinforce.train(part, reward=length_reward, callbacks=[StopAfterThree()])
    assert kept_steps(tmp_path / "b")[-1] == 3
    resumed = reinforce.train(dataclasses.replace(part), reward=length_reward, resume=True)
    assert kept_steps(resumed) == kept_steps(full)
    assert json.loads((resumed / BEST_FILE).read_text()) == json.loads((full / BEST_FILE).read_text())
    best, _ = expected_best(full, "val_reward", 2, True)
    assert [e["step"] for e in json.loads((full / BEST_FILE).read_text())["best"]] == best
