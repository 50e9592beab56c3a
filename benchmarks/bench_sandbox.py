"""Benchmark: the per-call overhead of the tool sandbox, ``bwrap`` against ``unsafe_local``.

For each snippet (``print(1)``, and a small compute: a sum of squares and a sort of 20 000 numbers), it runs
``run_python`` ``--calls`` times under each sandbox, alternating the two, after one warm-up call each, and
prints the median wall seconds per call (``SandboxResult.seconds``: start of the child to its end, output
read) and the median of the whole ``run_python`` call as the caller sees it. Under root, ``unsafe_local``
imports ``PRELOAD`` before dropping to ``nobody``; ``bwrap`` imports nothing up front.

    python benchmarks/bench_sandbox.py               # 30 calls of each
    python benchmarks/bench_sandbox.py --calls 100
"""

from __future__ import annotations

import argparse
import statistics
import time

from rlbits.envs.sandbox import check_sandbox, run_python

SNIPPETS = {
    "print(1)": "print(1)",
    "compute": "xs = [(i * 7919) % 10007 for i in range(20000)]\nprint(sum(x * x for x in xs), sorted(xs)[100])",
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=30, help="timed calls per snippet and sandbox")
    args = ap.parse_args()
    check_sandbox("bwrap")
    sandboxes = ("bwrap", "unsafe_local")
    print(f"{'snippet':<10} {'sandbox':<13} {'median s/call':>14} {'median child s':>15}")
    for name, code in SNIPPETS.items():
        wall: dict[str, list[float]] = {s: [] for s in sandboxes}
        child: dict[str, list[float]] = {s: [] for s in sandboxes}
        for s in sandboxes:
            assert run_python(code, sandbox=s).ok  # warm-up
        for _ in range(args.calls):
            for s in sandboxes:
                start = time.perf_counter()
                r = run_python(code, sandbox=s)
                wall[s].append(time.perf_counter() - start)
                assert r.ok, r
                child[s].append(r.seconds)
        for s in sandboxes:
            print(
                f"{name:<10} {s:<13} {statistics.median(wall[s]):>14.4f} {statistics.median(child[s]):>15.4f}"
            )


if __name__ == "__main__":
    main()
