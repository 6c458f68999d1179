"""The training recipe an input calls for, and the augmentation it runs on preloaded uint8 batches.

Natural color images need what digits do not (the standard small-CNN recipe on CIFAR-sized data): random
crops from a zero-padded image and horizontal flips, so a few thousand images stop being memorised in a few
epochs; an L2 weight penalty; a learning rate that decays (cosine) instead of staying put. Whether an
input is such an image is read from its spec, never from a dataset's name: three channels are a camera's
picture, where a shifted or mirrored object is still the same object; one channel (digits, scans, sensor
maps) gets none of it, since a mirrored 2 is not a 2 and a shifted digit may leave its frame, so
grayscale training stays exactly as it was.

Every draw comes from the caller's ``torch.Generator`` (on the CPU, so a seed gives the same crops and flips
on every device): same seed, same batches.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, get_args

import torch

from common.errors import ConfigError

__all__ = [
    "AUGMENTS",
    "COLOR_CHANNELS",
    "COLOR_WEIGHT_DECAY",
    "SCHEDULES",
    "Augment",
    "Recipe",
    "Schedule",
    "check_recipe",
    "cosine_factor",
    "crop_flip",
    "resolve_recipe",
]

# what each option may be: "auto" decides from the input spec (see resolve_recipe)
Augment = Literal["auto", "none", "crop-flip"]
Schedule = Literal["auto", "constant", "cosine"]
AUGMENTS: tuple[str, ...] = get_args(Augment)
SCHEDULES: tuple[str, ...] = get_args(Schedule)
COLOR_CHANNELS = 3  # an input with this many channels is a color picture: it gets the color recipe
COLOR_WEIGHT_DECAY = 5e-4  # Adam's L2 penalty of the color recipe (the usual small-CNN CIFAR value)
PAD_SHARE = 8  # crop padding = the image side // PAD_SHARE (4 pixels at 32x32, the standard CIFAR crop)


@dataclass(frozen=True)
class Recipe:
    """A training run's resolved recipe: ``pad`` > 0 crops from a ``pad``-pixel zero border and flips
    (0: no augmentation); ``schedule`` is ``constant`` or ``cosine``; ``weight_decay`` is Adam's L2."""

    pad: int
    schedule: str
    weight_decay: float


def is_color(input_shape: tuple[int, ...]) -> bool:
    """Whether images of ``input_shape`` (C, H, W) are color pictures (:data:`COLOR_CHANNELS` channels):
    the one rule every ``auto`` setting of the device and the server reads."""
    return int(input_shape[0]) == COLOR_CHANNELS


def check_recipe(augment: object, schedule: object, weight_decay: object) -> None:
    """The recipe options of a config: a choice of :data:`AUGMENTS`, of :data:`SCHEDULES`, and a weight
    decay that is None (from the input spec) or a finite number >= 0; else :class:`ConfigError`."""
    if augment not in AUGMENTS:
        raise ConfigError(f"augment must be one of {AUGMENTS}, got {augment!r}")
    if schedule not in SCHEDULES:
        raise ConfigError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    if weight_decay is not None and not (
        isinstance(weight_decay, int | float)
        and not isinstance(weight_decay, bool)
        and 0 <= weight_decay < float("inf")
    ):
        raise ConfigError(
            f"weight_decay must be a finite number >= 0 or none (from the input), got {weight_decay!r}"
        )


def resolve_recipe(
    input_shape: tuple[int, int, int], *, augment: str, schedule: str, weight_decay: float | None
) -> Recipe:
    """The recipe for images of ``input_shape`` (C, H, W): each ``auto`` option (and a None weight
    decay) takes the color recipe for :data:`COLOR_CHANNELS`-channel inputs and the plain one (no
    augmentation, constant rate, no decay) otherwise; an explicit choice is kept as given."""
    check_recipe(augment, schedule, weight_decay)
    color = is_color(input_shape)
    crop = augment == "crop-flip" or (augment == "auto" and color)
    pad = max(1, min(input_shape[1:]) // PAD_SHARE) if crop else 0
    if schedule == "auto":
        schedule = "cosine" if color else "constant"
    if weight_decay is None:
        weight_decay = COLOR_WEIGHT_DECAY if color else 0.0
    return Recipe(pad=pad, schedule=schedule, weight_decay=float(weight_decay))


def cosine_factor(step: int, steps: int) -> float:
    """The cosine schedule's share of the base learning rate at ``step`` of ``steps`` (1 -> 0)."""
    if steps <= 0:
        return 1.0
    return 0.5 * (1.0 + math.cos(math.pi * min(step, steps) / steps))


def crop_flip(x: torch.Tensor, pad: int, generator: torch.Generator) -> torch.Tensor:
    """A random ``H x W`` crop of each image of ``x`` (uint8 N x C x H x W) zero-padded by ``pad``
    pixels on every side, mirrored left-right with probability 1/2: a new uint8 batch on ``x``'s device.

    Offsets and flips are drawn on the CPU from ``generator`` (N crops of two offsets, then N flips), so
    the batch is a function of the images and the generator's state alone."""
    n, _, h, w = x.shape
    offsets = torch.randint(0, 2 * pad + 1, (n, 2), generator=generator)
    flips = torch.rand(n, generator=generator) < 0.5
    padded = torch.nn.functional.pad(x, (pad, pad, pad, pad))  # zeros: black borders
    rows = (offsets[:, :1] + torch.arange(h)).to(x.device)  # N x H
    cols = offsets[:, 1:] + torch.arange(w)  # N x W
    cols = torch.where(flips[:, None], cols.flip(1), cols).to(x.device)  # a flip reads columns backwards
    batch = torch.arange(n, device=x.device)[:, None, None]
    out = padded.permute(0, 2, 3, 1)[batch, rows[:, :, None], cols[:, None, :]]  # N x H x W x C
    return out.permute(0, 3, 1, 2).contiguous()
