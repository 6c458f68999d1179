"""The load-time contract for ONNX that arrives from elsewhere: bounded, parsed once, checked, only then run.

Bundles, packages and generators come from machines nobody controls, and a valid manifest with a
recomputed hash says nothing about the ONNX inside. Before the first onnxruntime session, torch
allocation or tensor read, :func:`check_onnx` proves from the file alone that running it is cheap and
means what the manifest says:

1. the bytes are bounded, parsed once and their text decoded; no model-local functions, no
   graph-valued attributes (``Loop``, ``If``, ``Scan``: a loop of 2**62 iterations would never return)
   and every tensor inside the file, float32 (or a small int64 shape tensor) holding exactly what its
   dims say (:func:`export.onnx_parse.parse_onnx`, which readers that only take weights out call alone);
2. only the default ONNX domain and the operators of :data:`ALLOWED_OPS`;
3. the data inputs and outputs have the shapes the caller expects, with a symbolic or small batch dim;
4. strict shape inference gives every value a static shape at batch 1 and at ``max_batch``; element
   counts and operation counts are bounded per sample (a batch of B may cost B times the budget), and
   integer tensors may only be copied (``Shape``, ``Slice``, ``Concat``, ...), never computed, so no
   size can be derived by arithmetic;
5. a classifier's deployment metadata, where it has some, is well formed with one class name per logit
   (:func:`export.metadata.read_deploy_metadata`; its ``metadata_props`` were bounded in step 1).

So the memory and compute of running the graph are bounded before it runs: this is the per-file budget
of time and memory. Every refusal is ``error`` (BundleError by default) naming the source, what was
expected, what was got and the fix; anything else a hostile file makes the checker raise is turned into
one too (:func:`export.onnx_parse.contract_guard`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import onnx
from onnx import TensorProto, numpy_helper

from common.errors import BundleError, ToolkitError
from export.metadata import read_deploy_metadata
from export.onnx_export import DECODER_INPUT_NAMES, DECODER_OUTPUT_NAME
from export.onnx_parse import (
    DEFAULT_LIMITS,
    OnnxLimits,
    check_data,
    contract_guard,
    dtype_name,
    parse_onnx,
    refuse,
)
from export.onnx_shapes import INTEGER_OPS, Values, operations, static_values

__all__ = [
    "ALLOWED_OPS",
    "DEFAULT_LIMITS",
    "MIN_OPSET",
    "OnnxLimits",
    "check_classifier_onnx",
    "check_decoder_onnx",
    "check_onnx",
    "parse_onnx",
]

# What our exporters write (opset 18, measured on chain specs, zoo:mobilenetv2/vgg11/resnet18 and
# the elastic mbv3 subnets with BN kept and folded, cvae-small/-large decoders and the conditional
# generator a package carries) ...
_EXPORTED_OPS = frozenset(
    {
        "Add", "AveragePool", "BatchNormalization", "Clip", "Concat", "Constant", "Conv",
        "ConvTranspose", "Div", "Flatten", "Gemm", "GlobalAveragePool", "HardSwish", "LeakyRelu",
        "MaxPool", "ReduceMean", "Relu", "Reshape", "Resize", "Shape", "Sigmoid", "Slice", "Sub",
    }
)  # fmt: skip
# ... and what server_kit.teachers.onnx_convert turns into torch for foreign classifiers (its SUPPORTED_OPS).
_CONVERTED_OPS = frozenset(
    {
        "Add", "AveragePool", "BatchNormalization", "Cast", "Clip", "Concat", "Constant", "Conv", "Div",
        "Dropout", "Flatten", "Gather", "Gemm", "GlobalAveragePool", "GlobalMaxPool", "HardSigmoid",
        "HardSwish", "Identity", "LeakyRelu", "LogSoftmax", "MatMul", "MaxPool", "Mul", "ReduceMax",
        "ReduceMean", "ReduceSum", "Relu", "Reshape", "Shape", "Sigmoid", "Softmax", "Squeeze", "Sub",
        "Tanh", "Transpose", "Unsqueeze",
    }
)  # fmt: skip
# int8 QDQ models (export.quantize) stay on the device that made them and are never loaded from
# elsewhere, so QuantizeLinear / DequantizeLinear are not allowed.
ALLOWED_OPS: frozenset[str] = _EXPORTED_OPS | _CONVERTED_OPS
MIN_OPSET = 11  # the oldest opset the converter is tested on; the newest is what the installed onnx knows
_DOMAINS = ("", "ai.onnx")
_CONSTANT_ATTRS = frozenset({"value", "value_float", "value_floats", "value_int", "value_ints"})


# ------------------------------------------------------------------------ 2, 3, 4: graph, shapes, budget


def check_onnx(
    model: bytes | onnx.ModelProto,
    *,
    inputs: Sequence[tuple[int, ...] | None],
    outputs: Sequence[tuple[int, ...] | None],
    input_names: Sequence[str] | None = None,
    output_names: Sequence[str] | None = None,
    source: str,
    limits: OnnxLimits = DEFAULT_LIMITS,
    error: type[ToolkitError] = BundleError,
) -> onnx.ModelProto:
    """The parsed model, once it passed the whole contract of the module docstring.

    ``inputs`` / ``outputs`` give each data input's and output's shape without the batch dim, in graph
    order (a classifier: ``[(C, H, W)]`` and ``[(num_classes,)]``); ``None`` accepts the shape the graph
    declares (inputs: static) or infers (outputs: anywhere). Every data input is float32 with the batch
    as dim 0, symbolic or an int in [1, max_static_batch]; a given output shape is ``[batch, *shape]``.
    ``input_names`` / ``output_names`` are checked when given. A ModelProto is taken as parsed by
    :func:`parse_onnx`; its data checks run again (they read no tensor data). Whatever else the checker
    raises on a hostile file is turned into ``error`` naming ``source`` too.
    """
    if isinstance(model, onnx.ModelProto):
        proto = model
        with contract_guard(source, error):
            check_data(proto, source, limits, error)
    else:
        proto = parse_onnx(model, source=source, limits=limits, error=error)
    with contract_guard(source, error):
        _check_graph(proto, inputs, outputs, input_names, output_names, source, limits, error)
    return proto


def _check_graph(
    proto: onnx.ModelProto,
    inputs: Sequence[tuple[int, ...] | None],
    outputs: Sequence[tuple[int, ...] | None],
    input_names: Sequence[str] | None,
    output_names: Sequence[str] | None,
    source: str,
    limits: OnnxLimits,
    error: type[ToolkitError],
) -> None:
    """Steps 2 to 4 of the module docstring on a model that passed :func:`parse_onnx`."""
    _check_ops(proto, source, error)
    _check_attributes(proto, source, error)
    batch, declared = _check_inputs(proto, inputs, input_names, source, limits, error)
    got_outputs = [o.name for o in proto.graph.output]
    if len(got_outputs) != len(outputs) or (output_names is not None and got_outputs != list(output_names)):
        want = list(output_names) if output_names is not None else f"{len(outputs)} output(s)"
        raise refuse(error, source, f"expected ONNX outputs {want}, got {got_outputs}", _EXPORT_FIX)
    batches = [batch] if batch is not None else sorted({1, limits.max_batch})
    for b in batches:
        try:
            full = {name: (b, *rest) for name, rest in declared.items()}
            values = static_values(proto, full, max_elements=limits.max_shape_elements)
        except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as err:
            raise refuse(
                error,
                source,
                f"the graph fails ONNX checks or strict shape inference at batch {b}: {str(err)[:500]}",
                _EXPORT_FIX,
            ) from err
        _check_budget(proto, values, declared, b, source, limits, error)
        _check_outputs(proto, values, outputs, b, source, error)


_EXPORT_FIX = "export the model with export.onnx_export for the shapes the manifest declares"


def check_classifier_onnx(
    model: bytes | onnx.ModelProto,
    *,
    input_shape: tuple[int, ...],
    num_classes: int,
    source: str,
    limits: OnnxLimits = DEFAULT_LIMITS,
    error: type[ToolkitError] = BundleError,
) -> onnx.ModelProto:
    """:func:`check_onnx` for a classifier: one input ``[batch, *input_shape]`` -> ``[batch, num_classes]``
    (names free: a classifier exported elsewhere may call them anything), and its deployment metadata,
    when present, names ``num_classes`` classes and describes that input."""
    proto = check_onnx(
        model,
        inputs=[tuple(input_shape)],
        outputs=[(num_classes,)],
        source=source,
        limits=limits,
        error=error,
    )
    props = {entry.key: entry.value for entry in proto.metadata_props}  # bounded by check_onnx
    meta = read_deploy_metadata(props, num_logits=num_classes, source=source, error=error)
    if meta is not None:
        spec = meta.input_spec
        weights = {init.name for init in proto.graph.initializer}
        graph_input = next((i.name for i in proto.graph.input if i.name not in weights), None)
        if spec.shape != tuple(input_shape) or spec.name != graph_input:
            raise refuse(
                error,
                source,
                f"the metadata's input_spec describes input {spec.name[:80]!r} {list(spec.shape)}, the graph "
                f"has {str(graph_input)[:80]!r} {list(input_shape)}",
                _EXPORT_FIX,
            )
    return proto


def check_decoder_onnx(
    model: bytes | onnx.ModelProto,
    *,
    latent_dim: int | None,
    num_classes: int,
    output_shape: tuple[int, ...],
    source: str,
    limits: OnnxLimits = DEFAULT_LIMITS,
    error: type[ToolkitError] = BundleError,
) -> onnx.ModelProto:
    """:func:`check_onnx` for a CVAE decoder or generator: ``z`` [batch, latent_dim] and ``y``
    [batch, num_classes] -> ``x`` [batch, *output_shape]. ``latent_dim`` None takes the declared one."""
    return check_onnx(
        model,
        inputs=[None if latent_dim is None else (latent_dim,), (num_classes,)],
        outputs=[tuple(output_shape)],
        input_names=DECODER_INPUT_NAMES,
        output_names=[DECODER_OUTPUT_NAME],
        source=source,
        limits=limits,
        error=error,
    )


def _check_ops(proto: onnx.ModelProto, source: str, error: type[ToolkitError]) -> None:
    opsets = [(o.domain, o.version) for o in proto.opset_import]
    newest = onnx.defs.onnx_opset_version()
    if len(opsets) != 1 or opsets[0][0] not in _DOMAINS or not MIN_OPSET <= opsets[0][1] <= newest:
        raise refuse(
            error,
            source,
            f"the model imports opsets {opsets}, expected only the default domain at a version in "
            f"[{MIN_OPSET}, {newest}]",
            "export with export.onnx_export (opset 18) and no custom domains",
        )
    found: dict[str, str] = {}
    for index, node in enumerate(proto.graph.node):
        op = node.op_type if node.domain in _DOMAINS else f"{node.domain}::{node.op_type}"
        if op not in ALLOWED_OPS:
            found.setdefault(op, str(node.name or index))
        elif op == "Constant" and {a.name for a in node.attribute} - _CONSTANT_ATTRS:
            found.setdefault(f"Constant({','.join(a.name for a in node.attribute)})", str(node.name or index))
    if found:
        listed = ", ".join(f"{op!r} (node {name!r})" for op, name in sorted(found.items()))
        raise refuse(
            error,
            source,
            f"operators outside the allowlist: {listed}; allowed: {sorted(ALLOWED_OPS)}",
            "export with export.onnx_export, which writes only allowed operators",
        )


_MAX_GROUP = 1 << 16  # Conv groups: at most one per channel, and no real model has more channels
_MAX_SLICE_STEP = 1 << 20  # |step| of a Slice: onnx's own shape inference overflows (bad_alloc, SIGSEGV)
# on steps near 2**63 before any check of ours could see its output, so they are bounded first


def _int_constants(proto: onnx.ModelProto) -> dict[str, np.ndarray]:
    """The int64 initializers and Constant outputs (each small: :func:`parse_onnx` bounded them)."""
    found = {
        i.name: numpy_helper.to_array(i) for i in proto.graph.initializer if i.data_type == TensorProto.INT64
    }
    for node in proto.graph.node:
        if node.op_type == "Constant" and node.output:
            for attr in node.attribute:
                if attr.name == "value" and attr.t.data_type == TensorProto.INT64:
                    found[node.output[0]] = numpy_helper.to_array(attr.t)
                elif attr.name in ("value_int", "value_ints"):
                    found[node.output[0]] = np.asarray(onnx.helper.get_attribute_value(attr), dtype=np.int64)
    return found


def _check_attributes(proto: onnx.ModelProto, source: str, error: type[ToolkitError]) -> None:
    """Attribute values that pass onnx's checker but break its shape inference or the torch converter:
    a Conv ``group`` below 1, a BatchNormalization ``epsilon`` not finite and > 0, a Slice step that is
    not a constant of at most 2**20 in size."""
    constants = _int_constants(proto)
    for index, node in enumerate(proto.graph.node):
        name = str(node.name or index)
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        problem = None
        if node.op_type in ("Conv", "ConvTranspose"):
            group = attrs.get("group", 1)
            if not isinstance(group, int) or not 1 <= group <= _MAX_GROUP:
                problem = f"group must be an integer in [1, {_MAX_GROUP}], got {group!r}"
        elif node.op_type == "BatchNormalization":
            eps = attrs.get("epsilon", 1e-5)
            if not isinstance(eps, float) or not math.isfinite(eps) or not 0 < eps <= 1:
                problem = f"epsilon must be a finite number in (0, 1], got {eps!r}"
        elif node.op_type == "Slice" and len(node.input) > 4 and node.input[4]:
            steps = constants.get(node.input[4])
            if steps is None or not all(1 <= abs(int(v)) <= _MAX_SLICE_STEP for v in steps.reshape(-1)):
                shown = "computed" if steps is None else steps.reshape(-1)[:4].tolist()
                problem = (
                    f"steps must be constants in [-{_MAX_SLICE_STEP}, {_MAX_SLICE_STEP}] but 0, got {shown}"
                )
        if problem is not None:
            raise refuse(error, source, f"node {name!r} ({node.op_type}): {problem}", _EXPORT_FIX)


def _shape_text(dims: Sequence[int | str | None]) -> str:
    return "[" + ", ".join("?" if d is None else str(d) for d in dims) + "]"


def _check_inputs(
    proto: onnx.ModelProto,
    expected: Sequence[tuple[int, ...] | None],
    names: Sequence[str] | None,
    source: str,
    limits: OnnxLimits,
    error: type[ToolkitError],
) -> tuple[int | None, dict[str, tuple[int, ...]]]:
    """(the static batch or None when symbolic, per data input its non-batch dims)."""
    initializers = {i.name for i in proto.graph.initializer}
    data = [i for i in proto.graph.input if i.name not in initializers]
    got_names = [i.name for i in data]
    if len(data) != len(expected) or (names is not None and got_names != list(names)):
        want = list(names) if names is not None else f"{len(expected)} data input(s)"
        raise refuse(error, source, f"expected ONNX inputs {want}, got {got_names}", _EXPORT_FIX)
    batches: set[int | None] = set()
    declared: dict[str, tuple[int, ...]] = {}
    for info, want in zip(data, expected, strict=True):
        tensor = info.type.tensor_type
        dims = [d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in tensor.shape.dim]
        shown = _shape_text(dims)
        wanted = "[batch, " + ", ".join(map(str, want)) + "]" if want is not None else "[batch, static dims]"
        if (
            not info.type.HasField("tensor_type")
            or tensor.elem_type != TensorProto.FLOAT
            or not tensor.HasField("shape")
            or len(dims) < 1
        ):
            raise refuse(
                error,
                source,
                f"ONNX input {info.name!r} must be a float32 tensor {wanted}, got {shown}",
                _EXPORT_FIX,
            )
        rest = dims[1:]
        bad_batch = isinstance(dims[0], int) and not 1 <= dims[0] <= limits.max_static_batch
        bad_rest = (
            any(not isinstance(d, int) or not 1 <= d <= limits.max_dim for d in rest)
            if want is None
            else tuple(rest) != tuple(want)
        )
        if bad_batch or bad_rest:
            batch_rule = f"symbolic or in [1, {limits.max_static_batch}]"
            raise refuse(
                error,
                source,
                f"ONNX input {info.name!r} has shape {shown}, expected {wanted} (batch {batch_rule})",
                _EXPORT_FIX,
            )
        batches.add(dims[0] if isinstance(dims[0], int) else None)
        declared[info.name] = tuple(rest)  # type: ignore[arg-type]
    if len(batches) > 1:
        raise refuse(
            error,
            source,
            f"the data inputs disagree on the batch dim ({sorted(map(str, batches))})",
            _EXPORT_FIX,
        )
    return next(iter(batches), None), declared


def _check_outputs(
    proto: onnx.ModelProto,
    values: Values,
    expected: Sequence[tuple[int, ...] | None],
    batch: int,
    source: str,
    error: type[ToolkitError],
) -> None:
    for info, want in zip(proto.graph.output, expected, strict=True):
        elem, dims = values.get(info.name, (0, ()))
        if want is None or (elem == TensorProto.FLOAT and dims == (batch, *want)):
            continue
        got = _shape_text([d if d >= 0 else None for d in dims])
        kind = "float32" if elem == TensorProto.FLOAT else dtype_name(elem)
        raise refuse(
            error,
            source,
            f"ONNX output {info.name!r} is {kind} {got} at batch {batch}, expected float32 "
            f"{_shape_text([batch, *want])} (the manifest's shape)",
            _EXPORT_FIX,
        )


def _check_budget(
    proto: onnx.ModelProto,
    values: Values,
    declared: dict[str, tuple[int, ...]],
    batch: int,
    source: str,
    limits: OnnxLimits,
    error: type[ToolkitError],
) -> None:
    """Every node output: static shape, float32 or copied int64, and the per-sample element and
    operation budgets (times ``batch``)."""
    max_tensor = batch * limits.max_tensor_elements
    max_total = batch * limits.max_total_elements
    max_ops = batch * limits.max_operations
    at = f"at batch {batch} (the budget is per sample, times the batch)"
    fix = "export a smaller model with export.onnx_export"
    total = sum(batch * math.prod(rest) for rest in declared.values())
    ops = 0
    for index, node in enumerate(proto.graph.node):
        label = f"node {node.name or index!r} ({node.op_type})"
        sizes = []
        for name in filter(None, node.output):
            elem, dims = values.get(name, (0, (-1,)))
            if elem not in (TensorProto.FLOAT, TensorProto.INT64) or any(d < 0 for d in dims):
                raise refuse(
                    error,
                    source,
                    f"{label} output {name!r} has no static float32/int64 shape after inference (got "
                    f"{dtype_name(elem)} {_shape_text([d if d >= 0 else None for d in dims])})",
                    fix,
                )
            if len(dims) > limits.max_rank:
                raise refuse(
                    error, source, f"{label} output {name!r} has rank {len(dims)} > {limits.max_rank}", fix
                )
            if elem == TensorProto.INT64 and (
                node.op_type not in INTEGER_OPS or math.prod(dims) > limits.max_shape_elements
            ):
                raise refuse(
                    error,
                    source,
                    f"{label} makes the int64 tensor {name!r} {_shape_text(dims)}; integer tensors are "
                    f"shapes of at most {limits.max_shape_elements} elements, only copied "
                    f"({', '.join(sorted(INTEGER_OPS))}) so that no size is computed at run time",
                    fix,
                )
            sizes.append(math.prod(dims))
        if any(s > max_tensor for s in sizes):
            raise refuse(
                error,
                source,
                f"{label} makes a tensor of {max(sizes)} elements {at}, expected at most {max_tensor}",
                fix,
            )
        total += sum(sizes)
        ops += operations(node, values)
    if total > max_total or ops > max_ops:
        raise refuse(
            error,
            source,
            f"one forward pass makes {total} elements in {ops} operations {at}, expected at most "
            f"{max_total} elements and {max_ops} operations",
            fix,
        )
