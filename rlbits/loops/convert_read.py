"""Reading a seed's config file as its own loader would: ``defaults:`` includes and OmegaConf interpolations.

``read_seed_config`` returns the merged, resolved tree; ``leaves`` flattens it into dotted field paths, the
unit ``rlbits.loops.convert`` maps. What cannot be resolved inside the files stays a string and is listed,
so the converter can name the field instead of guessing.
"""

from __future__ import annotations

import copy
import math
import re
from pathlib import Path
from typing import Any

import yaml

from rlbits.loops.config_yaml import ConfigError, load_yaml

_INTERP = re.compile(r"\$\{")
_RESOLVERS = {
    "mul": math.prod,
    "multiply": math.prod,
    "add": sum,
    "sum": sum,
    "subtract": lambda xs: xs[0] - sum(xs[1:]),
    "int_div": lambda xs: xs[0] // xs[1],
    "div": lambda xs: xs[0] / xs[1],
    "max": max,
    "min": min,
}
"""The OmegaConf resolvers the seeds' example configs register (NeMo-RL ``mul``, ``max``; NeMo ``multiply``,
``subtract``, ``int_div``), by name -> a function of the resolved argument list."""


class Unresolved(Exception):
    """An interpolation that cannot be resolved within the files (an unknown key or resolver)."""


def _read(path: Path, seen: tuple[Path, ...]) -> dict[str, Any]:
    try:
        text = path.read_text()
    except OSError as e:
        raise ConfigError(f"cannot read {path}: {e.strerror or e}") from None
    try:
        tree = load_yaml(text)
    except (ConfigError, yaml.YAMLError) as e:
        raise ConfigError(f"{path} is not readable YAML: {' '.join(str(e).split())}") from None
    if tree is None:
        tree = {}
    if not isinstance(tree, dict):
        raise ConfigError(f"{path}: a config file must hold a mapping at the top, got {type(tree).__name__}")
    defaults = tree.get("defaults")
    # NeMo-RL's load_config: ``defaults: base.yaml`` (or a list of such names) next to the file, this file
    # merged over them. Hydra's group entries (``- optional tp_overlap@...:``) stay for the converter to name.
    names = [defaults] if isinstance(defaults, str) else defaults if isinstance(defaults, list) else []
    if names and all(isinstance(n, str) and n.endswith((".yaml", ".yml")) for n in names):
        base: dict[str, Any] = {}
        for name in names:
            inc = (path.parent / name).resolve()
            if inc in seen:
                raise ConfigError(f"{path}: defaults include {name} again (a cycle)")
            base = merge(base, _read(inc, (*seen, inc)))
        tree = merge(base, {k: v for k, v in tree.items() if k != "defaults"})
    return tree


def merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """``over`` merged into a copy of ``base``: mappings key by key, anything else replaced (OmegaConf's
    merge of a file over its defaults)."""
    out = copy.deepcopy(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def _lookup(root: dict[str, Any], parts: list[str]) -> Any:
    node: Any = root
    for part in parts:
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            raise Unresolved(".".join(parts))
    return node


def _scalar(text: str) -> Any:
    """A resolver argument as OmegaConf reads it: a number, a bool, null, or the string."""
    text = text.strip()
    try:
        value = load_yaml(text)
    except (ConfigError, yaml.YAMLError):
        return text
    return value


def _split_args(text: str) -> list[str]:
    """``a, ${b}, c`` -> ``["a", "${b}", "c"]`` (commas inside ``${...}`` kept)."""
    out, depth, cur = [], 0, ""
    for ch in text:
        if ch == "," and depth == 0:
            out.append(cur)
            cur = ""
            continue
        depth += ch == "{"
        depth -= ch == "}"
        cur += ch
    out.append(cur)
    return out


def _resolve_expr(expr: str, root: dict[str, Any], where: list[str], stack: tuple[str, ...]) -> Any:
    """The value of the inside of one ``${...}``: a key path (absolute, or relative with leading dots) or
    ``resolver:arg,...``."""
    expr = expr.strip()
    head, colon, rest = expr.partition(":")
    if colon and re.fullmatch(r"[A-Za-z_][\w.]*", head) and not head.startswith("."):
        if head not in _RESOLVERS:
            raise Unresolved(f"resolver {head!r}")
        args = [_resolve_value(_scalar(a) if "${" not in a else a.strip(), root, where, stack) for a in _split_args(rest)]
        try:
            return _RESOLVERS[head]([float(a) if isinstance(a, str) else a for a in args])
        except (TypeError, ValueError, ZeroDivisionError) as e:
            raise Unresolved(f"{expr} ({e})") from None
    if expr.startswith("."):
        dots = len(expr) - len(expr.lstrip("."))
        parts = where[: len(where) - dots + 1] + [p for p in expr[dots:].split(".") if p]
    else:
        parts = expr.split(".")
    key = ".".join(parts)
    if key in stack:
        raise Unresolved(f"{key} (a cycle)")
    return _resolve_value(_lookup(root, parts), root, parts[:-1], (*stack, key))


def _resolve_value(value: Any, root: dict[str, Any], where: list[str], stack: tuple[str, ...] = ()) -> Any:
    if not isinstance(value, str) or "${" not in value:
        return value
    pieces, i, out = [], 0, []
    while True:
        m = _INTERP.search(value, i)
        if m is None:
            break
        depth, j = 1, m.end()
        while j < len(value) and depth:
            depth += value[j] == "{"
            depth -= value[j] == "}"
            j += 1
        if depth:
            raise Unresolved(value)
        pieces.append((m.start(), j, _resolve_expr(value[m.end() : j - 1], root, where, stack)))
        i = j
    if len(pieces) == 1 and pieces[0][0] == 0 and pieces[0][1] == len(value):
        return pieces[0][2]  # the whole string is one interpolation: keep the value's type
    i = 0
    for start, end, resolved in pieces:
        out.append(value[i:start] + str(resolved))
        i = end
    return "".join(out) + value[i:]


def resolve(tree: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """Every ``${...}`` of ``tree`` resolved within it -> (the resolved tree, {dotted field: what could not
    be resolved}); an unresolved field keeps its text."""
    unresolved: dict[str, str] = {}

    def walk(node: Any, where: list[str]) -> Any:
        if isinstance(node, dict):
            return {k: walk(v, [*where, str(k)]) for k, v in node.items()}
        if isinstance(node, list):
            return [walk(v, [*where, str(i)]) for i, v in enumerate(node)]
        try:
            return _resolve_value(node, tree, where[:-1])
        except Unresolved as e:
            unresolved[".".join(where)] = str(e)
            return node

    return walk(tree, []), unresolved


def read_seed_config(path: str | Path) -> tuple[dict[str, Any], dict[str, str]]:
    """A seed's YAML (or JSON) config file with its ``defaults:`` files merged under it and its
    interpolations resolved -> (tree, {field: unresolvable interpolation}).

    Raises:
        ConfigError: the file (or an included one) cannot be read, is not YAML, or holds no mapping.
    """
    path = Path(path).expanduser()
    return resolve(_read(path.resolve(), (path.resolve(),)))


def leaves(tree: Any, prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}, "c": []}`` -> ``{"a.b": 1, "c": []}``: every field that holds a value (a scalar, a
    list or an empty mapping), by dotted path."""
    if isinstance(tree, dict) and tree:
        out: dict[str, Any] = {}
        for key, value in tree.items():
            out.update(leaves(value, f"{prefix}.{key}" if prefix else str(key)))
        return out
    return {prefix: tree}


__all__ = ["Unresolved", "leaves", "merge", "read_seed_config", "resolve"]
