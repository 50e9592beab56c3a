"""The prompt stream: epochs over a prompt list in a seeded order, resumable from a sample count.

Every loop draws its prompts in this order, and ILQL its offline rows (``rlbits.data.offline.EpochSampler``);
``rlbits.loops.data`` re-exports it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from tensordict import NonTensorStack, TensorDict

from rlbits._seeds import derive_seed
from rlbits.distributed.env import DistEnv


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
        gen = torch.Generator().manual_seed(derive_seed(self.seed, 0, f"prompts/epoch{epoch}"))
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
        prompts = self.next(n * env.world_size)[env.rank * n : (env.rank + 1) * n]
        return TensorDict({"prompt_text": NonTensorStack.from_list(list(prompts))}, batch_size=[len(prompts)])

    def state_dict(self) -> dict[str, int]:
        return {"consumed_samples": self.consumed_samples}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.consumed_samples = int(state["consumed_samples"])


__all__ = ["PromptStream"]
