"""The bundle: what a device uploads, as one msgpack map in one file.

A bundle carries the BN-preserving ONNX model, the facts the server needs to use it without the
client's data (architecture string, input shape, per-class label counts of the local training split)
and provenance (device profile summary, metrics, seed, SDK version). The server trusts nothing it reads:
every field is type- and range-checked, the ONNX bytes must match their recorded sha256, and msgpack
is decoded with size limits so a hostile file cannot ask for gigabytes before being refused.

Rules (checked on construction and on read): ``kind`` is one of :data:`KINDS`; ``label_counts`` has one
non-negative count per class and sums to exactly ``num_examples`` (both describe the same local
training split) which must be >= 1 (the server weights teachers by these counts); a ``cvae_decoder``
needs ``latent_dim``, a ``classifier`` must not have one.

Bytes are deterministic: map keys are sorted recursively, binary and str are distinct msgpack types and
floats are always float64, so the same Bundle always gives the same file.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import msgpack

from export.atomic import atomic_write_bytes
from export.wire import unpack_map
from profiles.errors import BundleError

__all__ = [
    "KINDS",
    "MAX_CLASSES",
    "MAX_MODEL_BYTES",
    "MAX_STRING_BYTES",
    "SCHEMA_VERSION",
    "Bundle",
    "bundle_from_bytes",
    "bundle_to_bytes",
    "read_bundle",
    "write_bundle",
]

SCHEMA_VERSION: int = 1
KINDS = ("classifier", "cvae_decoder")

MAX_MODEL_BYTES = 1 << 30  # 1 GiB of ONNX
MAX_CLASSES = 100_000
MAX_STRING_BYTES = 10_000  # any str in the bundle, keys included
MAX_MAP_ENTRIES = 1_000  # profile / metrics entries
MAX_LATENT_DIM = 100_000
MAX_SEED = 2**64 - 1
# The whole file: the model, the label counts (<= 9 bytes each) and the small maps.
_MAX_FILE_BYTES = MAX_MODEL_BYTES + 9 * MAX_CLASSES + (1 << 24)

_SCALARS = (str, int, float, bool, type(None))
_REQUIRED_KEYS = frozenset(
    {
        "schema_version",
        "kind",
        "model_onnx",
        "sha256",
        "arch",
        "num_classes",
        "input_shape",
        "label_counts",
        "num_examples",
        "profile",
        "metrics",
        "seed",
        "sdk_version",
    }
)
_OPTIONAL_KEYS = frozenset({"latent_dim"})


@dataclass(frozen=True, kw_only=True)
class Bundle:
    """One device's upload. ``input_shape`` is (C, H, W); ``label_counts`` has one count per class.

    ``profile`` is the device profile summary (``name`` plus budgets) and ``metrics`` the local results
    (val_accuracy, flops, ...); both map str to str/int/float/bool/None. Lists are accepted for the
    tuple fields and stored as tuples.
    """

    kind: str
    model_onnx: bytes
    arch: str
    num_classes: int
    input_shape: tuple[int, int, int]
    label_counts: tuple[int, ...]
    num_examples: int
    profile: Mapping[str, Any]
    metrics: Mapping[str, Any]
    seed: int
    sdk_version: str
    latent_dim: int | None = None
    schema_version: int = SCHEMA_VERSION

    def __post_init__(self) -> None:
        if _int(self.schema_version) != SCHEMA_VERSION:
            raise BundleError(_schema_message(self.schema_version))
        if not isinstance(self.kind, str) or self.kind not in KINDS:
            raise BundleError(f"kind must be one of {KINDS}, got {self.kind!r}")
        if not isinstance(self.model_onnx, bytes | bytearray | memoryview):
            raise BundleError(f"model_onnx must be bytes, got {type(self.model_onnx).__name__}")
        object.__setattr__(self, "model_onnx", bytes(self.model_onnx))
        if not 0 < len(self.model_onnx) <= MAX_MODEL_BYTES:
            raise BundleError(f"model_onnx must hold 1 B to 1 GiB, got {len(self.model_onnx)} bytes")
        _check_str("arch", self.arch)
        _check_str("sdk_version", self.sdk_version)
        _check_int("num_classes", self.num_classes, 1, MAX_CLASSES)
        object.__setattr__(self, "input_shape", _int_tuple("input_shape", self.input_shape))
        if len(self.input_shape) != 3 or any(v < 1 for v in self.input_shape):
            raise BundleError(f"input_shape must be three positive ints (C, H, W), got {self.input_shape}")
        object.__setattr__(self, "label_counts", _int_tuple("label_counts", self.label_counts))
        if len(self.label_counts) != self.num_classes:
            raise BundleError(
                f"label_counts must have one entry per class (num_classes={self.num_classes}), got "
                f"{len(self.label_counts)}; fix: count labels over range(num_classes) of the training split"
            )
        if any(v < 0 for v in self.label_counts):
            raise BundleError(f"label_counts must be >= 0, got {min(self.label_counts)}")
        _check_int("num_examples", self.num_examples, 1, None)
        if sum(self.label_counts) != self.num_examples:
            raise BundleError(
                f"sum(label_counts) must equal num_examples (the same training split), got "
                f"{sum(self.label_counts)} != {self.num_examples}"
            )
        object.__setattr__(self, "profile", _scalar_map("profile", self.profile))
        object.__setattr__(self, "metrics", _scalar_map("metrics", self.metrics))
        name = self.profile.get("name")
        if not isinstance(name, str) or not name:
            raise BundleError(f"profile must have a non-empty str 'name', got {name!r}")
        _check_int("seed", self.seed, 0, MAX_SEED)
        if self.kind == "cvae_decoder":
            if self.latent_dim is None:
                raise BundleError(
                    "a cvae_decoder bundle needs latent_dim (the decoder's noise size), got None"
                )
            _check_int("latent_dim", self.latent_dim, 1, MAX_LATENT_DIM)
        elif self.latent_dim is not None:
            raise BundleError(
                f"latent_dim is only for cvae_decoder bundles, got {self.latent_dim!r} on a {self.kind}"
            )

    @cached_property
    def sha256(self) -> str:
        """Hex sha256 of ``model_onnx`` (computed once; the bundle is immutable)."""
        return hashlib.sha256(self.model_onnx).hexdigest()

    def manifest(self) -> dict[str, Any]:
        """Everything but the model bytes, JSON-friendly (for ``edge-sdk inspect``), plus its size."""
        out = {k: v for k, v in _wire_map(self).items() if k != "model_onnx"}
        out["model_onnx_size_bytes"] = len(self.model_onnx)
        return dict(sorted(out.items()))


def bundle_to_bytes(bundle: Bundle) -> bytes:
    """Deterministic msgpack encoding (sorted keys, bin for bytes, float64)."""
    if not isinstance(bundle, Bundle):
        raise BundleError(f"expected a Bundle, got {type(bundle).__name__}")
    return msgpack.packb(_wire_map(bundle), use_bin_type=True, use_single_float=False)


def bundle_from_bytes(data: bytes, *, source: str = "<bytes>") -> Bundle:
    """Decode and fully validate a bundle; every refusal is a BundleError naming ``source``."""
    obj = unpack_map(
        data,
        source=source,
        what="bundle",
        max_bytes=_MAX_FILE_BYTES,
        max_bin=MAX_MODEL_BYTES,
        max_str=MAX_STRING_BYTES,
        max_array=MAX_CLASSES,
        max_map=MAX_MAP_ENTRIES,
    )
    version = obj.get("schema_version")
    if _int(version) != SCHEMA_VERSION:
        raise BundleError(f"{source}: {_schema_message(version)}")
    keys = set(obj)
    missing, unknown = sorted(_REQUIRED_KEYS - keys), sorted(keys - _REQUIRED_KEYS - _OPTIONAL_KEYS)
    if missing or unknown:
        raise BundleError(
            f"{source}: bundle keys wrong: missing {missing}, unknown {unknown}; "
            f"expected {sorted(_REQUIRED_KEYS)} (+ optional {sorted(_OPTIONAL_KEYS)})"
        )
    recorded = obj.pop("sha256")
    try:
        bundle = Bundle(**obj)
    except BundleError as err:
        raise BundleError(f"{source}: {err}") from err
    if recorded != bundle.sha256:
        raise BundleError(
            f"{source}: model_onnx sha256 mismatch: recorded {str(recorded)[:80]!r}, computed "
            f"{bundle.sha256}; the file is corrupt, fetch it again"
        )
    return bundle


def write_bundle(bundle: Bundle, path: str | Path) -> Path:
    """Serialise first, then write atomically: a failure leaves neither a partial nor a temp file."""
    return atomic_write_bytes(path, bundle_to_bytes(bundle))


def read_bundle(path: str | Path) -> Bundle:
    """Read the whole file once (size-checked first) and decode it with :func:`bundle_from_bytes`."""
    path = Path(path)
    try:
        size = path.stat().st_size
        if size > _MAX_FILE_BYTES:
            raise BundleError(f"{path}: {size} bytes is larger than any valid bundle ({_MAX_FILE_BYTES})")
        data = path.read_bytes()
    except OSError as err:
        raise BundleError(f"cannot read bundle {path}: {err}") from err
    return bundle_from_bytes(data, source=str(path))


def _wire_map(bundle: Bundle) -> dict[str, Any]:
    out: dict[str, Any] = {
        "schema_version": bundle.schema_version,
        "kind": bundle.kind,
        "model_onnx": bundle.model_onnx,
        "sha256": bundle.sha256,
        "arch": bundle.arch,
        "num_classes": bundle.num_classes,
        "input_shape": list(bundle.input_shape),
        "label_counts": list(bundle.label_counts),
        "num_examples": bundle.num_examples,
        "profile": dict(bundle.profile),
        "metrics": dict(bundle.metrics),
        "seed": bundle.seed,
        "sdk_version": bundle.sdk_version,
    }
    if bundle.latent_dim is not None:
        out["latent_dim"] = bundle.latent_dim
    return _sorted(out)


def _sorted(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _sorted(value[k]) for k in sorted(value)}
    if isinstance(value, list):
        return [_sorted(v) for v in value]
    return value


def _schema_message(version: object) -> str:
    if isinstance(version, int) and not isinstance(version, bool) and version > SCHEMA_VERSION:
        return (
            f"bundle schema {version} is newer than this SDK's {SCHEMA_VERSION}; "
            "upgrade the toolkit (pip install -U oneshot-fl-edge) to read it"
        )
    return (
        f"bundle schema_version must be {SCHEMA_VERSION}, got {version!r}; re-export the bundle with this SDK"
    )


def _int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _check_int(name: str, value: object, low: int, high: int | None) -> None:
    ok = _int(value) is not None and low <= value and (high is None or value <= high)  # type: ignore[operator]
    if not ok:
        bound = f"[{low}, {high}]" if high is not None else f">= {low}"
        raise BundleError(f"{name} must be an int in {bound}, got {value!r}")


def _check_str(name: str, value: object) -> None:
    if not isinstance(value, str) or not value or len(value.encode("utf-8")) > MAX_STRING_BYTES:
        shown = value[:80] + "..." if isinstance(value, str) and len(value) > 80 else value
        raise BundleError(
            f"{name} must be a non-empty str of at most {MAX_STRING_BYTES} bytes, got {shown!r}"
        )


def _int_tuple(name: str, value: object) -> tuple[int, ...]:
    if isinstance(value, str | bytes) or not isinstance(value, Sequence):
        raise BundleError(f"{name} must be a sequence of ints, got {type(value).__name__}")
    if len(value) > MAX_CLASSES:
        raise BundleError(f"{name} must have at most {MAX_CLASSES} entries, got {len(value)}")
    bad = [v for v in value if _int(v) is None]
    if bad:
        raise BundleError(f"{name} must hold ints only, got {bad[0]!r}")
    return tuple(value)


def _scalar_map(name: str, value: object) -> dict[str, Any]:
    if not isinstance(value, Mapping):
        raise BundleError(f"{name} must be a map of str to scalars, got {type(value).__name__}")
    if len(value) > MAX_MAP_ENTRIES:
        raise BundleError(f"{name} must have at most {MAX_MAP_ENTRIES} entries, got {len(value)}")
    out: dict[str, Any] = {}
    for key, item in value.items():
        _check_str(f"{name} key", key)
        if not isinstance(item, _SCALARS):
            raise BundleError(
                f"{name}[{key!r}] must be str, int, float, bool or None, got {type(item).__name__}; "
                "fix: flatten it or json.dumps it"
            )
        if isinstance(item, str) and len(item.encode("utf-8")) > MAX_STRING_BYTES:
            raise BundleError(f"{name}[{key!r}] is longer than {MAX_STRING_BYTES} bytes")
        if isinstance(item, int) and not isinstance(item, bool) and not -(2**63) <= item <= MAX_SEED:
            raise BundleError(f"{name}[{key!r}] = {item} does not fit in 64 bits")
        out[key] = _plain(item)
    return dict(sorted(out.items()))


def _plain(item: Any) -> Any:
    """Builtin types only (a numpy float64 is a float subclass): what is stored is what is read back."""
    if item is None or isinstance(item, bool):
        return item
    if isinstance(item, str):
        return str(item)
    return int(item) if isinstance(item, int) else float(item)
