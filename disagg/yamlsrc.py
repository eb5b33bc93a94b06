"""YAML loading that remembers where every value came from.

``load_yaml(path)`` returns a :class:`Node` tree: plain Python values plus, for
every mapping key and sequence item, the 1-based line it was written on. The
topology builder pops keys from these nodes so that every value is consumed
exactly once and leftovers are reported as unknown keys.

A topology file may come from someone else, so loading is bounded: a file over
:data:`MAX_FILE_BYTES`, nesting deeper than :data:`MAX_DEPTH`, more than
:data:`MAX_ALIAS_USES` alias expansions or :data:`MAX_NODES` values after
expansion (the "billion laughs" file), and an alias inside the value it names
(``&a [*a]``) are refused with ``file:line: message`` before anything is built
that grows with the expansion. Aliases are kept apart from the values they
name while composing (:class:`_Alias`), so every refusal names the line of the
alias that crossed the limit.
"""

from __future__ import annotations

import builtins
import difflib
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import yaml
from yaml.composer import Composer
from yaml.constructor import SafeConstructor
from yaml.resolver import Resolver

from disagg.errors import TopologyError

try:  # libyaml's scanner and parser (about 10x faster); our own composer either way
    from yaml._yaml import CParser as _Parser
    _FAST = True
except ImportError:  # pragma: no cover - PyYAML built without libyaml
    _FAST = False
if TYPE_CHECKING:
    from yaml._yaml import Mark as _CMark  # the marks on libyaml's events (same fields as yaml.Mark)

#: a topology is a few KB; a bigger file is refused before it is parsed
MAX_FILE_BYTES = 1 << 20
#: mappings and lists nested deeper than this are refused (a topology nests 5 levels)
MAX_DEPTH = 64
#: alias uses after expansion (``*name`` inside values that are themselves aliased count each time)
MAX_ALIAS_USES = 1000
#: values (scalars, mappings, lists) in the expanded tree
MAX_NODES = 100_000


class _LimitError(yaml.MarkedYAMLError):
    """A loading limit was crossed (carries the mark of where)."""


def _mark(mark: yaml.Mark | _CMark | None) -> yaml.Mark | None:
    """libyaml's mark as a yaml.Mark: the same fields. The stubs admit only yaml.Mark on nodes and
    errors, though PyYAML puts libyaml's marks there as well."""
    return cast("yaml.Mark | None", mark)


class _Alias(yaml.Node):
    """An alias use (``*name``) as written: the node it names and where the alias stands."""

    id = "alias"

    def __init__(self, target: yaml.Node, anchor: str, start_mark: yaml.Mark | _CMark | None,
                 end_mark: yaml.Mark | _CMark | None) -> None:
        # an alias has no tag (PyYAML's nodes want a str; nothing reads it)
        super().__init__("", target, _mark(start_mark), _mark(end_mark))
        self.anchor = anchor


class _BoundedComposer(Composer):
    """PyYAML's composer, with aliases kept as :class:`_Alias` and the depth and node count bounded."""

    def __init__(self) -> None:
        super().__init__()
        self._depth = 0
        self._composed = 0

    if TYPE_CHECKING:
        # From the parser this composer is mixed with (_Loader); there is an event whenever
        # compose_node runs (the composer checks first).
        def peek_event(self) -> yaml.Event: ...

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node | None:
        event = self.peek_event()
        self._composed += 1
        if self._composed > MAX_NODES:
            raise _LimitError(None, None, f"more than {MAX_NODES} values in one file", _mark(event.start_mark))
        if isinstance(event, yaml.AliasEvent):
            target = super().compose_node(parent, index)
            assert target is not None  # an alias names a composed node (an unknown anchor raises)
            return _Alias(target, str(event.anchor), event.start_mark, event.end_mark)
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                raise _LimitError(None, None, f"nested deeper than {MAX_DEPTH} levels", _mark(event.start_mark))
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


if _FAST:
    class _Loader(_BoundedComposer, _Parser, SafeConstructor, Resolver):
        def __init__(self, stream: str) -> None:
            _Parser.__init__(self, stream)
            _BoundedComposer.__init__(self)
            SafeConstructor.__init__(self)
            Resolver.__init__(self)
else:  # pragma: no cover
    from yaml.parser import Parser
    from yaml.reader import Reader
    from yaml.scanner import Scanner

    # the same loader where PyYAML lacks libyaml: a conditional second definition of one class
    class _Loader(_BoundedComposer, Reader, Scanner, Parser, SafeConstructor, Resolver):  # type: ignore[no-redef]
        def __init__(self, stream: str) -> None:
            Reader.__init__(self, stream)
            Scanner.__init__(self)
            Parser.__init__(self)
            _BoundedComposer.__init__(self)
            SafeConstructor.__init__(self)
            Resolver.__init__(self)


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


class _Builder:
    """Turns a composed YAML graph into a :class:`Node` tree, expanding aliases within the limits."""

    def __init__(self, file: str, loader: _Loader) -> None:
        self.file = file
        self.loader = loader
        self.nodes = 0
        self.alias_uses = 0
        self._open: set[int] = set()   # ids of the collections being built (the path from the root)

    def fail(self, mark: yaml.Mark, path: str, message: str) -> TopologyError:
        return TopologyError(self.file, mark.line + 1, path or "<top>", message)

    def resolve(self, node: yaml.Node, path: str) -> yaml.Node:
        """The node an alias names (counting the use), or ``node`` itself."""
        while isinstance(node, _Alias):
            self.alias_uses += 1
            if self.alias_uses > MAX_ALIAS_USES:
                raise self.fail(node.start_mark, path,
                                f"alias *{node.anchor}: aliases expand more than {MAX_ALIAS_USES} times "
                                "(nested aliases, as in a \"billion laughs\" file); a topology needs a few")
            if id(node.value) in self._open:
                raise self.fail(node.start_mark, path,
                                f"alias *{node.anchor} refers to a value that contains it (a recursive alias)")
            node = node.value
        return node

    def build(self, node: yaml.Node, path: str, depth: int = 0) -> Node:
        mark = node.start_mark
        node = self.resolve(node, path)
        self.nodes += 1
        if self.nodes > MAX_NODES:
            raise self.fail(mark, path, f"aliases expand to more than {MAX_NODES} values; a topology has a few dozen")
        if depth > MAX_DEPTH:
            raise self.fail(mark, path, f"aliases nest values deeper than {MAX_DEPTH} levels")
        line = node.start_mark.line + 1
        if isinstance(node, yaml.ScalarNode):
            return Node(self.loader.construct_object(node, deep=True), line, path, self.file)
        self._open.add(id(node))
        try:
            if isinstance(node, yaml.MappingNode):
                return self._mapping(node, path, depth, line)
            items = [self.build(item, _child_path(path, i), depth + 1) for i, item in enumerate(node.value)]
            return Node([i.value for i in items], line, path, self.file, items=items)
        finally:
            self._open.discard(id(node))

    def _mapping(self, node: yaml.MappingNode, path: str, depth: int, line: int) -> Node:
        children: dict[Any, Node] = {}
        for key_node, value_node in node.value:
            key_line = key_node.start_mark.line + 1
            resolved = self.resolve(key_node, path)
            key = (self.loader.construct_object(resolved, deep=True)
                   if isinstance(resolved, yaml.ScalarNode) else resolved.value)
            if not isinstance(key, str):
                shown = "a mapping" if isinstance(resolved, yaml.MappingNode) else (
                    "a list" if isinstance(resolved, yaml.SequenceNode) else repr(key))
                raise TopologyError(self.file, key_line, path or "<top>", f"keys must be strings, got {shown}")
            if key in children:
                raise TopologyError(self.file, key_line, _child_path(path, key), "appears twice in the same mapping")
            child = self.build(value_node, _child_path(path, key), depth + 1)
            child.line = key_line
            children[key] = child
        return Node({k: v.value for k, v in children.items()}, line, path, self.file, children=children)


def load_yaml(path: str | Path) -> Node:
    """Parse a YAML file into a :class:`Node` tree; errors name the file and line."""
    file = str(path)
    try:
        with open(path, "rb") as fh:
            data = fh.read(MAX_FILE_BYTES + 1)  # never more: the file may be huge (or /dev/zero)
    except FileNotFoundError as exc:
        raise TopologyError(file, None, "", "file not found") from exc
    except OSError as exc:
        raise TopologyError(file, None, "", f"cannot read file: {exc.strerror or exc}") from exc
    if len(data) > MAX_FILE_BYTES:
        raise _too_big(file, data.count(b"\n", 0, MAX_FILE_BYTES) + 1)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise TopologyError(file, data.count(b"\n", 0, exc.start) + 1, "",
                            f"not UTF-8 text (byte {exc.start}: {exc.reason})") from exc
    return parse_yaml(text, file)


def _too_big(file: str, line: int) -> TopologyError:
    return TopologyError(file, line, "", f"the file passes {MAX_FILE_BYTES // (1 << 20)} MiB here, "
                                         "the limit for a topology file (a topology is a few KB)")


def parse_yaml(text: str, file: str = "<string>") -> Node:
    """Parse YAML text into a :class:`Node` tree (within the limits in this module's docstring)."""
    if len(text) > MAX_FILE_BYTES or len(text.encode("utf-8", "surrogatepass")) > MAX_FILE_BYTES:
        raise _too_big(file, text.encode("utf-8", "surrogatepass").count(b"\n", 0, MAX_FILE_BYTES) + 1)
    loader = _Loader(text)
    try:
        root = loader.get_single_node()
        if root is None:
            raise TopologyError(file, 1, "", "the file is empty; expected a mapping of topology fields")
        return _Builder(file, loader).build(root, "")
    except _LimitError as exc:
        mark = exc.problem_mark
        raise TopologyError(file, mark.line + 1 if mark is not None else None, "", str(exc.problem)) from None
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = mark.line + 1 if mark is not None else None
        raise TopologyError(file, line, "", f"invalid YAML: {exc.problem or exc}") from exc
    except yaml.YAMLError as exc:
        raise TopologyError(file, None, "", f"invalid YAML: {exc}") from exc
    except RecursionError:  # not reachable within MAX_DEPTH; a last guard against a traceback
        raise TopologyError(file, None, "", f"nested too deeply (the limit is {MAX_DEPTH} levels)") from None
    finally:
        loader.dispose()


class Fields:
    """Pops typed fields out of a mapping node; ``done()`` rejects leftovers.

    (The getters are named after the types they return, so signatures below
    ``str()`` spell the type ``builtins.str``.)

    Every getter raises :class:`TopologyError` naming file, line and field path
    with what was expected.
    """

    def __init__(self, node: Node, what: str = "a mapping") -> None:
        if not node.is_mapping:
            raise node.error(f"expected {what}, got {describe(node.value)}")
        self.node = node
        self._remaining: dict[str, Node] = dict(node.children)
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
            raise child.error(f"expected a string, got {describe(child.value)}")
        return str(child.value)

    def int(self, key: builtins.str, default: int | None = None, *, required: bool = False,
            minimum: int | None = None, maximum: int | None = None) -> int | None:
        child = self.required(key) if required else self.take(key)
        if child is None:
            return default
        return node_int(child, minimum=minimum, maximum=maximum)

    def float(self, key: builtins.str, default: float | None = None, *, above: float = 0.0) -> float | None:
        child = self.take(key)
        if child is None:
            return default
        if isinstance(child.value, bool) or not isinstance(child.value, (int, float)):
            raise child.error(f"expected a number, got {describe(child.value)}")
        if child.value <= above:
            raise child.error(f"expected a number greater than {above:g}, got {child.value}")
        return float(child.value)

    def bool(self, key: builtins.str, default: bool) -> bool:
        child = self.take(key)
        if child is None:
            return default
        if not isinstance(child.value, bool):
            raise child.error(f"expected true or false, got {describe(child.value)}")
        return child.value

    def choice(self, key: builtins.str, choices: tuple[builtins.str, ...],
               default: builtins.str | None = None) -> builtins.str:
        child = self.take(key) if default is not None else self.required(key)
        if child is None:
            assert default is not None
            return default
        value = child.value
        if not isinstance(value, str) or value not in choices:
            raise child.error(f"expected one of {', '.join(choices)}, got {value!r}"
                              + did_you_mean(str(value), choices))
        return value

    def str_list(self, key: builtins.str) -> tuple[builtins.str, ...]:
        child = self.take(key)
        if child is None:
            return ()
        if not child.is_sequence:
            raise child.error(f"expected a list of strings, got {describe(child.value)}")
        out = []
        for item in child.items:
            if isinstance(item.value, bool) or not isinstance(item.value, (str, int, float)):
                raise item.error(f"expected a string, got {describe(item.value)}")
            out.append(str(item.value))
        return tuple(out)

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
        raise node.error(f"expected an integer, got {describe(node.value)}")
    if minimum is not None and node.value < minimum:
        raise node.error(f"expected an integer >= {minimum}, got {node.value}")
    if maximum is not None and node.value > maximum:
        raise node.error(f"expected an integer <= {maximum}, got {node.value}")
    return node.value


def did_you_mean(word: str, candidates: Any) -> str:
    """A ``" (did you mean 'x'?)"`` suffix, or "" when nothing is close."""
    close = difflib.get_close_matches(word, list(candidates), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def describe(value: Any) -> str:
    """A value as an error message names it: "a list", "the string 'x'", "int 3"."""
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
