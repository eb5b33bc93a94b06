"""One declaration per proxy setting: each field of :class:`disagg.proxy.config.ProxyConfig`
(and of the config classes it holds) says in its ``metadata`` how ``disagg proxy`` spells it
(:func:`flag`), and everything else follows from that one place:

- :func:`add_arguments`: the ``argparse`` arguments (``disagg.commands.proxy`` calls it);
- :func:`to_argv`: the words that rebuild a config, every setting that differs from its
  default (``ProxyConfig.to_argv``: the command ``disagg up`` starts the proxy with and
  ``disagg check`` prints);
- :func:`from_args`: the config the parsed arguments describe (``disagg.commands.proxy``);
  the config class's ``__post_init__`` validates it.

A field without a flag holds a nested config class (timeouts, routing): its fields have theirs.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import types
import typing
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

#: the key of a field's ``metadata`` that holds its :class:`Flag`
FLAG = "disagg.flag"

#: how many words a flag takes: one value; ``many`` (``--decode URL [URL ...]``); ``each`` (repeatable,
#: one item per use); ``switch`` (present or not)
ARITIES = ("one", "many", "each", "switch")


@dataclass(frozen=True)
class Flag:
    """How one setting is spelled on the command line.

    ``parse``: argparse's ``type`` for one word (default: the field's own type, int, float or
    str); ``convert``: the parsed value -> the field's value, after argparse (for checks whose
    errors are the config's own); ``show``: one value or item -> its word (default ``str``, a
    float as ``repr(float(v))``). ``env``: a key: read from this environment variable when the
    flag is absent, and left out of :func:`to_argv` with ``keys=False``.
    """

    name: str
    help: str | None = None
    metavar: str | None = None
    aliases: tuple[str, ...] = ()
    choices: tuple[str, ...] | None = None
    arity: str = ""     # "" = from the field's type: bool -> switch, tuple -> many, else one
    parse: Callable[[str], Any] | None = None
    convert: Callable[[Any], Any] | None = None
    show: Callable[[Any], str] | None = None
    env: str | None = None

    @property
    def dest(self) -> str:
        """The attribute of the parsed arguments (argparse's own name for the flag)."""
        return self.name.lstrip("-").replace("-", "_")


def flag(name: str, *, default: Any = dataclasses.MISSING, repr: bool = True,
         **spec: Any) -> Any:
    """A dataclass field spelled ``name`` on the command line (``spec``: :class:`Flag`'s fields).
    Without ``default`` the field, and the flag, are required."""
    return dataclasses.field(default=default, repr=repr, metadata={FLAG: Flag(name, **spec)})


@dataclass(frozen=True)
class _Setting:
    """One flagged field of a config class, with what its type says."""

    field: dataclasses.Field[Any]
    flag: Flag
    base: type            # the field's type without ``| None`` (its items' type for a tuple)
    arity: str

    @property
    def required(self) -> bool:
        return self.field.default is dataclasses.MISSING and self.field.default_factory is dataclasses.MISSING

    @property
    def default(self) -> Any:
        if self.field.default_factory is not dataclasses.MISSING:
            return self.field.default_factory()
        return self.field.default

    def word(self, value: Any) -> str:
        if self.flag.show is not None:
            return self.flag.show(value)
        return repr(float(value)) if self.base is float else str(value)


def _strip_none(hint: Any) -> Any:
    """``float | None`` -> ``float``."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return args[0] if len(args) == 1 else hint
    return hint


def _walk(cls: type) -> Iterator[tuple[dataclasses.Field[Any], Any]]:
    """Each field of the dataclass ``cls`` with its resolved type."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        yield f, _strip_none(hints[f.name])


def settings(cls: type) -> Iterator[_Setting]:
    """The flagged fields of ``cls`` and of the config classes it holds, in declaration order."""
    for f, hint in _walk(cls):
        if FLAG in f.metadata:
            yield _setting(cls, f, hint)
        elif dataclasses.is_dataclass(hint) and isinstance(hint, type):
            yield from settings(hint)


def _setting(cls: type, f: dataclasses.Field[Any], hint: Any) -> _Setting:
    """The flagged field ``f`` of ``cls``, whose type is ``hint``."""
    spec: Flag = f.metadata[FLAG]
    origin = typing.get_origin(hint)
    base: Any = typing.get_args(hint)[0] if origin is tuple else hint
    arity = spec.arity or ("switch" if hint is bool else "many" if origin is tuple else "one")
    if arity not in ARITIES:
        raise ValueError(f"{cls.__name__}.{f.name}: arity {arity!r} is not one of {', '.join(ARITIES)}")
    return _Setting(f, spec, base if isinstance(base, type) else str, arity)


def add_arguments(parser: argparse.ArgumentParser, cls: type) -> None:
    """Add an argument to ``parser`` for every flagged field of ``cls`` (nested ones included)."""
    for s in settings(cls):
        spec = s.flag
        kwargs: dict[str, Any] = {"dest": spec.dest, "help": spec.help}
        if s.arity == "switch":
            parser.add_argument(spec.name, *spec.aliases, action="store_true", **kwargs)
            continue
        kwargs["type"] = spec.parse or (s.base if s.base in (int, float) else str)
        if spec.metavar:
            kwargs["metavar"] = spec.metavar
        if spec.choices is not None:
            kwargs["choices"] = spec.choices
        if s.arity == "many":
            kwargs["nargs"] = "+"
        if s.arity == "each":
            kwargs["action"] = "append"
        if s.required:
            kwargs["required"] = True
        else:
            default = s.default
            kwargs["default"] = list(default) if s.arity in ("many", "each") else default
        parser.add_argument(spec.name, *spec.aliases, **kwargs)


def from_args(cls: type, args: argparse.Namespace) -> Any:
    """The ``cls`` (a config class) that ``args``, parsed by a parser :func:`add_arguments` made,
    describes."""
    values: dict[str, Any] = {}
    for f, hint in _walk(cls):
        spec = f.metadata.get(FLAG)
        if spec is None:
            if dataclasses.is_dataclass(hint) and isinstance(hint, type):
                values[f.name] = from_args(hint, args)
            continue
        value = getattr(args, spec.dest)
        if spec.convert is not None:
            value = spec.convert(value)
        elif isinstance(value, list):
            value = tuple(value)
        if spec.env is not None:
            value = value or os.environ.get(spec.env) or None
        values[f.name] = value
    return cls(**values)


def to_argv(config: Any, *, keys: bool = True) -> list[str]:
    """The words that rebuild ``config`` (a config class instance) through :func:`add_arguments`'s
    parser and :func:`from_args`: each setting that differs from its default (a required one
    always). ``keys=False`` leaves out the settings that have an environment variable (keys)."""
    words: list[str] = []
    for f, hint in _walk(type(config)):
        value = getattr(config, f.name)
        spec = f.metadata.get(FLAG)
        if spec is None:
            if dataclasses.is_dataclass(hint):
                words += to_argv(value, keys=keys)
            continue
        if spec.env is not None and not keys:
            continue
        s = _setting(type(config), f, hint)
        if s.required or value != s.default:
            words += _words(s, value)
    return words


def _words(s: _Setting, value: Any) -> list[str]:
    """The words of one setting's value."""
    name = s.flag.name
    if s.arity == "switch":
        return [name] if value else []
    if s.arity == "many":
        return [name, *(s.word(v) for v in value)]
    if s.arity == "each":
        return [w for item in value for w in (name, s.word(item))]
    return [name, s.word(value)]
