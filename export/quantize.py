"""Deployable ONNX: int8 static quantization (onnxruntime, QDQ, per-channel) and latency measurement.

Static QDQ is the CNN choice: dynamic quantization of convs goes through ConvInteger and runs far
slower, while QDQ is the portable format that TensorRT, QNN and XNNPACK read. Activations are unsigned
int8 with min-max ranges calibrated on the device's own images; weights are per output channel.

The weights' range is chosen for the CPUs the model will meet, not the one that quantized it.
onnxruntime's x86-64 kernels without VNNI (AVX2, AVX-512 before Cascade Lake) multiply u8 activations by
s8 weights with ``vpmaddubsw``, which adds pairs of products in 16 bits and saturates: two products of
255 x 127 overflow, so such a CPU can predict other classes than one with VNNI or ARM64's dot products.
Weights in 7 bits (``reduce_range``, [-64, 63]) keep every pair sum within int16 (2 x 255 x 64 < 32767),
so the integer results are the same on every CPU class. The measured cost of the lost bit and the
agreement per CPU class are in benchmarks/RESULTS.md (``benchmarks/int8_cpu_classes.py``).
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from common.errors import ExportError
from export.onnx_export import INPUT_NAME, onnx_session, read_metadata, validate_onnx

__all__ = ["DEFAULT_SCHEME", "QUANTIZATION_KEY", "SCHEMES", "QuantScheme", "latency_ms", "quantize_int8"]

# the metadata_props entry saying how, and for which CPUs, a model was quantized
QUANTIZATION_KEY = "quantization"


@dataclass(frozen=True)
class QuantScheme:
    """One int8 layout: activation and weight types, and whether weights use 7 of their 8 bits."""

    activations: str  # "uint8" | "int8"
    weights: str  # "int8" | "uint8"
    reduce_range: bool
    runs_alike_on: str  # the CPU classes on which onnxruntime's integer results are the same

    def to_metadata(self, name: str) -> str:
        return json.dumps(
            {"scheme": name, "format": "QDQ", "per_channel": True} | asdict(self), sort_keys=True
        )


SCHEMES: dict[str, QuantScheme] = {
    # full-range s8 weights: exact on VNNI / ARM64, may saturate on x86-64 without VNNI
    "u8s8": QuantScheme("uint8", "int8", False, "x86-64 with VNNI, ARM64"),
    # 7-bit s8 weights: no pair sum can saturate, the same integers on every CPU class
    "u8s7": QuantScheme("uint8", "int8", True, "x86-64 with or without VNNI, ARM64"),
    # asymmetric u8 weights: onnxruntime widens both operands to 16 bits first, so nothing saturates
    "u8u8": QuantScheme("uint8", "uint8", False, "x86-64 with or without VNNI, ARM64"),
}
DEFAULT_SCHEME = "u8s7"


class _Reader:
    """onnxruntime CalibrationDataReader over a float32 N x C x H x W array, in fixed batches."""

    def __init__(self, x: np.ndarray, batch_size: int) -> None:
        self._batches = iter([x[i : i + batch_size] for i in range(0, len(x), batch_size)])

    def get_next(self) -> dict[str, np.ndarray] | None:
        batch = next(self._batches, None)
        return None if batch is None else {INPUT_NAME: batch}


def quantize_int8(
    model_bytes: bytes, calibration: np.ndarray, *, batch_size: int = 32, scheme: str = DEFAULT_SCHEME
) -> bytes:
    """Static int8 QDQ quantization of an fp32 classifier, calibrated on ``calibration``.

    ``scheme``: a key of :data:`SCHEMES`; the result records it under :data:`QUANTIZATION_KEY`.

    ``calibration``: float32 pixels in [0, 1], N x C x H x W (a few hundred local images suffice).
    The result passes the same ONNX checks as every export and keeps every ``metadata_props`` entry of
    the fp32 model (provenance, class names, input spec: the int8 model takes the same float32 input);
    onnxruntime's tools carry them over and add their own ``onnx.*`` keys, checked here since a deployed
    model without its class names would be unusable.
    """
    from onnxruntime.quantization import QuantFormat, QuantType, quant_pre_process, quantize_static

    if scheme not in SCHEMES:
        raise ExportError(f"scheme must be one of {sorted(SCHEMES)}, got {scheme!r}; fix: pick one of them")
    layout = SCHEMES[scheme]
    types = {"uint8": QuantType.QUInt8, "int8": QuantType.QInt8}
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
                activation_type=types[layout.activations],
                weight_type=types[layout.weights],
                reduce_range=layout.reduce_range,
            )
        except Exception as err:  # onnxruntime raises assorted types from its tooling
            raise ExportError(f"int8 quantization failed: {type(err).__name__}: {err}") from err
        data = _with_scheme(dst.read_bytes(), layout.to_metadata(scheme))
    kept = {entry.key: entry.value for entry in validate_onnx(data).metadata_props}
    lost = sorted(key for key, value in read_metadata(model_bytes).items() if kept.get(key) != value)
    if lost:
        raise ExportError(
            f"int8 quantization dropped or changed the metadata {lost}, expected every fp32 entry kept; "
            "fix: check the installed onnxruntime's quantization tools"
        )
    return data


def _with_scheme(model_bytes: bytes, value: str) -> bytes:
    import onnx

    model = onnx.load_model_from_string(model_bytes)
    kept = [p for p in model.metadata_props if p.key != QUANTIZATION_KEY]
    del model.metadata_props[:]
    model.metadata_props.extend(kept)
    model.metadata_props.add(key=QUANTIZATION_KEY, value=value)
    return model.SerializeToString()


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
