"""Every subpackage exports its public names: ``from rlbits.models import ILQLModel`` works, each name of a
package's ``__all__`` resolves, and a package re-exports the ``__all__`` of each of its modules. Importing a
package stays cheap: heavy dependencies load when a name that needs them is used."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "rlbits"
# ``rlbits.loops`` exports its loops' entry points itself (docs/design.md, "Loops").
SUBPACKAGES = ["data", "distributed", "envs", "functional", "models", "rollout", "tasks", "viz", "zoo"]
# A package attribute named like one of its modules is that module, not the module's function of that name.
MODULE_NAMED = {("rlbits.rollout", "score")}
# Modules whose names the package does not re-export, and why.
NOT_REEXPORTED = {
    "rlbits.tasks.movie_reviews": "the imdb task's data helpers; a task is reached by get_task(name)",
}


def _static_all(path: Path) -> list[str] | None:
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
            return [ast.literal_eval(e) for e in node.value.elts]
    return None


def _modules(package: str) -> list[tuple[str, Path]]:
    """The modules and subpackages directly in ``package``, private ones (``_name``) left out."""
    folder = PACKAGE / package
    out = []
    for path in sorted(folder.iterdir()):
        if path.suffix == ".py" and not path.name.startswith("_"):
            out.append((f"rlbits.{package}.{path.stem}", path))
        elif path.is_dir() and (path / "__init__.py").is_file():
            out.append((f"rlbits.{package}.{path.name}", path / "__init__.py"))
    return out


@pytest.mark.parametrize("package", SUBPACKAGES)
def test_every_name_in_all_resolves(package):
    pkg = importlib.import_module(f"rlbits.{package}")
    assert pkg.__all__, f"rlbits.{package} exports nothing"
    assert len(set(pkg.__all__)) == len(pkg.__all__), f"rlbits.{package}.__all__ repeats a name"
    missing = [name for name in pkg.__all__ if getattr(pkg, name, None) is None]
    assert not missing, f"rlbits.{package}.__all__ names {missing}, which do not import"
    assert set(pkg.__all__) <= set(dir(pkg))
    with pytest.raises(AttributeError, match=f"rlbits.{package}"):
        pkg.no_such_name  # noqa: B018


@pytest.mark.parametrize("package", SUBPACKAGES)
def test_a_package_exports_the_all_of_each_module(package):
    pkg = importlib.import_module(f"rlbits.{package}")
    problems = []
    for module, path in _modules(package):
        names = _static_all(path)
        if names is None or module in NOT_REEXPORTED:
            continue
        for name in names:
            if (pkg.__name__, name) in MODULE_NAMED:
                assert getattr(pkg, name) is importlib.import_module(f"{pkg.__name__}.{name}")
            elif name not in pkg.__all__:
                problems.append(f"{module}.{name} is not in rlbits.{package}.__all__")
            elif getattr(pkg, name) is not getattr(importlib.import_module(module), name):
                problems.append(f"rlbits.{package}.{name} is not {module}.{name}")
    assert not problems, "\n".join(problems)


def test_the_ilql_doc_import_works():
    from rlbits.models import ILQLModel, ValueModel  # as docs/ilql.md and docs/ppo.md write

    assert ILQLModel.__module__ == "rlbits.models.heads" and ValueModel.__module__ == "rlbits.models.heads"


def test_importing_the_packages_loads_no_heavy_dependency():
    heavy = ["transformers", "peft", "torchrl", "matplotlib", "ipywidgets"]
    code = (
        "import sys\n"
        f"import {', '.join(f'rlbits.{p}' for p in SUBPACKAGES if p != 'zoo')}\n"
        f"print([m for m in {heavy!r} if m in sys.modules])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=PACKAGE.parent)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
