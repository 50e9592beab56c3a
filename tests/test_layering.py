"""Imports point down only (DESIGN.md "Layers"). Walks every module's AST, including imports inside
functions, so a lazy import cannot hide a layer reaching up."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "rlbits"

# Lower rank = lower layer. A module may import only its own layer or lower ones.
RANKS = {
    "functional": 0,
    "_io": 1,
    "batch": 1,
    "tasks": 2,
    "models": 3,
    "rollout": 4,
    "distributed": 5,
    "dist": 5,
    "loops": 6,
    "api": 6,
    "cli": 7,
    "demo": 7,
    "__init__": 7,
    "__main__": 7,
}
SIDE_BRANCH = "viz"  # may import anything; nothing but the CLI imports it

# Third-party packages the kernels (``rlbits.functional``) may import besides the stdlib. einops is a declared
# core dependency (pyproject.toml) used for the group reshapes ("(g k) -> g k"); it is pure Python over
# torch ops and traces through torch.compile(fullgraph=True) (tests/test_functional_compile.py), so the
# kernels stay free of tensordict, transformers and torch.distributed.
FUNCTIONAL_THIRD_PARTY = ("torch", "einops")


def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE.parent).with_suffix("")
        name = ".".join(rel.parts)
        if name.endswith(".__init__"):
            name = name[: -len(".__init__")]
        yield name, path


def _imports(path: Path, module: str):
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                yield node.lineno, ".".join(base + ([node.module] if node.module else []))
            else:
                yield node.lineno, node.module


MODULES = list(_modules())


def test_modules_found():
    names = [m for m, _ in MODULES]
    assert "rlbits.functional.advantages" in names and len(names) > 8


@pytest.mark.parametrize("module,path", MODULES, ids=[m for m, _ in MODULES])
def test_imports_point_down(module, path):
    layer = _layer(module)
    problems = []
    for line, target in _imports(path, module):
        top = target.split(".")[0]
        allowed = (*FUNCTIONAL_THIRD_PARTY, "rlbits")
        if layer == "functional" and top not in allowed and top not in sys.stdlib_module_names:
            problems.append(
                f"line {line}: functional may import only {', '.join(FUNCTIONAL_THIRD_PARTY)} and the stdlib, "
                f"not {target}"
            )
        if layer == "functional" and target.startswith("rlbits") and not target.startswith("rlbits.functional"):
            problems.append(f"line {line}: functional imports {target}")
        if target.startswith("torch.distributed") and layer != "distributed":
            problems.append(f"line {line}: only rlbits.distributed may import torch.distributed ({target})")
        if not target.startswith("rlbits.") or layer == SIDE_BRANCH:
            continue
        target_layer = _layer(target)
        if target_layer == SIDE_BRANCH:
            if layer != "cli":
                problems.append(f"line {line}: core module imports the side branch {target}")
            continue
        if RANKS.get(target_layer, 99) > RANKS.get(layer, -1):
            problems.append(f"line {line}: layer {layer!r} reaches up to {target}")
    assert not problems, f"{module}:\n" + "\n".join(problems)
