"""frozen(): a fixed model for the block, the caller's flags restored after."""

from __future__ import annotations

import pytest
from torch import nn

from common.torch_utils import frozen


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
