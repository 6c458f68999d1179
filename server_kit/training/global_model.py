"""The training phase: the global model from the labelled synthetic set, by consensus distillation
(then DENSE's adversarial rounds when asked) or by FedMHO (FedAvg or distillation to start, then fusion)."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from common.errors import ConfigError, DataError
from common.seeding import seeded
from common.timing import timed
from edge_sdk.data import deploy_metadata_for
from edge_sdk.models.arch import build_model, parse_arch, with_num_classes
from export.onnx_export import export_onnx
from server_kit.labelling import LabelConfig, Labels, mixture_labeller
from server_kit.synthesis import GeneratorConfig, Synthesis
from server_kit.teachers import Federation, Teacher
from server_kit.training.adversarial import AdversarialConfig, adversarial_distill
from server_kit.training.distill import DistillConfig, distill
from server_kit.training.fedavg import fedavg_init
from server_kit.training.fusion import FusionConfig, fuse

__all__ = ["Training", "TrainingConfig", "export_global", "train_global"]


@dataclass(frozen=True, kw_only=True)
class TrainingConfig:
    """The training phase's settings: the student's architecture and its distillation, the adversarial
    rounds (with the generator's and the vote's settings they reuse), FedMHO's fusion and FedAvg start,
    the hard-label ablation, the seed and precision."""

    student: str
    distill: DistillConfig
    adversarial: AdversarialConfig | None
    generator: GeneratorConfig
    labels: LabelConfig
    fusion: FusionConfig | None
    fedavg_init: bool
    hard_labels: bool
    seed: int
    precision: str


@dataclass(frozen=True)
class Training:
    """The trained global model and how it was made."""

    student: torch.nn.Module
    spec: str
    init: str
    distill_loss: list[float]
    fusion_loss: list[float]
    seconds: dict[str, float]
    adversarial: dict[str, list[float]] | None = None


def train_global(
    fed: Federation,
    synthesis: Synthesis,
    labels: Labels,
    config: TrainingConfig,
    *,
    teachers: Sequence[Teacher] = (),
    progress: bool = False,
) -> Training:
    """Distil the student on the kept labelled samples, then (``config.adversarial``) refine it in DENSE's
    rounds; with ``config.fusion`` (FedMHO) initialise it by FedAvg of the same-architecture ``teachers``
    when possible and fuse it on the decoder samples."""
    seconds: dict[str, float] = {}
    with timed(seconds, "distill"):
        student, spec, init, losses = _start(fed, synthesis, labels, config, teachers, progress)
    curves = None
    if config.adversarial is not None:
        if synthesis.generator is None:
            raise ConfigError("adversarial distillation needs the generator source's generator")
        with timed(seconds, "adversarial"):
            keep = labels.keep
            curves = adversarial_distill(
                student,
                copy.deepcopy(synthesis.generator),  # a phase leaves its inputs as they were
                fed.modules,
                synthesis.label_counts,
                synthesis.synthetic.x[keep],
                labels.targets[keep],
                config=config.adversarial,
                generator_config=config.generator,
                labels=config.labels,
                distill_config=config.distill,
                seed=config.seed,
                device=fed.device,
                progress=progress,
                precision=config.precision,
            )
    fusion_losses: list[float] = []
    if config.fusion is not None:
        decoder_part = synthesis.parts["decoder"]
        with timed(seconds, "fusion"):
            fusion_losses = fuse(
                student,
                decoder_part.x,
                decoder_part.target_class,
                config=config.fusion,
                teachers=fed.modules,
                label_counts=synthesis.label_counts,  # the counts synthesis trusted (verified when checked)
                decoder_counts=synthesis.decoders.label_counts if synthesis.decoders is not None else (),
                seed=config.seed,
                device=fed.device,
                progress=progress,
            )
    return Training(student.cpu().eval(), spec, init, losses, fusion_losses, seconds, curves)


def _start(
    fed: Federation,
    synthesis: Synthesis,
    labels: Labels,
    config: TrainingConfig,
    teachers: Sequence[Teacher],
    progress: bool,
) -> tuple[torch.nn.Module, str, str, list[float]]:
    """(student, spec, how it started, distillation losses): FedAvg of same-architecture classifiers
    under FedMHO (its Eq. 4), else the student distilled on the kept samples."""
    spec = str(with_num_classes(parse_arch(config.student), fed.num_classes))
    student = fedavg_init(list(teachers)) if config.fusion is not None and config.fedavg_init else None
    if student is not None:
        return student, teachers[0].bundle.arch, "fedavg", []
    keep = labels.keep
    if int(keep.sum()) < 2:
        raise DataError(
            f"only {int(keep.sum())} of {len(keep)} synthetic samples carry their target class's "
            "label; the teachers disagree with every source: keep them with drop_mismatch=False"
        )
    hard = config.hard_labels
    targets = synthesis.synthetic.target_class[keep] if hard else labels.targets[keep]
    with seeded(config.seed):  # weight init draws from the global RNG: scope and seed it
        student = build_model(spec, fed.input_shape, fed.num_classes)
    relabel = None
    # the mixtures are labelled by the same vote as the set
    if config.distill.mix:
        relabel = mixture_labeller(
            fed, synthesis, config.labels, tau=config.distill.tau, precision=config.precision
        )
    losses = distill(
        student,
        synthesis.synthetic.x[keep],
        targets,
        config=replace(config.distill, hard_labels=hard),
        seed=config.seed,
        device=fed.device,
        progress=progress,
        precision=config.precision,
        relabel=relabel,
    )
    return student, spec, "consensus-distillation", losses


def export_global(training: Training, fed: Federation, *, num_teachers: int, seed: int) -> bytes:
    """The trained global model as validated, parity-checked ONNX bytes, its metadata naming where it came
    from (the server, its teachers, its seed) and how to deploy it (the task's input and classes)."""
    metadata = {
        "arch": training.spec,
        "role": "global-student",
        "producer": "server-kit",
        "num_classes": str(fed.num_classes),
        "num_teachers": str(num_teachers),
        "seed": str(seed),
    } | deploy_metadata_for(fed.input_shape, fed.num_classes, fed.class_names)
    return export_onnx(training.student, fed.input_shape, metadata=metadata, seed=seed)
