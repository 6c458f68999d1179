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
import math
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from common.errors import ExportError
from export.onnx_export import INPUT_NAME, onnx_logits, onnx_session, read_metadata, validate_onnx

__all__ = [
    "DEFAULT_MIN_AGREEMENT",
    "DEFAULT_SCHEME",
    "QUANTIZATION_KEY",
    "SCHEMES",
    "QuantScheme",
    "latency_ms",
    "quantize_int8",
]

# the metadata_props entry saying how, and for which CPUs, a model was quantized
QUANTIZATION_KEY = "quantization"


@dataclass(frozen=True)
class QuantScheme:
    """One int8 layout: activation and weight types, and whether weights use 7 of their 8 bits."""

    activations: str  # "uint8" | "int8"
    weights: str  # "int8" | "uint8"
    reduce_range: bool
    runs_alike_on: str  # the CPU classes on which onnxruntime's integer results are the same

    def to_metadata(self, name: str, record: dict[str, object]) -> str:
        """The metadata entry: this layout, and which nodes stayed float32 at what measured agreement."""
        return json.dumps(
            {"scheme": name, "format": "QDQ", "per_channel": True} | asdict(self) | record, sort_keys=True
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
# the share of predictions the int8 model must keep; a deployed model is judged by its predictions
DEFAULT_MIN_AGREEMENT = 0.99
# the operators that hold the compute int8 is for: a model with all of them in float32 is not int8
_WEIGHTED = ("Conv", "ConvTranspose", "Gemm", "MatMul")


class _Reader:
    """onnxruntime CalibrationDataReader over a float32 N x C x H x W array, in fixed batches."""

    def __init__(self, x: np.ndarray, batch_size: int) -> None:
        self._batches = iter([x[i : i + batch_size] for i in range(0, len(x), batch_size)])

    def get_next(self) -> dict[str, np.ndarray] | None:
        batch = next(self._batches, None)
        return None if batch is None else {INPUT_NAME: batch}


def quantize_int8(
    model_bytes: bytes,
    calibration: np.ndarray,
    *,
    batch_size: int = 32,
    scheme: str = DEFAULT_SCHEME,
    min_agreement: float | None = DEFAULT_MIN_AGREEMENT,
    check: np.ndarray | None = None,
) -> bytes:
    """Static int8 QDQ quantization of an fp32 classifier, calibrated on ``calibration``.

    ``scheme``: a key of :data:`SCHEMES`; the result records it under :data:`QUANTIZATION_KEY`.

    ``calibration``: float32 pixels in [0, 1], N x C x H x W (a few hundred local images suffice).

    ``min_agreement``: the share of predictions the int8 model must keep, held at 95 % confidence on the
    ``check`` images (default: the calibration images; pass the device's held-out images). A model
    whose top two logits are often close (an under-trained one flips predictions under one pixel level
    of noise) loses more than that to int8 rounding; its most sensitive nodes then stay float32
    (:func:`_keep_float`), named in the metadata with the measured agreement. ``None`` quantizes every
    node without checking.

    The result passes the same ONNX checks as every export and keeps every ``metadata_props`` entry of
    the fp32 model (provenance, class names, input spec: the int8 model takes the same float32 input);
    onnxruntime's tools carry them over and add their own ``onnx.*`` keys, checked here since a deployed
    model without its class names would be unusable.
    """
    from onnxruntime.quantization import quant_pre_process

    if scheme not in SCHEMES:
        raise ExportError(f"scheme must be one of {sorted(SCHEMES)}, got {scheme!r}; fix: pick one of them")
    if min_agreement is not None and not (isinstance(min_agreement, float) and 0.0 < min_agreement <= 1.0):
        raise ExportError(
            f"min_agreement must be a float in (0, 1] or None, got {min_agreement!r}; "
            "fix: pass a share such as 0.99, or None to quantize without the check"
        )
    x = _images(calibration, "calibration")
    check = x if check is None else _images(check, "check")
    if check.shape[1:] != x.shape[1:]:
        raise ExportError(
            f"check images must be N x {' x '.join(map(str, x.shape[1:]))} like the calibration images, "
            f"got {check.shape}; fix: pass images of the model's input shape"
        )
    with tempfile.TemporaryDirectory(prefix="quantize-") as tmp:
        src, pre = Path(tmp, "fp32.onnx"), Path(tmp, "pre.onnx")
        src.write_bytes(model_bytes)
        try:
            quant_pre_process(str(src), str(pre), skip_symbolic_shape=True)
        except Exception as err:  # onnxruntime raises assorted types from its tooling
            raise ExportError(f"int8 quantization failed: {type(err).__name__}: {err}") from err
        _name_nodes(pre)

        def quantize(exclude: tuple[str, ...] = (), only: str | None = None) -> bytes:
            reader = _Reader(x, batch_size)
            return _quantize(pre, Path(tmp, "int8.onnx"), reader, SCHEMES[scheme], exclude, only)

        data, record = quantize(), {}
        if min_agreement is not None:
            data, record = _keep_float(model_bytes, pre, quantize, check, min_agreement, data)
        data = _with_scheme(data, SCHEMES[scheme].to_metadata(scheme, record))
    kept = {entry.key: entry.value for entry in validate_onnx(data).metadata_props}
    lost = sorted(key for key, value in read_metadata(model_bytes).items() if kept.get(key) != value)
    if lost:
        raise ExportError(
            f"int8 quantization dropped or changed the metadata {lost}, expected every fp32 entry kept; "
            "fix: check the installed onnxruntime's quantization tools"
        )
    return data


def _images(x: np.ndarray, what: str) -> np.ndarray:
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim != 4 or len(x) < 1:
        raise ExportError(f"{what} must be N x C x H x W float32 with N >= 1, got shape {x.shape}")
    return x


def _name_nodes(path: Path) -> None:
    """Name every unnamed node (onnx's optimizer leaves some so): the float32 fallback excludes by name."""
    import onnx

    model = onnx.load_model(str(path))
    taken = {node.name for node in model.graph.node}
    for index, node in enumerate(model.graph.node):
        if not node.name:
            node.name = next(
                n for i in range(len(taken) + 1) if (n := f"{node.op_type}_{index}_{i}") not in taken
            )
            taken.add(node.name)
    onnx.save_model(model, str(path))


def _quantize(
    pre: Path, dst: Path, reader: _Reader, layout: QuantScheme, exclude: tuple[str, ...], only: str | None
) -> bytes:
    from onnxruntime.quantization import QuantFormat, QuantType, quantize_static

    types = {"uint8": QuantType.QUInt8, "int8": QuantType.QInt8}
    try:
        quantize_static(
            str(pre),
            str(dst),
            reader,
            quant_format=QuantFormat.QDQ,
            per_channel=True,
            activation_type=types[layout.activations],
            weight_type=types[layout.weights],
            reduce_range=layout.reduce_range,
            nodes_to_exclude=list(exclude),
            nodes_to_quantize=None if only is None else [only],
        )
    except Exception as err:  # onnxruntime raises assorted types from its tooling
        raise ExportError(f"int8 quantization failed: {type(err).__name__}: {err}") from err
    return dst.read_bytes()


def _keep_float(
    fp32: bytes,
    pre: Path,
    quantize: Callable[..., bytes],
    check: np.ndarray,
    target: float,
    data: bytes,
) -> tuple[bytes, dict[str, object]]:
    """The int8 model with the fewest float32 nodes that agrees with fp32 on >= ``target`` of ``check``.

    Nodes are ranked by the predictions they flip when each alone is int8 (one quantization per node:
    the activations of element-wise nodes, a hard-swish's product or a residual sum, are rounded too and
    can cost as much as a convolution's), then the k most harmful stay float32, k found by bisection
    (agreement grows with k: the k = all end is the fp32 model itself). Raises when that leaves no
    convolution or matrix product in int8: deploy float32 then.
    """
    import onnx

    ref = _predict(fp32, check)
    agreement, target = _agree(data, check, ref), _needed(target, len(check))
    if agreement >= target:
        return data, {"float_nodes": [], "agreement": agreement, "check_images": len(check)}
    graph = onnx.load_model(str(pre)).graph
    layers = [n.name for n in graph.node]
    weighted = {n.name for n in graph.node if n.op_type in _WEIGHTED}
    alone = {name: _agree(quantize(only=name), check, ref) for name in layers}
    ranked = tuple(sorted(layers, key=lambda name: (alone[name], layers.index(name))))
    lo, hi, best = 0, len(ranked), None  # the largest k below target, the smallest tried above it
    while lo + 1 <= hi:
        k = (lo + 1 + hi) // 2
        candidate = quantize(ranked[:k])
        share = _agree(candidate, check, ref)
        if share >= target:
            hi, best = k - 1, (candidate, k, share)
        else:
            lo = k
    if best is None or weighted <= set(ranked[: best[1]]):
        raise ExportError(
            f"int8 agrees with float32 on {agreement:.2%} of {len(check)} check images, expected >= "
            f"{target:.2%}, and keeping the most sensitive nodes in float32 reaches it only with every "
            "convolution and matrix product in float32; fix: deploy the float32 model, train it longer "
            "(int8 rounding flips the predictions whose top two logits are close), or check on more images"
        )
    candidate, k, share = best
    record = {"float_nodes": list(ranked[:k]), "agreement": share, "check_images": len(check)}
    # how much of the compute int8 still runs: a model left mostly float32 gains little from int8
    return candidate, record | {
        "int8_weighted_nodes": f"{len(weighted - set(ranked[:k]))} of {len(weighted)}"
    }


def _needed(target: float, n: int) -> float:
    """The agreement on ``n`` check images that puts the true agreement above ``target`` at one-sided 95 %
    confidence (normal approximation of the binomial): the bisection keeps the first k that passes, so an
    agreement just at ``target`` on the check images overstates it on unseen ones."""
    return min(1.0, target + 1.645 * math.sqrt(target * (1.0 - target) / n))


def _predict(model_bytes: bytes, x: np.ndarray) -> np.ndarray:
    return onnx_logits(model_bytes, x).argmax(1)


def _agree(model_bytes: bytes, x: np.ndarray, ref: np.ndarray) -> float:
    return float((_predict(model_bytes, x) == ref).mean())


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
