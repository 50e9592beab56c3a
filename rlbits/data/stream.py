"""The prompt stream: epochs over a prompt list in a seeded order, resumable from a sample count; and the
up-front checks of user prompts (``check_prompts``, ``check_prompt_lengths``, ``read_prompts``).

Every loop draws its prompts in this order, and ILQL its offline rows (``rlbits.data.offline.EpochSampler``)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from tensordict import NonTensorStack, TensorDict

from rlbits._io import read_jsonl
from rlbits._seeds import generator
from rlbits.distributed.env import DistEnv


def prompt_batch(prompts: Sequence[str]) -> TensorDict:
    """A batch of prompt strings, ``prompt_text`` [n]: the input of a loop's ``rollout`` phase."""
    if isinstance(prompts, str):
        raise ValueError("prompts must be a list of strings, got a single str (wrap it in a list)")
    return TensorDict({"prompt_text": NonTensorStack.from_list(list(prompts))}, batch_size=[len(prompts)])


class PromptStream:
    """Yields prompts in a fresh permutation each epoch, the permutation a function of ``(seed, epoch)``
    (``derive_seed(seed, 0, "prompts/epoch{e}")``: the same on every rank).

    The whole position is ``consumed_samples``: a resumed stream built with the same prompts and seed and
    ``consumed_samples`` continues exactly where the interrupted one stopped, with no generator state
    (``state_dict()``/``load_state_dict()`` carry it in a checkpoint).
    """

    def __init__(self, prompts: Sequence[Any], seed: int, consumed_samples: int = 0) -> None:
        if not prompts:
            raise ValueError("the prompt list is empty; a task or dataset must give at least one prompt")
        self.prompts = list(prompts)
        self.seed = seed
        self.consumed_samples = consumed_samples

    def _order(self, epoch: int) -> list[int]:
        gen = generator(self.seed, 0, f"prompts/epoch{epoch}")
        return torch.randperm(len(self.prompts), generator=gen).tolist()

    def __len__(self) -> int:
        return len(self.prompts)

    @property
    def epoch(self) -> int:
        """Current epoch (0-based): how many full passes have been consumed."""
        return self.consumed_samples // len(self.prompts)

    def next(self, n: int) -> list[Any]:
        """The next ``n`` prompts (crossing into the next epoch's permutation when one ends)."""
        out = []
        while len(out) < n:
            epoch, pos = divmod(self.consumed_samples, len(self.prompts))
            order = self._order(epoch)
            take = min(n - len(out), len(order) - pos)
            out.extend(self.prompts[i] for i in order[pos : pos + take])
            self.consumed_samples += take
        return out

    def next_batch(self, n: int, env: DistEnv | None = None) -> TensorDict:
        """This rank's ``n`` prompts of the next ``n * world_size`` (every rank draws the same, keeps its
        slice) as a batch with ``prompt_text`` [n], the input of a loop's ``rollout`` phase."""
        env = env or DistEnv()
        return prompt_batch(self.next(n * env.world_size)[env.rank * n : (env.rank + 1) * n])

    def state_dict(self) -> dict[str, int]:
        return {"consumed_samples": self.consumed_samples}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Restore the position ``state_dict`` wrote.

        Raises:
            ValueError: ``consumed_samples`` is missing or not an int >= 0.
        """
        self.consumed_samples = checked_count(state, "consumed_samples")


def checked_count(state: Any, key: str) -> int:
    """``state[key]`` if it is an int >= 0 (not a bool); a saved data position's count or seed.

    Raises:
        ValueError: naming ``key`` and what it holds.
    """
    value = state.get(key) if isinstance(state, dict) else None
    if type(value) is not int or value < 0:
        raise ValueError(f"field {key!r} must be an int >= 0, got {value!r:.80}")
    return value


class PromptError(ValueError):
    """User prompts are unusable (not a list of strings, empty, too long); the message names the prompt."""


def check_prompts(prompts: Any, what: str = "prompts") -> list[str]:
    """Check user prompts before any model is loaded; return them as a list of str.

    ``what`` names the argument in messages (``prompts``, ``val_prompts``); prompts are numbered from 1 in
    the order given.

    Raises:
        PromptError (a ValueError): ``prompts`` is a single string (it would be read as one prompt per
            character), not a sequence, empty, or holds a non-str, an empty / whitespace-only prompt, or one
            that is not valid Unicode (a lone surrogate such as ``"\ud800"``, which no tokenizer can encode).
    """
    if isinstance(prompts, (str, bytes)):
        text = prompts if isinstance(prompts, str) else repr(prompts)
        raise PromptError(
            f"{what} is a single string ({text[:40]!r}); pass a list of prompts, e.g. {what}=[{text[:40]!r}]"
        )
    if isinstance(prompts, dict) or not isinstance(prompts, Sequence):
        raise PromptError(f"{what} must be a list of strings, got {type(prompts).__name__}")
    out = list(prompts)
    if not out:
        raise PromptError(f"{what} is an empty list; give at least one prompt (or None for the task's)")
    for i, prompt in enumerate(out, start=1):
        if not isinstance(prompt, str):
            raise PromptError(
                f"prompt {i} of your {what} is not a string: {prompt!r:.60} ({type(prompt).__name__}); "
                "every prompt must be a str"
            )
        if not prompt.strip():
            raise PromptError(f"prompt {i} of your {what} is empty{' (whitespace only)' if prompt else ''}")
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError as e:
            raise PromptError(
                f"prompt {i} of your {what} is not valid Unicode: {e.reason} at character {e.start} "
                f"({prompt[max(0, e.start - 20) : e.start + 20]!r}); every prompt must be encodable as UTF-8"
            ) from None
    return out


def read_prompts(path: str | Path, what: str = "val_prompts") -> list[str]:
    """Prompts from a file: ``.jsonl`` (one ``{"prompt": ...}`` object per line), otherwise plain text with
    one prompt per line (blank lines skipped). Checked by ``check_prompts``.

    Raises:
        FileNotFoundError: no such file. PromptError: a bad line, text that is not UTF-8, or no prompt at all.
    """
    path = Path(path).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"{what} file {str(path)!r} does not exist")
    try:
        if path.suffix == ".jsonl":
            rows = read_jsonl(
                path, what=what, error=PromptError, expected='an object with a "prompt" key',
                accept=lambda row: isinstance(row, dict) and "prompt" in row,
            )
            prompts = [row["prompt"] for row in rows]
        else:
            prompts = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    except UnicodeDecodeError as e:
        raise PromptError(
            f"{what} file {str(path)!r} is not UTF-8 text: {e.reason} at byte {e.start}"
        ) from None
    return check_prompts(prompts, f"{what} (from {path.name})")


def check_prompt_lengths(
    prompts: Sequence[str], tokenizer: Any, *, max_new_tokens: int, max_positions: int | None, what: str = "prompts"
) -> int:
    """Check that the longest prompt plus ``max_new_tokens`` fits the model's context ``max_positions`` (None:
    no limit known); returns the longest prompt's token count.

    Raises:
        PromptError: a prompt too long, naming it (numbered from 1) and the limits.
    """
    lengths = [len(ids) for ids in tokenizer(list(prompts), add_special_tokens=False)["input_ids"]]
    longest = max(range(len(lengths)), key=lengths.__getitem__)
    if max_positions is not None and lengths[longest] + max_new_tokens > max_positions:
        raise PromptError(
            f"prompt {longest + 1} of your {what} has {lengths[longest]} tokens; with max_new_tokens = "
            f"{max_new_tokens} that is {lengths[longest] + max_new_tokens}, more than the model's context of "
            f"{max_positions} positions; shorten the prompts or lower max_new_tokens"
        )
    return lengths[longest]


__all__ = ["PromptError", "PromptStream", "check_prompt_lengths", "check_prompts", "read_prompts"]
