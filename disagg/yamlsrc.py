"""YAML loading that remembers where every value came from.

``load_yaml(path)`` returns a :class:`Node` tree: plain Python values plus, for
every mapping key and sequence item, the 1-based line it was written on. The
topology builder pops keys from these nodes so that every value is consumed
exactly once and leftovers are reported as unknown keys.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from disagg.errors import TopologyError


@dataclass
class Node:
    """A YAML value with its source position and dotted field path."""

    value: Any
    line: int
    path: str
    file: str
    children: dict[Any, Node] = field(default_factory=dict)
    items: list[Node] = field(default_factory=list)

    def error(self, message: str, *, path: str | None = None) -> TopologyError:
        """Build a TopologyError pointing at this node."""
        return TopologyError(self.file, self.line, path or self.path or "<top>", message)

    @property
    def is_mapping(self) -> bool:
        return isinstance(self.value, dict)

    @property
    def is_sequence(self) -> bool:
        return isinstance(self.value, list)


def _child_path(parent: str, key: Any) -> str:
    if isinstance(key, int):
        return f"{parent}[{key}]"
    return f"{parent}.{key}" if parent else str(key)


def _build(node: yaml.Node, path: str, file: str, loader: yaml.SafeLoader) -> Node:
    line = node.start_mark.line + 1
    if isinstance(node, yaml.MappingNode):
        children: dict[Any, Node] = {}
        for key_node, value_node in node.value:
            key = loader.construct_object(key_node, deep=True)
            if not isinstance(key, str):
                raise TopologyError(file, key_node.start_mark.line + 1, path or "<top>",
                                    f"keys must be strings, got {key!r}")
            if key in children:
                raise TopologyError(file, key_node.start_mark.line + 1, _child_path(path, key),
                                    "appears twice in the same mapping")
            child = _build(value_node, _child_path(path, key), file, loader)
            child.line = key_node.start_mark.line + 1
            children[key] = child
        return Node({k: v.value for k, v in children.items()}, line, path, file, children=children)
    if isinstance(node, yaml.SequenceNode):
        items = [_build(item, _child_path(path, i), file, loader) for i, item in enumerate(node.value)]
        return Node([i.value for i in items], line, path, file, items=items)
    return Node(loader.construct_object(node, deep=True), line, path, file)


def load_yaml(path: str | Path) -> Node:
    """Parse a YAML file into a :class:`Node` tree; errors name the file and line."""
    file = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError as exc:
        raise TopologyError(file, None, "", "file not found") from exc
    except OSError as exc:
        raise TopologyError(file, None, "", f"cannot read file: {exc.strerror or exc}") from exc
    return parse_yaml(text, file)


def parse_yaml(text: str, file: str = "<string>") -> Node:
    """Parse YAML text into a :class:`Node` tree."""
    loader = yaml.SafeLoader(text)
    try:
        root = loader.get_single_node()
        if root is None:
            raise TopologyError(file, 1, "", "the file is empty; expected a mapping of topology fields")
        return _build(root, "", file, loader)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = mark.line + 1 if mark is not None else None
        raise TopologyError(file, line, "", f"invalid YAML: {exc.problem or exc}") from exc
    except yaml.YAMLError as exc:
        raise TopologyError(file, None, "", f"invalid YAML: {exc}") from exc
    finally:
        loader.dispose()


class Fields:
    """Pops typed fields out of a mapping node; ``done()`` rejects leftovers.

    Every getter raises :class:`TopologyError` naming file, line and field path
    with what was expected.
    """

    def __init__(self, node: Node, what: str = "a mapping") -> None:
        if not node.is_mapping:
            raise node.error(f"expected {what}, got {_describe(node.value)}")
        self.node = node
        self._remaining = dict(node.children)
        self._known: list[str] = []

    def take(self, key: str) -> Node | None:
        """Remove and return the child node ``key`` (None when absent or null)."""
        self._known.append(key)
        child = self._remaining.pop(key, None)
        if child is None or child.value is None:
            return None
        return child

    def required(self, key: str) -> Node:
        """Like :meth:`take` but the key must be present and not null."""
        child = self.take(key)
        if child is None:
            typo = next((n for k, n in self._remaining.items() if did_you_mean(k, [key])), None)
            if typo is not None:  # report the misspelt key, not a missing one
                raise TopologyError(typo.file, typo.line, typo.path,
                                    "unknown field" + did_you_mean(typo.path.rsplit(".", 1)[-1], [key]))
            raise TopologyError(self.node.file, self.node.line, _child_path(self.node.path, key),
                                "is required but missing")
        return child

    def str(self, key: str, default: str | None = None, *, required: bool = False) -> str | None:
        child = self.required(key) if required else self.take(key)
        if child is None:
            return default
        if isinstance(child.value, bool) or not isinstance(child.value, (str, int, float)):
            raise child.error(f"expected a string, got {_describe(child.value)}")
        return str(child.value)

    def int(self, key: str, default: int | None = None, *, required: bool = False,
            minimum: int | None = None, maximum: int | None = None) -> int | None:
        child = self.required(key) if required else self.take(key)
        if child is None:
            return default
        return node_int(child, minimum=minimum, maximum=maximum)

    def float(self, key: str, default: float | None = None, *, minimum: float = 0.0) -> float | None:
        child = self.take(key)
        if child is None:
            return default
        if isinstance(child.value, bool) or not isinstance(child.value, (int, float)):
            raise child.error(f"expected a number, got {_describe(child.value)}")
        if child.value <= minimum:
            raise child.error(f"expected a number greater than {minimum:g}, got {child.value}")
        return float(child.value)

    def bool(self, key: str, default: bool) -> bool:
        child = self.take(key)
        if child is None:
            return default
        if not isinstance(child.value, bool):
            raise child.error(f"expected true or false, got {_describe(child.value)}")
        return child.value

    def choice(self, key: str, choices: tuple[str, ...], default: str | None = None) -> str:
        child = self.take(key) if default is not None else self.required(key)
        if child is None:
            assert default is not None
            return default
        value = child.value
        if not isinstance(value, str) or value not in choices:
            raise child.error(f"expected one of {', '.join(choices)}, got {value!r}"
                              + did_you_mean(str(value), choices))
        return value

    def str_list(self, key: str) -> tuple[str, ...]:
        child = self.take(key)
        if child is None:
            return ()
        if not child.is_sequence:
            raise child.error(f"expected a list of strings, got {_describe(child.value)}")
        out = []
        for item in child.items:
            if isinstance(item.value, bool) or not isinstance(item.value, (str, int, float)):
                raise item.error(f"expected a string, got {_describe(item.value)}")
            out.append(str(item.value))
        return tuple(out)

    def str_map(self, key: str) -> dict[str, str]:
        child = self.take(key)
        if child is None:
            return {}
        if not child.is_mapping:
            raise child.error(f"expected a mapping of names to strings, got {_describe(child.value)}")
        out = {}
        for name, item in child.children.items():
            if isinstance(item.value, (dict, list)) or item.value is None:
                raise item.error(f"expected a string, got {_describe(item.value)}")
            value = item.value
            out[name] = ("true" if value else "false") if isinstance(value, bool) else str(value)
        return out

    def done(self) -> None:
        """Raise for the first key nobody asked for (with a did-you-mean hint)."""
        for key, child in self._remaining.items():
            raise TopologyError(child.file, child.line, child.path,
                                "unknown field" + did_you_mean(key, self._known)
                                + (f"; known fields here: {', '.join(sorted(set(self._known)))}"
                                   if self._known else ""))


def node_int(node: Node, *, minimum: int | None = None, maximum: int | None = None) -> int:
    """The node's value as an int within [minimum, maximum], else a TopologyError."""
    if isinstance(node.value, bool) or not isinstance(node.value, int):
        raise node.error(f"expected an integer, got {_describe(node.value)}")
    if minimum is not None and node.value < minimum:
        raise node.error(f"expected an integer >= {minimum}, got {node.value}")
    if maximum is not None and node.value > maximum:
        raise node.error(f"expected an integer <= {maximum}, got {node.value}")
    return node.value


def did_you_mean(word: str, candidates: Any) -> str:
    """A ``" (did you mean 'x'?)"`` suffix, or "" when nothing is close."""
    close = difflib.get_close_matches(word, list(candidates), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _describe(value: Any) -> str:
    if value is None:
        return "nothing"
    if isinstance(value, bool):
        return f"a boolean ({str(value).lower()})"
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, str):
        return f"the string {value!r}"
    return f"{type(value).__name__} {value!r}"
