"""The command line end to end on a tiny model: train, resume, eval, plot, and clear errors."""

from __future__ import annotations

import json

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
    assert capsys.readouterr().out.strip().splitlines()[-1] == str(run_dir)
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


def test_config_errors_exit_2_with_the_field_named(policy_dir, tmp_path, capsys):
    assert main(["train", f"run_dir={tmp_path / 'r'}", "sede=1"]) == 2
    assert "unknown config key 'sede'" in capsys.readouterr().err
    assert main(["train", "configs/ppo_sentiment.yaml", "max_new_tokens=zero"]) == 2
    assert "max_new_tokens must be int" in capsys.readouterr().err
    with pytest.raises(FileNotFoundError, match="is not a run directory|does not exist"):
        main(["eval", str(tmp_path / "nothing")])
