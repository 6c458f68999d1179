"""The one device resolver: every ``device`` option of the toolkit becomes a ``torch.device`` here.

A config says ``auto``, ``cpu``, ``cuda`` or ``cuda:N``; asking for CUDA on a machine without it fails at
once with the fix, instead of deep in a training loop with torch's own message.
"""

from __future__ import annotations

import torch

from common.errors import ConfigError

__all__ = ["resolve_device"]


def resolve_device(name: str | torch.device) -> torch.device:
    """``auto`` -> CUDA when available, else CPU; any other name as given, CUDA refused where it is absent."""
    if str(name) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as err:  # torch's own message lists every backend; ours says what to give
        raise ConfigError(f"device must be cpu, cuda, cuda:N or auto, got {str(name)!r}") from err
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            f"device {str(name)!r} asked for, but CUDA is not available; use device cpu or auto"
        )
    return device
