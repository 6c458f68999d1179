"""The first half of the load-time ONNX contract: bounded bytes, parsed once, text decoded, data inside.

:func:`parse_onnx` is what every reader of foreign ONNX calls first (``export.onnx_check.check_onnx``
goes on from its result; ``export.weights`` only takes weights out):

1. the bytes are bounded, then parsed once (``onnx.load_model_from_string`` never follows external
   data; only ``numpy_helper.to_array`` and onnxruntime would);
2. every text field is valid UTF-8: the protobuf runtime hands an undecodable string field back as
   ``bytes``, and onnx's C++ checker fails to turn an error message that quotes one into Python text,
   so names, op types, domains and string attributes are decoded here, once, for everything after;
3. no model-local functions, no graph-valued, sparse or reference attributes, and every tensor lives
   inside the file (no external data in any form, no sparse tensors), is float32 (or a small int64
   shape tensor), has dims >= 1 and exactly as much data as its dims say, finite float values (a NaN
   weight would poison whoever runs the model, server or device); counts and bytes are bounded;
4. the ``metadata_props`` are bounded in count and size (``export.metadata.check_metadata_props``).

:func:`contract_guard` is the backstop around the whole contract: whatever a hostile file still makes
the checker raise outside the contract's own refusals becomes ``error`` naming the file. Every refusal
is ``error`` (BundleError by default) naming the source, what was expected, what was got and the fix.
"""

from __future__ import annotations

import math
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, fields
from pathlib import Path

import numpy as np
import onnx
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import DecodeError, Message
from onnx import AttributeProto, TensorProto

from common.checks import check_int
from common.errors import BundleError, ToolkitError
from export.metadata import check_metadata_props

__all__ = [
    "DEFAULT_LIMITS",
    "OnnxLimits",
    "check_data",
    "contract_guard",
    "dtype_name",
    "parse_onnx",
    "refuse",
]


@dataclass(frozen=True, kw_only=True)
class OnnxLimits:
    """Bounds of the contract. Element and operation counts are per sample (at batch 1); a batch of
    B may use B times as much, checked at ``max_batch`` too.

    Measured on our exports (opset 18, 3 x 32 x 32): per sample the largest value holds 0.15 M elements
    (mbv3, largest subnet), one forward pass makes at most 4.0 M values (the same, BN kept) and
    resnet18 does 0.56 G multiply-accumulates in 45 MB. The largest chain the arch grammar allows
    (18 x C128k7, F300, F10 on 3 x 32 x 32) is the extreme: 212 MB of weights, 14 G
    multiply-accumulates and 7.2 M values per sample. The defaults leave about 2x over that chain and
    >= 8x over the rest; ``max_batch`` is the largest batch the toolkit feeds (decoder sampling, 1024).
    """

    max_model_bytes: int = 512 << 20
    max_weight_bytes: int = 512 << 20  # initializers + Constant tensors
    max_initializers: int = 4096
    max_nodes: int = 4096
    max_dim: int = 1 << 20  # any one dim of an initializer or constant
    max_rank: int = 8  # dims of any tensor or value (ours have at most 4)
    max_shape_elements: int = 64  # an int64 initializer or constant: a shape, axes, starts
    max_static_batch: int = 64  # a fixed batch dim is run as is by the parity checks
    max_batch: int = 1024  # the budget is also checked at this batch (superlinear growth shows)
    max_tensor_elements: int = 1 << 22  # one value, per sample (16 MiB of float32)
    max_total_elements: int = 1 << 25  # all values of one forward pass, per sample (128 MiB)
    max_operations: int = 1 << 35  # multiply-accumulates (conv, matmul, pools) + elements touched

    def __post_init__(self) -> None:
        for f in fields(self):
            check_int(f.name, getattr(self, f.name), 1)


DEFAULT_LIMITS = OnnxLimits()
_EXPORT_FIX = "export the model with export.onnx_export (one graph, weights inside the file)"


def refuse(error: type[ToolkitError], source: str, message: str, fix: str) -> ToolkitError:
    """The contract's refusal: ``<source>: <what was expected and got>; fix: <fix>``."""
    return error(f"{source}: {message}; fix: {fix}")


def dtype_name(code: int) -> str:
    return TensorProto.DataType.Name(code) if code in TensorProto.DataType.values() else str(code)


@contextmanager
def contract_guard(source: str, error: type[ToolkitError]) -> Iterator[None]:
    """Turn any exception the contract did not raise on purpose into ``error`` naming ``source``.

    The contract refuses what it knows by name; this is for what a hostile file makes a library below it
    raise (a protobuf, numpy or onnx error type nobody listed). MemoryError passes through: running out
    is an outcome of its own. An honest export never gets here; if one does, the message says it is a
    checker bug and where it was raised, so it is not mistaken for a bad file.
    """
    try:
        yield
    except (ToolkitError, MemoryError):
        raise
    except Exception as err:  # the backstop: whatever a hostile file makes the checker raise
        frames = traceback.extract_tb(err.__traceback__)
        where = f" at {Path(frames[-1].filename).name}:{frames[-1].lineno}" if frames else ""
        raise refuse(
            error,
            source,
            f"expected an ONNX model the load-time contract can check, got one its checker fails on "
            f"({type(err).__name__}{where}: {str(err)[:300]}); a corrupt or hostile file ends here, but if "
            "this file is an honest export of export.onnx_export, this is a bug of export.onnx_check: "
            "report it with the file",
            "re-export the model with export.onnx_export, or fetch the file again if it was corrupted",
        ) from err


# ----------------------------------------------------------------------------------------- parse


def parse_onnx(
    model_bytes: bytes,
    *,
    source: str,
    limits: OnnxLimits = DEFAULT_LIMITS,
    error: type[ToolkitError] = BundleError,
) -> onnx.ModelProto:
    """Bound the bytes, parse once, and refuse undecodable text, anything that reads data from outside
    the file, nests a graph or holds a tensor that is not what its dims say. After this, every
    initializer and Constant can be read with ``numpy_helper.to_array`` without touching the disk or
    allocating more than the file's size, and every string field is ``str``. Does not check the graph's
    operators or shapes (``export.onnx_check.check_onnx`` does)."""
    if not isinstance(model_bytes, bytes | bytearray | memoryview) or len(model_bytes) == 0:
        got = f"{len(model_bytes)} bytes" if isinstance(model_bytes, bytes) else type(model_bytes).__name__
        raise refuse(error, source, f"expected serialized ONNX bytes, got {got}", "pass the file's bytes")
    if len(model_bytes) > limits.max_model_bytes:
        raise refuse(
            error,
            source,
            f"the ONNX model is {len(model_bytes)} bytes, expected at most {limits.max_model_bytes}",
            "export a smaller model",
        )
    with contract_guard(source, error):
        try:
            proto = onnx.load_model_from_string(bytes(model_bytes))
        except (DecodeError, ValueError, RuntimeError) as err:
            raise refuse(
                error,
                source,
                f"not a valid ONNX model ({type(err).__name__}: {err})",
                "pass a serialized ONNX file",
            ) from err
        check_data(proto, source, limits, error)
    return proto


def check_data(proto: onnx.ModelProto, source: str, limits: OnnxLimits, error: type[ToolkitError]) -> None:
    """Steps 2 to 4 of the module docstring on a parsed model (tensor data is read only for finiteness)."""
    _check_text(proto, "model", source, error)
    check_metadata_props(((e.key, e.value) for e in proto.metadata_props), source=source, error=error)
    if proto.functions or proto.training_info:
        what = "model-local functions" if proto.functions else "training_info graphs"
        raise refuse(error, source, f"the model defines {what}, expected a single plain graph", _EXPORT_FIX)
    graph = proto.graph
    if graph.sparse_initializer:
        raise refuse(
            error, source, f"{len(graph.sparse_initializer)} sparse initializers, expected none", _EXPORT_FIX
        )
    if len(graph.node) > limits.max_nodes or len(graph.initializer) > limits.max_initializers:
        raise refuse(
            error,
            source,
            f"{len(graph.node)} nodes and {len(graph.initializer)} initializers, expected at most "
            f"{limits.max_nodes} and {limits.max_initializers}",
            _EXPORT_FIX,
        )
    total = 0
    for where, tensor in _tensors(graph, source, error):
        total += _check_tensor(where, tensor, source, limits, error)
    if total > limits.max_weight_bytes:
        raise refuse(
            error,
            source,
            f"the weights hold {total} bytes, expected at most {limits.max_weight_bytes}",
            _EXPORT_FIX,
        )


# Text that is bytes on the wire but read as text by onnx: attribute strings (Resize's mode, ...).
_TEXT_BYTES = frozenset({("onnx.AttributeProto", "s"), ("onnx.AttributeProto", "strings")})


def _is_repeated(field: FieldDescriptor) -> bool:
    repeated = getattr(field, "is_repeated", None)  # protobuf >= 5; ``label`` before (removed in 7)
    return bool(repeated) if repeated is not None else field.label == FieldDescriptor.LABEL_REPEATED


def _check_text(message: Message, path: str, source: str, error: type[ToolkitError]) -> None:
    """Every string field (and string attribute) of ``message`` and its sub-messages is UTF-8 text.

    Only string, text-bytes and message fields are read: tensor payloads (``raw_data``, ``float_data``)
    are never touched, so this costs nothing per weight. Nesting is bounded by protobuf's parse depth.
    """
    descriptor = message.DESCRIPTOR
    for field in descriptor.fields:
        is_text = field.type == FieldDescriptor.TYPE_STRING or (
            field.type == FieldDescriptor.TYPE_BYTES and (descriptor.full_name, field.name) in _TEXT_BYTES
        )
        is_message = field.type == FieldDescriptor.TYPE_MESSAGE
        if not (is_text or is_message):
            continue
        if _is_repeated(field):
            values = list(getattr(message, field.name))
        else:
            values = [getattr(message, field.name)] if message.HasField(field.name) else []
        for index, value in enumerate(values):
            where = f"{path}.{field.name}" + (f"[{index}]" if _is_repeated(field) else "")
            if is_message:
                _check_text(value, where, source, error)
                continue
            if isinstance(value, bytes):
                try:
                    value.decode("utf-8")
                    continue
                except UnicodeDecodeError:
                    pass
            elif isinstance(value, str):
                continue
            raise refuse(
                error,
                source,
                f"{where} is not UTF-8 text (got {bytes(value)[:60]!r}); ONNX names, operator types, "
                "domains and string attributes must be UTF-8",
                "re-export the model with export.onnx_export, or fetch the file again if it was corrupted",
            )


def _tensors(
    graph: onnx.GraphProto, source: str, error: type[ToolkitError]
) -> Iterator[tuple[str, TensorProto]]:
    """Every tensor of the graph: initializers and node attributes. Nested graphs are refused here."""
    for init in graph.initializer:
        yield f"initializer {init.name!r}", init
    for index, node in enumerate(graph.node):
        label = f"node {node.name or index!r} ({node.op_type})"
        for attr in node.attribute:
            if attr.ref_attr_name or attr.type in (
                AttributeProto.GRAPH, AttributeProto.GRAPHS, AttributeProto.SPARSE_TENSOR,
                AttributeProto.SPARSE_TENSORS, AttributeProto.TENSORS, AttributeProto.TYPE_PROTO,
                AttributeProto.TYPE_PROTOS,
            ):  # fmt: skip
                kind = (
                    AttributeProto.AttributeType.Name(attr.type).lower()
                    if attr.type in AttributeProto.AttributeType.values()
                    else f"type-{attr.type}"
                )
                raise refuse(
                    error,
                    source,
                    f"{label} has a {kind} attribute {attr.name!r}; subgraphs (Loop, If, Scan), sparse "
                    "and reference attributes are not accepted",
                    "export a plain feed-forward graph with export.onnx_export",
                )
            if attr.type == AttributeProto.TENSOR:
                yield f"{label} attribute {attr.name!r}", attr.t


def _check_tensor(
    where: str, tensor: TensorProto, source: str, limits: OnnxLimits, error: type[ToolkitError]
) -> int:
    """Bytes of one valid tensor: data inside the file, float32 or small int64, dims >= 1, sizes agree."""
    if tensor.data_location == TensorProto.EXTERNAL or tensor.external_data:
        location = next((e.value for e in tensor.external_data if e.key == "location"), "?")
        raise refuse(
            error,
            source,
            f"{where} keeps its data in an external file ({location[:200]!r}); expected every tensor "
            "inside the ONNX bytes (nothing is read from disk)",
            "save the model without external data (onnx.save_model(..., save_as_external_data=False))",
        )
    fix = "store weights as float32 initializers of the exported model (export.onnx_export)"
    if tensor.HasField("segment"):
        raise refuse(error, source, f"{where} is a segmented tensor, expected a whole one", fix)
    if tensor.data_type not in (TensorProto.FLOAT, TensorProto.INT64):
        raise refuse(
            error,
            source,
            f"{where} has data type {dtype_name(tensor.data_type)}, expected FLOAT (or a small INT64)",
            fix,
        )
    dims = list(tensor.dims)
    if len(dims) > limits.max_rank or any(d < 1 or d > limits.max_dim for d in dims):
        raise refuse(
            error,
            source,
            f"{where} has dims {dims[:12]}{' ...' if len(dims) > 12 else ''}, expected at most "
            f"{limits.max_rank} dims, each in [1, {limits.max_dim}]",
            fix,
        )
    count = math.prod(dims)
    if tensor.data_type == TensorProto.INT64 and (len(dims) > 1 or count > limits.max_shape_elements):
        raise refuse(
            error,
            source,
            f"{where} is INT64 of dims {dims}; int64 tensors are shapes or axes: rank <= 1 and at most "
            f"{limits.max_shape_elements} elements",
            fix,
        )
    is_float = tensor.data_type == TensorProto.FLOAT
    itemsize, typed, wrong = (
        (4, tensor.float_data, tensor.int64_data) if is_float else (8, tensor.int64_data, tensor.float_data)
    )
    others = (wrong, tensor.int32_data, tensor.string_data, tensor.double_data, tensor.uint64_data)
    stored = len(tensor.raw_data) // itemsize if tensor.raw_data else len(typed)
    exact = not tensor.raw_data or len(tensor.raw_data) % itemsize == 0
    if not exact or (tensor.raw_data and typed) or any(others) or stored != count:
        got = f"{len(tensor.raw_data)} raw bytes" if tensor.raw_data else f"{len(typed)} values"
        raise refuse(
            error, source, f"{where} has dims {dims} ({count * itemsize} bytes) but holds {got}", fix
        )
    if is_float:  # one NaN weight makes every output NaN: whoever runs it, server or device, learns nothing
        values = np.frombuffer(tensor.raw_data, "<f4") if tensor.raw_data else np.asarray(typed, np.float32)
        if not np.isfinite(values).all():
            bad = int(values.size - np.isfinite(values).sum())
            raise refuse(
                error, source, f"{where} holds {bad} NaN or infinite values, expected finite weights", fix
            )
    return count * itemsize
