"""The set-up PPO and REINFORCE share, before their first step: ``online_run`` (from the config to a
started ``Run`` and the loop's state), ``initial_policy`` (the initial policy, its tokenizer and the frozen
reference) and ``online_fields`` (the ``OnlineState`` fields both loops build alike).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from rlbits.data.stream import PromptStream
from rlbits.distributed.env import DistEnv
from rlbits.loops.config import RunConfig
from rlbits.loops.run import Run
from rlbits.loops.runtime import Setup, generator, load_policy_and_tokenizer, prepare
from rlbits.loops.state import OnlineState
from rlbits.models.load import freeze


@contextlib.contextmanager
def online_run(
    cfg: RunConfig, init_state: Callable[..., OnlineState], validate: Callable, *, reward: Any = None,
    prompts: Sequence[str] | None = None, val_prompts: Sequence[str] | None = None, **run_args: Any,
) -> Iterator[tuple[Run, OnlineState]]:
    """A started run of an online loop and its state, for the loop's steps: the config's ``reward_model``
    key resolved (``cfg.resolve_reward``), a ``Run(cfg, **run_args)`` (``callbacks``, ``resume``,
    ``force``), the user's inputs checked (``Run.check_inputs``: a resume with others is refused before any
    model is loaded), ``init_state(cfg, run.env, setup=run.setup, reward=, prompts=, val_prompts=)``, and
    ``run.start(state, validate=validate)`` (a checkpoint restored into the state, the logs opened).
    Yields ``(run, state)``; the run closes when the block ends.
    """
    reward = cfg.resolve_reward(reward)  # the reward_model key: a reward-model folder instead of the task's reward
    with Run(cfg, **run_args) as run:
        prompts, val_prompts = run.check_inputs(reward=reward, prompts=prompts, val_prompts=val_prompts)
        state = init_state(cfg, run.env, setup=run.setup, reward=reward, prompts=prompts, val_prompts=val_prompts)
        run.start(state, validate=validate)
        yield run, state


def initial_policy(
    cfg: RunConfig, env: DistEnv, setup: Setup, *, reference: bool
) -> tuple[str, torch.nn.Module, Any, torch.nn.Module | None]:
    """``(init_path, policy, tokenizer, reference)``: the initial policy's folder, the policy loaded from it
    (no adapters yet, not prepared) and its tokenizer, and, when ``reference`` and not LoRA, the frozen
    reference (a second copy, prepared for the run: ``freeze``, ``prepare``); else None (with LoRA the
    reference is the policy with its adapters disabled: ``phases.reference_model``)."""
    init_path = setup.initial_policy_path()
    policy, tokenizer = load_policy_and_tokenizer(init_path, env)
    frozen = None
    if reference and not cfg.lora:
        frozen = prepare(freeze(load_policy_and_tokenizer(init_path, env)[0]), cfg, env)
    return init_path, policy, tokenizer, frozen


def online_fields(
    cfg: RunConfig, env: DistEnv, setup: Setup, tokenizer: Any, init_path: str, *, reward: Any = None,
    prompts: Sequence[str] | None = None, val_prompts: Sequence[str] | None = None,
) -> dict[str, Any]:
    """The ``OnlineState`` fields of a fresh state: the process, tokenizer and initial folder, the seeded
    ``sampling`` and ``minibatch`` generators, the prompt stream (``prompts``, else the task's train split),
    the reward (``reward``, else the task's), the task's ``make_env`` and the validation prompts
    (``val_prompts``, else the task's test split)."""
    return dict(
        env=env, tokenizer=tokenizer, init_path=init_path, make_env=setup.make_env, reward=setup.reward(reward),
        sampling_generator=generator(cfg.seed, env.rank, "sampling", env.device),
        minibatch_generator=generator(cfg.seed, env.rank, "minibatch"),
        stream=PromptStream(setup.prompts(tokenizer, prompts, "train"), cfg.seed),
        val_prompts=setup.prompts(tokenizer, val_prompts, "test"),
    )


__all__ = ["initial_policy", "online_fields", "online_run"]
