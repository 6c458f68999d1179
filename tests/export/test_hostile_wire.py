"""Issue #34, classes 1 and 3 at the wire: well-formed but hostile msgpack maps (mixed key types, deep
nesting) and ONNX that passes onnx's own checker (Conv group, BatchNorm epsilon, Slice steps, NaN/Inf
weights) are refused with BundleError by the one reader each goes through, before any hash or model."""

import math

import msgpack
import numpy as np
import onnx
import pytest
import torch
from onnx import helper, numpy_helper

from common.errors import BundleError
from edge_sdk.models.arch import build_model
from export.bundle import bundle_from_bytes
from export.onnx_check import check_classifier_onnx
from export.onnx_export import export_onnx
from export.package import package_from_bytes
from export.weights_file import read_weights_file, write_weights_file

SHAPE = (1, 8, 8)


def nested(depth: int) -> object:
    value: object = 1
    for _ in range(depth):
        value = [value]
    return value


@pytest.mark.parametrize("read", [bundle_from_bytes, package_from_bytes])
@pytest.mark.parametrize(
    ("obj", "match"),
    [
        ({"schema_version": 3, "profile": {"a": 1, b"b": 2}}, "every map key must be a str"),
        ({b"sha256": "0", "kind": "classifier"}, "every map key must be a str"),
        ({"schema_version": 3, "profile": nested(500)}, "nested at most 16 levels"),
    ],
)
def test_hostile_maps_are_refused_before_any_hash(read, obj, match):
    with pytest.raises(BundleError, match=match):
        read(msgpack.packb(obj, use_bin_type=True))


def test_weights_file_with_mixed_keys_deep_nesting_or_nan_is_refused(tmp_path):
    tensors = {"w": torch.ones(4), "i": torch.arange(3)}
    good = write_weights_file(tmp_path / "good", tensors, kind="k", manifest={"n": 1})
    assert read_weights_file(good, kind="k")[0]["w"].sum() == 4
    honest = msgpack.unpackb(good.read_bytes(), raw=False)
    for manifest, match in (({"n": 1, b"x": 2}, "map key must be a str"), ({"n": nested(40)}, "nested")):
        path = tmp_path / "bad"
        path.write_bytes(msgpack.packb({**honest, "manifest": manifest}, use_bin_type=True))
        with pytest.raises(BundleError, match=match):
            read_weights_file(path, kind="k")
    for value in (math.nan, math.inf, -math.inf):
        poisoned = write_weights_file(
            tmp_path / "nan", {**tensors, "w": torch.tensor([1.0, value])}, kind="k", manifest={}
        )
        with pytest.raises(BundleError, match="NaN or infinite"):
            read_weights_file(poisoned, kind="k")


@pytest.fixture(scope="module")
def model() -> onnx.ModelProto:
    torch.manual_seed(0)
    return onnx.load_from_string(export_onnx(build_model("C4k3-P-F10", SHAPE, 10).eval(), SHAPE))


def check(proto: onnx.ModelProto) -> None:
    check_classifier_onnx(proto.SerializeToString(), input_shape=SHAPE, num_classes=10, source="m")


def _data_input(proto: onnx.ModelProto) -> str:
    names = {i.name for i in proto.graph.initializer}
    return next(i.name for i in proto.graph.input if i.name not in names)


def test_the_honest_model_passes(model):
    check(model)


@pytest.mark.parametrize("group", [0, -1])
def test_conv_group_below_one_is_refused(model, group):
    proto = onnx.ModelProto()
    proto.CopyFrom(model)
    conv = next(n for n in proto.graph.node if n.op_type == "Conv")
    kept = [a for a in conv.attribute if a.name != "group"]
    del conv.attribute[:]
    conv.attribute.extend([*kept, helper.make_attribute("group", group)])
    with pytest.raises(BundleError, match="group must be an integer"):
        check(proto)


@pytest.mark.parametrize("eps", [-1e-5, math.nan, math.inf])
def test_batchnorm_epsilon_not_finite_and_positive_is_refused(model, eps):
    proto = onnx.ModelProto()
    proto.CopyFrom(model)
    params = [f"bn_{k}" for k in ("scale", "bias", "mean", "var")]
    proto.graph.initializer.extend(numpy_helper.from_array(np.ones(1, np.float32), p) for p in params)
    proto.graph.node.append(
        helper.make_node("BatchNormalization", [_data_input(proto), *params], ["bn_out"], epsilon=eps)
    )
    with pytest.raises(BundleError, match="epsilon must be a finite number"):
        check(proto)


@pytest.mark.parametrize("step", [2**63 - 1, -(2**63), 2**31, 0])
def test_extreme_slice_steps_are_refused_before_onnx_shape_inference(model, step):
    """onnx's own inference crashes the process (SIGSEGV) or allocates without bound on these."""
    proto = onnx.ModelProto()
    proto.CopyFrom(model)
    for name, value in (("s", 0), ("e", 2**63 - 1), ("a", 0), ("t", step)):
        proto.graph.initializer.append(numpy_helper.from_array(np.array([value], np.int64), f"sl_{name}"))
    proto.graph.node.extend(
        [
            helper.make_node("Shape", [_data_input(proto)], ["sl_shape"]),
            helper.make_node("Slice", ["sl_shape", "sl_s", "sl_e", "sl_a", "sl_t"], ["sl_out"]),
        ]
    )
    with pytest.raises(BundleError, match="steps must be constants"):
        check(proto)


@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_nonfinite_onnx_weights_are_refused(model, value):
    proto = onnx.ModelProto()
    proto.CopyFrom(model)
    tensor = next(t for t in proto.graph.initializer if t.data_type == onnx.TensorProto.FLOAT)
    values = numpy_helper.to_array(tensor).copy()
    values.reshape(-1)[0] = value
    tensor.CopyFrom(numpy_helper.from_array(values, tensor.name))
    with pytest.raises(BundleError, match="NaN or infinite"):
        check(proto)
