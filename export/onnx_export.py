"""ONNX export, validation and numeric parity: the only way a torch model leaves the toolkit.

Every exported file has one float32 input ``x`` (N x C x H x W, dynamic batch axis ``batch``), one output
``logits``, opset :data:`OPSET` and provenance in ``metadata_props``. An export is trusted only after
``onnx.checker`` (full check), strict shape inference and an onnxruntime-vs-torch parity check.

With ``keep_batchnorm=True`` (the teacher in a bundle) BatchNormalization nodes stay in the graph and every
initializer is named after its ``state_dict`` key, so the server rebuilds the model from its arch string
and loads the weights exactly (``export.weights``), and DeepInversion can read BN statistics.

Exporter: the TorchScript exporter (``dynamo=False``), for speed. Measured on ``C8k3-P-C16k3-P-F32-F10`` at
1x12x12, 1 thread: 0.11 s cold / 0.03 s warm, against 6.3 s cold / 1.8 s warm for ``dynamo=True,
optimize=False`` before the extra onnxscript passes the dynamo path needs to keep BN (which also rely on
private onnxscript names). Exports run on every client and many times in tests. It is deprecated upstream;
torch is pinned (<= 2.14.1) in pyproject.toml, and the checks below fail loudly if its output ever drifts.
"""

from __future__ import annotations

import io
import json
import warnings
from collections.abc import Mapping
from typing import TYPE_CHECKING

import numpy as np
import onnx
import torch
from google.protobuf.message import DecodeError
from torch import nn

from profiles.errors import ExportError

if TYPE_CHECKING:
    import onnxruntime

__all__ = [
    "INPUT_NAME",
    "OPSET",
    "OUTPUT_NAME",
    "check_parity",
    "export_onnx",
    "onnx_session",
    "read_metadata",
    "validate_onnx",
]

OPSET: int = 18
INPUT_NAME = "x"
OUTPUT_NAME = "logits"
BATCH_AXIS = "batch"
_TRACE_BATCH = 2  # a batch of 1 could let the tracer specialise on the batch size

# Warnings the TorchScript exporter always emits for this exact call; anything else still shows.
_EXPECTED_WARNINGS = (
    (DeprecationWarning, r"You are using the legacy TorchScript-based ONNX export"),
    (DeprecationWarning, r"The feature will be removed"),
    (UserWarning, r"It is recommended that constant folding be turned off"),
)


def export_onnx(
    model: nn.Module,
    input_shape: tuple[int, int, int],
    *,
    metadata: Mapping[str, str] | None = None,
    keep_batchnorm: bool = True,
    seed: int = 0,
    atol: float = 1e-4,
) -> bytes:
    """Export ``model`` (in eval mode) to validated ONNX bytes and check parity against onnxruntime.

    ``metadata`` (str -> str, e.g. arch, sdk_version, producer) is merged with the keys the exporter sets
    (``opset``, ``input_shape`` as a JSON list, ``batchnorm``); a caller value for one of those must agree.
    The model's train/eval mode is restored module by module afterwards. Same model -> same bytes.
    """
    input_shape = _check_input_shape(input_shape)
    props = _merge_metadata(metadata, input_shape, keep_batchnorm)
    dummy = torch.rand((_TRACE_BATCH, *input_shape), generator=torch.Generator().manual_seed(seed))
    dummy = dummy.to(_device(model))
    buffer = io.BytesIO()
    modes = _eval_modes(model)
    try:
        with warnings.catch_warnings(), torch.no_grad():
            for category, message in _EXPECTED_WARNINGS:
                warnings.filterwarnings("ignore", message=message, category=category)
            torch.onnx.export(
                model,
                (dummy,),
                buffer,
                dynamo=False,
                opset_version=OPSET,
                input_names=[INPUT_NAME],
                output_names=[OUTPUT_NAME],
                dynamic_axes={INPUT_NAME: {0: BATCH_AXIS}, OUTPUT_NAME: {0: BATCH_AXIS}},
                # PRESERVE with the model in eval keeps BN as BatchNormalization (eval semantics);
                # EVAL lets constant folding fuse it into the preceding Conv.
                training=torch.onnx.TrainingMode.PRESERVE if keep_batchnorm else torch.onnx.TrainingMode.EVAL,
                do_constant_folding=True,
            )
    except (RuntimeError, ValueError, TypeError) as err:
        raise ExportError(
            f"torch.onnx.export failed for input shape {input_shape}: {err}; "
            f"fix: make sure the model runs on a float32 batch shaped (N, {', '.join(map(str, input_shape))})"
        ) from err
    finally:
        _restore_modes(modes)

    proto = onnx.load_from_string(buffer.getvalue())
    _undo_initializer_dedup(proto.graph)
    _strip_default_training_mode(proto.graph)
    del proto.metadata_props[:]
    for key in sorted(props):
        entry = proto.metadata_props.add()
        entry.key, entry.value = key, props[key]
    data = proto.SerializeToString(deterministic=True)

    validate_onnx(data)
    check_parity(model, data, input_shape, seed=seed, atol=atol)
    return data


def validate_onnx(model_bytes: bytes) -> onnx.ModelProto:
    """Parse and check: ``onnx.checker`` full check, then strict, type-checked shape inference."""
    proto = _parse(model_bytes)
    try:
        onnx.checker.check_model(proto, full_check=True)
        onnx.shape_inference.infer_shapes(proto, check_type=True, strict_mode=True)
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as err:
        raise ExportError(
            f"ONNX model failed validation: {err}; fix: re-export it with export_onnx (opset {OPSET})"
        ) from err
    return proto


def check_parity(
    model: nn.Module,
    model_bytes: bytes,
    input_shape: tuple[int, int, int],
    *,
    seed: int = 0,
    batch_size: int = 8,
    atol: float = 1e-4,
) -> float:
    """Max abs difference between torch (eval) and onnxruntime outputs on a seeded batch in [0, 1].

    Raises ExportError when it exceeds ``atol`` (or is not finite), so an ONNX file that does not compute
    what the model computes never travels.
    """
    input_shape = _check_input_shape(input_shape)
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ExportError(f"batch_size must be an int >= 1, got {batch_size!r}")
    if not atol > 0:
        raise ExportError(f"atol must be > 0, got {atol!r}")
    x = torch.rand((batch_size, *input_shape), generator=torch.Generator().manual_seed(seed))
    session = onnx_session(model_bytes)
    inputs, outputs = session.get_inputs(), session.get_outputs()
    if len(inputs) != 1 or len(outputs) != 1:
        raise ExportError(
            f"expected an ONNX model with 1 input and 1 output, got {len(inputs)} and {len(outputs)}; "
            "fix: export a single-tensor model with export_onnx"
        )
    try:
        got = session.run(None, {inputs[0].name: x.numpy()})[0]
    except Exception as err:  # onnxruntime raises its own pybind exception types
        raise ExportError(
            f"onnxruntime failed on a float32 batch shaped {tuple(x.shape)}: {err}; "
            f"fix: export with export_onnx for input shape {input_shape}"
        ) from err
    modes = _eval_modes(model)
    try:
        with torch.no_grad():
            expected = model(x.to(_device(model)))
    finally:
        _restore_modes(modes)
    if not isinstance(expected, torch.Tensor):
        raise ExportError(f"the model must return one tensor of logits, got {type(expected).__name__}")
    expected_np = expected.detach().cpu().float().numpy()
    if got.shape != expected_np.shape:
        raise ExportError(
            f"ONNX output shape {got.shape} != torch output shape {expected_np.shape} on a batch of "
            f"{batch_size}; fix: avoid batch-size-dependent reshapes (use torch.flatten(x, 1))"
        )
    diff = float(np.max(np.abs(got.astype(np.float64) - expected_np.astype(np.float64)))) if got.size else 0.0
    if not diff <= atol:  # also catches NaN
        raise ExportError(
            f"ONNX/torch parity failed: max abs diff {diff:.3g} > atol {atol:g} on {batch_size} seeded "
            f"inputs (seed {seed}); fix: make forward deterministic and free of Python-side state "
            "(tracing freezes Python values and control flow), or use ops onnxruntime supports exactly"
        )
    return diff


def read_metadata(model_bytes: bytes) -> dict[str, str]:
    """The ``metadata_props`` of an ONNX model as a dict."""
    return {entry.key: entry.value for entry in _parse(model_bytes).metadata_props}


def onnx_session(model_bytes: bytes, *, threads: int = 1) -> onnxruntime.InferenceSession:
    """A CPU onnxruntime session with a fixed thread count (reproducible timings, no oversubscription)."""
    import onnxruntime

    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise ExportError(f"threads must be an int >= 1, got {threads!r}")
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.execution_mode = onnxruntime.ExecutionMode.ORT_SEQUENTIAL
    try:
        return onnxruntime.InferenceSession(
            bytes(model_bytes), sess_options=options, providers=["CPUExecutionProvider"]
        )
    except Exception as err:  # onnxruntime raises its own pybind exception types
        raise ExportError(
            f"onnxruntime cannot load the model: {err}; fix: re-export it with export_onnx"
        ) from err


def _parse(model_bytes: bytes) -> onnx.ModelProto:
    if not isinstance(model_bytes, bytes | bytearray | memoryview) or len(model_bytes) == 0:
        got = f"{len(model_bytes)} bytes" if isinstance(model_bytes, bytes) else type(model_bytes).__name__
        raise ExportError(f"expected serialized ONNX bytes, got {got}")
    try:
        return onnx.load_from_string(bytes(model_bytes))
    except DecodeError as err:
        raise ExportError(f"not an ONNX model ({len(model_bytes)} bytes): {err}") from err


def _check_input_shape(input_shape: tuple[int, int, int]) -> tuple[int, int, int]:
    shape = tuple(input_shape)
    if len(shape) != 3 or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in shape):
        raise ExportError(f"input_shape must be three positive ints (C, H, W), got {input_shape!r}")
    return shape  # type: ignore[return-value]


def _merge_metadata(
    metadata: Mapping[str, str] | None, input_shape: tuple[int, int, int], keep_batchnorm: bool
) -> dict[str, str]:
    own = {
        "opset": str(OPSET),
        "input_shape": json.dumps(list(input_shape)),
        "batchnorm": "kept" if keep_batchnorm else "folded",
    }
    merged = dict(own)
    for key, value in (metadata or {}).items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise ExportError(
                f"metadata keys and values must be str, got {key!r}: {value!r}; fix: convert with str() "
                "or json.dumps()"
            )
        if key in own and value != own[key]:
            raise ExportError(f"metadata {key!r} is set by the exporter to {own[key]!r}, got {value!r}")
        merged[key] = value
    return merged


def _device(model: nn.Module) -> torch.device:
    """Where the model's weights live (the inputs are made on CPU with a seeded generator, then moved)."""
    tensor = next(model.parameters(), None)
    return tensor.device if tensor is not None else torch.device("cpu")


def _eval_modes(model: nn.Module) -> list[tuple[nn.Module, bool]]:
    """Remember every submodule's mode (they can differ), then switch the whole model to eval."""
    modes = [(module, module.training) for module in model.modules()]
    model.eval()
    return modes


def _restore_modes(modes: list[tuple[nn.Module, bool]]) -> None:
    for module, training in modes:
        module.training = training


def _undo_initializer_dedup(graph: onnx.GraphProto) -> None:
    """Give every parameter its own initializer named after its state_dict key.

    The TorchScript exporter merges initializers with equal values (e.g. the all-ones running_var of two
    fresh BN layers) and re-creates the other names with Identity nodes; copy the tensor back instead.
    """
    by_name = {init.name: init for init in graph.initializer}
    outputs = {out.name for out in graph.output}
    keep = []
    for node in graph.node:
        if node.op_type == "Identity" and node.input[0] in by_name and node.output[0] not in outputs:
            copy = onnx.TensorProto()
            copy.CopyFrom(by_name[node.input[0]])
            copy.name = node.output[0]
            graph.initializer.append(copy)
            by_name[copy.name] = copy
        else:
            keep.append(node)
    if len(keep) != len(graph.node):
        del graph.node[:]
        graph.node.extend(keep)


def _strip_default_training_mode(graph: onnx.GraphProto) -> None:
    """Drop ``training_mode=0`` from BatchNormalization: it is the default, and some readers reject it."""
    for node in graph.node:
        if node.op_type != "BatchNormalization":
            continue
        kept = [a for a in node.attribute if not (a.name == "training_mode" and a.i == 0)]
        if len(kept) != len(node.attribute):
            del node.attribute[:]
            node.attribute.extend(kept)
