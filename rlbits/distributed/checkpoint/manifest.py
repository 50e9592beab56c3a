"""A checkpoint's files: where checkpoints live, the manifest of every file's size and sha256, verifying a
checkpoint against it, and finding the newest checkpoint that verifies.

The manifest is for integrity, not authenticity (no key): whoever can write a run directory can still give it
other well-formed weights (docs/reliability.md, "Checkpoints and run files: threat model").
"""

from __future__ import annotations

import json
import os
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from rlbits._io import sha256_file

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


def _workers() -> int:
    """Threads that hash a checkpoint (hashlib releases the GIL): the CPUs this process may use, up to 16."""
    return max(1, min(16, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1))


def _hash_jobs(jobs: list[tuple[Path, int, int | None]]) -> list[str]:
    """sha256 of each ``(file, offset, length)``, in parallel threads."""
    if len(jobs) <= 1:
        return [sha256_file(*job, block=CHUNK) for job in jobs]
    with ThreadPoolExecutor(min(_workers(), len(jobs))) as pool:
        return list(pool.map(lambda job: sha256_file(*job, block=CHUNK), jobs))


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


def write_manifest(folder: Path, step: int, checksums: str) -> None:
    """Write ``folder/manifest.json`` for every file under ``folder``: each file's size and, as ``checksums``
    asks (``"all"``, or ``"small"``: files under ``SMALL_FILE`` bytes), its sha256 (``_digest_entries``)."""
    files = sorted(p for p in folder.rglob("*") if p.is_file())
    entries = _digest_entries(files, folder, checksums)
    manifest = {"step": step, "checksums": checksums, "chunk_bytes": CHUNK, "files": entries}
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=2))


def step_of(path: Path) -> int:
    """N of a ``step_N`` checkpoint folder."""
    return int(path.name[5:])


def first_line(e: BaseException) -> str:
    """The first line of an error's message (its type's name if it has none), for one-line warnings."""
    return str(e).splitlines()[0] if str(e).strip() else type(e).__name__


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """Complete (renamed) step checkpoints of a run, oldest first."""
    root = Path(run_dir) / CHECKPOINTS
    if not root.is_dir():
        return []
    steps = [p for p in root.iterdir() if p.is_dir() and p.name.startswith("step_") and p.name[5:].isdigit()]
    return sorted(steps, key=lambda p: int(p.name[5:]))


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


def read_manifest(path: Path) -> tuple[dict[str, Any] | None, str | None]:
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
    if manifest.get("step", step_of(path)) != step_of(path):
        return None, f"manifest.json is of step {manifest.get('step')!r}, its folder of step {step_of(path)}"
    return manifest, None


def verify_files(path: Path, *, small: bool = True, large: bool = True, share: tuple[int, int] = (0, 1)) -> str | None:
    """What is wrong with checkpoint ``path`` against its manifest, or None. Sizes always; ``small``: the sha256
    of the files hashed whole (under ``CHUNK``); ``large``: the chunked sha256 of the others;
    ``share=(rank, world_size)``: hash every ``world_size``-th of them only."""
    manifest, problem = read_manifest(path)
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


def verify_checkpoint(path: str | Path, *, full: bool = True) -> str | None:
    """None if every file of the manifest is present with its size and sha256 (where the manifest records
    one), else what is wrong, naming the file.

    Args:
        full: also hash the large files (the weights, in parallel 16 MiB chunks); False checks their sizes
            only (the small files' sha256 still).
    """
    return verify_files(Path(path), large=full)


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
        why = "it stopped before its first save"
        warnings.warn(f"run {str(run_dir)!r} has no checkpoint yet ({why}): starting it over", stacklevel=2)
        return None
    path = latest_checkpoint(run_dir, full=False)
    if path is None:
        raise FileNotFoundError(
            f"resume=True but run_dir {str(run_dir)!r} has no checkpoint to resume from "
            f"(no complete checkpoint under {str(Path(run_dir) / CHECKPOINTS)!r})"
        )
    return path

