"""Deprecated: the grab-bag the loops once shared, split by responsibility (docs/design.md, "Loops").

Kept so that existing notebooks keep importing: every name here now lives in one of

- ``rlbits.loops.runtime``: ``setup``, ``seed_everything``, ``derive_seed``, ``prepare``, ``autocast``,
  ``kernel``, ``disable_dropout``, ``policy_path``, ``load_policy_and_tokenizer``;
- ``rlbits.loops.optim``: ``make_optimizer``; ``rlbits.loops.update``: ``pad_microbatches``;
- ``rlbits.loops.phases``: ``rollout``, ``score_rollout``, ``reference_logprobs``, ``validate``;
- ``rlbits.loops.run``: ``PhaseTimer``, ``in_phase``, ``agreed``, ``SKIPPABLE``, ``sample_rows``.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from tensordict import TensorDictBase

from rlbits.distributed.env import DistEnv
from rlbits.loops import phases
from rlbits.loops.config import RunConfig
from rlbits.loops.optim import make_optimizer
from rlbits.loops.phases import reference_logprobs, rollout, score_rollout
from rlbits.loops.run import SKIPPABLE, PhaseTimer, agreed, in_phase, sample_rows
from rlbits.loops.runtime import (
    autocast,
    disable_dropout,
    kernel,
    load_policy_and_tokenizer,
    policy_path,
    prepare,
    seed_everything,
    setup,
)
from rlbits.loops.update import pad_microbatches


def validate(
    policy: torch.nn.Module,
    tokenizer: Any,
    cfg: RunConfig,
    *,
    reward: Any = None,
    prompts: Sequence[str] | None = None,
    logits_processor: Callable | None = None,
    env: DistEnv | None = None,
) -> tuple[dict[str, float], TensorDictBase]:
    """``rlbits.loops.phases.validate`` with the task's test prompts (chat-formatted when ``uses_chat(cfg)``,
    as the loops validate; given ``prompts`` are used as they are) and reward as defaults; a multi-turn task
    (one with ``make_env``) is validated on episodes, as in training (so ``rlbits eval`` scores it so too)."""
    from rlbits.loops.runtime import loop_prompts
    from rlbits.tasks import get_task

    task = get_task(cfg.task)
    return phases.validate(
        policy, tokenizer, cfg, reward=reward if reward is not None else task.reward,
        prompts=prompts if prompts is not None else loop_prompts(cfg, tokenizer, None, "test"),
        logits_processor=logits_processor, env=env, make_env=getattr(task, "make_env", None),
    )  # fmt: skip


def kl_per_sequence(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, action_mask: torch.Tensor) -> torch.Tensor:
    """Mean over sequences of the summed k1 KL estimate (nats per sequence)."""
    return phases.kl_per_sequence(logprobs, ref_logprobs, action_mask).mean()


def response_stats(batch: TensorDictBase) -> dict[str, torch.Tensor]:
    """Response length metrics."""
    lengths = batch["action_mask"].sum(-1).float()
    return {"response_len": lengths.mean(), "response_len_max": lengths.max()}


def skipped_step(error: BaseException, step: int) -> dict[str, float]:
    """Warn about a step dropped by ``on_nonfinite="skip"``; the metrics to log for it."""
    warnings.warn(f"skipping step {step}: {error}", stacklevel=2)
    return {"skipped_step": 1.0}


__all__ = [
    "SKIPPABLE", "PhaseTimer", "agreed", "autocast", "disable_dropout", "in_phase", "kernel",
    "kl_per_sequence", "load_policy_and_tokenizer", "make_optimizer", "pad_microbatches", "policy_path", "prepare",
    "reference_logprobs", "response_stats", "rollout", "sample_rows", "score_rollout", "seed_everything", "setup",
    "skipped_step", "validate",
]  # fmt: skip
