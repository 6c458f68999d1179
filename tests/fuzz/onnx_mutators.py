"""ONNX-level mutations: structurally valid protobufs that a careless loader would run, trust or read from.

Each function edits a parsed ``ModelProto`` in place (seeded by ``rng``) and returns a short note. They
target the reader contract, not the parser: graphs that never end (a Loop of 2^62 iterations), ask for
terabytes (ConstantOfShape, Resize, sparse or dims lying about their size), use ops or types nothing
should accept (custom domains, string / float8 / undefined initializers) or name files outside the model
(external data: relative, absolute and ``../`` paths to a secret the runner plants in the case's cwd).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

SECRET_NAME = "secret.bin"
SECRET_BYTES = 16 * 1024
SECRET_CHUNK = 64  # external data offsets are multiples of this; the leak scan looks at these offsets

OnnxMutation = Callable[[onnx.ModelProto, np.random.Generator, Path], str]


def _pick(rng: np.random.Generator, options: list) -> object:
    return options[int(rng.integers(len(options)))]


def _float_initializers(model: onnx.ModelProto) -> list[TensorProto]:
    return [t for t in model.graph.initializer if t.data_type == TensorProto.FLOAT and t.raw_data]


def _rewire_output(model: onnx.ModelProto) -> tuple[str, str]:
    """Rename the graph's first output at its producer to ``<out>_fuzz_pre``; the caller adds nodes that
    compute ``<out>`` from it. Returns (pre, out)."""
    out = model.graph.output[0].name
    pre = f"{out}_fuzz_pre"
    for node in model.graph.node:
        for i, name in enumerate(node.output):
            if name == out:
                node.output[i] = pre
    return pre, out


def _any_float(name: str) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, None)


def _add_to_output(model: onnx.ModelProto, nodes: list[onnx.NodeProto], scalar: str) -> None:
    """out = pre + 0 * scalar: the bomb is on the output's data path, so no optimiser may drop it."""
    pre, out = _rewire_output(model)
    zero = "fuzz_zero"
    model.graph.initializer.append(numpy_helper.from_array(np.zeros((), np.float32), zero))
    model.graph.node.extend(
        [
            *nodes,
            helper.make_node("Mul", [scalar, zero], ["fuzz_scaled"]),
            helper.make_node("Add", [pre, "fuzz_scaled"], [out]),
        ]
    )


def input_dims(model: onnx.ModelProto, rng: np.random.Generator, _: Path) -> str:
    value = _pick(rng, [2_000_000, 0, -1, 2**62])
    target = model.graph.input[int(rng.integers(len(model.graph.input)))]
    dims = target.type.tensor_type.shape.dim
    axis = int(rng.integers(len(dims)))
    dims[axis].Clear()
    dims[axis].dim_value = int(value)  # type: ignore[call-overload]
    return f"input {target.name} dim {axis} = {value}"


def extra_output(model: onnx.ModelProto, rng: np.random.Generator, _: Path) -> str:
    if rng.random() < 0.5:
        pre, out = _rewire_output(model)
        pads = numpy_helper.from_array(np.array([0, 0, 0, 1], np.int64), "fuzz_pads")
        rank = len(model.graph.output[0].type.tensor_type.shape.dim)
        if rank != 2:  # a decoder image: one extra pixel column instead of one extra logit
            pads = numpy_helper.from_array(np.array([0] * (2 * rank - 1) + [1], np.int64), "fuzz_pads")
        model.graph.initializer.append(pads)
        model.graph.node.append(helper.make_node("Pad", [pre, "fuzz_pads"], [out]))
        model.graph.output[0].type.tensor_type.ClearField("shape")
        return "one extra logit (Pad on the last axis)"
    first = model.graph.output[0].name
    model.graph.node.append(helper.make_node("Identity", [first], ["fuzz_second"]))
    model.graph.output.append(_any_float("fuzz_second"))
    return "a second graph output"


def loop(model: onnx.ModelProto, rng: np.random.Generator, _: Path) -> str:
    trips = int(_pick(rng, [2**62, 2**63 - 1]))
    body = helper.make_graph(
        [
            helper.make_node("Identity", ["cond_in"], ["cond_out"]),
            helper.make_node("Identity", ["v_in"], ["v_out"]),
        ],
        "fuzz_body",
        [
            helper.make_tensor_value_info("i", TensorProto.INT64, []),
            helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
            _any_float("v_in"),
        ],
        [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []), _any_float("v_out")],
    )
    pre, out = _rewire_output(model)
    model.graph.initializer.extend(
        [
            numpy_helper.from_array(np.array(trips, np.int64), "fuzz_trips"),
            numpy_helper.from_array(np.array(True), "fuzz_cond"),
        ]
    )
    model.graph.node.append(helper.make_node("Loop", ["fuzz_trips", "fuzz_cond", pre], [out], body=body))
    return f"Loop of {trips} iterations on the output"


def control_flow(model: onnx.ModelProto, rng: np.random.Generator, _: Path) -> str:
    pre, out = _rewire_output(model)
    if rng.random() < 0.5:
        then = helper.make_graph([helper.make_node("Identity", [pre], ["t"])], "then", [], [_any_float("t")])
        other = helper.make_graph([helper.make_node("Neg", [pre], ["e"])], "else", [], [_any_float("e")])
        taken = bool(rng.random() < 0.5)
        model.graph.initializer.append(numpy_helper.from_array(np.array(taken), "fuzz_if"))
        model.graph.node.append(
            helper.make_node("If", ["fuzz_if"], [out], then_branch=then, else_branch=other)
        )
        return f"If ({taken}) around the output"
    body = helper.make_graph(
        [helper.make_node("Identity", ["s_in"], ["s_out"])],
        "scan",
        [_any_float("s_in")],
        [_any_float("s_out")],
    )
    axis = int(rng.integers(0, 2))
    model.graph.node.append(
        helper.make_node("Scan", [pre], [out], body=body, num_scan_inputs=1, scan_input_axes=[axis])
    )
    return f"Scan over axis {axis} of the output"


def custom_op(model: onnx.ModelProto, rng: np.random.Generator, _: Path) -> str:
    domain = str(_pick(rng, ["com.fuzz.evil", "ai.onnx.ml", "com.microsoft"]))
    op = str(_pick(rng, ["Exfiltrate", "FusedGemm", "Shell"]))
    pre, out = _rewire_output(model)
    model.graph.node.append(helper.make_node(op, [pre], [out], domain=domain))
    if all(o.domain != domain for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(domain, 1))
    return f"op {domain}.{op}"


def constant_of_shape(model: onnx.ModelProto, rng: np.random.Generator, _: Path) -> str:
    elements = 4 * 2**30  # float32: 16 GiB
    nodes = [helper.make_node("ConstantOfShape", ["fuzz_shape"], ["fuzz_big"])]
    if rng.random() < 0.5:  # constant: an optimiser would fold it at session creation
        model.graph.initializer.append(numpy_helper.from_array(np.array([elements], np.int64), "fuzz_shape"))
        note = "ConstantOfShape of 16 GiB (constant shape)"
    else:  # depends on the batch: allocated at run time
        model.graph.initializer.append(
            numpy_helper.from_array(np.array([elements // 4], np.int64), "fuzz_per_row")
        )
        nodes = [
            helper.make_node("Shape", [model.graph.input[0].name], ["fuzz_in_shape"], end=1),
            helper.make_node("Concat", ["fuzz_in_shape", "fuzz_per_row"], ["fuzz_shape"], axis=0),
            *nodes,
        ]
        note = "ConstantOfShape of batch x 4 GiB (run time)"
    nodes.append(helper.make_node("ReduceSum", ["fuzz_big"], ["fuzz_sum"], keepdims=0))
    _add_to_output(model, nodes, "fuzz_sum")
    return note


def resize(model: onnx.ModelProto, rng: np.random.Generator, _: Path) -> str:
    source = model.graph.input[0]
    rank = len(source.type.tensor_type.shape.dim)
    factor = float(_pick(rng, [1e5, 1e9, 3.4e38]))
    scales = np.array([1.0] * max(rank - 2, 1) + [factor] * min(rank - 1, 2), np.float32)[:rank]
    model.graph.initializer.append(numpy_helper.from_array(scales, "fuzz_scales"))
    nodes = [
        helper.make_node("Resize", [source.name, "", "fuzz_scales"], ["fuzz_big"], mode="nearest"),
        helper.make_node("ReduceMean", ["fuzz_big"], ["fuzz_mean"], keepdims=0),
    ]
    _add_to_output(model, nodes, "fuzz_mean")
    return f"Resize of {source.name} by {factor:g}"


def initializer_dtype(model: onnx.ModelProto, rng: np.random.Generator, _: Path) -> str:
    tensor = _pick(rng, _float_initializers(model))
    assert isinstance(tensor, TensorProto)
    values = numpy_helper.to_array(tensor)
    variant = str(_pick(rng, ["double", "double_raw", "int64", "string", "float8", "undefined", "bfloat16"]))
    if variant == "double":
        tensor.CopyFrom(numpy_helper.from_array(values.astype(np.float64), tensor.name))
    elif variant == "int64":
        tensor.CopyFrom(numpy_helper.from_array(values.astype(np.int64), tensor.name))
    elif variant == "double_raw":  # type says 8 bytes per element, raw_data holds 4
        tensor.data_type = TensorProto.DOUBLE
    elif variant == "string":
        tensor.ClearField("raw_data")
        tensor.data_type = TensorProto.STRING
        tensor.string_data.extend([b"fuzz"] * values.size)
    elif variant == "float8":
        tensor.data_type = TensorProto.FLOAT8E4M3FN
        tensor.raw_data = bytes(values.size)
    elif variant == "bfloat16":
        tensor.data_type = TensorProto.BFLOAT16
        tensor.raw_data = values.astype(np.float32).view(np.uint32).astype(">u4").tobytes()[: 2 * values.size]
    else:
        tensor.data_type = TensorProto.UNDEFINED
    return f"initializer {tensor.name} as {variant}"


def initializer_dims(model: onnx.ModelProto, rng: np.random.Generator, _: Path) -> str:
    tensor = _pick(rng, _float_initializers(model))
    assert isinstance(tensor, TensorProto)
    variant = str(_pick(rng, ["zero", "huge", "negative", "rank64", "overflow"]))
    dims = list(tensor.dims) or [1]
    if variant == "zero":
        dims[0] = 0
    elif variant == "huge":
        dims[0] = 2**40
    elif variant == "negative":
        dims[0] = -dims[0]
    elif variant == "rank64":
        dims = dims + [1] * 60
    else:  # the product overflows int64
        dims = [2**31, 2**31, 2**31, *dims]
    del tensor.dims[:]
    tensor.dims.extend(dims)
    return f"initializer {tensor.name} dims {variant}"


def raw_length(model: onnx.ModelProto, rng: np.random.Generator, _: Path) -> str:
    tensor = _pick(rng, _float_initializers(model))
    assert isinstance(tensor, TensorProto)
    variant = str(_pick(rng, ["short", "long", "float_data_and_raw", "float_data_wrong_count", "empty"]))
    if variant == "short":
        tensor.raw_data = tensor.raw_data[: -int(rng.integers(1, 5))]
    elif variant == "long":
        tensor.raw_data = tensor.raw_data + bytes(int(rng.integers(1, 4096)))
    elif variant == "float_data_and_raw":
        tensor.float_data.extend([1.0] * 3)
    elif variant == "float_data_wrong_count":
        tensor.ClearField("raw_data")
        tensor.float_data.extend([1.0] * 3)
    else:
        tensor.ClearField("raw_data")
    return f"initializer {tensor.name} data {variant}"


def _externalise(tensor: TensorProto, location: str, offset: int) -> None:
    length = len(tensor.raw_data)
    tensor.ClearField("raw_data")
    tensor.data_location = TensorProto.EXTERNAL
    del tensor.external_data[:]
    for key, value in (("location", location), ("offset", str(offset)), ("length", str(length))):
        entry = tensor.external_data.add()
        entry.key, entry.value = key, value


def external_data(model: onnx.ModelProto, rng: np.random.Generator, workdir: Path) -> str:
    """Point a tensor at the planted secret: relative, absolute or ``../`` (``workdir`` is the cwd the
    consumer runs in; the runner plants the secret there and in its parent)."""
    location = str(
        _pick(
            rng,
            [
                SECRET_NAME,
                f"./{SECRET_NAME}",
                str(workdir / SECRET_NAME),
                f"../{SECRET_NAME}",
                f"sub/../../{SECRET_NAME}",
                str(workdir.parent / SECRET_NAME),
            ],
        )
    )
    fits = [t for t in _float_initializers(model) if 80 <= len(t.raw_data) <= SECRET_BYTES // 2]
    tensor = _pick(rng, fits)
    assert isinstance(tensor, TensorProto)
    offset = SECRET_CHUNK * int(rng.integers(0, (SECRET_BYTES - len(tensor.raw_data)) // SECRET_CHUNK))
    place = str(_pick(rng, ["initializer", "constant_node", "sparse_values", "subgraph"]))
    if place == "initializer":
        _externalise(tensor, location, offset)
    elif place == "constant_node":  # the tensor moves into a Constant node's value attribute
        model.graph.initializer.remove(tensor)
        value = TensorProto()
        value.CopyFrom(tensor)
        _externalise(value, location, offset)
        model.graph.node.insert(0, helper.make_node("Constant", [], [tensor.name], value=value))
    elif place == "sparse_values":
        model.graph.initializer.remove(tensor)
        n = int(np.prod(tensor.dims))
        values = TensorProto()
        values.CopyFrom(tensor)
        del values.dims[:]
        values.dims.append(n)
        _externalise(values, location, offset)
        indices = numpy_helper.from_array(np.arange(n, dtype=np.int64), f"{tensor.name}_indices")
        model.graph.sparse_initializer.append(helper.make_sparse_tensor(values, indices, list(tensor.dims)))
    else:  # inside an If branch: only a recursive check finds it
        pre, out = _rewire_output(model)
        inner = TensorProto()
        inner.CopyFrom(tensor)
        inner.name = "fuzz_inner"
        _externalise(inner, location, offset)
        then = helper.make_graph(
            [helper.make_node("Identity", [pre], ["t"])], "then", [], [_any_float("t")], [inner]
        )
        other = helper.make_graph(
            [helper.make_node("Identity", ["fuzz_inner"], ["e"])], "else", [], [_any_float("e")]
        )
        model.graph.initializer.append(numpy_helper.from_array(np.array(True), "fuzz_if"))
        model.graph.node.append(
            helper.make_node("If", ["fuzz_if"], [out], then_branch=then, else_branch=other)
        )
    return f"external data {location!r} offset {offset} in {place} ({tensor.name})"


def sparse(model: onnx.ModelProto, rng: np.random.Generator, _: Path) -> str:
    tensor = _pick(rng, _float_initializers(model))
    assert isinstance(tensor, TensorProto)
    values = numpy_helper.to_array(tensor).ravel()
    huge = rng.random() < 0.5
    dims = [2**20, 2**20] if huge else list(tensor.dims)
    model.graph.initializer.remove(tensor)
    sparse_values = numpy_helper.from_array(values, tensor.name)
    indices = numpy_helper.from_array(np.arange(values.size, dtype=np.int64), f"{tensor.name}_indices")
    model.graph.sparse_initializer.append(helper.make_sparse_tensor(sparse_values, indices, dims))
    return f"sparse initializer {tensor.name}" + (" of 4 TiB dense" if huge else "")


def nonfinite(model: onnx.ModelProto, rng: np.random.Generator, _: Path) -> str:
    """NaN or +-Inf in one float initializer: the model still runs, and poisons whoever runs it."""
    tensor = _pick(rng, _float_initializers(model))
    assert isinstance(tensor, TensorProto)
    values = numpy_helper.to_array(tensor).copy()
    value = _pick(rng, [np.nan, np.inf, -np.inf])
    count = int(rng.integers(1, values.size + 1))
    values.reshape(-1)[:count] = value
    tensor.CopyFrom(numpy_helper.from_array(values, tensor.name))
    return f"{count} of {values.size} values of {tensor.name} = {value}"


_EXTREME_STEPS = [0, 2**31, 2**63 - 1, -(2**63), -(2**31), 2**21]


def _data_input(model: onnx.ModelProto) -> onnx.ValueInfoProto:
    names = {i.name for i in model.graph.initializer}
    return next(i for i in model.graph.input if i.name not in names)


def hostile_attrs(model: onnx.ModelProto, rng: np.random.Generator, _: Path) -> str:
    """Values onnx's checker lets through: Conv group 0 or negative, a BatchNormalization epsilon that is
    negative or not finite, and a Slice of the input's shape with an extreme step (onnx's own shape
    inference allocates without bound, or crashes, on steps near 2**63). The extra nodes dangle: the
    graph's outputs are unchanged, so only a checker that reads every node catches them."""
    variant = str(_pick(rng, ["group", "epsilon", "slice"]))
    x = _data_input(model)
    if variant == "group":
        convs = [n for n in model.graph.node if n.op_type in ("Conv", "ConvTranspose")]
        group = int(_pick(rng, [0, -1, -(2**31), 2**40]))
        if convs:
            node = _pick(rng, convs)
            assert isinstance(node, onnx.NodeProto)
            kept = [a for a in node.attribute if a.name != "group"]
            del node.attribute[:]
            node.attribute.extend([*kept, helper.make_attribute("group", group)])
            return f"Conv {node.name!r} group {group}"
        variant = "epsilon"
    if variant == "epsilon":
        channels = x.type.tensor_type.shape.dim[1].dim_value or 1
        eps = float(_pick(rng, [-1e-5, -1.0, float("nan"), float("inf"), 0.0]))
        params = [f"fuzz_bn_{k}" for k in ("scale", "bias", "mean", "var")]
        for name in params:
            model.graph.initializer.append(numpy_helper.from_array(np.ones(channels, np.float32), name))
        model.graph.node.append(
            helper.make_node("BatchNormalization", [x.name, *params], ["fuzz_bn_out"], epsilon=eps)
        )
        return f"dangling BatchNormalization epsilon {eps}"
    step = int(_pick(rng, _EXTREME_STEPS))
    start, end = _pick(rng, [(0, 2**63 - 1), (-1, -(2**63)), (2**63 - 1, -(2**63))])  # type: ignore[misc]
    for name, value in (("start", start), ("end", end), ("axis", 0), ("step", step)):
        model.graph.initializer.append(numpy_helper.from_array(np.array([value], np.int64), f"fuzz_{name}"))
    model.graph.node.extend(
        [
            helper.make_node("Shape", [x.name], ["fuzz_shape"]),
            helper.make_node(
                "Slice",
                ["fuzz_shape", "fuzz_start", "fuzz_end", "fuzz_axis", "fuzz_step"],
                ["fuzz_sliced"],
            ),
        ]
    )
    return f"dangling Slice of the input shape, [{start}:{end}:{step}]"


MUST_REFUSE = frozenset({"onnx_external_data", "onnx_nonfinite", "onnx_attrs"})

ONNX_MUTATIONS: dict[str, OnnxMutation] = {
    "onnx_input_dims": input_dims,
    "onnx_extra_output": extra_output,
    "onnx_loop": loop,
    "onnx_control_flow": control_flow,
    "onnx_custom_op": custom_op,
    "onnx_constant_of_shape": constant_of_shape,
    "onnx_resize": resize,
    "onnx_dtype": initializer_dtype,
    "onnx_dims": initializer_dims,
    "onnx_raw_length": raw_length,
    "onnx_external_data": external_data,
    "onnx_sparse": sparse,
    "onnx_nonfinite": nonfinite,
    "onnx_attrs": hostile_attrs,
}
