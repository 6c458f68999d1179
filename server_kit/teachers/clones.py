"""One model uploaded under several names counts once.

Every check of a claim (:mod:`server_kit.labelling.trust`, :mod:`server_kit.labelling.decoder_trust`) and
the cost budget (:mod:`server_kit.teachers.budget`) compare an upload with the median of the others, which
holds while hostile uploads are a minority. Colluding devices that upload one model under several names
break that for free: identical copies agree perfectly with each other, and three of them can be the
majority of the holders of a class. Devices training on their own data never make the same weights, so
copies are evidence of nothing but the first: an upload whose weights (the ONNX initializers, by content,
whatever their names or order, and whatever the manifest around them) equal an earlier upload's of the
same kind is refused.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import onnx
from onnx import numpy_helper

from common.errors import BundleError

__all__ = ["weights_digest", "without_clones"]


def weights_digest(model_onnx: bytes) -> str:
    """sha256 over the sorted digests of every initializer's dtype, shape and values (names left out)."""
    model = onnx.load_model_from_string(model_onnx)
    parts = []
    for tensor in model.graph.initializer:
        array = numpy_helper.to_array(tensor)
        head = f"{array.dtype}|{array.shape}|".encode()
        parts.append(hashlib.sha256(head + array.tobytes()).hexdigest())
    return hashlib.sha256("".join(sorted(parts)).encode()).hexdigest()


def without_clones(
    uploads: Sequence[tuple[Path, Any]], *, on_error: str, skipped: list[tuple[str, str]]
) -> list[tuple[Path, Any]]:
    """The (name, Bundle) pairs with every later copy of an earlier one's weights (same kind) left out:
    refused with a BundleError (``on_error="stop"``) or appended to ``skipped`` with the reason."""
    first: dict[tuple[str, str], Path] = {}
    kept = []
    for path, bundle in uploads:
        key = (bundle.kind, weights_digest(bundle.model_onnx))
        if key in first:
            reason = (
                f"has the same weights as {first[key]}: one model uploaded under several names counts "
                "once; fix: upload each device's own model"
            )
            if on_error == "stop":
                raise BundleError(f"{path}: {reason}")
            skipped.append((str(path), reason))
            continue
        first[key] = path
        kept.append((path, bundle))
    return kept
