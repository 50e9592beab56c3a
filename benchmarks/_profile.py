"""How much of a measured call is matrix multiplication: time and FLOPs of its matmul kernels, from
``torch.profiler``. Shared by ``bench_decode.py --profile`` and ``bench_step.py --profile-matmuls``.

The point is a bound no overhead removal can beat: a step whose matmuls alone take ``matmul_s`` can never
run faster than that with the same kernels, so ``matmul_s / floor`` is the best ratio to the arithmetic
floor this machine's matmul libraries allow at the step's shapes.
"""

from __future__ import annotations

import math
import time
from collections import Counter

# Leaf matmul kernels on CPU (MKL through aten, oneDNN on packed weights). Wrappers such as aten::linear
# and aten::matmul are left out: their self time is dispatch, and their FLOPs are their children's.
MATMUL_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "mkldnn::_linear_pointwise")


def _flops(event) -> float:
    """FLOPs of one profiled call: the profiler's own count for aten ops; for oneDNN's packed linear (no
    formula in the profiler) 2 x rows x out x in from the input [..., in] and weight [out, in] shapes."""
    if event.name != "mkldnn::_linear_pointwise":
        return float(event.flops or 0)
    x_shape, w_shape = event.input_shapes[0], event.input_shapes[1]
    return 2.0 * math.prod(x_shape[:-1]) * w_shape[0] * w_shape[1]


def _phase(event) -> str:
    """The rlbits loop phase a call ran in (the ``rlbits/<phase>`` range of ``PhaseTimer``), or "-"."""
    parent = event.cpu_parent
    while parent is not None:
        if parent.name.startswith("rlbits/"):
            return parent.name.removeprefix("rlbits/")
        parent = parent.cpu_parent
    return "-"


def _totals(rows: list[dict]) -> dict:
    seconds = sum(r["s"] for r in rows)
    gflop = sum(r["gflop"] for r in rows)
    return {"matmul_s": seconds, "matmul_gflop": gflop, "matmul_gflops": gflop / seconds if seconds else 0.0}


def matmul_summary(prof) -> dict:
    """Time and FLOPs of the matmul kernels of a finished ``profiler()``: ``{"matmul_s", "matmul_gflop",
    "matmul_gflops", "by_op": {op: {"s", "gflop", "calls"}}, "by_phase": {phase: {"matmul_s", ...}}}``.
    Times are each kernel's own CPU time (self time); phases are the loops' ``rlbits/<phase>`` ranges."""
    by_op: dict[str, dict] = {}
    by_phase: dict[str, dict] = {}
    for event in prof.events():
        if event.name not in MATMUL_OPS:
            continue
        seconds, gflop = event.self_cpu_time_total / 1e6, _flops(event) / 1e9
        for table, key in ((by_op, event.name), (by_phase, _phase(event))):
            row = table.setdefault(key, {"s": 0.0, "gflop": 0.0, "calls": 0})
            row["s"] += seconds
            row["gflop"] += gflop
            row["calls"] += 1
    return {
        **_totals(list(by_op.values())),
        "by_op": by_op,
        "by_phase": {phase: _totals([row]) for phase, row in by_phase.items()},
    }


def matmul_calls(prof) -> list[tuple[str, str, list]]:
    """The matmul kernel calls of a finished ``profiler()``, in order: ``(phase, op, input shapes)``."""
    events = sorted((e for e in prof.events() if e.name in MATMUL_OPS), key=lambda e: e.time_range.start)
    return [(_phase(e), e.name, [list(s) for s in e.input_shapes]) for e in events]


def replay_seconds(calls: list[tuple[str, str, list]], *, repeats: int = 3, pool_mb: int = 128) -> dict:
    """Seconds per phase of the same matmul calls run again in order without the profiler (best of
    ``repeats``), on float32 operands of the recorded shapes: a profiler-free measure of what the kernels
    alone cost. Each distinct call shape cycles through copies of its operands up to ``pool_mb`` (so 30
    layers' distinct decode weights come from memory, as in a real decode, not from the cache); packed
    linears get weights reordered for their row count, as ``packed_linears`` does."""
    import torch

    keys = [(op, str(shapes)) for _, op, shapes in calls]
    counts = Counter(keys)
    pools: dict[tuple, list] = {}
    for key, (_, op, shapes) in zip(keys, calls, strict=True):
        if key in pools:
            continue
        tensor_shapes = [sh for sh in shapes if sh]
        nbytes = 4 * sum(math.prod(sh) for sh in tensor_shapes)
        copies = max(1, min(counts[key], pool_mb * 2**20 // max(nbytes, 1)))
        made = []
        for _ in range(copies):
            ts = [torch.randn(sh) for sh in tensor_shapes]
            if op == "mkldnn::_linear_pointwise":
                rows = math.prod(shapes[0][:-1])
                ts[1] = torch.ops.mkldnn._reorder_linear_weight(ts[1], rows)
                ts = ts[:3] if len(ts) >= 3 else [*ts, None]
            made.append(ts)
        pools[key] = made

    def run(op, ts):
        if op == "aten::mm":
            return torch.mm(*ts)
        if op == "aten::addmm":
            return torch.addmm(*ts)
        if op == "aten::bmm":
            return torch.bmm(*ts)
        if op == "aten::baddbmm":
            return torch.baddbmm(*ts)
        return torch.ops.mkldnn._linear_pointwise(ts[0], ts[1], ts[2], "none", [], "")

    best: dict[str, float] = {}
    with torch.no_grad():
        for _ in range(repeats):
            seconds: dict[str, float] = {}
            cursor = dict.fromkeys(pools, 0)
            for key, (phase, op, _) in zip(keys, calls, strict=True):
                ts = pools[key][cursor[key] % len(pools[key])]
                cursor[key] += 1
                t = time.perf_counter()
                run(op, ts)
                seconds[phase] = seconds.get(phase, 0.0) + time.perf_counter() - t
            for phase, sec in seconds.items():
                best[phase] = min(best.get(phase, float("inf")), sec)
    return best


def profiler():
    """A CPU profiler recording what ``matmul_summary`` needs (shapes and FLOPs), not stacks."""
    import torch

    return torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True, with_flops=True
    )
