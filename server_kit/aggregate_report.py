"""The record of a server run (``report.json``): what ran, on which uploads, what each phase made and
how the written global model scored; :func:`server_kit.aggregate.aggregate` adds the timings and the
output names."""

from __future__ import annotations

from typing import Any

import torch

from common.checks import is_number
from server_kit.aggregate_config import AggregateConfig
from server_kit.labelling import Labels
from server_kit.synthesis import Synthesis
from server_kit.teachers import Federation, Teacher
from server_kit.training import Training

__all__ = ["run_report", "teacher_entry"]


def run_report(
    config: AggregateConfig,
    device: torch.device,
    fed: Federation,
    teachers: list[Teacher],
    skipped: list[tuple[str, str]],
    synthesis: Synthesis,
    labels: Labels,
    agreed: dict[str, float],
    training: Training,
    evaluation: dict[str, Any] | None,
) -> dict[str, Any]:
    """``report.json`` less the timings and the output names (its keys are written sorted)."""
    return {
        "config": config.to_dict(device),
        "seed": config.seed,
        "device": str(device),
        "threads": torch.get_num_threads(),
        "student": {
            "arch": training.spec,
            "num_classes": fed.num_classes,
            "input_shape": list(fed.input_shape),
            "class_names": list(fed.class_names) if fed.class_names is not None else None,
        },
        "teachers": [teacher_entry(t) for t in teachers],
        "skipped": [{"file": path, "reason": reason} for path, reason in skipped],
        "synthetic_size": len(synthesis.synthetic),
        "generator_loss": [],
        "generator_skipped": None,  # why a generator the sources named did not run
        "decoders": None,
        **synthesis.report,
        "labels": labels.report,
        "distilled_samples": labels.kept,
        "training": "consensus distillation" if config.fusion is None else f"FedMHO-{config.fusion.mode}",
        "init": training.init,
        "fusion_loss": training.fusion_loss,
        "label_agreement": agreed,
        "distill_loss": training.distill_loss,
        "adversarial": training.adversarial,
        "accuracy": None if evaluation is None else evaluation["accuracy"],
        "per_class_accuracy": None if evaluation is None else evaluation["per_class_accuracy"],
        "num_eval_examples": None if evaluation is None else evaluation["num_examples"],
    }


def teacher_entry(teacher: Teacher) -> dict[str, Any]:
    """A teacher as the report lists it: where it came from, what it is, what it claims."""
    bundle = teacher.bundle
    accuracy = bundle.metrics.get("val_accuracy")
    return {
        "file": str(teacher.path) if teacher.path is not None else None,
        "arch": bundle.arch,
        "method": teacher.method,
        "sha256": bundle.sha256,
        "profile": bundle.profile.get("name"),
        "num_examples": bundle.num_examples,
        "label_counts": list(bundle.label_counts),
        "val_accuracy": float(accuracy) if is_number(accuracy) else None,
    }
