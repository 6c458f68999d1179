"""More views of the synthetic images: each image also as its mirror, a new sample the teachers label like
any other.

A synthetic set made by optimisation is small; a student that sees each image in one pose learns its
exact pixels. A mirrored natural image is still of its class, but its soft target is not the original's
(the teachers answer differently), so the mirror is added *before* the vote, labelled by the teachers on
what it shows: that is what separates this from flipping images during distillation
(``DistillConfig.flip``), whose targets were computed on the unmoved images.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Literal, get_args

import torch

from common.errors import ConfigError
from server_kit.synthesis.inversion import SyntheticSet
from server_kit.synthesis.sources import Synthesis

__all__ = ["VIEWS", "Views", "check_views", "with_views"]

Views = Literal["none", "flip"]
VIEWS: tuple[str, ...] = get_args(Views)


def check_views(views: object, *, allow_auto: bool = False) -> None:
    """``views`` is one of :data:`VIEWS` (or ``auto`` where the caller decides it later)."""
    valid = ("auto", *VIEWS) if allow_auto else VIEWS
    if views not in valid:
        raise ConfigError(f"views must be one of {valid}, got {views!r}")


def with_views(synthesis: Synthesis, views: str) -> Synthesis:
    """``synthesis`` with every part followed by its mirror images (``flip``), or unchanged (``none``).

    Each part grows on its own, so the pooled set stays the parts in ``SOURCES`` order (what the vote's
    construction labels and the top-up index by); a mirror keeps its image's teacher and target class.
    """
    check_views(views)
    if views == "none":
        return synthesis
    parts = {name: _mirrored(part) for name, part in synthesis.parts.items()}
    pooled = SyntheticSet(
        x=torch.cat([p.x for p in parts.values()]),
        teacher=torch.cat([p.teacher for p in parts.values()]),
        target_class=torch.cat([p.target_class for p in parts.values()]),
    )
    report = synthesis.report | {"synthetic_sources": {name: len(p) for name, p in parts.items()}}
    return replace(synthesis, synthetic=pooled, parts=parts, report=report)


def _mirrored(part: SyntheticSet) -> SyntheticSet:
    """The part, then each of its images mirrored left-right."""
    return SyntheticSet(
        x=torch.cat([part.x, part.x.flip(3)]),
        teacher=part.teacher.repeat(2),
        target_class=part.target_class.repeat(2),
    )
