"""Scores over seeds, summarised as Agarwal et al. (2021) recommend: the interquartile mean with stratified
bootstrap confidence intervals, for final scores and for learning curves (the ``rliable`` package; install
``rlbits[stats]``).

    rows = rlbits.sweep(config, {"policy_loss": ["vanilla", "gspo"], "seed": [0, 1, 2]}, out_dir="runs/x")
    table = iqm_table(sweep_scores(rows, "val_reward", by="policy_loss"))   # {loss: (iqm, low, high)}
    steps, curves = sweep_curves(rows, "val_reward", by="policy_loss")       # {loss: [runs, steps]}
    plot_iqm_curves(steps, iqm_curves(curves))

The interquartile mean (IQM) is the mean of the middle 50% of the runs (``scipy.stats.trim_mean`` cutting 25%
from each end): less thrown by one outlier seed than the mean, less wasteful of runs than the median. Its
confidence interval is the percentile interval of the IQMs of bootstrap resamples of the runs; "stratified":
with several tasks, each task's runs are resampled separately (here every group's runs are one task's). With
few runs the interval is wide, and honestly so: that is the point. Reference: R. Agarwal, M. Schwarzer,
P. S. Castro, A. Courville, M. G. Bellemare, "Deep Reinforcement Learning at the Edge of the Statistical
Precipice", NeurIPS 2021 (arXiv:2108.13264).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from rlbits.loops.logger import read_metrics
from rlbits.viz.plots import _pyplot, series

CI = tuple[float, float, float]
"""(IQM, lower bound, upper bound)."""


def _rliable():
    try:
        from rliable import library, metrics
    except ImportError as e:
        raise ImportError(f"the statistics need rliable: pip install 'rlbits[stats]' ({e})") from e
    return library, metrics


def _interval_estimates(library, data, func, reps: int, confidence: float, seed: int):
    """rliable's stratified bootstrap (percentile intervals), seeded: rliable draws its resamples from NumPy's
    global generator (not from the ``random_state`` it takes), so that is seeded here and restored after."""
    state = np.random.get_state()
    np.random.seed(seed)
    try:
        return library.get_interval_estimates(data, func, reps=reps, confidence_interval_size=confidence)
    finally:
        np.random.set_state(state)


def _runs_by_tasks(name: str, scores: Any) -> np.ndarray:
    """``scores`` as a float array ``[runs, tasks]`` (a 1-D array is one task's runs)."""
    array = np.asarray(scores, dtype=np.float64)
    if array.ndim == 1:
        array = array[:, None]
    if array.ndim != 2 or array.shape[0] == 0 or array.shape[1] == 0:
        raise ValueError(
            f"scores of {name!r} must be [runs] or [runs, tasks] with at least one run, got {array.shape}"
        )
    if not np.isfinite(array).all():
        raise ValueError(f"scores of {name!r} hold NaN or inf: {array.tolist()}")
    return array


def iqm(scores: Any) -> float:
    """The interquartile mean of ``scores`` (any shape, all entries pooled): the mean after cutting
    ``floor(n / 4)`` of the ``n`` values from each end (``scipy.stats.trim_mean(x, 0.25)``; rliable's
    ``aggregate_iqm``). Raises ValueError for no values or a NaN/inf."""
    _, metrics = _rliable()
    return float(metrics.aggregate_iqm(_runs_by_tasks("scores", np.ravel(scores))))


def iqm_table(
    scores: Mapping[str, Any], *, confidence: float = 0.95, reps: int = 2000, seed: int = 0
) -> dict[str, CI]:
    """IQM and stratified-bootstrap confidence interval of each group's scores.

    Args:
        scores: group name -> its scores, ``[runs]`` (one task) or ``[runs, tasks]`` (floats; each task's runs
            are resampled separately).
        confidence: the interval's coverage.
        reps: bootstrap resamples.
        seed: of the resampling, so that a table is reproducible (NumPy's global generator is left as it was).

    Returns: group -> ``(iqm, low, high)``; ``low <= iqm <= high`` whenever the groups' runs are few enough to
    be resampled exhaustively, and in practice otherwise (a percentile interval of the resampled IQMs).

    Raises:
        ValueError: no groups, a group without runs, NaN/inf scores, ``confidence`` outside (0, 1).
    """
    library, metrics = _rliable()
    if not scores:
        raise ValueError("no groups of scores")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    data = {name: _runs_by_tasks(name, s) for name, s in scores.items()}
    func = lambda x: np.array([metrics.aggregate_iqm(x)])  # noqa: E731
    points, intervals = _interval_estimates(library, data, func, reps, confidence, seed)
    return {
        name: (float(points[name][0]), float(intervals[name][0, 0]), float(intervals[name][1, 0]))
        for name in data
    }


def iqm_curves(
    curves: Mapping[str, Any], *, confidence: float = 0.95, reps: int = 1000, seed: int = 0
) -> dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """IQM over runs at each point of a learning curve, with its stratified-bootstrap confidence band.

    Args:
        curves: group -> its runs' curves, ``[runs, points]`` (floats, every run at the same points, e.g.
            ``sweep_curves``).
        confidence, reps, seed: as in ``iqm_table``.

    Returns: group -> ``(iqm, low, high)``, each ``[points]`` float64.

    Raises:
        ValueError: no groups, a group that is not ``[runs, points]`` with at least one of each, NaN/inf.
    """
    library, metrics = _rliable()
    if not curves:
        raise ValueError("no groups of curves")
    data = {}
    for name, c in curves.items():
        array = np.asarray(c, dtype=np.float64)
        if array.ndim != 2 or 0 in array.shape or not np.isfinite(array).all():
            raise ValueError(f"curves of {name!r} must be finite [runs, points] with at least one of each")
        data[name] = array[:, None, :]  # [runs, tasks=1, points]

    def per_point(x: np.ndarray) -> np.ndarray:
        return np.array([metrics.aggregate_iqm(x[..., t]) for t in range(x.shape[-1])])

    points, intervals = _interval_estimates(library, data, per_point, reps, confidence, seed)
    return {name: (points[name], intervals[name][0], intervals[name][1]) for name in data}


def _groups(rows: Sequence[Mapping[str, Any]], by: str | Sequence[str]) -> dict[str, list[Mapping[str, Any]]]:
    keys = [by] if isinstance(by, str) else list(by)
    out: dict[str, list[Mapping[str, Any]]] = {}
    for row in rows:
        if row.get("status") != "finished":
            continue
        missing = [k for k in keys if k not in row]
        if missing:
            raise KeyError(f"summary row {row.get('name')!r} has no {missing[0]!r}; group by a grid axis")
        out.setdefault(",".join(str(row[k]) for k in keys), []).append(row)
    if not out:
        raise ValueError("no finished runs among the summary rows")
    return out


def sweep_scores(
    rows: Sequence[Mapping[str, Any]], metric: str, by: str | Sequence[str]
) -> dict[str, np.ndarray]:
    """Each group's final ``metric`` (``final/<metric>`` of ``rlbits.sweep``'s summary rows), ``[runs]``:
    the finished runs grouped by the values of the grid axes ``by`` (``"policy_loss"``: one group per loss,
    its seeds the runs; several axes: a group per combination, named ``a,b``).

    Raises:
        ValueError: no finished runs. KeyError: a finished run without ``by`` or without the metric.
    """
    out = {}
    for name, group in _groups(rows, by).items():
        key = f"final/{metric}"
        missing = [r.get("name") for r in group if key not in r]
        if missing:
            raise KeyError(f"run {missing[0]!r} logged no {metric!r}")
        out[name] = np.array([float(r[key]) for r in group])
    return out


def sweep_curves(
    rows: Sequence[Mapping[str, Any]], metric: str, by: str | Sequence[str]
) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """The learning curves of ``metric`` of a sweep's finished runs (their ``metrics.jsonl``), grouped as in
    ``sweep_scores``: ``(steps, {group: [runs, steps]})`` at the steps where every run logged ``metric``.

    Raises:
        ValueError: no finished runs, or no step at which all of them logged ``metric``.
    """
    groups = _groups(rows, by)
    per_run = {
        name: [dict(zip(*series(read_metrics(r["run_dir"]), metric), strict=True)) for r in group]
        for name, group in groups.items()
    }
    common = set.intersection(*(set(run) for runs in per_run.values() for run in runs))
    if not common:
        raise ValueError(f"the runs share no step at which {metric!r} was logged")
    steps = np.array(sorted(common))
    return steps, {
        name: np.array([[run[s] for s in steps] for run in runs]) for name, runs in per_run.items()
    }


def plot_iqm_curves(
    steps: Sequence[float],
    curves: Mapping[str, tuple[np.ndarray, np.ndarray, np.ndarray]],
    *,
    metric: str = "",
    ax=None,
    out: str | None = None,
):
    """One line per group (its IQM, ``iqm_curves``) with its confidence band; returns the figure."""
    plt = _pyplot()
    if ax is None:
        fig, ax = plt.subplots(figsize=(6, 3.5))
    else:
        fig = ax.figure
    for name, (mid, low, high) in curves.items():
        (line,) = ax.plot(steps, mid, marker="." if len(steps) < 30 else None, label=name)
        line.set_gid(name)
        ax.fill_between(steps, low, high, color=line.get_color(), alpha=0.2)
    ax.set_xlabel("step")
    ax.set_ylabel(f"{metric} (IQM and CI)" if metric else "IQM and CI")
    ax.legend(fontsize=8)
    fig.tight_layout()
    if out is not None:
        fig.savefig(out, dpi=110)
    return fig


__all__ = ["iqm", "iqm_curves", "iqm_table", "plot_iqm_curves", "sweep_curves", "sweep_scores"]
