"""User prompts: checked up front (naming the user's index), held-out val_prompts, and the run's provenance
(what it was started with, checked on resume)."""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path

import pytest
from metrics_compare import untimed_by_step

import rlbits
from rlbits.data.stream import PromptError, check_prompt_lengths, check_prompts, read_prompts
from rlbits.loops import ilql, ppo, reinforce
from rlbits.loops.provenance import (
    PROVENANCE_FILE,
    ResumeMismatchError,
    check_resume,
    describe_prompts,
    describe_reward,
    read_provenance,
    write_provenance,
)
from rlbits.loops.run import read_metrics
from rlbits.models.tiny import tiny_causal_lm, tiny_tokenizer

V = 32
PROMPTS = ["1+2=", "3+4=", "5+6=", "7+8=", "9+1=", "2+3=", "4+5=", "6+7="]  # in the tiny tokenizer's vocabulary
VAL = ["9*9=", "8*7="]


def reward(prompts, responses):
    """Scores validation prompts 1 and train prompts 0, so val_reward shows which prompts validation used."""
    return [1.0 if "*" in p else 0.0 for p in prompts]


def other_reward(prompts, responses):
    return [0.5 for _ in prompts]


def scaled(prompts, responses, k=1.0):
    return [k for _ in prompts]


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_policy")
    tiny_causal_lm("gpt2", V, seed=0).save_pretrained(path)
    tiny_tokenizer(V).save_pretrained(path)
    return str(path)


def make_cfg(tiny_path, run_dir, **overrides):
    kw = dict(
        task="arithmetic", policy=tiny_path, run_dir=str(run_dir), max_num_steps=2, num_prompts_per_step=2,
        num_generations_per_prompt=2, max_new_tokens=4, microbatch_size=4, learning_rate=1e-3,
        max_val_samples=4, val_period=0, val_at_start=False, val_at_end=False, save_period=1, progress=False,
        tensorboard=False, log_samples=1,
    )
    kw.update(overrides)
    return reinforce.ReinforceConfig(**kw)


# --- check_prompts: the up-front checks ------------------------------------------------------------------

BAD = [
    ("The movie was", "prompts is a single string .*pass a list of prompts"),
    (["ok", 3, "fine"], r"prompt 2 of your prompts is not a string: 3 \(int\)"),
    (["the plot", "a film", ""], "prompt 3 of your prompts is empty"),
    (["the plot", "   "], r"prompt 2 of your prompts is empty \(whitespace only\)"),
    ([], "prompts is an empty list"),
    (42, "prompts must be a list of strings, got int"),
]


@pytest.mark.parametrize("prompts, match", BAD)
def test_check_prompts(prompts, match):
    with pytest.raises(PromptError, match=match):
        check_prompts(prompts)
    assert issubclass(PromptError, ValueError)


def test_check_prompts_names_the_argument_and_returns_a_list():
    with pytest.raises(PromptError, match="prompt 1 of your val_prompts is empty"):
        check_prompts([""], "val_prompts")
    assert check_prompts(("a", "b")) == ["a", "b"]


def test_read_prompts(tmp_path):
    (tmp_path / "p.txt").write_text("first prompt\n\nsecond prompt\n")
    (tmp_path / "p.jsonl").write_text('{"prompt": "x y"}\n{"prompt": "z", "other": 1}\n')
    assert read_prompts(tmp_path / "p.txt") == ["first prompt", "second prompt"]
    assert read_prompts(tmp_path / "p.jsonl") == ["x y", "z"]
    (tmp_path / "bad.jsonl").write_text('{"prompt": "x"}\n{"text": "y"}\n')
    with pytest.raises(PromptError, match="line 2"):
        read_prompts(tmp_path / "bad.jsonl")
    (tmp_path / "empty.txt").write_text("\n\n")
    with pytest.raises(PromptError, match="empty list"):
        read_prompts(tmp_path / "empty.txt")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        read_prompts(tmp_path / "missing.txt")


def test_check_prompt_lengths():
    tok = tiny_tokenizer(V)
    n = check_prompt_lengths(["ab", "abcd"], tok, max_new_tokens=4, max_positions=128)
    assert n == len(tok("abcd", add_special_tokens=False)["input_ids"])
    with pytest.raises(PromptError, match="prompt 2 of your prompts has .* tokens.*context of 128"):
        check_prompt_lengths(["ab", "word " * 100], tok, max_new_tokens=4, max_positions=128)
    assert check_prompt_lengths(["word " * 100], tok, max_new_tokens=4, max_positions=None) > 128


def test_api_checks_prompts_before_anything(tmp_path):
    # rlbits.train checks before resolving the config or loading a model: no run directory appears
    for prompts, match in BAD[:5]:
        with pytest.raises(PromptError, match=match):
            rlbits.train(reward_fn=reward, prompts=prompts, run_dir=str(tmp_path / "run"))
    with pytest.raises(PromptError, match="prompt 1 of your val_prompts is empty"):
        rlbits.train(reward_fn=reward, prompts=PROMPTS, val_prompts=[" "], run_dir=str(tmp_path / "run"))
    assert not (tmp_path / "run").exists()


# --- provenance, without training ------------------------------------------------------------------------


def test_describe_reward():
    assert describe_reward(None, "sentiment") == {"kind": "task", "name": "sentiment"}
    assert describe_reward("http://localhost:8000", "x") == {"kind": "url", "name": "http://localhost:8000"}
    d = describe_reward(reward, "x")
    assert d["kind"] == "callable" and d["name"] == f"{__name__}.reward" and len(d["sha256"]) == 64
    assert describe_reward(other_reward, "x")["sha256"] != d["sha256"]

    class Scorer:
        def __call__(self, prompts, responses):
            return [0.0] * len(prompts)

    assert describe_reward(Scorer(), "x")["name"].endswith("test_describe_reward.<locals>.Scorer")
    half, third = functools.partial(scaled, k=0.5), functools.partial(scaled, k=0.3)
    assert describe_reward(half, "x")["name"] == f"functools.partial({__name__}.scaled, ...)"
    assert describe_reward(half, "x") != describe_reward(third, "x")
    assert describe_reward(half, "x") == describe_reward(functools.partial(scaled, k=0.5), "x")


def test_check_resume(tmp_path):
    start = {"reward": describe_reward(reward, "arithmetic"), "prompts": describe_prompts(PROMPTS, "custom"),
             "val_prompts": describe_prompts(VAL, "custom")}
    write_provenance(tmp_path, start)
    assert read_provenance(tmp_path) == start
    check_resume(tmp_path, dict(start))  # the same: goes on
    cli = {**start, "reward": describe_reward(None, "arithmetic"), "prompts": describe_prompts(["1+1="], "task:arithmetic/train")}
    with pytest.raises(ResumeMismatchError) as e:
        check_resume(tmp_path, cli)
    msg = str(e.value)
    assert "\n" not in msg and isinstance(e.value, ValueError)
    assert f"reward {__name__}.reward and 8 custom prompts" in msg
    assert "same reward_fn=, prompts=" in msg and "allow_changed_inputs=True" in msg
    with pytest.warns(UserWarning, match="resuming with changed inputs"):
        check_resume(tmp_path, cli, allow_changed=True)
    with pytest.warns(UserWarning, match="no provenance.json"):
        check_resume(tmp_path / "old_run", cli)


# --- each bad input, through each loop's train(): the error comes before training -----------------------


def no_training_output(run_dir: Path) -> bool:
    return not (run_dir / "checkpoints").exists() and not (run_dir / "metrics.jsonl").exists()


def loop_cfg(loop, tiny_path, run_dir):
    if loop == "reinforce":
        return make_cfg(tiny_path, run_dir)
    common = dict(
        task="arithmetic", policy=tiny_path, run_dir=str(run_dir), max_num_steps=2, max_new_tokens=4,
        max_val_samples=4, val_period=0, val_at_start=False, val_at_end=False, save_period=1, progress=False,
        tensorboard=False,
    )
    if loop == "ppo":
        return ppo.PPOConfig(num_prompts_per_step=2, microbatch_size=4, **common)
    return ilql.ILQLConfig(batch_size=4, **common)


@pytest.mark.slow
@pytest.mark.parametrize("loop", ["reinforce", "ppo", "ilql"])
@pytest.mark.parametrize("prompts, match", BAD[:5] + [(PROMPTS[:3] + ["word " * 200], "prompt 4 of your prompts has")])
def test_bad_prompts_fail_before_training(tiny_path, tmp_path, loop, prompts, match):
    module = {"reinforce": reinforce, "ppo": ppo, "ilql": ilql}[loop]
    with pytest.raises(PromptError, match=match):
        module.train(loop_cfg(loop, tiny_path, tmp_path / "run"), reward=reward, prompts=prompts)
    assert no_training_output(tmp_path / "run")


@pytest.mark.slow
def test_bad_val_prompts_fail_before_training(tiny_path, tmp_path):
    cfg = make_cfg(tiny_path, tmp_path / "run")
    with pytest.raises(PromptError, match="val_prompts is a single string"):
        reinforce.train(cfg, reward=reward, prompts=PROMPTS, val_prompts="held out")
    with pytest.raises(PromptError, match="prompt 2 of your val_prompts has .* tokens"):
        reinforce.train(cfg, reward=reward, prompts=PROMPTS, val_prompts=["ok", "word " * 200])
    (tmp_path / "val.txt").write_text("ok\n")
    (tmp_path / "val.jsonl").write_text('{"prompt": ""}\n')
    with pytest.raises(PromptError, match=r"prompt 1 of your val_prompts \(from val.jsonl\) is empty"):
        reinforce.train(dataclasses.replace(cfg, val_prompts=str(tmp_path / "val.jsonl")), reward=reward)
    assert no_training_output(tmp_path / "run")


# --- val_prompts are what validation scores --------------------------------------------------------------


@pytest.mark.slow
def test_val_prompts_are_validated_on(tiny_path, tmp_path):
    opts = dict(max_num_steps=1, val_at_start=True, val_at_end=True)
    run = reinforce.train(make_cfg(tiny_path, tmp_path / "a", **opts), reward=reward, prompts=PROMPTS, val_prompts=VAL)
    rows = read_metrics(run)
    assert [r["val_reward"] for r in rows] == [1.0, 1.0] and rows[1]["rewards"] == 0.0
    samples = [json.loads(line) for line in (Path(run) / "samples.jsonl").read_text().splitlines()]
    assert {s["prompt"] for s in samples if s.get("split") == "test"} <= set(VAL)
    # the default is unchanged: the task's test split (the reward gives it 0)
    run = reinforce.train(make_cfg(tiny_path, tmp_path / "b", **opts), reward=reward, prompts=PROMPTS)
    assert [r["val_reward"] for r in read_metrics(run)] == [0.0, 0.0]
    # from the config: a file of prompts
    (tmp_path / "val.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in VAL))
    cfg = make_cfg(tiny_path, tmp_path / "c", val_prompts=str(tmp_path / "val.jsonl"), **opts)
    run = rlbits.train(reward_fn=reward, prompts=PROMPTS, config=cfg)
    assert [r["val_reward"] for r in read_metrics(run)] == [1.0, 1.0]
    assert read_provenance(run)["val_prompts"]["count"] == 2


# --- provenance round trip -------------------------------------------------------------------------------


def comparable(run_dir):
    return untimed_by_step(read_metrics(run_dir))


@pytest.mark.slow
def test_resume_with_the_same_inputs_continues_exactly(tiny_path, tmp_path):
    kw = dict(reward=reward, prompts=PROMPTS, val_prompts=VAL)
    full = reinforce.train(make_cfg(tiny_path, tmp_path / "a", max_num_steps=3), **kw)
    part = make_cfg(tiny_path, tmp_path / "b")
    reinforce.train(part, **kw)
    record = read_provenance(part.run_dir)
    assert record["reward"]["name"] == f"{__name__}.reward"
    assert record["prompts"]["count"] == 8 and record["val_prompts"]["count"] == 2 and "samples" not in record
    resumed = reinforce.train(dataclasses.replace(part, max_num_steps=3), resume=True, **kw)
    assert comparable(full) == comparable(resumed)
    assert read_provenance(resumed) == record  # a resume does not rewrite the record


@pytest.mark.slow
def test_resume_with_other_inputs_is_refused(tiny_path, tmp_path):
    part = make_cfg(tiny_path, tmp_path / "run")
    reinforce.train(part, reward=reward, prompts=PROMPTS)
    more = dataclasses.replace(part, max_num_steps=3)
    checkpoints = sorted(p.name for p in (Path(part.run_dir) / "checkpoints").iterdir())
    # as from the CLI (`rlbits train --resume RUN_DIR`): the task's reward and prompts
    with pytest.raises(ResumeMismatchError, match=f"started with reward {__name__}.reward and 8 custom prompts"):
        rlbits.train(config=more, resume=True)
    with pytest.raises(ResumeMismatchError, match="reward_fn="):
        reinforce.train(more, reward=other_reward, prompts=PROMPTS, resume=True)
    with pytest.raises(ResumeMismatchError, match="7 custom prompts.*same prompts="):
        reinforce.train(more, reward=reward, prompts=PROMPTS[:7], resume=True)
    with pytest.raises(ResumeMismatchError, match="2 custom validation prompts"):
        reinforce.train(more, reward=reward, prompts=PROMPTS, val_prompts=VAL, resume=True)
    assert sorted(p.name for p in (Path(part.run_dir) / "checkpoints").iterdir()) == checkpoints
    assert [r["step"] for r in read_metrics(part.run_dir)] == [1, 2]
    # the override: the run goes on with the new reward
    with pytest.warns(UserWarning, match="resuming with changed inputs"):
        run = rlbits.train(reward_fn=other_reward, prompts=PROMPTS, config=more, resume=True, allow_changed_inputs=True)
    assert [r["step"] for r in read_metrics(run)] == [1, 2, 3] and read_metrics(run)[-1]["rewards"] == 0.5


@pytest.mark.slow
def test_ilql_resume_checks_samples(tiny_path, tmp_path):
    samples = [(p, " a b", float(i % 2)) for i, p in enumerate(PROMPTS)]
    cfg = ilql.ILQLConfig(
        task="arithmetic", policy=tiny_path, run_dir=str(tmp_path / "run"), max_num_steps=1, batch_size=4,
        max_new_tokens=4, max_val_samples=2, val_period=0, val_at_start=False, val_at_end=False,
        progress=False, tensorboard=False,
    )
    ilql.train(cfg, reward=reward, samples=samples)
    assert read_provenance(cfg.run_dir)["samples"]["count"] == 8
    more = dataclasses.replace(cfg, max_num_steps=2)
    with pytest.raises(ResumeMismatchError, match="8 offline samples.*7 offline samples"):
        ilql.train(more, reward=reward, samples=samples[:7], resume=True)
    ilql.train(more, reward=reward, resume=True)  # samples left out: the offline set is read back
    assert [r["step"] for r in read_metrics(cfg.run_dir)][-1] == 2
    assert (Path(cfg.run_dir) / PROVENANCE_FILE).is_file()


@pytest.mark.slow
def test_a_fresh_run_into_an_existing_run_keeps_its_record(tiny_path, tmp_path):
    cfg = make_cfg(tiny_path, tmp_path / "run", max_num_steps=1)
    reinforce.train(cfg, reward=reward, prompts=PROMPTS)
    record = read_provenance(cfg.run_dir)
    with pytest.raises(FileExistsError):
        reinforce.train(cfg, reward=other_reward, prompts=PROMPTS[:4])
    assert read_provenance(cfg.run_dir) == record
