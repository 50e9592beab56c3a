"""Stress test of two-rank torchrun launches: N tiny PPO runs (CPU, gloo) under load, counting aborts.

Issue 13, item 9: a two-rank run sometimes ended with SIGABRT ("terminate called without an active exception")
or torchrun reporting FAILED although training had finished. This script launches the same tiny run N times
and classifies each launch:

- ``ok``: exit status 0, no abort marker in the output;
- ``abort``: a rank died of SIGABRT (torchrun's ``exitcode: -6``, a shell's 134) or printed "terminate called
  without an active exception";
- ``failed``: any other non-zero exit or torchrun's ``FAILED`` summary (the tail of its output is kept);
- ``timeout``: the launch ran past ``--timeout`` seconds.

The run: a random-init tiny GPT-2 (``rlbits.models.tiny``, vocabulary 32) saved once, then
``python -m torch.distributed.run --standalone --nproc_per_node=2 -m rlbits train configs/ppo_sentiment.yaml``
with the arithmetic task, 2 steps, 5 new tokens, a checkpoint every step (the settings of
tests/distributed/test_dist.py's torchrun tests). Load: ``--load K`` busy-loop processes run beside the launches (default
1; the launches themselves use ``OMP_NUM_THREADS=1`` per rank).

    python benchmarks/stress_torchrun.py               # N=20, one busy process beside
    python benchmarks/stress_torchrun.py -n 10 --load 0 --out benchmarks/results/stress_torchrun.json

Prints one line per launch and a summary (counts, wall time); exits 1 if any launch aborted or failed.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ARGS = [
    "max_num_steps=2", "max_new_tokens=5", "max_val_samples=4", "progress=false", "tensorboard=false",
    "save_period=1", "val_period=0", "task=arithmetic", "num_prompts_per_step=4",
    "num_generations_per_prompt=2", "microbatch_size=4", "num_minibatches=2",
]
ABORT = re.compile(r"terminate called without an active exception|exitcode\s*:\s*-6\b|SIGABRT|Aborted")


def _busy(stop_at: float) -> None:
    x = 0
    while time.time() < stop_at:
        x = (x * 1103515245 + 12345) % 2**31


def classify(returncode: int | None, output: str) -> str:
    """``ok``, ``abort``, ``failed`` or ``timeout`` for one launch (see the module docstring)."""
    if returncode is None:
        return "timeout"
    if ABORT.search(output) or returncode in (-6, 134):
        return "abort"
    if returncode != 0 or "FAILED" in output:
        return "failed"
    return "ok"


def launch(policy: str, run_dir: Path, timeout: float) -> tuple[str, float, str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "rlbits",
           "train", "configs/ppo_sentiment.yaml", f"policy={policy}", f"run_dir={run_dir}", *ARGS]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    start = time.perf_counter()
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
        returncode, output = out.returncode, out.stdout + out.stderr
    except subprocess.TimeoutExpired as e:
        returncode = None
        output = "".join(x.decode() if isinstance(x, bytes) else (x or "") for x in (e.stdout, e.stderr))
    return classify(returncode, output), time.perf_counter() - start, output


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-n", type=int, default=20, help="launches (default 20)")
    parser.add_argument("--load", type=int, default=1, help="busy-loop processes beside the launches (default 1)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per launch (default 300)")
    parser.add_argument("--out", type=Path, help="write the summary as JSON here")
    args = parser.parse_args(argv)

    from rlbits.models.tiny import tiny_causal_lm, tiny_tokenizer

    counts = {"ok": 0, "abort": 0, "failed": 0, "timeout": 0}
    launches = []
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="stress_torchrun_") as tmp:
        policy = Path(tmp) / "policy"
        tiny_causal_lm("gpt2", 32, seed=0).save_pretrained(policy)
        tiny_tokenizer(32).save_pretrained(policy)
        burners = [
            multiprocessing.Process(target=_busy, args=(time.time() + args.n * args.timeout,), daemon=True)
            for _ in range(args.load)
        ]
        for p in burners:
            p.start()
        try:
            for i in range(args.n):
                kind, seconds, output = launch(str(policy), Path(tmp) / f"run{i}", args.timeout)
                counts[kind] += 1
                row = {"launch": i, "result": kind, "seconds": round(seconds, 1)}
                if kind != "ok":
                    row["tail"] = output[-2000:]
                launches.append(row)
                print(f"launch {i + 1:3d}/{args.n}: {kind:7s} {seconds:6.1f} s", flush=True)
                if kind != "ok":
                    print(output[-2000:], flush=True)
        finally:
            for p in burners:
                p.terminate()
                p.join()
    wall = time.perf_counter() - start
    summary = {"n": args.n, "load": args.load, **counts, "wall_seconds": round(wall, 1), "launches": launches}
    print(
        f"{args.n} launches under load {args.load}: ok {counts['ok']}, abort {counts['abort']}, "
        f"failed {counts['failed']}, timeout {counts['timeout']}; wall {wall:.0f} s "
        f"({wall / max(1, args.n):.1f} s per launch)"
    )
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(summary, indent=2) + "\n")
    return 0 if counts["ok"] == args.n else 1


if __name__ == "__main__":
    sys.exit(main())
