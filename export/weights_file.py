"""A weights file that cannot execute code: safetensors tensors inside a validated msgpack manifest.

Used for the HAPFNAS supernet the server sends to devices. The manifest names what the tensors are
(``kind``, input shape, class count, the search-space string, provenance). Reading checks the schema
version, the kind, the hash and the types, like a bundle, and never unpickles anything (safetensors is a
flat header + raw buffers). ``sha256`` covers the whole map but itself
(:func:`export.wire.canonical_sha256`), so the manifest is protected like the tensors; schema 1 hashed
the tensors only and is refused (no schema-1 file was ever kept: write it again with ``server-kit
supernet``). What a manifest value means (its bounds) is checked by the reader of that kind, e.g.
:func:`edge_sdk.models.elastic.supernet_file.load_supernet`; here only its shape: str -> scalar or list of
ints.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from common.checks import is_int, read_regular_file
from common.errors import BundleError
from export.atomic import atomic_write_bytes
from export.wire import canonical_bytes, canonical_sha256, unpack_map

__all__ = ["WEIGHTS_SCHEMA_VERSION", "read_weights_file", "write_weights_file"]

WEIGHTS_SCHEMA_VERSION = 2  # 2: sha256 covers the whole map (1: the tensor bytes only)
_MAX_FILE_BYTES = 4 << 30
_MAX_STR = 1 << 20
_MAX_LIST = 1 << 10  # an int list in the manifest (a shape)
_KEYS = {"schema_version", "kind", "manifest", "tensors", "sha256"}
_SCALARS = (str, int, float, bool, type(None))


def _manifest_problem(manifest: object) -> str | None:
    """Why ``manifest`` is not a map of str to scalars or short int lists (no bools in the lists)."""
    if not isinstance(manifest, Mapping):
        return f"manifest must be a map, got {type(manifest).__name__}"
    for key, value in manifest.items():
        ints = isinstance(value, list) and len(value) <= _MAX_LIST and all(is_int(v) for v in value)
        if not isinstance(key, str) or not (isinstance(value, _SCALARS) or ints):
            return f"manifest must map str to scalars or int lists, got {key!r}: {str(value)[:80]}"
        if any(is_int(v) and not -(2**63) <= v < 2**64 for v in (value if ints else [value])):
            return f"manifest[{key!r}] does not fit in 64 bits"
    return None


def write_weights_file(
    path: str | Path, tensors: Mapping[str, torch.Tensor], *, kind: str, manifest: Mapping[str, Any]
) -> Path:
    """Write ``tensors`` (safetensors) and ``manifest`` (str -> scalar or list of ints) atomically."""
    problem = _manifest_problem(manifest)
    if problem is not None:
        raise BundleError(problem)
    blob = st_save({k: v.detach().cpu().contiguous() for k, v in sorted(tensors.items())})
    data = {
        "schema_version": WEIGHTS_SCHEMA_VERSION,
        "kind": kind,
        "manifest": dict(manifest),
        "tensors": blob,
    }
    return atomic_write_bytes(path, canonical_bytes({**data, "sha256": canonical_sha256(data)}))


def read_weights_file(path: str | Path, *, kind: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(tensors, manifest) of a file written by :func:`write_weights_file` with this ``kind``."""
    path = Path(path)
    raw = read_regular_file(path, max_bytes=_MAX_FILE_BYTES, what="weights file", error=BundleError)
    obj = unpack_map(
        raw,
        source=str(path),
        what="weights file",
        max_bytes=_MAX_FILE_BYTES,
        max_bin=_MAX_FILE_BYTES,
        max_str=_MAX_STR,
        max_array=_MAX_LIST,
        max_map=1 << 16,
    )
    if set(obj) != _KEYS:
        raise BundleError(f"{path}: expected keys {sorted(_KEYS)}, got {sorted(obj)}")
    version = obj["schema_version"]
    if not is_int(version) or version != WEIGHTS_SCHEMA_VERSION:
        raise BundleError(
            f"{path}: schema_version {version!r} is not supported (expected {WEIGHTS_SCHEMA_VERSION}; "
            "schema 1 did not protect the manifest); write it again with a matching server-kit"
        )
    if obj["kind"] != kind:
        raise BundleError(f"{path}: a {str(obj['kind'])[:80]!r} file, expected {kind!r}")
    if obj["sha256"] != canonical_sha256(obj):
        raise BundleError(f"{path}: sha256 mismatch; the file is corrupt or was altered, fetch it again")
    problem = _manifest_problem(obj["manifest"])
    if problem is not None or not isinstance(obj["tensors"], bytes):
        raise BundleError(f"{path}: {problem or 'tensors must be bytes'}")
    try:
        tensors = st_load(obj["tensors"])
    except Exception as err:  # safetensors raises its own SafetensorError
        raise BundleError(f"{path}: unreadable tensors: {err}") from err
    poisoned = sorted(k for k, t in tensors.items() if t.is_floating_point() and not torch.isfinite(t).all())
    if poisoned:  # a NaN weight makes every output NaN on whoever loads it
        raise BundleError(
            f"{path}: tensors {poisoned[:3]} hold NaN or infinite values, expected finite weights; "
            "the file is corrupt or hostile, fetch it again from a trusted source"
        )
    return tensors, obj["manifest"]
