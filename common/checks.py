"""Validators shared by every frozen config and wire reader, the output-path checks (the CLIs run them at
parse time, before any work), and the one way to build a config from a preset.

Configs validate themselves at creation (``__post_init__``) so a bad value fails where it was written, not
deep inside a training loop. These helpers keep the wording of those errors the same across the toolkit.
"""

from __future__ import annotations

import dataclasses
import json
import math
import operator
import os
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

from common import toml
from common.errors import ConfigError, ToolkitError

__all__ = [
    "check_input_shape",
    "check_int",
    "check_ints",
    "check_number",
    "check_output_dir",
    "check_output_file",
    "check_real_dir",
    "check_str",
    "check_tree",
    "differences",
    "from_preset",
    "is_int",
    "is_number",
    "load_json",
    "load_toml",
    "make_real_dir",
    "read_regular_file",
]

T = TypeVar("T")
_FLOAT_MAX = 1.7976931348623157e308  # an int past it passes is_number but cannot be a float


def differences(recorded: object, wanted: object, prefix: str = "") -> list[str]:
    """Dotted keys whose values differ between two JSON objects (a key one of them lacks differs too), so
    a refusal to reuse an earlier run's files can name what changed instead of just saying "stale"."""
    if isinstance(recorded, dict) and isinstance(wanted, dict):
        keys = sorted(set(recorded) | set(wanted))
        return [d for k in keys for d in differences(recorded.get(k), wanted.get(k), f"{prefix}{k}.")]
    return [] if recorded == wanted else [prefix.rstrip(".")]


def is_number(value: object) -> bool:
    """A finite int or float, not a bool (an int is finite at any size: ``math.isfinite`` would raise
    OverflowError on one past float range)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    return isinstance(value, int) or math.isfinite(value)


def is_int(value: object) -> bool:
    """A builtin int, not a bool (``True == 1`` must not pass for a count or a version)."""
    return isinstance(value, int) and not isinstance(value, bool)


def check_int(
    name: str,
    value: object,
    low: int,
    high: int | None = None,
    *,
    error: type[ToolkitError] = ConfigError,
) -> int:
    """``value`` as an int in [low, high] (numpy integers accepted, bools refused), else ``error``."""
    try:
        number = None if isinstance(value, bool) else operator.index(value)  # type: ignore[arg-type]
    except TypeError:  # floats, strings, None
        number = None
    if number is None or number < low or (high is not None and number > high):
        bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise error(f"{name} must be an integer {bound}, got {value!r}")
    return number


def check_ints(
    name: str,
    value: object,
    low: int,
    high: int | None = None,
    *,
    max_length: int,
    error: type[ToolkitError] = ConfigError,
) -> tuple[int, ...]:
    """``value`` (a list or tuple, at most ``max_length`` long) as a tuple of ints in [low, high]."""
    if not isinstance(value, list | tuple):
        raise error(f"{name} must be a list of integers, got {type(value).__name__}")
    if len(value) > max_length:
        raise error(f"{name} must have at most {max_length} entries, got {len(value)}")
    return tuple(check_int(f"{name}[{i}]", v, low, high, error=error) for i, v in enumerate(value))


def check_input_shape(
    name: str,
    value: object,
    *,
    max_channels: int,
    max_elements: int,
    error: type[ToolkitError] = ConfigError,
) -> tuple[int, int, int]:
    """``value`` as (C, H, W): three ints >= 1, C <= ``max_channels`` and C * H * W <= ``max_elements``.

    Bounded before anything is allocated from it: one sample of this shape is what every model built
    from a manifest runs on.
    """
    shape = check_ints(name, value, 1, max_elements, max_length=3, error=error)
    if len(shape) != 3 or shape[0] > max_channels or math.prod(shape) > max_elements:
        raise error(
            f"{name} must be three integers (C, H, W) >= 1 with C <= {max_channels} and "
            f"C * H * W <= {max_elements}, got {value!r}"
        )
    return shape  # type: ignore[return-value]


def check_str(name: str, value: object, *, max_bytes: int, error: type[ToolkitError] = ConfigError) -> str:
    """``value`` as a non-empty str of at most ``max_bytes`` UTF-8 bytes."""
    if not isinstance(value, str) or not value or len(value.encode("utf-8")) > max_bytes:
        shown = value[:80] + "..." if isinstance(value, str) and len(value) > 80 else value
        raise error(f"{name} must be a non-empty str of at most {max_bytes} bytes, got {shown!r}")
    return value


def check_number(
    name: str, value: object, *, positive: bool = False, error: type[ToolkitError] = ConfigError
) -> float:
    """``value`` as a finite number >= 0 (> 0 when ``positive``), else ``error``."""
    if not is_number(value) or not 0 <= value <= _FLOAT_MAX or (positive and value == 0):  # type: ignore[operator]
        raise error(f"{name} must be a finite number {'> 0' if positive else '>= 0'}, got {value!r}")
    return float(value)  # type: ignore[arg-type]


def check_output_dir(path: str | Path, *, what: str = "output directory") -> Path:
    """``path`` as a directory to write into (it may not exist yet): ConfigError, before any work, when it
    or one of its parents is an existing file, where ``mkdir`` would raise FileExistsError at the end."""
    path = Path(path)
    blocker = next((p for p in (path, *path.parents) if p.exists() and not p.is_dir()), None)
    if blocker == path:
        raise ConfigError(
            f"{what} must be a directory, got {str(path)!r}, an existing file; "
            "fix: choose another directory or remove the file"
        )
    if blocker is not None:
        raise ConfigError(
            f"{what} {str(path)!r} cannot be created: {str(blocker)!r} is an existing file, not a "
            "directory; fix: choose another path"
        )
    return path


def check_output_file(path: str | Path, *, what: str = "output file") -> Path:
    """``path`` as a file to (over)write: ConfigError when it is an existing directory or a parent of it
    is an existing file."""
    path = Path(path)
    if path.is_dir():
        raise ConfigError(
            f"{what} must be a file path, got {str(path)!r}, an existing directory; "
            "fix: name a file, e.g. one inside that directory"
        )
    blocker = next((p for p in path.parents if p.exists() and not p.is_dir()), None)
    if blocker is not None:
        raise ConfigError(
            f"{what} {str(path)!r} cannot be written: {str(blocker)!r} is an existing file, not a "
            "directory; fix: choose another path"
        )
    return path


def from_preset(
    cls: type[T], presets: Mapping[str, Mapping[str, Any]], name: str, what: str, **overrides: Any
) -> T:
    """``cls`` built from ``presets[name]`` with keyword ``overrides``; unknown names or fields are refused.

    Preset names match case-insensitively, ignoring ``-`` and ``_`` (``fashion-mnist`` == ``fashionmnist``).
    """
    key = str(name).lower().replace("-", "").replace("_", "")
    by_key = {k.lower().replace("-", "").replace("_", ""): k for k in presets}
    if key not in by_key:
        raise ConfigError(f"unknown {what} preset {name!r}; expected one of {sorted(presets)}")
    valid = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(overrides) - valid)
    if unknown:
        raise ConfigError(f"unknown {what} options {unknown}; valid options are {sorted(valid)}")
    return cls(**{**presets[by_key[key]], **overrides})


# --- untrusted bytes: one bounded walk, one bounded JSON decode, one bounded file read --------------------

MAX_DEPTH = 32  # nesting of any decoded file: every format of the toolkit is a few levels deep
MAX_INT_DIGITS = 20  # a 64-bit integer's decimal digits, sign excluded
_INT_LOW, _INT_HIGH = -(2**63), 2**64 - 1


def check_tree(
    value: object,
    name: str,
    *,
    max_depth: int = MAX_DEPTH,
    max_nodes: int = 1 << 20,
    error: type[ToolkitError] = ConfigError,
) -> None:
    """Refuse a decoded tree (maps, lists, scalars) nested deeper than ``max_depth``, with more than
    ``max_nodes`` entries (counting a shared container once per use: a YAML alias bomb), a map key that
    is not a str, or an int outside 64 bits. Iterative, so no depth reaches the interpreter's stack, and
    run before anything sorts, hashes or prints the tree (those recurse, or compare mixed key types)."""
    stack: list[tuple[object, int]] = [(value, 0)]
    nodes = 0
    while stack:
        item, depth = stack.pop()
        nodes += 1
        if nodes > max_nodes:
            raise error(f"{name} must hold at most {max_nodes} values, got more; fix: send a smaller file")
        if isinstance(item, dict):
            bad = next((k for k in item if not isinstance(k, str)), None)
            if bad is not None:
                raise error(
                    f"{name}: every map key must be a str, got a {type(bad).__name__} key "
                    f"{repr(bad)[:40]}; the file was not written by this toolkit"
                )
            children: Any = item.values()
        elif isinstance(item, list | tuple):
            children = item
        else:
            if is_int(item) and not _INT_LOW <= item <= _INT_HIGH:  # type: ignore[operator]
                raise error(f"{name}: an integer does not fit in 64 bits; the file was altered")
            continue
        if depth >= max_depth and children:
            raise error(f"{name} must be nested at most {max_depth} levels deep, got deeper")
        stack.extend((child, depth + 1) for child in children)


def _json_depth(text: str) -> int:
    """Nesting depth of JSON ``text`` (brackets outside strings), found without recursion."""
    depth = deepest = 0
    in_string = escaped = False
    for char in text:
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif char in "]}":
            depth -= 1
    return deepest


def load_json(
    text: str | bytes,
    name: str,
    *,
    max_bytes: int = 1 << 20,
    max_depth: int = MAX_DEPTH,
    error: type[ToolkitError] = ConfigError,
) -> Any:
    """JSON from an untrusted source, bounded: at most ``max_bytes``, ``max_depth`` levels (checked
    before parsing: the decoder recurses), integers of at most 64 bits (Python's own int parse refuses
    only past 4,300 digits, with a ValueError), finite floats (no NaN, Infinity or 1e999), str keys;
    else ``error``."""
    if isinstance(text, bytes):
        if len(text) > max_bytes:
            raise error(f"{name} must be at most {max_bytes} bytes of JSON, got {len(text)}")
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as err:
            raise error(f"{name} must be UTF-8 JSON, got undecodable bytes ({err.reason})") from None
    if not isinstance(text, str):
        raise error(f"{name} must be JSON text, got {type(text).__name__}")
    if len(text) > max_bytes:
        raise error(f"{name} must be at most {max_bytes} bytes of JSON, got {len(text)} characters")
    if _json_depth(text) > max_depth:
        raise error(f"{name} must be nested at most {max_depth} levels deep, got deeper")

    def parse_int(digits: str) -> int:
        if len(digits.lstrip("-")) > MAX_INT_DIGITS:
            raise error(f"{name}: an integer of {len(digits)} digits does not fit in 64 bits")
        return int(digits)

    def parse_float(text: str) -> float:
        value = float(text)
        if not math.isfinite(value):  # 1e999 reads as inf
            raise error(f"{name}: {text[:40]} is past the float range; write a finite number")
        return value

    def parse_constant(word: str) -> float:
        raise error(f"{name}: {word} is not a JSON number; write a finite number")

    try:
        data = json.loads(text, parse_int=parse_int, parse_float=parse_float, parse_constant=parse_constant)
    except ValueError as err:  # JSONDecodeError, and a float past the digit limit
        if isinstance(err, ToolkitError):
            raise
        raise error(f"{name} does not parse: not valid JSON ({str(err)[:200]})") from None
    check_tree(data, name, max_depth=max_depth, error=error)
    return data


def load_toml(
    text: str, name: str, *, max_bytes: int = 1 << 20, error: type[ToolkitError] = ConfigError
) -> Any:
    """TOML from an untrusted source, bounded like :func:`load_json` (the parser recurses into nested
    arrays and inline tables, so too deep a file is refused through its RecursionError)."""
    if not isinstance(text, str) or len(text) > max_bytes:
        got = f"{len(text)} characters" if isinstance(text, str) else type(text).__name__
        raise error(f"{name} must be TOML text of at most {max_bytes} characters, got {got}")
    try:
        data = toml.loads(text)
    except ValueError as err:  # TOMLDecodeError, and an int past Python's 4,300-digit limit
        raise error(f"{name} does not parse: not valid TOML ({str(err)[:200]})") from None
    except RecursionError:
        raise error(f"{name} must be nested at most {MAX_DEPTH} levels deep, got deeper") from None
    check_tree(data, name, error=error)
    return data


def read_regular_file(
    path: str | Path,
    *,
    max_bytes: int,
    what: str,
    follow_links: bool = True,
    error: type[ToolkitError] = ConfigError,
) -> bytes:
    """The bytes of ``path``, a regular file of at most ``max_bytes``: a FIFO, device (``/dev/zero``),
    directory or, with ``follow_links=False``, a symlink is refused before anything is read from it.
    Opened non-blocking (a FIFO's open would wait for a writer) and checked on the open descriptor, so
    what is checked is what is read."""
    path = Path(path)
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    if not follow_links:
        flags |= getattr(os, "O_NOFOLLOW", 0)
        if path.is_symlink():
            raise error(
                f"{what} {str(path)!r} is a symbolic link; the toolkit reads only the file itself there"
            )
    try:
        fd = os.open(path, flags)
    except OSError as err:
        raise error(f"cannot read {what} {str(path)!r}: {err.strerror or err}; fix: check the path") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise error(
                f"{what} {str(path)!r} must be a regular file, got a special file or directory; "
                "fix: pass the file itself"
            )
        if info.st_size > max_bytes:
            raise error(
                f"{what} {str(path)!r} must be at most {max_bytes} bytes, got {info.st_size}; "
                "fix: pass the file the toolkit wrote"
            )
        chunks, left = [], max_bytes + 1
        while left > 0 and (chunk := os.read(fd, min(left, 1 << 20))):
            chunks.append(chunk)
            left -= len(chunk)
    except OSError as err:
        raise error(f"cannot read {what} {str(path)!r}: {err.strerror or err}") from None
    finally:
        os.close(fd)
    data = b"".join(chunks)
    if len(data) > max_bytes:  # it grew after the check
        raise error(f"{what} {str(path)!r} must be at most {max_bytes} bytes, got more")
    return data


def check_real_dir(path: str | Path, *, what: str = "output folder") -> Path:
    """``path`` as a folder to write into that is not a symbolic link (a link left in an output folder
    would send the files written there anywhere): ConfigError when it is a link or an existing file."""
    path = Path(path)
    if path.is_symlink():
        raise ConfigError(
            f"{what} {str(path)!r} is a symbolic link, got one already in the output folder; the toolkit "
            "does not write through links: remove it or choose another --out"
        )
    if path.exists() and not path.is_dir():
        raise ConfigError(f"{what} {str(path)!r} must be a directory, got an existing file; remove it")
    return path


def make_real_dir(path: str | Path, *, what: str = "output folder") -> Path:
    """Create ``path`` (and its parents) and check it is a real folder, not a link to one elsewhere."""
    path = check_real_dir(path, what=what)
    path.mkdir(parents=True, exist_ok=True)
    return check_real_dir(path, what=what)
