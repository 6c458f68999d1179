"""ONNX export, validation and numeric parity: the only way a torch model leaves the toolkit.

Every exported classifier has one float32 input ``x`` (N x C x H x W, dynamic batch axis ``batch``), one
output ``logits``, opset :data:`OPSET` and provenance in ``metadata_props``. A CVAE decoder
(:func:`export_decoder_onnx`) has two float32 inputs ``z`` (N x latent) and ``y`` (N x classes, one-hot) and
one output ``x`` (N x C x H x W pixels in [0, 1]). An export is trusted only after ``onnx.checker`` (full
check), strict shape inference and an onnxruntime-vs-torch parity check.

With ``keep_batchnorm=True`` (the teacher in a bundle) BatchNormalization nodes stay in the graph and every
initializer is named after its ``state_dict`` key, so the server rebuilds the model from its arch string
and loads the weights exactly (``export.weights``), and DeepInversion can read BN statistics.

Exporter: the TorchScript exporter (``dynamo=False``), for speed: the dynamo path (``dynamo=True,
optimize=False``) was measured far slower on a small chain, cold and warm, even before the extra onnxscript
passes it needs to keep BN (which also rely on private onnxscript names); benchmarks/RESULTS.md, "Numbers
once kept in the code's comments". Exports run on every client and many times in tests. It is deprecated
upstream; torch is pinned (<= 2.14.1) in pyproject.toml, and the checks below fail loudly if its output
ever drifts.
"""

from __future__ import annotations

import copy
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

from common.errors import BundleError, ExportError, ToolkitError
from common.torch_utils import INFER_BATCH
from export.metadata import DeployMetadata, check_metadata_props, read_deploy_metadata

if TYPE_CHECKING:
    import onnxruntime

__all__ = [
    "DECODER_INPUT_NAMES",
    "DECODER_OUTPUT_NAME",
    "INPUT_NAME",
    "OPSET",
    "OUTPUT_NAME",
    "check_decoder_parity",
    "check_parity",
    "export_decoder_onnx",
    "export_onnx",
    "onnx_logits",
    "onnx_session",
    "read_deploy",
    "read_metadata",
    "validate_onnx",
]

OPSET: int = 18
INPUT_NAME = "x"
OUTPUT_NAME = "logits"
DECODER_INPUT_NAMES = ("z", "y")  # latent noise, one-hot label
DECODER_OUTPUT_NAME = "x"
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
    Deployment metadata (:func:`export.metadata.deploy_metadata`) must name one class per logit and
    describe this input, checked here so no file is written that its readers would refuse.
    The model's train/eval mode is restored module by module afterwards. Same model -> same bytes.
    """
    input_shape = _check_input_shape(input_shape)
    own = {
        "opset": str(OPSET),
        "input_shape": json.dumps(list(input_shape)),
        "batchnorm": "kept" if keep_batchnorm else "folded",
    }
    props = _merge_metadata(metadata, own)
    dummy = torch.rand((_TRACE_BATCH, *input_shape), generator=torch.Generator().manual_seed(seed))
    data = _export_bytes(
        model,
        (dummy,),
        input_names=[INPUT_NAME],
        output_name=OUTPUT_NAME,
        props=props,
        keep_batchnorm=keep_batchnorm,
        fix=(f"make sure the model runs on a float32 batch shaped (N, {', '.join(map(str, input_shape))})"),
        what=f"input shape {input_shape}",
    )
    dims = validate_onnx(data).graph.output[0].type.tensor_type.shape.dim
    check_parity(model, data, input_shape, seed=seed, atol=atol)
    logits = dims[1].dim_value if len(dims) == 2 and dims[1].dim_value > 0 else None
    deploy = read_deploy_metadata(props, num_logits=logits, source="export_onnx metadata", error=ExportError)
    if deploy is not None and (
        deploy.input_spec.shape != input_shape or deploy.input_spec.name != INPUT_NAME
    ):
        raise ExportError(
            f"the input_spec metadata describes input {deploy.input_spec.name!r} "
            f"{list(deploy.input_spec.shape)}, the export has {INPUT_NAME!r} {list(input_shape)}; fix: build "
            "the spec for the shape passed to export_onnx"
        )
    return data


def export_decoder_onnx(
    decoder: nn.Module,
    *,
    latent_dim: int,
    num_classes: int,
    output_shape: tuple[int, int, int],
    metadata: Mapping[str, str] | None = None,
    seed: int = 0,
    atol: float = 1e-4,
) -> bytes:
    """Export a CVAE decoder ``decoder(z, y) -> x`` to validated ONNX bytes, parity-checked like
    :func:`export_onnx`.

    Inputs ``z`` (float32 N x ``latent_dim``) and ``y`` (float32 one-hot N x ``num_classes``), output ``x``
    (float32 N x C x H x W), dynamic batch. Initializers keep their ``state_dict`` names (the server
    rebuilds the decoder from its arch string, :mod:`export.weights`). The exporter sets the metadata
    ``opset``, ``latent_dim``, ``num_classes`` and ``output_shape`` (JSON list).
    """
    latent_dim = _check_positive_int("latent_dim", latent_dim)
    num_classes = _check_positive_int("num_classes", num_classes)
    output_shape = _check_input_shape(output_shape)
    own = {
        "opset": str(OPSET),
        "latent_dim": str(latent_dim),
        "num_classes": str(num_classes),
        "output_shape": json.dumps(list(output_shape)),
    }
    props = _merge_metadata(metadata, own)
    z, y = _decoder_inputs(_TRACE_BATCH, latent_dim, num_classes, seed)
    data = _export_bytes(
        decoder,
        (z, y),
        input_names=list(DECODER_INPUT_NAMES),
        output_name=DECODER_OUTPUT_NAME,
        props=props,
        keep_batchnorm=True,
        fix=f"make sure decoder(z, y) accepts z (N, {latent_dim}) and one-hot y (N, {num_classes})",
        what=f"latent_dim {latent_dim}, num_classes {num_classes}",
        output_shape=output_shape,
    )
    validate_onnx(data)
    got = check_decoder_parity(
        decoder, data, latent_dim=latent_dim, num_classes=num_classes, seed=seed, atol=atol
    )
    if got != output_shape:
        raise ExportError(
            f"the decoder returns images shaped {got}, expected output_shape {output_shape}; fix: pass the "
            "(C, H, W) the decoder produces"
        )
    return data


def _export_bytes(
    model: nn.Module,
    args: tuple[torch.Tensor, ...],
    *,
    input_names: list[str],
    output_name: str,
    props: Mapping[str, str],
    keep_batchnorm: bool,
    fix: str,
    what: str,
    output_shape: tuple[int, ...] | None = None,
) -> bytes:
    """Trace ``model`` on ``args`` (made on CPU, moved to the model), fix the graph up, set the metadata.

    The model is exported in eval mode; each submodule's mode is restored afterwards. Same model, same
    arguments -> same bytes. ``output_shape`` declares the output's non-batch dims: the tracer leaves
    them symbolic (even mislabelled) after a reshape or resize; strict shape inference then checks them.
    """
    args = tuple(a.to(_device(model)) for a in args)
    buffer = io.BytesIO()
    axes = {name: {0: BATCH_AXIS} for name in [*input_names, output_name]}
    modes = _eval_modes(model)
    try:
        with warnings.catch_warnings(), torch.no_grad():
            for category, message in _EXPECTED_WARNINGS:
                warnings.filterwarnings("ignore", message=message, category=category)
            torch.onnx.export(
                model,
                args,
                buffer,
                dynamo=False,
                opset_version=OPSET,
                input_names=input_names,
                output_names=[output_name],
                dynamic_axes=axes,
                # PRESERVE with the model in eval keeps BN as BatchNormalization (eval semantics);
                # EVAL lets constant folding fuse it into the preceding Conv.
                training=torch.onnx.TrainingMode.PRESERVE if keep_batchnorm else torch.onnx.TrainingMode.EVAL,
                do_constant_folding=True,
            )
    except (RuntimeError, ValueError, TypeError) as err:
        raise ExportError(f"torch.onnx.export failed for {what}: {err}; fix: {fix}") from err
    finally:
        _restore_modes(modes)

    proto = onnx.load_from_string(buffer.getvalue())
    _undo_initializer_dedup(proto.graph)
    _strip_default_training_mode(proto.graph)
    if output_shape is not None:
        _declare_output_shape(proto.graph, output_shape)
    del proto.metadata_props[:]
    for key in sorted(props):
        entry = proto.metadata_props.add()
        entry.key, entry.value = key, props[key]
    return proto.SerializeToString(deterministic=True)


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
    _check_parity_args(batch_size, atol)
    x = torch.rand((batch_size, *input_shape), generator=torch.Generator().manual_seed(seed))
    diff, _ = _compare(
        model,
        model_bytes,
        {INPUT_NAME: x},
        seed=seed,
        atol=atol,
        fix_run=f"export with export_onnx for input shape {input_shape}",
        fix_shape="avoid batch-size-dependent reshapes (use torch.flatten(x, 1))",
    )
    return diff


def check_decoder_parity(
    decoder: nn.Module,
    model_bytes: bytes,
    *,
    latent_dim: int,
    num_classes: int,
    seed: int = 0,
    batch_size: int = 8,
    atol: float = 1e-4,
) -> tuple[int, ...]:
    """Parity of a decoder export on a seeded batch: z ~ N(0, I), y one-hot of seeded labels.

    Returns the (C, H, W) shape of one decoded image; raises ExportError like :func:`check_parity`.
    """
    latent_dim = _check_positive_int("latent_dim", latent_dim)
    num_classes = _check_positive_int("num_classes", num_classes)
    _check_parity_args(batch_size, atol)
    z, y = _decoder_inputs(batch_size, latent_dim, num_classes, seed)
    _, shape = _compare(
        decoder,
        model_bytes,
        dict(zip(DECODER_INPUT_NAMES, (z, y), strict=True)),
        seed=seed,
        atol=atol,
        fix_run=f"export with export_decoder_onnx (latent_dim {latent_dim}, num_classes {num_classes})",
        fix_shape="avoid batch-size-dependent reshapes (use x.reshape(-1, C, H, W))",
    )
    return shape[1:]


def _check_parity_args(batch_size: int, atol: float) -> None:
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ExportError(f"batch_size must be an int >= 1, got {batch_size!r}")
    if not atol > 0:
        raise ExportError(f"atol must be > 0, got {atol!r}")


def _decoder_inputs(
    batch: int, latent_dim: int, num_classes: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Seeded z ~ N(0, I) (batch x latent) and one-hot y (batch x classes) of uniformly drawn labels."""
    generator = torch.Generator().manual_seed(seed)
    z = torch.randn((batch, latent_dim), generator=generator)
    labels = torch.randint(num_classes, (batch,), generator=generator)
    return z, torch.nn.functional.one_hot(labels, num_classes).float()


def _compare(
    model: nn.Module,
    model_bytes: bytes,
    inputs: Mapping[str, torch.Tensor],
    *,
    seed: int,
    atol: float,
    fix_run: str,
    fix_shape: str,
) -> tuple[float, tuple[int, ...]]:
    """(max abs difference, output shape) of torch (eval) vs onnxruntime on the named CPU ``inputs``.

    The ONNX model must have exactly these inputs (in this order) and one output; the torch model is
    called positionally in the same order.
    """
    session = onnx_session(model_bytes)
    names = [i.name for i in session.get_inputs()]
    outputs = session.get_outputs()
    if len(names) != len(inputs) or len(outputs) != 1:
        raise ExportError(
            f"expected an ONNX model with {len(inputs)} input{'s' if len(inputs) > 1 else ''} and 1 output, "
            f"got {len(names)} and {len(outputs)}; fix: {fix_run}"
        )
    if len(inputs) > 1 and names != list(inputs):
        raise ExportError(f"expected ONNX inputs {list(inputs)}, got {names}; fix: {fix_run}")
    feed = dict(zip(names, (t.numpy() for t in inputs.values()), strict=True))
    shapes = ", ".join(str(tuple(t.shape)) for t in inputs.values())
    try:
        got = session.run(None, feed)[0]
    except Exception as err:  # onnxruntime raises its own pybind exception types
        raise ExportError(
            f"onnxruntime failed on float32 inputs shaped {shapes}: {err}; fix: {fix_run}"
        ) from err
    modes = _eval_modes(model)
    try:
        with torch.no_grad():
            # on the CPU in exact float32: a GPU's TF32 convolutions (cuDNN's default) differ from
            # onnxruntime by ~1e-3, which would refuse every model trained there
            reference = model if _device(model).type == "cpu" else copy.deepcopy(model).cpu()
            expected = reference(*inputs.values())
    finally:
        _restore_modes(modes)
    if not isinstance(expected, torch.Tensor):
        raise ExportError(f"the model must return one tensor, got {type(expected).__name__}")
    expected_np = expected.detach().cpu().float().numpy()
    batch_size = next(iter(inputs.values())).shape[0]
    if got.shape != expected_np.shape:
        raise ExportError(
            f"ONNX output shape {got.shape} != torch output shape {expected_np.shape} on a batch of "
            f"{batch_size}; fix: {fix_shape}"
        )
    diff = float(np.max(np.abs(got.astype(np.float64) - expected_np.astype(np.float64)))) if got.size else 0.0
    if not diff <= atol:  # also catches NaN
        raise ExportError(
            f"ONNX/torch parity failed: max abs diff {diff:.3g} > atol {atol:g} on {batch_size} seeded "
            f"inputs (seed {seed}); fix: make forward deterministic and free of Python-side state "
            "(tracing freezes Python values and control flow), or use ops onnxruntime supports exactly"
        )
    return diff, tuple(int(v) for v in got.shape)


def read_metadata(model_bytes: bytes) -> dict[str, str]:
    """The ``metadata_props`` of an ONNX model as a dict."""
    return {entry.key: entry.value for entry in _parse(model_bytes).metadata_props}


def read_deploy(
    model_bytes: bytes,
    *,
    num_logits: int | None = None,
    source: str = "model",
    error: type[ToolkitError] = BundleError,
) -> DeployMetadata | None:
    """The deployment metadata (class names, input spec) of an ONNX model, bounded and checked
    (:mod:`export.metadata`); None for a model exported without it."""
    entries = ((entry.key, entry.value) for entry in _parse(model_bytes).metadata_props)
    props = check_metadata_props(entries, source=source, error=error)
    return read_deploy_metadata(props, num_logits=num_logits, source=source, error=error)


def onnx_session(model_bytes: bytes, *, threads: int = 1) -> onnxruntime.InferenceSession:
    """A CPU onnxruntime session with a fixed thread count (reproducible timings, no oversubscription)."""
    import onnxruntime

    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise ExportError(f"threads must be an int >= 1, got {threads!r}")
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.execution_mode = onnxruntime.ExecutionMode.ORT_SEQUENTIAL
    # no CPU arena: the arena keeps its largest batch's activations for the session's life (a simulation's
    # client evaluation grew by it, benchmarks/RESULTS.md "Speed and memory"); sessions here are short
    options.enable_cpu_mem_arena = False
    try:
        return onnxruntime.InferenceSession(
            bytes(model_bytes), sess_options=options, providers=["CPUExecutionProvider"]
        )
    except Exception as err:  # onnxruntime raises its own pybind exception types
        raise ExportError(
            f"onnxruntime cannot load the model: {err}; fix: re-export it with export_onnx"
        ) from err


def onnx_logits(
    model_bytes: bytes, images: np.ndarray, *, batch_size: int = INFER_BATCH, threads: int = 1
) -> np.ndarray:
    """The model's outputs on ``images`` (float32 N x C x H x W), run in batches of ``batch_size``."""
    session = onnx_session(model_bytes, threads=threads)
    name = session.get_inputs()[0].name
    batches = range(0, len(images), batch_size)
    return np.concatenate([session.run(None, {name: images[i : i + batch_size]})[0] for i in batches])


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


def _merge_metadata(metadata: Mapping[str, str] | None, own: Mapping[str, str]) -> dict[str, str]:
    """The caller's metadata plus the exporter's own keys (a caller value for one of those must agree)."""
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


def _check_positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ExportError(f"{name} must be a positive int, got {value!r}")
    return value


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


def _declare_output_shape(graph: onnx.GraphProto, shape: tuple[int, ...]) -> None:
    """Set the single output to (batch, *shape)."""
    dims = graph.output[0].type.tensor_type.shape.dim
    del dims[:]
    dims.add().dim_param = BATCH_AXIS
    for value in shape:
        dims.add().dim_value = int(value)


def _strip_default_training_mode(graph: onnx.GraphProto) -> None:
    """Drop ``training_mode=0`` from BatchNormalization: it is the default, and some readers reject it."""
    for node in graph.node:
        if node.op_type != "BatchNormalization":
            continue
        kept = [a for a in node.attribute if not (a.name == "training_mode" and a.i == 0)]
        if len(kept) != len(node.attribute):
            del node.attribute[:]
            node.attribute.extend(kept)
