"""Deprecated alias of ``rlbits.zoo.pretrain`` (it re-exported ``rlbits.tasks.pretrain``, which moved there).

``import rlbits.models.pretrain as pt`` and ``from rlbits.models.pretrain import pretrain`` keep working,
with a ``DeprecationWarning``. The name is bound to the ``rlbits.zoo.pretrain`` module object itself, so
patching an attribute through either name patches both. New code: ``rlbits.zoo.pretrain``, and
``rlbits.zoo.base_model(task)`` for a task's base model.

This module imports a layer above its own (``zoo``); ``tests/test_layering.py`` exempts it (``ALIASES``) on
the condition that it imports nothing else above its layer and no rlbits module imports it.
"""

from __future__ import annotations

import sys
import warnings

import rlbits.zoo.pretrain as _target

warnings.warn(
    "rlbits.models.pretrain is deprecated: base models moved to rlbits.zoo; use rlbits.zoo.pretrain "
    "(or rlbits.zoo.base_model(task) for a task's base model)",
    DeprecationWarning,
    stacklevel=2,
)
sys.modules[__name__] = _target
