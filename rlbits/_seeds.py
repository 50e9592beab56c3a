"""Seeds: one derivation for every random stream of a run (stdlib and torch only, so any layer can use it).

``derive_seed(seed, rank, stream)`` names each stream (sampling, minibatch shuffles, validation, prompt order,
initialisation), so no two streams share a seed by accident (``seed + 1000 * rank`` would give seed 1000 on
rank 0 and seed 0 on rank 1 one stream). ``generator`` is a ``torch.Generator`` seeded by it; ``rlbits.loops.runtime``
re-exports both.
"""

from __future__ import annotations

import hashlib

import torch


def derive_seed(seed: int, rank: int, stream: str) -> int:
    """The seed of one named random stream of a run: 63 bits of blake2b over ``(seed, rank, stream)``.

    Args:
        seed: the run's ``cfg.seed``.
        rank: the process's rank (0 for streams every rank must share, such as the prompt order).
        stream: the stream's name (``"sampling"``, ``"minibatch"``, ``"validation"``, ``"prompts/epoch3"``).

    Returns:
        An int in [0, 2**63), different for different triples with overwhelming probability.
    """
    digest = hashlib.blake2b(f"{seed}|{rank}|{stream}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def generator(seed: int, rank: int, stream: str, device: torch.device | str = "cpu") -> torch.Generator:
    """A ``torch.Generator`` on ``device`` seeded with ``derive_seed(seed, rank, stream)``."""
    return torch.Generator(device=device).manual_seed(derive_seed(seed, rank, stream))


__all__ = ["derive_seed", "generator"]
