"""Adversarial distillation (DENSE, NeurIPS 2022) with the conditioned labels of server_kit.labelling.labels.

A student distilled once on a fixed synthetic set learns what the set covers; under label skew the set's
images of a class come from the few teachers that hold it, and the boundaries between classes held by
different teachers (a 4 made by one client, a 9 by another) are what the student gets wrong. DENSE closes
the gap by alternating two steps: the generator is pushed towards images the teachers still agree on but
the student does not yet imitate (its adversarial term, -KL(ensemble || student) on the samples where
both still pick the same class), then the student trains on those images with the others kept in a
memory. Here the ensemble is the conditioned, masked one (each teacher weighted by its share of the
sample's class), both in the generator's adversarial term and in the labels of the new samples, and new
samples whose label is not their class are dropped like every other synthetic sample.

This runs after the ordinary distillation, from its student, its generator and its labelled set.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace

import torch
from torch import Tensor, nn

from common.checks import check_int, is_number
from common.errors import ConfigError
from common.seeding import derive_seed
from server_kit.labelling import LabelConfig, label_synthetic
from server_kit.synthesis import ConditionalGenerator, GeneratorConfig, sample_generator, train_generator
from server_kit.training.distill import DistillConfig, distill

__all__ = ["AdversarialConfig", "adversarial_distill"]


@dataclass(frozen=True, kw_only=True)
class AdversarialConfig:
    """``rounds`` of (``generator_steps`` adversarial generator steps, ``samples_per_round`` new samples
    labelled and added to the memory, ``student_epochs`` passes of the student over the memory)."""

    rounds: int = 20  # DENSE-style rounds after the distillation (generator adversarial to the student)
    generator_steps: int = 10  # adversarial generator steps per round
    samples_per_round: int = 512  # new samples labelled and added to the memory per round
    student_epochs: int = 1  # passes of the student over the memory per round
    adv_weight: float = 1.0  # DENSE's weight of the adversarial term

    def __post_init__(self) -> None:
        for name in ("rounds", "generator_steps", "samples_per_round", "student_epochs"):
            check_int(name, getattr(self, name), 1)
        if not is_number(self.adv_weight) or self.adv_weight <= 0:
            raise ConfigError(f"adv_weight must be a positive number, got {self.adv_weight!r}")

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def adversarial_distill(
    student: nn.Module,
    generator: ConditionalGenerator,
    teachers: Sequence[nn.Module],
    label_counts: Sequence[Sequence[int]],
    memory_x: Tensor,
    memory_targets: Tensor,
    *,
    config: AdversarialConfig,
    generator_config: GeneratorConfig,
    labels: LabelConfig,
    distill_config: DistillConfig,
    seed: int,
    device: str | torch.device = "cpu",
    progress: bool = False,
    precision: str = "auto",
) -> dict[str, list[float]]:
    """Train ``student`` and ``generator`` in place for ``config.rounds`` rounds (see the module docstring).

    ``memory_x`` / ``memory_targets`` are the labelled samples the student was distilled on; the new ones
    are appended (on the CPU). Returns per-round curves: the student's mean loss, the generator's mean
    adversarial term, and the fraction of new samples kept.
    """
    if memory_x.shape[0] != memory_targets.shape[0]:
        raise ConfigError(f"memory has {memory_x.shape[0]} images but {memory_targets.shape[0]} targets")
    counts = torch.as_tensor([list(r) for r in label_counts], dtype=torch.float64)
    pooled = counts.sum(dim=0)
    gen_config = replace(generator_config, adv_weight=config.adv_weight)
    xs, ts = [memory_x], [memory_targets]
    curves: dict[str, list[float]] = {"student_loss": [], "adv": [], "kept": []}
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=config.rounds, desc="adversarial", unit="round")
    for r in range(config.rounds):
        _, losses = train_generator(
            teachers, label_counts, input_shape=generator.input_shape, num_classes=generator.num_classes,
            config=gen_config, seed=derive_seed(seed, r, 0), device=device, student=student,
            generator=generator, steps=config.generator_steps, precision=precision,
        )  # fmt: skip
        x, y = sample_generator(
            generator, pooled, n=config.samples_per_round, seed=derive_seed(seed, r, 1), device=device
        )
        new = label_synthetic(
            teachers, x, y, counts, config=labels, tau=distill_config.tau, device=device, precision=precision
        )
        xs.append(x[new.keep])
        ts.append(new.targets[new.keep])
        history = distill(
            student,
            torch.cat(xs),
            torch.cat(ts),
            # a round's pass is short: its own last weights carry on to the next round, not an average
            config=replace(distill_config, epochs=config.student_epochs, average=0.0),
            seed=derive_seed(seed, r, 2),
            device=device,
            precision=precision,
        )
        curves["student_loss"].append(history[-1])
        curves["adv"].append(sum(step["adv"] for step in losses) / len(losses))
        curves["kept"].append(new.kept / max(len(y), 1))
        if bar is not None:
            bar.set_postfix(loss=f"{history[-1]:.4f}", kept=f"{curves['kept'][-1]:.2f}")
            bar.update(1)
    if bar is not None:
        bar.close()
    if not all(math.isfinite(v) for v in curves["student_loss"]):
        raise ConfigError("adversarial distillation diverged (a non-finite student loss); lower adv_weight")
    return curves
