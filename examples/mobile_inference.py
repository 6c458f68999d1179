"""Classify images with a file of `edge-sdk deploy` in its own mobile runtime, as an app would.

    python examples/mobile_inference.py model.ort   digit.png [more.png images.npy ...] [--top-k 3]
    python examples/mobile_inference.py model.tflite digit.png ...   # needs ai-edge-litert
    python examples/mobile_inference.py model.pte   digit.png ...    # needs executorch (its runtime bindings)

What an app does on the phone, here in Python: load the file in the target's runtime, read the deployment
metadata where that runtime keeps it (an ``.ort`` file's model metadata; the ``.json`` beside a ``.tflite``;
an ExecuTorch program's constant methods ``class_names`` / ``input_spec`` / ``deploy_schema``), prepare each
image as ``input_spec`` says and run one image at a time (the batch a ``.tflite`` and the XNNPACK program
were made for). The checks, the pixel preparation and the printout are onnx_inference.py's, beside this file.
The Kotlin and Swift equivalents are in docs/mobile.md.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # onnx_inference.py, this example's sibling
from onnx_inference import (
    MAX_METADATA_CHARS,
    MetadataError,
    command_line,
    describe,
    load_pixels,
    parse_metadata,
    prepare,
    print_top,
)

DEPLOY_KEYS = ("deploy_schema", "class_names", "input_spec")
Forward = Callable[[np.ndarray], np.ndarray]  # one float32 image (1 x C x H x W) -> its logits (1 x L)


def load_ort(path: Path) -> tuple[dict[str, str], Forward]:
    import onnxruntime

    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    name = session.get_inputs()[0].name
    return session.get_modelmeta().custom_metadata_map, lambda x: session.run(None, {name: x})[0]


def load_tflite(path: Path) -> tuple[dict[str, str], Forward]:
    from ai_edge_litert.interpreter import Interpreter

    sidecar = path.with_suffix(".json")  # edge-sdk deploy writes model.tflite and model.json
    if not sidecar.is_file() or sidecar.stat().st_size > MAX_METADATA_CHARS:
        raise MetadataError(f"expected the deployment metadata {sidecar.name} beside {path.name}")
    meta = json.loads(sidecar.read_text(encoding="utf-8"))
    interpreter = Interpreter(model_path=str(path), num_threads=1)
    interpreter.allocate_tensors()
    x_index = interpreter.get_input_details()[0]["index"]
    y_index = interpreter.get_output_details()[0]["index"]

    def forward(x: np.ndarray) -> np.ndarray:
        interpreter.set_tensor(x_index, x)
        interpreter.invoke()
        return interpreter.get_tensor(y_index).copy()

    return meta, forward


def load_pte(path: Path) -> tuple[dict[str, str], Forward]:
    import torch  # ExecuTorch's Python bindings take torch tensors; an app links the C++ runtime alone
    from executorch.runtime import Runtime

    # from its path: loaded from a bytes object that was then freed, the program crashed the interpreter
    program = Runtime.get().load_program(str(path))
    meta = {key: str(program.load_method(key).execute([])[0]) for key in DEPLOY_KEYS}
    method = program.load_method("forward")
    return meta, lambda x: method.execute([torch.from_numpy(x)])[0].numpy()


LOADERS = {".ort": load_ort, ".tflite": load_tflite, ".pte": load_pte}


def classify(model: Path, inputs: list[Path], top_k: int) -> int:
    """Print the model's input spec, then the ``top_k`` classes of every input."""
    loader = LOADERS.get(model.suffix.lower())
    if loader is None:
        raise MetadataError(f"expected a {sorted(LOADERS)} file of edge-sdk deploy, got {model.name}")
    meta, forward = loader(model)
    names, spec = parse_metadata({key: meta.get(key) for key in DEPLOY_KEYS})  # type: ignore[misc]
    print(describe(model, names, spec))
    for path in inputs:
        x = prepare(load_pixels(path, spec), spec)
        logits = np.concatenate([forward(x[i : i + 1]) for i in range(len(x))])
        if logits.shape != (len(x), len(names)):
            raise MetadataError(f"{len(names)} class names for logits shaped {list(logits.shape)}")
        print_top(path, logits, names, top_k)
    return 0


def main(argv: list[str] | None = None) -> int:
    return command_line(__doc__, "a .ort, .tflite or .pte file of edge-sdk deploy", classify, argv)


if __name__ == "__main__":
    sys.exit(main())
