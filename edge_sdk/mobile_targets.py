"""The torch-based phone runtimes behind `edge-sdk deploy`: ExecuTorch, LiteRT (TFLite) and Core ML.

Each starts from the classifier rebuilt as a torch module (its ``arch`` metadata and its ONNX weights, as
the server rebuilds teachers), so the artifact computes what the ONNX computes. Each carries the deployment
metadata where its runtime can read it: ExecuTorch as constant methods of the program
(``program.load_method("class_names")``), Core ML in the package's user-defined metadata, LiteRT in a
JSON file beside the model (the metadata a LiteRT flatbuffer holds is read through the separate
tflite-support package, which this toolkit does not depend on). Their packages are optional and imported
here only when the target is used (``edge_sdk.deploy.TARGETS`` names the extra that brings each).
"""

from __future__ import annotations

import json
import re
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np
import torch
from torch import nn

from common.errors import ExportError
from edge_sdk.models.arch import build_model
from export.metadata import DEPLOY_KEYS
from export.weights import initializer_state_dict

__all__ = [
    "check_kernels",
    "conversion_error",
    "coreml_files",
    "executorch_files",
    "load_executorch",
    "load_tflite",
    "rebuild",
    "run_executorch",
    "run_tflite",
    "tflite_files",
]

# one loaded model: a (1, C, H, W) float32 image -> its (1, L) logits, as a phone labels one image at a time
Runner = Callable[[np.ndarray], np.ndarray]

_OPERATOR = re.compile(r"aten[.:]+[A-Za-z_0-9.]+")
_FX_NODE = re.compile(r"[Uu]nsupported fx node ([A-Za-z_0-9.]+)")  # Core ML's name for an operator


def rebuild(
    model_onnx: bytes, props: Mapping[str, str], shape: tuple[int, int, int], logits: int
) -> nn.Module:
    """The classifier as a torch module in eval mode, from its ``arch`` metadata and ONNX weights."""
    arch = props.get("arch")
    if not arch:
        raise ExportError(
            "the model has no 'arch' metadata, which the torch-based targets rebuild it from; fix: deploy a "
            "model the toolkit exported (global.onnx, deploy.onnx, a bundle's), or use --target onnx or ort"
        )
    if props.get("batchnorm") == "folded":  # its weights no longer map onto the architecture's modules
        raise ExportError(
            "the model was exported with BatchNorm folded into its convolutions, the torch-based targets "
            "rebuild the architecture from BatchNorm-preserving weights; fix: deploy it with --target onnx "
            "or ort, or an export that keeps BatchNorm (a bundle's model, global.onnx, personal.fp32.onnx)"
        )
    try:
        module = build_model(arch, shape, logits)
        module.load_state_dict(initializer_state_dict(model_onnx, module, source="the model"), strict=True)
    except (ValueError, RuntimeError) as err:  # SpecError, BundleError, torch's own
        raise ExportError(f"cannot rebuild the model from its arch {arch[:200]!r}: {err}") from err
    return module.eval()


def conversion_error(runtime: str, err: BaseException) -> ExportError:
    """One line for a converter's failure, naming the operator it could not represent when it says one."""
    text = " ".join(str(err).split())
    ops = sorted(set(_OPERATOR.findall(text)) | set(_FX_NODE.findall(text)))
    what = f"the operator(s) {', '.join(ops[:5])}" if ops else "the model"
    return ExportError(
        f"{runtime} cannot represent {what} ({type(err).__name__}: {text[:300]}); fix: deploy to onnx "
        "or ort, which run every operator the toolkit exports"
    )


def check_kernels(runtime: str, manager) -> bytes:  # manager: exir's ExecutorchProgramManager
    """The program's bytes once every operator it calls has a kernel in ExecuTorch's runtime (the
    converter writes operators the runtime cannot run; the phone would find out when it loads the
    program), else one line naming them."""
    from executorch.extension.pybindings.portable_lib import _get_operator_names

    have = set(_get_operator_names())
    called = {
        f"{op.name}.{op.overload}" if op.overload else op.name
        for plan in manager.executorch_program.execution_plan
        for op in plan.operators
    }
    missing = sorted(called - have)
    if missing:
        raise ExportError(
            f"{runtime} cannot represent the operator(s) {', '.join(missing[:5])}: its runtime has no kernel "
            "for them; fix: deploy to onnx or ort, which run every operator the toolkit exports"
        )
    return bytes(manager.buffer)


def _deploy_props(props: Mapping[str, str]) -> dict[str, str]:
    return {key: props[key] for key in DEPLOY_KEYS}


# ------------------------------------------------------------------------------------------ ExecuTorch


def executorch_files(module: nn.Module, shape: tuple[int, int, int], props: Mapping[str, str]) -> bytes:
    """A ``.pte`` program lowered to XNNPACK (ExecuTorch's CPU backend on Android and iOS), exported with a
    dynamic batch axis (a static batch-1 export of the elastic family failed in the runtime) and run one
    image at a time (its memory plan bounds the batch below the declared maximum), the deployment metadata
    as constant methods."""
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import to_edge_transform_and_lower

    example = (torch.rand((2, *shape), generator=torch.Generator().manual_seed(0)),)
    batch = torch.export.Dim("batch", min=1, max=64)
    try:
        with torch.no_grad():
            program = torch.export.export(module, example, dynamic_shapes=({0: batch},))
        lowered = to_edge_transform_and_lower(
            program, partitioner=[XnnpackPartitioner()], constant_methods=_deploy_props(props)
        )
        manager = lowered.to_executorch()
    except Exception as err:  # torch.export and exir raise many types, each a model it cannot represent
        raise conversion_error("ExecuTorch", err) from err
    return check_kernels("ExecuTorch", manager)


def load_executorch(program: bytes | Path) -> Runner:
    """The ``.pte``'s forward method, loaded once into ExecuTorch's runtime (the C++ runtime the phone
    links). The runtime reads a program given as bytes in place, so the runner keeps those bytes alive."""
    from executorch.runtime import Runtime

    forward = Runtime.get().load_program(program).load_method("forward")

    def run(image: np.ndarray, _program: bytes | Path = program) -> np.ndarray:
        return forward.execute([torch.from_numpy(image)])[0].numpy()

    return run


def run_executorch(program: bytes, images: np.ndarray) -> np.ndarray:
    """Logits of the ``.pte`` in ExecuTorch's runtime, one image at a time as on the phone."""
    forward = load_executorch(program)
    return np.stack([forward(image[None])[0] for image in images])


def executorch_metadata(program: bytes) -> dict[str, str]:
    """The deployment metadata as the runtime reads it back from the program's constant methods."""
    from executorch.runtime import Runtime

    loaded = Runtime.get().load_program(program)
    return {key: str(loaded.load_method(key).execute([])[0]) for key in DEPLOY_KEYS}


# ------------------------------------------------------------------------------------------ LiteRT


def tflite_files(
    module: nn.Module, shape: tuple[int, int, int], props: Mapping[str, str]
) -> dict[str, bytes]:
    """A ``.tflite`` flatbuffer of batch 1 (a phone labels one image at a time) and its metadata JSON."""
    import litert_torch

    example = (torch.rand((1, *shape), generator=torch.Generator().manual_seed(0)),)
    try:
        with tempfile.TemporaryDirectory(prefix="deploy-tflite-") as tmp:
            path = Path(tmp, "model.tflite")
            litert_torch.convert(module, example).export(str(path))
            model = path.read_bytes()
    except Exception as err:  # the converter raises many types, each a model it cannot represent
        raise conversion_error("LiteRT", err) from err
    sidecar = json.dumps(_deploy_props(props), sort_keys=True, indent=2) + "\n"
    return {"": model, ".json": sidecar.encode("utf-8")}


def load_tflite(model: bytes | Path) -> Runner:
    """The ``.tflite`` loaded once into the LiteRT interpreter, on one thread as on the phone."""
    from ai_edge_litert.interpreter import Interpreter

    if isinstance(model, Path):
        interpreter = Interpreter(model_path=str(model), num_threads=1)
    else:
        interpreter = Interpreter(model_content=model, num_threads=1)
    interpreter.allocate_tensors()
    x, y = interpreter.get_input_details()[0]["index"], interpreter.get_output_details()[0]["index"]

    def run(image: np.ndarray) -> np.ndarray:
        interpreter.set_tensor(x, image)
        interpreter.invoke()
        return interpreter.get_tensor(y).copy()

    return run


def run_tflite(model: bytes, images: np.ndarray) -> np.ndarray:
    """Logits of the ``.tflite`` in the LiteRT interpreter, one image at a time on one thread."""
    forward = load_tflite(model)
    return np.stack([forward(image[None])[0] for image in images])


# ------------------------------------------------------------------------------------------ Core ML


def coreml_files(
    module: nn.Module, shape: tuple[int, int, int], props: Mapping[str, str]
) -> dict[str, bytes]:
    """An ``.mlpackage`` (ML program, iOS 16+, batch 1) as its files, keyed ``/relative/path``: Core ML
    runs only on Apple devices, so it is converted here and never run."""
    import coremltools as ct

    example = (torch.rand((1, *shape), generator=torch.Generator().manual_seed(0)),)
    try:
        with torch.no_grad():
            program = torch.export.export(module, example).run_decompositions({})
        model = ct.convert(
            program,
            inputs=[ct.TensorType(name="x", shape=(1, *shape))],
            outputs=[ct.TensorType(name="logits")],
            minimum_deployment_target=ct.target.iOS16,
        )
    except Exception as err:  # coremltools raises many types, each a model it cannot represent
        raise conversion_error("Core ML", err) from err
    for key, value in _deploy_props(props).items():
        model.user_defined_metadata[key] = value
    with tempfile.TemporaryDirectory(prefix="deploy-coreml-") as tmp:
        root = Path(tmp, "model.mlpackage")
        model.save(str(root))
        return {
            "/" + path.relative_to(root).as_posix(): path.read_bytes()
            for path in sorted(root.rglob("*"))
            if path.is_file()
        }
