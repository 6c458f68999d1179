"""Shared initial weights: the server publishes one architecture's seeded weights, every device starts there.

Averaging the parameters of independently initialised networks averages unrelated features: FedAvg
(FedMHO Eq. 4, the global model's initialisation) needs every classifier to start from the same weights,
which a real one-shot deployment gets by sending them before local training. This module is both ends of
that message:

* the server writes it (:func:`initial_weights`, ``server-kit init``): ``build_model(arch)`` under a
  seed, exported as a BN-preserving ONNX whose initializer names are the state-dict keys, with metadata
  ``role=initial-weights``, ``arch``, ``num_classes``, ``input_shape`` and ``seed``;
* the device reads it (:func:`read_initial_weights`, ``edge-sdk run --init``) for its own task: the bytes
  are bounded and held to the ONNX load contract against the device's input shape and class count
  *before* anything is rebuilt, the arch string is parsed, the model rebuilt and the weights loaded
  strictly by name, so a file whose weights do not fit its arch is refused.

The device then trains exactly that architecture (no search: the architecture is the server's), after
checking it against its profile's budget (``edge_sdk.client``).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from torch import nn

from common.checks import check_input_shape, check_int, load_json, read_regular_file
from common.errors import BundleError, ConfigError, ExportError, SpecError
from common.seeding import seeded
from edge_sdk import __version__
from edge_sdk.models.arch import build_model, parse_arch, with_num_classes
from export.atomic import atomic_write_bytes
from export.onnx_check import check_classifier_onnx
from export.onnx_export import export_onnx, read_metadata
from export.weights import initializer_state_dict
from export.wire import MAX_INPUT_CHANNELS, MAX_INPUT_ELEMENTS

__all__ = ["INIT_ROLE", "MAX_INIT_BYTES", "InitialWeights", "initial_weights", "read_initial_weights"]

INIT_ROLE = "initial-weights"  # ONNX metadata role of the file
MAX_INIT_BYTES = 256 << 20  # a classifier's weights; anything larger is refused before parsing


@dataclass(frozen=True)
class InitialWeights:
    """A read initialisation: the architecture (head sized to the task), the module holding the weights
    (float32, train mode), the seed the server drew them with and the file's sha256."""

    arch: str
    module: nn.Module
    seed: int
    sha256: str


def _shape(input_shape: object) -> tuple[int, int, int]:
    return check_input_shape(
        "input_shape", input_shape, max_channels=MAX_INPUT_CHANNELS, max_elements=MAX_INPUT_ELEMENTS
    )


def _task_arch(arch: str, num_classes: int) -> str:
    return str(with_num_classes(parse_arch(arch), num_classes))


def initial_weights(arch: str, input_shape: tuple[int, int, int], num_classes: int, *, seed: int) -> bytes:
    """The file a server publishes: ``arch`` (a chain's head resized to ``num_classes``) built with
    weights drawn from ``seed`` (the caller's RNG untouched), as validated ONNX bytes. Same arguments,
    same bytes."""
    shape = _shape(input_shape)
    check_int("num_classes", num_classes, 2)
    check_int("seed", seed, 0)
    try:
        spec = _task_arch(arch, num_classes)
        with seeded(seed):
            module = build_model(spec, shape, num_classes)
    except SpecError as err:
        raise ConfigError(f"cannot build initial weights for {arch!r}: {err}") from err
    metadata = {
        "role": INIT_ROLE,
        "arch": spec,
        "num_classes": str(num_classes),
        "seed": str(seed),
        "sdk_version": __version__,
        "producer": "server-kit init",
    }
    return export_onnx(module.eval(), shape, metadata=metadata, seed=seed)


def write_initial_weights(
    path: str | Path, arch: str, input_shape: tuple[int, int, int], num_classes: int, *, seed: int
) -> Path:
    """:func:`initial_weights` written atomically to ``path``."""
    return atomic_write_bytes(path, initial_weights(arch, input_shape, num_classes, seed=seed))


def read_initial_weights(
    source: str | Path | bytes, *, input_shape: tuple[int, int, int], num_classes: int
) -> InitialWeights:
    """The initialisation in ``source`` (a path or the bytes) for a task of ``num_classes`` classes of
    ``input_shape``; ConfigError when it is not an initial-weights file for that task, ExportError /
    BundleError when its ONNX breaks the load contract or its weights do not fit its arch."""
    shape = _shape(input_shape)
    name = "<bytes>" if isinstance(source, bytes | bytearray) else str(source)
    if isinstance(source, bytes | bytearray):
        data = bytes(source)
    else:
        data = read_regular_file(source, max_bytes=MAX_INIT_BYTES, what="initial-weights file")
    if len(data) > MAX_INIT_BYTES:
        raise ConfigError(f"{name} is {len(data)} bytes, an initial-weights file is at most {MAX_INIT_BYTES}")
    # the contract first, against this device's task: nothing of a file that fails it is rebuilt
    check_classifier_onnx(data, input_shape=shape, num_classes=num_classes, source=name, error=ExportError)
    meta = read_metadata(data)
    if meta.get("role") != INIT_ROLE:
        raise ConfigError(
            f"{name} is not an initial-weights file (metadata role {meta.get('role')!r}, expected "
            f"{INIT_ROLE!r}); fix: write one with `server-kit init`"
        )
    try:
        declared = load_json(meta.get("input_shape", "null"), f"{name}: input_shape", error=ConfigError)
        seed = check_int("seed", load_json(meta.get("seed", ""), "seed", error=ConfigError), 0, 2**64 - 1)
        arch = _task_arch(meta.get("arch", ""), num_classes)
    except (ValueError, SpecError) as err:
        raise ConfigError(f"{name}: unreadable initial-weights metadata ({err}); rewrite it") from err
    if declared != list(shape):
        raise ConfigError(f"{name} is for inputs {declared}, this task's are {list(shape)}")
    if arch != meta.get("arch"):
        raise ConfigError(
            f"{name} holds {meta.get('arch')!r} weights, this task needs the {num_classes}-class head "
            f"{arch!r}; fix: `server-kit init` with --num-classes {num_classes}"
        )
    try:
        module = build_model(arch, shape, num_classes)
        module.load_state_dict(initializer_state_dict(data, module, source=name), strict=True)
    except (SpecError, BundleError, RuntimeError) as err:
        raise ConfigError(f"{name}: the weights do not fit arch {arch!r}: {err}") from err
    return InitialWeights(
        arch=arch, module=module.train(), seed=seed, sha256=hashlib.sha256(data).hexdigest()
    )
