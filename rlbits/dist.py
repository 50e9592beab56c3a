"""Deprecated alias of ``rlbits.distributed`` (renamed: ``dist/`` reads as build output to packaging tools).

``import rlbits.dist.checkpoint`` and ``from rlbits.dist.env import DistEnv`` keep working, with a
``DeprecationWarning``; new code imports ``rlbits.distributed``.
"""

from __future__ import annotations

import importlib
import sys
import warnings

warnings.warn("rlbits.dist is renamed rlbits.distributed; the old name will be removed", DeprecationWarning, stacklevel=2)

_SUBMODULES = ("env", "reduce", "parallelize", "checkpoint")
for _name in _SUBMODULES:
    sys.modules[f"{__name__}.{_name}"] = importlib.import_module(f"rlbits.distributed.{_name}")
    globals()[_name] = sys.modules[f"{__name__}.{_name}"]
__path__: list[str] = []  # a package to the import system, so ``rlbits.dist.env`` resolves from sys.modules
