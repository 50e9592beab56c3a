"""Asynchronous RL with bounded staleness under torchrun: wall time and idle time of one rollout rank and one
trainer rank at ``max_staleness`` 0 and 1, beside the colocated synchronous 2-rank data-parallel run (issue 27).

The workload is ``configs/grpo_arithmetic.yaml`` (GRPO with DAPO's dynamic sampling on the built-in arithmetic
task, tiny GPT-2), ``--steps`` steps, every rank with ``OMP_NUM_THREADS=1``:

- ``ranks k=0``: ``async_mode=ranks rollout_ranks=1 max_staleness=0``: the rollout rank and the trainer take turns
  (the synchronous schedule, split over two processes);
- ``ranks k=1``: the same with ``max_staleness=1``: the rollout rank samples step t+1 while the trainer trains
  step t; overlap can buy up to (R + U) / max(R, U);
- ``ranks k=1 eager``: the same with ``async_schedule=eager`` (the rollout rank produces back to back with the
  newest weights it holds, up to version + k; the trainer does not wait for the weights to be taken);
- ``colocated``: ``async_mode=off`` on 2 data-parallel ranks, each with half the prompts per step (the same rows
  per optimizer step): on CPU, where colocation costs nothing, the honest reference.

For each: wall time of the launch, the steady-state seconds per step (``time_s`` of the metrics rows, from
step 5 to the step before the last: without start-up, model load and the final validation, which the wall
time includes), the final greedy ``val_reward`` (500 held-out prompts), and the means of
``time/trainer_idle`` and ``time/rollout_idle`` (seconds per step each side waited on the other).

    python benchmarks/async_ranks.py                    # 30 steps, seed 0
    python benchmarks/async_ranks.py --steps 50 --seeds 0 1 --out benchmarks/results/async_ranks.json

Run it on a quiet machine (nothing else running): the figures are ratios of wall times measured in one run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rlbits.loops.logger import read_metrics

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "grpo_arithmetic.yaml"
VARIANTS = {
    "ranks k=0": ["async_mode=ranks", "rollout_ranks=1", "max_staleness=0"],
    "ranks k=1": ["async_mode=ranks", "rollout_ranks=1", "max_staleness=1"],
    "ranks k=1 eager": ["async_mode=ranks", "rollout_ranks=1", "max_staleness=1", "async_schedule=eager"],
    "colocated": [],  # + num_prompts_per_step halved: see colocated_prompts
}


def colocated_prompts(config: Path, overrides: list[str]) -> str:
    """The colocated run's override: each of its 2 data-parallel ranks draws half the prompts per step, so an
    optimizer step sees the rows of one ``ranks`` step."""
    import yaml

    n = yaml.safe_load(config.read_text())["num_prompts_per_step"]
    for item in overrides:
        if item.startswith("num_prompts_per_step="):
            n = int(item.split("=", 1)[1])
    if n % 2:
        raise SystemExit(f"num_prompts_per_step must be even to split over 2 colocated ranks, got {n}")
    return f"num_prompts_per_step={n // 2}"


def _mean(rows: list[dict], key: str) -> float | None:
    values = [r[key] for r in rows if isinstance(r.get(key), (int, float))]
    return round(sum(values) / len(values), 3) if values else None


def steady_s_per_step(rows: list[dict], first: int = 5) -> float | None:
    """Seconds per step between the rows of step ``first`` and of the step before the last (whose row
    follows the final validation)."""
    times = {r["step"]: r["time_s"] for r in rows if "time_s" in r}
    last = max(times, default=0) - 1
    if first not in times or last not in times or last <= first:
        return None
    return round((times[last] - times[first]) / (last - first), 4)


def launch(
    name: str, extra: list[str], steps: int, seed: int, workdir: Path, overrides: list[str] = (), config: Path = CONFIG,
) -> dict:
    """One ``torchrun --nproc_per_node 2`` launch of the workload; its wall time and the metrics above."""
    run_dir = workdir / f"{name.replace(' ', '_').replace('=', '')}_s{seed}"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "rlbits",
        "train", str(config), f"run_dir={run_dir}", f"max_num_steps={steps}", f"val_period={steps}",
        f"seed={seed}", "progress=false", "tensorboard=false", *overrides, *extra,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    start = time.perf_counter()
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"{name} (seed {seed}) failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    rows = read_metrics(run_dir)
    val = [r["val_reward"] for r in rows if "val_reward" in r]
    return {
        "variant": name, "seed": seed, "steps": steps, "wall_s": round(wall, 2),
        "val_reward": val[-1] if val else None, "steady_s_per_step": steady_s_per_step(rows),
        "trainer_idle_s": _mean(rows, "time/trainer_idle"), "rollout_idle_s": _mean(rows, "time/rollout_idle"),
        "command": " ".join(cmd[1:]),
    }


def _ratio(a: dict, b: dict) -> str:
    x, y = a["steady_s_per_step"], b["steady_s_per_step"]
    return f"{x / y:.2f}x" if x and y else "n/a"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--out", type=Path, help="write the rows as JSON here")
    parser.add_argument(
        "--overrides", nargs="*", default=[], metavar="KEY=VALUE",
        help="config overrides for every run, e.g. dynamic_sampling=false",
    )
    parser.add_argument("--config", type=Path, default=CONFIG, help="the workload's config (default: %(default)s)")
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for seed in args.seeds:
            for name in args.variants:
                extra = VARIANTS[name] + ([colocated_prompts(args.config, args.overrides)] if name == "colocated" else [])
                row = launch(name, extra, args.steps, seed, Path(tmp), args.overrides, args.config)
                rows.append(row)
                idle = f"trainer idle {row['trainer_idle_s']}, rollout idle {row['rollout_idle_s']}"
                print(f"{name:15s} seed {seed}: {row['wall_s']:7.1f} s, {row['steady_s_per_step']} s/step steady, "
                      f"val_reward {row['val_reward']}, {idle}", flush=True)
    for seed in args.seeds:
        by = {r["variant"]: r for r in rows if r["seed"] == seed}
        if len(by) < len(VARIANTS):
            continue
        print(
            f"seed {seed}: ranks k=0 / ranks k=1 = {by['ranks k=0']['wall_s'] / by['ranks k=1']['wall_s']:.2f}x; "
            f"colocated / ranks k=1 = {by['colocated']['wall_s'] / by['ranks k=1']['wall_s']:.2f}x (wall); "
            f"per step, steady: k=0 / k=1 = {_ratio(by['ranks k=0'], by['ranks k=1'])}, "
            f"colocated / k=1 = {_ratio(by['colocated'], by['ranks k=1'])}; "
            f"k=0 / k=1 eager = {by['ranks k=0']['wall_s'] / by['ranks k=1 eager']['wall_s']:.2f}x (wall), "
            f"{_ratio(by['ranks k=0'], by['ranks k=1 eager'])} (steady)"
        )
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
