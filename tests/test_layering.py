"""Imports point down only (docs/design.md "Layers"). Walks every module's AST, including imports inside
functions, so a lazy import cannot hide a layer reaching up."""

from __future__ import annotations

import ast
import itertools
import sys
from collections import deque
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "rlbits"

# Lower rank = lower layer. A module may import only its own layer or lower ones.
RANKS = {
    "functional": 0,
    "_io": 1,
    "_lazy": 1,  # lazy_exports: stdlib only, used by the package __init__ files
    "_seeds": 1,  # derive_seed: stdlib only, below everything that seeds a stream
    "batch": 1,
    "text": 1,  # tokenize/chat/decode between strings and the batch; imports batch
    "envs": 1,  # environments and tools: plain Python, below the tasks whose ``make_env`` builds one
    "tasks": 2,
    "models": 3,
    "rollout": 4,
    "zoo": 5,  # the tasks' base models: built from tasks' corpora, used by the loops and the CLI
    "distributed": 6,
    "data": 6,  # PromptStream and the ILQL offline dataset: generate/score (rollout), unsharded/DistEnv (distributed)
    "loops": 7,
    "api": 7,
    "cli": 8,
    "demo": 8,
    "__init__": 8,
    "__main__": 8,
}
SIDE_BRANCH = "viz"  # may import anything; nothing but the CLI imports it

# Third-party packages the kernels (``rlbits.functional``) may import besides the stdlib. einops is a declared
# core dependency (pyproject.toml) used for the group reshapes ("(g k) -> g k"); it is pure Python over
# torch ops and traces through torch.compile(fullgraph=True) (tests/functional/test_functional_compile.py), so the
# kernels stay free of tensordict, transformers and torch.distributed.
FUNCTIONAL_THIRD_PARTY = ("torch", "einops")

# Third-party packages the envs layer (plain Python, no torch) may import besides the stdlib: transformers,
# only inside ``ToolRegistry.register`` (``get_json_schema`` for a tool without a schema; it imports torch
# where torch is installed). ``import rlbits.envs`` imports neither (tests/envs/test_envs_tools.py).
ENVS_THIRD_PARTY = ("transformers",)


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
        if (
            layer == "functional"
            and target.startswith("rlbits")
            and not target.startswith("rlbits.functional")
        ):
            problems.append(f"line {line}: functional imports {target}")
        if (
            layer == "envs"
            and top not in (*ENVS_THIRD_PARTY, "rlbits")
            and top not in sys.stdlib_module_names
        ):
            problems.append(f"line {line}: envs is plain Python: it may import only the stdlib, not {target}")
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


# --------------------------------------------------------------------------------------------------------
# No import cycles between rlbits modules
# --------------------------------------------------------------------------------------------------------

MODULE_NAMES = {m for m, _ in MODULES}
PATHS = dict(MODULES)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _runtime_nodes(tree: ast.AST):
    """Every node of ``tree`` except the bodies of ``if TYPE_CHECKING:`` (imports that never run)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        stack.extend(ast.iter_child_nodes(node))


def _known(dotted: str) -> str | None:
    """The rlbits module that importing ``dotted`` runs last: the longest prefix that is a module."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        if ".".join(parts[:i]) in MODULE_NAMES:
            return ".".join(parts[:i])
    return None


def _module_edges(module: str, path: Path) -> dict[str, int]:
    """``{imported rlbits module: first line}`` for every import in ``module``, at any depth (inside
    functions and ``try`` blocks too, not under ``if TYPE_CHECKING``).

    ``from p import n`` imports the submodule ``p.n`` when there is one, else ``p``; ``import a.b.c`` and
    ``from a.b import c`` also run the packages ``a`` and ``a.b`` first, so those are edges too, except the
    packages that contain ``module`` (Python has imported them before ``module`` started).
    ``importlib.import_module("literal")`` counts, and so does each module named in a package's ``_LAZY``
    dict (``rlbits._lazy.lazy_exports``: imported on first attribute access). An ``import_module`` of a computed
    name (``api.loop_module``: ``import_module(LOOPS[name][0])``) may import any rlbits module that the module
    names in a string constant (``"rlbits.loops.ilql"``), or else that the modules it imports name: each of
    those is an edge.
    """
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    ancestors = {".".join(module.split(".")[:i]) for i in range(1, module.count(".") + 1)}
    edges: dict[str, int] = {}
    computed: list[int] = []

    def add(dotted: str, line: int, *, implicit: bool = False) -> None:
        target = _known(dotted)
        if target is None or target == module or (implicit and target in ancestors):
            return
        edges[target] = min(line, edges.get(target, line))
        parts = target.split(".")
        for i in range(1, len(parts)):  # the packages above the target run first
            add(".".join(parts[:i]), line, implicit=True)

    for node in _runtime_nodes(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name, node.lineno)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module
            for alias in node.names:
                add(f"{source}.{alias.name}", node.lineno)
        elif _is_import_module(node):
            if isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
                add(node.args[0].value, node.lineno)
            else:
                computed.append(node.lineno)
        elif (
            isinstance(node, ast.Assign)
            and any(isinstance(t, ast.Name) and t.id == "_LAZY" for t in node.targets)
            and isinstance(node.value, ast.Dict)
        ):
            for value in node.value.values:
                if isinstance(value, ast.Constant) and isinstance(value.value, str):
                    add(value.value, value.lineno)
    if computed:  # the names it may import: module-name strings in it and in the modules it imports
        named = _named_modules(tree) | {n for m in list(edges) for n in _named_modules(_tree(m))}
        for name in sorted(named):
            add(name, computed[0], implicit=True)  # "rlbits" (importlib.resources) names no import
    return edges


def _is_import_module(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, (ast.Attribute, ast.Name))
        and (node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id) == "import_module"
        and bool(node.args)
    )


def _tree(module: str) -> ast.AST:
    return ast.parse(PATHS[module].read_text(), filename=str(PATHS[module]))


def _named_modules(tree: ast.AST) -> set[str]:
    """The rlbits modules a module names in string constants (``"rlbits.loops.ppo"``)."""
    return {
        node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in MODULE_NAMES
    }


def _find_cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """A shortest cycle through each module that lies on one, each cycle listed once as ``[a, b, ..., a]``
    starting at its smallest name."""
    cycles = set()
    for start in sorted(graph):
        parent: dict[str, str | None] = {start: None}  # breadth-first from start
        queue, closing = deque([start]), None
        while queue and closing is None:
            node = queue.popleft()
            for nxt in sorted(graph.get(node, {})):
                if nxt == start:
                    closing = node  # node imports start: the cycle start -> ... -> node -> start
                    break
                if nxt not in parent:
                    parent[nxt] = node
                    queue.append(nxt)
        if closing is None:
            continue
        path = [closing]
        while path[-1] != start:
            path.append(parent[path[-1]])
        path.reverse()
        i = path.index(min(path))
        cycles.add(tuple(path[i:] + path[:i]))
    return [[*c, c[0]] for c in sorted(cycles)]


def _describe(cycle: list[str], graph: dict[str, dict[str, int]]) -> str:
    steps = [f"{a} imports {b} (line {graph[a][b]})" for a, b in itertools.pairwise(cycle)]
    return "  " + "\n  ".join(steps)


IMPORT_GRAPH = {module: _module_edges(module, path) for module, path in MODULES}


def test_import_graph_sees_lazy_and_package_imports():
    # A function-level import (zoo.real's CheckpointNotFoundError) and the package re-export path.
    assert "rlbits.models.load" in IMPORT_GRAPH["rlbits.zoo.real"]
    assert "rlbits.rollout.score" in IMPORT_GRAPH["rlbits.rollout.reward_server"]
    assert "rlbits.functional.advantages" in IMPORT_GRAPH["rlbits.functional"]
    assert "rlbits.models" in IMPORT_GRAPH["rlbits.rollout.score"]  # the package above models.load runs first
    assert "rlbits.models.heads" in IMPORT_GRAPH["rlbits.models"]  # a lazy export (``_LAZY``)
    assert _find_cycles({"a": {"b": 1}, "b": {"c": 2}, "c": {"a": 3}, "d": {"a": 4}}) == [
        ["a", "b", "c", "a"]
    ]
    assert _find_cycles({"a": {"b": 1}, "b": {}}) == []


def test_import_graph_sees_computed_imports():
    """``rlbits.train`` and ``rlbits eval`` import a loop by a name from the config (``api.loop_module``): the
    graph has an edge from ``api`` to every loop, so a loop importing ``api`` (or ``evaluate``) is a cycle."""
    loops = {"rlbits.loops.ppo", "rlbits.loops.reinforce", "rlbits.loops.ilql", "rlbits.loops.reward_model"}
    assert loops <= set(IMPORT_GRAPH["rlbits.loops.api"])
    assert "rlbits.loops.api" in IMPORT_GRAPH["rlbits.loops.evaluate"]
    for loop in loops:
        assert not {"rlbits.loops.api", "rlbits.loops.evaluate"} & set(IMPORT_GRAPH[loop]), loop


def test_no_import_cycles():
    """The rlbits modules import each other in a DAG: no module imports (directly or through others, at
    module level or inside a function) a module that imports it back. A cycle works only as long as every
    import in it happens in the right order; the layers stay separable only without them."""
    cycles = _find_cycles(IMPORT_GRAPH)
    assert not cycles, f"{len(cycles)} import cycle(s) between rlbits modules:\n" + "\n\n".join(
        _describe(c, IMPORT_GRAPH) for c in cycles
    )
