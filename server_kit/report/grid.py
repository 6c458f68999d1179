"""A PNG contact sheet of pseudo-images: one row per class, the most confident samples first.

It is the quickest sanity check of an inversion run: a row of noise means the teachers agree on
nothing for that class. Rows are chosen by the consensus labels (argmax), not by the target class the
image was optimised for, because the consensus is what the student learns from.
"""

from __future__ import annotations

import io
from pathlib import Path

import torch
from torch import Tensor

from common.errors import ConfigError
from export.atomic import atomic_write_bytes

__all__ = ["GRID_PADDING", "grid_png", "tile", "write_grid"]

GRID_PADDING = 2  # grey pixels between cells (server_kit.report.html finds the class rows by it)


def grid_png(
    x: Tensor, probs: Tensor, *, per_class: int = 8, scale: int = 2, padding: int = GRID_PADDING
) -> bytes:
    """PNG bytes: row c holds up to ``per_class`` images whose consensus argmax is c, by confidence.

    x: N x C x H x W float in [0, 1] (C = 1 or 3); probs: N x L. Missing cells stay black.
    """
    from PIL import Image

    if x.ndim != 4 or x.shape[1] not in (1, 3):
        raise ConfigError(f"x must be N x C x H x W with C in (1, 3), got shape {tuple(x.shape)}")
    if probs.ndim != 2 or probs.shape[0] != x.shape[0]:
        raise ConfigError(f"probs must be N x L with N = {x.shape[0]}, got shape {tuple(probs.shape)}")
    if per_class < 1 or scale < 1:
        raise ConfigError(f"per_class and scale must be >= 1, got {per_class}, {scale}")
    num_classes = probs.shape[1]
    confidence, label = probs.max(dim=1)  # N, N
    cells = torch.zeros((num_classes * per_class, *x.shape[1:]))  # L*per_class x C x H x W
    for c in range(num_classes):
        members = (label == c).nonzero().flatten()  # indices of images voted class c
        best = members[confidence[members].argsort(descending=True)[:per_class]]
        cells[c * per_class : c * per_class + best.numel()] = x[best].float().clamp(0, 1)
    if scale > 1:
        cells = cells.repeat_interleave(scale, dim=2).repeat_interleave(scale, dim=3)
    grid = tile(cells, columns=per_class, padding=padding, pad_value=0.5)  # 3 x H' x W'
    array = (grid.permute(1, 2, 0) * 255).round().to(torch.uint8).numpy()  # H' x W' x 3
    buf = io.BytesIO()
    Image.fromarray(array).save(buf, format="PNG")
    return buf.getvalue()


def tile(cells: Tensor, *, columns: int, padding: int, pad_value: float) -> Tensor:
    """3 x H' x W': ``cells`` (N x C x h x w, C = 1 or 3) in rows of ``columns``, ``padding`` pixels of
    ``pad_value`` around and between them. torchvision's ``make_grid`` for these arguments (a test holds
    them equal), here so the server draws its grids without torchvision, which it needs only to read the
    torchvision datasets."""
    if cells.shape[1] == 1:
        cells = cells.expand(-1, 3, -1, -1)  # grey -> RGB
    n, _, h, w = cells.shape
    if n == 1:
        return cells[0].clone()  # make_grid returns a lone image unpadded
    columns = min(columns, n)
    rows = -(-n // columns)
    grid = cells.new_full((3, rows * (h + padding) + padding, columns * (w + padding) + padding), pad_value)
    for k in range(n):
        top, left = (k // columns) * (h + padding) + padding, (k % columns) * (w + padding) + padding
        grid[:, top : top + h, left : left + w] = cells[k]
    return grid


def write_grid(path: str | Path, x: Tensor, probs: Tensor, *, per_class: int = 8, scale: int = 2) -> Path:
    """Write :func:`grid_png` atomically to ``path``."""
    return atomic_write_bytes(path, grid_png(x, probs, per_class=per_class, scale=scale))
