"""Execute the tutorials and research notebooks in place, so their saved copies hold real outputs.

    python tutorials/execute.py                      # every notebook, full settings (tens of minutes on CPU)
    python tutorials/execute.py tutorials/02_*.ipynb # some of them
    python tutorials/execute.py --small              # tiny settings (what CI runs), outputs written too

Each notebook runs with its own folder as the working directory (its runs go to ``runs/`` there, which
git ignores). Full settings use the task base models cached under ``$RLBITS_CACHE`` (built on first use).
Prints the wall time of each notebook; stops at the first error, leaving that notebook's file untouched.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "tutorials").glob("*.ipynb")) + sorted((ROOT / "notebooks").glob("*.ipynb"))


def execute(path: Path, *, small: bool, cwd: Path | None = None, timeout: int | None = None):
    """Run every cell of the notebook at ``path`` top to bottom in a fresh ``python3`` kernel and return the
    executed notebook (not written). ``RLBITS_NOTEBOOK_SMALL=1`` in the kernel's environment when ``small``.
    Raises ``nbclient.exceptions.CellExecutionError`` naming the failing cell."""
    import nbclient
    import nbformat

    nb = nbformat.read(path, as_version=4)
    os.environ["RLBITS_NOTEBOOK_SMALL"] = "1" if small else "0"
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # small models are fastest on one thread
    client = nbclient.NotebookClient(
        nb, timeout=timeout, kernel_name="python3", resources={"metadata": {"path": str(cwd or path.parent)}}
    )
    client.execute()
    return nb


def main(argv: list[str] | None = None) -> int:
    import nbformat

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("notebooks", nargs="*", type=Path, help="default: every tutorial and notebook")
    parser.add_argument("--small", action="store_true", help="tiny settings (RLBITS_NOTEBOOK_SMALL=1)")
    args = parser.parse_args(argv)
    for path in args.notebooks or NOTEBOOKS:
        t0 = time.perf_counter()
        nb = execute(path.resolve(), small=args.small)
        nbformat.write(nb, path)
        print(f"{path}: {time.perf_counter() - t0:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
