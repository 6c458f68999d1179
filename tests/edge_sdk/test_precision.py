"""Compute precision: validation, what ``auto`` resolves to, and what each context computes in."""

from __future__ import annotations

import pytest
import torch

from common.errors import ConfigError
from edge_sdk.precision import PRECISIONS, autocast, check_precision, native_bf16, resolve_precision


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
