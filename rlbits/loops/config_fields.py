"""How a config field is declared and checked: its range (``ranged``), its type, its docstring.

``rlbits.loops.config`` declares the fields with these; ``check_fields`` runs when a config is built.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import math
import os
import textwrap
import types
import typing
from typing import Any, Literal

from rlbits.loops.config_yaml import ConfigError, show

# --------------------------------------------------------------------------------------------------------
# Ranges
# --------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Range:
    """The values a numeric field accepts: bounds (``ge``, ``gt``, ``le``, ``lt``; None = unbounded), a size
    cap (``at_most``: sizes that allocate, listed by ``--help-config``) and whether the value may be
    infinite (``finite``; NaN never is). None passes when the field's type allows it."""

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    at_most: int | None = None
    finite: bool = True

    def describe(self, none_ok: bool = False) -> str:
        """``>= 1``, ``> 0 or null``, ``in [0, 1]``, ``in (0, 1)``, ...: the bounds, as error messages say them."""
        low = ("[", self.ge) if self.ge is not None else ("(", self.gt) if self.gt is not None else None
        high = ("]", self.le) if self.le is not None else (")", self.lt) if self.lt is not None else None
        if low and high:
            text = f"in {low[0]}{_number(low[1])}, {_number(high[1])}{high[0]}"
        elif low:
            text = (">= " if low[0] == "[" else "> ") + _number(low[1])
        elif high:
            text = ("<= " if high[0] == "]" else "< ") + _number(high[1])
        else:
            text = "any number"
        return text + (" or null" if none_ok else "")

    def problem(self, value: float, none_ok: bool = False) -> str | None:
        """What is wrong with ``value`` (``"must be >= 1"``, ...; ``none_ok``: the field may also be None, as
        the message then says), or None when it is in range."""
        if isinstance(value, float) and (math.isnan(value) or (self.finite and math.isinf(value))):
            return "must be a finite number"
        inside = (
            (self.ge is None or value >= self.ge)
            and (self.gt is None or value > self.gt)
            and (self.le is None or value <= self.le)
            and (self.lt is None or value < self.lt)
        )
        if not inside:
            return f"must be {self.describe(none_ok)}"
        if self.at_most is not None and value > self.at_most:
            return f"must be <= {self.at_most}"
        return None


_ANY = Range()  # a float field without a declared range: only NaN and inf are refused


def _number(bound: float) -> str:
    return f"{bound:g}" if isinstance(bound, float) else str(bound)


def ranged(
    default: Any,
    *,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    lt: float | None = None,
    at_most: int | None = None,
    finite: bool = True,
) -> Any:
    """A config field with default ``default`` whose values must lie in a ``Range`` (checked when a config is
    built). A subclass that gives the field another default keeps its range (``field_ranges``)."""
    bounds = Range(ge=ge, gt=gt, le=le, lt=lt, at_most=at_most, finite=finite)
    return dataclasses.field(default=default, metadata={"range": bounds})


@functools.cache
def field_ranges(cls: type) -> dict[str, Range]:
    """Field name -> its ``Range``, for ``cls`` and its bases (do not modify the dict returned)."""
    out: dict[str, Range] = {}
    for klass in reversed(cls.__mro__):
        for f in getattr(klass, "__dataclass_fields__", {}).values():
            if "range" in f.metadata:
                out[f.name] = f.metadata["range"]
    return out


def size_limits(cls: type) -> dict[str, int]:
    """Field -> the largest value a config of ``cls`` accepts (``Range.at_most``): sizes that allocate."""
    return {name: r.at_most for name, r in field_ranges(cls).items() if r.at_most is not None}


def check_fields(cfg: Any) -> None:
    """Every field of ``cfg`` holds a value of its annotated type (coerced in place: an int for a float field
    becomes a float) in its ``Range``; float fields are never NaN and, unless their range says otherwise,
    never infinite. Raises ConfigError naming the first bad field, its value and its docstring."""
    cls = type(cfg)
    hints, ranges = _hints(cls), field_ranges(cls)
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        coerced = _coerce(cls, f.name, value, hints[f.name])
        if coerced is not value:
            object.__setattr__(cfg, f.name, coerced)
        if not isinstance(coerced, (int, float)) or isinstance(coerced, bool):
            continue
        none_ok = type(None) in typing.get_args(hints[f.name])
        problem = ranges.get(f.name, _ANY).problem(coerced, none_ok)
        if problem is not None:
            doc = field_docs(cls).get(f.name, "")
            raise ConfigError(f"{f.name} {problem}, got {show(coerced)}" + (f" ({doc})" if doc else ""))


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """Field name -> the docstring written under it, whitespace joined, for ``cls`` and its dataclass bases
    (read from the source once per class; do not modify the dict returned)."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass) or klass is object:
            continue
        try:
            source = textwrap.dedent(inspect.getsource(klass))
        except (OSError, TypeError):
            continue
        body = ast.parse(source).body[0].body
        for node, nxt in zip(body, body[1:], strict=False):
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                if (
                    isinstance(nxt, ast.Expr)
                    and isinstance(nxt.value, ast.Constant)
                    and isinstance(nxt.value.value, str)
                ):
                    docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(cls: type, name: str, value: Any, tp: Any) -> Any:
    """``value`` checked against the annotation ``tp`` (int, float, bool, str, dict, X | None, Literal[...]);
    an int or a numeric string (YAML 1.1 reads ``1e-5`` as one) for a float becomes a float, a path
    (``os.PathLike``) for a str its string."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(cls, name, value, arg)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if errors else f"{name}: bad value {show(value)}")
    if origin is Literal:
        allowed = typing.get_args(tp)
        if value not in allowed:
            raise ConfigError(f"{name} must be one of {', '.join(map(repr, allowed))}; got {show(value)}")
        return value
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, float):
            return value
        if isinstance(value, int) and not isinstance(value, bool):
            try:
                return float(value)
            except OverflowError:
                raise ConfigError(f"{name} must be a float; {show(value)} is too large for one") from None
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
    elif tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, os.PathLike):  # run_dir=Path(...) in a notebook: a path field holds its string
            return os.fspath(value)
    elif tp is dict or origin is dict:
        if isinstance(value, dict):
            return value
    else:
        return value
    doc = field_docs(cls).get(name, "")
    raise ConfigError(
        f"{name} must be {_type_name(tp)}, got {show(value)} ({type(value).__name__})"
        + (f": {doc}" if doc else "")
    )


__all__ = ["Range", "check_fields", "field_docs", "field_ranges", "ranged", "size_limits"]
