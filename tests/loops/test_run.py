"""``rlbits.loops.run.Run``: the lifecycle every loop shares, driven here by a small loop of its own, and the
phase contract of every loop (``phase(state, batch, cfg) -> batch``)."""

from __future__ import annotations

import dataclasses
import inspect
import json

import pytest
import torch
from tensordict import TensorDict

from rlbits.data.stream import PromptStream
from rlbits.distributed.checkpoint import list_checkpoints
from rlbits.loops import ilql, ppo, reinforce, reward_model
from rlbits.loops.config import PolicyConfig, RunConfig
from rlbits.loops.provenance import ResumeMismatchError
from rlbits.loops.run import Run, read_metrics, total_steps
from rlbits.loops.state import LoopState, StreamState, optimizer_of
from rlbits.models.load import load_policy
from rlbits.models.tiny import tiny_causal_lm, tiny_tokenizer

# --- total_steps ------------------------------------------------------------------------------------------


def test_total_steps_rounds_the_last_pass_up_and_caps_at_max_num_steps():
    cfg = RunConfig(max_num_steps=100, max_num_epochs=2)
    assert total_steps(cfg, 8, 4) == 4
    assert total_steps(cfg, 10, 4) == 5  # ceil(2 * 10 / 4): every sample seen twice
    assert total_steps(cfg, 24, 16) == 3
    assert total_steps(RunConfig(max_num_steps=3, max_num_epochs=2), 100, 4) == 3
    assert total_steps(RunConfig(max_num_epochs=1), 1, 64) == 1
    assert total_steps(cfg, None, 4) == 100  # no epochs: max_num_steps
    with pytest.raises(ValueError, match="samples_per_step must be >= 1"):
        total_steps(cfg, 8, 0)


# --- a small loop of its own ------------------------------------------------------------------------------


@dataclasses.dataclass(kw_only=True)
class CountingState(StreamState):
    """A loop that nudges a tiny LM's weights and 'trains' on prompts of 3 tokens each (its epochs and
    length are its stream's: ``StreamState``)."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer = optimizer_of("model")

    @property
    def trained_model(self) -> torch.nn.Module:
        return self.model

    def samples_per_step(self, cfg):
        return 4


def take(state, batch, cfg):
    rows = state.stream.next(4)
    return TensorDict({"action_mask": torch.ones(len(rows), 3, dtype=torch.bool)}, batch_size=[len(rows)])


def nudge(state, batch, cfg):
    with torch.no_grad():
        next(state.model.parameters()).add_(0.01)
    state.metrics.same("loss", 1.0)
    return batch


def validate(state, batch, cfg):
    state.metrics.same("val_reward", float(state.step))
    return batch


def run_small(run_dir, *, resume=False, record=None, **overrides):
    settings = dict(
        max_num_steps=10, max_num_epochs=1, save_period=2, progress=False, tensorboard=False, log_samples=0
    )
    cfg = RunConfig(run_dir=str(run_dir), **{**settings, **overrides})
    with Run(cfg, resume=resume) as run:
        run.record_provenance(record or {"loop": cfg.loop, "samples": {"count": 10, "sha256": "a"}})
        model = tiny_causal_lm("gpt2", 32, seed=0)
        state = CountingState(
            env=run.env, tokenizer=tiny_tokenizer(32), model=model, stream=PromptStream(list(range(10)), seed=0),
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        )
        with run.timed("setup"):
            pass
        assert run.elapsed("setup") > 0 and run.elapsed("never") == 0.0
        run.start(state, validate=validate)
        for _ in run.steps(state):
            with run.step(state):
                with run.phase("data"):
                    batch = take(state, None, cfg)
                with run.phase("update"):
                    batch = nudge(state, batch, cfg)
                assert run.elapsed("data") > 0
                run.end_step(state, batch)
        run.finish(state)
    return run, state


def test_run_drives_a_loop_through_the_state_contract(tmp_path):
    run, state = run_small(tmp_path / "r")
    assert run.total == 3  # ceil(10 / 4): the last step reaches into the second pass, then the run ends
    rows = read_metrics(tmp_path / "r")
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert rows[0]["val_reward"] == 0.0
    assert rows[1]["epoch"] == 0 and rows[3]["epoch"] == 1 and rows[3]["val_reward"] == 3.0
    assert state.total_valid_tokens == 3 * 4 * 3 and rows[1]["tokens_per_s"] > 0
    assert [p.name for p in list_checkpoints(tmp_path / "r")] == ["step_2", "step_3"]
    assert json.loads((tmp_path / "r" / "provenance.json").read_text())["samples"]["count"] == 10
    final = load_policy(tmp_path / "r" / "final")
    assert torch.equal(next(final.parameters()), next(state.model.parameters()).detach())


def test_record_provenance_checks_a_resumed_run(tmp_path):
    run_small(tmp_path / "r", max_num_steps=1)
    other = {"loop": "ppo", "samples": {"count": 10, "sha256": "b"}}
    with pytest.raises(ResumeMismatchError, match="cannot resume"):
        run_small(tmp_path / "r", resume=True, record=other, max_num_steps=2)
    with pytest.warns(UserWarning, match="resuming with changed inputs"):
        run_small(tmp_path / "r", resume=True, record=other, max_num_steps=2, allow_changed_inputs=True)


def test_a_state_without_trained_model_is_refused_by_name(tmp_path):
    @dataclasses.dataclass(kw_only=True)
    class Nameless(LoopState):
        pass

    cfg = PolicyConfig(run_dir=str(tmp_path / "n"), progress=False, tensorboard=False)
    with Run(cfg) as run, pytest.raises(NotImplementedError, match="Nameless must define trained_model"):
        run.check_inputs(reward=None, prompts=["a b"], val_prompts=None)
        run.start(Nameless(env=run.env), validate=validate)


# --- the phase contract --------------------------------------------------------------------------------


@pytest.mark.parametrize("module", [ppo, reinforce, ilql, reward_model], ids=lambda m: m.__name__.split(".")[-1])
def test_every_phase_takes_state_batch_cfg(module):
    """Each loop lists its phases in ``PHASES`` (its ``validate`` among them); each one is
    ``phase(state, batch, cfg) -> batch``: three positional parameters, any others keyword-only with defaults."""
    assert module.validate in module.PHASES
    for phase in module.PHASES:
        params = list(inspect.signature(phase).parameters.values())
        positional = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        assert positional == ["state", "batch", "cfg"], f"{module.__name__}.{phase.__name__}: {positional}"
        extra = [p for p in params if p.kind is p.KEYWORD_ONLY and p.default is p.empty]
        assert not extra, f"{module.__name__}.{phase.__name__} needs {[p.name for p in extra]}"


def test_ppo_and_reinforce_share_their_rollout_and_reference_phases():
    from rlbits.loops import phases

    assert ppo.rollout is reinforce.rollout is phases.rollout
    assert ppo.reference is reinforce.reference is phases.reference
    assert ppo.validate is reinforce.validate is phases.validate_policy


# --- on_nonfinite="skip" (through rlbits.train) ---------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_policy(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_policy")
    tiny_causal_lm("gpt2", 32, seed=0).save_pretrained(path)
    tiny_tokenizer(32).save_pretrained(path)
    return str(path)


class NanOnCall:
    """A reward that returns NaN for one sample on its ``bad``-th call, else 0.5."""

    def __init__(self, bad: int):
        self.calls, self.bad = 0, bad

    def __call__(self, prompts, responses):
        self.calls += 1
        return [float("nan") if self.calls == self.bad and i == 1 else 0.5 for i in range(len(prompts))]


@pytest.mark.slow
@pytest.mark.parametrize("loop", ["ppo", "reinforce"])
def test_skip_drops_a_step_with_a_nan_reward_and_goes_on(loop, tiny_policy, tmp_path):
    import rlbits

    config = {"ppo": "configs/ppo_sentiment.yaml", "reinforce": "configs/rloo_arithmetic.yaml"}[loop]
    run_dir = tmp_path / "run"
    kw = dict(policy=tiny_policy, run_dir=str(run_dir), max_num_steps=3, num_prompts_per_step=2,
              num_generations_per_prompt=2, max_new_tokens=4, microbatch_size=4, val_at_start=False,
              val_at_end=False, val_period=0, save_period=1, progress=False, tensorboard=False)
    with pytest.raises(ValueError, match=r"step 2, phase score: .*nan for sample 1"):
        rlbits.train(reward_fn=NanOnCall(bad=2), config=config, **kw)  # the default: stop
    assert [p.name for p in list_checkpoints(run_dir)] == ["step_1"]
    with pytest.warns(UserWarning, match="skipping step 2"):
        rlbits.train(
            reward_fn=NanOnCall(bad=2),
            config=config,
            on_nonfinite="skip",
            **{**kw, "run_dir": str(tmp_path / "skip")},
        )
    rows = read_metrics(tmp_path / "skip")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows[1] == {"step": 2, "time_s": rows[1]["time_s"], "skipped_step": 1.0}
    assert "skipped_step" not in rows[0] and "skipped_step" not in rows[2]
    final = load_policy(tmp_path / "skip" / "final")
    assert all(torch.isfinite(p).all() for p in final.parameters())


# --- max_time -----------------------------------------------------------------------------------------------


def test_max_time_parses_dd_hh_mm_ss_and_refuses_other_forms():
    from rlbits.loops.config import ConfigError, max_time_seconds

    assert max_time_seconds("00:03:45:00") == 3 * 3600 + 45 * 60  # NeMo-RL's convert_to_seconds example
    assert max_time_seconds("1:0:0:5") == 86405
    for bad in ("03:45:00", "00:00:00:00", "a:b:c:d", "00:00:-1:00"):
        with pytest.raises(ConfigError, match="max_time"):
            RunConfig(max_time=bad)


def test_max_time_ends_the_run_after_the_step_that_spends_it(tmp_path, monkeypatch):
    import rlbits.loops.run as run_module

    # a budget of 0 s: spent by the end of step 1, which then validates, saves and exports (NeMo-Aligner)
    monkeypatch.setattr(run_module, "max_time_seconds", lambda _: 0)
    run, state = run_small(tmp_path / "spent", max_time="00:00:00:01", val_period=0, save_period=0)
    assert state.step == 1
    rows = read_metrics(run.dir)
    assert [r["step"] for r in rows if "val_reward" in r] == [0, 1]
    assert [p.name for p in list_checkpoints(run.dir)] == ["step_1"]
    assert (run.dir / "final" / "config.json").exists()
    monkeypatch.undo()
    run, state = run_small(tmp_path / "ample", max_time="00:01:00:00")
    assert state.step == 3  # its epoch ends first, as without max_time
