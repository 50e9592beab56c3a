"""Step time and peak memory of an rlbits GRPO step as rollouts, response length and model size grow.

Each point is one fresh subprocess: it saves a random-init GPT-2 (``benchmarks/_workload.py``) to a temp
folder, builds the loop state (``rlbits.loops.reinforce.init_state``) and runs one step of the loop's phases
in ``reinforce.train``'s order (rollout, score, dynamic_sampling, reference, advantages, update; microbatches of
32 rows) once as a warm-up and once timed. Peak
memory = the process's ``ru_maxrss`` after the timed step (model, optimizer and imports included).

Axes (the others held at the standard workload: 32 rollouts = 8 prompts x 4, 32 new tokens, 4 layers x 256):

- rollouts: 32, 64, 128, 256, 512 (``--quick``: 32, 128)
- response length: 32, 128, 512, 1024 (``--quick``: 32, 256)
- model size: 2x128, 4x256 (standard), 6x512, 6x768 (67M) layers x width (``--quick``: 2x128, 4x256, 6x768)

    python benchmarks/bench_scaling.py --quick     # ~5 min on 2 quiet cores
    python benchmarks/bench_scaling.py             # the full grid, ~20 min on 2 quiet cores

Writes ``benchmarks/results/bench_scaling.json`` and ``docs/images/scaling_{rollouts,length,model}.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import _workload as W  # noqa: E402

SIZES = {"2x128": (2, 128, 2), "4x256": (4, 256, 4), "6x512": (6, 512, 8), "6x768": (6, 768, 12)}
FULL = {"rollouts": [32, 64, 128, 256, 512], "length": [32, 128, 512, 1024], "model": list(SIZES)}
QUICK = {"rollouts": [32, 128], "length": [32, 256], "model": ["2x128", "4x256", "6x768"]}


def _grpo_step(state, cfg):
    """One step of ``rlbits.loops.reinforce.train`` without the run around it (no logging, validation or
    checkpoint): its phases in order, each timed. Returns ``(time/<phase> seconds, the step's batch)``."""
    from rlbits.loops import reinforce
    from rlbits.loops.metrics import StepMetrics
    from rlbits.loops.run import PhaseTimer

    state.metrics, timer = StepMetrics(), PhaseTimer()
    with timer("rollout"):
        batch = reinforce.rollout(state, state.stream.next_batch(cfg.num_prompts_per_step, state.env), cfg)
    with timer("score"):
        batch = reinforce.score(state, batch, cfg)
    with timer("rollout"):
        batch = reinforce.dynamic_sampling(state, batch, cfg)
    for name in ("reference", "advantages", "update"):
        with timer(name):
            batch = getattr(reinforce, name)(state, batch, cfg)
    state.step += 1
    return timer.metrics(), batch


def _point(rollouts: int, length: int, size: str, threads: int) -> dict:
    import torch

    from rlbits.loops import reinforce
    from rlbits.loops.runtime import setup

    torch.set_num_threads(threads)
    layers, width, heads = SIZES[size]
    with tempfile.TemporaryDirectory(prefix="bench_scaling_") as tmp:
        folder = W.build_model_folder(
            Path(tmp) / "model", layers=layers, width=width, heads=heads, positions=16 + max(length, 32)
        )
        cfg = reinforce.ReinforceConfig(
            policy=str(folder),
            run_dir=str(Path(tmp) / "run"),
            num_prompts_per_step=rollouts // 4,
            num_generations_per_prompt=4,
            max_new_tokens=length,
            temperature=1.0,
            microbatch_size=32,
            cpu_threads=threads,
            adv_estimator="grpo",
            progress=False,
            tensorboard=False,
            val_at_start=False,
            val_at_end=False,
            val_period=0,
            device="cpu",
        )
        env = setup(cfg)
        state = reinforce.init_state(cfg, env, reward=W.rlbits_reward, prompts=W.prompts(rollouts // 4 * 3, seed=2))
        _grpo_step(state, cfg)  # warm-up
        t0 = time.perf_counter()
        phase_seconds, batch = _grpo_step(state, cfg)
        seconds = time.perf_counter() - t0
    return {
        "rollouts": rollouts,
        "length": length,
        "model": size,
        "params": sum(p.numel() for p in state.policy.parameters()),
        "step_s": seconds,
        "phases": phase_seconds,
        "response_len": float(batch["action_mask"].sum(-1).float().mean()),
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "load_1min": os.getloadavg()[0],
    }


def _plot(results: list[dict], axis: str, xs_key: str, xlabel: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in results if r["axis"] == axis and "step_s" in r]
    if not rows:
        return
    labels = [str(r[xs_key]) for r in rows]
    fig, ax = plt.subplots(figsize=(6, 3.6))
    ax.plot(labels, [r["step_s"] for r in rows], "o-", color="tab:blue")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("seconds per GRPO step", color="tab:blue")
    ax2 = ax.twinx()
    ax2.plot(labels, [r["peak_rss_mib"] for r in rows], "s--", color="tab:red")
    ax2.set_ylabel("peak RSS (MiB)", color="tab:red")
    ax.set_title(f"rlbits GRPO step vs {xlabel} (2 CPU threads)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="a smaller grid (about a quarter of the time)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, default=HERE / "results" / "bench_scaling.json")
    p.add_argument("--images", type=Path, default=HERE.parent / "docs" / "images")
    p.add_argument("--point", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.point:
        rollouts, length, size = args.point.split(",")
        print("@@" + json.dumps(_point(int(rollouts), int(length), size, args.threads)), flush=True)
        return []

    grid = QUICK if args.quick else FULL
    points = [("rollouts", n, 32, "4x256") for n in grid["rollouts"]]
    points += [("length", 32, n, "4x256") for n in grid["length"]]
    points += [("model", 32, 32, s) for s in grid["model"]]
    results = []
    cache: dict[tuple, dict] = {}
    for axis, rollouts, length, size in points:
        key = (rollouts, length, size)
        if key not in cache:
            cmd = [
                sys.executable,
                __file__,
                f"--point={rollouts},{length},{size}",
                f"--threads={args.threads}",
            ]
            proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("@@")]
            cache[key] = json.loads(lines[-1][2:]) if lines else {"error": proc.stderr[-2000:]}
        r = {"axis": axis, "rollouts": rollouts, "length": length, "model": size, **cache[key]}
        results.append(r)
        if "step_s" in r:
            print(
                f"{axis:<9} rollouts {rollouts:4d} length {length:5d} model {size}: {r['step_s']:7.2f} s/step, "
                f"peak RSS {r['peak_rss_mib']:6.0f} MiB (load {r['load_1min']:.1f})",
                flush=True,
            )
        else:
            print(f"{axis} {key} failed:\n{r['error']}", file=sys.stderr)
    _plot(results, "rollouts", "rollouts", "rollouts per step", args.images / "scaling_rollouts.png")
    _plot(results, "length", "length", "response length (tokens)", args.images / "scaling_length.png")
    _plot(results, "model", "model", "model (layers x width)", args.images / "scaling_model.png")
    table = ["| axis | rollouts | response length | model | params | s/step | peak RSS MiB | load |",
             "|---|---|---|---|---|---|---|---|"]
    for r in results:
        if "step_s" in r:
            table.append(
                f"| {r['axis']} | {r['rollouts']} | {r['length']} | {r['model']} | {r['params'] / 1e6:.1f}M | "
                f"{r['step_s']:.2f} | {r['peak_rss_mib']:.0f} | {r['load_1min']:.1f} |"
            )
    print("\n".join(table))
    import torch

    report = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "threads": args.threads,
        "quick": args.quick,
        "versions": {"torch": torch.__version__},
        "results": results,
        "table": "\n".join(table),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")
    return results


if __name__ == "__main__":
    main()
