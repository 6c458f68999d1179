"""Accuracy of a classifier on an ArrayDataset: an ONNX file through onnxruntime, or a torch module.

The ONNX path is what a device will run, so the report measures the artifact that ships, not the torch
module it came from. Both paths feed pixels as ``x.float() / 255`` (models normalise inside) and share one
summary, so their numbers are directly comparable.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from common.errors import BundleError, ConfigError, DataError, ExportError
from common.torch_utils import INFER_BATCH
from edge_sdk.data import ArrayDataset
from export.onnx_export import onnx_session

__all__ = ["evaluate_module", "evaluate_onnx"]


def evaluate_onnx(
    model: bytes | str | Path,
    data: ArrayDataset,
    *,
    batch_size: int = INFER_BATCH,
    threads: int = 1,
    unknown_output: bool = False,
) -> dict[str, Any]:
    """Accuracy of an ONNX classifier (bytes or a path to a ``.onnx`` file) with onnxruntime on CPU.

    Returns ``{"accuracy", "num_examples", "correct", "per_class_accuracy"}``; a class with no examples
    gets ``None``. A model with a fixed batch dimension is fed batches of that size (the last one padded).
    ``unknown_output``: the model has one more output, "none of my classes" (FedOV); an image it calls
    unknown counts as wrong.
    """
    _check_batch_size(batch_size)
    source = "<bytes>" if isinstance(model, bytes | bytearray) else str(model)
    if isinstance(model, str | Path):
        try:
            model = Path(model).read_bytes()
        except OSError as err:
            raise BundleError(f"cannot read ONNX model {source}: {err}") from err
    try:
        session = onnx_session(bytes(model), threads=threads)
    except ExportError as err:
        raise ExportError(f"{source}: {err}") from err
    info = session.get_inputs()[0]
    static = [d if isinstance(d, int) and d > 0 else None for d in info.shape]
    expected = tuple(static[1:])
    if len(static) != 4 or any(
        e is not None and e != g for e, g in zip(expected, data.input_shape, strict=True)
    ):
        raise DataError(
            f"{source} expects input {info.shape} but the data is N x {data.input_shape}; "
            "fix: evaluate on data of the model's input shape"
        )
    fixed = static[0]
    step = fixed or batch_size
    predictions = []
    for start in range(0, len(data), step):
        x = data.x[start : start + step].cpu().numpy().astype(np.float32) / np.float32(255)
        real = len(x)
        if fixed and real < fixed:
            x = np.concatenate([x, np.zeros((fixed - real, *x.shape[1:]), dtype=np.float32)])
        logits = session.run(None, {info.name: x})[0][:real]
        predictions.append(_predict(logits, data.num_classes + int(unknown_output), source))
    return _summary(predictions, data)


def evaluate_module(
    module: nn.Module,
    data: ArrayDataset,
    *,
    batch_size: int = INFER_BATCH,
    device: str | torch.device = "cpu",
) -> dict[str, Any]:
    """The same summary as :func:`evaluate_onnx` for a torch module (run in eval mode; modes restored)."""
    _check_batch_size(batch_size)
    modes = [(m, m.training) for m in module.modules()]
    module.eval()
    predictions = []
    try:
        with torch.inference_mode():
            for start in range(0, len(data), batch_size):
                x = data.x[start : start + batch_size].to(device).float() / 255
                logits = module(x).float().cpu().numpy()
                predictions.append(_predict(logits, data.num_classes, type(module).__name__))
    finally:
        for m, training in modes:
            m.training = training
    return _summary(predictions, data)


def _check_batch_size(batch_size: int) -> None:
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ConfigError(f"batch_size must be an int >= 1, got {batch_size!r}")


def _predict(logits: np.ndarray, num_classes: int, source: str) -> np.ndarray:
    if logits.ndim != 2 or logits.shape[1] != num_classes:
        raise DataError(
            f"{source} outputs logits shaped {logits.shape} but the data has {num_classes} classes; "
            "fix: evaluate on data of the task the model was trained for"
        )
    return logits.argmax(axis=1)


def _summary(predictions: list[np.ndarray], data: ArrayDataset) -> dict[str, Any]:
    if len(data) == 0:
        raise DataError("cannot evaluate on an empty dataset; expected at least one example")
    labels = data.y.cpu().numpy()
    hits = np.concatenate(predictions) == labels
    per_class_total = np.bincount(labels, minlength=data.num_classes)
    per_class_hits = np.bincount(labels, weights=hits, minlength=data.num_classes)
    correct = int(hits.sum())
    return {
        "accuracy": correct / len(labels),
        "num_examples": len(labels),
        "correct": correct,
        "per_class_accuracy": [
            float(h / n) if n else None for h, n in zip(per_class_hits, per_class_total, strict=True)
        ],
    }
