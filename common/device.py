"""The one device resolver: every ``device`` option of the toolkit becomes a ``torch.device`` here.

A config says ``auto``, ``cpu``, ``cuda`` or ``cuda:N``; asking for CUDA on a machine without it fails at
once with the fix, instead of deep in a training loop with torch's own message.
"""

from __future__ import annotations

import torch

from common.errors import ConfigError

__all__ = ["check_device", "resolve_device"]

_NAMES = "cpu, cuda, cuda:N or auto"


def check_device(name: object) -> str:
    """``name`` if it is a device this machine has (``auto``, ``cpu``, ``cuda``, ``cuda:N``), else the
    one-line refusal: what configs call when they are built, so a run is refused before any work."""
    text = name if isinstance(name, str) else None
    if text is None or not (text in ("auto", "cpu", "cuda") or text.removeprefix("cuda:").isdigit()):
        raise ConfigError(f"device must be {_NAMES}, got {name!r}")
    if text.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"device {text!r} asked for, but CUDA is not available; use device cpu or auto")
    return text


def resolve_device(name: str | torch.device) -> torch.device:
    """``auto`` -> CUDA when available, else CPU; any other name as given, CUDA refused where it is absent."""
    if isinstance(name, torch.device):  # resolved once already: CUDA still checked (a device handed on)
        if name.type == "cuda":
            check_device(str(name))
        return name
    if check_device(name) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)
