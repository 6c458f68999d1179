"""The toolkit's exception hierarchy.

It lives in ``common``, the lowest layer (stdlib only): ``profiles``, ``export``, ``edge_sdk`` and
``server_kit`` all import from here, so one ``except ToolkitError`` catches every failure the toolkit
raises on purpose. Each subclass also inherits the matching builtin so callers can catch ``ValueError``
or ``RuntimeError`` as they would for any library. Messages say what was expected, what was got, and
how to fix it.
"""

from __future__ import annotations


class ToolkitError(Exception):
    """Base class of every error the toolkit raises on purpose."""


class ConfigError(ToolkitError, ValueError):
    """A configuration value or command-line option is invalid."""


class ProfileError(ConfigError):
    """A device profile is malformed, incomplete or unknown."""


class DataError(ToolkitError, ValueError):
    """A dataset, data root or client data file is missing or malformed."""


class SpecError(ToolkitError, ValueError):
    """An architecture spec is malformed or invalid for the given input shape."""


class BudgetError(ToolkitError, ValueError):
    """A model (or every candidate of a search) exceeds the device budget."""


class ExportError(ToolkitError, RuntimeError):
    """An ONNX export failed validation or numeric parity."""


class BundleError(ToolkitError, ValueError):
    """A bundle (or another wire file) is corrupt, truncated or of an unsupported schema."""


class TeacherError(ToolkitError, ValueError):
    """A teacher model cannot be loaded or converted into a differentiable module."""


class ResourceError(ToolkitError, RuntimeError):
    """The device cannot host the toolkit itself: its memory is below what the process needs to run."""
