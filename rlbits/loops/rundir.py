"""Which folders a run may write into, and the lock that keeps one run per folder.

A run directory is new (it does not exist), empty, or an rlbits run: a folder holding ``.rlbits-run``, the
marker file rlbits writes into it before anything else. ``claim_run_dir`` inspects the folder and refuses
anything else before writing or deleting a file, then takes ``.rlbits-run.lock`` (``fcntl.flock``, held by the
run's main process for the run's whole life) so a second run, or a resume of a live one, is refused naming the
process that holds it. The kernel releases a ``flock`` when its process dies, so a run killed with ``kill -9``
leaves no stale lock: the next run simply takes it.

``force=True`` (``rlbits train --force``) also accepts a non-empty folder that is not an rlbits run, and an
existing run started over without ``resume``. It never overrides the lock, and never lets a run be written
into ``/``, the home folder, the current folder or one above it unless that folder is empty or already a run.
Whatever the mode, rlbits deletes only what it wrote (checkpoints carrying its manifest, temporaries of its
own names; ``rlbits.loops.logger``, ``rlbits.distributed.checkpoint``).
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import json
import os
import socket
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from rlbits.distributed.checkpoint import CHECKPOINTS, discard_checkpoints

MARKER = ".rlbits-run"
"""The file that makes a folder an rlbits run; written first, holding ``{"format", "loop", "created"}``."""
LOCK = ".rlbits-run.lock"
"""The lock file: ``flock``-ed by the live run's main process, holding its pid, host and start time."""
MARKER_FORMAT = 1
_OWN_FILES = frozenset({MARKER, LOCK})


class RunDirError(FileExistsError):
    """``run_dir`` cannot hold this run: it is a file, holds other files, holds a run (without ``resume``)
    or is a place no run is written into. The message says why and what to do."""


class RunDirLockedError(RunDirError):
    """Another live process holds the run directory's lock; the message names its pid, host and start time."""


class DiskFullError(OSError):
    """A write into the run directory failed because the disk (or the user's quota) is full. The message
    names the run directory and the file; the checkpoints already saved stay valid."""


def _listing(path: Path) -> list[str]:
    return sorted(p.name for p in path.iterdir())


def _protected(path: Path) -> str | None:
    """Why ``path`` is a place a careless ``run_dir`` points at (the root, home, the current folder or one
    above it), or None."""
    resolved = path.resolve()
    cwd = Path.cwd().resolve()
    if resolved == Path(resolved.anchor):
        return "the file-system root"
    if resolved == Path.home().resolve():
        return "your home folder"
    if resolved == cwd:
        return "the current folder"
    if resolved in cwd.parents:
        return "a folder above the current folder"
    return None


def inspect_run_dir(path: str | Path) -> str:
    """What ``path`` is, without writing anything: ``"new"`` (does not exist), ``"empty"``, ``"run"``
    (holds the marker), ``"legacy"`` (a run of an rlbits without the marker: ``config.yaml`` and
    ``metrics.jsonl``) or ``"foreign"`` (any other non-empty folder).

    Raises:
        RunDirError: ``path`` exists and is not a folder.
    """
    path = Path(path)
    if not path.exists() and not path.is_symlink():
        return "new"
    if not path.is_dir():
        raise RunDirError(f"run_dir {str(path)!r} is a file, not a folder; choose a folder for the run")
    names = set(_listing(path))
    if MARKER in names:
        return "run"
    if not names - _OWN_FILES:
        return "empty"
    if {"config.yaml", "metrics.jsonl"} <= names:
        return "legacy"
    return "foreign"


def _has_progress(path: Path) -> bool:
    """The run logged a step or saved a checkpoint (a run stopped before either may be started over)."""
    checkpoints = path / CHECKPOINTS
    return (path / "metrics.jsonl").exists() or (checkpoints.is_dir() and any(checkpoints.iterdir()))


def check_run_dir(
    path: str | Path, *, resume: bool = False, force: bool = False, restarted: bool = False
) -> tuple[str, bool]:
    """Decide whether a run may use ``path``; writes nothing.

    Args:
        path: the run directory.
        resume: the run continues ``path``'s latest checkpoint.
        force: also accept a non-empty folder that is not a run, a run without the marker, and (without
            ``resume``) an existing run, which is then started over.
        restarted: a ``torchrun --max-restarts`` restart of the job that started ``path``.

    Returns:
        ``(kind, start_over)``: ``inspect_run_dir``'s kind, and whether an earlier run's logs and checkpoints
        must be cleared first (``force`` on a run or a legacy run, without ``resume``).

    Raises:
        RunDirError: ``path`` is a file, a non-empty folder that is not a run (without ``force``), a run that
            has made progress (without ``resume``, ``force`` or ``restarted``), a legacy run (without
            ``force``), or the root, home or current folder (or one above it) holding other files.
        FileNotFoundError: ``resume`` of a folder that does not exist or is empty.
    """
    path = Path(path)
    kind = inspect_run_dir(path)
    if kind in ("new", "empty"):
        if resume:
            what = "does not exist" if kind == "new" else "is empty"
            raise FileNotFoundError(
                f"resume=True but run_dir {str(path)!r} {what}: "
                "no checkpoint to resume from (no complete checkpoint)"
            )
        return kind, False
    if kind == "run":
        if resume or restarted or not _has_progress(path):
            return kind, False
        if force:
            return kind, True
        raise RunDirError(
            f"run_dir {str(path)!r} already holds a run; resume it with `rlbits train --resume {path}`, start it "
            "over with --force (its checkpoints and logs are replaced), or choose another run_dir"
        )
    place = _protected(path)
    if place is not None:
        raise RunDirError(
            f"run_dir {str(path)!r} is {place} and holds other files; a run is written into a new or empty "
            "folder (e.g. run_dir=runs/NAME), even with --force"
        )
    if kind == "legacy":
        if force:
            return kind, not resume
        raise RunDirError(
            f"run_dir {str(path)!r} looks like a run of an earlier rlbits (it has config.yaml but no {MARKER} "
            "marker); adopt it with --force (`rlbits train --resume DIR --force` continues it), or choose "
            "another run_dir"
        )
    if force:
        return kind, False
    shown = _listing(path)
    names = ", ".join(shown[:5]) + (f" and {len(shown) - 5} more" if len(shown) > 5 else "")
    raise RunDirError(
        f"run_dir {str(path)!r} is not empty and is not an rlbits run (it holds {names}); choose a new or empty "
        "folder, or pass --force to write the run into it (rlbits never deletes files it did not write)"
    )


def write_marker(path: str | Path, loop: str) -> Path:
    """Write ``path/.rlbits-run`` (format, loop, created time) unless it exists; returns its path."""
    marker = Path(path) / MARKER
    record = {
        "format": MARKER_FORMAT,
        "loop": loop,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    try:
        fd = os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:  # another process claiming the same new folder wrote it first: the lock decides
        return marker
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps(record) + "\n")
    return marker


def _holder(lock_path: Path) -> str:
    try:
        info = json.loads(lock_path.read_text())
        return f"pid {info['pid']} on {info['host']}, started {info['started']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "another process (its pid is not readable yet)"


class RunDirClaim:
    """A run's hold on its directory: the exclusive ``flock`` on ``.rlbits-run.lock``. ``release()`` (or the
    end of a ``with`` block) lets it go; the kernel lets it go if the process dies.

    Attributes:
        path: the run directory.
        kind: what the folder was when claimed (``inspect_run_dir``).
        started_over: an earlier run in it was started over (its checkpoints discarded; the logger empties
            its ``metrics.jsonl`` and ``samples.jsonl``).
    """

    def __init__(self, path: Path, kind: str, started_over: bool, fd: int | None) -> None:
        self.path = path
        self.kind = kind
        self.started_over = started_over
        self._fd = fd

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        """Unlock and close the lock file (the file stays: deleting it would race with the next run)."""
        if self._fd is not None:
            fd, self._fd = self._fd, None
            with contextlib.suppress(OSError):
                fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)

    def __enter__(self) -> RunDirClaim:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()

    def __del__(self) -> None:
        self.release()


def lock_run_dir(path: str | Path) -> int | None:
    """Take ``path/.rlbits-run.lock`` (exclusive ``flock``, non-blocking) and write this process's pid, host
    and start time into it. Returns the open descriptor (close it to release), or None with a warning where the
    file system does not support ``flock``.

    Raises:
        RunDirLockedError: another live process holds it; the message names that process.
    """
    lock_path = Path(path) / LOCK
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        _flock(fd, path, lock_path)
    except RunDirLockedError:  # an OSError too: caught first
        os.close(fd)
        raise
    except OSError as e:
        os.close(fd)
        warnings.warn(
            f"cannot lock {lock_path} ({e.strerror}); a second run on it would not be refused", stacklevel=2
        )
        return None
    info = {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(info) + "\n").encode(), 0)
    return fd


def check_not_locked(path: str | Path) -> None:
    """Raise ``RunDirLockedError`` if a live run holds ``path``'s lock now (a probe that writes nothing:
    ``claim_run_dir`` takes the lock for good).

    Raises:
        RunDirLockedError: a live run holds ``path``; the message names that process.
    """
    lock_path = Path(path) / LOCK
    try:
        fd = os.open(lock_path, os.O_RDWR)
    except OSError:  # no lock file (a new folder or an earlier run's), or not readable: claim_run_dir decides
        return
    try:
        _flock(fd, path, lock_path)
    except RunDirLockedError:  # an OSError too: caught first
        raise
    except OSError:  # no flock on this file system: claim_run_dir warns
        pass
    finally:
        os.close(fd)


def _flock(fd: int, path: str | Path, lock_path: Path) -> None:
    """Take an exclusive ``flock`` on ``fd`` without waiting.

    Raises:
        RunDirLockedError: a live process holds it (the message names that process).
        OSError: the file system does not support ``flock``.
    """
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            raise RunDirLockedError(
                f"run_dir {str(path)!r} is in use by a live run ({_holder(lock_path)}); wait for it to end or "
                "stop it, or choose another run_dir"
            ) from None
        raise


def claim_run_dir(
    path: str | Path, *, loop: str, resume: bool = False, force: bool = False, restarted: bool = False
) -> RunDirClaim:
    """Check ``path`` (``check_run_dir``: nothing is written if it is refused), create it, write the marker
    first, take the lock, and check again under the lock (another process may have claimed it in between).
    When an earlier run is started over (``force`` without ``resume``), its checkpoints are discarded.

    Call it on the main process only. Args as ``check_run_dir``; ``loop`` is recorded in the marker.

    Raises:
        RunDirError, FileNotFoundError: as ``check_run_dir``. RunDirLockedError: a live run holds ``path``.
        DiskFullError: no space left to create the folder or its marker.
    """
    path = Path(path)
    kind, start_over = check_run_dir(path, resume=resume, force=force, restarted=restarted)
    with disk_full_as_error(path):
        path.mkdir(parents=True, exist_ok=True)
        write_marker(path, loop)
        fd = lock_run_dir(path)
    claim = RunDirClaim(path, kind, start_over, fd)
    try:
        if kind in ("new", "empty", "run"):  # a run may have used it between the check and the lock
            claim.started_over = check_run_dir(path, resume=resume, force=force, restarted=restarted)[1]
        if claim.started_over:
            discard_checkpoints(path)
    except BaseException:
        claim.release()
        raise
    return claim


def disk_full(exc: BaseException) -> OSError | None:
    """The ``ENOSPC``/``EDQUOT`` ``OSError`` behind ``exc`` (itself, its cause or context, or one of the
    failures a ``torch.distributed.checkpoint`` ``CheckpointException`` carries), or None."""
    seen: set[int] = set()
    todo: list[Any] = [exc]
    while todo:
        e = todo.pop()
        if not isinstance(e, BaseException) or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return e
        todo += [e.__cause__, e.__context__]
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):
            todo += [f[0] if isinstance(f, tuple) else f for f in failures.values()]
    return None


def disk_full_error(run_dir: str | Path, error: OSError) -> DiskFullError:
    """A ``DiskFullError`` naming ``run_dir``, the file ``error`` names, and how to continue."""
    name = os.fspath(error.filename) if isinstance(error.filename, (str, os.PathLike)) else ""
    where = f" while writing {name}" if name and not name.startswith("<") else ""  # not a stream's repr
    full = DiskFullError(
        f"the disk holding run_dir {str(run_dir)!r} is full{where} ({os.strerror(error.errno)}); the checkpoints "
        f"already saved are intact: free some space, then `rlbits train --resume {run_dir}` continues the run"
    )
    full.errno = error.errno
    return full


@contextlib.contextmanager
def disk_full_as_error(run_dir: str | Path) -> Iterator[None]:
    """Turn a full disk (``ENOSPC``/``EDQUOT``, however deep it is wrapped) inside the block into one
    ``DiskFullError`` naming ``run_dir``; other errors pass unchanged."""
    try:
        yield
    except DiskFullError:
        raise
    except BaseException as e:
        full = disk_full(e)
        if full is None:
            raise
        raise disk_full_error(run_dir, full) from e


__all__ = [
    "LOCK",
    "MARKER",
    "DiskFullError",
    "RunDirClaim",
    "RunDirError",
    "RunDirLockedError",
    "check_not_locked",
    "check_run_dir",
    "claim_run_dir",
    "disk_full",
    "disk_full_as_error",
    "disk_full_error",
    "inspect_run_dir",
    "lock_run_dir",
    "write_marker",
]
