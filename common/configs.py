"""Configs from dicts and files: the inverse of a frozen config's ``to_dict``, so a run can be replayed
from the ``results.json`` it wrote (JSON, what machines write) or from a TOML or YAML file a person wrote.

One builder for every config: keys are checked against the dataclass's fields (an unknown key is refused
with the list of valid ones), values are brought back to the field's type where JSON and TOML lose it
(lists -> tuples, strings -> paths), and a nested table builds the nested config, over that field's
current value, so a partial table (``[aggregate.distill] epochs = 5``) changes only the keys it names.
The configs' own ``__post_init__`` validates what comes out. YAML is read by jsonargparse's loader (safe,
no tags; ``1e-3`` is a number, as in TOML and JSON, where PyYAML alone reads a string).

Renamed keys: a config class whose fields were renamed keeps the table ``renamed_keys`` (a ``ClassVar``,
old name -> new name). A file or a run's record that still holds an old name is refused with one line
naming the new one, not read under it (a key's meaning may have changed with its name); the generated
command-line options refuse the old flag the same way (:mod:`common.config_args`).
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import yaml
from jsonargparse import get_loader

from common.checks import check_tree, load_json, load_toml, read_regular_file
from common.errors import ConfigError

__all__ = [
    "MAX_CONFIG_BYTES",
    "MAX_CONFIG_VALUES",
    "Builder",
    "config_from_dict",
    "read_config_file",
    "refuse_renamed",
    "renamed_keys",
]

MAX_CONFIG_BYTES = 8 << 20  # a config a person writes is a few KB; a run's results.json tens of KB
MAX_CONFIG_VALUES = 100_000  # values in the parsed tree, counting every use of a YAML alias

T = TypeVar("T")

# builds one field from its table and the field's current value (a config of the same class, or None)
Builder = Callable[[Any, Any], Any]


def config_from_dict(
    cls: type[T],
    data: object,
    *,
    what: str,
    base: T | None = None,
    builders: Mapping[str, Builder] | None = None,
) -> T:
    """``cls`` built from ``data`` (a mapping of field names), over ``base`` when given (its values fill
    the keys ``data`` leaves out; else the fields' defaults do). A field named in ``builders`` is built
    by it (a family of configs picked by a key, e.g. the search strategy); a dataclass-typed field from
    a mapping is built by this function, recursively. ``what`` names the table in error messages."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"{what} must be a table of keys, got {type(data).__name__}: {data!r}")
    refuse_renamed(cls, data, what)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}  # type: ignore[arg-type]
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ConfigError(
            f"unknown keys {unknown} in {what}; valid keys are {sorted(fields)}; fix: remove or rename them"
        )
    hints = typing.get_type_hints(cls)
    values: dict[str, Any] = {} if base is None else {name: getattr(base, name) for name in fields}
    for name, value in data.items():
        current = getattr(base, name) if base is not None else _default(fields[name])
        if builders is not None and name in builders:
            values[name] = builders[name](value, current)
        else:
            values[name] = _convert(hints[name], value, current, f"{what}.{name}")
    missing = sorted(name for name, f in fields.items() if name not in values and _required(f))
    if missing:
        raise ConfigError(f"{what} needs the keys {missing}, got {sorted(data)}; fix: add them")
    return cls(**values)


def renamed_keys(cls: type) -> Mapping[str, str]:
    """The renamed fields of the config class ``cls``: old name -> new name (see the module docstring)."""
    table = getattr(cls, "renamed_keys", {})
    return table if isinstance(table, Mapping) else {}


def refuse_renamed(cls: type, data: Mapping[str, Any], what: str) -> None:
    """One line for the first key of ``data`` that ``cls`` renamed: the new name, and how to fix it."""
    renamed = renamed_keys(cls)
    for old in sorted(set(data) & set(renamed)):
        new = renamed[old]
        raise ConfigError(
            f"{what}: expected the key {new!r}, got {old!r}, its old name (renamed: one name per meaning "
            f"across the toolkit); fix: rename {old!r} to {new!r} (a run's record: there too, or rerun)"
        )


def _required(f: dataclasses.Field[Any]) -> bool:
    return f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING


def _default(f: dataclasses.Field[Any]) -> Any:
    """The field's default value (a fresh one from its factory), None when it has none."""
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


def _convert(hint: Any, value: Any, current: Any, what: str) -> Any:
    """``value`` as read from JSON or TOML, brought back to the type ``hint`` where those formats lose it;
    anything else is passed on for the config to validate."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        if value is None:
            return None
        members = [m for m in typing.get_args(hint) if m is not type(None)]
        if len(members) != 1:
            return value
        hint = members[0]
    if dataclasses.is_dataclass(hint) and isinstance(hint, type):
        if isinstance(value, hint):
            return value
        return config_from_dict(hint, value, what=what, base=current if isinstance(current, hint) else None)
    if typing.get_origin(hint) is tuple and isinstance(value, list):
        return tuple(value)
    if hint is Path and isinstance(value, str):
        return Path(value)
    return value


def read_config_file(path: str | Path) -> dict[str, Any]:
    """The config table of ``path``: a ``.toml`` or ``.yaml`` file a person wrote, or a ``.json`` file a
    run wrote (a ``results.json`` or ``report.json``: its ``config`` entry; or a bare config, e.g.
    ``--print-config``'s output). A regular file of at most :data:`MAX_CONFIG_BYTES` (a FIFO or
    ``/dev/zero`` is refused before it is read), UTF-8, and a tree bounded by
    :func:`common.checks.check_tree` before anything prints or walks it (a YAML alias bomb is a few
    hundred bytes that expand to billions of values)."""
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in (".toml", ".json", ".yaml", ".yml"):
        raise ConfigError(
            f"config file must end in .toml, .yaml, .yml or .json, got {str(path)!r}; fix: rename it "
            "or point at a run's results.json"
        )
    raw = read_regular_file(path, max_bytes=MAX_CONFIG_BYTES, what="config file")
    name = f"config file {str(path)!r}"
    if suffix == ".json":
        data: Any = load_json(raw, name, max_bytes=MAX_CONFIG_BYTES)
    else:
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as err:
            raise ConfigError(f"{name} must be UTF-8 text, got undecodable bytes ({err.reason})") from None
        if suffix == ".toml":
            data = load_toml(text, name, max_bytes=MAX_CONFIG_BYTES)
        else:
            try:
                data = get_loader("yaml")(text)
            except (yaml.YAMLError, RecursionError) as err:
                raise ConfigError(f"{name} does not parse: {str(err)[:300]}") from None
            check_tree(data, name, max_nodes=MAX_CONFIG_VALUES)
    if isinstance(data, dict) and isinstance(data.get("config"), dict):
        data = data["config"]
    if not isinstance(data, dict):
        raise ConfigError(f"{name} must hold a table of keys, got {type(data).__name__}")
    return data
