"""How good is a base model: ``evaluate(path, task)`` scores it on the task's prompts with plain HF
``model.generate`` (``hf_responses``), and ``plateau_check`` measures whether more supervised training on its
corpus would still improve it.

Independent of the RL loops' sampler (``rlbits.rollout.generate``), so it checks a model folder as anyone
loading it with transformers would see it.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

from rlbits.zoo.builder import encode_corpus, loss_starts, recipe, train_step

# ``evaluate``'s response length for a real-data task (no recipe): the loops' ``max_new_tokens`` default.
REAL_TASK_MAX_NEW_TOKENS = 24


def hf_responses(
    model: Any,
    tokenizer: Any,
    texts: list[str],
    max_new_tokens: int,
    *,
    greedy: bool = True,
    temperature: float = 1.0,
    batch_size: int = 100,
    seed: int = 0,
) -> list[str]:
    """The decoded continuation of each of ``texts`` (tokenised as they are, no special tokens added) by an
    HF causal LM's ``generate``: texts of equal token length are batched together, so no padding is needed;
    greedy, or pure temperature sampling (no top-k / top-p) seeded by ``seed`` without touching the global
    RNG. What ``evaluate`` scores; ``benchmarks/eval_math.py`` keeps every response."""
    encoded = tokenizer(texts, add_special_tokens=False)["input_ids"]
    by_length: dict[int, list[int]] = defaultdict(list)
    for i, ids in enumerate(encoded):
        by_length[len(ids)].append(i)
    responses = [""] * len(texts)
    sampling = {} if greedy else dict(temperature=temperature, top_k=0, top_p=1.0)
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(seed)
        for length in sorted(by_length):
            rows = by_length[length]
            for s in range(0, len(rows), batch_size):
                chunk = rows[s : s + batch_size]
                input_ids = torch.tensor([encoded[i] for i in chunk])
                out = model.generate(
                    input_ids=input_ids,
                    attention_mask=torch.ones_like(input_ids),
                    do_sample=not greedy,
                    max_new_tokens=max_new_tokens,
                    pad_token_id=tokenizer.pad_token_id,
                    eos_token_id=tokenizer.eos_token_id,
                    **sampling,
                )
                decoded = tokenizer.batch_decode(out[:, length:], skip_special_tokens=True)
                for i, text in zip(chunk, decoded, strict=True):
                    responses[i] = text
    return responses


def evaluate(
    model_path: str | os.PathLike,
    task: str,
    split: str = "test",
    *,
    greedy: bool = True,
    n: int | None = None,
    temperature: float = 1.0,
    max_new_tokens: int | None = None,
    batch_size: int = 100,
    seed: int = 0,
) -> dict:
    """Score a causal LM on ``task``'s prompts with plain HF ``model.generate``.

    Prompts of equal token length are batched together, so no padding is needed. Sampling (``greedy=False``)
    is pure temperature sampling (no top-k / top-p) seeded by ``seed``.

    Args:
        model_path: an HF folder with a causal LM and its tokenizer.
        task: a registered task name.
        split: the task's prompt split.
        greedy: greedy decoding, else sampling at ``temperature``.
        n: use the first ``n`` prompts of the split (all if None).
        max_new_tokens: default: the task's ``RECIPES[task]["max_new_tokens"]`` (a real-data task:
            ``REAL_TASK_MAX_NEW_TOKENS``, 24, the loops' default).

    A task with ``CHAT = True`` (``math``) gets its prompts formatted with the tokenizer's chat template
    (``rlbits.text.chat_prompts``), as the loops do; its reward receives the prompts as the task gives them.

    Returns:
        ``{"mean": mean reward, "std": population std, "accuracy": fraction of rewards equal to 1.0,
        "n": number of prompts, "samples": the first 8 (prompt, response, reward) triples}``.

    Raises:
        ValueError: unknown task or split, or a task played in an environment (``make_env``: its episodes
            take several turns, which one ``generate`` call cannot play).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlbits.tasks import get_task

    module = get_task(task)
    if hasattr(module, "make_env"):
        raise ValueError(
            f"evaluate: task {task!r} is played in an environment (its module has make_env); play its episodes "
            "with the multi-turn rollout instead (docs/tasks.md)"
        )
    prompts = module.prompts(split)[:n]
    model = AutoModelForCausalLM.from_pretrained(model_path, use_safetensors=True).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    if getattr(module, "BASE_MODEL", None) is not None:  # a real-data task: no recipe
        max_new_tokens = max_new_tokens or REAL_TASK_MAX_NEW_TOKENS
    else:
        max_new_tokens = max_new_tokens or recipe(task)["max_new_tokens"]
    from rlbits.text import chat_prompts  # here: ``import rlbits`` imports this module and stays light

    texts = chat_prompts(tokenizer, prompts) if getattr(module, "CHAT", False) else prompts
    responses = hf_responses(
        model, tokenizer, texts, max_new_tokens, greedy=greedy, temperature=temperature, batch_size=batch_size,
        seed=seed,
    )
    rewards = module.reward(prompts, responses)
    return dict(
        mean=statistics.fmean(rewards),
        std=statistics.pstdev(rewards),
        accuracy=sum(r == 1.0 for r in rewards) / len(rewards),
        n=len(prompts),
        samples=list(zip(prompts, responses, rewards, strict=True))[:8],
    )


def plateau_check(
    model_path: str | os.PathLike,
    task: str,
    *,
    cpu_seconds: float = 300.0,
    lr: float | None = None,
    seed: int = 1,
    n: int | None = None,
) -> dict:
    """Greedy test score of a base model, then again after ``cpu_seconds`` more supervised training.

    Evidence that a base model sits on a plateau of its corpus, not in the middle of its learning curve
    (an RL gain over a half-trained model could be had by more supervised training too). The model trains
    on a fresh corpus draw (``task.corpus(corpus_size, seed)``) with the build's settings, at ``lr``
    (default: the end of the build's schedule, 10% of its peak) after a 20-step warm-up, with fresh AdamW
    state, until this process has used ``cpu_seconds`` of CPU time (``time.process_time``; with one torch
    thread that is the wall-clock time on an idle core). Nothing is saved; the caller's RNG state is kept.

    Returns:
        ``{"before": evaluate(...) of the model, "after": the same after training, "steps": steps taken,
        "cpu_seconds": CPU time used, "lr": the rate}``; ``evaluate`` runs greedy on ``n`` test prompts.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlbits.tasks import get_task

    module = get_task(task)
    info = json.loads((Path(model_path) / "base_model.json").read_text())
    lr = lr if lr is not None else 0.1 * info["lr"]
    before = evaluate(model_path, task, n=n)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path, use_safetensors=True).train()
    texts = module.corpus(info["corpus_size"], seed)
    data, lengths = encode_corpus(tokenizer, texts, info["n_positions"])
    starts = loss_starts(tokenizer, data, info.get("loss_after"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.01)
    steps, start = 0, time.process_time()
    with torch.random.fork_rng(devices=[]):
        order = torch.Generator().manual_seed(seed)
        while time.process_time() - start < cpu_seconds:
            idx = torch.randint(len(data), (info["batch_size"],), generator=order)
            train_step(model, optimizer, data, lengths, starts, idx, lr * min(1.0, (steps + 1) / 20))
            steps += 1
    used = time.process_time() - start
    with tempfile.TemporaryDirectory() as tmp:
        model.eval().save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        after = evaluate(tmp, task, n=n)
    return dict(before=before, after=after, steps=steps, cpu_seconds=round(used, 1), lr=lr)


__all__ = ["REAL_TASK_MAX_NEW_TOKENS", "evaluate", "hf_responses", "plateau_check"]
