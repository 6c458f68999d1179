"""The deployment metadata schema: written by the exporters, read back exactly, kept by int8 quantization,
and every malformed or oversized piece refused by the reader and the load-time ONNX contract."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
import torch

from common.errors import BundleError, ConfigError, ExportError, TeacherError
from edge_sdk.data import PIXEL_MEAN, PIXEL_STD, deploy_metadata_for
from edge_sdk.models.arch import build_model
from export.bundle import Bundle, bundle_from_bytes, bundle_to_bytes
from export.metadata import (
    CLASS_NAMES_KEY,
    INPUT_SPEC_KEY,
    MAX_CLASS_NAME_BYTES,
    MAX_METADATA_ENTRIES,
    MAX_METADATA_VALUE_BYTES,
    SCHEMA_KEY,
    UNKNOWN_CLASS,
    InputSpec,
    check_metadata_props,
    deploy_metadata,
    index_class_names,
    read_deploy_metadata,
)
from export.onnx_check import check_classifier_onnx
from export.onnx_export import export_onnx, read_deploy, read_metadata
from export.quantize import quantize_int8

SHAPE = (1, 8, 8)
ARCH = "C4k3-P-F3"
NAMES = ("cat", "dog", "bird")


def _spec(**overrides: object) -> InputSpec:
    fields = dict(name="x", shape=SHAPE, mean=(0.5,), std=(0.5,))
    return InputSpec(**{**fields, **overrides})  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return build_model(ARCH, SHAPE, len(NAMES)).eval()


@pytest.fixture(scope="module")
def exported(model: torch.nn.Module) -> bytes:
    meta = {"arch": ARCH} | deploy_metadata_for(SHAPE, len(NAMES), NAMES)
    return export_onnx(model, SHAPE, metadata=meta, keep_batchnorm=False)


def _with_props(model_bytes: bytes, **changes: str | None) -> bytes:
    """The model with metadata entries replaced (None removes one)."""
    proto = onnx.load_from_string(model_bytes)
    props = {e.key: e.value for e in proto.metadata_props}
    props.update(changes)
    del proto.metadata_props[:]
    for key, value in props.items():
        if value is not None:
            entry = proto.metadata_props.add()
            entry.key, entry.value = key, value
    return proto.SerializeToString()


def _check(model_bytes: bytes, num_classes: int = len(NAMES)) -> onnx.ModelProto:
    return check_classifier_onnx(model_bytes, input_shape=SHAPE, num_classes=num_classes, source="c.bundle")


# ------------------------------------------------------------------------------------ round trip


def test_export_writes_the_schema_and_it_reads_back_exactly(exported: bytes) -> None:
    meta = read_metadata(exported)
    assert meta[SCHEMA_KEY] == "1" and meta["arch"] == ARCH
    assert json.loads(meta[CLASS_NAMES_KEY]) == list(NAMES)
    assert json.loads(meta[INPUT_SPEC_KEY]) == {
        "name": "x",
        "shape": [1, 8, 8],
        "dtype": "float32",
        "layout": "NCHW",
        "pixel_range": [0.0, 255.0],
        "input_range": [0.0, 1.0],
        "mean": [PIXEL_MEAN],
        "std": [PIXEL_STD],
        "normalization": "inside",
    }
    back = read_deploy(exported, num_logits=3)
    assert back is not None and back.class_names == NAMES and back.input_spec == _spec()
    _check(exported)  # the load-time contract accepts it


def test_metadata_changes_no_weight(model: torch.nn.Module, exported: bytes) -> None:
    plain = export_onnx(model, SHAPE, metadata={"arch": ARCH}, keep_batchnorm=False)
    assert read_deploy(plain) is None  # an export without the schema reads as None, not an error
    weights = [
        [
            (i.name, onnx.numpy_helper.to_array(i).tobytes())
            for i in onnx.load_from_string(b).graph.initializer
        ]
        for b in (plain, exported)
    ]
    assert weights[0] == weights[1]


def test_index_names_and_unknown_output() -> None:
    assert index_class_names(3) == ("0", "1", "2")
    props = deploy_metadata_for((3, 4, 4), 2, None, unknown_output=True)
    meta = read_deploy_metadata(props, num_logits=3)
    assert meta is not None and meta.class_names == ("0", "1", UNKNOWN_CLASS)
    assert meta.input_spec.mean == (PIXEL_MEAN,) * 3 and meta.input_spec.shape == (3, 4, 4)
    with pytest.raises(ConfigError, match="3 class names for 2 classes"):
        deploy_metadata_for((1, 4, 4), 2, ("a", "b", "c"))


def test_int8_quantization_keeps_every_entry(exported: bytes) -> None:
    calibration = np.random.default_rng(0).random((16, *SHAPE), dtype=np.float32)
    int8 = quantize_int8(exported, calibration)
    fp32_meta, int8_meta = read_metadata(exported), read_metadata(int8)
    assert {k: int8_meta[k] for k in fp32_meta} == fp32_meta
    assert read_deploy(int8, num_logits=3) == read_deploy(exported, num_logits=3)


# ------------------------------------------------------------------------------------- refusals


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({SCHEMA_KEY: None}, "lacks"),
        ({INPUT_SPEC_KEY: None}, "lacks"),
        ({SCHEMA_KEY: "2"}, "not a version this reader knows"),
        ({CLASS_NAMES_KEY: "[1, 2, 3]"}, r"class_names\[0\] must be a non-empty str"),
        ({CLASS_NAMES_KEY: '{"a": 1}'}, "must be a list"),
        ({CLASS_NAMES_KEY: "[not json"}, "not JSON"),
        ({CLASS_NAMES_KEY: '["a", "b"]'}, "2 class names for 3"),
        ({CLASS_NAMES_KEY: '["a", "a", "b"]'}, "unique"),
        ({CLASS_NAMES_KEY: '["a", "", "b"]'}, "non-empty"),
        ({CLASS_NAMES_KEY: json.dumps(["a", "b", "c" * (MAX_CLASS_NAME_BYTES + 1)])}, "at most 100 bytes"),
        ({CLASS_NAMES_KEY: '["a", "b", "\\ud800"]'}, "UTF-8"),
        ({CLASS_NAMES_KEY: "[" * 100_000}, "not JSON"),
        ({INPUT_SPEC_KEY: "[]"}, "input_spec must be an object"),
        ({INPUT_SPEC_KEY: "x" * 5000}, "at most 4096"),
    ],
)
def test_malformed_schema_is_refused(exported: bytes, changes: dict, match: str) -> None:
    bad = _with_props(exported, **changes)
    with pytest.raises(BundleError, match=match):
        read_deploy(bad, num_logits=3)
    with pytest.raises(TeacherError, match=match):  # the contract raises the caller's error kind
        check_classifier_onnx(bad, input_shape=SHAPE, num_classes=3, source="t", error=TeacherError)


@pytest.mark.parametrize(
    ("spec_changes", "match"),
    [
        ({"shape": [1, 8]}, "shape must be three integers"),
        ({"shape": [1, 8, 8.5]}, r"shape\[2\] must be an integer"),
        ({"mean": [0.5, 0.5]}, "mean must be 1 finite numbers"),
        ({"std": [0.0]}, "std must be > 0"),
        ({"std": ["0.5"]}, "std must be 1 finite numbers"),
        ({"pixel_range": [255, 0]}, "low < high"),
        ({"normalization": "twice"}, "normalization must be one of"),
        ({"dtype": "uint8"}, "dtype must be one of"),
        ({"layout": "NHWC"}, "layout must be one of"),
        ({"name": ""}, "name must be a non-empty str"),
        ({"extra": 1}, "keys"),
    ],
)
def test_malformed_input_spec_is_refused(exported: bytes, spec_changes: dict, match: str) -> None:
    spec = json.loads(read_metadata(exported)[INPUT_SPEC_KEY]) | spec_changes
    with pytest.raises(BundleError, match=match):
        _check(_with_props(exported, **{INPUT_SPEC_KEY: json.dumps(spec)}))


def test_a_spec_for_another_input_is_refused(exported: bytes) -> None:
    spec = json.loads(read_metadata(exported)[INPUT_SPEC_KEY])
    for changes in ({"shape": [1, 4, 16]}, {"name": "image"}):
        with pytest.raises(BundleError, match="the metadata's input_spec describes"):
            _check(_with_props(exported, **{INPUT_SPEC_KEY: json.dumps(spec | changes)}))


def test_oversized_or_too_many_entries_are_refused_by_the_contract(exported: bytes) -> None:
    with pytest.raises(BundleError, match=f"at most {MAX_METADATA_VALUE_BYTES} bytes"):
        _check(_with_props(exported, note="x" * (MAX_METADATA_VALUE_BYTES + 1)))
    many = {f"k{i}": "v" for i in range(MAX_METADATA_ENTRIES)}
    with pytest.raises(BundleError, match=f"more than {MAX_METADATA_ENTRIES} metadata entries"):
        _check(_with_props(exported, **many))
    with pytest.raises(BundleError, match="appears twice"):
        check_metadata_props([("a", "1"), ("a", "2")], source="m")
    with pytest.raises(BundleError, match="metadata key must be a non-empty str"):
        check_metadata_props([("", "1")], source="m")


def test_bundles_carry_the_keys_and_their_contract_refuses_bad_ones(exported: bytes) -> None:
    """The bundle format carries the ONNX as is; what reads it holds the metadata to the contract."""

    def bundle(model_onnx: bytes) -> Bundle:
        return bundle_from_bytes(
            bundle_to_bytes(
                Bundle(
                    kind="classifier",
                    model_onnx=model_onnx,
                    arch=ARCH,
                    num_classes=3,
                    input_shape=SHAPE,
                    label_counts=[1, 1, 1],
                    num_examples=3,
                    profile={"name": "test-device"},
                    metrics={},
                    seed=0,
                    sdk_version="test",
                )
            )
        )

    good = bundle(exported)
    assert good.model_onnx == exported
    _check(good.model_onnx)
    for bad_onnx in (
        _with_props(exported, **{CLASS_NAMES_KEY: '["a"]'}),
        _with_props(exported, note="x" * (MAX_METADATA_VALUE_BYTES + 1)),
    ):
        with pytest.raises(BundleError):
            _check(bundle(bad_onnx).model_onnx)


def test_writers_refuse_what_readers_would(model: torch.nn.Module) -> None:
    with pytest.raises(BundleError, match="unique"):
        deploy_metadata(["a", "a", "b"], _spec())
    with pytest.raises(BundleError, match="InputSpec"):
        deploy_metadata(NAMES, {"name": "x"})  # type: ignore[arg-type]
    with pytest.raises(ExportError, match="2 class names for 3"):
        export_onnx(model, SHAPE, metadata=deploy_metadata(["a", "b"], _spec()))
    with pytest.raises(ExportError, match="input_spec metadata describes"):
        export_onnx(model, SHAPE, metadata=deploy_metadata(NAMES, _spec(shape=(1, 4, 4))))
