"""The bundle: what a device uploads, as one msgpack map in one file.

A bundle carries the BN-preserving ONNX model, the facts the server needs to use it without the
client's data (architecture string, input shape, per-class label counts of the local training split)
and provenance (device profile summary, metrics, seed, SDK version). The server trusts nothing it reads:
every field is type- and range-checked (bounds in :mod:`export.wire`), the recorded ``sha256`` must match
the whole map (:func:`export.wire.canonical_sha256`: every field but ``sha256``, so a flipped byte in the
metrics or the label counts is caught like one in the model), and msgpack is decoded with size limits so
a hostile file cannot ask for gigabytes before being refused.

Schema 1 hashed only the ONNX bytes; it is refused. :func:`upgrade_bundle` rewrites a schema-1 bundle
you made yourself (``edge-sdk upgrade``): it vouches for the manifest as it is now, so it is no tool for
bundles from devices.

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

from common.checks import check_input_shape, check_int, check_ints, check_str, is_int, read_regular_file
from common.errors import BundleError, ConfigError
from export.atomic import atomic_write_bytes
from export.wire import (
    MAX_CLASSES,
    MAX_DECODER_CLASSES,
    MAX_EXAMPLES,
    MAX_INPUT_CHANNELS,
    MAX_INPUT_ELEMENTS,
    MAX_LATENT_DIM,
    canonical_bytes,
    canonical_sha256,
    unpack_map,
)

__all__ = [
    "KINDS",
    "MAX_BUNDLE_BYTES",
    "MAX_CLASSES",
    "MAX_MODEL_BYTES",
    "MAX_STRING_BYTES",
    "SCHEMA_VERSION",
    "Bundle",
    "bundle_from_bytes",
    "bundle_to_bytes",
    "client_names",
    "read_bundle",
    "upgrade_bundle",
    "write_bundle",
]

SCHEMA_VERSION: int = 2  # 2: sha256 covers the whole map (1: the ONNX bytes only)
KINDS = ("classifier", "cvae_decoder")

MAX_MODEL_BYTES = 1 << 30  # 1 GiB of ONNX
MAX_STRING_BYTES = 10_000  # any str in the bundle, keys included
MAX_MAP_ENTRIES = 1_000  # profile / metrics entries
MAX_SEED = 2**64 - 1
# The whole file (or bytes from a device): the model, the label counts (<= 9 bytes each) and the small maps.
MAX_BUNDLE_BYTES = MAX_MODEL_BYTES + 9 * MAX_CLASSES + (1 << 24)

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
_OPTIONAL_KEYS = frozenset({"latent_dim", "unknown_output"})


@dataclass(frozen=True, kw_only=True)
class Bundle:
    """One device's upload. ``input_shape`` is (C, H, W); ``label_counts`` has one count per class.

    ``profile`` is the device profile summary (``name`` plus budgets) and ``metrics`` the local results
    (val_accuracy, flops, ...); both map str to str/int/float/bool/None. Lists are accepted for the
    tuple fields and stored as tuples.

    ``unknown_output`` (classifiers only, FedOV): the model has ``num_classes + 1`` outputs, the last one
    "none of my classes", trained on corrupted local images so the teacher can abstain on what it never
    saw. Written only when true, so the manifest (and hash) of every other bundle is what it always was.
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
    unknown_output: bool = False
    schema_version: int = SCHEMA_VERSION

    def __post_init__(self) -> None:
        if not is_int(self.schema_version) or self.schema_version != SCHEMA_VERSION:
            raise BundleError(_schema_message(self.schema_version))
        if not isinstance(self.kind, str) or self.kind not in KINDS:
            raise BundleError(f"kind must be one of {KINDS}, got {self.kind!r}")
        if not isinstance(self.model_onnx, bytes | bytearray | memoryview):
            raise BundleError(f"model_onnx must be bytes, got {type(self.model_onnx).__name__}")
        self._set("model_onnx", bytes(self.model_onnx))
        if not 0 < len(self.model_onnx) <= MAX_MODEL_BYTES:
            raise BundleError(f"model_onnx must hold 1 B to 1 GiB, got {len(self.model_onnx)} bytes")
        check_str("arch", self.arch, max_bytes=MAX_STRING_BYTES, error=BundleError)
        check_str("sdk_version", self.sdk_version, max_bytes=MAX_STRING_BYTES, error=BundleError)
        decoder = self.kind == "cvae_decoder"
        # a decoder's one-hot conditioning costs the server an L x L matrix: a tighter cap (export.wire)
        max_classes = MAX_DECODER_CLASSES if decoder else MAX_CLASSES
        label = "num_classes of a cvae_decoder" if decoder else "num_classes"
        self._set("num_classes", check_int(label, self.num_classes, 1, max_classes, error=BundleError))
        shape = check_input_shape(
            "input_shape",
            self.input_shape,
            max_channels=MAX_INPUT_CHANNELS,
            max_elements=MAX_INPUT_ELEMENTS,
            error=BundleError,
        )
        self._set("input_shape", shape)
        counts = check_ints(
            "label_counts", self.label_counts, 0, MAX_EXAMPLES, max_length=max_classes, error=BundleError
        )
        self._set("label_counts", counts)
        if len(self.label_counts) != self.num_classes:
            raise BundleError(
                f"label_counts must have one entry per class (num_classes={self.num_classes}), got "
                f"{len(self.label_counts)}; fix: count labels over range(num_classes) of the training split"
            )
        self._set(
            "num_examples", check_int("num_examples", self.num_examples, 1, MAX_EXAMPLES, error=BundleError)
        )
        if sum(self.label_counts) != self.num_examples:
            raise BundleError(
                f"sum(label_counts) must equal num_examples (the same training split), got "
                f"{sum(self.label_counts)} != {self.num_examples}"
            )
        self._set("profile", _scalar_map("profile", self.profile))
        self._set("metrics", _scalar_map("metrics", self.metrics))
        name = self.profile.get("name")
        if not isinstance(name, str) or not name:
            raise BundleError(f"profile must have a non-empty str 'name', got {name!r}")
        self._set("seed", check_int("seed", self.seed, 0, MAX_SEED, error=BundleError))
        if decoder:
            if self.latent_dim is None:
                raise BundleError(
                    "a cvae_decoder bundle needs latent_dim (the decoder's noise size), got None"
                )
            self._set(
                "latent_dim", check_int("latent_dim", self.latent_dim, 1, MAX_LATENT_DIM, error=BundleError)
            )
        elif self.latent_dim is not None:
            raise BundleError(
                f"latent_dim is only for cvae_decoder bundles, got {self.latent_dim!r} on a {self.kind}"
            )
        if not isinstance(self.unknown_output, bool):
            raise BundleError(f"unknown_output must be a bool, got {type(self.unknown_output).__name__}")
        if self.unknown_output and decoder:
            raise BundleError("unknown_output is only for classifier bundles, got it on a cvae_decoder")
        if self.unknown_output and self.num_classes >= MAX_CLASSES:
            raise BundleError(f"an unknown output needs num_classes < {MAX_CLASSES}, got {self.num_classes}")

    @property
    def num_outputs(self) -> int:
        """Columns of the model's output: one per class, plus the "unknown" one when there is one."""
        return self.num_classes + int(self.unknown_output)

    def _set(self, name: str, value: Any) -> None:
        """Store the validated (normalised) value: the dataclass is frozen."""
        object.__setattr__(self, name, value)

    @cached_property
    def sha256(self) -> str:
        """Hex sha256 of the whole bundle but this field (:func:`export.wire.canonical_sha256`): what the
        file records, so it identifies the upload (model and manifest). Computed once; it is immutable."""
        return canonical_sha256(_wire_map(self))

    @cached_property
    def model_sha256(self) -> str:
        """Hex sha256 of ``model_onnx`` alone: the model's identity, which a package names its client by."""
        return hashlib.sha256(self.model_onnx).hexdigest()

    def manifest(self) -> dict[str, Any]:
        """Everything but the model bytes, JSON-friendly (``edge-sdk inspect``), plus its size and hashes."""
        out = {k: v for k, v in _wire_map(self).items() if k != "model_onnx"}
        out["sha256"] = self.sha256
        out["model_onnx_size_bytes"] = len(self.model_onnx)
        out["model_sha256"] = self.model_sha256
        return dict(sorted(out.items()))


def bundle_to_bytes(bundle: Bundle) -> bytes:
    """Deterministic msgpack encoding (:func:`export.wire.canonical_bytes`) with the map's sha256."""
    if not isinstance(bundle, Bundle):
        raise BundleError(f"expected a Bundle, got {type(bundle).__name__}")
    return canonical_bytes({**_wire_map(bundle), "sha256": bundle.sha256})


def bundle_from_bytes(data: bytes, *, source: str = "<bytes>") -> Bundle:
    """Decode and fully validate a bundle; every refusal is a BundleError naming ``source``.

    The hash is checked before the fields, so a corrupt file is reported as corrupt, not as whichever
    field the flip landed in.
    """
    obj = _decode(data, source)
    version = obj.get("schema_version")
    if not is_int(version) or version != SCHEMA_VERSION:
        raise BundleError(f"{source}: {_schema_message(version)}")
    _check_keys(obj, source)
    recorded = obj.pop("sha256")
    computed = canonical_sha256(obj)
    if recorded != computed:
        raise BundleError(
            f"{source}: sha256 mismatch: recorded {str(recorded)[:80]!r}, computed {computed} over the "
            "whole bundle; the file is corrupt or was altered after export, fetch it again"
        )
    return _construct(obj, source)


def write_bundle(bundle: Bundle, path: str | Path) -> Path:
    """Serialise first, then write atomically: a failure leaves neither a partial nor a temp file."""
    return atomic_write_bytes(path, bundle_to_bytes(bundle))


def read_bundle(path: str | Path) -> Bundle:
    """Read the whole file once (size-checked first) and decode it with :func:`bundle_from_bytes`."""
    path = Path(path)
    return bundle_from_bytes(_read(path), source=str(path))


def upgrade_bundle(path: str | Path) -> bool:
    """Rewrite a schema-1 bundle at ``path`` in place (atomically) as the current schema.

    Schema 1's sha256 covered the ONNX bytes only; that hash is verified, then the manifest is validated
    with today's bounds and hashed as it stands. Returns False (and writes nothing) when the file already
    is the current schema. Only for bundles you made: an upgrade vouches for a manifest nothing protected.
    """
    path = Path(path)
    data = _read(path)
    obj = _decode(data, str(path))
    version = obj.get("schema_version")
    if is_int(version) and version == SCHEMA_VERSION:
        bundle_from_bytes(data, source=str(path))  # verified, nothing to do
        return False
    if not is_int(version) or version != 1:
        raise BundleError(
            f"{path}: only schema-1 bundles can be upgraded, got schema_version {version!r}; "
            "re-export the bundle with this SDK"
        )
    _check_keys(obj, str(path))
    recorded, model = obj.pop("sha256"), obj.get("model_onnx")
    if not isinstance(model, bytes) or recorded != hashlib.sha256(model).hexdigest():
        raise BundleError(f"{path}: schema-1 model_onnx sha256 mismatch; the file is corrupt, re-export it")
    write_bundle(_construct({**obj, "schema_version": SCHEMA_VERSION}, str(path)), path)
    return True


def client_names(paths: Sequence[str | Path]) -> list[str]:
    """One output name per bundle path (``<name>.package``, ``<name>.onnx``) that no two bundles share.

    Bundles carry no client id, so the name is the file's stem; stems that repeat (``a/client_00.bundle``
    and ``b/client_00.bundle``) get their position appended (``client_00-0``, ``client_00-1``). Names are
    compared case-insensitively (macOS and Windows file systems), and a file given twice is refused, so
    nothing is ever overwritten by a sibling output. Raises ConfigError before anything is written.
    """
    resolved = [Path(p).resolve() for p in paths]
    twice = sorted({str(p) for p in resolved if resolved.count(p) > 1})
    if twice:
        raise ConfigError(f"bundles must be distinct files, got {twice} more than once; pass each once")
    stems = [Path(p).stem for p in paths]
    folded = [stem.casefold() for stem in stems]
    names = [stem if folded.count(stem.casefold()) == 1 else f"{stem}-{i}" for i, stem in enumerate(stems)]
    clash = sorted({n for n in names if [m.casefold() for m in names].count(n.casefold()) > 1})
    if clash:
        raise ConfigError(
            f"bundle file names give the same output name {clash}; rename the bundles so their stems differ"
        )
    return names


def _read(path: Path) -> bytes:
    """A regular file of at most MAX_BUNDLE_BYTES (a FIFO would block the round, /dev/zero fill memory)."""
    return read_regular_file(path, max_bytes=MAX_BUNDLE_BYTES, what="bundle", error=BundleError)


def _decode(data: bytes, source: str) -> dict[str, Any]:
    return unpack_map(
        data,
        source=source,
        what="bundle",
        max_bytes=MAX_BUNDLE_BYTES,
        max_bin=MAX_MODEL_BYTES,
        max_str=MAX_STRING_BYTES,
        max_array=MAX_CLASSES,
        max_map=MAX_MAP_ENTRIES,
    )


def _check_keys(obj: dict[str, Any], source: str) -> None:
    keys = set(obj)
    missing, unknown = sorted(_REQUIRED_KEYS - keys), sorted(keys - _REQUIRED_KEYS - _OPTIONAL_KEYS)
    if missing or unknown:
        raise BundleError(
            f"{source}: bundle keys wrong: missing {missing}, unknown {unknown}; "
            f"expected {sorted(_REQUIRED_KEYS)} (+ optional {sorted(_OPTIONAL_KEYS)})"
        )
    if "latent_dim" in obj and obj["latent_dim"] is None:  # the writer omits it: nil would hash differently
        raise BundleError(f"{source}: latent_dim must be omitted when unset, got nil")
    if "unknown_output" in obj and obj["unknown_output"] is not True:  # omitted when false, likewise
        got = obj["unknown_output"]
        raise BundleError(f"{source}: unknown_output must be omitted unless true, got {got!r}")


def _construct(fields: dict[str, Any], source: str) -> Bundle:
    try:
        return Bundle(**fields)
    except BundleError as err:
        raise BundleError(f"{source}: {err}") from err


def _wire_map(bundle: Bundle) -> dict[str, Any]:
    """Every field as written, but ``sha256`` (which is computed over this map)."""
    out: dict[str, Any] = {
        "schema_version": bundle.schema_version,
        "kind": bundle.kind,
        "model_onnx": bundle.model_onnx,
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
    if bundle.unknown_output:
        out["unknown_output"] = True
    return dict(sorted(out.items()))


def _schema_message(version: object) -> str:
    if is_int(version) and version > SCHEMA_VERSION:  # type: ignore[operator]
        return (
            f"bundle schema {version} is newer than this SDK's {SCHEMA_VERSION}; "
            "upgrade the toolkit (pip install -U oneshot-fl-edge) to read it"
        )
    if is_int(version) and version == 1:
        return (
            f"bundle schema 1 is no longer read (its sha256 covers the model only, not the manifest), "
            f"this SDK reads schema {SCHEMA_VERSION}; re-export the bundle with this SDK "
            "(edge-sdk run / export), or upgrade a bundle you made yourself with `edge-sdk upgrade FILE`"
        )
    return (
        f"bundle schema_version must be {SCHEMA_VERSION}, got {version!r}; re-export the bundle with this SDK"
    )


def _scalar_map(name: str, value: object) -> dict[str, Any]:
    if not isinstance(value, Mapping):
        raise BundleError(f"{name} must be a map of str to scalars, got {type(value).__name__}")
    if len(value) > MAX_MAP_ENTRIES:
        raise BundleError(f"{name} must have at most {MAX_MAP_ENTRIES} entries, got {len(value)}")
    out: dict[str, Any] = {}
    for key, item in value.items():
        check_str(f"{name} key", key, max_bytes=MAX_STRING_BYTES, error=BundleError)
        if not isinstance(item, _SCALARS):
            raise BundleError(
                f"{name}[{key!r}] must be str, int, float, bool or None, got {type(item).__name__}; "
                "fix: flatten it or json.dumps it"
            )
        if isinstance(item, str) and len(item.encode("utf-8")) > MAX_STRING_BYTES:
            raise BundleError(f"{name}[{key!r}] is longer than {MAX_STRING_BYTES} bytes")
        if is_int(item) and not -(2**63) <= item <= MAX_SEED:
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
