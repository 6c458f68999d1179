"""Compute precision: validation, what ``auto`` resolves to, and what each context computes in."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from common.errors import ConfigError
from edge_sdk.precision import PRECISIONS, autocast, check_precision, native_bf16, resolve_precision

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("bad", ["fp16", "BF16", None, 32])
def test_unknown_precision_is_refused(bad: object) -> None:
    with pytest.raises(ConfigError, match="precision must be one of"):
        check_precision(bad)


def test_auto_is_bf16_exactly_where_it_is_native() -> None:
    assert resolve_precision("auto", "cpu") == ("bf16" if native_bf16("cpu") else "fp32")
    for explicit in ("fp32", "bf16"):
        assert resolve_precision(explicit, "cpu") == explicit
    assert set(PRECISIONS) == {"auto", "fp32", "bf16"}


@pytest.mark.parametrize(("precision", "dtype"), [("fp32", torch.float32), ("bf16", torch.bfloat16)])
def test_context_computes_matmuls_in_its_precision(precision: str, dtype: torch.dtype) -> None:
    a, b = torch.rand(4, 8), torch.rand(8, 3)
    with autocast(precision, "cpu"):
        assert (a @ b).dtype == dtype
    assert (a @ b).dtype == torch.float32  # nothing leaks past the block


def test_auto_is_float32_where_onednn_may_not_use_bfloat16() -> None:
    """Held to AVX2 (how the toolkit stands in for an AVX2-only CPU) a bfloat16 CPU emulates bfloat16 in
    slow kernels, so ``auto`` must not pick it there, whatever the CPU's own flags say."""
    code = "from edge_sdk.precision import resolve_precision; print(resolve_precision('auto', 'cpu'))"
    env = os.environ | {"ONEDNN_MAX_CPU_ISA": "AVX2", "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "fp32"
