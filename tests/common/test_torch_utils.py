"""frozen(): a fixed model for the block, the caller's flags restored after; batched_logits(): eval-mode
logits in slices, the same as one pass."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from common.torch_utils import batched_logits, frozen


def test_frozen_restores_mode_and_flags_even_on_error() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    model[0].bias.requires_grad_(False)  # a caller's own choice survives
    with frozen(model) as inner:
        assert inner is model and not model.training
        assert not any(p.requires_grad for p in model.parameters())
    assert model.training
    assert [p.requires_grad for p in model.parameters()] == [True, False, True, True]
    model.eval()
    with pytest.raises(RuntimeError), frozen(model):
        raise RuntimeError("boom")
    assert not model.training and model[0].weight.requires_grad


def test_batched_logits_equal_one_pass_in_eval_mode_and_restore_the_flag() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 8), nn.BatchNorm1d(8), nn.Linear(8, 4))
    model.train()(torch.randn(32, 3))  # running statistics away from their start
    x = torch.randn(10, 3)
    out = batched_logits(model, x, batch_size=3)  # slices of 3, 3, 3, 1: a lone last image in eval mode
    assert model.training  # the caller's flag is back
    with torch.no_grad():
        expected = model.eval()(x)
    assert out.dtype == torch.float32 and out.device.type == "cpu" and not out.requires_grad
    torch.testing.assert_close(out, expected)
