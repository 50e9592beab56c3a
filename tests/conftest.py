import importlib
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, settings

# One intra-op thread per xdist worker: two workers on two cores, no oversubscription.
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)

settings.register_profile(
    "ci", derandomize=True, deadline=None, max_examples=60, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile("dev", deadline=None, max_examples=60, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("ci" if os.environ.get("CI") else "dev")


@pytest.fixture
def gen() -> torch.Generator:
    return torch.Generator().manual_seed(0)


@pytest.fixture(scope="session")
def made_once(tmp_path_factory):
    """``made_once(name, make) -> folder``: ``make(folder)`` runs once for the whole session, xdist workers
    included (the first worker makes it under a file lock; the others wait and reuse it). For what costs tens
    of seconds and several tests read, such as reference runs and torchrun launches. (xdist's
    ``--dist loadgroup`` would do this by sending the tests to one worker, but with pytest 9 its group
    marker is ignored.)"""
    from filelock import FileLock  # a dependency of torch

    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base  # the workers' common folder

    def get(name: str, make: Callable[[Path], None]) -> Path:
        folder = shared / name
        with FileLock(str(folder) + ".lock"):
            if not (folder / ".made").exists():
                folder.mkdir(exist_ok=True)
                make(folder)
                (folder / ".made").touch()
        return folder

    return get


# --------------------------------------------------------------------------------------------------------
# `python -m pytest -m "not slow"` trains no model
# --------------------------------------------------------------------------------------------------------
# The rule: a test that runs a loop's train(), pretrains (or keeps pretraining) a base model, or launches
# torchrun / `rlbits train` / `rlbits pretrain` in a subprocess is marked @pytest.mark.slow (per test, or
# `pytestmark` for a module that trains throughout). Pure tests (kernels, configs, one phase of a loop on a
# tiny model) are not.
#
# The guard: while a test that is not marked slow runs (its fixtures included), every module-level name
# bound to one of TRAINING_ENTRY_POINTS (in rlbits and in the test's module, so `from rlbits.loops.ppo import
# train` is caught too) is replaced by a stub that fails the test, and so is a subprocess launch of training.
# The test fails even if the code under test swallows the failure (the dashboard's background thread
# does). Entry points are import-path strings resolved in try/except: one that a refactor moved is skipped
# here, without breaking collection, and tests/test_slow_guard.py fails naming it.
TRAINING_ENTRY_POINTS = (
    "rlbits.loops.ppo:train",
    "rlbits.loops.reinforce:train",
    "rlbits.loops.ilql:train",
    "rlbits.loops.reward_model:train",
    "rlbits.zoo.builder:pretrain",  # the base-model builder (rlbits.zoo.base_model builds through it)
    "rlbits.zoo.evaluator:plateau_check",  # keeps pretraining a base model for a while
)
TRAINS_A_MODEL = "this test trains a model: mark it @pytest.mark.slow"


def resolve_entry_point(spec: str):
    """The function named ``module:name``, or None if it cannot be imported (moved, renamed, broken)."""
    module_name, _, name = spec.partition(":")
    try:
        return getattr(importlib.import_module(module_name), name)
    except Exception:
        return None


def _bound_in(test_module) -> list:
    """The modules where an entry point may be bound: every imported rlbits module and the test's own."""
    mods = {
        id(m): m for name, m in list(sys.modules.items()) if name == "rlbits" or name.startswith("rlbits.")
    }
    if test_module is not None:
        mods[id(test_module)] = test_module
    return list(mods.values())


def _launches_training(args) -> bool:
    """Whether a subprocess command line runs torchrun or `rlbits train|pretrain` (`python -m rlbits ...`)."""
    argv = [args] if isinstance(args, (str, bytes, os.PathLike)) else list(args)
    words = [os.path.basename(w) for a in argv for w in os.fsdecode(a).split()]
    if "torchrun" in words or "torch.distributed.run" in words:
        return True
    return any(
        w == "rlbits" and nxt in ("train", "pretrain") for w, nxt in zip(words, words[1:], strict=False)
    )


class _TrainingGuard:
    """Replaces the training entry points (and training subprocesses) while one fast test runs."""

    def __init__(self) -> None:
        self.violations: list[str] = []  # what the test called
        self.missing: list[str] = []  # entry points that did not resolve (tests/test_slow_guard.py fails)
        self.guarded: dict[str, object] = {}  # entry point -> the original function
        self._patch = pytest.MonkeyPatch()

    def _refuse(self, what: str) -> None:
        self.violations.append(what)
        pytest.fail(f"{TRAINS_A_MODEL} (it called {what})")

    def _stub(self, spec: str, original):
        guard = self

        def refuse_training(*args, **kwargs):
            cfg = args[0] if args else kwargs.get("cfg")
            if spec.startswith("rlbits.loops.") and cfg is not None and not hasattr(cfg, "run_dir"):
                return original(*args, **kwargs)  # not a config: the loop rejects it before loading anything
            guard._refuse(spec)

        refuse_training.__wrapped__ = original
        return refuse_training

    def arm(self, test_module=None) -> None:
        try:
            stubs = {}
            for spec in TRAINING_ENTRY_POINTS:
                fn = resolve_entry_point(spec)
                if fn is None:
                    self.missing.append(spec)
                else:
                    self.guarded[spec] = fn
                    stubs[id(fn)] = (fn, self._stub(spec, fn))
            for mod in _bound_in(test_module):
                for name, value in list(vars(mod).items()):
                    hit = stubs.get(id(value))
                    if hit is not None and hit[0] is value:
                        self._patch.setattr(mod, name, hit[1])
            popen_init = subprocess.Popen.__init__
            guard = self

            def guarded_popen_init(popen, *args, **kwargs):
                command = args[0] if args else kwargs.get("args", ())
                if _launches_training(command):
                    guard._refuse(f"subprocess {command!r}")
                popen_init(popen, *args, **kwargs)

            self._patch.setattr(subprocess.Popen, "__init__", guarded_popen_init)
        except Exception as e:  # never break the suite; the guard's own test reports it
            self.missing.append(f"the guard could not be armed: {e!r}")

    def disarm(self) -> None:
        self._patch.undo()


_GUARD_KEY = pytest.StashKey[_TrainingGuard]()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Arms the guard around setup, call and teardown of every test that is not marked slow (so a
    module-scoped fixture that trains, set up by a fast test, is caught as well)."""
    if item.get_closest_marker("slow") is not None:
        return (yield)
    guard = _TrainingGuard()
    item.stash[_GUARD_KEY] = guard
    guard.arm(getattr(item, "module", None))
    try:
        return (yield)
    finally:
        guard.disarm()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    """A test that passed although it reached a training entry point (the failure was swallowed) fails."""
    result = yield
    guard = item.stash.get(_GUARD_KEY, None)
    if guard is not None and guard.violations:
        pytest.fail(f"{TRAINS_A_MODEL} (it called {', '.join(guard.violations)})")
    return result


@pytest.fixture
def training_guard(request) -> _TrainingGuard | None:
    """The guard of the running test (None for a slow test), for the tests of the guard itself."""
    return request.node.stash.get(_GUARD_KEY, None)
