"""Compute precision of the training and inference loops: float32, or bfloat16 autocast where it is native.

Every model of the toolkit keeps float32 weights (what ONNX exports and bundles carry). With ``bf16`` the
convolutions and matrix products of a forward pass run in bfloat16 under :func:`torch.autocast`, and the
losses, BatchNorm statistics and optimizer steps stay in float32 (autocast's own policy). On a CPU with
native bfloat16 dot products (x86 AVX512-BF16 or AMX) that makes a small CNN's training step and a
teacher's inversion step faster, with the same validation accuracy (benchmarks/RESULTS.md, "Speed and
memory, second pass"); a CPU without it emulates bfloat16 and gets slower, so ``auto`` picks float32
there.

Two rules every caller keeps:

* autocast is entered around each forward (:func:`autocast`), never around a whole training run:
  autocast caches the bfloat16 copy of every weight until the context exits, so a context spanning
  optimizer steps keeps computing with the first step's weights;
* the result that is reported as the model's accuracy is measured in float32, the precision of the
  exported model (search fitness may use the run's precision: it only ranks candidates).
"""

from __future__ import annotations

import contextlib
import functools
from typing import Literal, get_args

import torch

from common.errors import ConfigError

__all__ = ["PRECISIONS", "autocast", "check_precision", "native_bf16", "resolve_precision"]

Precision = Literal["auto", "fp32", "bf16"]  # a config field of this type gets these as choices
PRECISIONS: tuple[str, ...] = get_args(Precision)


def check_precision(precision: object) -> str:
    """``precision`` if it is one of :data:`PRECISIONS`, else ConfigError."""
    if precision not in PRECISIONS:
        raise ConfigError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    return str(precision)


def native_bf16(device: str | torch.device = "cpu") -> bool:
    """Whether ``device`` computes bfloat16 dot products in hardware (CUDA: compute capability 8+;
    x86 CPU: AVX512-BF16 or AMX-BF16, as torch's CPU feature probe reports them, and oneDNN, which runs
    the convolutions, allowed to use them: ``ONEDNN_MAX_CPU_ISA=AVX2``, the way to stand in for an
    AVX2-only CPU, forbids them, and bfloat16 then falls back to emulated kernels many times slower
    than float32)."""
    return _native_bf16(torch.device(device).type)


@functools.cache
def _native_bf16(kind: str) -> bool:
    if kind == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported(including_emulation=False)
    if kind != "cpu":
        return False
    probe = getattr(torch._C._cpu, "_get_cpu_capability", None)  # private, hence the fallback
    if probe is None:
        return False
    try:
        features = probe()
    except RuntimeError:
        return False
    return bool(features.get("avx512_bf16") or features.get("amx_bf16")) and _onednn_bf16()


def _onednn_bf16() -> bool:
    """oneDNN's own answer (it honours ``ONEDNN_MAX_CPU_ISA``); private in torch, hence the fallback."""
    probe = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    try:
        return bool(torch.backends.mkldnn.is_available() and probe is not None and probe())
    except RuntimeError:
        return False


def resolve_precision(precision: str, device: str | torch.device = "cpu") -> str:
    """``fp32`` or ``bf16``: ``auto`` is bf16 where :func:`native_bf16` holds. An explicit ``bf16`` is
    honoured on any CPU (emulated, slower) and refused on a GPU without bfloat16 support."""
    check_precision(precision)
    device = torch.device(device)
    if precision == "auto":
        return "bf16" if native_bf16(device) else "fp32"
    if precision == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise ConfigError(f"precision bf16 asked for, but {device} has no bfloat16 support; use fp32 or auto")
    return precision


def autocast(precision: str, device: str | torch.device = "cpu") -> contextlib.AbstractContextManager[None]:
    """The context one forward pass runs in: bfloat16 autocast for ``bf16`` (resolved first when
    ``auto``), nothing for ``fp32``. Enter it per forward (see the module docstring)."""
    device = torch.device(device)
    if resolve_precision(precision, device) == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=torch.bfloat16)
