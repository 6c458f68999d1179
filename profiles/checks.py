"""Validators shared by every frozen config and wire reader, and the one way to build a config from a preset.

Configs validate themselves at creation (``__post_init__``) so a bad value fails where it was written, not
deep inside a training loop. These helpers keep the wording of those errors the same across the toolkit.
"""

from __future__ import annotations

import dataclasses
import math
import operator
from collections.abc import Mapping
from typing import Any, TypeVar

from profiles.errors import ConfigError, ToolkitError

__all__ = ["check_int", "check_number", "from_preset", "is_number"]

T = TypeVar("T")


def is_number(value: object) -> bool:
    """A finite int or float, not a bool."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


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


def check_number(
    name: str, value: object, *, positive: bool = False, error: type[ToolkitError] = ConfigError
) -> float:
    """``value`` as a finite number >= 0 (> 0 when ``positive``), else ``error``."""
    if not is_number(value) or value < 0 or (positive and value == 0):  # type: ignore[operator]
        raise error(f"{name} must be a finite number {'> 0' if positive else '>= 0'}, got {value!r}")
    return float(value)  # type: ignore[arg-type]


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
