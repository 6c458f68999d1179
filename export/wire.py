"""The one msgpack reader behind bundles, packages and weights files, and the bounds they share.

Every file format of the toolkit is a msgpack map read from an untrusted source, so decoding is bounded
(no ext types, capped bin/str/array/map sizes, a total size cap checked before parsing, no repeated map
key, only str map keys, at most :data:`MAX_DEPTH` levels: :func:`common.checks.check_tree`) and every
failure is a :class:`BundleError` that names the source and says which kind of file was
expected. A file's ``sha256`` is taken over :func:`canonical_bytes` of its map without that key, so a
flipped byte anywhere in the file is caught, not only in the model.

Bounds on what a manifest may describe are checked before anything is allocated from it. They are set
from the largest real tasks the toolkit is meant for, with headroom, not from what msgpack can encode:

* :data:`MAX_CLASSES` 10,000: ImageNet-1k has 1,000 classes, iNaturalist 2021 10,000; EMNIST 62.
* :data:`MAX_DECODER_CLASSES` 1,024: a CVAE decoder is conditioned on one-hot labels and the server
  builds an L x L identity for them (``torch.eye``, 4 MiB at 1,024, 40 GB at 100,000); ImageNet-1k fits.
* :data:`MAX_INPUT_CHANNELS` 16 and :data:`MAX_INPUT_ELEMENTS` 2**20 (C * H * W): ImageNet at 224 x 224 x 3
  is 150,528 elements and 512 x 512 x 3 is 786,432; Sentinel-2's 13 bands fit. One float32 sample is at
  most 4 MiB, where (1, 100000, 100000) would be 40 GB before any layer.
* :data:`MAX_LATENT_DIM` 4,096: CVAE latents are 2 to a few hundred wide (``edge_sdk.cvae`` uses the
  same cap).
* :data:`MAX_EXAMPLES` 2**40 (about 10**12) per client and per class count: 100x LAION-5B.
"""

from __future__ import annotations

import hashlib
from typing import Any

import msgpack

from common.checks import check_tree
from common.errors import BundleError

__all__ = [
    "MAX_CLASSES",
    "MAX_DECODER_CLASSES",
    "MAX_DEPTH",
    "MAX_EXAMPLES",
    "MAX_INPUT_CHANNELS",
    "MAX_INPUT_ELEMENTS",
    "MAX_LATENT_DIM",
    "canonical_bytes",
    "canonical_sha256",
    "unpack_map",
]

MAX_CLASSES = 10_000
MAX_DECODER_CLASSES = 1_024
MAX_INPUT_CHANNELS = 16
MAX_INPUT_ELEMENTS = 1 << 20
MAX_LATENT_DIM = 4_096
MAX_EXAMPLES = 1 << 40
MAX_DEPTH = 16  # maps and arrays in a wire file: its deepest field is three levels down


class _RepeatedKey(Exception):
    """Raised inside the decoder; turned into a BundleError that names the file."""


def _unique_map(pairs: list[tuple[Any, Any]]) -> dict[Any, Any]:
    """msgpack keeps the last of two equal keys, so a second ``sha256`` could shadow the first: refuse."""
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[Any] = set()
        for key, _ in pairs:
            if key in seen:
                raise _RepeatedKey(key)
            seen.add(key)
    return out


def unpack_map(
    data: bytes | bytearray | memoryview,
    *,
    source: str,
    what: str,
    max_bytes: int,
    max_bin: int,
    max_str: int,
    max_array: int,
    max_map: int,
) -> dict[str, Any]:
    """Decode ``data`` as one msgpack map of a ``what`` (e.g. "bundle") within the given limits."""
    if not isinstance(data, bytes | bytearray | memoryview):
        raise BundleError(f"{source}: expected the {what}'s bytes, got {type(data).__name__}")
    if len(data) > max_bytes:
        raise BundleError(f"{source}: {len(data)} bytes is larger than any valid {what} ({max_bytes})")
    try:
        obj = msgpack.unpackb(
            data,
            raw=False,
            strict_map_key=True,
            use_list=True,
            object_pairs_hook=_unique_map,
            max_bin_len=max_bin,
            max_str_len=max_str,
            max_array_len=max_array,
            max_map_len=max_map,
            max_ext_len=0,
        )
    except _RepeatedKey as err:
        raise BundleError(
            f"{source}: a map in this {what} has the key {str(err.args[0])[:80]!r} twice; a valid {what} "
            "never repeats a key (the file was altered), fetch it again"
        ) from None
    except (msgpack.UnpackException, ValueError) as err:  # ExtraData, OutOfData, FormatError, limits
        raise BundleError(
            f"{source}: not a readable {what} (corrupt, truncated or not msgpack): "
            f"{type(err).__name__}: {err}"
        ) from err
    if not isinstance(obj, dict):
        raise BundleError(f"{source}: a {what} is a msgpack map, got {type(obj).__name__}")
    check_tree(obj, f"{source}: this {what}", max_depth=MAX_DEPTH, error=BundleError)
    return obj


def _sorted(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _sorted(value[k]) for k in sorted(value)}
    if isinstance(value, list | tuple):
        return [_sorted(v) for v in value]
    return value


def canonical_bytes(obj: dict[str, Any]) -> bytes:
    """The one encoding every file is written in and hashed over: map keys sorted at every level, bytes
    as msgpack bin (distinct from str), floats always float64, tuples as arrays."""
    return msgpack.packb(_sorted(obj), use_bin_type=True, use_single_float=False)


def canonical_sha256(obj: dict[str, Any]) -> str:
    """Hex sha256 of :func:`canonical_bytes` of ``obj`` without its ``sha256`` key (the file's hash)."""
    return hashlib.sha256(canonical_bytes({k: v for k, v in obj.items() if k != "sha256"})).hexdigest()
