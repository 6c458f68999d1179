"""The supernet file: a :class:`~.supernet.SuperNet`'s weights in :mod:`export.weights_file`'s code-free
format (safetensors in a validated manifest, never a pickle), tied to the :data:`~.spec.SPACE` it was
trained for.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from common.checks import check_input_shape, check_int
from common.errors import BundleError
from edge_sdk.models.elastic.spec import SPACE
from edge_sdk.models.elastic.supernet import SuperNet
from export.weights_file import read_weights_file, write_weights_file
from export.wire import MAX_CLASSES, MAX_INPUT_CHANNELS, MAX_INPUT_ELEMENTS

__all__ = ["load_supernet", "save_supernet"]


SUPERNET_KIND = "elastic-supernet"


def save_supernet(supernet: SuperNet, path: str | Path, *, provenance: dict[str, Any] | None = None) -> Path:
    """Write the supernet's weights (safetensors in a validated manifest; never a pickle)."""
    manifest = {
        "space": repr(SPACE),
        "input_shape": list(supernet.input_shape),
        "num_classes": supernet.num_classes,
        **(provenance or {}),
    }
    return write_weights_file(path, supernet.max.state_dict(), kind=SUPERNET_KIND, manifest=manifest)


def load_supernet(path: str | Path) -> SuperNet:
    """Read a file written by :func:`save_supernet`; refuses another search space or a tampered file."""
    tensors, manifest = read_weights_file(path, kind=SUPERNET_KIND)
    if manifest.get("space") != repr(SPACE):
        raise BundleError(f"{path} was trained for another elastic search space; retrain it with this SDK")
    try:  # bounded before the supernet's weights are allocated from them (bounds: export.wire)
        shape = check_input_shape(
            "input_shape",
            manifest.get("input_shape"),
            max_channels=MAX_INPUT_CHANNELS,
            max_elements=MAX_INPUT_ELEMENTS,
            error=BundleError,
        )
        classes = check_int("num_classes", manifest.get("num_classes"), 1, MAX_CLASSES, error=BundleError)
    except BundleError as err:
        raise BundleError(
            f"{path}: manifest {err}; write the supernet again with server-kit supernet"
        ) from err
    supernet = SuperNet(shape, classes)
    try:
        supernet.max.load_state_dict(tensors, strict=True)
    except RuntimeError as err:
        raise BundleError(f"{path}: weights do not fit the supernet: {err}") from err
    return supernet.eval()
