"""TOML reading on every Python the toolkit runs on: the standard library's ``tomllib`` from 3.11, its
backport ``tomli`` (the same parser, declared under a ``python_version < '3.11'`` marker) on 3.10, the Python
of NVIDIA's PyTorch wheels for JetPack 6. The one place that knows which; stdlib only otherwise."""

from __future__ import annotations

import sys

if sys.version_info >= (3, 11):
    from tomllib import TOMLDecodeError, loads
else:
    from tomli import TOMLDecodeError, loads

__all__ = ["TOMLDecodeError", "loads"]
