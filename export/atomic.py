"""Atomic file writes: a failed run never leaves a half-written file that looks complete.

Every output of the toolkit goes through these helpers: the bytes go to a temporary file in the target
directory, are flushed to disk, and only then renamed over the destination (``os.replace`` is atomic on
POSIX and Windows).
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

__all__ = [
    "atomic_file",
    "atomic_write_bytes",
    "atomic_write_json",
    "atomic_write_text",
    "to_json",
]


@contextlib.contextmanager
def atomic_file(path: str | Path) -> Iterator[BinaryIO]:
    """A binary file to write ``path`` through, streamed (for outputs too large to hold as one bytes
    object); it replaces ``path`` only when the block ends without an error."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            yield fh
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_bytes(path: str | Path, data: bytes) -> Path:
    with atomic_file(path) as fh:
        fh.write(data)
    return Path(path)


def atomic_write_text(path: str | Path, text: str) -> Path:
    return atomic_write_bytes(path, text.encode("utf-8"))


def to_json(obj: Any) -> str:
    """Machine output: sorted keys, two-space indent, trailing newline."""
    return json.dumps(obj, sort_keys=True, indent=2) + "\n"


def atomic_write_json(path: str | Path, obj: Any) -> Path:
    return atomic_write_text(path, to_json(obj))
