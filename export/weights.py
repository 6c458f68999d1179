"""Weights out of an ONNX file: the initializers of a BN-preserving export, keyed like a state_dict.

The SDK exports teachers so that ONNX initializer names equal the model's ``state_dict`` keys; rebuilding
the module from its arch string and loading these tensors is exact (and as fast as native torch), which
is why both the device (reloading its own model) and the server (teachers) go through here. The bytes
may come from anywhere, so they are parsed by :func:`export.onnx_check.parse_onnx` first: no external
data, every initializer float32 (or a small int64) with exactly the data its dims say.
"""

from __future__ import annotations

import torch
from onnx import numpy_helper

from common.errors import BundleError
from export.onnx_check import parse_onnx

__all__ = ["initializer_state_dict"]


def initializer_state_dict(
    model_bytes: bytes, module: torch.nn.Module | None = None, *, source: str = "ONNX model"
) -> dict[str, torch.Tensor]:
    """Map initializer name -> tensor; with ``module``, keep exactly its state_dict keys.

    ``num_batches_tracked`` buffers are not exported (they do not affect eval outputs), so they are filled
    from the module. A file that fails :func:`~export.onnx_check.parse_onnx`, missing keys or shape
    mismatches raise a BundleError naming them (and ``source``).
    """
    graph = parse_onnx(model_bytes, source=source, error=BundleError).graph
    tensors = {init.name: torch.from_numpy(numpy_helper.to_array(init).copy()) for init in graph.initializer}
    if module is None:
        return tensors
    wanted = module.state_dict()
    out: dict[str, torch.Tensor] = {}
    missing = []
    for key, ref in wanted.items():
        if key in tensors:
            value = tensors[key]
            if tuple(value.shape) != tuple(ref.shape):
                raise BundleError(
                    f"ONNX initializer {key!r} has shape {tuple(value.shape)}, the architecture expects "
                    f"{tuple(ref.shape)}; the arch string does not match the ONNX weights"
                )
            out[key] = value.to(ref.dtype)
        elif key.endswith("num_batches_tracked"):
            out[key] = ref.clone()
        else:
            missing.append(key)
    if missing:
        raise BundleError(
            f"ONNX file lacks {len(missing)} weights of the architecture (e.g. {missing[:3]}); it was not "
            "exported with BatchNorm kept by this SDK"
        )
    return out
