"""Checkpoints for exact resume: models in HF format (safetensors), optimizers, RNG states, counters.

Layout of ``RUN_DIR/checkpoints/step_N/``::

    policy/            HF folder (config.json, model.safetensors, tokenizer files): loadable with from_pretrained
    value/ ...         one folder per extra model, written by its own ``save_pretrained``
    optimizers.pt      optimizer state dicts (loaded with ``torch.load(weights_only=True)``)
    rng.pt             python, numpy and torch (CPU and CUDA) RNG states, and the loop's named generators
    state.json         counters: consumed_samples, current_step, current_epoch, total_valid_tokens, ...
    manifest.json      every file's size and sha256; written last

A checkpoint is written into a temporary folder and renamed into place, so a crash leaves either the whole
checkpoint or none. ``latest_checkpoint`` verifies the manifest and falls back to the previous checkpoint if
the newest is torn or corrupted. Only rank 0 writes (single-process checkpoints; sharded
``torch.distributed.checkpoint`` saves come with the FSDP2 path).
"""

from __future__ import annotations

import hashlib
import json
import random
import shutil
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

CHECKPOINTS = "checkpoints"
MANIFEST = "manifest.json"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _rng_state(generators: Mapping[str, torch.Generator]) -> dict[str, Any]:
    np_state = np.random.get_state()
    return {
        "python": random.getstate(),
        "numpy": [np_state[0], np_state[1].tolist(), *np_state[2:]],
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "generators": {name: g.get_state() for name, g in generators.items()},
    }


def _set_rng_state(state: Mapping[str, Any], generators: Mapping[str, torch.Generator]) -> None:
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    kind, keys, *rest = state["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), *rest))
    torch.set_rng_state(state["torch"])
    if torch.cuda.is_available() and state["cuda"]:
        torch.cuda.set_rng_state_all(state["cuda"])
    for name, g in generators.items():
        if name not in state["generators"]:
            raise ValueError(f"checkpoint has no state for generator {name!r} (has {sorted(state['generators'])})")
        g.set_state(state["generators"][name])


def _save_model(model: torch.nn.Module, path: Path) -> None:
    if not hasattr(model, "save_pretrained"):
        raise TypeError(f"cannot checkpoint {type(model).__name__}: it has no save_pretrained method")
    model.save_pretrained(str(path))


def save_checkpoint(
    run_dir: str | Path,
    step: int,
    *,
    models: Mapping[str, torch.nn.Module],
    optimizers: Mapping[str, torch.optim.Optimizer] | None = None,
    state: Mapping[str, Any] | None = None,
    generators: Mapping[str, torch.Generator] | None = None,
    tokenizer: Any = None,
    keep: int = 2,
) -> Path:
    """Write ``RUN_DIR/checkpoints/step_{step}`` atomically and delete all but the newest ``keep``.

    Args:
        run_dir: the run directory.
        step: training steps completed.
        models: name -> module with ``save_pretrained`` (the policy as ``policy``; e.g. ``value``, ``ilql``).
        optimizers: name -> optimizer.
        state: JSON-serialisable counters.
        generators: name -> ``torch.Generator`` whose state must resume exactly (sampling, data order).
        tokenizer: saved into ``policy/`` so that folder is a complete HF checkpoint.
        keep: how many step checkpoints to keep.

    Returns:
        The checkpoint folder.

    Raises:
        ValueError: ``state`` holds a non-finite number or something JSON cannot store.
    """
    root = Path(run_dir) / CHECKPOINTS
    final = root / f"step_{step}"
    tmp = root / f".tmp_step_{step}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    try:
        for name, model in models.items():
            _save_model(model, tmp / name)
        if tokenizer is not None and "policy" in models:
            tokenizer.save_pretrained(str(tmp / "policy"))
        torch.save({k: o.state_dict() for k, o in (optimizers or {}).items()}, tmp / "optimizers.pt")
        torch.save(_rng_state(generators or {}), tmp / "rng.pt")
        try:
            text = json.dumps({"step": step, **(state or {})}, indent=2, allow_nan=False)
        except ValueError as e:
            raise ValueError(f"checkpoint state for step {step} is not finite JSON: {e}") from e
        (tmp / "state.json").write_text(text)
        files = sorted(p for p in tmp.rglob("*") if p.is_file())
        manifest = {
            "step": step,
            "files": {str(p.relative_to(tmp)): {"bytes": p.stat().st_size, "sha256": _sha256(p)} for p in files},
        }
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2))
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    for old in list_checkpoints(run_dir)[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    return final


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """Complete (renamed) step checkpoints of a run, oldest first."""
    root = Path(run_dir) / CHECKPOINTS
    if not root.is_dir():
        return []
    steps = [p for p in root.iterdir() if p.is_dir() and p.name.startswith("step_") and p.name[5:].isdigit()]
    return sorted(steps, key=lambda p: int(p.name[5:]))


def verify_checkpoint(path: str | Path) -> str | None:
    """None if every file of the manifest is present with its size and sha256, else what is wrong."""
    path = Path(path)
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        return "no manifest.json"
    try:
        manifest = json.loads(manifest_path.read_text())
    except json.JSONDecodeError as e:
        return f"manifest.json is not valid JSON ({e})"
    for rel, meta in manifest.get("files", {}).items():
        f = path / rel
        if not f.is_file():
            return f"{rel} is missing"
        if f.stat().st_size != meta["bytes"] or _sha256(f) != meta["sha256"]:
            return f"{rel} does not match its checksum"
    return None


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The newest checkpoint that verifies; a torn or corrupted newer one is skipped with a warning."""
    for path in reversed(list_checkpoints(run_dir)):
        problem = verify_checkpoint(path)
        if problem is None:
            return path
        warnings.warn(f"skipping checkpoint {path}: {problem}", stacklevel=2)
    return None


def resume_checkpoint(run_dir: str | Path) -> Path:
    """The checkpoint a ``resume=True`` run continues from: ``latest_checkpoint(run_dir)``.

    Raises:
        FileNotFoundError: the run has no complete, verifying checkpoint.
    """
    path = latest_checkpoint(run_dir)
    if path is None:
        raise FileNotFoundError(
            f"resume=True but run_dir {str(run_dir)!r} has no checkpoint to resume from "
            f"(no complete checkpoint under {str(Path(run_dir) / CHECKPOINTS)!r})"
        )
    return path


def load_checkpoint(
    path: str | Path,
    *,
    optimizers: Mapping[str, torch.optim.Optimizer] | None = None,
    generators: Mapping[str, torch.Generator] | None = None,
) -> dict[str, Any]:
    """Restore optimizer and RNG states in place and return the counters of ``state.json``.

    Models are not touched: rebuild them from ``path / NAME`` (HF folders) before building the optimizers.

    Raises:
        ValueError: the checkpoint does not verify, or lacks a requested optimizer or generator.
    """
    path = Path(path)
    problem = verify_checkpoint(path)
    if problem is not None:
        raise ValueError(f"checkpoint {str(path)!r} is damaged: {problem}")
    saved = torch.load(path / "optimizers.pt", weights_only=True)
    for name, opt in (optimizers or {}).items():
        if name not in saved:
            raise ValueError(f"checkpoint {str(path)!r} has no optimizer {name!r} (has {sorted(saved)})")
        opt.load_state_dict(saved[name])
    _set_rng_state(torch.load(path / "rng.pt", weights_only=True), generators or {})
    return json.loads((path / "state.json").read_text())
