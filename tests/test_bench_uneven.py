"""benchmarks/uneven_generate.py: the uneven workload's lengths and the roofline behind its "best any batching
can reach" ratio, against hand counts."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "uneven_generate.py"
_spec = importlib.util.spec_from_file_location("bench_uneven_generate", _PATH)
bench = importlib.util.module_from_spec(_spec)
sys.modules["bench_uneven_generate"] = bench
_spec.loader.exec_module(bench)

SHAPE = {"weight_bytes": 100.0, "matmul_params": 10.0, "layers": 2, "heads": 3, "head_dim": 1, "kv_token_bytes": 1.0}


def test_uneven_lengths_follow_the_stated_distribution():
    lengths = bench.uneven_lengths(50, 128, seed=3)
    assert len(lengths) == 50 and lengths.count(128) == 5
    assert all(1 <= n <= 16 for n in lengths if n != 128)
    assert lengths == bench.uneven_lengths(50, 128, seed=3) != bench.uneven_lengths(50, 128, seed=4)


def test_roofline_is_the_sum_of_each_pass_cost_by_hand():
    # Rows of lengths [1, 3] after 2-token prompts: the prefill (2 rows x 2 tokens), then token 1 and token 2
    # of the second row alone (contexts 3 and 4). attention: 4 * layers * heads * head_dim = 24 per position.
    memory_bound = bench.roofline_seconds([1, 3], 2, **SHAPE, read_gbs=1e-9, peak_gflops=1e9)
    assert memory_bound == pytest.approx((100 + 2 * 2) + (100 + 3) + (100 + 4))  # bytes at 1 byte/s
    compute_bound = bench.roofline_seconds([1, 3], 2, **SHAPE, read_gbs=1e9, peak_gflops=1e-9)
    prefill = 2 * 2 * 2 * 10 + 2 * 24 * (1 + 2)  # each row attends to 1, then 2 positions
    assert compute_bound == pytest.approx(prefill + (2 * 10 + 24 * 3) + (2 * 10 + 24 * 4))


def test_roofline_charges_each_pass_its_larger_side():
    # At 1 byte/s and 1 flop/s a pass costs max(bytes, flops): the prefill is compute-bound (224 flops against
    # 104 bytes), the first one-row step memory-bound (103 bytes, 92 flops), the second compute-bound (104
    # bytes, 116 flops).
    both = bench.roofline_seconds([1, 3], 2, **SHAPE, read_gbs=1e-9, peak_gflops=1e-9)
    assert both == pytest.approx(224 + 103 + 116)


def test_uneven_over_uniform_at_the_roofline_grows_with_the_tail_when_memory_bound():
    # Memory-bound (the weights dominate): every pass costs about the same, so the ratio is the ratio of
    # sequential passes, the longest row's length over the uniform length.
    shape = dict(SHAPE, weight_bytes=1e9, kv_token_bytes=0.0)
    uneven, uniform = [1] * 9 + [64], [8] * 10  # 73 tokens against 80
    ratio = bench.roofline_seconds(uneven, 4, **shape, read_gbs=1.0, peak_gflops=1e9) / bench.roofline_seconds(
        uniform, 4, **shape, read_gbs=1.0, peak_gflops=1e9
    )
    assert ratio == pytest.approx(64 / 8, rel=1e-6)
