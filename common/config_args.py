"""Command-line options generated from the config dataclasses: one flag per field, so a new field is a
new flag without a CLI edit, and no table of flag -> field is kept by hand.

Why jsonargparse (not tyro): its resolver (the one behind ``ArgumentParser.add_class_arguments``) reads a
dataclass's fields with their types already resolved (inherited fields, postponed annotations, ``X |
None``, ``Literal`` choices, nested dataclasses), and its YAML loader reads ``lr: 1e-3`` as the number
PyYAML alone reads as a string. Both libraries would also build the parser; we keep argparse's parser
(:mod:`common.cli`) and its one-line errors and exit codes, which tyro's own parser and error screens
would replace, and take from jsonargparse what it reads. The help of a flag is its field's own
documentation: the class docstring's ``Attributes:`` entry, else the ``#`` comment beside or above the
field (jsonargparse reads docstrings only, and only with docstring-parser installed).

Names: a field's flag is its path in the config, dashed: ``--distill-epochs`` is ``distill.epochs``. A
nested config named in ``flatten`` lends its fields without its own name (simulate's ``--particles`` is
``search.particles``) unless an outer field already has that name (simulate's ``--device`` is the
clients' device, ``--aggregate-device`` the server's). A config field of a family (``search``: the
strategy picks the class) offers the union of the family's fields; the config refuses a field of
another member. Every flag defaults to None, "not given": the preset or ``--config`` file keeps its value;
``none`` sets an optional field to None. A field renamed (its class's ``renamed_keys``,
:mod:`common.configs`) leaves its old flag behind as a refusal: one line naming the new flag.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import re
import types
import typing
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jsonargparse._parameter_resolvers import get_signature_parameters

from common.cli import expert, renamed_option
from common.configs import renamed_keys
from common.errors import ConfigError

__all__ = ["NONE", "Flag", "add_config_args", "config_flags", "given_options", "given_table"]


class _NoneValue:
    """The value of ``--option none``: None set on purpose (a flag's own None means "not given")."""

    def __repr__(self) -> str:
        return "none"


NONE = _NoneValue()
_DEST = "config:"  # flag dests: no hand-declared option (--out, --seed of init) can collide with them


@dataclass(frozen=True)
class Flag:
    """One generated option: the field at ``path`` (in the command's config), its type and docs."""

    option: str
    path: tuple[str, ...]
    hint: Any  # the field's type, ``| None`` removed
    optional: bool  # the field takes None
    default: Any  # shown in --help; dataclasses.MISSING when there is none to show
    doc: str
    group: str  # the nested config it belongs to ("" for the command's own fields)
    off_note: str = ""  # "when fusion is set": the nested config is None by default
    old_options: tuple[str, ...] = ()  # the flags of the field's old names (refused, naming this one)

    @property
    def dest(self) -> str:
        return _DEST + ".".join(self.path)


# --- the fields' documentation -----------------------------------------------------------------------

_FIELD = re.compile(r"(\w+)\s*:\s*[^=#]")
_NAMES = re.compile(r"(\w+(?:\s*,\s*\w+)*)\s*:\s*(.*)")  # "lr, batch_size: Adam settings"


def _attributes_section(docstring: str) -> dict[str, str]:
    """``name: text`` entries of a Google-style ``Attributes:`` section (continuation lines joined)."""
    docs: dict[str, str] = {}
    lines = inspect.cleandoc(docstring).splitlines()
    try:
        start = next(i for i, line in enumerate(lines) if line.strip() == "Attributes:")
    except StopIteration:
        return docs
    current: list[str] = []  # the names of the entry being read ("lr, batch_size: ..." documents two)
    indent = None
    for line in lines[start + 1 :]:
        if not line.strip():
            continue
        width = len(line) - len(line.lstrip())
        if width == 0:
            break
        indent = width if indent is None else indent
        match = _NAMES.match(line.strip())
        if width == indent and match:
            current = [n.strip() for n in match.group(1).split(",")]
            for name in current:
                docs[name] = match.group(2).strip()
        elif width > indent:
            for name in current:
                docs[name] += " " + line.strip()
    return docs


def _comments(source: str) -> dict[str, str]:
    """Field name -> the ``#`` comment beside it, else the comment lines just above it."""
    lines = source.splitlines()
    start = next((i + 1 for i, line in enumerate(lines) if line.lstrip().startswith("class ")), len(lines))
    body = [line for line in lines[start:] if line.strip()]
    if not body:
        return {}
    indent = len(body[0]) - len(body[0].lstrip())
    docs: dict[str, str] = {}
    above: list[str] = []
    for line in lines[start:]:
        stripped = line.strip()
        width = len(line) - len(line.lstrip())
        if stripped.startswith("#") and width == indent:
            above.append(stripped.lstrip("#").strip())
            continue
        match = _FIELD.match(stripped) if width == indent else None
        if match and not stripped.startswith(("def ", "class ", "@")):
            beside = re.search(r"\s#\s(.*)$", stripped)
            text = beside.group(1).strip() if beside else " ".join(above)
            if text:
                docs[match.group(1)] = text
        above = []
    return docs


def field_docs(cls: type) -> dict[str, str]:
    """The documentation of every field of ``cls`` (inherited ones too), for ``--help``."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            source = inspect.getsource(klass)
        except (OSError, TypeError):  # no source (frozen app, interactive class): no help text
            source = ""
        docs |= _comments(source) | _attributes_section(klass.__doc__ or "")
    return docs


# --- fields -> flags -----------------------------------------------------------------------------------


def _strip_none(hint: Any) -> tuple[Any, bool]:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        members = [m for m in typing.get_args(hint) if m is not type(None)]
        optional = len(members) < len(typing.get_args(hint))
        if len(members) == 1:
            return members[0], optional
    return hint, False


def _field_default(f: dataclasses.Field[Any]) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def _is_config(hint: Any) -> bool:
    return isinstance(hint, type) and dataclasses.is_dataclass(hint)


def config_flags(
    classes: type | Sequence[type],
    *,
    flatten: Collection[str] = (),
    skip: Collection[str] = (),
    families: Mapping[str, Sequence[type]] | None = None,
) -> tuple[Flag, ...]:
    """The flags of a config class (or of the union of a family's classes), outer fields first.

    ``flatten``, ``skip`` and ``families`` name fields by their dotted path (``aggregate.seed``): nested
    configs whose fields take no prefix, fields with no flag (the CLI sets them itself: ``out_dir`` is
    ``--out``), and fields whose class a key picks (the union of the classes' fields is offered).
    """
    families = families or {}
    roots = (classes,) if isinstance(classes, type) else tuple(classes)
    flags: list[Flag] = []
    taken: set[str] = set()
    # breadth first, so an outer field claims its name before a flattened inner one
    queue: list[tuple[tuple[str, ...], tuple[str, ...], tuple[type, ...], Any, str]] = [
        ((), (), roots, None, "")
    ]
    while queue:
        path, prefix, owners, instance, off_note = queue.pop(0)
        seen: set[str] = set()
        docs: dict[str, str] = {}
        renamed: dict[str, list[str]] = {}  # new name -> its old names
        for owner in reversed(owners):
            docs |= field_docs(owner)
            for old, new in renamed_keys(owner).items():
                renamed.setdefault(new, []).append(old)
        for owner in owners:
            fields = {f.name: f for f in dataclasses.fields(owner)}
            for param in get_signature_parameters(owner):
                name = param.name
                if name in seen or name not in fields:
                    continue
                seen.add(name)
                here = (*path, name)
                key = ".".join(here)
                if key in skip:
                    continue
                hint, optional = _strip_none(param.annotation)
                if instance is not None and hasattr(instance, name):
                    default = getattr(instance, name)
                else:
                    default = _field_default(fields[name])
                if key in families or _is_config(hint):
                    members = tuple(families.get(key, (hint,)))
                    inner = prefix if key in flatten else (*prefix, name)
                    note = off_note or (f"when {name} is set" if default is None else "")
                    value = None if default is dataclasses.MISSING else default
                    queue.append((here, inner, members, value, note))
                    continue
                words = (*prefix, name)
                if _option(words) in taken:  # a flattened field whose name an outer one has: its full path
                    words = here
                option = _option(words)
                if option in taken:
                    raise ConfigError(
                        f"two config fields want the flag {option}, got the second at {key}; fix: rename "
                        "one, or do not flatten its config"
                    )
                taken.add(option)
                group = ".".join(path)
                old = tuple(_option((*words[:-1], old)) for old in sorted(renamed.get(name, ())))
                doc = docs.get(name, "")
                flags.append(Flag(option, here, hint, optional, default, doc, group, off_note, old))
    return tuple(flags)


def _option(words: Sequence[str]) -> str:
    """The flag of a field path's words: ``("distill", "epochs")`` -> ``--distill-epochs``."""
    return "--" + "-".join(words).replace("_", "-")


def _scalar(hint: Any) -> Callable[[str], Any]:
    if hint is bool:
        return _boolean
    if hint in (int, float, str, Path):
        return hint  # type: ignore[no-any-return]
    raise ConfigError(
        f"a config field of type {hint!r} has no command-line form; fix: give it a flag by hand"
    )


def _boolean(text: str) -> bool:
    words = {"true": True, "yes": True, "1": True, "false": False, "no": False, "0": False}
    if text.strip().lower() not in words:
        raise ValueError(text)
    return words[text.strip().lower()]


def _parser_of(flag: Flag) -> tuple[Callable[[str], Any], str]:
    """The argparse ``type`` of a flag (named for argparse's "invalid <name> value") and its metavar. A
    ``Literal`` field's choices are checked by the type, not by argparse's ``choices``, so ``none``
    passes where the field is optional."""
    hint = flag.hint
    choices: tuple[Any, ...] | None = None
    if typing.get_origin(hint) is typing.Literal:
        choices = typing.get_args(hint)
        convert: Callable[[str], Any] = type(choices[0])
        name, metavar = convert.__name__, "{" + ",".join(map(str, choices)) + "}"
    elif typing.get_origin(hint) is tuple:
        args = typing.get_args(hint)
        if len(args) != 2 or args[1] is not Ellipsis:
            raise ConfigError(
                f"field {'.'.join(flag.path)}: only tuple[X, ...] fields get a flag, got {hint!r}"
            )
        item = _scalar(args[0])

        def convert(text: str) -> Any:
            return tuple(item(v.strip()) for v in text.split(",") if v.strip())

        name, metavar = f"comma-separated {args[0].__name__}", "A,B,..."
    else:
        convert = _scalar(hint)
        name, metavar = convert.__name__, {int: "INT", float: "FLOAT", Path: "PATH"}.get(hint, "TEXT")

    def parse(text: str) -> Any:
        if text.strip().lower() == "none" and (flag.optional or typing.get_origin(hint) is tuple):
            return NONE if flag.optional else ()
        value = convert(text)
        if choices is not None and value not in choices:
            raise ValueError(text)
        return value

    parse.__name__ = name
    return parse, metavar


def _help(flag: Flag) -> str:
    parts = [flag.doc] if flag.doc else []
    if flag.default is not dataclasses.MISSING:
        shown = ",".join(map(str, flag.default)) if isinstance(flag.default, tuple) else flag.default
        where = f" {flag.off_note}" if flag.off_note else ""
        parts.append(f"(default{where}: {'none' if shown is None else shown})")
    return " ".join(parts).replace("%", "%%")  # argparse formats help with %


def add_config_args(
    parser: argparse.ArgumentParser,
    classes: type | Sequence[type],
    *,
    flatten: Collection[str] = (),
    skip: Collection[str] = (),
    families: Mapping[str, Sequence[type]] | None = None,
    groups: Mapping[str, Any] | None = None,
    common: Collection[str] | None = None,
) -> tuple[Flag, ...]:
    """Adds one option per field (see :func:`config_flags`) to ``parser``; returns the flags, which
    :func:`given_table` reads back.

    ``groups``: the argument group of each nested config (its dotted path, "" for the command's own
    fields), so a command orders its options by phase; a config not named gets a group of its own.
    ``common``: the fields (dotted paths) ``--help`` lists; the others are for experts, listed by
    ``--help-all`` (:func:`common.cli.expert`). None: every field is listed.
    """
    flags = config_flags(classes, flatten=flatten, skip=skip, families=families)
    if common is not None:
        unknown = sorted(set(common) - {".".join(flag.path) for flag in flags})
        if unknown:
            raise ConfigError(f"common options must name fields that have a flag, got {unknown}")
    targets: dict[str, Any] = dict(groups or {})
    for flag in flags:
        if flag.group not in targets:
            targets[flag.group] = parser.add_argument_group(f"{flag.group} options") if flag.group else parser
        if flag.hint is bool:
            kind: dict[str, Any] = {"action": argparse.BooleanOptionalAction}
        else:
            convert, metavar = _parser_of(flag)
            kind = {"type": convert, "metavar": metavar}
        action = targets[flag.group].add_argument(
            flag.option, dest=flag.dest, default=None, help=_help(flag), **kind
        )
        if common is not None and ".".join(flag.path) not in common:
            expert(action)
    for flag in flags:  # after every flag: an old name another field now has is that field's
        for old in flag.old_options:
            if old not in parser._option_string_actions:
                renamed_option(parser, old, flag.option)
    return flags


def given_table(args: argparse.Namespace, flags: Sequence[Flag]) -> dict[str, Any]:
    """The options given on the command line as a nested table of field values (``--distill-epochs 5``
    -> ``{"distill": {"epochs": 5}}``), for :func:`common.configs.config_from_dict` over a base."""
    table: dict[str, Any] = {}
    for flag in flags:
        value = getattr(args, flag.dest, None)
        if value is None:
            continue
        node = table
        for key in flag.path[:-1]:
            node = node.setdefault(key, {})
        node[flag.path[-1]] = None if value is NONE else value
    return table


def given_options(args: argparse.Namespace, flags: Sequence[Flag], under: tuple[str, ...]) -> list[str]:
    """The options given for fields under ``under`` (a nested config's path), as typed."""
    return [
        f.option for f in flags if f.path[: len(under)] == under and getattr(args, f.dest, None) is not None
    ]
