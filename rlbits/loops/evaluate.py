"""``rlbits eval RUN_DIR``: the test-split reward of a run's final policy next to its base model's."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from rlbits.loops.api import loop_module, resolve_config
from rlbits.loops.common import load_policy_and_tokenizer, policy_path, setup, validate


def evaluate_run(run_dir: str | Path, *, max_val_samples: int | None = None, greedy: bool = False) -> dict[str, dict[str, float]]:
    """Validate ``RUN_DIR/final`` and the run's initial policy on the same test prompts with the same noise.

    A loop may define its own ``evaluate_run`` (ILQL evaluates steered decoding); it is used when present.

    Returns:
        ``{"base": metrics, "final": metrics}`` with ``val_reward``, ``val_reward_std``, ``val_response_len``.

    Raises:
        FileNotFoundError: no ``config.yaml`` or ``final/`` in ``run_dir``.
    """
    run_dir = Path(run_dir)
    if not (run_dir / "config.yaml").is_file():
        raise FileNotFoundError(f"{run_dir / 'config.yaml'} does not exist; is {str(run_dir)!r} a run directory?")
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
        out[name], _ = validate(policy, tokenizer, cfg)
    return out
