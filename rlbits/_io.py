"""Small file-system helpers shared across layers (stdlib only)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path


@contextlib.contextmanager
def atomic_folder(path: str | os.PathLike, *, marker: str = "config.json") -> Iterator[Path]:
    """Yield a temporary sibling folder; on success it replaces ``path``, on error it is removed.

    A reader never sees a half-written ``path``: the new folder is renamed into place (the old one, if any,
    is moved aside first and deleted after). An existing ``path`` is only replaced if it is empty or holds
    ``marker`` (``config.json``: a checkpoint; ``meta.json``: a memory-mapped TensorDict), so a typo cannot wipe
    an unrelated folder.

    Raises:
        ValueError: ``path`` is a file, or a non-empty folder without ``marker``.
    """
    dst = Path(path).expanduser()
    if dst.exists():
        if not dst.is_dir():
            raise ValueError(f"cannot save to {str(path)!r}: it is a file")
        if any(dst.iterdir()) and not (dst / marker).is_file():
            raise ValueError(
                f"refusing to overwrite {str(path)!r}: it is a non-empty folder without {marker} "
                "(not what is saved there); choose a new or empty folder"
            )
    dst.parent.mkdir(parents=True, exist_ok=True)
    # mkdir (not mkdtemp, which makes it 0700) so the final folder gets the usual umask permissions.
    tmp = dst.parent / f".{dst.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        yield tmp
        old = None
        if dst.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{dst.name}.old-", dir=dst.parent))
            os.replace(dst, old / "x")
        os.replace(tmp, dst)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def read_jsonl(
    path: Path, *, what: str, error: type[Exception], expected: str, accept: Callable[[object], bool]
) -> list:
    """The rows of a JSONL file, blank lines skipped. A line that is not JSON, or a row ``accept`` refuses,
    raises ``error`` naming ``what``, the file and the line (``expected`` says what a row must be)."""
    rows = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise error(f"{what} file {str(path)!r}, line {n}: not JSON ({e.msg})") from None
        except RecursionError:
            raise error(f"{what} file {str(path)!r}, line {n}: not JSON (it nests too deeply)") from None
        if not accept(row):
            raise error(f"{what} file {str(path)!r}, line {n}: expected {expected}")
        rows.append(row)
    return rows


def sha256_file(
    path: str | os.PathLike, offset: int = 0, length: int | None = None, *, block: int = 16 << 20
) -> str:
    """Hex sha256 of ``length`` bytes of the file ``path`` from byte ``offset`` (None: to the end).

    Reads into one reused buffer of up to ``block`` bytes: few GIL hand-overs per block, so threads hashing
    beside a busy main thread do not slow it (hashlib releases the GIL while it hashes).
    """
    h = hashlib.sha256()
    with open(path, "rb") as f:
        f.seek(offset)
        left = length if length is not None else os.fstat(f.fileno()).st_size - offset
        buffer = bytearray(min(max(left, 0), block))
        view = memoryview(buffer)
        while left > 0:
            n = f.readinto(view[: min(len(buffer), left)])
            if not n:
                break
            h.update(view[:n])
            left -= n
    return h.hexdigest()
