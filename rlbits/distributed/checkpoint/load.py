"""Loading a checkpoint: ``load_checkpoint`` (every check before anything is used, the large files hashed
while DCP reads them) and ``restore_checkpoint`` (the newest checkpoint that loads, falling back on failure)."""

from __future__ import annotations

import json
import math
import random
import warnings
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from rlbits._seeds import derive_seed
from rlbits.distributed.checkpoint.manifest import (
    CheckpointError,
    first_line,
    list_checkpoints,
    read_manifest,
    step_of,
    verify_files,
)
from rlbits.distributed.checkpoint.safe_read import _SafePlanner, _SafeReader, read_dcp_metadata
from rlbits.distributed.checkpoint.save import optimizer_states
from rlbits.distributed.env import DistEnv


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


def _agree(problem: str | None, env: DistEnv) -> str | None:
    """The first rank's problem, if any rank has one (one ``all_gather_object`` at world size > 1)."""
    if env.world_size == 1:
        return problem
    import torch.distributed as dist

    problems: list[str | None] = [None] * env.world_size
    dist.all_gather_object(problems, problem, group=env.group)
    return next((p if r == env.rank else f"rank {r}: {p}" for r, p in enumerate(problems) if p is not None), None)


def _read_state(path: Path) -> dict[str, Any]:
    """``state.json`` of checkpoint ``path``, with the fields every checkpoint has checked.

    Raises:
        CheckpointError: not a JSON object; ``step`` not an int equal to the folder's ``step_N``;
            ``world_size`` or ``total_steps`` not an int >= 1 (the message names the field and the file).
    """
    file = path / "state.json"
    try:
        saved = json.loads(file.read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{str(file)!r} cannot be read as JSON: {e}") from None
    if not isinstance(saved, dict):
        raise CheckpointError(f"{str(file)!r} holds a {type(saved).__name__}, not a JSON object")
    step = saved.get("step")
    if type(step) is not int or step != step_of(path):
        raise CheckpointError(
            f"{str(file)!r}: field 'step' is {step!r}; its folder {path.name} says {step_of(path)}"
        )
    for name in ("world_size", "total_steps"):
        if name in saved and (type(saved[name]) is not int or saved[name] < 1):
            raise CheckpointError(f"{str(file)!r}: field {name!r} must be an int >= 1, got {saved[name]!r}")
    return saved


def _check_storage(path: Path, metadata: dcp_metadata.Metadata, manifest: Mapping[str, Any]) -> None:
    """Every file DCP's metadata points at is a file of ``dcp/`` that the manifest lists."""
    for info in (metadata.storage_data or {}).values():
        rel = getattr(info, "relative_path", None)
        plain = isinstance(rel, str) and Path(rel).name == rel and not rel.startswith(".")
        if not plain or f"dcp/{rel}" not in manifest["files"]:
            raise CheckpointError(
                f"{str(path / 'dcp' / '.metadata')!r} points at {rel!r}, which is not a file of the checkpoint"
            )


def _check_fit(
    path: Path, models: Mapping[str, nn.Module], in_dcp: list[str], metadata: dcp_metadata.Metadata
) -> None:
    """Each model of ``in_dcp`` has exactly the tensors the checkpoint holds for it, of the same shapes and
    dtypes (DCP would otherwise cast dtypes silently and name a missing key deep in its planner)."""
    stored = metadata.state_dict_metadata
    for name in in_dcp:
        prefix = f"models.{name}."
        expected = get_model_state_dict(models[name])
        saved = {k[len(prefix) :]: v for k, v in stored.items() if k.startswith(prefix)}
        missing, extra = sorted(set(expected) - set(saved)), sorted(set(saved) - set(expected))
        if missing or extra:
            raise CheckpointError(
                f"checkpoint {str(path)!r} cannot restore model {name!r}: it lacks {missing[:3]} and has "
                f"{extra[:3]} besides the model's tensors",
                mismatch=True,
            )
        for key, tensor in expected.items():
            meta = saved[key]
            if not isinstance(tensor, torch.Tensor) or not isinstance(meta, dcp_metadata.TensorStorageMetadata):
                continue
            if tuple(meta.size) != tuple(tensor.shape) or meta.properties.dtype != tensor.dtype:
                kind = "Size mismatch" if tuple(meta.size) != tuple(tensor.shape) else "dtype mismatch"
                raise CheckpointError(
                    f"checkpoint {str(path)!r} cannot restore {name}.{key}: {kind}: it holds {tuple(meta.size)} "
                    f"{meta.properties.dtype}, the model {tuple(tensor.shape)} {tensor.dtype}",
                    mismatch=True,
                )


def _first_non_finite(payload: Mapping[str, Any], prefix: str = "") -> str | None:
    """The name of the first floating-point tensor of ``payload`` (nested dicts/lists) holding NaN/inf."""
    items = payload.items() if isinstance(payload, Mapping) else enumerate(payload)
    for key, value in items:
        name = f"{prefix}{key}"
        if isinstance(value, torch.Tensor):
            local = value.to_local() if hasattr(value, "to_local") else value
            # the max-norm propagates NaN and inf, and is several times cheaper than isfinite(t).all()
            norm = torch.linalg.vector_norm(local, math.inf) if local.is_floating_point() and local.numel() else None
            if norm is not None and not torch.isfinite(norm):
                return name
        elif isinstance(value, (Mapping, list, tuple)):
            found = _first_non_finite(value, f"{name}.")
            if found:
                return found
    return None


def load_checkpoint(
    path: str | Path,
    *,
    models: Mapping[str, nn.Module] | None = None,
    optimizers: Mapping[str, torch.optim.Optimizer] | None = None,
    generators: Mapping[str, torch.Generator] | None = None,
    env: DistEnv | None = None,
    check_state: Callable[[dict[str, Any]], None] | None = None,
    verify: bool = True,
) -> dict[str, Any]:
    """Restore weights, optimizer and RNG states in place; return the counters of ``state.json``. Collective at
    world size > 1 (every check is agreed over the ranks, so all ranks raise together).

    Build ``models`` first (fresh, from the run's initial weights), shard them as for training, build the
    optimizers, then call this: the weights come from ``dcp/``.

    Checked before anything is loaded: every file's size and the small files' sha256 against the manifest,
    ``state.json`` (``_read_state``, then ``check_state``), DCP's metadata (read without unpickling anything
    but its own classes; it may point only at files of the manifest), and that each model's tensors have the
    checkpoint's names, shapes and dtypes. The large files' chunked sha256 runs in threads while DCP reads
    them (the hashing split over the ranks) and is checked before the loaded state is used, then that no
    weight or optimizer state is NaN/inf. A failure after DCP has loaded leaves the models and optimizers
    partly restored: load another checkpoint into them (``restore_checkpoint`` does) or rebuild them.

    Args:
        models: name -> model (needed for every optimizer, whose states are keyed by parameter name).
        optimizers: name -> optimizer of ``models[name]``.
        generators: name -> generator; restored when the world size is the one saved, else left as seeded.
        env: the ``DistEnv`` (None: world size 1).
        check_state: called with ``state.json``'s dict; raises ``ValueError`` naming a bad field
            (``LoopState.check_counters``).
        verify: check the files against the manifest (False: the caller did; the other checks still run,
            and no file is unpickled either way).

    Raises:
        CheckpointError: the checkpoint is damaged, or does not fit the models (``mismatch``), or lacks a
            requested model, optimizer or generator; the message names the checkpoint and the file.
    """
    path = Path(path)
    env = env or DistEnv()
    models = dict(models or {})
    share = (env.rank, env.world_size)
    problem = _agree(verify_files(path, large=False, share=share), env) if verify else None
    if problem is not None:
        raise CheckpointError(f"checkpoint {str(path)!r} is damaged: {problem}")
    # The large files' sha256 runs beside the checks, the optimizer set-up and DCP's read (hashlib releases the
    # GIL), and is agreed before anything loaded is used: DCP reading an unverified file runs no code.
    hasher = ThreadPoolExecutor(1)
    hashed = hasher.submit(verify_files, path, small=False, share=share) if verify else None
    try:
        return _load_verified(path, models, optimizers, generators, env, check_state, hashed)
    finally:
        hasher.shutdown(wait=False, cancel_futures=True)


def _load_verified(
    path: Path,
    models: dict[str, nn.Module],
    optimizers: Mapping[str, torch.optim.Optimizer] | None,
    generators: Mapping[str, torch.Generator] | None,
    env: DistEnv,
    check_state: Callable[[dict[str, Any]], None] | None,
    hashed: Any,
) -> dict[str, Any]:
    """``load_checkpoint`` once the small files verify; ``hashed``: the future of the large files' check."""
    error: CheckpointError | None = None
    try:
        manifest, _ = read_manifest(path)
        saved = _read_state(path)
        if check_state is not None:
            try:
                check_state(saved)
            except (ValueError, TypeError) as e:
                raise CheckpointError(f"{str(path / 'state.json')!r}: {e}") from None
        metadata = read_dcp_metadata(path / "dcp" / ".metadata")
        _check_storage(path, metadata, manifest)
        stored = metadata.state_dict_metadata
        in_dcp = [name for name in models if any(k.startswith(f"models.{name}.") for k in stored)]
        _check_fit(path, models, in_dcp, metadata)
        rng = path / "rng" / f"rank_{env.rank}.pt"
        rng_state = None
        if saved.get("world_size", 1) == env.world_size and rng.is_file():
            if f"rng/{rng.name}" not in manifest["files"]:
                raise CheckpointError(f"{str(rng)!r} is not in the checkpoint's manifest")
            try:
                rng_state = torch.load(rng, weights_only=True)
            except Exception as e:
                why = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                raise CheckpointError(f"{str(rng)!r} cannot be read: {why}") from None
        absent = [name for name in models if name not in in_dcp]
        if absent:
            raise CheckpointError(f"checkpoint {str(path)!r} holds no weights of models {absent}", mismatch=True)
    except CheckpointError as e:
        error = e
    except (OSError, ValueError, KeyError, TypeError) as e:
        error = CheckpointError(f"checkpoint {str(path)!r} cannot be read: {type(e).__name__}: {e}")
    agreed = _agree(str(error) if error is not None else None, env)
    if agreed is not None:
        damaged = _agree(hashed.result() if hashed is not None else None, env)  # a flipped byte explains it
        if damaged is not None:
            raise CheckpointError(f"checkpoint {str(path)!r} is damaged: {damaged}")
        raise error if error is not None else CheckpointError(agreed)
    payload: dict[str, Any] = {}
    if optimizers:
        for model in models.values():  # a stale .grad makes the optimizer state load skip (silently)
            model.zero_grad(set_to_none=True)
        payload["optimizers"] = optimizer_states(models, optimizers)
    if in_dcp:
        payload["models"] = {name: get_model_state_dict(models[name]) for name in in_dcp}
    failed: BaseException | None = None
    if payload:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                reader, planner = _SafeReader(path / "dcp"), _SafePlanner()
                dcp.load(payload, storage_reader=reader, planner=planner, no_dist=env.world_size == 1,
                         process_group=env.group)
        except (Exception, CheckpointException) as e:  # on every rank (DCP gathers the ranks' failures)
            failed = e
    damaged = _agree(hashed.result() if hashed is not None else None, env)
    if damaged is not None:  # named by the checksum, whatever DCP made of the damaged file
        raise CheckpointError(f"checkpoint {str(path)!r} is damaged: {damaged}") from failed
    if failed is not None:  # DCP names the missing key deep in its planner (its CheckpointException is a
        # BaseException, with the per-rank exceptions in ``failures``); say what was asked for
        failures = getattr(failed, "failures", None)
        errors = [f[0] if isinstance(f, tuple) else f for f in failures.values()] if failures else [failed]
        why = "; ".join(sorted({first_line(x) for x in errors}))
        raise CheckpointError(
            f"checkpoint {str(path)!r} cannot restore models {in_dcp} / optimizers {sorted(optimizers or {})}: {why}",
            mismatch="Missing key" in why or "mismatch" in why.lower(),  # else: damaged (checksums="small")
        ) from failed
    if payload:
        bad = _agree(_first_non_finite(payload), env)
        if bad is not None:
            raise CheckpointError(f"checkpoint {str(path)!r} is damaged: dcp/ holds NaN/inf in {bad}")
        for name in in_dcp:
            set_model_state_dict(models[name], payload["models"][name])
        for name, opt in (optimizers or {}).items():
            set_optimizer_state_dict(models[name], opt, payload["optimizers"][name])
    if rng_state is not None:
        _set_rng_state(rng_state, generators or {})
    elif generators:
        # No stream to map from N ranks to M: reseed each from its seed and the step, so the continued run
        # neither replays the first steps' noise nor depends on anything but (seed, step, rank).
        for name, g in generators.items():
            g.manual_seed(derive_seed(g.initial_seed(), env.rank, f"{name}/resumed_at_step_{saved.get('step', 0)}"))
        warnings.warn(
            f"checkpoint {str(path)!r} was saved at world size {saved.get('world_size', 1)}, resumed at "
            f"{env.world_size}: RNG streams are reseeded from (seed, step, rank) (the run continues, not bit-exactly)",
            stacklevel=3,
        )
    return saved


def restore_checkpoint(
    run_dir: str | Path,
    *,
    newest: str | Path | None = None,
    models: Mapping[str, nn.Module] | None = None,
    optimizers: Mapping[str, torch.optim.Optimizer] | None = None,
    generators: Mapping[str, torch.Generator] | None = None,
    env: DistEnv | None = None,
    check_state: Callable[[dict[str, Any]], None] | None = None,
) -> tuple[Path, dict[str, Any]]:
    """Load the newest checkpoint of ``run_dir`` that loads (``load_checkpoint``), from ``newest`` (default:
    the newest there is) down: each one that fails, for any reason, is skipped with a warning naming it and
    why. Collective at world size > 1 (the ranks agree on each checkpoint's failure, so they fall back
    together).

    Returns:
        The checkpoint loaded and its ``state.json``.

    Raises:
        CheckpointError: no checkpoint loads; the message lists each and why (``mismatch`` if every one
            was intact but did not fit the models).
    """
    candidates = list(reversed(list_checkpoints(run_dir)))
    if newest is not None:
        candidates = [p for p in candidates if step_of(p) <= step_of(Path(newest))]
    failures: list[tuple[Path, BaseException]] = []
    for path in candidates:
        try:
            saved = load_checkpoint(path, models=models, optimizers=optimizers, generators=generators, env=env,
                                    check_state=check_state)
        except (Exception, CheckpointException) as e:  # any failure: the previous checkpoint may still load
            warnings.warn(f"skipping checkpoint {path}: {first_line(e)}", stacklevel=2)
            failures.append((path, e))
            continue
        return path, saved
    mismatch = bool(failures) and all(getattr(e, "mismatch", False) for _, e in failures)
    reasons = "; ".join(f"{p.name}: {first_line(e)}" for p, e in failures)
    raise CheckpointError(
        f"no checkpoint of run {str(run_dir)!r} can be loaded ({reasons or 'there is none'})", mismatch=mismatch
    )

