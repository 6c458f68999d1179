"""Honest seed files, one per file kind, built in seconds from seeded random weights and data.

Every mutant starts from one of these, so a seed must itself be accepted by its consumer: the runner
calibrates the memory cap on it and fails loudly if it is refused. Sizes are tiny (1 x 8 x 8 inputs, 10
classes) so hundreds of cases fit in CI; the file formats are the real ones, written by the public writers.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from edge_sdk.cvae import build_cvae
from edge_sdk.data import ArrayDataset, save_client_data
from edge_sdk.models.arch import build_model
from edge_sdk.models.elastic.supernet import SuperNet
from edge_sdk.models.elastic.supernet_file import save_supernet
from export.bundle import Bundle, write_bundle
from export.onnx_export import export_decoder_onnx, export_onnx
from export.package import Package, write_package
from export.weights_file import write_weights_file
from tests.fuzz.hostile import HOSTILE_KINDS, build_hostile_seeds

WIRE_KINDS = ("classifier", "decoder", "package", "supernet", "weights")  # msgpack maps with a sha256
KINDS = (*WIRE_KINDS, *HOSTILE_KINDS)
SHAPE = (1, 8, 8)
NUM_CLASSES = 10
LATENT_DIM = 3
ARCH = "C4k3-P-F10"
WEIGHTS_KIND = "fuzz-weights"  # the generic weights-file reader's ``kind`` for the plain weights seed
LABEL_COUNTS = (5, 3, 0, 4, 2, 6, 1, 3, 2, 4)


@dataclass(frozen=True)
class Seeds:
    """Paths of the honest files (``root`` holds them); ``own_bundle`` is the device's upload that the
    package was made for, and ``data`` its local training set (``.npz``) for the personalize path."""

    root: Path
    files: dict[str, Path]
    own_bundle: Path
    data: Path


def _model(seed: int) -> torch.nn.Module:
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return build_model(ARCH, SHAPE, NUM_CLASSES).eval()


def _classifier_bundle(model_onnx: bytes, seed: int) -> Bundle:
    return Bundle(
        kind="classifier",
        model_onnx=model_onnx,
        arch=ARCH,
        num_classes=NUM_CLASSES,
        input_shape=SHAPE,
        label_counts=LABEL_COUNTS,
        num_examples=sum(LABEL_COUNTS),
        profile={"name": "fuzz-device", "memory_mb": 64},
        metrics={"val_accuracy": 0.5, "flops": 1000},
        seed=seed,
        sdk_version="0.1.0",
    )


def build_seeds(root: str | Path) -> Seeds:
    """Write the five honest seed files (plus the device's own bundle and data) under ``root``."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    files: dict[str, Path] = {}
    own_onnx = export_onnx(_model(0), SHAPE)
    own_bundle = write_bundle(_classifier_bundle(own_onnx, 0), root / "own.bundle")
    files["classifier"] = write_bundle(
        _classifier_bundle(export_onnx(_model(1), SHAPE), 1), root / "c.bundle"
    )

    with torch.random.fork_rng():
        torch.manual_seed(2)
        cvae = build_cvae("cvae-small", SHAPE, NUM_CLASSES, LATENT_DIM).eval()
    decoder_onnx = export_decoder_onnx(
        cvae.decoder, latent_dim=LATENT_DIM, num_classes=NUM_CLASSES, output_shape=SHAPE
    )
    decoder = Bundle(
        kind="cvae_decoder",
        model_onnx=decoder_onnx,
        arch=cvae.arch,
        num_classes=NUM_CLASSES,
        input_shape=SHAPE,
        label_counts=LABEL_COUNTS,
        num_examples=sum(LABEL_COUNTS),
        profile={"name": "fuzz-device"},
        metrics={"val_loss": 1.0},
        seed=2,
        sdk_version="0.1.0",
        latent_dim=LATENT_DIM,
    )
    files["decoder"] = write_bundle(decoder, root / "d.bundle")

    rng = np.random.default_rng(3)
    package = Package(
        client="client_00",
        client_sha256=hashlib.sha256(own_onnx).hexdigest(),
        global_onnx=export_onnx(_model(3), SHAPE),
        global_arch=ARCH,
        num_classes=NUM_CLASSES,
        input_shape=SHAPE,
        inputs=rng.integers(0, 256, (16, *SHAPE), dtype=np.uint8),
        knowledge=rng.standard_normal((16, NUM_CLASSES)).astype(np.float32),
        generator_onnx=decoder_onnx,  # inputs z and y: what the kdg path runs with onnxruntime
        knobs={"mu": 0.5, "epochs": 1},
        seed=3,
    )
    files["package"] = write_package(package, root / "p.package")

    with torch.random.fork_rng():
        torch.manual_seed(4)
        supernet = SuperNet(SHAPE, NUM_CLASSES).eval()
    files["supernet"] = save_supernet(supernet, root / "s.supernet")

    gen = torch.Generator().manual_seed(5)
    tensors = {
        "a.weight": torch.randn(8, 4, generator=gen),
        "b.bias": torch.randn(8, generator=gen).double(),
        "c.index": torch.arange(6, dtype=torch.int64),
    }
    manifest = {"input_shape": list(SHAPE), "num_classes": NUM_CLASSES, "note": "fuzz seed"}
    files["weights"] = write_weights_file(root / "w.weights", tensors, kind=WEIGHTS_KIND, manifest=manifest)

    y = torch.arange(40) % NUM_CLASSES
    x = torch.randint(0, 256, (40, *SHAPE), dtype=torch.uint8, generator=gen)
    data = save_client_data(root / "data.npz", ArrayDataset(x, y, NUM_CLASSES))
    files.update(build_hostile_seeds(root))
    return Seeds(root=root, files=files, own_bundle=own_bundle, data=data)
