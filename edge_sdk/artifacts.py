"""What a device writes: the trained-model file (ONNX with the arch and metrics in its metadata, so a final
training can be resumed or bundled later) and the upload bundles of a classifier or a CVAE decoder."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from common.errors import BudgetError, ConfigError
from edge_sdk import __version__
from edge_sdk.cvae import CVAE
from edge_sdk.data import deploy_metadata_for
from edge_sdk.models.arch import build_model
from edge_sdk.profiling import fits, profile_model
from export.atomic import atomic_write_bytes
from export.bundle import Bundle, write_bundle
from export.onnx_export import export_decoder_onnx, export_onnx, read_deploy, read_metadata
from export.weights import initializer_state_dict
from profiles import DeviceProfile

__all__ = [
    "TrainedCVAE",
    "TrainedModel",
    "bundle_cvae",
    "bundle_model",
    "decoder_bundle_path",
    "load_trained_model",
    "save_trained_model",
]


@dataclass(frozen=True)
class TrainedModel:
    """A trained model plus what the bundle needs to describe it."""

    module: torch.nn.Module
    arch: str
    num_classes: int
    input_shape: tuple[int, int, int]
    label_counts: tuple[int, ...]
    num_examples: int
    metrics: dict[str, Any]
    unknown_output: bool = False  # the module has num_classes + 1 outputs, the last "unknown"
    # per epoch, the training's mean loss ({"train_loss": ...}): the report's curve, never in the bundle
    history: tuple[dict[str, float], ...] = field(default=(), repr=False, compare=False)
    class_names: tuple[str, ...] | None = None  # of the data it learnt from; None: index names
    # the optimizer it was trained with, to go on training (the chosen finalist); never serialised
    optimizer: torch.optim.Optimizer | None = field(default=None, repr=False, compare=False)


@dataclass(frozen=True)
class TrainedCVAE:
    """A trained CVAE plus what its decoder bundle needs."""

    module: CVAE
    arch: str
    num_classes: int
    input_shape: tuple[int, int, int]
    label_counts: tuple[int, ...]
    num_examples: int
    latent_dim: int
    metrics: dict[str, Any]
    # per epoch, the training's loss and its recon and KL parts: the report's curve, never in the bundle
    history: tuple[dict[str, float], ...] = field(default=(), repr=False, compare=False)


def decoder_bundle_path(out: str | Path) -> Path:
    """Where the ``both`` role writes the decoder bundle: ``client.bundle`` -> ``client.decoder.bundle``."""
    return Path(out).with_suffix(".decoder.bundle")


def save_trained_model(trained: TrainedModel, path: str | Path) -> Path:
    """Write the trained model as a BN-preserving ONNX file with everything `bundle_model` needs.

    ONNX is the SDK's model file: it cannot execute code, the server reads it, and the weights can be
    reloaded exactly (initializer names equal state_dict keys).
    """
    meta = {
        "arch": trained.arch,
        "num_classes": str(trained.num_classes),
        "input_shape": json.dumps(list(trained.input_shape)),
        "label_counts": json.dumps(list(trained.label_counts)),
        "num_examples": str(trained.num_examples),
        "metrics": json.dumps(trained.metrics, sort_keys=True),
        "unknown_output": json.dumps(trained.unknown_output),
        "sdk_version": __version__,
        "producer": "edge_sdk.train",
    } | _deploy_metadata(trained)
    data = export_onnx(trained.module, trained.input_shape, metadata=meta)
    return atomic_write_bytes(path, data)


def load_trained_model(path: str | Path) -> tuple[TrainedModel, bytes]:
    """Inverse of `save_trained_model`: rebuild the module from its arch and load the ONNX weights."""
    data = Path(path).read_bytes()
    meta = read_metadata(data)
    try:
        arch = meta["arch"]
        num_classes = int(meta["num_classes"])
        input_shape = tuple(json.loads(meta["input_shape"]))
        label_counts = tuple(json.loads(meta["label_counts"]))
        num_examples = int(meta["num_examples"])
        metrics = json.loads(meta["metrics"])
        unknown_output = json.loads(meta.get("unknown_output", "false"))  # absent before FedOV
        if not isinstance(unknown_output, bool):
            raise ValueError(f"unknown_output must be true or false, got {unknown_output!r}")
    except (KeyError, ValueError) as err:
        raise ConfigError(
            f"{path} is not a model written by `edge-sdk train` (missing metadata {err}); "
            "train it with the SDK"
        ) from err
    deploy = read_deploy(
        data, num_logits=num_classes + int(unknown_output), source=str(path), error=ConfigError
    )
    module = build_model(arch, input_shape, num_classes + int(unknown_output))  # type: ignore[arg-type]
    module.load_state_dict(initializer_state_dict(data, module), strict=True)
    trained = TrainedModel(
        module=module.eval(),
        arch=arch,
        num_classes=num_classes,
        input_shape=input_shape,  # type: ignore[arg-type]
        label_counts=label_counts,
        num_examples=num_examples,
        metrics=metrics,
        unknown_output=unknown_output,
        class_names=None if deploy is None else deploy.class_names[:num_classes],
    )
    return trained, data


def bundle_model(
    trained: TrainedModel,
    profile: DeviceProfile,
    out: str | Path,
    *,
    seed: int,
    onnx_bytes: bytes | None = None,
    extra_metrics: dict[str, Any] | None = None,
) -> Bundle:
    """Check the budget once more, export (unless given the ONNX), and write the bundle atomically."""
    cost = profile_model(trained.module, trained.input_shape)
    problem = fits(cost, profile)
    if problem is not None:
        raise BudgetError(f"trained model {trained.arch} does not fit the device: {problem}")
    if onnx_bytes is None:
        onnx_bytes = export_onnx(
            trained.module,
            trained.input_shape,
            metadata={"arch": trained.arch, "sdk_version": __version__, "producer": "edge_sdk.client"}
            | _deploy_metadata(trained),
        )
    metrics = dict(trained.metrics) | dict(extra_metrics or {})
    bundle = Bundle(
        kind="classifier",
        model_onnx=onnx_bytes,
        arch=trained.arch,
        num_classes=trained.num_classes,
        input_shape=trained.input_shape,
        label_counts=trained.label_counts,
        num_examples=trained.num_examples,
        profile=_profile_summary(profile),
        metrics=metrics,
        seed=seed,
        sdk_version=__version__,
        unknown_output=trained.unknown_output,
    )
    write_bundle(bundle, out)
    return bundle


def _deploy_metadata(trained: TrainedModel) -> dict[str, str]:
    return deploy_metadata_for(
        trained.input_shape, trained.num_classes, trained.class_names, unknown_output=trained.unknown_output
    )


def _profile_summary(profile: DeviceProfile) -> dict[str, Any]:
    return {
        "name": profile.name,
        "max_flops": profile.max_flops,
        "max_params": profile.max_params,
        "memory_mb": profile.memory_mb,
        "gflops": profile.gflops,
        "role": profile.role,
    }


def bundle_cvae(trained: TrainedCVAE, profile: DeviceProfile, out: str | Path, *, seed: int) -> Bundle:
    """Export the decoder alone (validated, parity-checked) and write a ``cvae_decoder`` bundle atomically."""
    onnx_bytes = export_decoder_onnx(
        trained.module.decoder,
        latent_dim=trained.latent_dim,
        num_classes=trained.num_classes,
        output_shape=trained.input_shape,
        metadata={"arch": trained.arch, "sdk_version": __version__, "producer": "edge_sdk.client"},
    )
    bundle = Bundle(
        kind="cvae_decoder",
        model_onnx=onnx_bytes,
        arch=trained.arch,
        num_classes=trained.num_classes,
        input_shape=trained.input_shape,
        label_counts=trained.label_counts,
        num_examples=trained.num_examples,
        latent_dim=trained.latent_dim,
        profile=_profile_summary(profile),
        metrics=trained.metrics,
        seed=seed,
        sdk_version=__version__,
    )
    write_bundle(bundle, out)
    return bundle
