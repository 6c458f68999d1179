"""Classify images with a deployable model of the toolkit using onnxruntime alone (no torch, no toolkit).

    python examples/onnx_inference.py deploy.onnx digit.png [more.png images.npy ...] [--top-k 3]

The model says everything a runtime needs in its ONNX metadata (``deploy_schema`` 1, written by every
exporter of the toolkit, see export/metadata.py): ``class_names`` (JSON list, one per logit) and
``input_spec`` (JSON: input name, [C, H, W] with a dynamic batch, float32 NCHW, the raw ``pixel_range``,
the ``input_range`` the model takes, the per-channel ``mean`` / ``std`` and whether the model applies
that normalisation ``inside`` itself or expects it done ``outside``). This script reads them through
``InferenceSession.get_modelmeta().custom_metadata_map``, prepares each input as the spec says and
prints the top-k class names with their softmax probabilities.

Inputs: an image file (PNG, JPEG, ...: Pillow converts it to greyscale for C = 1 or RGB for C = 3 and
resizes it to H x W) or a ``.npy`` of raw pixels in ``pixel_range``, shaped (H, W) when C = 1, (C, H, W)
or a batch (N, C, H, W). Needs numpy, onnxruntime and, for image files, Pillow.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime

SCHEMA_VERSION = "1"
MAX_METADATA_CHARS = 1 << 20  # the toolkit's own bound on one metadata value
MAX_NPY_BYTES = 256 << 20  # refuse to load a larger .npy
IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff", ".webp", ".pgm", ".ppm"}


class MetadataError(ValueError):
    """The model's metadata is missing or not what deploy_schema 1 says."""


def read_metadata(session: onnxruntime.InferenceSession) -> tuple[list[str], dict[str, Any]]:
    """(class names, input spec) from the model's custom metadata, checked before anything uses them."""
    names, spec = parse_metadata(session.get_modelmeta().custom_metadata_map)
    inputs, outputs = session.get_inputs(), session.get_outputs()
    if len(inputs) != 1 or inputs[0].name != spec.get("name"):
        raise MetadataError(
            f"input_spec names input {spec.get('name')!r}, the model has {[i.name for i in inputs]}"
        )
    logits = outputs[0].shape[-1] if outputs and outputs[0].shape else None
    if isinstance(logits, int) and logits != len(names):
        raise MetadataError(f"{len(names)} class names for {logits} logits, expected one name per logit")
    return names, spec


def parse_metadata(meta: dict[str, str]) -> tuple[list[str], dict[str, Any]]:
    """(class names, input spec) from the deployment metadata's strings, whichever runtime carried them
    (ONNX's metadata_props, a LiteRT sidecar JSON, an ExecuTorch program's constant methods)."""
    version = meta.get("deploy_schema")
    if version != SCHEMA_VERSION:
        raise MetadataError(
            f"expected deploy_schema {SCHEMA_VERSION!r} in the model's metadata, got {version!r}; "
            "re-export the model with the toolkit (server-kit aggregate, edge-sdk personalize)"
        )
    names, spec = (_json(meta, key) for key in ("class_names", "input_spec"))
    if not isinstance(names, list) or not names or not all(isinstance(n, str) and n for n in names):
        raise MetadataError(f"class_names must be a non-empty list of non-empty str, got {str(names)[:200]}")
    if not isinstance(spec, dict):
        raise MetadataError(f"input_spec must be a JSON object, got {type(spec).__name__}")
    shape = spec.get("shape")
    if not (isinstance(shape, list) and len(shape) == 3 and all(type(v) is int and v >= 1 for v in shape)):
        raise MetadataError(f"input_spec shape must be [C, H, W] of ints >= 1, got {shape!r}")
    channels = shape[0]
    for key, length in (("pixel_range", 2), ("input_range", 2), ("mean", channels), ("std", channels)):
        values = spec.get(key)
        if not (isinstance(values, list) and len(values) == length and all(_finite(v) for v in values)):
            raise MetadataError(f"input_spec {key} must be {length} finite numbers, got {values!r}")
    ranges = (spec["pixel_range"], spec["input_range"])
    if not all(v > 0 for v in spec["std"]) or not all(low < high for low, high in ranges):
        raise MetadataError(f"input_spec needs std > 0 and [low, high] ranges, got {str(spec)[:300]}")
    kind = (spec.get("dtype"), spec.get("layout"), spec.get("normalization"))
    if kind not in (("float32", "NCHW", "inside"), ("float32", "NCHW", "outside")):
        raise MetadataError(f"input_spec must be float32 NCHW normalised inside or outside, got {kind}")
    return names, spec


def load_pixels(path: Path, spec: dict[str, Any]) -> np.ndarray:
    """Raw pixels of one file as float64 N x C x H x W (N = 1 for an image)."""
    channels, height, width = spec["shape"]
    if path.suffix.lower() == ".npy":
        if path.stat().st_size > MAX_NPY_BYTES:
            raise ValueError(f"{path} is larger than {MAX_NPY_BYTES} bytes")
        array = np.load(path, allow_pickle=False)
        if array.dtype.kind not in "uif":
            raise ValueError(f"{path}: expected numeric pixels, got dtype {array.dtype}")
        if array.ndim == 2 and channels == 1:
            array = array[None]
        if array.ndim == 3:
            array = array[None]
    elif path.suffix.lower() in IMAGE_SUFFIXES:
        from PIL import Image  # only image files need Pillow

        with Image.open(path) as image:
            image = image.convert("L" if channels == 1 else "RGB")
            if image.size != (width, height):
                image = image.resize((width, height), Image.Resampling.BILINEAR)
            array = np.asarray(image)
        array = array[None, None] if channels == 1 else array.transpose(2, 0, 1)[None]  # HWC -> NCHW
    else:
        raise ValueError(f"{path}: expected an image file ({sorted(IMAGE_SUFFIXES)}) or a .npy")
    if array.ndim != 4 or tuple(array.shape[1:]) != (channels, height, width):
        raise ValueError(
            f"{path}: expected pixels shaped {[channels, height, width]}, got {list(array.shape)}"
        )
    return array.astype(np.float64)


def prepare(pixels: np.ndarray, spec: dict[str, Any]) -> np.ndarray:
    """Raw pixels -> the model's float32 input: pixel_range mapped onto input_range, then normalised
    when the model expects it done outside (a model normalising inside must not get it twice)."""
    (p_low, p_high), (i_low, i_high) = spec["pixel_range"], spec["input_range"]
    x = (pixels - p_low) / (p_high - p_low) * (i_high - i_low) + i_low
    if spec["normalization"] == "outside":
        shape = (1, -1, 1, 1)
        x = (x - np.reshape(spec["mean"], shape)) / np.reshape(spec["std"], shape)
    return x.astype(np.float32)


def softmax(logits: np.ndarray) -> np.ndarray:
    shifted = np.exp(logits - logits.max(axis=1, keepdims=True))
    return shifted / shifted.sum(axis=1, keepdims=True)


def main(argv: list[str] | None = None) -> int:
    return command_line(__doc__, "deploy.onnx, global.onnx or another toolkit classifier", classify, argv)


def command_line(
    doc: str, model_help: str, run: Callable[[Path, list[Path], int], int], argv: list[str] | None
) -> int:
    """The examples' command line: ``MODEL INPUTS... [--top-k K]`` run by ``run``; an error is one line on
    stderr and exit 1 (runtimes raise their own types, onnxruntime's derive from Exception alone)."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("model", type=Path, help=model_help)
    parser.add_argument("inputs", type=Path, nargs="+", help="image files or .npy arrays of raw pixels")
    parser.add_argument("--top-k", type=int, default=3, help="how many classes to print per input")
    args = parser.parse_args(argv)
    try:
        return run(args.model, args.inputs, args.top_k)
    except Exception as err:  # one line, no traceback
        print(f"{parser.prog}: error: {' '.join(str(err).split())}", file=sys.stderr)
        return 1


def classify(model: Path, inputs: list[Path], top_k: int) -> int:
    """Print the model's input spec, then the ``top_k`` classes of every input."""
    try:
        session = onnxruntime.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    except Exception as err:
        raise MetadataError(
            f"cannot load {model} as an ONNX model ({err}); expected a classifier the toolkit exported "
            "(deploy.onnx, global.onnx)"
        ) from err
    names, spec = read_metadata(session)
    print(describe(model, names, spec))
    for path in inputs:
        logits = session.run(None, {spec["name"]: prepare(load_pixels(path, spec), spec)})[0]
        print_top(path, logits, names, top_k)
    return 0


def print_top(path: Path, logits: np.ndarray, names: list[str], top_k: int) -> None:
    """One line per row of ``logits``: the ``top_k`` class names with their softmax probabilities."""
    probabilities = softmax(logits.astype(np.float64))
    k = max(1, min(top_k, len(names)))
    for index, row in enumerate(probabilities):
        label = f"{path.name}[{index}]" if len(probabilities) > 1 else path.name
        top = np.argsort(-row, kind="stable")[:k]
        print(f"{label}: " + ", ".join(f"{names[c]} ({row[c]:.4f})" for c in top))


def describe(model: Path, names: list[str], spec: dict[str, Any]) -> str:
    """The model's classes and input spec in one line."""
    normalised = "by the model" if spec["normalization"] == "inside" else "here"
    return (
        f"{model.name}: {len(names)} classes; input {spec['name']!r} [N, *{spec['shape']}] "
        f"{spec['dtype']} {spec['layout']}, pixels {spec['pixel_range']} -> {spec['input_range']}, "
        f"normalised {normalised} with mean {spec['mean']} std {spec['std']}"
    )


def _json(meta: dict[str, str], key: str) -> Any:
    text = meta.get(key)
    if text is None or len(text) > MAX_METADATA_CHARS:
        raise MetadataError(f"metadata {key!r} must be JSON of at most {MAX_METADATA_CHARS} characters")
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as err:
        raise MetadataError(f"metadata {key!r} is not JSON: {err}") from err


def _finite(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


if __name__ == "__main__":
    sys.exit(main())
