"""The personalization package: what the server sends back to one client after aggregation.

One msgpack map per client, validated like a bundle. It carries the global model (ONNX), the
distillation inputs (uint8 images of the aggregation's synthetic set, N x C x H x W), the personalised
server knowledge Z_n^s for those inputs (float32 logits, N x L; FedPD's PKE output), optionally the
global generator (ONNX, for FedKDG-style local training) and the knobs the server used.

A package names the client it was made for by the sha256 of that client's uploaded model
(``client_sha256``): the device compares it with its own model and refuses a package meant for another
client. ``sha256`` covers every other field (the canonical msgpack of the map without it), so a flipped
byte anywhere is refused. Same package, same bytes.

The package comes from elsewhere, and it says what its models must be (``num_classes``,
``input_shape``), so :func:`package_from_bytes` holds both to :mod:`export.onnx_check`'s load-time
contract before a reader sees them: the global model ``[batch, *input_shape] -> [batch, num_classes]``,
the generator ``z``, ``y`` one-hot -> ``[batch, *input_shape]``, each within the per-file budget. (A
Package built in memory is not checked: :func:`edge_sdk.personalize.personalize` checks what it runs.)
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import msgpack
import numpy as np

from common.checks import check_input_shape, check_int, check_ints, check_str, is_int, read_regular_file
from common.errors import BundleError
from export.atomic import atomic_write_bytes
from export.onnx_check import check_classifier_onnx, check_decoder_onnx
from export.wire import MAX_CLASSES, MAX_INPUT_CHANNELS, MAX_INPUT_ELEMENTS, unpack_map

__all__ = [
    "MAX_PACKAGE_BYTES",
    "PACKAGE_KIND",
    "PACKAGE_SCHEMA_VERSION",
    "Package",
    "package_from_bytes",
    "package_to_bytes",
    "read_package",
    "write_package",
]

PACKAGE_SCHEMA_VERSION = 1
PACKAGE_KIND = "personalization"
MAX_PACKAGE_BYTES = 4 << 30  # models + images + knowledge
_MAX_BIN = 2 << 30
_MAX_STR = 10_000
_MAX_ENTRIES = 1_000
_SCALARS = (str, int, float, bool, type(None))
_MAX_SEED = 2**64 - 1


@dataclass(frozen=True, kw_only=True)
class Package:
    """One client's personalization package (see the module docstring).

    ``inputs`` is N x C x H x W uint8 and ``knowledge`` N x L float32 (numpy arrays); ``generator_onnx``
    may be None. ``knobs`` maps str to scalars (server settings, e.g. mu, epochs).
    """

    client: str
    client_sha256: str
    global_onnx: bytes
    global_arch: str
    num_classes: int
    input_shape: tuple[int, int, int]
    inputs: np.ndarray
    knowledge: np.ndarray
    generator_onnx: bytes | None
    knobs: Mapping[str, Any]
    seed: int
    kind: str = PACKAGE_KIND
    schema_version: int = PACKAGE_SCHEMA_VERSION

    def __post_init__(self) -> None:
        if not is_int(self.schema_version) or self.schema_version != PACKAGE_SCHEMA_VERSION:
            raise BundleError(
                f"package schema_version {self.schema_version!r} is not supported (this SDK reads "
                f"{PACKAGE_SCHEMA_VERSION}); fix: make the package with a matching server-kit"
            )
        if self.kind != PACKAGE_KIND:
            raise BundleError(f"kind must be {PACKAGE_KIND!r}, got {self.kind!r}")
        for name in ("client", "client_sha256", "global_arch"):
            check_str(name, getattr(self, name), max_bytes=_MAX_STR, error=BundleError)
        if len(self.client_sha256) != 64 or any(c not in "0123456789abcdef" for c in self.client_sha256):
            raise BundleError(f"client_sha256 must be 64 lowercase hex digits, got {self.client_sha256!r}")
        if not isinstance(self.global_onnx, bytes) or not self.global_onnx:
            raise BundleError("global_onnx must be non-empty bytes")
        if self.generator_onnx is not None and (
            not isinstance(self.generator_onnx, bytes) or not self.generator_onnx
        ):
            raise BundleError("generator_onnx must be None or non-empty bytes")
        classes = check_int("num_classes", self.num_classes, 2, MAX_CLASSES, error=BundleError)
        object.__setattr__(self, "num_classes", classes)
        object.__setattr__(self, "seed", check_int("seed", self.seed, 0, _MAX_SEED, error=BundleError))
        shape = check_input_shape(
            "input_shape",
            self.input_shape,
            max_channels=MAX_INPUT_CHANNELS,
            max_elements=MAX_INPUT_ELEMENTS,
            error=BundleError,
        )
        object.__setattr__(self, "input_shape", shape)
        x, z = self.inputs, self.knowledge
        if not isinstance(x, np.ndarray) or x.dtype != np.uint8 or x.shape[1:] != shape or len(x) < 1:
            raise BundleError(
                f"inputs must be uint8 N x {shape} with N >= 1, got "
                f"{getattr(x, 'dtype', type(x).__name__)} {getattr(x, 'shape', '')}"
            )
        if not isinstance(z, np.ndarray) or z.dtype != np.float32 or z.shape != (len(x), self.num_classes):
            raise BundleError(
                f"knowledge must be float32 of shape ({len(x)}, {self.num_classes}), got "
                f"{getattr(z, 'dtype', type(z).__name__)} {getattr(z, 'shape', '')}"
            )
        if not np.isfinite(z).all():
            raise BundleError("knowledge must be finite")
        if not isinstance(self.knobs, Mapping) or len(self.knobs) > _MAX_ENTRIES:
            raise BundleError("knobs must be a map of at most 1000 entries")
        for key, value in self.knobs.items():
            if not isinstance(key, str) or not isinstance(value, _SCALARS):
                raise BundleError(f"knobs must map str to str/int/float/bool/None, got {key!r}: {value!r}")
            if isinstance(value, float) and not math.isfinite(value):
                raise BundleError(f"knob {key!r} must be finite, got {value!r}")

    def check_for(self, model_onnx: bytes) -> None:
        """Refuse this package unless it was made for the client whose uploaded model is ``model_onnx``."""
        own = hashlib.sha256(model_onnx).hexdigest()
        if own != self.client_sha256:
            raise BundleError(
                f"this package was made for {self.client!r} (model sha256 {self.client_sha256[:12]}...), "
                f"not for this device's model ({own[:12]}...); fix: use the package the server wrote for "
                "this client's bundle"
            )


def _wire(package: Package) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for f in fields(package):
        value = getattr(package, f.name)
        if f.name in ("inputs", "knowledge"):
            little = np.ascontiguousarray(value, dtype=value.dtype.newbyteorder("<"))
            value = {"shape": list(value.shape), "data": little.tobytes()}
        elif f.name == "input_shape":
            value = list(value)
        elif f.name == "knobs":
            value = dict(sorted(value.items()))
        out[f.name] = value
    return dict(sorted(out.items()))


def _pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True, use_single_float=False)


def package_to_bytes(package: Package) -> bytes:
    """Deterministic msgpack: sorted keys, the hash of everything else under ``sha256``."""
    if not isinstance(package, Package):
        raise BundleError(f"expected a Package, got {type(package).__name__}")
    wire = _wire(package)
    wire["sha256"] = hashlib.sha256(_pack(wire)).hexdigest()
    return _pack(dict(sorted(wire.items())))


def _array(name: str, value: object, dtype: type) -> np.ndarray:
    if not isinstance(value, dict) or set(value) != {"shape", "data"}:
        raise BundleError(f"{name} must be a map with shape and data")
    shape = list(
        check_ints(f"{name}.shape", value["shape"], 0, MAX_PACKAGE_BYTES, max_length=4, error=BundleError)
    )
    data, expected = value["data"], math.prod(shape) * np.dtype(dtype).itemsize
    if not isinstance(data, bytes) or len(data) != expected:
        got = f"{len(data)} bytes" if isinstance(data, bytes) else type(data).__name__
        raise BundleError(f"{name}.data must hold {expected} bytes for shape {shape}, got {got}")
    return np.frombuffer(data, dtype=np.dtype(dtype).newbyteorder("<")).astype(dtype).reshape(shape)


def package_from_bytes(data: bytes, *, source: str = "<bytes>") -> Package:
    """Decode and validate, the ONNX models included; every refusal is a BundleError naming ``source``."""
    obj = unpack_map(
        data,
        source=source,
        what="package",
        max_bytes=MAX_PACKAGE_BYTES,
        max_bin=_MAX_BIN,
        max_str=_MAX_STR,
        max_array=_MAX_ENTRIES,
        max_map=_MAX_ENTRIES,
    )
    version = obj.get("schema_version")
    if not is_int(version) or version != PACKAGE_SCHEMA_VERSION:
        raise BundleError(
            f"{source}: package schema_version {version!r} is not supported "
            f"(expected {PACKAGE_SCHEMA_VERSION}); fix: make the package with a matching server-kit"
        )
    expected = {f.name for f in fields(Package)} | {"sha256"}
    if set(obj) != expected:
        raise BundleError(
            f"{source}: package keys wrong: missing {sorted(expected - set(obj))}, "
            f"unknown {sorted(set(obj) - expected)}"
        )
    recorded = obj.pop("sha256")
    if recorded != hashlib.sha256(_pack(dict(sorted(obj.items())))).hexdigest():
        raise BundleError(
            f"{source}: package sha256 mismatch; the file is corrupt or was altered, fetch it again"
        )
    try:
        package = Package(
            **{
                **obj,
                "inputs": _array("inputs", obj["inputs"], np.uint8),
                "knowledge": _array("knowledge", obj["knowledge"], np.float32),
            }
        )
    except (BundleError, TypeError) as err:
        raise BundleError(f"{source}: {err}") from err
    _check_models(package, source)
    return package


def _check_models(package: Package, source: str) -> None:
    """The package's ONNX against the shapes it declares, before anything parses it further or runs it."""
    check_classifier_onnx(
        package.global_onnx,
        input_shape=package.input_shape,
        num_classes=package.num_classes,
        source=f"{source}: global_onnx",
    )
    if package.generator_onnx is not None:
        check_decoder_onnx(
            package.generator_onnx,
            latent_dim=None,
            num_classes=package.num_classes,
            output_shape=package.input_shape,
            source=f"{source}: generator_onnx",
        )


def write_package(package: Package, path: str | Path) -> Path:
    """Serialise, then write atomically."""
    return atomic_write_bytes(path, package_to_bytes(package))


def read_package(path: str | Path) -> Package:
    """Read and validate a package file."""
    path = Path(path)
    data = read_regular_file(path, max_bytes=MAX_PACKAGE_BYTES, what="package", error=BundleError)
    return package_from_bytes(data, source=str(path))
