"""The notebook dashboard driven headless: metrics extend its curves, samples fill its table, and clicking
Stop during a tiny ``rlbits.train`` run ends the run after the current step with a checkpoint."""

from __future__ import annotations

import time

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402

import rlbits  # noqa: E402
from rlbits.loops.run import read_metrics  # noqa: E402
from rlbits.models.load import save_pretrained  # noqa: E402
from rlbits.models.tiny import tiny_causal_lm, tiny_tokenizer  # noqa: E402
from rlbits.viz import Dashboard  # noqa: E402

PROMPTS = ["the plot", "a film", "it was", "my day", "so this", "hello", "we saw", "an end"]


def reward(prompts, responses):
    return [min(r.count("a"), 4) / 4 for r in responses]


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("dash") / "policy"
    save_pretrained(tiny_causal_lm("gpt2", seed=0), tiny_tokenizer(), path)
    return str(path)


def tiny_run(policy_dir, run_dir, **overrides):
    config = dict(loop="ppo", policy=policy_dir, run_dir=str(run_dir), max_num_steps=6, num_prompts_per_step=4,
                  max_new_tokens=5, microbatch_size=4, ppo_epochs=1, num_minibatches=1, val_period=0,
                  val_at_start=False, val_at_end=False, save_period=0, log_samples=2, progress=False,
                  tensorboard=False)
    config.update(overrides)
    return dict(reward_fn=reward, prompts=PROMPTS, config=config)


def test_metrics_extend_the_curves_and_the_status():
    dash = Dashboard()
    dash.on_metrics(1, {"rewards": 0.5, "init_policy_kl": 0.0, "actor_loss": -0.2, "time/step": 1.0})
    dash.on_metrics(2, {"rewards": 0.75, "init_policy_kl": 0.1, "actor_loss": -0.1, "val_reward": 0.6})
    assert dash.lines() == {
        "rewards": ([1, 2], [0.5, 0.75]),
        "init_policy_kl": ([1, 2], [0.0, 0.1]),
        "actor_loss": ([1, 2], [-0.2, -0.1]),
        "val_reward": ([2], [0.6]),
    }
    axes = {ax.get_title(): ax for ax in dash.figure.axes}
    assert [ln.get_label() for ln in axes["reward"].get_lines()] == ["rewards", "val_reward"]
    assert axes["reward"].get_ylim()[1] >= 0.75  # rescaled to the new data
    assert "step 2" in dash.status.value and "0.75" in dash.status.value
    assert dash.image.value[:8] == b"\x89PNG\r\n\x1a\n"  # rendered into the image widget
    assert [h["step"] for h in dash.history] == [1, 2]


def test_samples_fill_the_table_escaped():
    dash = Dashboard(max_samples=2)
    dash.on_samples(3, [{"prompt": "a<b", "response": " fine", "reward": 0.123456}, {"prompt": "c", "response": "d"},
                        {"prompt": "dropped", "response": "x"}])
    assert [row["step"] for row in dash.samples] == [3, 3]
    html = dash.table.value
    assert "a&lt;b" in html and "0.1235" in html and "dropped" not in html
    dash.on_samples(4, [{"prompt": "new", "response": "y"}])
    assert "new" in dash.table.value and "a&lt;b" not in dash.table.value


def test_stop_button_sets_should_stop():
    dash = Dashboard()
    assert not dash.should_stop()
    dash.button.click()
    assert dash.should_stop() and dash.button.disabled


@pytest.mark.slow
def test_clicking_stop_during_a_run_ends_it_after_the_step_with_a_checkpoint(policy_dir, tmp_path):
    class ClickAfterFirstStep:
        def __init__(self, dash):
            self.dash = dash

        def on_metrics(self, step, metrics):
            if step == 1:
                self.dash.button.click()

    dash = Dashboard()
    run_dir = rlbits.train(
        **tiny_run(policy_dir, tmp_path / "run"), callbacks=[dash, ClickAfterFirstStep(dash)]
    )
    # clicked while step 1 was logging: step 1 is the last one, checkpointed
    assert [r["step"] for r in read_metrics(run_dir)] == [1]
    assert [p.name for p in (run_dir / "checkpoints").iterdir()] == ["step_1"]
    assert dash.lines()["rewards"][0] == [1]
    assert dash.lines()["rewards"][1] == [r["rewards"] for r in read_metrics(run_dir)]
    assert len(dash.samples) == 2 and dash.samples[0]["prompt"] in PROMPTS


@pytest.mark.slow
def test_background_run_stops_cleanly_on_a_click(policy_dir, tmp_path):
    dash = Dashboard()
    thread = dash.train(**tiny_run(policy_dir, tmp_path / "run", max_num_steps=1000))
    deadline = time.monotonic() + 120
    while not dash.history and time.monotonic() < deadline:
        time.sleep(0.05)
    assert dash.history, "no step finished within 120 s"
    dash.button.click()
    run_dir = dash.wait(timeout=120)
    assert not thread.is_alive()
    steps = [r["step"] for r in read_metrics(run_dir)]
    assert 1 <= len(steps) < 1000 and steps == list(range(1, len(steps) + 1))
    assert [p.name for p in (run_dir / "checkpoints").iterdir()] == [f"step_{steps[-1]}"]
    assert dash.lines()["rewards"][0] == steps
    with pytest.raises(RuntimeError, match="already following"):
        dash._thread = thread  # a finished thread does not block a new run ...
        thread.join()
        dash._thread = type("Alive", (), {"is_alive": lambda self: True})()  # ... a live one does
        dash.train(**tiny_run(policy_dir, tmp_path / "run2"))


@pytest.mark.slow
def test_background_errors_are_shown_and_re_raised(tmp_path):
    dash = Dashboard()
    dash.train(config={"loop": "ppo", "run_dir": str(tmp_path / "r"), "policy": str(tmp_path / "missing")})
    with pytest.raises(Exception, match="missing"):
        dash.wait(timeout=60)
    assert "failed" in dash.status.value
