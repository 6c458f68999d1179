"""The deployable classifier's metadata: what a runtime needs to use an ONNX model without this toolkit.

Every classifier a user may deploy (the server's ``global.onnx``, a device's ``deploy.onnx`` fp32 or int8,
the classifier inside a bundle) carries three ``metadata_props`` keys besides its provenance, so that
onnxruntime alone (``InferenceSession.get_modelmeta().custom_metadata_map``, or the C API's
``OrtApi::ModelMetadataLookupCustomMetadataMap``) can label its outputs and prepare its input:

* ``deploy_schema``: the schema version, ``"1"``; a reader refuses a version it does not know.
* ``class_names``: a JSON list of str, one per logit, in logit order (a FedOV model's extra "unknown"
  logit is named :data:`UNKNOWN_CLASS`).
* ``input_spec``: a JSON object: ``name`` of the input, ``shape`` [C, H, W] (the batch axis, first, is
  dynamic), ``dtype`` ``"float32"``, ``layout`` ``"NCHW"`` (C = 1 greyscale, C = 3 RGB), the raw
  ``pixel_range`` of the images the model learnt from ([0, 255]: every dataset is held as uint8, the
  8x8 digits rescaled from 0..16), the ``input_range`` the model takes (a pixel ``p`` goes in as
  ``(p - pixel_range[0]) / (pixel_range[1] - pixel_range[0])`` scaled onto it), and the per-channel
  ``mean`` / ``std`` of the normalisation, with ``normalization`` saying who applies it: ``"inside"``
  (the model computes ``(x - mean) / std`` itself; feed it ``x`` in ``input_range``) or ``"outside"``.

A model file may have come from anywhere: :func:`check_metadata_props` bounds every key and value before
one is decoded, and :func:`read_deploy_metadata` checks the JSON types and the class count against the
logits. Stdlib only, so the ONNX contract (``export.onnx_parse``) and every exporter can use it.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from common.checks import check_input_shape, check_int, check_str, is_number, load_json
from common.errors import BundleError, ToolkitError
from export.wire import MAX_CLASSES, MAX_INPUT_CHANNELS, MAX_INPUT_ELEMENTS

__all__ = [
    "CLASS_NAMES_KEY",
    "DEPLOY_KEYS",
    "INPUT_SPEC_KEY",
    "MAX_CLASS_NAME_BYTES",
    "MAX_METADATA_ENTRIES",
    "MAX_METADATA_KEY_BYTES",
    "MAX_METADATA_VALUE_BYTES",
    "METADATA_VERSION",
    "NORMALIZATIONS",
    "SCHEMA_KEY",
    "UNKNOWN_CLASS",
    "DeployMetadata",
    "InputSpec",
    "check_class_names",
    "check_metadata_props",
    "deploy_metadata",
    "index_class_names",
    "read_deploy_metadata",
]

METADATA_VERSION = 1
SCHEMA_KEY = "deploy_schema"
CLASS_NAMES_KEY = "class_names"
INPUT_SPEC_KEY = "input_spec"
DEPLOY_KEYS = (SCHEMA_KEY, CLASS_NAMES_KEY, INPUT_SPEC_KEY)
UNKNOWN_CLASS = "<unknown>"  # FedOV's extra logit: "none of the task's classes"
NORMALIZATIONS = ("inside", "outside")
DTYPE = "float32"
LAYOUT = "NCHW"
# Bounds of what a reader decodes. 10,000 class names (export.wire.MAX_CLASSES) of up to 100 bytes, quoted
# and comma-separated, fit in 1 MiB with room to spare; a whole metadata set of ours holds < 20 keys.
MAX_CLASS_NAME_BYTES = 100
MAX_METADATA_VALUE_BYTES = 1 << 20
MAX_METADATA_KEY_BYTES = 256
MAX_METADATA_ENTRIES = 64
_MAX_SPEC_BYTES = 4_096  # an input spec of 16 channels is about 400 bytes
_SPEC_FIELDS = (
    "name",
    "shape",
    "dtype",
    "layout",
    "pixel_range",
    "input_range",
    "mean",
    "std",
    "normalization",
)
_FIX = "re-export the model with the toolkit's exporters, which write this metadata"


@dataclass(frozen=True, kw_only=True)
class InputSpec:
    """What one input sample is and how a raw image becomes it (see the module docstring).

    ``mean`` / ``std`` have one value per channel; ``std`` > 0; each range is (low, high) with low < high.
    """

    name: str
    shape: tuple[int, int, int]
    mean: tuple[float, ...]
    std: tuple[float, ...]
    pixel_range: tuple[float, float] = (0.0, 255.0)
    input_range: tuple[float, float] = (0.0, 1.0)
    normalization: str = "inside"
    dtype: str = DTYPE
    layout: str = LAYOUT

    def __post_init__(self) -> None:
        error = BundleError  # a spec is read from model files: the wire's error
        check_str("input_spec name", self.name, max_bytes=MAX_METADATA_KEY_BYTES, error=error)
        shape = check_input_shape(
            "input_spec shape",
            self.shape,
            max_channels=MAX_INPUT_CHANNELS,
            max_elements=MAX_INPUT_ELEMENTS,
            error=error,
        )
        object.__setattr__(self, "shape", shape)
        for name in ("mean", "std"):
            values = _numbers(f"input_spec {name}", getattr(self, name), shape[0], error)
            if name == "std" and any(v <= 0 for v in values):
                raise error(f"input_spec std must be > 0 in every channel, got {list(values)}; fix: {_FIX}")
            object.__setattr__(self, name, values)
        for name in ("pixel_range", "input_range"):
            low, high = _numbers(f"input_spec {name}", getattr(self, name), 2, error)
            if not low < high:
                raise error(
                    f"input_spec {name} must be [low, high] with low < high, got [{low}, {high}]; fix: {_FIX}"
                )
            object.__setattr__(self, name, (low, high))
        for name, allowed in (("normalization", NORMALIZATIONS), ("dtype", (DTYPE,)), ("layout", (LAYOUT,))):
            if getattr(self, name) not in allowed:
                raise error(
                    f"input_spec {name} must be one of {list(allowed)}, got {getattr(self, name)!r}; "
                    f"fix: {_FIX}"
                )

    def to_dict(self) -> dict[str, Any]:
        """The JSON object written as ``input_spec`` (lists, not tuples)."""
        values = {name: getattr(self, name) for name in _SPEC_FIELDS}
        return {name: list(v) if isinstance(v, tuple) else v for name, v in values.items()}


@dataclass(frozen=True, kw_only=True)
class DeployMetadata:
    """The schema's content, as read back from a model."""

    class_names: tuple[str, ...]
    input_spec: InputSpec
    version: int = METADATA_VERSION


def index_class_names(num_classes: int) -> tuple[str, ...]:
    """``("0", "1", ...)``: the names of classes nobody named (and of digits, MNIST and SVHN)."""
    return tuple(str(i) for i in range(check_int("num_classes", num_classes, 1, MAX_CLASSES)))


def deploy_metadata(class_names: Sequence[str], input_spec: InputSpec) -> dict[str, str]:
    """The schema's three ``metadata_props`` entries for a classifier with one logit per class name.

    Raises BundleError on names its reader would refuse, so no model is written with metadata that
    cannot be read back.
    """
    if not isinstance(input_spec, InputSpec):
        raise BundleError(f"input_spec must be an InputSpec, got {type(input_spec).__name__}")
    names = check_class_names(class_names)
    props = {
        SCHEMA_KEY: str(METADATA_VERSION),
        CLASS_NAMES_KEY: json.dumps(list(names), ensure_ascii=False),
        INPUT_SPEC_KEY: json.dumps(input_spec.to_dict(), sort_keys=True),
    }
    check_metadata_props(props.items(), source="deploy metadata")
    return props


def check_metadata_props(
    entries: Iterable[tuple[object, object]], *, source: str, error: type[ToolkitError] = BundleError
) -> dict[str, str]:
    """The (key, value) pairs of a model's ``metadata_props`` as a dict, once bounded: at most
    :data:`MAX_METADATA_ENTRIES` entries, keys non-empty str of at most :data:`MAX_METADATA_KEY_BYTES`,
    values str of at most :data:`MAX_METADATA_VALUE_BYTES` UTF-8 bytes, no key twice."""
    props: dict[str, str] = {}
    for count, (key, value) in enumerate(entries, start=1):
        if count > MAX_METADATA_ENTRIES:
            raise error(
                f"{source}: more than {MAX_METADATA_ENTRIES} metadata entries, expected at most that many; "
                f"fix: {_FIX}"
            )
        check_str(f"{source}: metadata key", key, max_bytes=MAX_METADATA_KEY_BYTES, error=error)
        if (
            not isinstance(value, str)
            or len(value) > MAX_METADATA_VALUE_BYTES
            or (len(value.encode("utf-8", "surrogatepass")) > MAX_METADATA_VALUE_BYTES)
        ):
            size = f"{len(value)} characters" if isinstance(value, str) else type(value).__name__
            raise error(
                f"{source}: metadata {str(key)[:80]!r} must be a str of at most {MAX_METADATA_VALUE_BYTES} "
                f"bytes, got {size}; fix: {_FIX}"
            )
        if key in props:
            raise error(f"{source}: metadata key {str(key)[:80]!r} appears twice, expected once; fix: {_FIX}")
        props[key] = value  # type: ignore[index]
    return props


def read_deploy_metadata(
    props: Mapping[str, str],
    *,
    num_logits: int | None = None,
    source: str = "model",
    error: type[ToolkitError] = BundleError,
) -> DeployMetadata | None:
    """The schema read back from bounded ``props`` (:func:`check_metadata_props`), or None when the model
    has none of its keys (an older export). Some keys without the others, an unknown version, JSON that is
    not what the schema says, or class names that are not one per logit (``num_logits`` when given)
    raise ``error``."""
    present = [key for key in DEPLOY_KEYS if key in props]
    if not present:
        return None
    if len(present) != len(DEPLOY_KEYS):
        missing = sorted(set(DEPLOY_KEYS) - set(present))
        raise error(
            f"{source}: metadata has {present} but lacks {missing}, expected all of them; fix: {_FIX}"
        )
    version = props[SCHEMA_KEY]
    if version != str(METADATA_VERSION):
        raise error(
            f"{source}: deploy_schema {version[:20]!r} is not a version this reader knows "
            f"({METADATA_VERSION}); fix: upgrade the toolkit or re-export the model"
        )
    text = _json(props[CLASS_NAMES_KEY], CLASS_NAMES_KEY, MAX_METADATA_VALUE_BYTES, source, error)
    names = check_class_names(text, num_classes=num_logits, error=error, source=source)
    raw = _json(props[INPUT_SPEC_KEY], INPUT_SPEC_KEY, _MAX_SPEC_BYTES, source, error)
    if not isinstance(raw, dict) or set(raw) != set(_SPEC_FIELDS):
        got = sorted(raw) if isinstance(raw, dict) else type(raw).__name__
        raise error(f"{source}: input_spec must be an object with keys {sorted(_SPEC_FIELDS)}, got {got}")
    try:
        spec = InputSpec(**{k: tuple(v) if isinstance(v, list) else v for k, v in raw.items()})
    except (BundleError, UnicodeEncodeError) as err:  # UnicodeEncodeError: a lone surrogate in the name
        raise error(f"{source}: input_spec is malformed: {err}; fix: {_FIX}") from err
    return DeployMetadata(class_names=names, input_spec=spec)


def _json(text: str, key: str, max_bytes: int, source: str, error: type[ToolkitError]) -> Any:
    if len(text) > max_bytes:
        raise error(f"{source}: {key} is {len(text)} characters, expected at most {max_bytes}; fix: {_FIX}")
    try:
        return load_json(text, key, max_bytes=max_bytes, error=error)
    except ToolkitError as err:
        raise error(f"{source}: {key} is not JSON ({err}); fix: {_FIX}") from err


def check_class_names(
    value: object,
    *,
    num_classes: int | None = None,
    source: str = "class_names",
    error: type[ToolkitError] = BundleError,
) -> tuple[str, ...]:
    """``value`` (a list or tuple) as class names: 1 to MAX_CLASSES non-empty, unique str of at most
    :data:`MAX_CLASS_NAME_BYTES` UTF-8 bytes, exactly ``num_classes`` of them when given."""
    if not isinstance(value, list | tuple) or not 1 <= len(value) <= MAX_CLASSES:
        got = f"{len(value)} entries" if isinstance(value, list | tuple) else type(value).__name__
        raise error(f"{source}: class_names must be a list of 1 to {MAX_CLASSES} str, got {got}; fix: {_FIX}")
    if num_classes is not None and len(value) != num_classes:
        raise error(
            f"{source}: {len(value)} class names for {num_classes} classes (logits), expected one name "
            "each; fix: name every class once, in label order"
        )
    try:
        names = tuple(
            check_str(f"class_names[{i}]", name, max_bytes=MAX_CLASS_NAME_BYTES, error=error)
            for i, name in enumerate(value)
        )
    except UnicodeEncodeError as err:  # a JSON escape of a lone surrogate decodes but is no UTF-8 text
        raise error(
            f"{source}: class_names must be UTF-8 text, got {err.object[:40]!r}; fix: {_FIX}"
        ) from err
    if len(set(names)) != len(names):
        repeated = sorted(n for n, count in Counter(names).items() if count > 1)[:5]
        raise error(
            f"{source}: class_names must be unique, got {repeated} more than once; fix: name each class once"
        )
    return names


def _numbers(name: str, value: object, length: int, error: type[ToolkitError]) -> tuple[float, ...]:
    if not isinstance(value, list | tuple) or len(value) != length or not all(is_number(v) for v in value):
        raise error(f"{name} must be {length} finite numbers, got {value!r:.200}; fix: {_FIX}")
    return tuple(float(v) for v in value)  # type: ignore[union-attr]
