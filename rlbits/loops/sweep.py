"""A grid of training runs, each in its own process: ``rlbits sweep`` and ``rlbits.sweep``.

    import rlbits
    rows = rlbits.sweep("configs/rloo_arithmetic.yaml", {"policy_loss": ["vanilla", "gspo"], "seed": [0, 1, 2]},
                        out_dir="runs/losses", max_num_steps=20)

    rlbits sweep configs/rloo_arithmetic.yaml policy_loss=vanilla,gspo seed=0,1,2 max_num_steps=20 --out runs/losses

Every combination of the grid's values (the cartesian product, in the order the axes are given) is one run of
``rlbits train`` in a subprocess, with its own run directory ``OUT_DIR/<name>``, where the name is the
combination written as ``key=value,key=value`` (``policy_loss=gspo,seed=1``). Up to ``processes`` runs go at
once. Every run's config is resolved and checked before the first starts (a bad key or value fails the sweep at
once) and written to ``OUT_DIR/configs/<name>.yaml``; each run's output goes to ``OUT_DIR/logs/<name>.log``.

The summary ``OUT_DIR/summary.jsonl`` (one row per run: the grid values, ``name``, ``run_dir``, ``status``
(``finished``, ``failed``, ``interrupted``), ``returncode``, ``seconds``, ``log`` and the last value of every
logged metric as ``final/<metric>``) is rewritten as each run ends. A second sweep into the same ``OUT_DIR``
skips the runs the summary lists as finished with the same config and starts every other run over (``rlbits
train --force``): a crashed or interrupted run does not continue from its checkpoint, so no result depends on
where a run stopped.

Comma rule of the command line: ``key=a,b,c`` is a grid axis of three values; each value is read as YAML, as
in ``rlbits train key=value``. A comma inside brackets, braces or quotes does not split: ``stop=[a,b]`` is one
value (a list), ``stop=[a,b],[c]`` an axis of two lists, ``name="a,b"`` one string.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from rlbits.loops.config import ConfigError, RunConfig, parse_overrides, save_config
from rlbits.loops.logger import read_metrics

SUMMARY = "summary.jsonl"
FINISHED, FAILED, INTERRUPTED = "finished", "failed", "interrupted"


def split_values(raw: str) -> list[str]:
    """The comma-separated values of one command-line grid axis, ``"0.1,[1,2],'a,b'"`` -> ``["0.1", "[1,2]",
    "'a,b'"]``: commas inside ``[]``, ``{}`` or quotes do not split. Raises ConfigError for an empty value
    (``a,,b``) or unbalanced brackets."""
    values, depth, quote, start = [], 0, "", 0
    for i, ch in enumerate(raw):
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in "[{":
            depth += 1
        elif ch in "]}":
            depth -= 1
            if depth < 0:
                raise ConfigError(f"{raw!r}: a closing {ch!r} without its opening bracket")
        elif ch == "," and depth == 0:
            values.append(raw[start:i])
            start = i + 1
    values.append(raw[start:])
    if depth or quote:
        raise ConfigError(f"{raw!r}: an unclosed bracket or quote")
    if any(not v.strip() for v in values):
        raise ConfigError(f"{raw!r}: an empty value between commas")
    return values


def parse_grid(args: Sequence[str]) -> tuple[dict[str, list[Any]], dict[str, Any]]:
    """``["policy_loss=vanilla,gspo", "seed=0,1", "max_num_steps=20"]`` -> the grid ``{"policy_loss":
    ["vanilla", "gspo"], "seed": [0, 1]}`` and the fixed overrides ``{"max_num_steps": 20}``: an argument whose
    value has a comma outside brackets and quotes (``split_values``) is an axis, each value parsed as YAML by
    ``parse_overrides``. Raises ConfigError for an argument that is not ``key=value``, a key given twice, or a
    value that is not YAML."""
    grid: dict[str, list[Any]] = {}
    fixed: dict[str, Any] = {}
    for item in args:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfigError(f"argument {item!r} is not of the form key=value or key=a,b,c")
        if key in grid or key in fixed:
            raise ConfigError(f"{key} is given twice; give an axis's values once, comma-separated: {key}=a,b")
        values = split_values(raw) if raw.strip() else [raw]
        parsed = [parse_overrides([f"{key}={v}"])[key] for v in values]
        if len(values) > 1:
            grid[key] = parsed
        else:
            fixed[key] = parsed[0]
    return grid, fixed


def grid_points(grid: Mapping[str, Sequence[Any]]) -> list[dict[str, Any]]:
    """The cartesian product of ``grid``'s values, one dict per combination; the last axis varies fastest.
    Raises ConfigError for an axis without values or with a value twice."""
    for key, values in grid.items():
        if isinstance(values, (str, bytes)) or not isinstance(values, Sequence) or not values:
            raise ConfigError(f"grid axis {key!r} must be a non-empty list of values, got {values!r}")
        if len({json.dumps(v, sort_keys=True, default=str) for v in values}) != len(values):
            raise ConfigError(f"grid axis {key!r} has a value twice: {list(values)!r}")
    return [dict(zip(grid, combo, strict=True)) for combo in itertools.product(*grid.values())]


def _text(value: Any) -> str:
    if isinstance(value, str):
        return value
    return json.dumps(value, separators=(",", ":")) if value is not None else "null"


def run_name(point: Mapping[str, Any]) -> str:
    """The folder name of a grid point: ``policy_loss=gspo,seed=1``; characters other than letters, digits and
    ``.+-_`` in a value become ``_`` (so a path or a list stays one folder name)."""
    if not point:
        return "run"
    return ",".join(f"{k}={re.sub(r'[^A-Za-z0-9.+_-]', '_', _text(v))}" for k, v in point.items())


def default_processes(cpu_threads: int) -> int:
    """Runs at once that fit this machine: its CPU count over each run's ``cpu_threads`` (0, torch's default of
    every core: one run at a time)."""
    cpus = os.cpu_count() or 1
    return max(1, cpus // cpu_threads) if cpu_threads > 0 else 1


def read_summary(out_dir: str | Path) -> list[dict[str, Any]]:
    """The rows of ``OUT_DIR/summary.jsonl`` (``[]`` if there is none)."""
    path = Path(out_dir) / SUMMARY
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def final_metrics(run_dir: str | Path) -> dict[str, float]:
    """The last logged value of every numeric metric of a run (``metrics.jsonl``), as ``final/<metric>``;
    ``{}`` for a run that logged nothing."""
    try:
        rows = read_metrics(run_dir)
    except FileNotFoundError:
        return {}
    last: dict[str, float] = {}
    for row in rows:
        for key, value in row.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                last[f"final/{key}"] = value
    return last


def _write_summary(out_dir: Path, rows: list[dict[str, Any]]) -> None:
    tmp = out_dir / f".{SUMMARY}.tmp"
    tmp.write_text("".join(json.dumps(r, default=str) + "\n" for r in rows))
    os.replace(tmp, out_dir / SUMMARY)  # a reader (or a killed sweep) never sees half a file


def _child_env() -> dict[str, str]:
    """The environment of a run: this one, with the folder this ``rlbits`` is imported from first on
    PYTHONPATH, so that the child trains with the same code (a checkout run from elsewhere, a notebook)."""
    env = dict(os.environ)
    folder = Path(__file__).resolve().parents[2]
    if folder.name in ("site-packages", "dist-packages"):  # an installed rlbits: the child finds it there too
        return env
    root = str(folder)
    paths = env.get("PYTHONPATH", "").split(os.pathsep) if env.get("PYTHONPATH") else []
    if root not in paths:
        env["PYTHONPATH"] = os.pathsep.join([root, *paths])
    return env


def _start(config_path: Path, log, force: bool) -> subprocess.Popen:
    command = [sys.executable, "-m", "rlbits", "train", str(config_path), *(["--force"] if force else [])]
    return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=_child_env())


def sweep(
    config: str | Path | dict[str, Any] | RunConfig | None,
    grid: Mapping[str, Sequence[Any]],
    *,
    out_dir: str | Path,
    processes: int | None = None,
    verbose: bool = True,
    **overrides: Any,
) -> list[dict[str, Any]]:
    """Train one run per combination of ``grid``'s values, each ``rlbits train`` in its own process, and
    return the summary: one row per run, in grid order (also in ``OUT_DIR/summary.jsonl``).

    Args:
        config: the base config, as ``rlbits.train`` takes it (a YAML path, a dict, a config, None: the
            default PPO job).
        grid: config field -> the values to try, ``{"policy_loss": ["vanilla", "gspo"], "seed": [0, 1, 2]}``.
        out_dir: the sweep's folder; run ``NAME`` (``run_name``: ``policy_loss=gspo,seed=1``) trains in
            ``OUT_DIR/NAME``, from ``OUT_DIR/configs/NAME.yaml``, writing its output to ``OUT_DIR/logs/NAME.log``.
        processes: runs at once; default ``os.cpu_count() // cpu_threads`` (``default_processes``).
        verbose: print a line as each run starts and ends.
        **overrides: config fields set in every run (``max_num_steps=20``); a grid axis wins over them.

    Each row holds the grid values (as the config holds them: ``learning_rate=1e-3`` is ``0.001``), ``name``,
    ``run_dir``, ``status``, ``returncode``, ``seconds`` (wall clock), ``log`` and ``final/<metric>`` for every
    metric the run logged (its last value). ``status``: ``finished`` (exit status 0), ``failed`` (any other;
    the other runs go on) or ``interrupted`` (stopped by a KeyboardInterrupt of the sweep: Ctrl-C, a notebook's
    interrupt button, which sends each running run SIGINT, so that it saves and stops, starts no more runs and
    re-raises). A run that the summary of an earlier sweep into ``out_dir`` lists as finished, with the same
    resolved config and its run directory still there, is not run again; any other run starts over
    (``rlbits train --force``).

    Raises:
        ConfigError: an empty grid axis, a value twice in an axis, two runs with one folder name, or a config
            (with any grid point's values) that does not validate; nothing has run then.
        ValueError: ``processes`` < 1.
    """
    from rlbits.loops.api import resolve_config

    out_dir = Path(out_dir)
    if processes is not None and processes < 1:
        raise ValueError(f"processes must be >= 1, got {processes}")
    points = grid_points(grid)
    names = [run_name(p) for p in points]
    clash = sorted({n for n in names if names.count(n) > 1})
    if clash:
        raise ConfigError(
            f"grid points share the folder name {clash[0]!r}; make the values differ in letters"
        )
    configs = [
        resolve_config(config, {**overrides, **point, "run_dir": str(out_dir / name)})
        for point, name in zip(points, names, strict=True)
    ]  # every config validates before anything runs
    if processes is None:
        processes = default_processes(max(c.cpu_threads for c in configs))
    for sub in ("configs", "logs"):
        (out_dir / sub).mkdir(parents=True, exist_ok=True)
    before = {r.get("name"): r for r in read_summary(out_dir)}
    rows: dict[str, dict[str, Any]] = {}
    todo = []
    for point, name, cfg in zip(points, names, configs, strict=True):
        config_path = out_dir / "configs" / f"{name}.yaml"
        old_config = config_path.read_text() if config_path.is_file() else None
        save_config(cfg, config_path)
        old = before.get(name)
        if (
            old is not None
            and old.get("status") == FINISHED
            and old_config == config_path.read_text()
            and Path(cfg.run_dir, "metrics.jsonl").is_file()
        ):  # finished with this very config: keep it
            rows[name] = old
            if verbose:
                print(f"rlbits sweep: {name}: finished before, skipped")
            continue
        todo.append((point, name, cfg, config_path))

    lock = threading.Lock()
    running: dict[str, subprocess.Popen] = {}
    interrupted = threading.Event()

    def ordered() -> list[dict[str, Any]]:
        return [rows[n] for n in names if n in rows]

    def run(item: tuple[dict[str, Any], str, RunConfig, Path]) -> None:
        point, name, cfg, config_path = item
        log = out_dir / "logs" / f"{name}.log"
        if verbose:
            print(f"rlbits sweep: {name}: started")
        force = Path(cfg.run_dir).exists()  # left by an earlier, unfinished try: start it over
        start = time.perf_counter()
        with open(log, "w") as log_file, lock:
            if interrupted.is_set():
                return
            running[name] = _start(config_path, log_file, force)
        code = running[name].wait()
        seconds = time.perf_counter() - start
        # a run stopped by the interrupt exits 0 after saving (a requested stop), but it did not finish
        status = INTERRUPTED if interrupted.is_set() else FINISHED if code == 0 else FAILED
        row = {
            **{k: getattr(cfg, k) for k in point},
            "name": name,
            "run_dir": cfg.run_dir,
            "status": status,
            "returncode": code,
            "seconds": round(seconds, 3),
            "log": str(log),
            **final_metrics(cfg.run_dir),
        }
        with lock:
            rows[name] = row
            _write_summary(out_dir, ordered())
        if verbose:
            print(
                f"rlbits sweep: {name}: {status} in {seconds:.1f} s" + ("" if code == 0 else f" (see {log})")
            )

    with ThreadPoolExecutor(max_workers=min(processes, max(1, len(todo)))) as pool:
        try:
            list(pool.map(run, todo))  # a thread waits on each running process
        except KeyboardInterrupt:  # Ctrl-C, a notebook's interrupt: stop the runs (each saves), start no more
            with lock:
                interrupted.set()
                for proc in running.values():
                    if proc.poll() is None:
                        proc.send_signal(signal.SIGINT)
            pool.shutdown(wait=True, cancel_futures=True)
            raise
    summary = ordered()
    _write_summary(out_dir, summary)
    return summary


__all__ = [
    "default_processes",
    "final_metrics",
    "grid_points",
    "parse_grid",
    "read_summary",
    "run_name",
    "split_values",
    "sweep",
]
