"""Held-out figures of a model on a multi-turn task (``calculator``, ``guess_number``), played as episodes.

Each model plays one episode per test prompt with ``rlbits.generate_episodes`` and the task's ``make_env``
(exactly what the loops' rollout and validation run), greedy or sampled, and this prints:

- ``calculator``: accuracy (episode reward 1.0), tool-call rate (episodes that wrote a ``<tool_call>``),
  accuracy of the episodes that called and of those that did not, mean turns;
- ``guess_number``: solve rate, mean turns of the solved games, mean turns, mean reward.

Used for the learning runs of docs/tasks.md::

    python benchmarks/eval_env_task.py calculator calculator runs/grpo_calculator/final --n 500
    python benchmarks/eval_env_task.py guess_number guess_number runs/grpo_guess_number/final --temperature 1

A model is a local HF folder or a task name (its zoo base model). ``--env-options`` (JSON) go to
``make_env`` (``'{"use_tool": false}'``).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from rlbits.models.load import load_policy, load_tokenizer
from rlbits.rollout.multiturn import generate_episodes
from rlbits.tasks import TASKS, get_task


def _model_path(name: str) -> str:
    if name in TASKS:
        from rlbits.zoo import base_model

        return str(base_model(name))
    return name


def play(task_name: str, model: str, *, n: int, temperature: float, seed: int, env_options: dict,
         batch_size: int = 100) -> dict:
    """One episode per test prompt (the first ``n``); returns the figures of the module docstring."""
    task = get_task(task_name)
    path = _model_path(model)
    policy, tokenizer = load_policy(path), load_tokenizer(path)
    policy.eval()
    prompts = task.prompts("test")[:n]
    gen = torch.Generator().manual_seed(seed)
    rewards, turns, texts = [], [], []
    with torch.no_grad():
        for i in range(0, len(prompts), batch_size):
            chunk = prompts[i : i + batch_size]
            batch = generate_episodes(
                policy, tokenizer, [task.make_env(p, **env_options) for p in chunk], chunk,
                temperature=temperature, generator=gen,
            )
            rewards += batch["rewards"].tolist()
            turns += batch["num_turns"].tolist()
            texts += list(batch["response_text"])
    out = {"model": model, "task": task_name, "n": len(prompts), "temperature": temperature,
           "env_options": env_options, "mean_turns": sum(turns) / len(turns), "mean_reward": sum(rewards) / len(rewards)}
    if task_name == "calculator":
        right = [r == 1.0 for r in rewards]
        called = [task.called_tool(t) for t in texts]
        n_called = sum(called)
        out["accuracy"] = sum(right) / len(right)
        out["tool_call_rate"] = n_called / len(called)
        out["accuracy_when_called"] = sum(r for r, c in zip(right, called, strict=True) if c) / max(n_called, 1)
        out["accuracy_when_not_called"] = sum(r for r, c in zip(right, called, strict=True) if not c) / max(
            len(called) - n_called, 1
        )
    elif task_name == "guess_number":
        outcomes = [task.play(p, t) for p, t in zip(prompts, texts, strict=True)]
        solved = [o.turns for o in outcomes if o.solved]
        out["solve_rate"] = len(solved) / len(outcomes)
        out["mean_turns_solved"] = sum(solved) / max(len(solved), 1)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("task", choices=["calculator", "guess_number"])
    parser.add_argument("models", nargs="+", help="HF folders or task names (their base model)")
    parser.add_argument("--n", type=int, default=500)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--env-options", default="{}", help="JSON keyword options for make_env")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    for model in args.models:
        start = time.perf_counter()
        out = play(args.task, model, n=args.n, temperature=args.temperature, seed=args.seed,
                   env_options=json.loads(args.env_options))
        out["seconds"] = round(time.perf_counter() - start, 1)
        print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in out.items()}))


if __name__ == "__main__":
    main()
