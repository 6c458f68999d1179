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
    """``name`` if it names a device (``auto``, ``cpu``, ``cuda``, ``cuda:N``), else the one-line refusal:
    what a config checks when it is built. Whether this machine has the device is :func:`resolve_device`'s
    to say where the config runs (a Flower server plans its clients' CUDA without a GPU of its own)."""
    text = name if isinstance(name, str) else None
    if text is None or not (text in ("auto", "cpu", "cuda") or text.removeprefix("cuda:").isdigit()):
        raise ConfigError(f"device must be {_NAMES}, got {name!r}")
    return text


def resolve_device(name: str | torch.device) -> torch.device:
    """``auto`` -> CUDA when available, else CPU; any other name as given, CUDA refused where it is absent
    (a run calls it before any work, so a missing GPU is one line, not a partition later)."""
    text = str(name) if isinstance(name, torch.device) else check_device(name)
    if text == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if text.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"device {text!r} asked for, but CUDA is not available; use device cpu or auto")
    return name if isinstance(name, torch.device) else torch.device(text)
