"""Checkpoints for exact resume: models, optimizers, RNG states, counters; at any world size.

One format at every world size (docs/design.md, "Checkpoints"). Layout of ``RUN_DIR/checkpoints/step_N/``::

    dcp/               torch.distributed.checkpoint: every model's weights and every optimizer's state,
                       sharded as trained; loadable at any world size (DCP reshards), also without a process
                       group (a notebook)
    tokenizer/         the policy's tokenizer
    rng/rank_R.pt      each rank's python, numpy, torch (CPU and CUDA) RNG states and the loop's generators
    state.json         the loop state's counters and data positions (step, total_valid_tokens,
                       stream/sampler: consumed_samples, ...), total_steps, world_size
    manifest.json      every file's size and sha256 (``checksums="all"``, ``save_checkpoint``'s default;
                       files of 16 MiB and more as one sha256 per 16 MiB chunk, hashed in parallel), or the
                       sha256 of the files under 1 MiB only (``checksums="small"``, the loops' default
                       ``checkpoint_checksums``); written last
    policy/ value/ ... HF folders (``from_pretrained``), only on request (``hf_folders=True``, world size 1);
                       HF folders are otherwise written at export (``RUN_DIR/final``)

A checkpoint is written into a temporary folder and renamed into place, so a crash leaves either the whole
checkpoint or none. Resuming (``resume_checkpoint``, then ``restore_checkpoint``) tries the checkpoints newest
first and falls back to the previous one, with a warning naming the skipped checkpoint and why, on any
failure to load it: a file missing, torn or failing its checksum, a ``state.json`` field of the wrong type or
range, metadata that is not DCP's, weights of other shapes or dtypes than the models', NaN/inf weights or
optimizer states. Optimizer state dicts are keyed by parameter names (``get_optimizer_state_dict``), so a
checkpoint saved at N ranks resumes at M: weights and optimizer states are resharded; the RNG streams
restart from the seeds when N != M (the run continues, not bit-exactly). Checkpoints of rlbits before this
format (weights in HF folders at world size 1) are still read.

Nothing is unpickled beyond plain data: DCP's ``.metadata`` is read with an unpickler that builds only DCP's
own metadata classes (``torch.Size``, dtypes, paths), its non-tensor items and the RNG states with
``torch.load(weights_only=True)``, JSON with ``json``. The manifest is for integrity, not authenticity (no
key): whoever can write a run directory can still give it other well-formed weights (docs/reliability.md,
"Checkpoints and run files: threat model").
"""

from __future__ import annotations

import copy
import hashlib
import io
import json
import math
import os
import pickle
import random
import shutil
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
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
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
from rlbits.models.load import check_safetensors, save_pretrained
from rlbits.models.lora import is_lora, merge_lora

CHECKPOINTS = "checkpoints"
MANIFEST = "manifest.json"
SMALL_FILE = 1 << 20
"""With ``checksums="small"``, files below this many bytes get a sha256 in the manifest (the weights are larger)."""
CHUNK = 16 << 20
"""Files of this many bytes or more get one sha256 per chunk of this size, hashed in parallel threads."""


class CheckpointError(ValueError):
    """A checkpoint cannot be loaded. The message names the checkpoint, the file and the problem.

    Attributes:
        mismatch: True when the checkpoint is intact but does not fit the models (other names, shapes or
            dtypes: a config override changed the model), False when it is damaged.
    """

    def __init__(self, message: str, *, mismatch: bool = False) -> None:
        super().__init__(message)
        self.mismatch = mismatch


def _sha256(path: Path, offset: int = 0, length: int | None = None) -> str:
    """sha256 of ``length`` bytes of ``path`` from ``offset`` (None: to the end), read in blocks of up to
    ``CHUNK`` bytes: few GIL hand-overs per chunk, so hashing threads do not slow a busy main thread."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        f.seek(offset)
        left = length if length is not None else os.fstat(f.fileno()).st_size - offset
        buffer = bytearray(min(max(left, 0), CHUNK))
        view = memoryview(buffer)
        while left > 0:
            n = f.readinto(view[: min(len(buffer), left)])
            if not n:
                break
            h.update(view[:n])
            left -= n
    return h.hexdigest()


def _workers() -> int:
    """Threads that hash a checkpoint (hashlib releases the GIL): the CPUs this process may use, up to 16."""
    return max(1, min(16, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1))


def _hash_jobs(jobs: list[tuple[Path, int, int | None]]) -> list[str]:
    """sha256 of each ``(file, offset, length)``, in parallel threads."""
    if len(jobs) <= 1:
        return [_sha256(*job) for job in jobs]
    with ThreadPoolExecutor(min(_workers(), len(jobs))) as pool:
        return list(pool.map(lambda job: _sha256(*job), jobs))


def _digest_entries(files: list[Path], root: Path, checksums: str) -> dict[str, dict[str, Any]]:
    """The manifest's ``files``: each file's size, and its sha256 (``sha256``; one per ``CHUNK`` as
    ``sha256_chunks`` for a file of ``CHUNK`` bytes or more) where ``checksums`` asks for one."""
    entries: dict[str, dict[str, Any]] = {}
    jobs: list[tuple[Path, int, int | None]] = []
    owners: list[tuple[str, str]] = []
    for p in files:
        rel = str(p.relative_to(root))
        size = p.stat().st_size
        entries[rel] = {"bytes": size}
        if checksums == "all" or size < SMALL_FILE:
            if size < CHUNK:
                jobs.append((p, 0, None))
                owners.append((rel, "sha256"))
            else:
                entries[rel]["sha256_chunks"] = []
                for offset in range(0, size, CHUNK):
                    jobs.append((p, offset, CHUNK))
                    owners.append((rel, "sha256_chunks"))
    for (rel, key), digest in zip(owners, _hash_jobs(jobs), strict=True):
        if key == "sha256":
            entries[rel]["sha256"] = digest
        else:
            entries[rel]["sha256_chunks"].append(digest)
    return entries


def _step_of(path: Path) -> int:
    return int(path.name[5:])


def _first_line(e: BaseException) -> str:
    return str(e).splitlines()[0] if str(e).strip() else type(e).__name__


# --- reading a checkpoint without unpickling anything but plain data ---------------------------------------

_METADATA_GLOBALS = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # a layout (torch.strided) by name
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("pathlib", "PosixPath"),  # StorageMeta.checkpoint_id
    ("pathlib", "PurePosixPath"),
    ("pathlib._local", "PosixPath"),
    ("pathlib._local", "PurePosixPath"),
    ("collections", "OrderedDict"),
}
"""What DCP's ``.metadata`` may name besides the classes of ``torch.distributed.checkpoint.metadata`` and the
torch dtypes: recorded from checkpoints of every rlbits model (fp32 and bf16, with AdamW states)."""


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's ``Metadata``: builds only the classes it is made of, so a crafted file cannot name a
    function to call (``os.system``) or a class to build."""

    def find_class(self, module: str, name: str) -> Any:
        if module == dcp_metadata.__name__:
            found = getattr(dcp_metadata, name, None)
            if isinstance(found, type) and found.__module__ == module:
                return found
        elif module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        elif (module, name) in _METADATA_GLOBALS:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"it names {module}.{name}, which is not part of DCP's metadata")


def read_dcp_metadata(path: str | Path) -> dcp_metadata.Metadata:
    """DCP's metadata file (``.metadata``), unpickled with only DCP's metadata classes allowed.

    Raises:
        CheckpointError: the file is missing, is not a pickle, names anything else (a function, another
            class), or does not hold a ``Metadata``; the message names the file.
    """
    path = Path(path)
    try:
        with open(path, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except Exception as e:  # UnpicklingError, EOFError, ValueError, RecursionError, MemoryError, ...
        raise CheckpointError(f"{str(path)!r} is not DCP metadata: {type(e).__name__}: {e}") from None
    if not isinstance(metadata, dcp_metadata.Metadata):
        raise CheckpointError(f"{str(path)!r} is not DCP metadata: it holds a {type(metadata).__name__}")
    return metadata


class _SafeReader(dcp.FileSystemReader):
    """DCP's file-system reader with ``read_metadata`` through ``read_dcp_metadata`` (DCP's own uses
    ``pickle.load``)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_metadata.Metadata:
        rank = kwargs.get("rank")
        metadata = read_dcp_metadata(Path(self.path) / (".metadata" if rank is None else f"__{rank}.metadata"))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = dcp_metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class _SafePlanner(DefaultLoadPlanner):
    """DCP's load planner with its non-tensor items (optimizer hyperparameters) read by
    ``torch.load(weights_only=True)`` (DCP's own passes ``weights_only=False``)."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


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
    checksums: str = "all",
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
            entries = _digest_entries(files, tmp, checksums)
            manifest = {"step": step, "checksums": checksums, "chunk_bytes": CHUNK, "files": entries}
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


def _read_manifest(path: Path) -> tuple[dict[str, Any] | None, str | None]:
    """The manifest of checkpoint ``path`` and None, or None and what is wrong with it."""
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        return None, "no manifest.json"
    try:
        manifest = json.loads(manifest_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        return None, f"manifest.json is not valid JSON ({e})"
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict) or not all(
        isinstance(rel, str) and isinstance(meta, dict) and type(meta.get("bytes")) is int
        for rel, meta in files.items()
    ):
        return None, "manifest.json is malformed (no 'files' mapping each file to its 'bytes')"
    if manifest.get("step", _step_of(path)) != _step_of(path):
        return None, f"manifest.json is of step {manifest.get('step')!r}, its folder of step {_step_of(path)}"
    return manifest, None


def _verify(path: Path, *, small: bool = True, large: bool = True, share: tuple[int, int] = (0, 1)) -> str | None:
    """What is wrong with checkpoint ``path`` against its manifest, or None. Sizes always; ``small``: the sha256
    of the files hashed whole (under ``CHUNK``); ``large``: the chunked sha256 of the others;
    ``share=(rank, world_size)``: hash every ``world_size``-th of them only."""
    manifest, problem = _read_manifest(path)
    if manifest is None:
        return problem
    chunk = manifest.get("chunk_bytes", CHUNK)
    jobs: list[tuple[Path, int, int | None]] = []
    expected: list[tuple[str, str]] = []
    for rel, meta in manifest["files"].items():
        f = path / rel
        if ".." in Path(rel).parts or Path(rel).is_absolute():
            return f"manifest.json names {rel!r}, outside the checkpoint"
        if not f.is_file():
            return f"{rel} is missing"
        if f.stat().st_size != meta["bytes"]:
            return f"{rel} has {f.stat().st_size} bytes, the manifest says {meta['bytes']}"
        if "sha256" in meta:
            if small:
                jobs.append((f, 0, None))
                expected.append((rel, meta["sha256"]))
        elif large and "sha256_chunks" in meta:
            digests = meta["sha256_chunks"]
            if not isinstance(digests, list) or len(digests) != -(-meta["bytes"] // chunk):
                return f"manifest.json is malformed (the chunk checksums of {rel})"
            for i, digest in enumerate(digests):
                jobs.append((f, i * chunk, chunk))
                expected.append((rel, digest))
    rank, world = share
    mine = list(range(rank, len(jobs), world))
    for i, got in zip(mine, _hash_jobs([jobs[i] for i in mine]), strict=True):
        rel, want = expected[i]
        if got != want:
            where = f" (bytes {jobs[i][1]}..{jobs[i][1] + chunk})" if jobs[i][2] is not None else ""
            return f"{rel} does not match its checksum{where}"
    return None


def _agree(problem: str | None, env: DistEnv) -> str | None:
    """The first rank's problem, if any rank has one (one ``all_gather_object`` at world size > 1)."""
    if env.world_size == 1:
        return problem
    import torch.distributed as dist

    problems: list[str | None] = [None] * env.world_size
    dist.all_gather_object(problems, problem)
    return next((p if r == env.rank else f"rank {r}: {p}" for r, p in enumerate(problems) if p is not None), None)


def verify_checkpoint(path: str | Path, *, full: bool = True) -> str | None:
    """None if every file of the manifest is present with its size and sha256 (where the manifest records
    one), else what is wrong, naming the file.

    Args:
        full: also hash the large files (the weights, in parallel 16 MiB chunks); False checks their sizes
            only (the small files' sha256 still).
    """
    return _verify(Path(path), large=full)


def latest_checkpoint(run_dir: str | Path, *, full: bool = True) -> Path | None:
    """The newest checkpoint that verifies (``verify_checkpoint(path, full=full)``); a torn or corrupted newer
    one is skipped with a warning."""
    for path in reversed(list_checkpoints(run_dir)):
        problem = verify_checkpoint(path, full=full)
        if problem is None:
            return path
        warnings.warn(f"skipping checkpoint {path}: {problem}", stacklevel=2)
    return None


def resume_checkpoint(run_dir: str | Path, *, missing_ok: bool = False) -> Path | None:
    """The checkpoint a ``resume=True`` run starts from: the newest whose files are all present with their
    sizes and whose small files match their sha256 (``latest_checkpoint(full=False)``: the weights are hashed
    once, when ``restore_checkpoint`` loads them, and it falls back further if they do not load).

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
    path = latest_checkpoint(run_dir, full=False)
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
    if type(step) is not int or step != _step_of(path):
        raise CheckpointError(
            f"{str(file)!r}: field 'step' is {step!r}; its folder {path.name} says {_step_of(path)}"
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
            if local.is_floating_point() and local.numel() and not torch.isfinite(torch.linalg.vector_norm(local, math.inf)):
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
    """Restore weights (if the checkpoint holds them in ``dcp/``), optimizer and RNG states in place; return
    the counters of ``state.json``. Collective at world size > 1 (every check is agreed over the ranks, so
    all ranks raise together).

    Build ``models`` first (fresh, from the run's initial weights), shard them as for training, build the
    optimizers, then call this: the weights come from ``dcp/`` (or, in a checkpoint of the earlier format,
    from the HF folder ``path/name``).

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
    problem = _agree(_verify(path, large=False, share=share), env) if verify else None
    if problem is not None:
        raise CheckpointError(f"checkpoint {str(path)!r} is damaged: {problem}")
    # The large files' sha256 runs beside the checks, the optimizer set-up and DCP's read (hashlib releases the
    # GIL), and is agreed before anything loaded is used: DCP reading an unverified file runs no code.
    hasher = ThreadPoolExecutor(1)
    hashed = hasher.submit(_verify, path, small=False, share=share) if verify else None
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
        manifest, _ = _read_manifest(path)
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
        for name in models:
            if name not in in_dcp:  # the earlier format: an HF folder
                _load_hf_weights(models[name], path, name)
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
        payload["optimizers"] = _optimizer_states(models, optimizers)
    if in_dcp:
        payload["models"] = {name: get_model_state_dict(models[name]) for name in in_dcp}
    failed: BaseException | None = None
    if payload:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                reader, planner = _SafeReader(path / "dcp"), _SafePlanner()
                dcp.load(payload, storage_reader=reader, planner=planner, no_dist=env.world_size == 1)
        except (Exception, CheckpointException) as e:  # on every rank (DCP gathers the ranks' failures)
            failed = e
    damaged = _agree(hashed.result() if hashed is not None else None, env)
    if damaged is not None:  # named by the checksum, whatever DCP made of the damaged file
        raise CheckpointError(f"checkpoint {str(path)!r} is damaged: {damaged}") from failed
    if failed is not None:  # DCP names the missing key deep in its planner (its CheckpointException is a
        # BaseException, with the per-rank exceptions in ``failures``); say what was asked for
        failures = getattr(failed, "failures", None)
        errors = [f[0] if isinstance(f, tuple) else f for f in failures.values()] if failures else [failed]
        why = "; ".join(sorted({_first_line(x) for x in errors}))
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
        candidates = [p for p in candidates if _step_of(p) <= _step_of(Path(newest))]
    failures: list[tuple[Path, BaseException]] = []
    for path in candidates:
        try:
            saved = load_checkpoint(path, models=models, optimizers=optimizers, generators=generators, env=env,
                                    check_state=check_state)  # fmt: skip
        except (Exception, CheckpointException) as e:  # any failure: the previous checkpoint may still load
            warnings.warn(f"skipping checkpoint {path}: {_first_line(e)}", stacklevel=2)
            failures.append((path, e))
            continue
        return path, saved
    mismatch = bool(failures) and all(getattr(e, "mismatch", False) for _, e in failures)
    reasons = "; ".join(f"{p.name}: {_first_line(e)}" for p, e in failures)
    raise CheckpointError(
        f"no checkpoint of run {str(run_dir)!r} can be loaded ({reasons or 'there is none'})", mismatch=mismatch
    )


def _load_hf_weights(model: nn.Module, path: Path, name: str) -> None:
    """Weights of model ``name`` from the HF folder of a checkpoint written before dcp/ held every model
    (safetensors only)."""
    earlier = {"value_model": "value", "model": "policy"}  # the folder names of the earlier format
    folder = hf_folder(path, name) or hf_folder(path, earlier.get(name, name))
    if folder is None:
        raise CheckpointError(
            f"checkpoint {str(path)!r} holds no weights of model {name!r} (neither in dcp/ nor {name}/)",
            mismatch=True,
        )
    if is_sharded(model):
        raise CheckpointError(
            f"checkpoint {str(path)!r} is of the earlier format (HF folders); resume it in one process first",
            mismatch=True,
        )
    check_safetensors(folder, f"checkpoint {str(path)!r}: model {name!r}")
    extra = {"use_safetensors": True} if isinstance(model, PreTrainedModel) else {}
    loaded = type(model).from_pretrained(str(folder), **extra)  # HF causal LM, ValueModel or ILQLModel
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
