"""Labelling synthetic samples with what the bundles say about who knows what.

Every synthetic sample is made *for* a class y: the generator's condition, the inversion target, the label a
CVAE decoder was asked for. Each bundle carries its label counts n_kc, so the server knows which teacher has
seen which class. A rule turns the teachers' temperature-softened predictions p_k(x) into one soft target:

* ``mean`` (pFedZKD, Algorithm 4): the mean over teachers. Under strong label skew most teachers never saw
  y and vote, confidently, for the classes they own.
* ``label-weighted``: teacher k's vote for *output* class c scaled by its share of c. Right for real images,
  whose class is unknown (it is how the ensemble ceilings in benchmarks/RESULTS.md are measured), but on a
  synthetic image a teacher that never saw y still votes with a large weight for its own classes.
* ``conditioned`` (DFDG's rule): teacher k weighted by its share of the *sample's* class y,
  w_k(y) = n_ky / sum_j n_jy, so a teacher with no example of y has weight exactly 0 on samples made for y.

``mask`` restricts each teacher's softmax to the classes it holds: a logit of a class the teacher never
trained on is arbitrary off the data manifold, and a synthetic image is off it. ``drop_mismatch`` then
drops the samples whose label does not pick y: the synthesis failed to make a y the federation agrees
on, and learning that image as anything would teach the student an artefact. So that no class is lost
that way (a class one client alone holds, whose images the others call theirs), a class whose samples
the rule mostly rejects (under ``FALLBACK_BELOW``) is labelled by the conditioned rule instead.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Literal, get_args

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from common.device import resolve_device
from common.errors import ConfigError
from common.torch_utils import INFER_BATCH
from edge_sdk.precision import autocast, resolve_precision
from server_kit.teachers import check_label_counts, class_shares, held_classes, map_teachers, own_probability

__all__ = [
    "LABEL_RULES",
    "LabelConfig",
    "Labels",
    "consensus",
    "label_synthetic",
    "teacher_probs",
    "unconditioned_vote",
]

LabelRule = Literal["mean", "label-weighted", "conditioned"]
LABEL_RULES: tuple[str, ...] = get_args(LabelRule)
ShareBase = Literal["classifiers", "federation"]
SHARE_BASES: tuple[str, ...] = get_args(ShareBase)
# with drop_mismatch, a class whose samples the rule labels as their class less often than this falls back
# to the conditioned rule (its owners label it), so no class disappears from the distillation set
FALLBACK_BELOW = 0.25


@dataclass(frozen=True, kw_only=True)
class LabelConfig:
    """How synthetic samples are labelled (see the module docstring).

    The default is the rule that is right on real images (label-weighted, far above the mean on MNIST's
    test set at alpha 0.1) with the samples it does not call y dropped: measured at alpha 0.1
    (benchmarks/RESULTS.md, "Label skew") it beat the mean, the conditioned rule with or without the
    mask, and kept the weakest class highest.
    """

    # how teacher votes become a sample's label: label-weighted (each teacher's vote for a class scaled by
    # its share of that class), conditioned (weighted by its share of the class the sample was made for),
    # mean (pFedZKD)
    rule: LabelRule = "label-weighted"
    mask: bool = False  # each teacher votes only for the classes it has examples of
    drop_mismatch: bool = True  # drop the samples whose label is not the class they were made for
    # what a teacher's share of a class is a share of: the classifiers' examples of it, or the whole
    # federation's (also the examples of devices that sent only a decoder)
    shares: ShareBase = "classifiers"
    # a teacher with an "unknown" output (FedOV) votes on each sample with the weight of its probability
    # that the sample is one of its classes; teachers without one vote as always. False: the unknown
    # output is ignored (the ablation)
    abstain: bool = True

    def __post_init__(self) -> None:
        if self.rule not in LABEL_RULES:
            raise ConfigError(f"label rule must be one of {list(LABEL_RULES)}, got {self.rule!r}")
        if self.shares not in SHARE_BASES:
            raise ConfigError(f"label shares must be one of {list(SHARE_BASES)}, got {self.shares!r}")
        for name in ("mask", "drop_mismatch", "abstain"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be a bool, got {getattr(self, name)!r}")

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


@dataclass(frozen=True)
class Labels:
    """Soft targets for every sample, which samples to keep, and how they relate to the target class."""

    targets: Tensor  # N x L float32, rows sum to 1
    keep: Tensor  # N bool
    report: dict[str, object]

    @property
    def kept(self) -> int:
        return int(self.keep.sum())


@torch.no_grad()
def teacher_probs(
    module: nn.Module,
    x: Tensor,
    *,
    tau: float,
    held: Tensor | None = None,
    batch_size: int = INFER_BATCH,
    device: str | torch.device = "cpu",
    precision: str = "auto",
) -> Tensor:
    """N x L float64 softmax(T(x) / tau) on the CPU, over the ``held`` classes only when given (L bool).

    The module runs in eval mode (BatchNorm on running statistics) at ``precision``
    (:mod:`edge_sdk.precision`); its training flag is restored.
    """
    return _probs_and_own(
        module, x, tau=tau, held=held, batch_size=batch_size, device=device, precision=precision
    )[0]


@torch.no_grad()
def _probs_and_own(
    module: nn.Module,
    x: Tensor,
    *,
    tau: float,
    held: Tensor | None,
    batch_size: int,
    device: str | torch.device,
    precision: str = "auto",
) -> tuple[Tensor, Tensor | None]:
    """:func:`teacher_probs` and, for a teacher that can abstain (:mod:`server_kit.teachers.abstain`), the N
    float64 probability that each image is one of its classes (None for the others)."""
    if not tau > 0:
        raise ConfigError(f"tau must be > 0, got {tau}")
    dev = resolve_device(device)
    precision = resolve_precision(precision, dev)
    was_training = module.training
    module.eval().to(dev)
    try:
        parts, owns = [], []
        for i in range(0, x.shape[0], batch_size):
            with autocast(precision, dev):
                logits, own = own_probability(module, x[i : i + batch_size].to(dev))
            logits = logits.double() / tau  # B x L
            if held is not None:
                if held.shape != logits.shape[1:]:
                    raise ConfigError(f"held mask has {held.shape[0]} classes, the teacher {logits.shape[1]}")
                logits = logits.masked_fill(~held.to(dev), -math.inf)
            parts.append(F.softmax(logits, dim=1).cpu())
            if own is not None:
                owns.append(own.double().cpu())
    finally:
        module.train(was_training)
    if not parts:
        return torch.zeros(0, 0, dtype=torch.float64), None
    return torch.cat(parts), (torch.cat(owns) if owns else None)


def _vote(
    modules: Sequence[nn.Module],
    x: Tensor,
    weighs: Sequence[Callable[[int, Tensor], Tensor]],
    *,
    tau: float,
    held: Tensor | None,
    batch_size: int,
    device: str | torch.device,
    abstain: bool = True,
    precision: str = "auto",
) -> list[Tensor]:
    """One N x L float64 vote per weighing rule: sum over teachers j of weigh(j, p_j(x)), rows
    renormalised to sum to 1. With ``abstain``, a teacher with an "unknown" output (FedOV) votes on each
    sample with the weight of its own probability that the sample is one of its classes.

    Every teacher runs once whatever the number of rules (running a teacher is the cost; weighing is a
    product); the teachers' probabilities (K x N x L) are held until they are summed in teacher order.
    """
    if not modules:
        raise ConfigError("labelling needs at least one teacher")
    if batch_size < 1:
        raise ConfigError(f"batch_size must be >= 1, got {batch_size}")
    totals: list[Tensor] | None = None
    # the teachers run side by side (one per core); their votes are summed in teacher order
    outputs = map_teachers(
        lambda j: _probs_and_own(
            modules[j],
            x,
            tau=tau,
            held=None if held is None else held[j],
            batch_size=batch_size,
            device=device,
            precision=precision,
        ),
        modules,
        device=device,
    )
    for j, (probs, own) in enumerate(outputs):
        if totals is not None and probs.shape != totals[0].shape:
            raise ConfigError(
                f"teacher {j} predicts {probs.shape[1]} classes, teacher 0 {totals[0].shape[1]}"
            )
        votes = [weigh(j, probs) for weigh in weighs]
        if abstain and own is not None:
            votes = [v * own.unsqueeze(1) for v in votes]
        totals = votes if totals is None else [t + v for t, v in zip(totals, votes, strict=True)]
    assert totals is not None
    return [t / t.sum(dim=1, keepdim=True).clamp(min=1e-300) for t in totals]


def consensus(
    modules: Sequence[nn.Module],
    x: Tensor,
    *,
    tau: float,
    class_weights: Tensor | None = None,
    held: Tensor | None = None,
    batch_size: int = INFER_BATCH,
    device: str | torch.device = "cpu",
    abstain: bool = True,
    precision: str = "auto",
) -> Tensor:
    """N x L float32 ensemble of softmax(T_k(x) / tau) for images whose class is unknown (real test images).

    The mean over teachers (pFedZKD, Algorithm 4) or, with ``class_weights`` (K x L, :func:`class_shares`),
    p_c proportional to sum_k w_kc p_kc; ``held`` (K x L bool, :func:`held_classes`) masks each teacher's
    softmax to its classes; ``abstain`` weighs a teacher with an unknown output by its p_own per image.
    """
    if class_weights is not None and tuple(class_weights.shape[:1]) != (len(modules),):
        raise ConfigError(f"class_weights has {class_weights.shape[0]} rows for {len(modules)} teachers")
    w = None if class_weights is None else class_weights.double()

    def weigh(j: int, probs: Tensor) -> Tensor:
        if w is None:
            return probs
        if w.shape[1] != probs.shape[1]:
            raise ConfigError(f"class_weights has {w.shape[1]} classes, teacher {j} {probs.shape[1]}")
        return probs * w[j]

    votes = _vote(
        modules, x, [weigh], tau=tau, held=held, batch_size=batch_size, device=device, abstain=abstain,
        precision=precision,
    )  # fmt: skip
    return votes[0].float()


def unconditioned_vote(
    modules: Sequence[nn.Module],
    x: Tensor,
    label_counts: Sequence[Sequence[int]] | Tensor,
    *,
    config: LabelConfig,
    tau: float,
    decoder_only_counts: Sequence[Sequence[int]] | Tensor | None = None,
    device: str | torch.device = "cpu",
    precision: str = "auto",
) -> Tensor:
    """N x L float32: ``config.rule``'s vote on images made for no class (mixtures of two synthetic
    images), with its mask, shares and abstention; the conditioned rule needs the class, and is refused."""
    if config.rule == "conditioned":
        raise ConfigError(
            "the conditioned rule weighs teachers by the class a sample was made for, and a mixture has "
            "none: use the label-weighted or mean rule"
        )
    counts = check_label_counts(label_counts)
    others = decoder_only_counts if config.shares == "federation" else None
    return consensus(
        modules,
        x,
        tau=tau,
        class_weights=class_shares(counts, others) if config.rule == "label-weighted" else None,
        held=held_classes(counts) if config.mask else None,
        device=device,
        abstain=config.abstain,
        precision=precision,
    )


def label_synthetic(
    modules: Sequence[nn.Module],
    x: Tensor,
    target_class: Tensor,
    label_counts: Sequence[Sequence[int]] | Tensor,
    *,
    config: LabelConfig,
    tau: float,
    decoder_only_counts: Sequence[Sequence[int]] | Tensor | None = None,
    batch_size: int = INFER_BATCH,
    device: str | torch.device = "cpu",
    precision: str = "auto",
) -> Labels:
    """Label ``x`` (N samples made for ``target_class``) by ``config.rule``; see the module docstring.

    ``decoder_only_counts``: the label counts of devices that sent no classifier, which the shares count
    with ``config.shares == "federation"`` (:func:`~server_kit.teachers.counts.class_shares`).

    The report holds the agreement of the labels with the target class (overall and per class) and how
    many samples of each class survive ``drop_mismatch``.
    """
    counts = check_label_counts(label_counts)
    k, num_classes = counts.shape
    if k != len(modules):
        raise ConfigError(f"label_counts has {k} rows for {len(modules)} teachers")
    n = x.shape[0]
    y = target_class.long()
    if tuple(y.shape) != (n,) or (n and (int(y.min()) < 0 or int(y.max()) >= num_classes)):
        raise ConfigError(f"target_class must be {n} indices in [0, {num_classes}), got {tuple(y.shape)}")
    held = held_classes(counts) if config.mask else None
    others = decoder_only_counts if config.shares == "federation" else None
    shares = class_shares(counts, others).double()  # K x L

    def rule_for(rule: str, y_part: Tensor) -> Callable[[int, Tensor], Tensor]:
        def weigh(j: int, probs: Tensor) -> Tensor:
            if probs.shape[1] != num_classes:
                raise ConfigError(f"teacher {j} predicts {probs.shape[1]} classes, expected {num_classes}")
            if rule == "mean":
                return probs
            if rule == "label-weighted":
                return probs * shares[j]  # j's vote for output class c scaled by its share of c
            return probs * shares[j, y_part].unsqueeze(1)  # conditioned: j's weight is its share of y_n

        return weigh

    # with drop_mismatch, the conditioned vote is the fallback of the classes the rule mostly rejects;
    # it is computed in the same pass over the teachers, so the fallback costs no second run of them
    rules = [config.rule]
    if config.drop_mismatch and config.rule != "conditioned":
        rules.append("conditioned")
    votes = _vote(
        modules,
        x,
        [rule_for(r, y) for r in rules],
        tau=tau,
        held=held,
        batch_size=batch_size,
        device=device,
        abstain=config.abstain,
        precision=precision,
    )
    targets = votes[0].float()
    hits = targets.argmax(dim=1) == y
    agree = torch.bincount(y[hits], minlength=num_classes)
    made = torch.bincount(y, minlength=num_classes)
    fallback: list[int] = []
    if len(votes) > 1:
        # never lose a class: where the rule rejects most samples made for c, the owners of c label them
        fallback = [c for c in range(num_classes) if made[c] > 0 and agree[c] < FALLBACK_BELOW * made[c]]
        if fallback:
            where = (y.view(-1, 1) == torch.tensor(fallback).view(1, -1)).any(dim=1)
            targets[where] = votes[1][where].float()
            hits = targets.argmax(dim=1) == y
    keep = hits if config.drop_mismatch else torch.ones(n, dtype=torch.bool)
    report = {
        **config.to_dict(),
        "target_class_agreement": float(hits.double().mean()) if n else None,
        "made_per_class": made.tolist(),
        "agree_per_class": torch.bincount(y[hits], minlength=num_classes).tolist(),  # the final labels
        "rule_agree_per_class": agree.tolist(),  # the rule's own, before the fallback
        "conditioned_fallback_classes": fallback,
        "kept": int(keep.sum()),
    }
    return Labels(targets=targets, keep=keep, report=report)
