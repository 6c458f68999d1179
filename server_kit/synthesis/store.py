"""The distillation set on disk: ``synthetic.npz`` in the server's output folder, kept so that
personalization (``server-kit personalize``, the supernet) trains on the very samples the global model saw."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import torch

from common.errors import DataError
from export.atomic import atomic_write_bytes
from server_kit.synthesis.inversion import SyntheticSet

__all__ = ["SYNTHETIC_FILE", "load_synthetic", "save_synthetic"]

SYNTHETIC_FILE = "synthetic.npz"  # the distillation set, kept for personalization (server-kit personalize)


def save_synthetic(path: Path, synthetic: SyntheticSet) -> Path:
    """Write the synthetic set as uint8 images (what a package ships) plus its provenance columns."""
    buf = io.BytesIO()
    np.savez_compressed(
        buf,
        x=(synthetic.x.clamp(0, 1) * 255).round().to(torch.uint8).numpy(),
        teacher=synthetic.teacher.numpy(),
        target_class=synthetic.target_class.numpy(),
    )
    return atomic_write_bytes(path, buf.getvalue())


def load_synthetic(path: str | Path) -> SyntheticSet:
    """Inverse of :func:`save_synthetic`; images come back as float32 in [0, 1] (multiples of 1/255)."""
    try:
        with np.load(Path(path)) as data:
            x, teacher, target = data["x"], data["teacher"], data["target_class"]
    except (OSError, KeyError, ValueError) as err:
        raise DataError(
            f"{path} is not a synthetic set written by server-kit aggregate ({err}); rerun aggregate"
        ) from err
    if x.dtype != np.uint8 or x.ndim != 4 or not len(x) == len(teacher) == len(target):
        raise DataError(f"{path}: expected uint8 N x C x H x W images with N labels, got {x.dtype} {x.shape}")
    return SyntheticSet(
        x=torch.from_numpy(x).float().div_(255.0),
        teacher=torch.from_numpy(teacher).long(),
        target_class=torch.from_numpy(target).long(),
    )
