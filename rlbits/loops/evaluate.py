"""Evaluation without training: ``evaluate`` (a policy in memory, on a task or a list of prompts) and
``evaluate_run`` (``rlbits eval RUN_DIR``: a run's final model next to its initial one, by the run's loop).

No loop imports this module: ``evaluate_run`` finds the loop's own ``evaluate_run`` through
``rlbits.loops.api.loop_module``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from tensordict import TensorDictBase

from rlbits.data.stream import check_prompts
from rlbits.distributed.env import DistEnv
from rlbits.loops.api import loop_module, resolve_config
from rlbits.loops.config import PolicyConfig, RunConfig
from rlbits.loops.phases import evaluate_policy
from rlbits.loops.runtime import Setup


def evaluate(
    policy: torch.nn.Module,
    tokenizer: Any,
    task_or_prompts: str | Sequence[str],
    reward: Any = None,
    *,
    config: str | Path | dict[str, Any] | RunConfig | None = None,
    env: DistEnv | None = None,
    **overrides: Any,
) -> tuple[dict[str, float], TensorDictBase]:
    """The mean reward of ``policy``'s responses, in memory (no run directory): ``evaluate_policy`` with the
    settings of ``config`` (default: the ``reinforce`` loop's, e.g. ``max_new_tokens``, ``temperature``,
    ``val_greedy``, ``max_val_samples``, ``seed``), changed by ``overrides``.

    Args:
        task_or_prompts: a task name (``"arithmetic"``): its test prompts (chat-formatted as a run would),
            reward and, for a multi-turn task, episodes; or a list of prompts, used as given (each one, up to
            ``max_val_samples``).
        reward: anything ``rlbits.score`` accepts; None = the task's (required with a list of prompts).
        env: the process's place in a torchrun job (every rank must call it then); default one process.

    Returns:
        ``({"val_reward", "val_reward_std", "val_response_len", "val_fraction_of_samples_properly_ended"[,
        "val_num_turns"]}, batch)``: the metrics over all ranks and this rank's batch (docs/batch.md, with
        ``rewards``).

    Raises:
        ValueError: prompts without a reward; an unknown task. PromptError: a bad prompt list.
        ConfigError: an unknown or invalid setting.
    """
    base = config if config is not None else {"loop": "reinforce"}
    if isinstance(task_or_prompts, str):
        cfg = resolve_config(base, {"task": task_or_prompts, **overrides})
        setup = Setup.of(cfg)
        prompts, reward, make_env = setup.prompts(tokenizer, None, "test"), setup.reward(reward), setup.make_env
    else:
        prompts, make_env = check_prompts(task_or_prompts, "prompts"), None
        if reward is None:
            raise ValueError("evaluate(policy, tokenizer, prompts) needs reward=: a list of prompts has no task reward")
        cfg = resolve_config(base, {"max_val_samples": len(prompts), **overrides})
    return evaluate_policy(policy, tokenizer, cfg, reward=reward, prompts=prompts, env=env, make_env=make_env)


def evaluate_run(
    run_dir: str | Path, *, max_val_samples: int | None = None, greedy: bool = False
) -> dict[str, dict[str, float]]:
    """``rlbits eval RUN_DIR``: the loop's ``evaluate_run(run_dir, cfg)`` with the run's config
    (``config.yaml``), ``max_val_samples`` and ``greedy`` decoding applied. The online loops compare
    ``RUN_DIR/final`` with the initial policy on the same test prompts with the same noise; ILQL steers the
    final model at ``beta``; a reward model is scored on its validation sets.

    Returns:
        ``{"base": metrics, "final": metrics}`` (a reward-model run: ``{set name: metrics}``).

    Raises:
        FileNotFoundError: no ``config.yaml`` or ``final/`` in ``run_dir``.
    """
    run_dir = Path(run_dir)
    if not (run_dir / "config.yaml").is_file():
        raise FileNotFoundError(f"{run_dir / 'config.yaml'} does not exist; is {str(run_dir)!r} a run directory?")
    if not (run_dir / "final").is_dir():
        raise FileNotFoundError(f"{run_dir / 'final'} does not exist; the run has not finished")
    cfg = resolve_config(run_dir / "config.yaml")
    changes: dict[str, Any] = {"val_greedy": greedy or cfg.val_greedy} if isinstance(cfg, PolicyConfig) else {}
    if max_val_samples is not None:
        changes["max_val_samples"] = max_val_samples
    cfg = dataclasses.replace(cfg, **changes)
    return loop_module(cfg.loop).evaluate_run(run_dir, cfg)


__all__ = ["evaluate", "evaluate_run"]
