"""Checkpoints for exact resume: models, optimizers, RNG states, counters; at any world size.

One format at every world size (docs/design.md, "Checkpoints"). Layout of ``RUN_DIR/checkpoints/step_N/``::

    dcp/               torch.distributed.checkpoint: every model's weights and every optimizer's state,
                       sharded as trained; loadable at any world size (DCP reshards), also without a process
                       group (a notebook)
    tokenizer/         the policy's tokenizer
    rng/rank_R.pt      each rank's python, numpy, torch (CPU and CUDA) RNG states and the loop's generators
    state.json         the loop state's counters and data positions (step, total_valid_tokens,
                       stream/sampler: consumed_samples, ...), total_steps, world_size
    manifest.json      every file's size, and the sha256 of the small ones (state, RNG, metadata,
                       tokenizer); of every file with ``checksums="all"``; written last
    policy/ value/ ... HF folders (``from_pretrained``), only on request (``hf_folders=True``, world size 1);
                       HF folders are otherwise written at export (``RUN_DIR/final``)

A checkpoint is written into a temporary folder and renamed into place, so a crash leaves either the whole
checkpoint or none. ``latest_checkpoint`` verifies the manifest (sizes always; checksums where recorded, so a
multi-GB checkpoint is not re-read on every save and resume unless asked) and falls back to the previous
checkpoint if the newest is torn or corrupted. Optimizer state dicts are keyed by parameter names
(``get_optimizer_state_dict``), so a checkpoint saved at N ranks resumes at M: weights and optimizer states
are resharded; the RNG streams restart from the seeds when N != M (the run continues, not bit-exactly).
Checkpoints of rlbits before this format (weights in HF folders at world size 1) are still read.
"""

from __future__ import annotations

import copy
import hashlib
import json
import random
import shutil
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from transformers import PreTrainedModel

from rlbits._seeds import derive_seed
from rlbits.distributed.env import DistEnv, barrier
from rlbits.distributed.parallelize import is_sharded
from rlbits.distributed.reduce import any_rank
from rlbits.models.load import save_pretrained
from rlbits.models.lora import is_lora, merge_lora

CHECKPOINTS = "checkpoints"
MANIFEST = "manifest.json"
SMALL_FILE = 1 << 20
"""Files below this many bytes get a sha256 in the manifest by default (the weights are larger)."""


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


def _save_model(model: nn.Module, path: Path, tokenizer: Any = None, *, owned: bool = False) -> None:
    """Write ``model`` as an HF folder; LoRA adapters are merged first, into a copy unless ``owned`` (the
    caller's throwaway replica), so the folder loads with plain ``from_pretrained``."""
    if is_lora(model):
        model = merge_lora(model if owned else copy.deepcopy(model))
    if isinstance(model, PreTrainedModel):
        save_pretrained(model, tokenizer, path)
    elif hasattr(model, "save_pretrained"):
        model.save_pretrained(str(path), tokenizer=tokenizer)  # ValueModel, ILQLModel
    else:
        raise TypeError(f"cannot checkpoint {type(model).__name__}: it has no save_pretrained method")


def _optimizer_states(models: Mapping[str, nn.Module], optimizers: Mapping[str, torch.optim.Optimizer]) -> dict:
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
        raise ValueError(f"refusing to checkpoint step {step}: {bad} holds NaN/inf (the previous checkpoint stays the newest)")


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
    env: DistEnv | None = None,
    checksums: str = "small",
    hf_folders: bool = False,
) -> Path:
    """Write ``RUN_DIR/checkpoints/step_{step}`` atomically and delete all but the newest ``keep``.

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
        env: the ``DistEnv`` (None: world size 1).
        checksums: ``"small"`` (sha256 of files under 1 MiB, sizes of all) or ``"all"`` (sha256 of every
            file: a flipped byte in the weights is then caught on resume, at the cost of reading them).
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
            "optimizers": _optimizer_states(models, optimizers),
            "models": {name: get_model_state_dict(m) for name, m in models.items()},
        }
        with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
            warnings.simplefilter("ignore", UserWarning)
            dcp.save(payload, checkpoint_id=tmp / "dcp", no_dist=env.world_size == 1)
        (tmp / "rng").mkdir(exist_ok=True)
        torch.save(_rng_state(generators or {}), tmp / "rng" / f"rank_{env.rank}.pt")
        if env.is_main:
            if hf_folders:
                for name, model in models.items():
                    _save_model(model, tmp / name, tokenizer if name == "policy" else None)
            if tokenizer is not None:
                tokenizer.save_pretrained(str(tmp / "tokenizer"))
            (tmp / "state.json").write_text(text)
        barrier(env)
        if env.is_main:
            files = sorted(p for p in tmp.rglob("*") if p.is_file())
            manifest = {"step": step, "checksums": checksums, "files": {}}
            for p in files:
                entry: dict[str, Any] = {"bytes": p.stat().st_size}
                if checksums == "all" or entry["bytes"] < SMALL_FILE:
                    entry["sha256"] = _sha256(p)
                manifest["files"][str(p.relative_to(tmp))] = entry
            (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2))
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
            _discard(old)
    barrier(env)
    return final


def is_rlbits_checkpoint(path: str | Path) -> bool:
    """Whether ``path`` is a checkpoint rlbits wrote: a ``step_N`` folder whose ``manifest.json`` is a JSON
    object of step N, or (a damaged one whose manifest is lost) that holds rlbits' ``state.json`` and ``dcp/``.
    Only these are ever pruned or replaced: a folder a user put under ``checkpoints/`` is left alone."""
    path = Path(path)
    if not (path.name.startswith("step_") and path.name[5:].isdigit() and path.is_dir() and not path.is_symlink()):
        return False
    try:
        manifest = json.loads((path / MANIFEST).read_text())
        if isinstance(manifest, dict) and manifest.get("step") == int(path.name[5:]):
            return True
    except (OSError, ValueError):
        pass
    return (path / "state.json").is_file() and (path / "dcp").is_dir()


def discard_checkpoints(run_dir: str | Path) -> list[Path]:
    """Delete every checkpoint of ``run_dir`` that rlbits wrote (``is_rlbits_checkpoint``), as a run started
    over in its folder does; other folders under ``checkpoints/`` stay. Returns the deleted paths."""
    gone = [p for p in list_checkpoints(run_dir) if is_rlbits_checkpoint(p)]
    for path in gone:
        _discard(path)
    return gone


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """Complete (renamed) step checkpoints of a run, oldest first."""
    root = Path(run_dir) / CHECKPOINTS
    if not root.is_dir():
        return []
    steps = [p for p in root.iterdir() if p.is_dir() and p.name.startswith("step_") and p.name[5:].isdigit()]
    return sorted(steps, key=lambda p: int(p.name[5:]))


def verify_checkpoint(path: str | Path) -> str | None:
    """None if every file of the manifest is present with its size (and its sha256, where the manifest
    records one), else what is wrong."""
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
        if f.stat().st_size != meta["bytes"]:
            return f"{rel} has {f.stat().st_size} bytes, the manifest says {meta['bytes']}"
        if "sha256" in meta and _sha256(f) != meta["sha256"]:
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


def resume_checkpoint(run_dir: str | Path, *, missing_ok: bool = False) -> Path | None:
    """The checkpoint a ``resume=True`` run continues from: ``latest_checkpoint(run_dir)``.

    Args:
        missing_ok: return None (with a warning) when the run started (has ``config.yaml``) but never wrote a
            checkpoint, e.g. it was killed during its first steps, so the caller starts it over. A folder
            that is not a run, or checkpoints that exist but are all damaged, still raise.

    Raises:
        FileNotFoundError: the run has no complete, verifying checkpoint.
    """
    if missing_ok and (Path(run_dir) / "config.yaml").is_file() and not list_checkpoints(run_dir):
        warnings.warn(f"run {str(run_dir)!r} has no checkpoint yet (it stopped before its first save): starting it over", stacklevel=2)
        return None
    path = latest_checkpoint(run_dir)
    if path is None:
        raise FileNotFoundError(
            f"resume=True but run_dir {str(run_dir)!r} has no checkpoint to resume from "
            f"(no complete checkpoint under {str(Path(run_dir) / CHECKPOINTS)!r})"
        )
    return path


def hf_folder(path: str | Path | None, name: str) -> Path | None:
    """``path/name`` if the checkpoint ``path`` holds model ``name`` as an HF folder (``hf_folders=True``, or a
    checkpoint of the earlier format), else None."""
    if path is None:
        return None
    folder = Path(path) / name
    return folder if (folder / "config.json").is_file() else None


def tokenizer_folder(path: str | Path) -> Path:
    """The folder holding a checkpoint's tokenizer (``tokenizer/``, or ``policy/`` in the earlier format)."""
    path = Path(path)
    return path / "tokenizer" if (path / "tokenizer").is_dir() else path / "policy"


def load_checkpoint(
    path: str | Path,
    *,
    models: Mapping[str, nn.Module] | None = None,
    optimizers: Mapping[str, torch.optim.Optimizer] | None = None,
    generators: Mapping[str, torch.Generator] | None = None,
    env: DistEnv | None = None,
) -> dict[str, Any]:
    """Restore weights (if the checkpoint holds them in ``dcp/``), optimizer and RNG states in place; return
    the counters of ``state.json``. Collective at world size > 1.

    Build ``models`` first (fresh, from the run's initial weights), shard them as for training, build the
    optimizers, then call this: the weights come from ``dcp/`` (or, in a checkpoint of the earlier format,
    from the HF folder ``path/name``).

    Args:
        models: name -> model (needed for every optimizer, whose states are keyed by parameter name).
        optimizers: name -> optimizer of ``models[name]``.
        generators: name -> generator; restored when the world size is the one saved, else left as seeded.
        env: the ``DistEnv`` (None: world size 1).

    Raises:
        ValueError: the checkpoint does not verify, or lacks a requested model, optimizer or generator.
    """
    path = Path(path)
    env = env or DistEnv()
    models = dict(models or {})
    problem = verify_checkpoint(path)
    if problem is not None:
        raise ValueError(f"checkpoint {str(path)!r} is damaged: {problem}")
    saved = json.loads((path / "state.json").read_text())
    stored = dcp.FileSystemReader(str(path / "dcp")).read_metadata().state_dict_metadata
    in_dcp = [name for name in models if any(k.startswith(f"models.{name}.") for k in stored)]
    for name in models:
        if name not in in_dcp:  # the earlier format: an HF folder
            _load_hf_weights(models[name], path, name)
    payload: dict[str, Any] = {}
    if optimizers:
        for model in models.values():  # a stale .grad makes the optimizer state load skip (silently)
            model.zero_grad(set_to_none=True)
        payload["optimizers"] = _optimizer_states(models, optimizers)
    if in_dcp:
        payload["models"] = {name: get_model_state_dict(models[name]) for name in in_dcp}
    if payload:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                dcp.load(payload, checkpoint_id=path / "dcp", no_dist=env.world_size == 1)
        except (Exception, CheckpointException) as e:  # DCP names the missing key deep in its planner (its
            # CheckpointException is a BaseException); say what was asked for
            failures = getattr(e, "failures", None)  # CheckpointException: per-rank exceptions
            why = "; ".join(sorted({str(f[0] if isinstance(f, tuple) else f).splitlines()[0] for f in failures.values()})) if failures else str(e)
            raise ValueError(
                f"checkpoint {str(path)!r} cannot restore models {in_dcp} / optimizers {sorted(optimizers or {})}: {why}"
            ) from e
        for name in in_dcp:
            set_model_state_dict(models[name], payload["models"][name])
        for name, opt in (optimizers or {}).items():
            set_optimizer_state_dict(models[name], opt, payload["optimizers"][name])
    rng = path / "rng" / f"rank_{env.rank}.pt"
    if saved.get("world_size", 1) == env.world_size and rng.is_file():
        _set_rng_state(torch.load(rng, weights_only=True), generators or {})
    elif generators:
        # No stream to map from N ranks to M: reseed each from its seed and the step, so the continued run
        # neither replays the first steps' noise nor depends on anything but (seed, step, rank).
        for name, g in generators.items():
            g.manual_seed(derive_seed(g.initial_seed(), env.rank, f"{name}/resumed_at_step_{saved.get('step', 0)}"))
        warnings.warn(
            f"checkpoint {str(path)!r} was saved at world size {saved.get('world_size', 1)}, resumed at "
            f"{env.world_size}: RNG streams are reseeded from (seed, step, rank) (the run continues, not bit-exactly)",
            stacklevel=2,
        )
    return saved


def _load_hf_weights(model: nn.Module, path: Path, name: str) -> None:
    """Weights of model ``name`` from the HF folder of a checkpoint written before dcp/ held every model."""
    earlier = {"value_model": "value", "model": "policy"}  # the folder names of the earlier format
    folder = hf_folder(path, name) or hf_folder(path, earlier.get(name, name))
    if folder is None:
        raise ValueError(f"checkpoint {str(path)!r} holds no weights of model {name!r} (neither in dcp/ nor {name}/)")
    if is_sharded(model):
        raise ValueError(
            f"checkpoint {str(path)!r} is of the earlier format (HF folders); resume it in one process first"
        )
    loaded = type(model).from_pretrained(str(folder))  # HF causal LM, ValueModel or ILQLModel
    model.load_state_dict(loaded.state_dict())


def export_model(
    model: nn.Module,
    path: str | Path,
    *,
    tokenizer: Any = None,
    env: DistEnv | None = None,
    build: Callable[[], nn.Module] | None = None,
) -> Path | None:
    """Save ``model`` as an HF folder at ``path`` from rank 0 (collective at world size > 1).

    A model with LoRA adapters (``rlbits.models.lora``) is saved with them merged into its weights (a copy
    is merged; ``model`` keeps its adapters), so the folder is an ordinary HF folder.

    A sharded model's full weights are gathered to rank 0's CPU (``get_model_state_dict(full_state_dict,
    cpu_offload)``) and loaded into ``build()``, an unsharded model of the same architecture on CPU, whose
    ``save_pretrained`` writes the folder.

    Returns:
        ``Path(path)`` on rank 0, None elsewhere.

    Raises:
        ValueError: ``model`` is sharded and no ``build`` was given.
    """
    env = env or DistEnv()
    path = Path(path)
    if is_sharded(model):
        if build is None:
            raise ValueError("export_model of a sharded model needs build=, a factory of an unsharded replica")
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if env.is_main:
            replica = build()
            replica.load_state_dict(full)
            _save_model(replica, path, tokenizer, owned=True)
        barrier(env)
        return path if env.is_main else None
    if env.is_main:
        _save_model(model, path, tokenizer)
    barrier(env)
    return path if env.is_main else None
