"""Static shapes of an ONNX graph at a fixed batch, and what running it costs: the maths behind
:mod:`export.onnx_check`'s budget.

``onnx.shape_inference`` alone leaves a shape unknown when it is computed at run time (``Shape`` ->
``Gather`` -> ``Concat`` -> ``Reshape``), and its data propagation covers only some opset versions. The
contract lets integer tensors only be copied (``Shape``, ``Slice``, ``Gather``, ``Concat``, ``Reshape``,
...), so with every input shape fixed they are all known: :func:`static_values` folds them into
constants and infers again until nothing changes, then every value has a static shape or stays unknown
(which the contract refuses).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

__all__ = ["INTEGER_OPS", "Values", "operations", "static_values"]

# Ops that may output an int64 tensor (a shape, axes, indices): each only copies values, none computes one.
INTEGER_OPS = frozenset(
    {"Concat", "Constant", "Gather", "Identity", "Reshape", "Shape", "Slice", "Squeeze", "Unsqueeze"}
)
Values = dict[str, tuple[int, tuple[int, ...]]]  # name -> (ONNX elem type, dims; -1 where unknown)
_KEEP_VALUES = 64  # float initializers up to this size keep their values for inference (Resize scales)
_MAX_PASSES = 16  # fold-and-infer rounds: shapes read from shapes read from shapes ... this deep
_HEAVY = frozenset({"Conv", "ConvTranspose", "Gemm", "MatMul", "MaxPool", "AveragePool"})


def static_values(
    model: onnx.ModelProto, inputs: Mapping[str, tuple[int, ...]], *, max_elements: int = 64
) -> Values:
    """Every value's (elem type, dims) with the data ``inputs`` fixed to these full shapes.

    Runs ``onnx.checker`` and strict, type-checked inference on a skeleton of ``model``: float
    initializers above 64 elements become inputs of the same type and shape (no shape depends on their
    values, and a 45 MB model is not copied), integer tensors of at most ``max_elements`` are folded
    into constants. Raises onnx's ValidationError / InferenceError. ``model`` must have passed
    :func:`export.onnx_parse.parse_onnx`: onnx's C++ checker cannot quote undecodable text in its errors.
    """
    skeleton = onnx.ModelProto()
    skeleton.ir_version = model.ir_version
    skeleton.opset_import.extend(model.opset_import)
    graph = skeleton.graph
    graph.name = model.graph.name or "graph"
    graph.node.extend(model.graph.node)
    graph.output.extend(model.graph.output)
    for name, dims in inputs.items():
        graph.input.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, list(dims)))
    for init in model.graph.initializer:
        if init.data_type != TensorProto.FLOAT or math.prod(init.dims) <= _KEEP_VALUES:
            graph.initializer.append(init)
        else:
            graph.input.append(helper.make_tensor_value_info(init.name, init.data_type, list(init.dims)))
    onnx.checker.check_model(skeleton)
    for _ in range(_MAX_PASSES):
        values = _infer(skeleton)
        if not _fold(graph, values, max_elements):
            break
    return values


def _infer(model: onnx.ModelProto) -> Values:
    inferred = onnx.shape_inference.infer_shapes(model, check_type=True, strict_mode=True, data_prop=True)
    values: Values = {}
    for info in (*inferred.graph.input, *inferred.graph.value_info, *inferred.graph.output):
        tensor = info.type.tensor_type
        if info.type.HasField("tensor_type") and tensor.HasField("shape"):
            dims = tuple(d.dim_value if d.HasField("dim_value") else -1 for d in tensor.shape.dim)
            values[info.name] = (tensor.elem_type, dims)
    for init in inferred.graph.initializer:
        values[init.name] = (init.data_type, tuple(init.dims))
    return values


def _fold(graph: onnx.GraphProto, values: Values, max_elements: int) -> bool:
    """Replace every integer node whose result is now known by a Constant; True if any was replaced."""
    known = {i.name: numpy_helper.to_array(i) for i in graph.initializer if i.data_type == TensorProto.INT64}
    nodes, changed = [], False
    for node in graph.node:
        result = _evaluate(node, known, values)
        if result is None or result.size > max_elements:
            nodes.append(node)
            continue
        known[node.output[0]] = result
        if node.op_type == "Constant":
            nodes.append(node)
        else:
            tensor = numpy_helper.from_array(result.astype(np.int64), node.output[0])
            nodes.append(helper.make_node("Constant", [], [node.output[0]], value=tensor))
            changed = True
    if changed:
        del graph.node[:]
        graph.node.extend(nodes)
    return changed


def _evaluate(node: onnx.NodeProto, known: dict[str, np.ndarray], values: Values) -> np.ndarray | None:
    """The int64 result of a copying node whose inputs are known, else None (left to the runtime)."""
    if node.op_type not in INTEGER_OPS or len(node.output) != 1:
        return None
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    if node.op_type == "Constant":
        value = attrs.get("value")
        if isinstance(value, TensorProto) and value.data_type == TensorProto.INT64:
            return numpy_helper.to_array(value)
        ints = attrs.get("value_int", attrs.get("value_ints"))
        return None if ints is None else np.asarray(ints, dtype=np.int64)
    if node.op_type == "Shape":
        dims = values.get(node.input[0], (0, (-1,)))[1]
        if any(d < 0 for d in dims):
            return None
        rank = len(dims)
        start, end = (
            min(max(v + rank if v < 0 else v, 0), rank)
            for v in (attrs.get("start", 0), attrs.get("end", rank))
        )
        return np.asarray(dims[start:end], dtype=np.int64)
    if any(name and name not in known for name in node.input) or not node.input or node.input[0] not in known:
        return None
    args = [known[name] if name else None for name in node.input]
    try:
        return _copy(node.op_type, args, attrs)
    except (IndexError, KeyError, OverflowError, TypeError, ValueError):  # invalid: inference refuses it
        return None


def _copy(op: str, args: list[np.ndarray | None], attrs: dict) -> np.ndarray:
    data = args[0]
    assert data is not None
    axes_input = args[1] if len(args) > 1 and args[1] is not None else None
    if op == "Identity":
        return data
    if op == "Concat":
        return np.concatenate([a for a in args if a is not None], axis=int(attrs["axis"]))
    if op == "Gather":
        return np.take(data, args[1], axis=int(attrs.get("axis", 0)))
    if op == "Reshape":
        shape = [int(v) for v in args[1]]  # type: ignore[union-attr]
        if not attrs.get("allowzero", 0):
            shape = [data.shape[i] if v == 0 else v for i, v in enumerate(shape)]
        return data.reshape(shape)
    if op == "Unsqueeze":
        axes = [int(v) for v in attrs.get("axes", axes_input)]  # type: ignore[union-attr]
        rank = data.ndim + len(axes)
        for axis in sorted(a % rank for a in axes):
            data = np.expand_dims(data, axis)
        return data
    if op == "Squeeze":
        axes = attrs.get("axes", axes_input)
        return np.squeeze(data, axis=None if axes is None else tuple(int(a) for a in axes))
    # Slice (opset >= 10): starts, ends, optional axes and steps as inputs
    starts, ends = args[1], args[2]
    axes = args[3] if len(args) > 3 and args[3] is not None else range(len(starts))  # type: ignore[arg-type]
    steps = args[4] if len(args) > 4 and args[4] is not None else [1] * len(starts)  # type: ignore[arg-type]
    index = [slice(None)] * data.ndim
    for axis, start, end, step in zip(axes, starts, ends, steps, strict=True):  # type: ignore[arg-type]
        index[int(axis)] = slice(int(start), int(end), int(step))
    return data[tuple(index)]


def operations(node: onnx.NodeProto, values: Values) -> int:
    """Work of one node: multiply-accumulates of conv, matmul and pools; elements read and written for
    every other node (elementwise ops, reductions, resizes, copies)."""
    shapes = [values.get(name, (0, ()))[1] if name else () for name in node.input]
    out = sum(math.prod(values.get(name, (0, ()))[1]) for name in node.output if name)
    if node.op_type not in _HEAVY or not shapes:
        return out + sum(math.prod(s) for s in shapes)
    if node.op_type == "Conv":  # weight C_out x C_in/group x k...: each output reads one filter
        return out * math.prod(shapes[1][1:])
    if node.op_type == "ConvTranspose":  # weight C_in x C_out/group x k...: each input writes one filter
        return math.prod(shapes[0]) * math.prod(shapes[1][1:])
    if node.op_type in ("Gemm", "MatMul"):
        a = shapes[0]
        trans_a = any(attr.name == "transA" and attr.i for attr in node.attribute)
        return out * (a[0] if trans_a and len(a) == 2 else a[-1] if a else 1)
    kernel = next((list(attr.ints) for attr in node.attribute if attr.name == "kernel_shape"), [])
    return out * math.prod(kernel)
