"""benchmarks/_profile.py: the matmul time and FLOPs behind the benchmarks' "matmuls alone / floor" bound,
attributed to the loops' phases through ``PhaseTimer``'s profiler ranges."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from rlbits.loops.run import PhaseTimer
from rlbits.models.packed import packed_linears, packing_available

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "_profile.py"
_spec = importlib.util.spec_from_file_location("bench_profile", _PATH)
bench_profile = importlib.util.module_from_spec(_spec)
sys.modules["bench_profile"] = bench_profile
_spec.loader.exec_module(bench_profile)


def _matmul_flops(rows: int, n_out: int, n_in: int) -> float:
    return 2.0 * rows * n_out * n_in


def test_matmul_flops_and_phases_match_a_hand_count():
    torch.manual_seed(0)
    first, second = torch.nn.Linear(24, 40), torch.nn.Linear(40, 8, bias=False)
    x = torch.randn(5, 7, 24)  # 35 rows
    timer = PhaseTimer()
    with bench_profile.profiler() as prof:
        with timer("update"):
            # forward: two matmuls; backward: grad of `second`'s input and both weights (x needs no grad)
            second(first(x)).square().sum().backward()
        with timer("rollout"), torch.no_grad():
            first(x[:, -1])  # 5 rows
        torch.mm(torch.randn(3, 4), torch.randn(4, 6))  # outside every phase
    summary = bench_profile.matmul_summary(prof)

    update = (
        _matmul_flops(35, 40, 24)  # first, forward
        + _matmul_flops(35, 8, 40)  # second, forward
        + _matmul_flops(35, 40, 8)  # grad of second's input
        + _matmul_flops(8, 40, 35)  # grad of second's weight
        + _matmul_flops(40, 24, 35)  # grad of first's weight
    )
    rollout = _matmul_flops(5, 40, 24)
    outside = _matmul_flops(3, 6, 4)
    phases = summary["by_phase"]
    assert set(phases) == {"update", "rollout", "-"}
    assert phases["update"]["matmul_gflop"] * 1e9 == pytest.approx(update)
    assert phases["rollout"]["matmul_gflop"] * 1e9 == pytest.approx(rollout)
    assert phases["-"]["matmul_gflop"] * 1e9 == pytest.approx(outside)
    assert summary["matmul_gflop"] * 1e9 == pytest.approx(update + rollout + outside)
    assert sum(r["calls"] for r in summary["by_op"].values()) == 7
    assert 0 < summary["matmul_s"] == pytest.approx(sum(p["matmul_s"] for p in phases.values()))


@pytest.mark.skipif(not packing_available(), reason="oneDNN packed linear unavailable in this build")
def test_packed_linear_flops_come_from_its_shapes():
    layer = torch.nn.Linear(32, 48)
    x = torch.randn(6, 2, 32)
    with torch.no_grad(), packed_linears(layer, batch_size=12), bench_profile.profiler() as prof:
        layer(x)
    summary = bench_profile.matmul_summary(prof)
    assert list(summary["by_op"]) == ["mkldnn::_linear_pointwise"]
    assert summary["matmul_gflop"] * 1e9 == pytest.approx(_matmul_flops(12, 48, 32))
    calls = bench_profile.matmul_calls(prof)
    assert calls == [("-", "mkldnn::_linear_pointwise", [[6, 2, 32], [48, 32], [48], [], [], []])]
    assert 0 < bench_profile.replay_seconds(calls, repeats=1)["-"] < 1


def test_phase_timer_names_its_profiler_ranges_and_still_times():
    timer = PhaseTimer()
    with torch.profiler.profile() as prof:
        with timer("reference"):
            torch.ones(3).sum()
    names = {e.name for e in prof.events()}
    assert "rlbits/reference" in names
    assert timer.metrics()["time/reference"] > 0


def test_replay_runs_the_recorded_calls_per_phase_without_the_profiler():
    layer = torch.nn.Linear(32, 48)
    timer = PhaseTimer()
    with bench_profile.profiler() as prof:
        with timer("update"):
            layer(torch.randn(10, 32)).sum().backward()
        with timer("rollout"), torch.no_grad():
            layer(torch.randn(4, 32))
    calls = bench_profile.matmul_calls(prof)
    assert [(phase, op) for phase, op, _ in calls] == [
        ("update", "aten::addmm"),  # forward
        ("update", "aten::mm"),  # weight gradient
        ("rollout", "aten::addmm"),
    ]
    assert calls[1][2] == [[48, 10], [10, 32]]
    replayed = bench_profile.replay_seconds(calls, repeats=2)
    assert set(replayed) == {"update", "rollout"}
    assert all(0 < s < 1 for s in replayed.values())
