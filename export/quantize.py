"""Deployable ONNX: int8 static quantization (onnxruntime, QDQ, per-channel) and latency measurement.

Static QDQ is the CNN choice measured in ``shared/notes/ecosystem.md``: dynamic quantization of convs
goes through ConvInteger and ran up to 17x slower on this CPU, while QDQ is the portable format that
TensorRT, QNN and XNNPACK read. Weights are signed int8 per output channel, activations unsigned int8
with min-max ranges calibrated on the device's own images.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from common.errors import ExportError
from export.onnx_export import INPUT_NAME, onnx_session, read_metadata, validate_onnx

__all__ = ["latency_ms", "quantize_int8"]


class _Reader:
    """onnxruntime CalibrationDataReader over a float32 N x C x H x W array, in fixed batches."""

    def __init__(self, x: np.ndarray, batch_size: int) -> None:
        self._batches = iter([x[i : i + batch_size] for i in range(0, len(x), batch_size)])

    def get_next(self) -> dict[str, np.ndarray] | None:
        batch = next(self._batches, None)
        return None if batch is None else {INPUT_NAME: batch}


def quantize_int8(model_bytes: bytes, calibration: np.ndarray, *, batch_size: int = 32) -> bytes:
    """Static int8 QDQ quantization of an fp32 classifier, calibrated on ``calibration``.

    ``calibration``: float32 pixels in [0, 1], N x C x H x W (a few hundred local images suffice).
    The result passes the same ONNX checks as every export and keeps every ``metadata_props`` entry of
    the fp32 model (provenance, class names, input spec: the int8 model takes the same float32 input);
    onnxruntime's tools carry them over and add their own ``onnx.*`` keys, checked here since a deployed
    model without its class names would be unusable.
    """
    from onnxruntime.quantization import QuantFormat, QuantType, quant_pre_process, quantize_static

    x = np.ascontiguousarray(calibration, dtype=np.float32)
    if x.ndim != 4 or len(x) < 1:
        raise ExportError(f"calibration must be N x C x H x W float32 with N >= 1, got shape {x.shape}")
    with tempfile.TemporaryDirectory(prefix="quantize-") as tmp:
        src, pre, dst = Path(tmp, "fp32.onnx"), Path(tmp, "pre.onnx"), Path(tmp, "int8.onnx")
        src.write_bytes(model_bytes)
        try:
            quant_pre_process(str(src), str(pre), skip_symbolic_shape=True)
            quantize_static(
                str(pre),
                str(dst),
                _Reader(x, batch_size),
                quant_format=QuantFormat.QDQ,
                per_channel=True,
                activation_type=QuantType.QUInt8,
                weight_type=QuantType.QInt8,
            )
        except Exception as err:  # onnxruntime raises assorted types from its tooling
            raise ExportError(f"int8 quantization failed: {type(err).__name__}: {err}") from err
        data = dst.read_bytes()
    kept = {entry.key: entry.value for entry in validate_onnx(data).metadata_props}
    lost = sorted(key for key, value in read_metadata(model_bytes).items() if kept.get(key) != value)
    if lost:
        raise ExportError(
            f"int8 quantization dropped or changed the metadata {lost}, expected every fp32 entry kept; "
            "fix: check the installed onnxruntime's quantization tools"
        )
    return data


def latency_ms(
    model_bytes: bytes,
    input_shape: tuple[int, int, int],
    *,
    batch: int = 1,
    repeats: int = 50,
    threads: int = 1,
) -> float:
    """Median onnxruntime CPU latency in milliseconds of one batch (after 5 warm-up runs)."""
    session = onnx_session(model_bytes, threads=threads)
    x = np.random.default_rng(0).random((batch, *input_shape), dtype=np.float32)
    for _ in range(5):
        session.run(None, {INPUT_NAME: x})
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        session.run(None, {INPUT_NAME: x})
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)
