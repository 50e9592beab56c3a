"""The prompt stream: epochs over a prompt list in a seeded order, resumable from a sample count."""

from __future__ import annotations

import torch


class PromptStream:
    """Yields prompts in a fresh permutation each epoch, the permutation a function of ``(seed, epoch)``.

    The whole position is ``consumed_samples``: a resumed stream built with the same prompts and seed and
    ``consumed_samples`` continues exactly where the interrupted one stopped, with no generator state.
    """

    def __init__(self, prompts: list[str], seed: int, consumed_samples: int = 0) -> None:
        if not prompts:
            raise ValueError("the prompt list is empty; a task or dataset must give at least one prompt")
        self.prompts = list(prompts)
        self.seed = seed
        self.consumed_samples = consumed_samples

    def _order(self, epoch: int) -> list[int]:
        gen = torch.Generator().manual_seed(self.seed * 100_003 + epoch)
        return torch.randperm(len(self.prompts), generator=gen).tolist()

    @property
    def epoch(self) -> int:
        """Current epoch (0-based): how many full passes have been consumed."""
        return self.consumed_samples // len(self.prompts)

    def next(self, n: int) -> list[str]:
        """The next ``n`` prompts (crossing into the next epoch's permutation when one ends)."""
        out = []
        while len(out) < n:
            epoch, pos = divmod(self.consumed_samples, len(self.prompts))
            order = self._order(epoch)
            take = min(n - len(out), len(order) - pos)
            out.extend(self.prompts[i] for i in order[pos : pos + take])
            self.consumed_samples += take
        return out
