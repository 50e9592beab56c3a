"""Writing a checkpoint: ``save_checkpoint`` (models and optimizers through DCP, RNG states, counters, the
manifest, all in a temporary folder renamed into place) and deleting checkpoints safely."""

from __future__ import annotations

import json
import random
import shutil
import warnings
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

from rlbits.distributed.checkpoint.export import save_hf_folder
from rlbits.distributed.checkpoint.manifest import (
    CHECKPOINTS,
    MANIFEST,
    is_rlbits_checkpoint,
    list_checkpoints,
    step_of,
    write_manifest,
)
from rlbits.distributed.env import DistEnv, barrier
from rlbits.distributed.parallelize import is_sharded
from rlbits.distributed.reduce import any_rank


def _rng_state(generators: Mapping[str, torch.Generator]) -> dict[str, Any]:
    np_state = np.random.get_state()
    return {
        "python": random.getstate(),
        "numpy": [np_state[0], np_state[1].tolist(), *np_state[2:]],
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "generators": {name: g.get_state() for name, g in generators.items()},
    }


def optimizer_states(models: Mapping[str, nn.Module], optimizers: Mapping[str, torch.optim.Optimizer]) -> dict:
    missing = sorted(set(optimizers) - set(models))
    if missing:
        raise ValueError(f"optimizers {missing} have no model of the same name (models: {sorted(models)})")
    return {name: get_optimizer_state_dict(models[name], opt) for name, opt in optimizers.items()}


def _discard(folder: Path) -> None:
    """Delete a checkpoint folder so that a kill midway never leaves a half-deleted ``step_N``: rename it to
    a temporary name first (atomic), then delete (a leftover ``.tmp_step_*`` is removed on the next start)."""
    trash = folder.with_name(f".tmp_{folder.name}.discarded")
    if trash.exists():
        shutil.rmtree(trash)
    folder.rename(trash)
    shutil.rmtree(trash, ignore_errors=True)


def _check_finite(models: Mapping[str, nn.Module], step: int, env: DistEnv) -> None:
    """Refuse to checkpoint NaN/inf weights (agreed over ranks, so every rank refuses together)."""
    bad = ""
    for name, model in models.items():
        for pname, p in model.named_parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            if not torch.isfinite(local.detach()).all():
                bad = f"{name}.{pname}"
                break
        if bad:
            break
    if any_rank(bool(bad), env):
        bad = bad or "a parameter on another rank"
    if bad:
        raise ValueError(
            f"refusing to checkpoint step {step}: {bad} holds NaN/inf (the previous checkpoint stays the newest)"
        )


def save_checkpoint(
    run_dir: str | Path,
    step: int,
    *,
    models: Mapping[str, nn.Module],
    optimizers: Mapping[str, torch.optim.Optimizer] | None = None,
    state: Mapping[str, Any] | None = None,
    generators: Mapping[str, torch.Generator] | None = None,
    tokenizer: Any = None,
    keep: int = 2,
    protect: Collection[int] = (),
    env: DistEnv | None = None,
    checksums: str = "all",
    hf_folders: bool = False,
) -> Path:
    """Write ``RUN_DIR/checkpoints/step_{step}`` atomically and delete all but the newest ``keep`` and those
    of the steps in ``protect``.

    Every rank must call it (at world size > 1 it is collective: DCP writes each rank's shards).

    Args:
        run_dir: the run directory.
        step: training steps completed.
        models: name -> module (the policy as ``policy``; e.g. ``value``): their weights go to ``dcp/``.
        optimizers: name -> optimizer of ``models[name]``.
        state: JSON-serialisable counters.
        generators: name -> ``torch.Generator`` whose state must resume exactly (sampling, data order).
        tokenizer: saved with the policy (or in ``tokenizer/``).
        keep: how many step checkpoints to keep.
        protect: steps whose checkpoints are kept besides the newest ``keep`` (the best ones: ``keep_top_k``).
        env: the ``DistEnv`` (None: world size 1).
        checksums: ``"all"`` (sha256 of every file, the weights in 16 MiB chunks hashed in parallel: a
            flipped byte anywhere is caught on resume) or ``"small"`` (sha256 of files under 1 MiB, sizes of
            all: a flipped byte in the weights is caught only if it makes them NaN/inf).
        hf_folders: also write each model as an HF folder (``from_pretrained``-loadable); world size 1 only.

    Returns:
        The checkpoint folder.

    Raises:
        ValueError: ``state`` holds a non-finite number or something JSON cannot store; an optimizer has no
            model of its name; ``checksums`` is not ``small``/``all``; ``hf_folders`` with sharded models.
    """
    if checksums not in ("small", "all"):
        raise ValueError(f"checksums must be 'small' or 'all', got {checksums!r}")
    env = env or DistEnv()
    optimizers = dict(optimizers or {})
    try:
        text = json.dumps({"step": step, **(state or {}), "world_size": env.world_size}, indent=2, allow_nan=False)
    except ValueError as e:
        raise ValueError(f"checkpoint state for step {step} is not finite JSON: {e}") from e
    _check_finite(models, step, env)
    if hf_folders and any(is_sharded(m) for m in models.values()):
        raise ValueError("hf_folders=True needs unsharded models (world size 1); export_model gathers sharded ones")
    root = Path(run_dir) / CHECKPOINTS
    final = root / f"step_{step}"
    tmp = root / f".tmp_step_{step}"
    foreign = env.is_main and final.exists() and not is_rlbits_checkpoint(final)
    if any_rank(foreign, env):  # a folder rlbits did not write is never replaced
        raise FileExistsError(
            f"cannot checkpoint step {step}: {str(final)!r} exists and is not an rlbits checkpoint (no "
            f"{MANIFEST} of step {step}); move it away (the previous checkpoint stays the newest)"
        )
    if env.is_main:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    barrier(env)
    try:
        payload: dict[str, Any] = {
            "optimizers": optimizer_states(models, optimizers),
            "models": {name: get_model_state_dict(m) for name, m in models.items()},
        }
        with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
            warnings.simplefilter("ignore", UserWarning)
            dcp.save(payload, checkpoint_id=tmp / "dcp", no_dist=env.world_size == 1, process_group=env.group)
        (tmp / "rng").mkdir(exist_ok=True)
        torch.save(_rng_state(generators or {}), tmp / "rng" / f"rank_{env.rank}.pt")
        if env.is_main:
            if hf_folders:
                for name, model in models.items():
                    save_hf_folder(model, tmp / name, tokenizer if name == "policy" else None)
            if tokenizer is not None:
                tokenizer.save_pretrained(str(tmp / "tokenizer"))
            (tmp / "state.json").write_text(text)
        barrier(env)
        if env.is_main:
            write_manifest(tmp, step, checksums)
            if final.exists():  # a redone step: move the old copy aside whole, never delete it in place
                _discard(final)
            tmp.rename(final)
    except BaseException:
        if env.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    if env.is_main:
        ours = [p for p in list_checkpoints(run_dir) if is_rlbits_checkpoint(p)]
        for old in ours[:-keep] if keep > 0 else []:
            if step_of(old) not in protect:
                _discard(old)
    barrier(env)
    return final


def discard_checkpoints(run_dir: str | Path) -> list[Path]:
    """Delete every checkpoint of ``run_dir`` that rlbits wrote (``is_rlbits_checkpoint``), as a run started
    over in its folder does; other folders under ``checkpoints/`` stay. Returns the deleted paths."""
    gone = [p for p in list_checkpoints(run_dir) if is_rlbits_checkpoint(p)]
    for path in gone:
        _discard(path)
    return gone

