"""Atomic file writes: a failed run never leaves a half-written file that looks complete.

Every output of the toolkit goes through these helpers: the bytes go to a temporary file in the target
directory, are flushed to disk, and only then renamed over the destination (``os.replace`` is atomic on
POSIX and Windows).
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

from common.errors import ConfigError

__all__ = [
    "atomic_write_bytes",
    "atomic_write_json",
    "atomic_write_text",
    "check_output_dir",
    "check_output_file",
    "to_json",
]


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


def atomic_write_bytes(path: str | Path, data: bytes) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def atomic_write_text(path: str | Path, text: str) -> Path:
    return atomic_write_bytes(path, text.encode("utf-8"))


def to_json(obj: Any) -> str:
    """Machine output: sorted keys, two-space indent, trailing newline."""
    return json.dumps(obj, sort_keys=True, indent=2) + "\n"


def atomic_write_json(path: str | Path, obj: Any) -> Path:
    return atomic_write_text(path, to_json(obj))
