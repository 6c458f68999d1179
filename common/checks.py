"""Validators shared by every frozen config and wire reader, the output-path checks (the CLIs run them at
parse time, before any work), and the one way to build a config from a preset.

Configs validate themselves at creation (``__post_init__``) so a bad value fails where it was written, not
deep inside a training loop. These helpers keep the wording of those errors the same across the toolkit.
"""

from __future__ import annotations

import dataclasses
import math
import operator
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

from common.errors import ConfigError, ToolkitError

__all__ = [
    "check_input_shape",
    "check_int",
    "check_ints",
    "check_number",
    "check_output_dir",
    "check_output_file",
    "check_str",
    "differences",
    "from_preset",
    "is_int",
    "is_number",
]

T = TypeVar("T")


def differences(recorded: object, wanted: object, prefix: str = "") -> list[str]:
    """Dotted keys whose values differ between two JSON objects (a key one of them lacks differs too), so
    a refusal to reuse an earlier run's files can name what changed instead of just saying "stale"."""
    if isinstance(recorded, dict) and isinstance(wanted, dict):
        keys = sorted(set(recorded) | set(wanted))
        return [d for k in keys for d in differences(recorded.get(k), wanted.get(k), f"{prefix}{k}.")]
    return [] if recorded == wanted else [prefix.rstrip(".")]


def is_number(value: object) -> bool:
    """A finite int or float, not a bool."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


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
    if not is_number(value) or value < 0 or (positive and value == 0):  # type: ignore[operator]
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
