"""The federation the server phases share: the usable teachers, what each claims it was trained on, the
decoder bundles, the task's shape and the one device the run resolved (every phase computes there)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from common.errors import TeacherError, ToolkitError
from export.bundle import Bundle
from server_kit.teachers.loading import Teacher, declared_class_names

__all__ = ["Federation", "charge", "probe_teacher", "split_kinds", "usable_teachers"]


@dataclass(frozen=True)
class Federation:
    """What every server phase needs to know about the uploads: the teachers (frozen modules) and what
    each says it was trained on, the CVAE decoder bundles, the task's shape, and where to compute."""

    modules: list[torch.nn.Module]
    label_counts: list[list[int]]
    num_classes: int
    input_shape: tuple[int, int, int]
    device: torch.device
    decoders: list[tuple[Path, Any]] = field(default_factory=list)
    class_names: tuple[str, ...] | None = None  # what the teachers agree on; None: index names

    @classmethod
    def from_teachers(
        cls, teachers: Sequence[Teacher], device: torch.device, decoders: list[tuple[Path, Any]] | None = None
    ) -> Federation:
        first = teachers[0].bundle
        return cls(
            modules=[t.module for t in teachers],
            label_counts=[list(t.bundle.label_counts) for t in teachers],
            num_classes=first.num_classes,
            input_shape=tuple(first.input_shape),  # type: ignore[arg-type]
            device=device,
            decoders=list(decoders or []),
            class_names=declared_class_names([t.bundle for t in teachers]),
        )


def split_kinds(
    bundles: Sequence[tuple[Path, Bundle]],
) -> tuple[list[tuple[Path, Bundle]], list[tuple[Path, Any]]]:
    """The (name, Bundle) pairs of the classifiers (teachers) and of the cvae_decoder bundles, in order."""
    classifiers = [(path, bundle) for path, bundle in bundles if bundle.kind != "cvae_decoder"]
    decoders = [(path, bundle) for path, bundle in bundles if bundle.kind == "cvae_decoder"]
    return classifiers, decoders


def charge(on_error: str, skipped: list[tuple[str, str]], path: object, err: ToolkitError) -> None:
    """A bundle's failure: raised with ``on_error="stop"``, else appended to ``skipped`` as (file, reason)."""
    if on_error == "stop":
        raise err
    skipped.append((str(path), str(err)))


def usable_teachers(
    teachers: list[Teacher], *, on_error: str, seed: int, device: torch.device, skipped: list[tuple[str, str]]
) -> list[Teacher]:
    """The teachers this run can use, each tried once on a seeded probe before any phase runs.

    Loading checks a teacher against onnxruntime, not against its manifest: an ONNX with 11 outputs under
    ``num_classes`` 10 loads, then breaks the labels minutes later. Here every failure is charged to its
    bundle (:func:`charge`)."""
    shape, classes = tuple(teachers[0].bundle.input_shape), teachers[0].bundle.num_classes
    probe = torch.rand((2, *shape), generator=torch.Generator().manual_seed(seed))
    usable = []
    for teacher in teachers:
        try:
            probe_teacher(teacher.module, probe, classes, device)
        except TeacherError as err:
            charge(on_error, skipped, teacher.path, TeacherError(f"{teacher.path}: {err}"))
            continue
        usable.append(teacher)
    if not usable:
        reasons = "; ".join(reason for _, reason in skipped)
        raise TeacherError(f"no usable teacher is left: {reasons}")
    return usable


def probe_teacher(module: torch.nn.Module, x: Tensor, num_classes: int, device: torch.device) -> None:
    """TeacherError unless ``module`` maps ``x`` (B x C x H x W) to finite B x ``num_classes`` logits and
    passes a gradient back to its input (what inversion and the generator need)."""
    x = x.to(device).requires_grad_(True)
    try:
        logits = module(x)
        if tuple(logits.shape) != (len(x), num_classes):
            raise TeacherError(
                f"outputs shape {tuple(logits.shape)} on a batch of {len(x)}, but its manifest says "
                f"num_classes {num_classes}; fix: export the classifier with a {num_classes}-class head"
            )
        if not bool(torch.isfinite(logits).all()):
            raise TeacherError("outputs non-finite logits on inputs in [0, 1]; the model is broken")
        logits.float().sum().backward()
    except RuntimeError as err:  # torch's shape and dtype errors
        raise TeacherError(f"fails on a batch shaped {tuple(x.shape)}: {err}") from err
    if x.grad is None or not bool(torch.isfinite(x.grad).all()):
        raise TeacherError("passes no finite gradient to its input, which inversion needs")
