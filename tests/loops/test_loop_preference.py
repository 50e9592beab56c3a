"""Preference loop: pairs from ranked groups, the loss against ``dpo_loss`` on hand-made log-probabilities,
offline and online smoke runs with validation metrics, exact resume, LoRA, config errors."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from metrics_compare import untimed_by_step
from tensordict import TensorDict

import rlbits
from rlbits.loops import preference
from rlbits.loops.config import ConfigError, config_from_dict, load_config
from rlbits.loops.optim import cosine_annealing_lr
from rlbits.loops.preference import PreferenceConfig, pair_rows, stack_pairs, train
from rlbits.loops.run import read_metrics
from rlbits.models.tiny import tiny_causal_lm, tiny_tokenizer

V = 32
PAIR_METRICS = {"rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins"}


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
        num_generations_per_prompt=3,
        num_pair_prompts=16,
        max_new_tokens=5,
        microbatch_size=3,
        learning_rate=1e-3,
        max_val_samples=8,
        progress=False,
        tensorboard=False,
    )
    kw.update(overrides)
    return PreferenceConfig(**kw)


# --- pairs and the loss on hand-made tensors -----------------------------------------------------------


def test_pair_rows_best_vs_worst_and_ties_skipped():
    rewards = torch.tensor([0.0, 1.0, 0.5, 2.0, 2.0, 2.0, 1.0, 0.0, 1.0])
    chosen, rejected = pair_rows(rewards, 3)
    assert chosen.tolist() == [1, 6] and rejected.tolist() == [0, 7]  # group 1 is a tie; first best / worst


def test_stack_pairs_and_loss_equal_dpo_loss():
    b, r = 4, 3
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 0]], dtype=torch.bool)
    flat = TensorDict(
        {
            "responses": torch.arange(b * r).view(b, r),
            "action_mask": mask,
            "rewards": torch.tensor([1.0, 0, 0, 1]),
        },
        batch_size=[b],
    )
    pairs = stack_pairs(flat, torch.tensor([0, 3]), torch.tensor([1, 2]))
    assert pairs.batch_size == torch.Size([2, 2]) and pairs["responses"][1, 1].tolist() == [6, 7, 8]
    cfg = PreferenceConfig(loss_type="ipo", beta=0.2)
    logps = torch.tensor([[-1.0, -2.0], [-0.5, -3.0]])
    pairs["ref_logps"] = torch.tensor([[-1.5, -1.5], [-1.0, -1.0]])
    loss, metrics = preference.loss_of(logps, pairs, cfg)
    h = logps - pairs["ref_logps"]
    lengths = pairs["action_mask"].sum(-1)
    want, want_m = rlbits.dpo_loss(
        h[:, 0], h[:, 1], 0.2, "ipo", chosen_lengths=lengths[:, 0], rejected_lengths=lengths[:, 1]
    )
    torch.testing.assert_close(loss, want)
    assert {k: v.item() for k, v in metrics.items() if k in want_m} == {
        k: v.item() for k, v in want_m.items()
    }
    assert metrics["logps/chosen"].item() == pytest.approx(-0.75)


# --- runs ----------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_offline_run_from_task_pairs(tiny_path, tmp_path):
    run_dir = train(make_cfg(tiny_path, tmp_path), reward=length_reward)
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [0, 1, 2]
    val = {f"val_{k}" for k in PAIR_METRICS} | {"val_loss", "val_reward"}
    assert val <= rows[0].keys() and val <= rows[2].keys()
    assert rows[0]["val_rewards/margins"] == 0.0 and rows[0]["val_loss"] == pytest.approx(0.6931472, abs=1e-6)
    assert (
        PAIR_METRICS | {"loss", "grad_norm", "logps/chosen", "dataset/pairs", "dataset/tie_frac"}
        <= rows[1].keys()
    )
    pairs = [json.loads(ln) for ln in (run_dir / "pairs.jsonl").read_text().splitlines()]
    assert len(pairs) == rows[1]["dataset/pairs"] and all(
        p["chosen_reward"] > p["rejected_reward"] for p in pairs
    )
    assert "pairs" in json.loads((run_dir / "provenance.json").read_text())
    assert (run_dir / "final" / "config.json").exists()


@pytest.mark.slow
def test_offline_run_from_a_pairs_file(tiny_path, tmp_path):
    path = tmp_path / "pairs.jsonl"
    rows = [{"prompt": f"{i}+1=", "chosen": str(i + 1), "rejected": str(i)} for i in range(10, 40)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = make_cfg(tiny_path, tmp_path, dataset=str(path), loss_type="robust", label_smoothing=0.1)
    metrics = read_metrics(train(cfg))
    assert "val_rewards/accuracies" in metrics[-1] and "val_reward" not in metrics[-1]  # no task sampling
    assert (
        metrics[0]["val_rewards/margins"] == 0.0 and metrics[-1]["val_rewards/margins"] != 0.0
    )  # 3 held out


@pytest.mark.slow
def test_online_run(tiny_path, tmp_path):
    rows = read_metrics(
        train(make_cfg(tiny_path, tmp_path, online=True, loss_type="simpo"), reward=length_reward)
    )
    assert {"pairs", "tie_frac", "gen_rewards", "loss", *PAIR_METRICS} <= rows[1].keys()
    assert "val_reward" in rows[2] and "val_loss" not in rows[2]
    assert 1 <= rows[1]["pairs"] <= 4


@pytest.mark.slow
def test_online_run_follows_the_learning_rate_schedule(tiny_path, tmp_path):
    cfg = make_cfg(tiny_path, tmp_path, online=True, max_num_steps=3, lr_scheduler="cosine_annealing", min_lr=1e-4)
    logged = {r["step"]: r["lr"] for r in read_metrics(train(cfg, reward=length_reward)) if "lr" in r}
    want = {s: cosine_annealing_lr(s - 1, lr=1e-3, t_max=3, min_lr=1e-4) for s in (1, 2, 3)}  # one update a step
    assert logged.keys() == want.keys() and all(logged[s] == pytest.approx(want[s], rel=1e-9) for s in want)


@pytest.mark.slow
@pytest.mark.parametrize("online", [False, True])
def test_exact_resume(tiny_path, tmp_path, online):
    opts = dict(online=online, save_period=2, val_at_start=False, val_period=0, lora_rank=4)
    full = train(make_cfg(tiny_path, tmp_path / "a", max_num_steps=4, **opts), reward=length_reward)
    part = make_cfg(tiny_path, tmp_path / "b", max_num_steps=2, **opts)
    train(part, reward=length_reward)
    resumed = train(dataclasses.replace(part, max_num_steps=4), reward=length_reward, resume=True)
    a, b = untimed_by_step(read_metrics(full), 3), untimed_by_step(read_metrics(resumed), 3)
    assert sorted(a) == [3, 4] and a == b


@pytest.mark.slow
def test_cli_loop_override(tiny_path, tmp_path):
    """``rlbits train loop=preference ...`` picks this loop's config."""
    run_dir = rlbits.train(
        length_reward,
        config=None,
        loop="preference",
        task="arithmetic",
        policy=tiny_path,
        run_dir=str(tmp_path / "cli"),
        max_num_steps=1,
        num_prompts_per_step=2,
        num_pair_prompts=8,
        num_generations_per_prompt=3,
        max_new_tokens=4,
        max_val_samples=4,
        progress=False,
        tensorboard=False,
    )
    assert read_metrics(run_dir)[-1]["step"] == 1


# --- config errors --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "values, match",
    [
        ({"loss_type": "dpo"}, "loss_type must be one of"),
        ({"beta": 0.0}, "beta"),
        ({"label_smoothing": 0.1, "loss_type": "hinge"}, "no effect with loss_type='hinge'"),
        ({"label_smoothing": 0.5, "loss_type": "robust"}, "label_smoothing"),
        ({"num_generations_per_prompt": 1}, "num_generations_per_prompt must be >= 2"),
        ({"online": True, "dataset": "x.jsonl"}, "remove dataset"),
        ({"val_dataset": "v.jsonl"}, "val_dataset needs a dataset"),
        ({"dataset": "pairs.txt"}, "must be a .jsonl or .csv"),
        ({"loop": "reinforce"}, "loop must be 'preference'"),
        ({"kl_coef": 0.1}, "kl_coef"),
    ],
)
def test_config_errors(values, match):
    with pytest.raises(ConfigError, match=match):
        config_from_dict(PreferenceConfig, values)


def test_labelled_file_is_refused(tmp_path):
    path = tmp_path / "labels.jsonl"
    path.write_text("".join(json.dumps({"text": f"t{i}", "label": i % 2}) + "\n" for i in range(20)))
    with pytest.raises(ConfigError, match="needs pairs"):
        preference.load_pairs(PreferenceConfig(dataset=str(path)))


@pytest.mark.parametrize("name", ["dpo_arithmetic.yaml", "online_dpo_arithmetic.yaml"])
def test_shipped_configs_load(name):
    cfg = load_config(PreferenceConfig, Path(__file__).resolve().parents[2] / "configs" / name)
    assert cfg.task == "arithmetic" and cfg.val_greedy and cfg.loop == "preference"
