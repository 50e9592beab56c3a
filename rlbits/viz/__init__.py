"""Plots, dashboards and rollout views for notebooks. Nothing in the core imports this package.

- ``plot_run(run_dirs)``, ``plot_compare(groups, metric)``: matplotlib figures of logged metrics.
- ``plot_tokens(batch, key, row)``: one response's tokens coloured by advantage, KL, logprob, ...
- ``Dashboard``: live curves, latest samples and a Stop button, as a ``rlbits.train`` callback.
- ``RolloutBrowser``: page through ``samples.jsonl`` or a batch; multi-turn episodes turn by turn
  (``episode_html``, ``turns_html``).

Names load lazily, so ``import rlbits.viz`` does not import matplotlib or ipywidgets until used.
"""

from __future__ import annotations

import importlib

_LAZY = {
    "plot_run": "rlbits.viz.plots",
    "plot_compare": "rlbits.viz.plots",
    "plot_tokens": "rlbits.viz.tokens",
    "tokens_html": "rlbits.viz.tokens",
    "Dashboard": "rlbits.viz.dashboard",
    "samples_table": "rlbits.viz.dashboard",
    "RolloutBrowser": "rlbits.viz.browser",
    "read_samples": "rlbits.viz.browser",
    "episode_html": "rlbits.viz.episodes",
    "turns_html": "rlbits.viz.episodes",
}

__all__ = list(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'rlbits.viz' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
