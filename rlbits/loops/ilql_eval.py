"""ILQL's evaluation: steered decoding (``SteeredPolicy``) scored as any policy is (``phases.evaluate_policy``).

``rlbits.loops.ilql`` validates with ``steered_validate`` and re-exports every name here; ``rlbits eval`` of an
ILQL run calls ``evaluate_run``.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from tensordict import TensorDictBase

from rlbits.distributed.env import DistEnv
from rlbits.loops import phases
from rlbits.loops.config import RunConfig
from rlbits.loops.runtime import Setup, disable_dropout, load_policy_and_tokenizer, policy_path, setup
from rlbits.models.heads import ILQLModel
from rlbits.models.load import load_tokenizer
from rlbits.models.steered import SteeredPolicy

if TYPE_CHECKING:  # only for the annotation: ilql imports this module
    from rlbits.loops.ilql import ILQLConfig



def steered_validate(
    model: ILQLModel, tokenizer: Any, cfg: RunConfig, *, beta: float, reward: Any = None,
    prompts: Sequence[str] | None = None, env: DistEnv | None = None, make_env: Any = None,
) -> tuple[dict[str, float], TensorDictBase]:
    """``phases.evaluate_policy`` of ``SteeredPolicy(model, beta)``: the mean reward of steered decoding on
    ``prompts`` (default the task's test split) with ``reward`` (default the task's), the same prompts and
    noise as the base model's validation. Returns ``(metrics, batch)``."""
    if reward is None or prompts is None:
        run = Setup.of(cfg)
        reward, make_env = run.reward(reward), run.make_env if make_env is None else make_env
        prompts = prompts if prompts is not None else run.prompts(tokenizer, None, "test")
    return phases.evaluate_policy(
        SteeredPolicy(model, beta), tokenizer, cfg, reward=reward, prompts=prompts, env=env, make_env=make_env
    )


def evaluate_betas(
    model: ILQLModel, tokenizer: Any, cfg: RunConfig, betas: Sequence[float], *, reward: Any = None,
    prompts: Sequence[str] | None = None,
) -> dict[float, dict[str, float]]:
    """``steered_validate`` at each beta (same prompts and noise): ``{beta: metrics}``."""
    return {b: steered_validate(model, tokenizer, cfg, beta=b, reward=reward, prompts=prompts)[0] for b in betas}


def load_final(run_dir: str | Path, device: str | torch.device = "cpu") -> tuple[ILQLModel, Any]:
    """The trained ILQL model (LM and heads, dropout off) and tokenizer of ``RUN_DIR/final``."""
    folder = Path(run_dir) / "final"
    return disable_dropout(ILQLModel.from_pretrained(folder, device=device)), load_tokenizer(folder)


def evaluate_run(run_dir: str | Path, cfg: ILQLConfig) -> dict[str, dict[str, float]]:
    """``rlbits eval RUN_DIR`` of an ILQL run: the base model (unsteered) and the final model steered at
    ``cfg.beta``, on the task's test prompts with the same noise. Returns ``{"base": metrics, "final": metrics}``."""
    env, run = setup(cfg), Setup.of(cfg)
    policy, tokenizer = load_policy_and_tokenizer(policy_path(cfg), env)
    kw = dict(reward=run.reward(None), prompts=run.prompts(tokenizer, None, "test"), make_env=run.make_env)
    base, _ = phases.evaluate_policy(policy, tokenizer, cfg, **kw)
    model, tokenizer = load_final(run_dir, env.device)
    final, _ = steered_validate(model, tokenizer, cfg, beta=cfg.beta, **kw)
    return {"base": base, "final": final}


__all__ = ["evaluate_betas", "evaluate_run", "load_final", "steered_validate"]
