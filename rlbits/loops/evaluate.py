"""``rlbits eval RUN_DIR``: the test-split reward of a run's final policy next to its base model's; for ILQL,
steered decoding (``steered_validate``, ``evaluate_betas``, ``evaluate_ilql_run``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from tensordict import TensorDictBase

from rlbits.distributed.env import DistEnv
from rlbits.loops import phases
from rlbits.loops.api import loop_module, resolve_config
from rlbits.loops.config import RunConfig
from rlbits.loops.runtime import disable_dropout, load_policy_and_tokenizer, loop_prompts, policy_path, setup
from rlbits.models.heads import ILQLModel
from rlbits.models.load import load_tokenizer
from rlbits.models.steered import SteeredPolicy

if TYPE_CHECKING:  # the ILQL loop imports this module
    from rlbits.loops.ilql import ILQLConfig


def validate(
    policy: torch.nn.Module,
    tokenizer: Any,
    cfg: RunConfig,
    *,
    reward: Any = None,
    prompts: Sequence[str] | None = None,
    env: DistEnv | None = None,
) -> tuple[dict[str, float], TensorDictBase]:
    """``rlbits.loops.phases.validate`` with the task's test prompts (chat-formatted when ``uses_chat(cfg)``,
    as the loops validate; given ``prompts`` are used as they are) and reward as defaults; a multi-turn task
    (one with ``make_env``) is validated on episodes, as in training."""
    from rlbits.tasks import get_task

    task = get_task(cfg.task)
    reward = reward if reward is not None else task.reward
    prompts = prompts if prompts is not None else loop_prompts(cfg, tokenizer, None, "test")
    make_env = getattr(task, "make_env", None)
    return phases.validate(policy, tokenizer, cfg, reward=reward, prompts=prompts, env=env, make_env=make_env)


def evaluate_run(
    run_dir: str | Path, *, max_val_samples: int | None = None, greedy: bool = False
) -> dict[str, dict[str, float]]:
    """Validate ``RUN_DIR/final`` and the run's initial policy on the same test prompts with the same noise.

    A loop may define its own ``evaluate_run`` (ILQL evaluates steered decoding); it is used when present.

    Returns:
        ``{"base": metrics, "final": metrics}`` with ``val_reward``, ``val_reward_std``, ``val_response_len``.

    Raises:
        FileNotFoundError: no ``config.yaml`` or ``final/`` in ``run_dir``.
    """
    run_dir = Path(run_dir)
    if not (run_dir / "config.yaml").is_file():
        raise FileNotFoundError(
            f"{run_dir / 'config.yaml'} does not exist; is {str(run_dir)!r} a run directory?"
        )
    if not (run_dir / "final").is_dir():
        raise FileNotFoundError(f"{run_dir / 'final'} does not exist; the run has not finished")
    cfg = resolve_config(run_dir / "config.yaml")
    changes = {"val_greedy": greedy or cfg.val_greedy}
    if max_val_samples is not None:
        changes["max_val_samples"] = max_val_samples
    cfg = dataclasses.replace(cfg, **changes)
    module = loop_module(cfg.loop)
    if hasattr(module, "evaluate_run"):
        return module.evaluate_run(run_dir, cfg)
    env = setup(cfg)
    out = {}
    for name, path in (("base", policy_path(cfg)), ("final", str(run_dir / "final"))):
        policy, tokenizer = load_policy_and_tokenizer(path, env)
        out[name], _ = validate(policy, tokenizer, cfg, reward=cfg.resolve_reward(None))  # reward_model, if set
    return out


# --------------------------------------------------------------------------------------------------------
# ILQL: steered decoding
# --------------------------------------------------------------------------------------------------------


def steered_validate(
    model: ILQLModel,
    tokenizer: Any,
    cfg: RunConfig,
    *,
    beta: float,
    reward: Any = None,
    prompts: Sequence[str] | None = None,
    env: DistEnv | None = None,
) -> tuple[dict[str, float], TensorDictBase]:
    """Mean test-split reward of steered decoding at ``beta`` (``validate`` on a ``SteeredPolicy``:
    same prompts, same noise as the base model's validation)."""
    return validate(SteeredPolicy(model, beta), tokenizer, cfg, reward=reward, prompts=prompts, env=env)


def load_ilql_final(run_dir: str | Path, device: str | torch.device = "cpu") -> tuple[ILQLModel, Any]:
    """The trained ILQL model (LM and heads) and tokenizer of ``RUN_DIR/final`` (``rlbits.loops.ilql.load_final``)."""
    folder = Path(run_dir) / "final"
    model = ILQLModel.from_pretrained(folder, device=device)
    return disable_dropout(model), load_tokenizer(folder)


def evaluate_betas(
    model: ILQLModel,
    tokenizer: Any,
    cfg: RunConfig,
    betas: Sequence[float],
    *,
    reward: Any = None,
    prompts: Sequence[str] | None = None,
) -> dict[float, dict[str, float]]:
    """``steered_validate`` at each beta (same prompts and noise): ``{beta: metrics}``."""
    return {
        b: steered_validate(model, tokenizer, cfg, beta=b, reward=reward, prompts=prompts)[0] for b in betas
    }


def evaluate_ilql_run(run_dir: str | Path, cfg: ILQLConfig) -> dict[str, dict[str, float]]:
    """For ``rlbits eval`` of an ILQL run (``rlbits.loops.ilql.evaluate_run``): the base model (unsteered) and
    the final model steered at ``cfg.beta``, on the same test prompts with the same noise. Returns
    ``{"base": metrics, "final": metrics}``."""
    env = setup(cfg)
    policy, tokenizer = load_policy_and_tokenizer(policy_path(cfg), env)
    base, _ = validate(policy, tokenizer, cfg)
    model, tokenizer = load_ilql_final(run_dir, env.device)
    final, _ = steered_validate(model, tokenizer, cfg, beta=cfg.beta)
    return {"base": base, "final": final}


__all__ = ["evaluate_betas", "evaluate_ilql_run", "evaluate_run", "load_ilql_final", "steered_validate"]
