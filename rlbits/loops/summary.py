"""The end-of-run summary ``rlbits train`` prints: what the run reached and what to type next.

    from rlbits.loops.summary import summarize
    print(summarize("runs/default"))

Built from the run directory alone (``metrics.jsonl`` and ``config.yaml``), so it works after the fact, on a
run stopped early or resumed several times.
"""

from __future__ import annotations

import math
import shlex
from pathlib import Path
from typing import Any

from rlbits.loops.config import ConfigError, read_yaml
from rlbits.loops.logger import read_metrics


def _last(rows: list[dict[str, Any]], key: str) -> tuple[int, float] | None:
    for row in reversed(rows):
        if isinstance(row.get(key), (int, float)):
            return row["step"], float(row[key])
    return None


def _first(rows: list[dict[str, Any]], key: str) -> tuple[int, float] | None:
    for row in rows:
        if isinstance(row.get(key), (int, float)):
            return row["step"], float(row[key])
    return None


def _wall_seconds(rows: list[dict[str, Any]]) -> float:
    """Seconds of all sessions together: ``time_s`` counts from each session's start, so it drops at a resume."""
    total, last = 0.0, 0.0
    for row in rows:
        t = row.get("time_s")
        if not isinstance(t, (int, float)):
            continue
        if t < last:  # a resumed session starts counting again
            total += last
        last = t
    return total + last


def _duration(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, s = divmod(round(seconds), 60)
    return f"{minutes} min {s:02d} s" if minutes < 60 else f"{minutes // 60} h {minutes % 60:02d} min"


def summarize(run_dir: str | Path) -> str:
    """A few lines on the run in ``run_dir``: validation reward at the start and the end, final KL to the
    initial policy, steps, wall time, tokens/s, the ``final/`` folder and the commands to go on.

    Raises:
        FileNotFoundError: ``run_dir`` holds no ``metrics.jsonl``.
    """
    run_dir = Path(run_dir)
    rows = read_metrics(run_dir)
    try:
        cfg = read_yaml(run_dir / "config.yaml")
    except ConfigError:
        cfg = {}
    steps = max((r.get("step", 0) for r in rows), default=0)
    max_steps = cfg.get("max_num_steps")
    quoted = shlex.quote(str(run_dir))
    lines = [f"run {run_dir}: {cfg.get('loop', '?')} on task {cfg.get('task', '?')}"]
    lines.append(f"  steps         {steps}" + (f" of {max_steps}" if max_steps else ""))
    first, last = _first(rows, "val_reward"), _last(rows, "val_reward")
    if first is not None and last is not None and first[0] != last[0]:
        lines.append(f"  val_reward    {first[1]:.4f} (step {first[0]}) -> {last[1]:.4f} (step {last[0]})")
    elif last is not None:
        lines.append(f"  val_reward    {last[1]:.4f} (step {last[0]})")
    for name in ("val_accuracy", "val_ood_accuracy", "val_prefix_accuracy"):  # the reward_model loop
        acc = _last(rows, name)
        if acc is not None:
            lines.append(f"  {name:<13} {acc[1]:.4f} (step {acc[0]})")
    kl = _last(rows, "init_policy_kl")
    if kl is not None:
        lines.append(
            f"  final KL      {kl[1]:.4f} nats/sequence to the initial policy (init_policy_kl, step {kl[0]})"
        )
    lines.append(f"  wall time     {_duration(_wall_seconds(rows))}")
    step_time = sum(r["time/step"] for r in rows if isinstance(r.get("time/step"), (int, float)))
    tokens = sum(
        r["tokens_per_s"] * r["time/step"]
        for r in rows
        if isinstance(r.get("tokens_per_s"), (int, float)) and isinstance(r.get("time/step"), (int, float))
    )
    if step_time > 0 and math.isfinite(tokens):
        lines.append(
            f"  tokens/s      {tokens / step_time:.0f} (trained tokens per second of training steps)"
        )
    final = run_dir / "final"
    lines.append(f"  final policy  {final}" + ("" if final.is_dir() else " (not written)"))
    more = steps + (max_steps if isinstance(max_steps, int) and max_steps > 0 else 100)
    commands = [
        (f"rlbits eval {quoted}", "test reward of final/ next to the base model's"),
        (f"rlbits plot {quoted}", "PNG of reward, KL, losses, entropy, throughput"),
        (f"rlbits train --resume {quoted} max_num_steps={more}", f"continue the run to step {more}"),
    ]
    width = max(len(c) for c, _ in commands)
    lines += ["next:", *(f"  {c.ljust(width)}   # {what}" for c, what in commands)]
    return "\n".join(lines)


__all__ = ["summarize"]
