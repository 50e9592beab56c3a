"""Benchmark: the per-call overhead of the tool sandbox, ``bwrap`` against ``unsafe_local``.

For each snippet (``print(1)``, and a small compute: a sum of squares and a sort of 20 000 numbers), it runs
``run_python`` ``--calls`` times under each sandbox, alternating the two, after one warm-up call each, and
prints the median wall seconds per call (``SandboxResult.seconds``: start of the child to its end, output
read) and the median of the whole ``run_python`` call as the caller sees it. Under root, ``unsafe_local``
imports ``PRELOAD`` before dropping to ``nobody``; ``bwrap`` imports nothing up front.

    python benchmarks/bench_sandbox.py               # 30 calls of each
    python benchmarks/bench_sandbox.py --calls 100
    python benchmarks/bench_sandbox.py --baseline OTHER/rlbits/envs/sandbox.py   # and another version's run_python

``--baseline`` loads ``run_python`` from another checkout's ``sandbox.py`` (it imports only the standard
library) and times it in the same alternation, with its own defaults, as ``baseline``.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time

from rlbits.envs.sandbox import check_sandbox, run_python

SNIPPETS = {
    "print(1)": "print(1)",
    "compute": "xs = [(i * 7919) % 10007 for i in range(20000)]\nprint(sum(x * x for x in xs), sorted(xs)[100])",
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=30, help="timed calls per snippet and sandbox")
    ap.add_argument("--baseline", help="another version's rlbits/envs/sandbox.py, timed as 'baseline'")
    args = ap.parse_args()
    check_sandbox("bwrap")
    runners = {s: (lambda code, s=s: run_python(code, sandbox=s)) for s in ("bwrap", "unsafe_local")}
    if args.baseline:
        spec = importlib.util.spec_from_file_location("baseline_sandbox", args.baseline)
        baseline = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = baseline  # dataclasses look their module up there
        spec.loader.exec_module(baseline)
        runners["baseline"] = baseline.run_python
    sandboxes = tuple(runners)
    print(f"{'snippet':<10} {'sandbox':<13} {'median s/call':>14} {'median child s':>15}")
    for name, code in SNIPPETS.items():
        wall: dict[str, list[float]] = {s: [] for s in sandboxes}
        child: dict[str, list[float]] = {s: [] for s in sandboxes}
        for s in sandboxes:
            assert runners[s](code).ok  # warm-up
        for _ in range(args.calls):
            for s in sandboxes:
                start = time.perf_counter()
                r = runners[s](code)
                wall[s].append(time.perf_counter() - start)
                assert r.ok, r
                child[s].append(r.seconds)
        for s in sandboxes:
            print(
                f"{name:<10} {s:<13} {statistics.median(wall[s]):>14.4f} {statistics.median(child[s]):>15.4f}"
            )


if __name__ == "__main__":
    main()
