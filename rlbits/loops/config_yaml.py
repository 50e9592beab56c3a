"""Config text, read safely: YAML files and ``key=value`` overrides (``read_yaml``, ``parse_overrides``), and
the error every config check raises (``ConfigError``, its values shown in bounded size by ``show``).

``rlbits.loops.config`` builds the configs from the dicts read here. The loader refuses a key given twice,
recursive aliases and aliases that expand past ``MAX_ALIAS_NODES`` nodes (a "billion laughs" document).
"""

from __future__ import annotations

import reprlib
from pathlib import Path
from typing import Any

import yaml


class ConfigError(ValueError):
    """A config key or value is invalid; the message names the field and what is allowed.

    The message is cut at ``MAX_MESSAGE`` characters (values in it are shown by ``show``, at most
    ``MAX_VALUE`` characters each), so a huge or deeply shared value cannot make the error itself costly."""

    MAX_MESSAGE = 4000

    def __init__(self, message: object = "", *args: object):
        if isinstance(message, str) and len(message) > self.MAX_MESSAGE:
            message = message[: self.MAX_MESSAGE] + f" ... (message cut at {self.MAX_MESSAGE} characters)"
        super().__init__(message, *args)


MAX_VALUE = 200
"""Most characters ``show`` gives a value in a message."""

_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother, _REPR.maxlong = 3, 80, 80, 40
_REPR.maxlist = _REPR.maxtuple = _REPR.maxdict = _REPR.maxset = _REPR.maxfrozenset = 8


def show(value: Any, limit: int = MAX_VALUE) -> str:
    """``repr(value)`` cut to at most ``limit`` characters, built without walking all of a large or deeply
    nested value (``reprlib``: the first items of each container, three levels deep)."""
    try:
        text = _REPR.repr(value)
    except Exception:  # e.g. an int past sys.get_int_max_str_digits()
        text = f"<{type(value).__name__}>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def parse_overrides(overrides: list[str] | tuple[str, ...]) -> dict[str, Any]:
    """``["key=value", ...]`` -> dict, each value parsed as YAML (``lr=1e-5``, ``wandb=true``,
    ``policy=null``) by the loader of config files (``load_yaml``: merge keys, bounded aliases, no duplicate
    keys)."""
    out = {}
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {show(item)} is not of the form key=value")
        try:
            out[key.strip()] = load_yaml(raw) if raw.strip() else ""
        except ConfigError as e:
            raise ConfigError(f"override {show(key.strip())}: {e}") from None
        except Exception as e:  # PyYAML also raises RecursionError, ValueError, ... on odd input
            why = f"{type(e).__name__}: {str(e)[:_MAX_YAML_ERROR]}"
            raise ConfigError(f"override {show(key.strip())}: value {show(raw)} is not valid YAML ({why})") from e
    return out


MAX_ALIAS_NODES = 10_000
"""Most YAML nodes that aliases (``*name``) may add to a config when expanded: anchors reused a few times
fit easily, while nine levels of nine aliases each (a 400-byte "billion laughs") would stand for 10^9."""
_MAX_YAML_ERROR = 600  # characters of PyYAML's own message (it quotes the offending line)
_MERGE_TAG = "tag:yaml.org,2002:merge"


class _ConfigLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` for config files and overrides: it rejects a key given twice in one mapping (YAML
    keeps the last one silently), an alias that refers to a node containing it, and aliases that expand to
    more than ``MAX_ALIAS_NODES`` nodes; merge keys (``<<: *base``) work as in ``SafeLoader``.

    Aliases are counted while the document is composed, before anything is built: each node counts 1 and
    each alias the expanded size of the node it names."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._expanded = 0  # nodes composed so far, with every alias counted at its expanded size
        self._alias_nodes = 0  # of those, the nodes that aliases stand for
        self._anchor_sizes: dict[str, int] = {}  # anchor -> expanded size of its node, once composed

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            if event.anchor in self.anchors:  # an undefined one is left to SafeLoader's own error
                line = event.start_mark.line + 1
                size = self._anchor_sizes.get(event.anchor)
                if size is None:
                    raise ConfigError(
                        f"alias *{event.anchor[:40]} on line {line} is inside the node it names (a recursive "
                        "structure); a config holds plain values"
                    )
                self._expanded += size
                self._alias_nodes += size
                if self._alias_nodes > MAX_ALIAS_NODES:
                    raise ConfigError(
                        f"aliases expand to more than {MAX_ALIAS_NODES} YAML nodes (at *{event.anchor[:40]}, "
                        f"line {line}); write the values out instead of nesting aliases"
                    )
            return super().compose_node(parent, index)
        anchor = self.peek_event().anchor
        start = self._expanded
        self._expanded += 1
        node = super().compose_node(parent, index)
        if anchor is not None:
            self._anchor_sizes[anchor] = self._expanded - start
        return node

    def compose_mapping_node(self, anchor):
        node = super().compose_mapping_node(anchor)
        seen = set()
        for key_node, _ in node.value:
            # Merged keys may repeat the mapping's own (those win); only plain scalar keys are compared.
            if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == _MERGE_TAG:
                continue
            key = self.construct_object(key_node)
            try:
                duplicate = key in seen
                seen.add(key)
            except TypeError:  # an unhashable key: let SafeLoader report it
                continue
            if duplicate:
                raise ConfigError(f"key {show(key)} is given twice (line {key_node.start_mark.line + 1})")
        return node


def load_yaml(text: str) -> Any:
    """Parse one YAML document of a config (a file's text or an override's value) with plain values only
    (``yaml.SafeLoader``; merge keys allowed; a key given twice, a recursive alias or aliases expanding to
    more than ``MAX_ALIAS_NODES`` nodes refused).

    Raises:
        ConfigError: a key given twice, a recursive alias, too many aliased nodes.
        yaml.YAMLError (and RecursionError, ValueError on odd input): text that is not valid YAML.
    """
    return yaml.load(text, Loader=_ConfigLoader)


def read_yaml(path: str | Path) -> dict[str, Any]:
    """Read a config YAML file into a dict (empty file -> {}) with ``load_yaml``. Raises ConfigError naming
    the file."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    try:
        data = load_yaml(path.read_text()) or {}
    except ConfigError as e:
        raise ConfigError(f"config file {str(path)!r}: {e}") from None
    except Exception as e:  # PyYAML also raises RecursionError, ValueError, ... on odd input
        raise ConfigError(
            f"config file {str(path)!r} is not valid YAML: {type(e).__name__}: {str(e)[:_MAX_YAML_ERROR]}"
        ) from e
    if not isinstance(data, dict):
        raise ConfigError(
            f"config file {str(path)!r} must hold a mapping of key: value, got {type(data).__name__}"
        )
    return data


__all__ = ["MAX_ALIAS_NODES", "MAX_VALUE", "ConfigError", "load_yaml", "parse_overrides", "read_yaml", "show"]
