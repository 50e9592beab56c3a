"""Built-in tasks: prompts, rewards and base-model corpora.

A task is a module with four functions (see ``docs/tasks.md``):

- ``prompts(split) -> list[str]``: ``"train"`` or ``"test"`` prompts (disjoint, deterministic).
- ``reward(prompts, responses) -> list[float]``: one score per (prompt, response) pair.
- ``corpus(n, seed) -> list[str]``: ``n`` documents (prompt + response, no EOS) to pretrain the base model.
- ``base_model() -> str``: path of the task's HF model folder, built on first use.

``get_task("sentiment").reward(prompts, responses)`` is how a reward server or a loop reaches a task by name.
Task modules are imported lazily, so ``import rlbits.tasks`` stays cheap.
"""

from __future__ import annotations

import importlib
from types import ModuleType

# Task name -> module path. Modules are imported on first ``get_task``.
TASKS: dict[str, str] = {
    "sentiment": "rlbits.tasks.sentiment",
    "arithmetic": "rlbits.tasks.arithmetic",
}


def get_task(name: str) -> ModuleType:
    """The task module registered under ``name`` (``"sentiment"`` or ``"arithmetic"``).

    Raises:
        ValueError: ``name`` is not a registered task; the message lists the valid names.
    """
    if not isinstance(name, str) or name not in TASKS:
        valid = ", ".join(map(repr, sorted(TASKS)))
        raise ValueError(f"unknown task {name!r}; valid tasks: {valid}")
    return importlib.import_module(TASKS[name])


__all__ = ["TASKS", "get_task"]
