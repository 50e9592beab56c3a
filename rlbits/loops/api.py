"""``rlbits.train(...)``: pick the loop from the config and run it (like ``trlx.train``).

    import rlbits
    run_dir = rlbits.train(reward_fn=my_reward, prompts=my_prompts, config="configs/ppo_sentiment.yaml",
                           max_num_steps=50, run_dir="runs/mine")
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.resources
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

from rlbits.data.stream import check_prompts
from rlbits.distributed.checkpoint import latest_checkpoint
from rlbits.loops.config import LOOPS, ConfigError, RunConfig, config_from_dict, parse_overrides, read_yaml
from rlbits.loops.run import elastic_restart
from rlbits.loops.rundir import check_not_locked, check_run_dir

DEFAULT_CONFIG = "ppo_sentiment.yaml"


def loop_module(name: str) -> ModuleType:
    """The module of loop ``name`` (``ppo``, ``reinforce``, ``ilql``, ``reward_model``)."""
    if name not in LOOPS:
        raise ConfigError(f"unknown loop {name!r}; expected one of {', '.join(LOOPS)}")
    return importlib.import_module(LOOPS[name][0])


def config_class(name: str) -> type[RunConfig]:
    module_name, class_name = LOOPS.get(name, (None, None))
    return getattr(loop_module(name), class_name)


def default_config_path() -> Path | None:
    """``configs/ppo_sentiment.yaml`` in the working directory (a checkout, or a user's edited copy), else the
    copy shipped inside the package (``rlbits/configs/``, package data: also there in a wheel install)."""
    path = Path.cwd() / "configs" / DEFAULT_CONFIG
    if path.is_file():
        return path
    packaged = importlib.resources.files("rlbits") / "configs" / DEFAULT_CONFIG
    return Path(str(packaged)) if packaged.is_file() else None


def resolve_config(
    config: str | Path | dict[str, Any] | RunConfig | None = None, overrides: dict[str, Any] | Sequence[str] = ()
) -> RunConfig:
    """A validated loop config from a YAML path, a dict, a config object or None (the default main job),
    with overrides (a dict, or ``key=value`` strings) applied on top. The ``loop`` key picks the class."""
    extra = dict(overrides) if isinstance(overrides, dict) else parse_overrides(list(overrides))
    if isinstance(config, RunConfig):
        values = {**dataclasses.asdict(config), **extra}
    else:
        if config is None and extra.get("loop", "ppo") == "ppo":
            config = default_config_path()
        if config is None:
            values = {}
        elif isinstance(config, dict):
            values = dict(config)
        else:
            values = read_yaml(config)
        values.update(extra)
    loop = values.get("loop", "ppo")
    if not isinstance(loop, str) or loop not in LOOPS:
        raise ConfigError(f"loop must be one of {', '.join(LOOPS)}; got {loop!r}")
    return config_from_dict(config_class(loop), values)


def train(
    reward_fn: Callable | str | Any = None,
    prompts: Sequence[str] | None = None,
    samples: Sequence[Any] | None = None,
    config: str | Path | dict[str, Any] | RunConfig | None = None,
    *,
    val_prompts: Sequence[str] | None = None,
    callbacks: Sequence[Any] = (),
    resume: bool = False,
    force: bool = False,
    **overrides: Any,
) -> Path:
    """Train with the loop named by ``config``'s ``loop`` and return the run directory.

    Args:
        reward_fn: reward for online loops: a callable ``(prompts, responses, **columns) -> list[float]``, a
            reward model, or a reward-server URL (see ``rlbits.score``); None = the task's reward.
        prompts: training prompts; None = the task's train split.
        samples: offline dataset for ILQL (``(prompt, response, reward)`` triples or dicts).
        val_prompts: held-out validation prompts; None = the config's ``val_prompts`` file, else the task's
            test split. ``prompts`` and ``val_prompts`` are checked first (a list of non-empty strings).
        config: YAML path, dict, config object, or None for ``configs/ppo_sentiment.yaml`` (with ``loop=`` another
            loop in ``overrides``: that loop's defaults).
        callbacks: objects with ``on_metrics``/``on_samples``/``should_stop`` (e.g. a notebook dashboard).
        resume: continue ``run_dir`` from its latest checkpoint. Under ``torchrun --max-restarts`` a restarted
            job resumes by itself. The reward, prompts and samples must be those the run was started with
            (``RUN_DIR/provenance.json``), unless ``allow_changed_inputs=True``.
        force: reuse a ``run_dir`` that is neither new, empty nor an rlbits run (a folder of other files, a
            run of an rlbits without the ``.rlbits-run`` marker), or start an existing run over without
            ``resume`` (its checkpoints and logs are replaced). rlbits still deletes only files it wrote, and
            a live run's lock is never overridden (``rlbits.loops.rundir``).
        **overrides: config fields to override (``max_num_steps=20``, ``run_dir="runs/x"``).

    Raises:
        ConfigError: unknown or invalid config keys; ``samples`` given to an online loop.
        PromptError: bad ``prompts`` / ``val_prompts`` (a single string, an empty list or prompt, a non-str).
        ResumeMismatchError: ``resume`` with other inputs than the run was started with.
        RunDirError: ``run_dir`` holds other files or a run (without ``resume``/``force``), or is a file;
            RunDirLockedError (a RunDirError): a live run holds it.
        DiskFullError: a write into the run directory failed on a full disk (saved checkpoints are intact).
    """
    prompts = check_prompts(prompts, "prompts") if prompts is not None else None  # before anything is loaded
    val_prompts = check_prompts(val_prompts, "val_prompts") if val_prompts is not None else None
    cfg = resolve_config(config, overrides)
    module = loop_module(cfg.loop)
    restarted = elastic_restart(cfg.run_dir)
    if not resume and restarted and latest_checkpoint(cfg.run_dir, full=False) is not None:
        resume = True  # torchrun --max-restarts restarted the job: continue from its last checkpoint
    if int(os.environ.get("RANK", "0")) == 0:  # refuse a run_dir before any model is loaded (Run claims it)
        check_run_dir(cfg.run_dir, resume=resume, force=force, restarted=restarted)
        check_not_locked(cfg.run_dir)
    kwargs: dict[str, Any] = {
        "callbacks": callbacks, "resume": resume, "force": force, "reward": reward_fn, "prompts": prompts,
    }
    if val_prompts is not None:
        kwargs["val_prompts"] = val_prompts
    if samples is not None:
        if cfg.loop != "ilql":
            raise ConfigError(f"samples= is an offline dataset for the ilql loop; loop {cfg.loop!r} samples its own")
        kwargs["samples"] = samples
    return module.train(cfg, **kwargs)
