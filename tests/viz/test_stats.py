"""IQM and its bootstrap confidence intervals (rlbits.viz.stats) on hand-checked numbers."""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("rliable")
from rlbits.viz.stats import iqm, iqm_curves, iqm_table, sweep_curves, sweep_scores  # noqa: E402


def test_iqm_of_known_numbers():
    # 1..8: cut 2 from each end, the mean of 3, 4, 5, 6
    assert iqm([1, 2, 3, 4, 5, 6, 7, 8]) == 4.5
    # an outlier seed does not move it: cut 1 from each end of 4 values, the mean of 1, 2
    assert iqm([1, 2, 0, 1000]) == 1.5
    # 3 values: floor(3 / 4) = 0 cut, the mean
    assert iqm([0.0, 0.3, 0.9]) == pytest.approx(0.4)


def test_the_interval_contains_the_iqm_and_is_reproducible():
    scores = {"a": [1, 2, 3, 4, 5, 6, 7, 8], "b": [0.5, 0.5, 0.5], "c": [0.0, 0.0, 0.0, 10.0]}
    table = iqm_table(scores, reps=500, seed=0)
    assert set(table) == {"a", "b", "c"}
    assert table["a"][0] == 4.5 and table["c"][0] == 0.0
    for mid, low, high in table.values():
        assert low <= mid <= high
    assert table["b"] == (0.5, 0.5, 0.5)  # equal runs: no uncertainty
    # every resample of 1..8 has an IQM between the smallest and the largest possible ones
    assert 1.0 <= table["a"][1] < 4.5 < table["a"][2] <= 8.0
    assert iqm_table(scores, reps=500, seed=0) == table


def test_iqm_table_refuses_bad_scores():
    with pytest.raises(ValueError, match="NaN"):
        iqm_table({"a": [1.0, float("nan")]})
    with pytest.raises(ValueError, match="at least one run"):
        iqm_table({"a": []})
    with pytest.raises(ValueError, match="confidence"):
        iqm_table({"a": [1.0]}, confidence=95)


def test_curve_bands_contain_the_curve():
    curves = {"a": np.arange(12.0).reshape(3, 4), "b": np.ones((2, 4))}
    out = iqm_curves(curves, reps=200)
    mid, low, high = out["a"]
    np.testing.assert_allclose(mid, [4, 5, 6, 7])  # the mean of 3 runs at each step
    assert (low <= mid).all() and (mid <= high).all()
    np.testing.assert_allclose(out["b"][1], 1.0)
    np.testing.assert_allclose(out["b"][2], 1.0)


def _run(path, values):
    path.mkdir()
    path.joinpath("metrics.jsonl").write_text(
        "".join(json.dumps({"step": s, "val_reward": v}) + "\n" for s, v in values)
    )
    return str(path)


def test_sweep_rows_grouped_by_an_axis(tmp_path):
    rows = [
        {"name": "x=a,seed=0", "x": "a", "seed": 0, "status": "finished", "final/val_reward": 0.5,
         "run_dir": _run(tmp_path / "a0", [(0, 0.0), (5, 0.5)])},
        {"name": "x=a,seed=1", "x": "a", "seed": 1, "status": "finished", "final/val_reward": 0.7,
         "run_dir": _run(tmp_path / "a1", [(0, 0.1), (2, 0.2), (5, 0.7)])},
        {"name": "x=b,seed=0", "x": "b", "seed": 0, "status": "finished", "final/val_reward": 0.1,
         "run_dir": _run(tmp_path / "b0", [(0, 0.0), (5, 0.1)])},
        {"name": "x=b,seed=1", "x": "b", "seed": 1, "status": "failed", "run_dir": str(tmp_path / "none")},
    ]
    scores = sweep_scores(rows, "val_reward", by="x")
    assert {k: v.tolist() for k, v in scores.items()} == {"a": [0.5, 0.7], "b": [0.1]}  # the failed run left out
    steps, curves = sweep_curves(rows, "val_reward", by="x")
    assert steps.tolist() == [0, 5]  # the steps every run logged
    assert curves["a"].tolist() == [[0.0, 0.5], [0.1, 0.7]] and curves["b"].tolist() == [[0.0, 0.1]]
    assert list(sweep_scores(rows, "val_reward", by=["x", "seed"])) == ["a,0", "a,1", "b,0"]
    with pytest.raises(KeyError, match="grid axis"):
        sweep_scores(rows, "val_reward", by="policy_loss")
