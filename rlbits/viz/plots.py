"""Plots of a run's metrics (matplotlib): reward, KL, losses, entropy, clip fraction, throughput.

``plot_run("runs/a")`` draws one run; ``plot_run(["runs/a", "runs/b"])`` overlays several, one colour per
run. Every line is labelled ``"RUN: METRIC"`` and holds exactly the logged ``(step, value)`` pairs, so a test
(or a reader with ``line.get_xdata()``) can check what is drawn.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rlbits.loops.run import read_metrics

# (title, metric names drawn in it); a panel is drawn if any run logged one of its metrics.
PANELS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("reward", ("rewards", "val_reward")),
    ("KL to reference", ("init_policy_kl", "kl_loss")),
    ("actor loss", ("actor_loss",)),
    ("critic loss", ("critic_loss",)),
    ("ILQL losses", ("loss_q", "loss_v", "loss_cql", "loss_awac")),
    ("entropy (nats/token)", ("entropy",)),
    ("clip fraction", ("clipfrac",)),
    ("tokens / s", ("tokens_per_s",)),
    ("seconds / step", ("time/step",)),
)


def _pyplot():
    # No matplotlib.use(...) here: it would replace Jupyter's inline backend. Without a display matplotlib
    # falls back to Agg by itself (CI, the CLI).
    import matplotlib.pyplot as plt

    return plt


def series(rows: Sequence[Mapping[str, Any]], key: str) -> tuple[list[float], list[float]]:
    """``(steps, values)`` of ``key`` in metric rows (rows without it, or with a null value, are skipped)."""
    pts = [(row["step"], row[key]) for row in rows if row.get(key) is not None]
    return [p[0] for p in pts], [p[1] for p in pts]


def active_panels(runs: Sequence[Sequence[Mapping[str, Any]]], panels=PANELS) -> list[tuple[str, list[str]]]:
    """The panels of ``panels`` with at least one metric logged by some run, each with those metrics."""
    out = []
    for title, keys in panels:
        present = [k for k in keys if any(row.get(k) is not None for rows in runs for row in rows)]
        if present:
            out.append((title, present))
    return out


def plot_run(
    run_dirs: str | Path | Sequence[str | Path],
    out: str | Path | None = None,
    labels: Sequence[str] | None = None,
    *,
    metrics: Sequence[str] | None = None,
    cols: int = 2,
):
    """Plot one run, or several overlaid, and return the matplotlib ``Figure`` (saved to ``out`` if given).

    Args:
        run_dirs: a run directory (holding ``metrics.jsonl``) or a list of them.
        out: optional image path (PNG, SVG, ... by suffix).
        labels: one name per run for the legends; default the folder names.
        metrics: draw one panel per listed metric instead of the default panels (``PANELS``: reward, KL,
            actor/critic/ILQL losses, entropy, clip fraction, tokens/s, seconds/step).
        cols: panels per row.

    Each panel plots every logged metric of its group against ``step``; each line's label is
    ``"LABEL: METRIC"`` and its data are the logged values (null values, i.e. non-finite ones, skipped).

    Raises:
        FileNotFoundError: a folder has no ``metrics.jsonl``.
        ValueError: ``labels`` has the wrong length, or no requested metric was logged.
    """
    plt = _pyplot()
    dirs = [run_dirs] if isinstance(run_dirs, (str, Path)) else list(run_dirs)
    if labels is not None and len(labels) != len(dirs):
        raise ValueError(f"labels has {len(labels)} names for {len(dirs)} runs")
    labels = list(labels) if labels is not None else [Path(d).name for d in dirs]
    runs = [read_metrics(d) for d in dirs]
    panels = active_panels(runs, tuple((m, (m,)) for m in metrics) if metrics is not None else PANELS)
    if not panels:
        wanted = ", ".join(metrics) if metrics is not None else "any of the default metrics"
        raise ValueError(f"none of the runs {', '.join(map(str, dirs))} logged {wanted}")
    rows_n = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows_n, cols, figsize=(5 * cols, 2.8 * rows_n), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    styles = ("-", "--", ":", "-.")
    for ax, (title, keys) in zip(axes.flat, panels, strict=False):
        for i, (label, rows) in enumerate(zip(labels, runs, strict=True)):
            for j, key in enumerate(keys):
                xs, ys = series(rows, key)
                if xs:
                    ax.plot(xs, ys, color=colors[i % len(colors)], linestyle=styles[j % len(styles)],
                            marker="." if len(xs) < 30 else None, label=f"{label}: {key}")
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    fig.tight_layout()
    if out is not None:
        fig.savefig(out, dpi=110)
    return fig


def plot_compare(
    groups: Mapping[str, Sequence[str | Path]],
    metric: str = "rewards",
    *,
    ax=None,
    out: str | Path | None = None,
    band: bool = True,
):
    """Mean (and min-max band) of ``metric`` over several seeds, one line per group; returns the figure.

    For research notebooks: ``plot_compare({"rloo": rloo_dirs, "grpo": grpo_dirs}, "val_reward")``. The
    mean is over the runs of a group at each step they all logged; the line's label is the group name and
    its data are those means.

    Raises:
        FileNotFoundError: a folder has no ``metrics.jsonl``.
        ValueError: a group is empty or its runs share no step with ``metric`` logged.
    """
    plt = _pyplot()
    if ax is None:
        fig, ax = plt.subplots(figsize=(6, 3.5))
    else:
        fig = ax.figure
    for name, dirs in groups.items():
        if not dirs:
            raise ValueError(f"group {name!r} has no runs")
        per_run = [dict(zip(*series(read_metrics(d), metric), strict=True)) for d in dirs]
        steps = sorted(set.intersection(*(set(r) for r in per_run)))
        if not steps:
            raise ValueError(f"the runs of group {name!r} share no step with {metric!r} logged")
        table = [[r[s] for r in per_run] for s in steps]
        mean = [sum(v) / len(v) for v in table]
        (line,) = ax.plot(
            steps, mean, marker="." if len(steps) < 30 else None, label=f"{name} (n={len(dirs)})"
        )
        line.set_gid(name)
        if band and len(dirs) > 1:
            ax.fill_between(
                steps, [min(v) for v in table], [max(v) for v in table], color=line.get_color(), alpha=0.2
            )
    ax.set_xlabel("step")
    ax.set_ylabel(metric)
    ax.legend(fontsize=8)
    fig.tight_layout()
    if out is not None:
        fig.savefig(out, dpi=110)
    return fig


__all__ = ["PANELS", "active_panels", "plot_compare", "plot_run", "series"]
