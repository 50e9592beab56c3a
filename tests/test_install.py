"""The editable install (``pip install -e .``, README) works from any folder, including one that holds a
folder named ``rlbits`` (a clone): pyproject.toml's ``package-dir`` makes setuptools put the project root on
``sys.path`` through a plain ``.pth`` file, so the path finder finds the package, not a namespace package."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest


def _editable_root() -> Path | None:
    """The project folder of an editable install of rlbits in this interpreter's environment, or None.

    Every distribution named rlbits is looked at: under ``python -m pytest`` the checkout's own
    ``rlbits.egg-info`` (no ``direct_url.json``) comes first on the path, before the installed one."""
    for dist in metadata.distributions(name="rlbits"):
        info = json.loads(dist.read_text("direct_url.json") or "{}")
        if info.get("dir_info", {}).get("editable") and info.get("url", "").startswith("file://"):
            return Path(info["url"][len("file://") :])
    return None


def test_import_from_a_folder_holding_a_clone_named_rlbits(tmp_path):
    root = _editable_root()
    if root is None:
        pytest.skip("rlbits is not installed editable here (pip install -c constraints.txt -e '.[dev]')")
    clone = tmp_path / "rlbits"  # a clone left in a folder named like the package
    (clone / "rlbits").mkdir(parents=True)
    (clone / "pyproject.toml").write_text("[project]\nname = 'rlbits'\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the installed package, not a path
    code = "import rlbits; rlbits.train; print(rlbits.__file__)"
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert out.returncode == 0, (
        f"`import rlbits` from a folder holding {clone} failed (a namespace package shadowed the editable "
        f"install of {root}; reinstall with `pip install -c constraints.txt -e .`):\n{out.stderr[-2000:]}"
    )
    assert Path(out.stdout.strip()).resolve() == (root / "rlbits" / "__init__.py").resolve()
