"""Plots of a run's metrics (matplotlib): reward, KL, losses, entropy, clip fraction, throughput."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from rlbits.loops.run import read_metrics

# (title, metric names tried in order); a panel is drawn if any run logged one of them.
PANELS = (
    ("reward", ("rewards", "val_reward")),
    ("KL to reference (nats/seq)", ("init_policy_kl",)),
    ("actor loss", ("actor_loss",)),
    ("critic loss", ("critic_loss",)),
    ("entropy", ("entropy",)),
    ("clip fraction", ("clipfrac",)),
    ("tokens / s", ("tokens_per_s",)),
    ("seconds / step", ("time/step",)),
)


def plot_run(run_dirs: str | Path | Sequence[str | Path], out: str | Path | None = None, labels: Sequence[str] | None = None):
    """Plot one run, or several overlaid, and return the matplotlib figure (saved to ``out`` if given).

    Each panel plots every logged metric of its group against ``step``; lines are labelled
    ``run: metric``, so tests and readers can find the data.
    """
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    dirs = [run_dirs] if isinstance(run_dirs, (str, Path)) else list(run_dirs)
    labels = list(labels) if labels else [Path(d).name for d in dirs]
    runs = [read_metrics(d) for d in dirs]
    panels = [(title, [k for k in keys if any(k in row for rows in runs for row in rows)]) for title, keys in PANELS]
    panels = [(t, ks) for t, ks in panels if ks]
    cols = 2
    rows_n = max(1, -(-len(panels) // cols))
    fig, axes = plt.subplots(rows_n, cols, figsize=(10, 2.8 * rows_n), squeeze=False)
    for ax, (title, keys) in zip(axes.flat, panels, strict=False):
        for label, rows in zip(labels, runs, strict=False):
            for key in keys:
                pts = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
                if pts:
                    xs, ys = zip(*pts, strict=False)
                    ax.plot(xs, ys, marker="." if len(pts) < 30 else None, label=f"{label}: {key}")
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.tight_layout()
    if out is not None:
        fig.savefig(out, dpi=110)
    return fig
