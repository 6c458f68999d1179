"""Teachers that can abstain (FedOV): a classifier with one extra "unknown" output.

Under label skew most teachers never saw most classes, and a plain classifier must still name one of its
own classes for any image. A device that trains with ``unknown_output`` (see :mod:`edge_sdk.outliers`)
adds an output for "none of my classes", learnt from corrupted copies of its own images. On the server
such a teacher is wrapped so every phase sees the usual ``num_classes`` logits (inversion, the generator,
distillation need nothing new), while the vote also asks it how sure it is that a sample is one of its
classes, ``p_own = 1 - softmax(logits)[unknown]``, and weighs its vote by that
(:mod:`server_kit.labelling.labels`).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

__all__ = ["MIN_OWN", "Abstaining", "own_probability"]

MIN_OWN = 1e-6


class Abstaining(nn.Module):
    """``inner`` maps images to ``num_classes + 1`` logits, the last "unknown"; ``forward`` returns the
    first ``num_classes`` (the known classes), :meth:`split` both parts from one pass."""

    def __init__(self, inner: nn.Module, num_classes: int) -> None:
        super().__init__()
        self.inner = inner
        self.num_classes = num_classes

    def split(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """(known-class logits B x L, probability B that x is one of them), from one forward pass.

        p_own is computed in float64 as -expm1(log p_unknown) and floored at ``MIN_OWN``: a teacher sure
        that an image is not its own keeps a tiny vote, so a sample every teacher disowns still gets
        the ensemble's (tiny, renormalised) opinion instead of an all-zero target."""
        logits = self.inner(x)
        log_unknown = torch.log_softmax(logits.double(), dim=1)[:, self.num_classes]
        return logits[:, : self.num_classes], (-torch.expm1(log_unknown)).clamp(min=MIN_OWN)

    def forward(self, x: Tensor) -> Tensor:
        return self.inner(x)[:, : self.num_classes]


def own_probability(module: nn.Module, x: Tensor) -> tuple[Tensor, Tensor | None]:
    """(logits, p_own or None): the module's known-class logits and, for an :class:`Abstaining` teacher,
    how sure it is that each image is one of its classes."""
    if isinstance(module, Abstaining):
        return module.split(x)
    return module(x), None
