"""The one msgpack reader behind bundles, packages and weights files.

Every file format of the toolkit is a msgpack map read from an untrusted source, so decoding is bounded
(no ext types, capped bin/str/array/map sizes, a total size cap checked before parsing) and every failure
is a :class:`BundleError` that names the source and says which kind of file was expected.
"""

from __future__ import annotations

from typing import Any

import msgpack

from profiles.errors import BundleError

__all__ = ["unpack_map"]


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
            max_bin_len=max_bin,
            max_str_len=max_str,
            max_array_len=max_array,
            max_map_len=max_map,
            max_ext_len=0,
        )
    except (msgpack.UnpackException, ValueError) as err:  # ExtraData, OutOfData, FormatError, limits
        raise BundleError(
            f"{source}: not a readable {what} (corrupt, truncated or not msgpack): "
            f"{type(err).__name__}: {err}"
        ) from err
    if not isinstance(obj, dict):
        raise BundleError(f"{source}: a {what} is a msgpack map, got {type(obj).__name__}")
    return obj
