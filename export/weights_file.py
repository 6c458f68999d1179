"""A weights file that cannot execute code: safetensors tensors inside a validated msgpack manifest.

Used for the HAPFNAS supernet the server sends to devices. The manifest names what the tensors are
(``kind``, input shape, class count, the search-space string, provenance); ``sha256`` covers the tensor
bytes. Reading checks the schema version, the kind, the hash and the types, like a bundle, and never
unpickles anything (safetensors is a flat header + raw buffers).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import msgpack
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from export.atomic import atomic_write_bytes
from export.wire import unpack_map
from profiles.errors import BundleError

__all__ = ["WEIGHTS_SCHEMA_VERSION", "read_weights_file", "write_weights_file"]

WEIGHTS_SCHEMA_VERSION = 1
_MAX_FILE_BYTES = 4 << 30
_KEYS = {"schema_version", "kind", "manifest", "tensors", "sha256"}
_SCALARS = (str, int, float, bool, type(None))


def write_weights_file(
    path: str | Path, tensors: Mapping[str, torch.Tensor], *, kind: str, manifest: Mapping[str, Any]
) -> Path:
    """Write ``tensors`` (safetensors) and ``manifest`` (str -> scalar or list of ints) atomically."""
    for key, value in manifest.items():
        ok = isinstance(value, _SCALARS) or (
            isinstance(value, list) and all(isinstance(v, int) for v in value)
        )
        if not isinstance(key, str) or not ok:
            raise BundleError(f"manifest must map str to scalars or int lists, got {key!r}: {value!r}")
    blob = st_save({k: v.detach().cpu().contiguous() for k, v in sorted(tensors.items())})
    data = {
        "schema_version": WEIGHTS_SCHEMA_VERSION,
        "kind": kind,
        "manifest": dict(sorted(manifest.items())),
        "tensors": blob,
        "sha256": hashlib.sha256(blob).hexdigest(),
    }
    return atomic_write_bytes(path, msgpack.packb(data, use_bin_type=True, use_single_float=False))


def read_weights_file(path: str | Path, *, kind: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(tensors, manifest) of a file written by :func:`write_weights_file` with this ``kind``."""
    path = Path(path)
    try:
        if path.stat().st_size > _MAX_FILE_BYTES:
            raise BundleError(f"{path}: larger than any valid weights file")
        raw = path.read_bytes()
    except OSError as err:
        raise BundleError(f"cannot read weights file {path}: {err}") from err
    obj = unpack_map(
        raw,
        source=str(path),
        what="weights file",
        max_bytes=_MAX_FILE_BYTES,
        max_bin=_MAX_FILE_BYTES,
        max_str=1 << 20,
        max_array=1 << 20,
        max_map=1 << 16,
    )
    if set(obj) != _KEYS:
        raise BundleError(f"{path}: expected keys {sorted(_KEYS)}, got {sorted(obj)}")
    if obj["schema_version"] != WEIGHTS_SCHEMA_VERSION:
        raise BundleError(
            f"{path}: schema_version {obj['schema_version']!r} is not supported (expected "
            f"{WEIGHTS_SCHEMA_VERSION}); write it with a matching server-kit"
        )
    if obj["kind"] != kind:
        raise BundleError(f"{path}: a {obj['kind']!r} file, expected {kind!r}")
    if not isinstance(obj["tensors"], bytes) or hashlib.sha256(obj["tensors"]).hexdigest() != obj["sha256"]:
        raise BundleError(
            f"{path}: tensor sha256 mismatch; the file is corrupt or was altered, fetch it again"
        )
    if not isinstance(obj["manifest"], dict):
        raise BundleError(f"{path}: manifest must be a map")
    try:
        tensors = st_load(obj["tensors"])
    except Exception as err:  # safetensors raises its own SafetensorError
        raise BundleError(f"{path}: unreadable tensors: {err}") from err
    return tensors, obj["manifest"]
