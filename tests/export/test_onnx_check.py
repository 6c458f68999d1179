"""The load-time ONNX contract: our exports pass; every hostile file (built here with onnx.helper) is
refused with a BundleError before onnxruntime, torch or onnx's external-data loader touches it."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from common.errors import BundleError, ConfigError, TeacherError
from edge_sdk.cvae import build_cvae
from edge_sdk.models.arch import build_model
from edge_sdk.models.elastic.spec import smallest
from export.onnx_check import (
    ALLOWED_OPS,
    OnnxLimits,
    check_classifier_onnx,
    check_decoder_onnx,
    check_onnx,
    parse_onnx,
)
from export.onnx_export import export_decoder_onnx, export_onnx
from export.weights import initializer_state_dict

SHAPE = (1, 4, 4)
L = 10
F = TensorProto.FLOAT


def _model(nodes: list, inits: list, inputs: list, outputs: list, opset: int = 18) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "g", inputs, outputs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=8)


def _linear(
    num_classes: int = L, x_dims: tuple = ("batch", *SHAPE), pre: list | None = None
) -> onnx.ModelProto:
    """x [batch, 1, 4, 4] -> (``pre`` nodes from x to "h") -> Flatten -> Gemm -> logits [batch, classes]."""
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.standard_normal((num_classes, 16)).astype(np.float32), "w")
    b = numpy_helper.from_array(np.zeros(num_classes, np.float32), "b")
    nodes = [
        *(pre or [helper.make_node("Identity", ["x"], ["h"])]),
        helper.make_node("Flatten", ["h"], ["f"], axis=1),
        helper.make_node("Gemm", ["f", "w", "b"], ["logits"], transB=1),
    ]
    x = helper.make_tensor_value_info("x", F, list(x_dims))
    return _model(nodes, [w, b], [x], [helper.make_tensor_value_info("logits", F, ["batch", num_classes])])


def _check(model: onnx.ModelProto | bytes, **kwargs) -> onnx.ModelProto:
    data = model if isinstance(model, bytes) else model.SerializeToString()
    return check_classifier_onnx(data, input_shape=SHAPE, num_classes=L, source="c.bundle", **kwargs)


def _decoder(latent: int = 2, classes: int = 3) -> onnx.ModelProto:
    """z [batch, latent], y [batch, classes] -> Concat -> Gemm -> Reshape [-1, 1, 4, 4] -> Sigmoid -> x."""
    w = numpy_helper.from_array(np.ones((latent + classes, 16), np.float32), "w")
    shape = numpy_helper.from_array(np.array([-1, *SHAPE], np.int64), "shape")
    nodes = [
        helper.make_node("Concat", ["z", "y"], ["zy"], axis=1),
        helper.make_node("Gemm", ["zy", "w"], ["h"]),
        helper.make_node("Reshape", ["h", "shape"], ["r"]),
        helper.make_node("Sigmoid", ["r"], ["x"]),
    ]
    inputs = [
        helper.make_tensor_value_info("z", F, ["batch", latent]),
        helper.make_tensor_value_info("y", F, ["batch", classes]),
    ]
    return _model(nodes, [w, shape], inputs, [helper.make_tensor_value_info("x", F, ["batch", *SHAPE])])


# ------------------------------------------------------------------------------------- honest exports


@pytest.mark.parametrize(
    ("arch", "shape", "keep_batchnorm"),
    [
        ("C8k3-P-C16k3-Pavg-F32-F10", (1, 12, 12), True),
        ("C8k3-P-C16k3-Pavg-F32-F10", (1, 12, 12), False),
        ("zoo:mobilenetv2", (3, 12, 12), True),
        (str(smallest()), (1, 28, 28), True),
    ],
)
def test_our_classifier_exports_pass(arch: str, shape: tuple, keep_batchnorm: bool) -> None:
    data = export_onnx(build_model(arch, shape, L).eval(), shape, keep_batchnorm=keep_batchnorm)
    proto = check_classifier_onnx(data, input_shape=shape, num_classes=L, source=arch)
    assert {node.op_type for node in proto.graph.node} <= ALLOWED_OPS
    assert proto.SerializeToString(deterministic=True) == onnx.load_from_string(data).SerializeToString(
        deterministic=True
    )


@pytest.mark.parametrize("arch", ["cvae-small-z2", "cvae-large-z4"])
def test_our_decoder_exports_pass(arch: str) -> None:
    shape = (1, 8, 8)
    cvae = build_cvae(arch, shape, 3)
    data = export_decoder_onnx(
        cvae.decoder.eval(), latent_dim=cvae.latent_dim, num_classes=3, output_shape=shape
    )
    for latent in (cvae.latent_dim, None):
        proto = check_decoder_onnx(data, latent_dim=latent, num_classes=3, output_shape=shape, source=arch)
        assert {node.op_type for node in proto.graph.node} <= ALLOWED_OPS
    with pytest.raises(
        BundleError, match=r"output 'x' is float32 \[1, 1, 8, 8\] .*expected float32 \[1, 1, 7, 7\]"
    ):
        check_decoder_onnx(
            data, latent_dim=cvae.latent_dim, num_classes=3, output_shape=(1, 7, 7), source=arch
        )


def test_small_hand_built_graphs_pass_and_a_static_batch_is_allowed() -> None:
    _check(_linear())
    _check(_linear(x_dims=(1, *SHAPE)))
    check_decoder_onnx(
        _decoder().SerializeToString(), latent_dim=2, num_classes=3, output_shape=SHAPE, source="d"
    )


# ------------------------------------------------------------------------------ the manifest's shapes


def test_eleven_logits_against_a_manifest_of_ten_are_refused() -> None:
    with pytest.raises(
        BundleError, match=r"c\.bundle: ONNX output 'logits' is float32 \[1, 11\] .*\[1, 10\]"
    ):
        _check(_linear(num_classes=11))


@pytest.mark.parametrize(
    ("x_dims", "match"),
    [
        (("batch", 1, 2_000_000, 4), r"has shape \[batch, 1, 2000000, 4\], expected \[batch, 1, 4, 4\]"),
        (("batch", 1, 200_000, 4), r"expected \[batch, 1, 4, 4\]"),
        ((2_000_000, 1, 4, 4), r"batch symbolic or in \[1, 64\]"),
        ((65, 1, 4, 4), r"batch symbolic or in \[1, 64\]"),
        (("batch", 4, 4), r"expected \[batch, 1, 4, 4\]"),
    ],
)
def test_inputs_must_have_the_manifest_shape_and_a_small_batch(x_dims: tuple, match: str) -> None:
    with pytest.raises(BundleError, match=match):
        _check(_linear(x_dims=x_dims))


def test_decoder_inputs_are_named_z_then_y_with_the_manifest_sizes() -> None:
    data = _decoder().SerializeToString()
    with pytest.raises(BundleError, match=r"input 'z' has shape \[batch, 2\], expected \[batch, 5\]"):
        check_decoder_onnx(data, latent_dim=5, num_classes=3, output_shape=SHAPE, source="d")
    swapped = _decoder()
    swapped.graph.input[0].name, swapped.graph.input[1].name = "y", "z"
    with pytest.raises(BundleError, match=r"expected ONNX inputs \['z', 'y'\], got \['y', 'z'\]"):
        check_decoder_onnx(
            swapped.SerializeToString(), latent_dim=2, num_classes=3, output_shape=SHAPE, source="d"
        )
    with pytest.raises(BundleError, match=r"input 'y' has shape \[batch, 3\], expected \[batch, 4\]"):
        check_decoder_onnx(data, latent_dim=None, num_classes=4, output_shape=SHAPE, source="d")


def test_inputs_must_be_float32_tensors() -> None:
    model = _linear()
    model.graph.input[0].type.tensor_type.elem_type = TensorProto.DOUBLE
    with pytest.raises(BundleError, match="must be a float32 tensor"):
        _check(model)


# ------------------------------------------------------------------------------ graph and operators


def loop_in_front(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with a Loop of 2**62 iterations carrying its first input through before the real graph:
    onnxruntime would never return. (Shared with the loader tests of server_kit and edge_sdk.)"""
    x = model.graph.input[0]
    dims = [d.dim_param or d.dim_value for d in x.type.tensor_type.shape.dim]
    body = helper.make_graph(
        [
            helper.make_node("Identity", ["cond"], ["cond_out"]),
            helper.make_node("Identity", ["v"], ["v_out"]),
        ],
        "body",
        [
            helper.make_tensor_value_info("i", TensorProto.INT64, []),
            helper.make_tensor_value_info("cond", TensorProto.BOOL, []),
            helper.make_tensor_value_info("v", F, dims),
        ],
        [
            helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
            helper.make_tensor_value_info("v_out", F, dims),
        ],
    )
    for node in model.graph.node:
        node.input[:] = ["looped" if name == x.name else name for name in node.input]
    model.graph.node.insert(0, helper.make_node("Loop", ["trips", "", x.name], ["looped"], body=body))
    model.graph.initializer.append(numpy_helper.from_array(np.array(2**62, np.int64), "trips"))
    return model


def external_weight(model: onnx.ModelProto, location: str) -> TensorProto:
    """Move the first initializer's data to the external file ``location``; returns that initializer."""
    tensor = model.graph.initializer[0]
    count = int(np.prod(tensor.dims))
    tensor.ClearField("raw_data")
    tensor.ClearField("float_data")
    tensor.data_location = TensorProto.EXTERNAL
    for key, value in (("location", location), ("offset", "0"), ("length", str(4 * count))):
        entry = tensor.external_data.add()
        entry.key, entry.value = key, value
    return tensor


def test_loop_with_2_to_the_62_iterations_is_refused() -> None:
    with pytest.raises(BundleError, match=r"node .* \(Loop\) has a graph attribute 'body'.*Loop, If, Scan"):
        _check(loop_in_front(_linear()))


def _with(model: onnx.ModelProto, change: str) -> onnx.ModelProto:
    if change == "custom domain":
        model.graph.node[0].domain = "com.microsoft"
        model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    elif change == "extra opset":
        model.opset_import.append(helper.make_opsetid("ai.onnx.ml", 3))
    elif change == "old opset":
        model.opset_import[0].version = 9
    elif change == "function":
        model.functions.append(
            helper.make_function(
                "local", "Twice", ["a"], ["b"], [helper.make_node("Add", ["a", "a"], ["b"])], []
            )
        )
    elif change == "training_info":
        model.training_info.add()
    elif change == "erf":
        model.graph.node[0].op_type = "Erf"
    elif change == "constant of shape":
        model.graph.node.insert(0, helper.make_node("ConstantOfShape", ["big"], ["zeros"]))
        model.graph.initializer.append(numpy_helper.from_array(np.array([1 << 32], np.int64), "big"))
    elif change == "string constant":
        model.graph.node.insert(0, helper.make_node("Constant", [], ["s"], value_string="hello"))
    return model


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ("custom domain", r"imports opsets"),
        ("extra opset", r"imports opsets .*'ai\.onnx\.ml'"),
        ("old opset", r"version in \[11, "),
        ("function", r"model-local functions"),
        ("training_info", r"training_info"),
        ("erf", r"operators outside the allowlist: 'Erf'"),
        ("constant of shape", r"outside the allowlist: 'ConstantOfShape'"),
        ("string constant", r"outside the allowlist: 'Constant\(value_string\)'"),
    ],
)
def test_only_the_default_domain_and_allowed_operators(change: str, match: str) -> None:
    with pytest.raises(BundleError, match=match):
        _check(_with(_linear(), change))


# ------------------------------------------------------------------- hostile text and unexpected errors


def _undecodable(model: onnx.ModelProto, text: str, only: int | None = None) -> bytes:
    """``model`` serialized with ``text`` made undecodable (every occurrence, or the ``only``-th): its last
    byte becomes 0xad (not UTF-8), same length, as one flipped byte in a download does. The protobuf
    runtime then hands the field back as ``bytes``, and onnx's C++ checker cannot quote it in an error."""
    data, raw = model.SerializeToString(), text.encode()
    starts = [i for i in range(len(data)) if data.startswith(raw, i)]
    assert starts, text
    out = bytearray(data)
    for start in starts if only is None else [starts[only]]:
        out[start + len(raw) - 1] = 0xAD
    return bytes(out)


def _text_model(where: str) -> tuple[onnx.ModelProto, str]:
    """A valid classifier holding the unique text ``marker`` in the field ``where`` names."""
    marker = "fuzzmark"
    model = _linear(
        pre=[
            helper.make_node("Constant", [], ["c"], value_floats=[1.0]),
            helper.make_node("Identity", ["x"], ["h"]),
        ]
    )
    node = model.graph.node[1]
    if where == "node name":
        node.name = marker
    elif where == "op type":
        marker = "Identity"
    elif where == "domain":  # a custom domain (refused when readable) in both node and opset import
        node.domain = model.opset_import[0].domain = marker
        return model, marker
    elif where == "value name":
        marker = "hidden"
        node.output[0] = model.graph.node[2].input[0] = marker
    elif where == "constant attribute name":  # the fuzz run's TypeError in _check_ops
        marker = "value_floats"
    elif where == "string attribute":
        model = _linear(pre=_resize([1, 1, 1, 1]))
        model.graph.initializer.append(numpy_helper.from_array(np.array([1, 1, 4, 4], np.float32), "back"))
        marker = "nearest"
    elif where == "doc string":
        model.doc_string = marker
    elif where == "metadata":
        helper.set_model_props(model, {"note": marker})
    _check(model)  # honest before the flip
    return model, marker


@pytest.mark.parametrize(
    "where",
    [
        "node name",
        "op type",
        "domain",
        "value name",
        "constant attribute name",
        "string attribute",
        "doc string",
        "metadata",
    ],
)
def test_undecodable_text_is_refused_by_both_readers(where: str) -> None:
    """A flipped byte in any protobuf text (fuzz cases classifier:onnx_bytes:0:9, a UnicodeDecodeError
    out of onnx.checker, and package:onnx_bytes:0:12, a TypeError in the operator check) is a BundleError
    naming the field, from parse_onnx already: nothing after it sees text that is not ``str``."""
    model, marker = _text_model(where)
    data = _undecodable(model, marker, 1 if where == "value name" else None)  # the consumer's input only
    match = r"c\.bundle: model\.[\w.\[\]]+ is not UTF-8 text \(got b'.*\\xad.*'\); ONNX names"
    with pytest.raises(BundleError, match=match):
        parse_onnx(data, source="c.bundle")
    with pytest.raises(BundleError, match=match):
        _check(data)
    with pytest.raises(BundleError, match=match):
        initializer_state_dict(data, source="c.bundle")


def test_an_unexpected_error_inside_the_checker_names_the_file(monkeypatch) -> None:
    """The backstop: whatever the checker raises outside its own refusals becomes the caller's error
    naming the file, the cause kept; MemoryError passes through (running out is its own outcome)."""
    import export.onnx_check as onnx_check
    import export.onnx_parse as onnx_parse

    data = _linear().SerializeToString()

    def boom(*args, **kwargs):
        raise KeyError("deep inside")

    monkeypatch.setattr(onnx_check, "static_values", boom)
    with pytest.raises(
        BundleError, match=r"c\.bundle: .*checker fails on \(KeyError at .*'deep inside'"
    ) as info:
        _check(data)
    assert isinstance(info.value.__cause__, KeyError)
    with pytest.raises(TeacherError, match=r"c\.bundle: .*bug of export\.onnx_check"):
        check_onnx(data, inputs=[None], outputs=[None], source="c.bundle", error=TeacherError)
    monkeypatch.setattr(onnx_parse, "_check_tensor", boom)
    with pytest.raises(BundleError, match=r"c\.bundle: .*KeyError"):
        parse_onnx(data, source="c.bundle")

    def out_of_memory(*args, **kwargs):
        raise MemoryError

    monkeypatch.setattr(onnx_parse, "_check_tensor", out_of_memory)
    with pytest.raises(MemoryError):
        parse_onnx(data, source="c.bundle")


# ---------------------------------------------------------------------------------- external data


@pytest.mark.parametrize("location", ["secret.bin", "../secret.bin", "/etc/hostname"])
@pytest.mark.parametrize("place", ["initializer", "constant"])
def test_external_data_is_refused_before_anything_reads_it(tmp_path, monkeypatch, location, place) -> None:
    secret = np.arange(160, dtype=np.float32)
    (tmp_path / "secret.bin").write_bytes(secret.tobytes())
    monkeypatch.chdir(tmp_path)
    model = _linear()
    weight = external_weight(model, location)
    if location == "secret.bin":  # the hazard is real: onnx's own reader takes the file from the cwd
        np.testing.assert_array_equal(numpy_helper.to_array(weight).ravel(), secret)
    if place == "constant":
        model.graph.node.insert(0, helper.make_node("Constant", [], ["w"], value=weight))
        del model.graph.initializer[0]
    data = model.SerializeToString()
    for read in (_check, initializer_state_dict):
        with pytest.raises(BundleError, match=rf"keeps its data in an external file \('{location}'\)"):
            read(data)


@pytest.mark.parametrize(
    "form", ["location flag only", "entries only", "sparse initializer", "sparse constant"]
)
def test_every_other_form_of_external_or_sparse_data_is_refused(form: str) -> None:
    model = _linear()
    weight = model.graph.initializer[0]
    if form == "location flag only":
        weight.data_location = TensorProto.EXTERNAL
    elif form == "entries only":
        entry = weight.external_data.add()
        entry.key, entry.value = "location", "secret.bin"
    else:
        values = numpy_helper.from_array(np.ones(2, np.float32), "v")
        indices = numpy_helper.from_array(np.array([0, 5], np.int64), "i")
        sparse = helper.make_sparse_tensor(values, indices, [16])
        if form == "sparse initializer":
            model.graph.sparse_initializer.append(sparse)
        else:
            model.graph.node.insert(0, helper.make_node("Constant", [], ["sp"], sparse_value=sparse))
    match = "external file" if "only" in form else "sparse"
    with pytest.raises(BundleError, match=match):
        _check(model)


# ------------------------------------------------------------------------------------- initializers


def _replace_weight(model: onnx.ModelProto, tensor: TensorProto) -> onnx.ModelProto:
    tensor.name = "w"
    model.graph.initializer[0].CopyFrom(tensor)
    return model


@pytest.mark.parametrize(
    ("tensor", "match"),
    [
        (numpy_helper.from_array(np.ones((10, 16), np.float64)), "data type DOUBLE"),
        (numpy_helper.from_array(np.ones((10, 16), np.int64)), r"INT64 of dims \[10, 16\]"),
        (numpy_helper.from_array(np.ones((10, 16), np.int32)), "data type INT32"),
        (helper.make_tensor("w", TensorProto.STRING, [2], [b"a", b"b"]), "data type STRING"),
        (helper.make_tensor("w", TensorProto.FLOAT8E4M3FN, [10, 16], bytes(160), raw=True), "FLOAT8E4M3FN"),
        (TensorProto(data_type=TensorProto.UNDEFINED, dims=[10, 16]), "data type UNDEFINED"),
        (TensorProto(data_type=F, dims=[0, 16]), r"dims \[0, 16\], expected at most 8 dims, each in \[1, "),
        (TensorProto(data_type=F, dims=[-3, 16]), r"dims \[-3, 16\]"),
        (TensorProto(data_type=F, dims=[1 << 40, 16], raw_data=bytes(640)), r"dims \[1099511627776, 16\]"),
        (TensorProto(data_type=F, dims=[10, 16, *[1] * 60], raw_data=bytes(640)), "at most 8 dims"),
        (TensorProto(data_type=F, dims=[10, 16], raw_data=bytes(639)), r"\(640 bytes\) but holds 639 raw"),
        (TensorProto(data_type=F, dims=[10, 16], raw_data=bytes(64)), r"\(640 bytes\) but holds 64 raw"),
        (TensorProto(data_type=F, dims=[10, 16], float_data=[1.0] * 159), "but holds 159 values"),
        (TensorProto(data_type=F, dims=[10, 16], raw_data=bytes(640), float_data=[1.0]), "holds 640 raw"),
        (TensorProto(data_type=F, dims=[10, 16], float_data=[1.0] * 160, int64_data=[1]), "holds 160 values"),
        (TensorProto(data_type=F, dims=[10, 16]), "but holds 0 values"),
    ],
)
def test_bad_initializers_are_refused_by_both_readers(tensor: TensorProto, match: str) -> None:
    data = _replace_weight(_linear(), tensor).SerializeToString()
    for read in (_check, initializer_state_dict):
        with pytest.raises(BundleError, match=match):
            read(data)


def test_small_int64_shape_initializers_are_read() -> None:
    state = initializer_state_dict(_decoder().SerializeToString())
    assert state["shape"].tolist() == [-1, *SHAPE] and state["w"].shape == (5, 16)


# ---------------------------------------------------------------------------------- memory and time


def _resize(scales: list[float]) -> list:
    return [
        helper.make_node(
            "Constant", [], ["scales"], value=numpy_helper.from_array(np.array(scales, np.float32))
        ),
        helper.make_node("Resize", ["x", "", "scales"], ["big"], mode="nearest"),
        helper.make_node("GlobalAveragePool", ["big"], ["pooled"]),
        helper.make_node("Resize", ["pooled", "", "back"], ["h"], mode="nearest"),
    ]


def test_resize_and_conv_transpose_cannot_blow_up_memory() -> None:
    """Valid graphs whose one intermediate tensor is 16 M elements per sample (64 MB, 4x the bound)."""
    model = _linear(pre=_resize([1, 1, 1000, 1000]))
    model.graph.initializer.append(numpy_helper.from_array(np.array([1, 1, 4, 4], np.float32), "back"))
    with pytest.raises(BundleError, match=r"\(Resize\) makes a tensor of 16000000 elements at batch 1"):
        _check(model)
    kernel = numpy_helper.from_array(np.ones((1, 1, 1, 1), np.float32), "k")
    stride = [
        helper.make_node(
            "ConvTranspose", ["x", "k"], ["big"], strides=[1000, 1000], output_padding=[999, 999]
        ),
        helper.make_node("GlobalAveragePool", ["big"], ["pooled"]),
        helper.make_node("Resize", ["pooled", "", "back"], ["h"], mode="nearest"),
    ]
    model = _linear(pre=stride)
    model.graph.initializer.extend(
        [kernel, numpy_helper.from_array(np.array([1, 1, 4, 4], np.float32), "back")]
    )
    with pytest.raises(
        BundleError, match=r"\(ConvTranspose\) makes a tensor of 16000000 elements at batch 1"
    ):
        _check(model)


def test_a_size_that_grows_with_the_batch_squared_is_refused_at_max_batch() -> None:
    """Resize to [B, B, 1024, 1024] with B read from the input's shape: 1 M elements at batch 1, but
    2**40 at batch 1024."""
    pre = [
        helper.make_node("Shape", ["x"], ["s"]),
        helper.make_node("Slice", ["s", "zero", "one"], ["n"]),
        helper.make_node("Concat", ["n", "n", "hw"], ["sizes"], axis=0),
        helper.make_node("Resize", ["x", "", "", "sizes"], ["big"], mode="nearest"),
        helper.make_node("ReduceMean", ["big", "axis1"], ["m"]),
        helper.make_node("GlobalAveragePool", ["m"], ["pooled"]),
        helper.make_node("Resize", ["pooled", "", "back"], ["h"], mode="nearest"),
    ]
    model = _linear(pre=pre)
    consts = {"zero": [0], "one": [1], "hw": [1024, 1024], "axis1": [1]}
    model.graph.initializer.extend(
        numpy_helper.from_array(np.array(v, np.int64), k) for k, v in consts.items()
    )
    model.graph.initializer.append(numpy_helper.from_array(np.array([1, 1, 4, 4], np.float32), "back"))
    with pytest.raises(BundleError, match=r"makes a tensor of 1099511627776 elements at batch 1024"):
        _check(model)
    _check(model, limits=OnnxLimits(max_batch=1))  # the same graph is within budget at batch 1


def test_integer_tensors_may_be_copied_but_not_computed() -> None:
    pre = [
        helper.make_node("Shape", ["x"], ["s"]),
        helper.make_node("Mul", ["s", "ones"], ["s2"]),
        helper.make_node("Reshape", ["x", "s2"], ["h"]),
    ]
    model = _linear(pre=pre)
    model.graph.initializer.append(numpy_helper.from_array(np.ones(4, np.int64), "ones"))
    with pytest.raises(BundleError, match=r"\(Mul\) makes the int64 tensor 's2'.*only copied"):
        _check(model)
    pre[1] = helper.make_node("Identity", ["s"], ["s2"])  # a copy is folded and the shape is known
    _check(_linear(pre=pre))


def test_a_shape_that_cannot_be_inferred_is_refused() -> None:
    """Resize scales computed at run time (Relu of a constant): inference cannot know the output size."""
    pre = _resize([1, 1, 1, 1])
    pre.insert(1, helper.make_node("Relu", ["scales"], ["scales_r"]))
    pre[2] = helper.make_node("Resize", ["x", "", "scales_r"], ["big"], mode="nearest")
    model = _linear(pre=pre)
    model.graph.initializer.append(numpy_helper.from_array(np.array([1, 1, 4, 4], np.float32), "back"))
    with pytest.raises(BundleError, match=r"\(Resize\) output 'big' has no static float32/int64 shape"):
        _check(model)


@pytest.mark.parametrize(
    ("limits", "match"),
    [
        (OnnxLimits(max_model_bytes=100), r"bytes, expected at most 100"),
        (OnnxLimits(max_weight_bytes=100), r"the weights hold 680 bytes, expected at most 100"),
        (OnnxLimits(max_initializers=1), r"3 nodes and 2 initializers, expected at most 4096 and 1"),
        (OnnxLimits(max_nodes=2), r"3 nodes .* expected at most 2 and"),
        (OnnxLimits(max_rank=3), r"\(Identity\) output 'h' has rank 4 > 3"),
        (OnnxLimits(max_tensor_elements=12), r"\(Identity\) makes a tensor of 16 elements at batch 1"),
        (OnnxLimits(max_total_elements=50), r"makes 58 elements in .* expected at most 50 elements"),
        (OnnxLimits(max_operations=100), r"in 224 operations .* and 100 operations"),
    ],
)
def test_each_bound_is_enforced(limits: OnnxLimits, match: str) -> None:
    """x 16 + h 16 + f 16 + logits 10 = 58 values; Identity and Flatten touch 32 each, Gemm does
    10 x 16 multiply-accumulates: 224 operations per sample."""
    _check(_linear())
    with pytest.raises(BundleError, match=match):
        _check(_linear(), limits=limits)


def test_limits_are_validated() -> None:
    with pytest.raises(ConfigError, match="max_nodes must be an integer >= 1"):
        OnnxLimits(max_nodes=0)
    with pytest.raises(ConfigError, match="max_batch"):
        OnnxLimits(max_batch=True)


# ----------------------------------------------------------------------------------------- parsing


@pytest.mark.parametrize(
    ("data", "match"),
    [(b"definitely not onnx", "not a valid ONNX model"), (b"", "got 0 bytes"), ("x", "got str")],
)
def test_unreadable_input_is_a_bundle_error(data, match: str) -> None:
    with pytest.raises(BundleError, match=f"c.bundle: .*{match}"):
        parse_onnx(data, source="c.bundle")


def test_check_onnx_accepts_a_parsed_model_and_checks_it_again() -> None:
    proto = parse_onnx(_linear().SerializeToString(), source="c")
    assert check_onnx(proto, inputs=[None], outputs=[None], source="c") is proto
    proto.graph.initializer[0].data_location = TensorProto.EXTERNAL
    with pytest.raises(BundleError, match="external file"):
        check_onnx(proto, inputs=[None], outputs=[None], source="c")
