"""Held-out accuracy of a model on the ``math`` task, overall and by kind of problem.

The procedure of ``rlbits.zoo.evaluate`` (chat-formatted prompts, plain HF ``generate``, prompts of equal
token length batched without padding, greedy, ``REAL_TASK_MAX_NEW_TOKENS`` = 24 new tokens), but keeping
every response so that accuracy (reward exactly 1.0) can be split by kind: one- or two-digit terms, ``+`` or
``-``. Used for the GRPO run of docs/real_models.md ("GRPO on math")::

    python benchmarks/eval_math.py smollm2-135m runs/grpo_smollm2_math/final --n 508 --out /tmp/eval.json

Each model is a local HF folder or a zoo name. Writes one JSON object per model (accuracy, mean reward,
accuracy by kind, every prompt/response/reward) to ``--out`` if given and prints a summary.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import time

import torch

from rlbits.tasks import get_task
from rlbits.text import chat_prompts
from rlbits.zoo import resolve_model
from rlbits.zoo.evaluator import REAL_TASK_MAX_NEW_TOKENS, hf_responses

_TERMS = re.compile(r"(\d+) ([+-]) (\d+) =\s*$")


def kind(question: str) -> str:
    """``"1-digit +"``, ``"2-digit -"``, ...: the larger number of digits of the two terms and the operator.

    Raises:
        ValueError: the question does not end with ``a op b =``.
    """
    match = _TERMS.search(question)
    if match is None:
        raise ValueError(f"not a two-term chain_sum question: {question!r}")
    a, op, b = match.groups()
    return f"{max(len(a), len(b))}-digit {op}"


def generate_greedy(
    model_path: str, prompts: list[str], max_new_tokens: int, batch_size: int = 64
) -> list[str]:
    """Greedy responses (decoded text) of the causal LM in ``model_path`` to ``prompts`` as chat turns
    (``rlbits.zoo.evaluator.hf_responses``, what ``rlbits.zoo.evaluate`` runs)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_path, use_safetensors=True).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    return hf_responses(model, tokenizer, chat_prompts(tokenizer, prompts), max_new_tokens, batch_size=batch_size)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="+", help="HF folders or zoo names")
    parser.add_argument("--n", type=int, default=508, help="the first N test problems")
    parser.add_argument("--max-new-tokens", type=int, default=REAL_TASK_MAX_NEW_TOKENS)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=None, help="JSON file for the full results")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    task = get_task("math")
    prompts = task.prompts("test")[: args.n]
    kinds = [kind(p) for p in prompts]
    results = {}
    for name in args.models:
        start = time.perf_counter()
        responses = generate_greedy(str(resolve_model(name)), prompts, args.max_new_tokens)
        rewards = task.reward(prompts, responses)
        by_kind = {
            k: (sum(r == 1.0 for r, kk in zip(rewards, kinds, strict=True) if kk == k), kinds.count(k))
            for k in sorted(set(kinds))
        }
        results[name] = dict(
            n=len(prompts),
            accuracy=sum(r == 1.0 for r in rewards) / len(rewards),
            mean_reward=statistics.fmean(rewards),
            by_kind={k: dict(correct=c, n=m, accuracy=c / m) for k, (c, m) in by_kind.items()},
            seconds=time.perf_counter() - start,
            samples=[
                dict(prompt=p, response=r, reward=x)
                for p, r, x in zip(prompts, responses, rewards, strict=True)
            ],
        )
        kinds_text = ", ".join(f"{k} {c}/{m}" for k, (c, m) in by_kind.items())
        print(
            f"{name}: accuracy {results[name]['accuracy']:.3f} "
            f"({sum(r == 1.0 for r in rewards)}/{len(rewards)}), "
            f"mean reward {results[name]['mean_reward']:.3f}, {kinds_text}; {results[name]['seconds']:.0f} s",
            flush=True,
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
