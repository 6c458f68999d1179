"""A dead-leaves image model: where natural-image inversion starts.

Inversion that starts from pixel noise ends in texture noise on color images: a teacher of two or three
convolutions holds too little of what a picture looks like for its gradient to build edges, flat regions
and occlusions. The dead-leaves model (Matheron; Lee, Mumford and Huang 2001) draws them from a seed
alone: opaque shapes of random colors dropped one over another, their sizes following a power law, which
gives the scale invariance, the flat regions and the sharp occluding edges natural pictures share. No
image of anyone goes into it. Inversion then only has to move such a picture toward a class, and the
student learns from images whose statistics are a camera's rather than noise's.

Every draw comes from the caller's ``torch.Generator`` (on the CPU), so a seed gives the same images on
every device.
"""

from __future__ import annotations

import torch
from torch import Tensor

from common.errors import ConfigError

__all__ = ["LEAVES", "dead_leaves"]

LEAVES = 64  # shapes dropped on every image
SMALLEST, LARGEST = 0.02, 0.6  # the shapes' radii, as fractions of the image side
POWER = 3.0  # radius density ~ r^-POWER: the scale-invariant size law of natural images (Lee et al.)


def dead_leaves(n: int, input_shape: tuple[int, int, int], generator: torch.Generator) -> Tensor:
    """``n`` dead-leaves images (n x C x H x W float32 in [0, 1]): a flat background, then
    :data:`LEAVES` disks or squares with radii between :data:`SMALLEST` and :data:`LARGEST` of the side
    (density ~ r^-:data:`POWER`), each a uniformly drawn color, each covering what lies below it."""
    c, h, w = input_shape
    if n < 0 or min(c, h, w) < 1:
        raise ConfigError(f"dead_leaves needs n >= 0 and a positive (C, H, W), got {n} and {input_shape}")
    image = torch.rand(n, c, 1, 1, generator=generator).expand(n, c, h, w).clone()
    rows = ((torch.arange(h, dtype=torch.float32) + 0.5) / h).view(1, h, 1)
    cols = ((torch.arange(w, dtype=torch.float32) + 0.5) / w).view(1, 1, w)
    a = 1.0 - POWER  # inverse-CDF sampling of the power law between SMALLEST and LARGEST
    low, high = SMALLEST**a, LARGEST**a
    for _ in range(LEAVES):
        radius = (low + torch.rand(n, generator=generator) * (high - low)) ** (1.0 / a)
        cy = torch.rand(n, 1, 1, generator=generator)
        cx = torch.rand(n, 1, 1, generator=generator)
        square = (torch.rand(n, generator=generator) < 0.5).view(n, 1, 1)
        dy, dx = (rows - cy).abs(), (cols - cx).abs()
        distance = torch.where(square, torch.maximum(dy, dx), torch.sqrt(dy * dy + dx * dx))
        inside = (distance < radius.view(n, 1, 1)).unsqueeze(1)  # n x 1 x H x W
        color = torch.rand(n, c, 1, 1, generator=generator)
        image = torch.where(inside, color, image)
    return image
