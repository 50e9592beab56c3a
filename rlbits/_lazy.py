"""Package attributes imported on first use, so that importing a package stays cheap (stdlib only)."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(package: str, names: Mapping[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """A module ``__getattr__`` and ``__dir__`` for ``package`` (its ``__name__``), each of whose attributes
    ``names`` maps to the module that defines it: ``{"ILQLModel": "rlbits.models.heads"}``.

    The first access of ``package.NAME`` imports ``names[NAME]`` and caches its ``NAME`` in the package's
    namespace; a name that maps to ``f"{package}.{NAME}"`` is that submodule itself. Use as::

        __getattr__, __dir__ = lazy_exports(__name__, _LAZY)

    The returned ``__getattr__`` raises ``AttributeError`` for any other name.
    """
    namespace = sys.modules[package].__dict__

    def __getattr__(name: str) -> Any:
        if name not in names:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        module = importlib.import_module(names[name])
        value = module if names[name] == f"{package}.{name}" else getattr(module, name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(names))

    return __getattr__, __dir__
