"""The guard of tests/conftest.py: a test not marked slow that trains a model fails, naming the fix.

These tests are not marked slow on purpose (the guard is armed for them) and train nothing: the guard
refuses every training call below before a model is loaded.
"""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

import rlbits

MESSAGE = "this test trains a model: mark it @pytest.mark.slow"


def refused(guard, call) -> str:
    """Run ``call``, expect the guard to refuse it, forget the refusal (so this test passes); the message."""
    with pytest.raises(pytest.fail.Exception, match="mark it @pytest.mark.slow") as info:
        call()
    assert guard.violations
    guard.violations.clear()
    return str(info.value)


def test_every_entry_point_resolves_and_is_guarded(training_guard):
    assert training_guard is not None
    assert training_guard.missing == [], (
        "an entry point of TRAINING_ENTRY_POINTS in tests/conftest.py no longer imports (moved by a refactor?): "
        f"{training_guard.missing}; point it at the new location"
    )
    for spec, original in training_guard.guarded.items():
        module, _, name = spec.partition(":")
        stub = getattr(importlib.import_module(module), name)
        assert stub is not original and stub.__wrapped__ is original, spec


def test_loop_train_is_refused_however_it_is_reached(training_guard, tmp_path):
    from rlbits.loops.reinforce import ReinforceConfig, train  # a name bound in this test module

    cfg = ReinforceConfig(policy=str(tmp_path / "none"), run_dir=str(tmp_path / "a"))
    assert "rlbits.loops.reinforce:train" in refused(training_guard, lambda: train(cfg))
    message = refused(
        training_guard, lambda: rlbits.train(config={"loop": "ilql", "run_dir": str(tmp_path / "b")})
    )
    assert "rlbits.loops.ilql:train" in message and MESSAGE in message
    from rlbits.cli import main

    refused(training_guard, lambda: main(["train", f"run_dir={tmp_path / 'c'}", f"policy={tmp_path}"]))
    assert not any((tmp_path / d).exists() for d in "abc")


def test_config_errors_and_non_configs_still_reach_the_loop():
    from rlbits.loops import ilql
    from rlbits.loops.config import ConfigError

    with pytest.raises(ConfigError, match="ILQLConfig"):
        ilql.train(object())  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="unknown config key"):
        rlbits.train(config={"loop": "ppo", "not_a_field": 1})


def test_pretraining_is_refused(training_guard, tmp_path, monkeypatch):
    monkeypatch.setenv("RLBITS_CACHE", str(tmp_path / "cache"))  # no cached base model: it would be built
    builders = {s: f for s, f in training_guard.guarded.items() if not s.startswith("rlbits.loops.")}
    assert builders
    for spec in builders:
        module, _, name = spec.partition(":")
        stub = getattr(importlib.import_module(module), name)
        assert spec in refused(training_guard, stub)
    from rlbits.zoo import base_model

    refused(training_guard, lambda: base_model("arithmetic"))  # builds through the guarded builder
    assert not (tmp_path / "cache" / "arithmetic-base").exists()


def test_training_subprocesses_are_refused_and_others_run(training_guard):
    refused(training_guard, lambda: subprocess.run(["torchrun", "--nproc_per_node", "2", "x.py"]))
    refused(training_guard, lambda: subprocess.run([sys.executable, "-m", "rlbits", "train", "run_dir=x"]))
    refused(training_guard, lambda: subprocess.run("rlbits pretrain arithmetic", shell=True))
    out = subprocess.run(["echo", "rlbits", "eval"], capture_output=True, text=True, check=True)
    assert out.stdout == "rlbits eval\n"
