"""Built-in tasks: prompts, rewards and the corpora base models are trained on.

A task is a module with three functions (see ``docs/tasks.md``):

- ``prompts(split) -> list[str]``: ``"train"`` or ``"test"`` prompts (disjoint, deterministic).
- ``reward(prompts, responses) -> list[float]``: one score per (prompt, response) pair.
- ``corpus(n, seed) -> list[str]``: ``n`` documents (prompt + response, no EOS) to pretrain a base model on.

A task played in an environment (``calculator``, ``guess_number``) also has ``make_env(prompt, **options) ->
rlbits.envs.Env``: one fresh env per episode (options: the run config's ``env_options``). The loops take its
rewards from the env's ``StepResult.reward``; the task's ``reward`` scores the text of a whole episode
(the response includes the env's observations) and agrees with them.

A task on real data (``imdb``, ``math``: the ``real`` extra) has no corpus (``corpus`` raises
NotImplementedError); its module names the zoo model it starts from (``BASE_MODEL = "smollm2-135m"``) and may
ask for chat-formatted prompts (``CHAT = True``; see ``RunConfig.chat_template``).

``get_task("sentiment").reward(prompts, responses)`` is how a reward server or a loop reaches a task by name.
Task modules are imported lazily, so ``import rlbits.tasks`` stays cheap.

The base models trained on these corpora live in ``rlbits.zoo``: ``rlbits.zoo.base_model("sentiment")`` is
the path of the sentiment base model, built on first use; ``rlbits.zoo.RECIPES`` holds their settings.
"""

from __future__ import annotations

import importlib
from types import ModuleType

# Task name -> module path. Modules are imported on first ``get_task``.
TASKS: dict[str, str] = {
    "sentiment": "rlbits.tasks.sentiment",
    "arithmetic": "rlbits.tasks.arithmetic",
    # Played in an environment: the module also defines ``make_env(prompt, **env_options)`` (docs/tasks.md).
    "calculator": "rlbits.tasks.calculator",
    "guess_number": "rlbits.tasks.guess_number",
    # Real data (the ``real`` extra; docs/real_models.md): their base model is the zoo model ``smollm2-135m``.
    "imdb": "rlbits.tasks.imdb",
    "math": "rlbits.tasks.math_problems",
}


def get_task(name: str) -> ModuleType:
    """The task module registered under ``name`` (``"sentiment"``, ``"arithmetic"``, ``"calculator"``,
    ``"guess_number"``, ``"imdb"``, ``"math"``).

    Raises:
        ValueError: ``name`` is not a registered task; the message lists the valid names.
    """
    if not isinstance(name, str) or name not in TASKS:
        valid = ", ".join(map(repr, sorted(TASKS)))
        raise ValueError(f"unknown task {name!r}; valid tasks: {valid}")
    return importlib.import_module(TASKS[name])


__all__ = ["TASKS", "get_task"]
