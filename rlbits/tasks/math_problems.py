"""Math task: two-term integer sums and differences from ``reasoning-gym``, scored by its own verifier.

- Problems: reasoning-gym's ``chain_sum`` generator (the ``real`` extra) at ``DIFFICULTY``: two terms of one or
  two digits each, ``+`` or ``-`` (``"State the final answer to the following arithmetic problem: 21 - 62 ="``,
  answer ``"-41"``). A problem belongs to the test split when the sha256 of its question is 0 modulo
  ``TEST_EVERY`` (4), else to the train split: disjoint by construction, with the same mix of difficulties.
  ``"test"``: the test problems among ``create_dataset("chain_sum", seed=TEST_SEED, size=N_TEST_DRAWS)``;
  ``"train"``: the train problems among ``seed=TRAIN_SEED, size=N_TRAIN_DRAWS``; fixed, in the generator's
  order. Repeats are kept, as in reasoning-gym's own evaluations: one-digit problems are half of the draws
  but only 200 distinct ones exist, so removing repeats would make a split mostly two-digit problems and
  change its difficulty (SmolLM2-135M: 17% greedy on de-duplicated draws, about 30% on the draws as they come).
- **Prompt format.** ``prompts(split)`` returns the question text exactly as reasoning-gym writes it. The
  task is meant for an instruct model: ``CHAT = True``, so the loops send each question as the one user turn
  of the tokenizer's chat template with the generation prompt appended (``rlbits.text.chat_prompts``; the
  ``chat_template`` config key overrides it). With SmolLM2's template that is its default system turn
  ("You are a helpful AI assistant named SmolLM, trained by Hugging Face"), the user turn with the question
  and ``<|im_start|>assistant\\n``. No instruction is added: SmolLM2-135M-Instruct already answers "The
  answer is 13." to these questions.
- ``reward``: the answer is the text of the last ``<answer>...</answer>`` tag if the response has one
  (reasoning-gym's convention, ``reasoning_gym.utils.extract_answer``), else the first number in the response
  (``-41``, ``1,000``, ``2.5``); it is scored by the dataset's own ``score_answer``: 1.0 when the number
  equals the true answer; when it does not but contains it as a substring (``13`` for ``3``), the package's
  partial credit ``len(true) / len(answer)``; else 0.0. Accuracy is the fraction scoring 1.0.
- A prompt is matched to its problem by its question text: the prompt itself, or one of its lines (the
  decoded chat-formatted prompt the reward receives holds the question on a line of its own). A prompt
  that holds no known question raises ValueError.
- No corpus: the base model is the real ``smollm2-135m`` (``BASE_MODEL``).

Base rate of SmolLM2-135M-Instruct (the dequantised Q4_1 weights, ``rlbits model get smollm2-135m``) on
held-out problems: see docs/real_models.md (between 20% and 60%, the range where RL has something to earn).
"""

from __future__ import annotations

import hashlib
import re
from functools import cache
from typing import Any

from rlbits.tasks._common import check_pairs, check_split
from rlbits.tasks.movie_reviews import missing_extra
from rlbits.tasks.sentiment import strip_eos

NAME = "math"
SPLITS = ("train", "test")
DATASET = "chain_sum"
DIFFICULTY = dict(min_terms=2, max_terms=2, min_digits=1, max_digits=2, allow_negation=False)
TEST_EVERY = 4
TRAIN_SEED, N_TRAIN_DRAWS = 1, 20_000
TEST_SEED, N_TEST_DRAWS = 2, 2_000
BASE_MODEL = "smollm2-135m"
CHAT = True

# An integer or decimal with optional sign and thousands separators: "-41", "1,000", "2.5".
_NUMBER = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?")


def _reasoning_gym():
    try:
        import reasoning_gym
    except ImportError as e:
        raise missing_extra("reasoning-gym", f"the {NAME} task") from e
    return reasoning_gym


def dataset(seed: int, size: int) -> Any:
    """reasoning-gym's ``chain_sum`` dataset at ``DIFFICULTY`` (its entries: ``question``, ``answer``,
    ``metadata``; its ``score_answer(answer, entry)`` is the verifier)."""
    return _reasoning_gym().create_dataset(DATASET, seed=seed, size=size, **DIFFICULTY)


def split_of(question: str) -> str:
    """``"test"`` if the sha256 of ``question`` is 0 modulo ``TEST_EVERY``, else ``"train"``."""
    return "test" if int(hashlib.sha256(question.encode()).hexdigest(), 16) % TEST_EVERY == 0 else "train"


@cache
def _problems() -> tuple[dict[str, list[dict]], dict[str, tuple[Any, dict]]]:
    # ({split: entries}, {question: (dataset, entry)}).
    index: dict[str, tuple[Any, dict]] = {}
    splits: dict[str, list[dict]] = {}
    for split, seed, size in (("train", TRAIN_SEED, N_TRAIN_DRAWS), ("test", TEST_SEED, N_TEST_DRAWS)):
        ds = dataset(seed, size)
        splits[split] = [entry for entry in ds if split_of(entry["question"]) == split]
        index.update((entry["question"], (ds, entry)) for entry in splits[split])
    return splits, index


def problems(split: str) -> list[dict]:
    """The reasoning-gym entries of ``split`` (``question``, ``answer``, ``metadata``), in prompt order.

    Raises:
        ValueError: another split. ImportError: ``reasoning-gym`` missing (names the ``real`` extra).
    """
    check_split(split, SPLITS)
    return list(_problems()[0][split])


def prompts(split: str) -> list[str]:
    """The questions of ``split`` (``"train"``: about 15,000, ``"test"``: about 500; repeats kept, see the
    module docstring), disjoint and fixed; the loops format them as a chat turn (``CHAT = True``).

    Raises:
        ValueError: another split. ImportError: ``reasoning-gym`` missing (names the ``real`` extra).
    """
    return [entry["question"] for entry in problems(split)]


def extract_answer(response: str) -> str | None:
    """The answer a response gives: its last ``<answer>`` tag's text, else its first number, else None."""
    tagged = _reasoning_gym().utils.extract_answer(response)
    if tagged is not None:
        return tagged
    match = _NUMBER.search(response)
    return match.group(0) if match else None


def find_problem(prompt: str) -> tuple[Any, dict]:
    """``(dataset, entry)`` of the problem ``prompt`` asks: the prompt is its question, or holds it as a line.

    Raises:
        ValueError: no known question in ``prompt``.
    """
    index = _problems()[1]
    if prompt in index:
        return index[prompt]
    for line in prompt.splitlines():
        if line.strip() in index:
            return index[line.strip()]
    raise ValueError(f"prompt {prompt[-120:]!r} holds no question of the {NAME} task (train or test split)")


def reward(prompts: list[str], responses: list[str]) -> list[float]:
    """reasoning-gym's ``score_answer`` of each response's answer (``extract_answer``) for its prompt's problem:
    1.0 right, the package's partial credit for an answer that contains the right one, else 0.0.

    Raises:
        TypeError: an argument is not a list of str. ValueError: the lists differ in length, or a prompt holds
            no question of this task.
    """
    check_pairs(prompts, responses)
    out = []
    for prompt, response in zip(prompts, responses, strict=True):
        ds, entry = find_problem(prompt)
        out.append(float(ds.score_answer(extract_answer(strip_eos(response)), entry)))
    return out


def corpus(n: int, seed: int) -> list[str]:
    """Not available: the math task's base model is a real pretrained model, not one trained here.

    Raises:
        NotImplementedError: always (use ``rlbits.zoo.base_model("math")``, i.e. ``smollm2-135m``).
    """
    raise NotImplementedError(
        f"the {NAME} task has no pretraining corpus: its base model is the real model {BASE_MODEL!r} "
        f"(rlbits.zoo.base_model({NAME!r}), `rlbits model get {BASE_MODEL}`)"
    )
