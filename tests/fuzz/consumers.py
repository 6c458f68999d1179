"""The real consumers the fuzz runner feeds each mutant to: every reader of a file that arrives from
elsewhere, then the first use the toolkit makes of what it read.

Each consumer takes (case file, the honest seeds, the case's work dir) and returns the bytes it produced
(weights, outputs, written files), which the runner scans for the planted secret. A consumer must raise
ToolkitError for a file it refuses; anything else it raises is a crash the runner reports.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from edge_sdk.data import load_client_data
from edge_sdk.models.elastic.spec import smallest
from edge_sdk.models.elastic.supernet import extract
from edge_sdk.models.elastic.supernet_file import load_supernet
from edge_sdk.personalize import PersonalizeConfig, personalize
from export.bundle import read_bundle
from export.package import read_package
from export.weights_file import read_weights_file
from server_kit.labelling.labels import teacher_probs
from server_kit.synthesis.decoders import load_decoder, sample_decoders
from server_kit.teachers.counts import held_classes
from server_kit.teachers.loading import load_teachers
from tests.fuzz import seeds as seeds_module
from tests.fuzz.hostile import hostile_consumers

__all__ = ["CONSUMERS", "Consumer"]

Consumer = Callable[[Path, seeds_module.Seeds, Path], list[bytes]]


def _state_bytes(module: torch.nn.Module) -> list[bytes]:
    return [t.detach().cpu().contiguous().numpy().tobytes() for t in module.state_dict().values()]


def consume_classifier(path: Path, seeds: seeds_module.Seeds, _: Path) -> list[bytes]:
    """load_teachers, then the server's first use of a teacher: softmax over the held classes."""
    teachers, _skipped = load_teachers([path], on_error="stop")
    teacher = teachers[0]
    x = torch.rand((4, *teacher.bundle.input_shape), generator=torch.Generator().manual_seed(0))
    probs = teacher_probs(
        teacher.module, x, tau=1.0, held=held_classes([list(teacher.bundle.label_counts)])[0]
    )
    return [*_state_bytes(teacher.module), probs.numpy().tobytes()]


def consume_decoder(path: Path, seeds: seeds_module.Seeds, _: Path) -> list[bytes]:
    """load_decoder, then a small synthetic draw as FedMHO's server makes it."""
    bundle = read_bundle(path)
    decoder = load_decoder(path)
    x, _y = sample_decoders(
        [decoder], [list(bundle.label_counts)], total=16, num_classes=bundle.num_classes, seed=0
    )
    return [*_state_bytes(decoder), x.numpy().tobytes()]


def consume_package(path: Path, seeds: seeds_module.Seeds, workdir: Path) -> list[bytes]:
    """The device: read the package, then personalize with kdg (runs the package's generator in
    onnxruntime and loads its global model), one tiny epoch."""
    package = read_package(path)
    config = PersonalizeConfig(
        method="kdg",
        kdg_terms=("pre", "tea"),
        train_epochs=1,
        batch_size=16,
        calibration_size=8,
        local_generator_steps=0,
    )
    data = load_client_data(seeds.data)
    result = personalize(data, read_bundle(seeds.own_bundle), package, workdir / "out", config=config)
    return [result.deploy_onnx.read_bytes()]


def consume_supernet(path: Path, seeds: seeds_module.Seeds, _: Path) -> list[bytes]:
    """load_supernet, then what a HAPFNAS client does: extract a subnet and run it on its own data."""
    supernet = load_supernet(path)
    net = extract(supernet, smallest()).eval()
    with torch.no_grad():
        out = net(torch.zeros(2, *seeds_module.SHAPE))
    return [*_state_bytes(supernet), out.numpy().tobytes()]


def consume_weights(path: Path, seeds: seeds_module.Seeds, _: Path) -> list[bytes]:
    tensors, _manifest = read_weights_file(path, kind=seeds_module.WEIGHTS_KIND)
    return [t.contiguous().numpy().tobytes() for t in tensors.values()]


CONSUMERS: dict[str, Consumer] = {
    "classifier": consume_classifier,
    "decoder": consume_decoder,
    "package": consume_package,
    "supernet": consume_supernet,
    "weights": consume_weights,
    **hostile_consumers(),
}
