"""Re-encoding mutated files so that they still read as valid: the hash is recomputed, never left stale.

A mutant whose hash no longer matches is refused at the first check and exercises nothing behind it, so
field- and ONNX-level mutants are written (1) through the project's public writer whenever the mutated
value survives it (an unvalidated copy of the seed object with the field replaced), so the file is hashed
by whatever definition the writer uses today; (2) otherwise as a raw msgpack map whose hash fields are
recomputed by the scheme :func:`detect_hashes` finds on the honest seed. Neither path copies the
reader's hash code, so both keep working when the definition changes (e.g. to cover the whole manifest);
when no known scheme reproduces a seed's hashes, :class:`HarnessError` says so instead of guessing.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import re
import struct
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import msgpack
import torch

from export.bundle import Bundle, bundle_to_bytes
from export.package import Package, package_to_bytes
from export.weights_file import write_weights_file

_HEX64 = re.compile(r"[0-9a-f]{64}")


class HarnessError(RuntimeError):
    """The harness itself cannot build a case (never a finding about the code under test)."""


def pack(obj: Any) -> bytes:
    """The toolkit's msgpack options (bin for bytes, float64); top-level keys sorted, nested maps in the
    order given (a decoded seed keeps its writer's order, which is what readers hash)."""
    if isinstance(obj, dict):
        obj = {k: obj[k] for k in sorted(obj, key=_key_order)}
    return msgpack.packb(obj, use_bin_type=True, use_single_float=False)


def _pack_as_is(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True, use_single_float=False)


def sort_maps(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: sort_maps(value[k]) for k in sorted(value, key=_key_order)}
    if isinstance(value, list | tuple):
        return [sort_maps(v) for v in value]
    return value


def _key_order(key: Any) -> tuple[str, str]:
    """str keys in str order (as every writer sorts them), other types after, by repr."""
    return ("", key) if isinstance(key, str) else (type(key).__name__, repr(key))


def decode(data: bytes) -> dict[str, Any]:
    """Lenient decode of a seed (trusted) file into a plain map."""
    obj = msgpack.unpackb(data, raw=False, strict_map_key=False)
    if not isinstance(obj, dict):
        raise HarnessError(f"a seed file must be a msgpack map, got {type(obj).__name__}")
    return obj


# ------------------------------------------------------------------------------------------ hash schemes

HashFn = Callable[[dict[str, Any]], str]


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@dataclass(frozen=True)
class HashScheme:
    """How one file kind is hashed: (hash key, description, function of the decoded map) in the order the
    hashes must be recomputed (hashes of one field first, hashes of the whole map last)."""

    steps: tuple[tuple[str, str, HashFn], ...]

    def apply(self, obj: dict[str, Any]) -> dict[str, Any]:
        out = dict(obj)
        for key, _, fn in self.steps:
            # when the mutant broke what a hash covers, the stale value is as good as any
            with contextlib.suppress(TypeError, KeyError, ValueError, OverflowError):
                out[key] = fn(out)
        return out


def _field_hash(field: str) -> HashFn:
    return lambda m: _sha(m[field])


def _map_hash(excluded: frozenset[str], canonical: bool) -> HashFn:
    """sha256 of the map less ``excluded``, nested maps as encoded or (``canonical``) sorted."""

    def fn(m: dict[str, Any]) -> str:
        rest = {k: v for k, v in m.items() if k not in excluded}
        return _sha(pack(sort_maps(rest) if canonical else rest))

    return fn


def detect_hashes(seed: dict[str, Any]) -> HashScheme:
    """The scheme reproducing the 64-hex-digit strs of ``seed``'s top level that are hashes of it.

    ``sha256`` must be one of them; any other hex field no candidate reproduces is data, not a hash.
    """
    hash_keys = sorted(k for k, v in seed.items() if isinstance(v, str) and _HEX64.fullmatch(v))
    if not hash_keys:
        raise HarnessError(f"no sha256 field in a seed with keys {sorted(seed)}")
    field_steps, map_steps = [], []
    for key in hash_keys:
        candidates: list[tuple[str, HashFn, bool]] = [
            (f"sha256({field})", _field_hash(field), False)
            for field, value in seed.items()
            if isinstance(value, bytes)
        ]
        candidates += [
            (f"sha256(map - {excluded}, sorted={canonical})", _map_hash(excluded, canonical), True)
            for excluded in (frozenset({key}), frozenset(hash_keys))
            for canonical in (False, True)
        ]
        for name, fn, whole in candidates:
            if fn(seed) == seed[key]:
                (map_steps if whole else field_steps).append((key, name, fn))
                break
        else:
            if key == "sha256":  # other hex fields may be data (a package's client_sha256)
                raise HarnessError(
                    f"cannot reproduce the seed's {key!r}; teach tests/fuzz/wire.py the new hash definition"
                )
    if not field_steps + map_steps:
        raise HarnessError(f"no field of the seed ({hash_keys}) is a hash this harness can reproduce")
    return HashScheme(tuple(field_steps + map_steps))


def encode_map(obj: dict[str, Any], scheme: HashScheme) -> bytes:
    """``obj`` with its hashes recomputed, packed canonically."""
    return pack(scheme.apply(obj))


def _map_header(size: int) -> bytes:
    return bytes([0x80 | size]) if size < 16 else b"\xde" + struct.pack(">H", size)


def encode_with_duplicate(obj: dict[str, Any], key: str, first: Any, scheme: HashScheme) -> bytes:
    """``obj`` (hashes recomputed) with ``key`` written twice: ``first`` before the honest value.

    A reader that keeps the last value and checks hashes on what it kept accepts the file, while another
    parser (or a later version) would act on ``first``: exactly the ambiguity a reader must refuse.
    """
    full = scheme.apply(obj)
    full = {k: full[k] for k in sorted(full, key=_key_order)}
    body = [_pack_as_is(key) + _pack_as_is(first)]
    body += [_pack_as_is(k) + _pack_as_is(v) for k, v in full.items()]
    return _map_header(len(full) + 1) + b"".join(body)


# ------------------------------------------------------------------------------------- public writers


def _unvalidated(obj: Any, changes: Mapping[str, Any]) -> Any:
    """A shallow copy of a frozen dataclass with fields replaced, skipping ``__post_init__`` checks, and
    every cached property dropped so the writer recomputes it (e.g. a hash) from the new fields."""
    out = copy.copy(obj)
    for name, value in changes.items():
        object.__setattr__(out, name, value)
    for name, attr in vars(type(out)).items():
        if isinstance(attr, cached_property):
            out.__dict__.pop(name, None)
    return out


def via_bundle_writer(bundle: Bundle, changes: Mapping[str, Any]) -> bytes | None:
    """``bundle_to_bytes`` of the bundle with ``changes``; None when the writer cannot encode them."""
    try:
        return bundle_to_bytes(_unvalidated(bundle, changes))
    except Exception:  # any failure means: fall back to the raw map
        return None


def via_package_writer(package: Package, changes: Mapping[str, Any]) -> bytes | None:
    """``package_to_bytes`` of the package with ``changes``; None when the writer cannot encode them."""
    try:
        return package_to_bytes(_unvalidated(package, changes))
    except Exception:
        return None


def via_weights_writer(
    tensors: Mapping[str, torch.Tensor], *, kind: str, manifest: Mapping[str, Any]
) -> bytes | None:
    """``write_weights_file`` output as bytes; None when the writer refuses the manifest."""
    with tempfile.TemporaryDirectory() as tmp:
        try:
            path = write_weights_file(Path(tmp) / "w", tensors, kind=kind, manifest=manifest)
        except Exception:
            return None
        return path.read_bytes()
