"""Cheap local outliers for a classifier that can say "none of my classes" (FedOV's idea).

Under label skew a device's classifier is asked, on the server, about images of classes it never saw;
a plain classifier must name one of its own. Trained with an extra "unknown" output on corrupted copies of
its own images, it learns where its classes end. The corruptions keep the local statistics of real
images (strokes, textures, brightness) and destroy their global shape, so "unknown" cannot be learnt
from a trivial cue such as noise or an unusual mean:

* patch shuffle: the image cut into a ``grid`` x ``grid`` mosaic of tiles, the tiles permuted;
* blend: the pixel mean of two images of *different* classes (never of one class: a thick stroke of
  class c is still c). A batch with a single class gets a patch shuffle instead.

Nothing leaves the device: the outliers exist only inside the training loop.
"""

from __future__ import annotations

import torch
from torch import Tensor

from common.errors import ConfigError

__all__ = ["GRID", "make_outliers"]

GRID = 4  # tiles per side: 7 x 7 pixel tiles on 28 x 28 images, 8 x 8 on 32 x 32


def _shuffle_tiles(x: Tensor, grid: int, generator: torch.Generator) -> Tensor:
    """Each image's ``grid`` x ``grid`` tiles (the top-left ``grid * tile`` square) in a random order."""
    n, c, h, w = x.shape
    th, tw = h // grid, w // grid
    if th < 1 or tw < 1:
        raise ConfigError(f"images of {h} x {w} pixels are too small for a {grid} x {grid} patch shuffle")
    out = x.clone()
    core = x[:, :, : th * grid, : tw * grid]
    tiles = (
        core.reshape(n, c, grid, th, grid, tw).permute(0, 2, 4, 1, 3, 5).reshape(n, grid * grid, c, th, tw)
    )
    order = torch.argsort(torch.rand((n, grid * grid), generator=generator), dim=1).to(x.device)
    tiles = tiles[torch.arange(n, device=x.device).unsqueeze(1), order]
    tiles = (
        tiles.reshape(n, grid, grid, c, th, tw).permute(0, 3, 1, 4, 2, 5).reshape(n, c, th * grid, tw * grid)
    )
    out[:, :, : th * grid, : tw * grid] = tiles
    return out


def make_outliers(
    x: Tensor, y: Tensor, count: int, generator: torch.Generator, *, grid: int = GRID
) -> Tensor:
    """``count`` outliers (float images like ``x``, B x C x H x W in [0, 1]) made from the batch ``x``
    with labels ``y``: half patch-shuffled images, half blends of two images of different classes.

    ``generator`` (CPU) draws every choice, so a seeded training run makes the same outliers.
    """
    if count < 1 or len(x) < 1:
        raise ConfigError(f"need a non-empty batch and count >= 1, got {len(x)} images and count {count}")
    pick = torch.randint(len(x), (count,), generator=generator).to(x.device)
    out = _shuffle_tiles(x[pick], grid, generator)
    half = count // 2
    if half and bool((y != y[0]).any()):
        first = torch.randint(len(x), (half,), generator=generator).to(x.device)
        second = torch.randint(len(x), (half,), generator=generator).to(x.device)
        differ = y[first] != y[second]  # only pairs of two classes blend; the rest stay shuffled
        blended = 0.5 * (x[first] + x[second])
        out[:half] = torch.where(differ.view(-1, 1, 1, 1), blended, out[:half])
    return out
