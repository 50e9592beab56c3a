"""Plots, dashboards and rollout views for notebooks. Nothing in the core imports this package.

- ``plot_run(run_dirs)``, ``plot_compare(groups, metric)``: matplotlib figures of logged metrics.
- ``plot_tokens(batch, key, row)``: one response's tokens coloured by advantage, KL, logprob, ...
- ``Dashboard``: live curves, latest samples and a Stop button, as a ``rlbits.train`` callback.
- ``iqm_table``, ``iqm_curves``, ``plot_iqm_curves``: interquartile means over seeds with bootstrap confidence
  intervals (rliable, the ``stats`` extra), e.g. of an ``rlbits.sweep``.
- ``RolloutBrowser``: page through ``samples.jsonl`` or a batch; multi-turn episodes turn by turn
  (``episode_html``, ``turns_html``).

Names load lazily, so ``import rlbits.viz`` does not import matplotlib or ipywidgets until used.
"""

from __future__ import annotations

from rlbits._lazy import lazy_exports

_LAZY = {
    # plots
    "PANELS": "rlbits.viz.plots",
    "active_panels": "rlbits.viz.plots",
    "plot_compare": "rlbits.viz.plots",
    "plot_run": "rlbits.viz.plots",
    "series": "rlbits.viz.plots",
    # tokens
    "color_scale": "rlbits.viz.tokens",
    "drawn_mask": "rlbits.viz.tokens",
    "observation_flags": "rlbits.viz.tokens",
    "plot_tokens": "rlbits.viz.tokens",
    "row_values": "rlbits.viz.tokens",
    "token_labels": "rlbits.viz.tokens",
    "tokens_html": "rlbits.viz.tokens",
    # dashboard
    "DEFAULT_PANELS": "rlbits.viz.dashboard",
    "Dashboard": "rlbits.viz.dashboard",
    "samples_table": "rlbits.viz.dashboard",
    # stats
    "iqm": "rlbits.viz.stats",
    "iqm_curves": "rlbits.viz.stats",
    "iqm_table": "rlbits.viz.stats",
    "plot_iqm_curves": "rlbits.viz.stats",
    "sweep_curves": "rlbits.viz.stats",
    "sweep_scores": "rlbits.viz.stats",
    # browser
    "RolloutBrowser": "rlbits.viz.browser",
    "batch_rows": "rlbits.viz.browser",
    "episodes_table": "rlbits.viz.browser",
    "is_episode": "rlbits.viz.browser",
    "read_samples": "rlbits.viz.browser",
    # episodes
    "episode_header": "rlbits.viz.episodes",
    "episode_html": "rlbits.viz.episodes",
    "turn_header": "rlbits.viz.episodes",
    "turns_html": "rlbits.viz.episodes",
}

__all__ = list(_LAZY)

__getattr__, __dir__ = lazy_exports(__name__, _LAZY)
