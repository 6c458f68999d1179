"""The labelling phase: a target for every pooled synthetic sample, from the teachers' vote or from the
class a sample was made for (its source labelled by construction), and how well the two agree."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from common.torch_utils import INFER_BATCH
from edge_sdk.precision import autocast, resolve_precision
from server_kit.labelling.labels import LabelConfig, Labels, label_synthetic, unconditioned_vote
from server_kit.synthesis import DecoderConfig, Synthesis, SyntheticSet
from server_kit.teachers import Federation, unpaired_counts

__all__ = ["LabellingConfig", "agreement", "label", "mixture_labeller", "vote_labels"]


@dataclass(frozen=True, kw_only=True)
class LabellingConfig:
    """The labelling phase's settings: the vote's rule (``labels``, at temperature ``tau``), the paper's
    hard-label ablation, the sources labelled by construction and their weight, the top-up (``top_up``,
    drawing from the decoders as ``decoder`` says), the seed and precision."""

    labels: LabelConfig
    tau: float
    hard_labels: bool
    construction_labels: tuple[str, ...]
    construction_weight: float
    top_up: bool
    decoder: DecoderConfig
    seed: int
    precision: str


def label(fed: Federation, synthesis: Synthesis, config: LabellingConfig) -> Labels:
    """Soft targets for the synthetic set (``config.labels``, weighing the teachers by the counts that
    synthesis trusted), or the paper's "w/o ZSKD" ablation: the target class as a hard label, all kept."""
    synthetic = synthesis.synthetic
    if config.hard_labels:
        targets = F.one_hot(synthetic.target_class, fed.num_classes).float()
        n = len(synthetic)
        return Labels(targets=targets, keep=torch.ones(n, dtype=torch.bool), report={"rule": "hard"})
    # the pooled set is the parts in order: one flag per sample says whether its source is labelled
    # by construction (the class it was made for) or by the teachers' vote
    by_construction = torch.cat(
        [
            torch.full((len(part),), name in config.construction_labels, dtype=torch.bool)
            for name, part in synthesis.parts.items()
        ]
    )
    return vote_labels(fed, synthetic.x, synthetic.target_class, by_construction, synthesis, config)


def _decoder_only_counts(synthesis: Synthesis, labels: LabelConfig) -> Tensor | None:
    """The checked counts of the devices that sent only a decoder, where the shares count them."""
    if labels.shares == "federation" and synthesis.decoders is not None:
        return unpaired_counts(synthesis.label_counts, synthesis.decoders.label_counts)
    return None


def mixture_labeller(
    fed: Federation, synthesis: Synthesis, labels: LabelConfig, *, tau: float, precision: str
) -> Callable[[Tensor], Tensor]:
    """The vote that labels the distillation's mixtures of synthetic images (``DistillConfig.mix``): the
    same rule, counts and temperature as the set's own labels, without a class to condition on."""
    others = _decoder_only_counts(synthesis, labels)

    def relabel(x: Tensor) -> Tensor:
        return unconditioned_vote(
            fed.modules, x, synthesis.label_counts, config=labels, tau=tau, decoder_only_counts=others,
            device=fed.device, precision=precision,
        )  # fmt: skip

    return relabel


def vote_labels(
    fed: Federation,
    x: Tensor,
    y: Tensor,
    by_construction: Tensor,
    synthesis: Synthesis,
    config: LabellingConfig,
) -> Labels:
    """The teachers' vote on every sample (with drop_mismatch it also drops a constructed sample the
    teachers do not call its class: a blurry decode, or a decoder that lies about its labels); a
    constructed sample's target is ``construction_weight`` on its class, the rest on the vote."""
    others = _decoder_only_counts(synthesis, config.labels)
    votes = label_synthetic(
        fed.modules,
        x,
        y,
        synthesis.label_counts,
        config=config.labels,
        tau=config.tau,
        decoder_only_counts=others,
        device=fed.device,
        precision=config.precision,
    )
    weight = float(config.construction_weight)
    construction = weight * F.one_hot(y, fed.num_classes).float()
    construction += (1 - weight) * votes.targets
    targets = torch.where(by_construction.unsqueeze(1), construction, votes.targets)
    report = dict(votes.report) | {
        "by_construction": int(by_construction.sum()),
        "by_construction_kept": int((votes.keep & by_construction).sum()),
    }
    return Labels(targets=targets, keep=votes.keep, report=report)


def agreement(fed: Federation, synthetic: SyntheticSet, labels: Labels, precision: str) -> dict[str, float]:
    """How often the labels name the class a sample was made for, and how often they agree with the
    teacher that made the image (does the image transfer?)."""
    chosen = labels.targets.argmax(1)
    return {
        "target_class": float((chosen == synthetic.target_class).float().mean()),
        "generating_teacher": _generator_agreement(fed.modules, synthetic, chosen, fed.device, precision),
    }


@torch.no_grad()
def _generator_agreement(
    modules: Sequence[torch.nn.Module],
    synthetic: SyntheticSet,
    labels: Tensor,
    device: torch.device,
    precision: str = "auto",
) -> float:
    """Fraction of pseudo-images whose label equals the argmax of the teacher that generated them."""
    hits = 0
    precision = resolve_precision(precision, device)
    for k, module in enumerate(modules):
        mine = (synthetic.teacher == k).nonzero().flatten()  # indices of teacher k's images
        for i in range(0, mine.numel(), INFER_BATCH):
            idx = mine[i : i + INFER_BATCH]
            with autocast(precision, device):
                own = module(synthetic.x[idx].to(device)).argmax(1).cpu()
            hits += int((own == labels[idx]).sum())
    return hits / max(len(synthetic), 1)
