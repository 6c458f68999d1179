"""Small module helpers shared by every package that trains against a fixed model."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import nn

__all__ = ["frozen"]


@contextlib.contextmanager
def frozen(module: nn.Module) -> Iterator[nn.Module]:
    """``module`` in eval mode with ``requires_grad`` False for the block, the caller's flags restored after.

    A teacher that a generator or an inversion optimises against must not update its BatchNorm statistics
    nor collect gradients, but the caller may go on training it afterwards.
    """
    was_training = module.training
    flags = [p.requires_grad for p in module.parameters()]
    module.eval().requires_grad_(False)
    try:
        yield module
    finally:
        for p, flag in zip(module.parameters(), flags, strict=True):
            p.requires_grad_(flag)
        module.train(was_training)
