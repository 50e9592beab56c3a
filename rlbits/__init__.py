"""rlbits: small composable pieces for reinforcement learning on language models.

Pure tensor kernels live in ``rlbits.functional`` and are re-exported here; TensorDict batch helpers in
``rlbits.batch``; sampling and scoring in ``rlbits.rollout``; loops in ``rlbits.loops``.
"""

from rlbits.functional import *  # noqa: F403
from rlbits.functional import __all__ as _functional_all

__version__ = "0.1.0"

__all__ = [*_functional_all]
