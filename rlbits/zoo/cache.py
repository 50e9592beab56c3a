"""The model cache: the folder ``$RLBITS_CACHE`` (default ``~/.cache/rlbits``) and the file lock that keeps
two processes from building or fetching the same model twice.

``rlbits.zoo.builder`` keeps a task's base model in ``default_model_dir(task)``; ``rlbits.zoo.real`` keeps the
registry models in ``cache_dir() / "models"``. Both build under ``file_lock``: a waiting process says on
stderr what it waits for (at once, then every ``LOCK_REPORT_EVERY_S``) and gives up after ``lock_timeout()``
seconds (``$RLBITS_LOCK_TIMEOUT``, default an hour).
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from pathlib import Path

# Longest wait for another process's build (seconds), unless ``RLBITS_LOCK_TIMEOUT`` or ``lock_timeout=``.
LOCK_TIMEOUT_S = 3600.0
# Seconds between the "waiting for another process" lines on stderr.
LOCK_REPORT_EVERY_S = 30.0


def cache_dir() -> Path:
    """``$RLBITS_CACHE`` if set, else ``~/.cache/rlbits``."""
    return Path(os.environ.get("RLBITS_CACHE") or Path.home() / ".cache" / "rlbits").expanduser()


def default_model_dir(task: str) -> Path:
    """Where ``task``'s base model lives: ``cache_dir() / f"{task}-base"``."""
    return cache_dir() / f"{task}-base"


def lock_timeout() -> float:
    """Seconds a process waits for another one's build: ``$RLBITS_LOCK_TIMEOUT``, else ``LOCK_TIMEOUT_S``."""
    value = os.environ.get("RLBITS_LOCK_TIMEOUT")
    if not value:
        return LOCK_TIMEOUT_S
    try:
        return float(value)
    except ValueError:
        raise ValueError(f"RLBITS_LOCK_TIMEOUT must be a number of seconds, got {value!r}") from None


def _holder(path: Path) -> str:
    # The pid the lock's holder wrote into the lock file, as words for a message.
    try:
        pid = path.read_text().strip()
    except OSError:
        pid = ""
    return f"pid {pid}" if pid.isdigit() else "pid unknown"


@contextlib.contextmanager
def file_lock(path: Path, *, what: str = "", timeout: float | None = None):
    """Hold an exclusive ``flock`` on ``path`` while the block runs; the holder writes its pid into the file.

    A waiter says on stderr what it waits for (``what``, else the path), at once and then every
    ``LOCK_REPORT_EVERY_S`` seconds. Without ``fcntl`` (Windows) the block runs unlocked.

    Args:
        path: the lock file (created, with its parent folders, if missing).
        what: words for the messages, e.g. the folder being built.
        timeout: seconds to wait; default ``lock_timeout()``.

    Raises:
        TimeoutError: another process held the lock for ``timeout`` seconds (the message names the lock
            file and its holder's pid).
    """
    timeout = lock_timeout() if timeout is None else timeout
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as f:
        try:
            import fcntl
        except ImportError:  # no flock (Windows): build without a lock
            yield
            return
        start = time.monotonic()
        report_at = start
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                pass
            now = time.monotonic()
            if now - start >= timeout:
                raise TimeoutError(
                    f"gave up after {now - start:.0f} s waiting for another process ({_holder(path)}) "
                    f"building {what or path}: the lock file {path} is still locked. If that build hangs, end "
                    f"its process; if no process holds the lock (a network filesystem that kept it), remove "
                    f"{path}. Wait longer with RLBITS_LOCK_TIMEOUT=SECONDS (now {timeout:g})."
                )
            if now >= report_at:
                print(
                    f"rlbits: waiting for another process ({_holder(path)}) building {what or path} "
                    f"({now - start:.0f} s so far, giving up after {timeout:g} s: RLBITS_LOCK_TIMEOUT). "
                    f"Lock file: {path}; the lock goes with its process, so if no such process is running "
                    f"(e.g. the lock is on a network filesystem), remove {path} and retry.",
                    file=sys.stderr,
                    flush=True,
                )
                report_at = now + LOCK_REPORT_EVERY_S
            time.sleep(max(0.0, min(0.2, timeout - (now - start))))
        try:
            f.seek(0)
            f.truncate()
            f.write(f"{os.getpid()}\n")
            f.flush()
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


__all__ = [
    "LOCK_TIMEOUT_S",
    "LOCK_REPORT_EVERY_S",
    "cache_dir",
    "default_model_dir",
    "file_lock",
    "lock_timeout",
]
