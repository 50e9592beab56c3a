"""SFT control for the arithmetic RL targets: RL vs. more supervised training on the same compute.

The arithmetic base model imitates a demonstrator that drops carries 70% of the time (``rlbits.tasks.arithmetic``),
so its greedy answers are wrong on most carry problems however long it imitates. This script

1. measures the base model's greedy exact-match accuracy on the whole test split
   (``rlbits.zoo.evaluate``: HF ``generate``, 500 prompts);
2. trains each ``--config`` RL run (``rlbits.loops.reinforce.train``), timing its wall clock and the CPU time
   of this process (``time.process_time``, all threads), and evaluates its ``final/`` policy the same way;
3. continues the base model's own supervised training for the same CPU time with
   ``rlbits.zoo.plateau_check`` -- the corpus and recipe of ``rlbits.zoo.builder`` (a fresh
   draw of the task corpus, AdamW betas (0.9, 0.95), weight decay 0.01, the build's batch size, loss on the
   answer tokens, gradient clip 1.0) at the learning rate the build's schedule ended at -- and evaluates it
   the same way;
4. prints one JSON object with every accuracy, the gains in points, the wall and CPU seconds and steps.

CPU time is the budget that is fair on a shared machine (wall clock depends on what else runs); on idle
cores with the same thread count the two are proportional, so the same CPU time is the same wall time.

    .venv/bin/python benchmarks/sft_control.py --config configs/rloo_arithmetic.yaml --config configs/grpo_arithmetic.yaml
    .venv/bin/python benchmarks/sft_control.py --cpu-seconds 600          # the SFT control alone
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import sys
import time

import torch

from rlbits.zoo import base_model, evaluate, plateau_check

TASK = "arithmetic"


def train_rl(config: str, overrides: list[str]) -> dict:
    """Train one RL config (its run_dir replaced) and return its wall/CPU seconds and final accuracy."""
    from rlbits.loops.config import load_config
    from rlbits.loops.reinforce import ReinforceConfig, train

    cfg = load_config(ReinforceConfig, config, overrides)
    cfg = dataclasses.replace(cfg, progress=False)
    shutil.rmtree(cfg.run_dir, ignore_errors=True)
    wall, cpu = time.perf_counter(), time.process_time()
    run_dir = train(cfg)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    final = evaluate(str(run_dir / "final"), TASK, greedy=True)
    return {
        "run_dir": str(run_dir),
        "steps": cfg.max_num_steps,
        "wall_s": round(wall, 1),
        "cpu_s": round(cpu, 1),
        "s_per_step": round(wall / cfg.max_num_steps, 2),
        "accuracy": final["accuracy"],
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--config", action="append", default=[], help="an RL config YAML to train (repeatable)"
    )
    parser.add_argument("--override", action="append", default=[], help="key=value applied to every --config")
    parser.add_argument(
        "--cpu-seconds",
        type=float,
        default=None,
        help="SFT CPU budget (default: the largest CPU time of the RL runs, else 300)",
    )
    parser.add_argument("--model", default=None, help="base model folder (default: the arithmetic task's)")
    parser.add_argument(
        "--lr", type=float, default=None, help="SFT learning rate (default: the build's final lr)"
    )
    parser.add_argument("--seed", type=int, default=1, help="SFT corpus draw and batch order")
    args = parser.parse_args(argv)

    model = args.model or base_model(TASK)
    print(f"torch threads: {torch.get_num_threads()}", file=sys.stderr)
    base = evaluate(model, TASK, greedy=True)["accuracy"]
    result: dict = {"base_model": model, "base_accuracy": base, "rl": {}}
    for config in args.config:
        run = train_rl(config, args.override)
        run["gain_points"] = round(100 * (run["accuracy"] - base), 1)
        result["rl"][config] = run
        print(json.dumps({config: run}), file=sys.stderr)
    budget = args.cpu_seconds
    if budget is None:
        budget = max((r["cpu_s"] for r in result["rl"].values()), default=300.0)
    wall = time.perf_counter()
    sft = plateau_check(model, TASK, cpu_seconds=budget, lr=args.lr, seed=args.seed)
    result["sft"] = {
        "accuracy": sft["after"]["accuracy"],
        "gain_points": round(100 * (sft["after"]["accuracy"] - sft["before"]["accuracy"]), 1),
        "steps": sft["steps"],
        "cpu_s": sft["cpu_seconds"],
        "wall_s": round(time.perf_counter() - wall, 1),
        "lr": sft["lr"],
    }
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
