"""The label counts a teacher claims (how many examples of each class it trained on), checked once and
turned into the weights every phase shares: a teacher's share of each class, and the classes it holds."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from common.errors import ConfigError, ToolkitError

__all__ = ["check_label_counts", "class_shares", "held_classes", "unpaired_counts"]


def check_label_counts(
    label_counts: Sequence[Sequence[int]] | Tensor,
    *,
    num_classes: int | None = None,
    min_rows: int = 1,
    what: str = "label_counts",
    error: type[ToolkitError] = ConfigError,
) -> Tensor:
    """``label_counts`` as a K x L float64 tensor: K >= ``min_rows`` rows (one per bundle), L >= 2 classes
    (exactly ``num_classes`` when given), every count finite and >= 0, else ``error``.

    The one validator of claimed counts, so labelling and FedMHO's teacher refuse the same inputs; each
    caller picks the error its own tests and users expect (DataError where the counts are data).
    """
    rows = label_counts if isinstance(label_counts, Tensor) else [list(r) for r in label_counts]
    if len(rows) == 0 and min_rows == 0 and num_classes is not None:
        return torch.zeros(0, num_classes, dtype=torch.float64)
    try:
        counts = torch.as_tensor(rows, dtype=torch.float64)
    except (TypeError, ValueError) as err:  # ragged rows, non-numbers
        raise error(f"{what} must be K x L numbers, got {type(label_counts).__name__}: {err}") from err
    columns = "L >= 2" if num_classes is None else f"L == {num_classes}"
    if (
        counts.ndim != 2
        or counts.shape[0] < max(min_rows, 1)
        or counts.shape[1] < 2
        or (num_classes is not None and counts.shape[1] != num_classes)
    ):
        raise error(
            f"{what} must be K x L with K >= {max(min_rows, 1)}, {columns}, got shape {tuple(counts.shape)}"
        )
    if not torch.isfinite(counts).all() or (counts < 0).any():
        raise error(f"{what} must be finite and >= 0")
    return counts


def class_shares(
    label_counts: Sequence[Sequence[int]] | Tensor, others: Sequence[Sequence[int]] | Tensor | None = None
) -> Tensor:
    """K x L float32: teacher k's share of the federation's examples of class c.

    Without ``others`` the columns sum to 1. ``others`` (M x L) are the examples of devices that sent
    no classifier (their knowledge reaches the server as decoders only): they count in each class's
    total, so the classifiers' weights for a class sum to the share of its examples they saw, and a
    teacher that alone among the classifiers holds a class no longer votes for it with full weight.
    A class no teacher has examples of gets uniform weights 1/K (every teacher is equally uninformed).
    """
    counts = check_label_counts(label_counts)
    held = counts.sum(dim=0, keepdim=True)  # 1 x L
    total = held
    if others is not None:
        extra = check_label_counts(others, num_classes=counts.shape[1], min_rows=0, what="others")
        total = held + extra.sum(dim=0, keepdim=True)
    uniform = torch.full_like(counts, 1.0 / counts.shape[0])
    return torch.where(held > 0, counts / total.clamp(min=1e-300), uniform).float()


def unpaired_counts(
    classifier_counts: Sequence[Sequence[int]] | Tensor, decoder_counts: Sequence[Sequence[int]] | Tensor
) -> list[list[int]]:
    """The decoders' count rows that are no classifier's: a device that uploads both sends the same
    claim twice (its decoder's row equals its classifier's, or is that row with refused classes zeroed),
    and counting it twice would weigh its data double. Bundles carry no device id, so a decoder row that
    fits inside some classifier row (equal where the decoder claims anything) is taken as that device's."""
    classifiers = check_label_counts(classifier_counts)
    rows = check_label_counts(decoder_counts, num_classes=classifiers.shape[1], min_rows=0, what="decoders")
    unpaired = []
    for row in rows:
        claimed = row > 0
        inside = ((classifiers == row) | ~claimed).all(dim=1)  # equal on every class the decoder claims
        if not bool(inside.any()) and bool(claimed.any()):
            unpaired.append([int(v) for v in row.tolist()])
    return unpaired


def held_classes(label_counts: Sequence[Sequence[int]] | Tensor) -> Tensor:
    """K x L bool: the classes each teacher has examples of; a teacher with none holds every class."""
    held = check_label_counts(label_counts) > 0
    return held | ~held.any(dim=1, keepdim=True)
