"""Every tutorial and research notebook runs top to bottom (nbclient, kernel ``python3``) in small mode.

Each runs on a copy in a temporary folder (the repo copy, which keeps the outputs of a full run, is never
written), with ``RLBITS_NOTEBOOK_SMALL=1`` (the notebooks' first code cell then picks tiny settings and
builds a tiny base model in seconds) and an empty ``RLBITS_CACHE``, as on a fresh CI machine. The
notebooks' own ``assert``s are the checks.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "tutorials").glob("*.ipynb")) + sorted((ROOT / "notebooks").glob("*.ipynb"))


def test_every_tutorial_number_is_there():
    names = [p.name for p in NOTEBOOKS if p.parent.name == "tutorials"]
    assert len(names) >= 9 and [n[:2] for n in names] == [f"{i:02d}" for i in range(1, len(names) + 1)]
    assert len([p for p in NOTEBOOKS if p.parent.name == "notebooks"]) >= 2


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[f"{p.parent.name}/{p.stem}" for p in NOTEBOOKS])
def test_notebook_runs_in_small_mode(path, tmp_path, monkeypatch):
    nbclient = pytest.importorskip("nbclient")
    nbformat = pytest.importorskip("nbformat")
    copy = tmp_path / path.name
    shutil.copy(path, copy)
    original = path.read_bytes()
    monkeypatch.setenv("RLBITS_NOTEBOOK_SMALL", "1")
    monkeypatch.setenv("RLBITS_CACHE", str(tmp_path / "cache"))  # empty: nothing may need a prebuilt model
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    nb = nbformat.read(copy, as_version=4)
    client = nbclient.NotebookClient(
        nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    )
    client.execute()  # raises CellExecutionError naming the failing cell and its traceback
    errors = [
        o
        for c in nb.cells
        if c.cell_type == "code"
        for o in c.get("outputs", [])
        if o.get("output_type") == "error"
    ]
    assert not errors
    assert path.read_bytes() == original  # the repo copy is untouched
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").iterdir()), (
        "a task base model was built"
    )
