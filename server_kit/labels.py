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

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from profiles.errors import ConfigError

__all__ = [
    "LABEL_RULES",
    "LabelConfig",
    "Labels",
    "class_shares",
    "consensus",
    "held_classes",
    "label_synthetic",
    "teacher_probs",
]

LABEL_RULES = ("mean", "label-weighted", "conditioned")
# with drop_mismatch, a class whose samples the rule labels as their class less often than this falls back
# to the conditioned rule (its owners label it), so no class disappears from the distillation set
FALLBACK_BELOW = 0.25


@dataclass(frozen=True, kw_only=True)
class LabelConfig:
    """How synthetic samples are labelled (see the module docstring).

    The default is the rule that is right on real images (label-weighted, 96.4 % on MNIST's test set at
    alpha 0.1 against 80.2 % for the mean) with the samples it does not call y dropped: measured at alpha
    0.1 (benchmarks/RESULTS.md, "Label skew") it beat the mean, the conditioned rule with or without the
    mask, and kept the weakest class highest.
    """

    rule: str = "label-weighted"
    mask: bool = False
    drop_mismatch: bool = True

    def __post_init__(self) -> None:
        if self.rule not in LABEL_RULES:
            raise ConfigError(f"label rule must be one of {list(LABEL_RULES)}, got {self.rule!r}")
        for name in ("mask", "drop_mismatch"):
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


def _counts(label_counts: Sequence[Sequence[int]] | Tensor) -> Tensor:
    counts = torch.as_tensor(
        label_counts if isinstance(label_counts, Tensor) else [list(r) for r in label_counts],
        dtype=torch.float64,
    )
    if counts.ndim != 2 or counts.shape[0] < 1 or counts.shape[1] < 2:
        raise ConfigError(f"label_counts must be K x L with K >= 1, L >= 2, got shape {tuple(counts.shape)}")
    if not torch.isfinite(counts).all() or (counts < 0).any():
        raise ConfigError("label_counts must be finite and >= 0")
    return counts


def class_shares(label_counts: Sequence[Sequence[int]] | Tensor) -> Tensor:
    """K x L float32: teacher k's share of the federation's examples of class c (columns sum to 1).

    A class no teacher has examples of gets uniform weights 1/K (every teacher is equally uninformed).
    """
    counts = _counts(label_counts)
    total = counts.sum(dim=0, keepdim=True)  # 1 x L
    uniform = torch.full_like(counts, 1.0 / counts.shape[0])
    return torch.where(total > 0, counts / total.clamp(min=1e-300), uniform).float()


def held_classes(label_counts: Sequence[Sequence[int]] | Tensor) -> Tensor:
    """K x L bool: the classes each teacher has examples of; a teacher with none holds every class."""
    held = _counts(label_counts) > 0
    return held | ~held.any(dim=1, keepdim=True)


def _resolve_device(device: str | torch.device) -> torch.device:
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


@torch.no_grad()
def teacher_probs(
    module: nn.Module,
    x: Tensor,
    *,
    tau: float,
    held: Tensor | None = None,
    batch_size: int = 512,
    device: str | torch.device = "cpu",
) -> Tensor:
    """N x L float64 softmax(T(x) / tau) on the CPU, over the ``held`` classes only when given (L bool).

    The module runs in eval mode (BatchNorm on running statistics); its training flag is restored.
    """
    if not tau > 0:
        raise ConfigError(f"tau must be > 0, got {tau}")
    dev = _resolve_device(device)
    was_training = module.training
    module.eval().to(dev)
    try:
        parts = []
        for i in range(0, x.shape[0], batch_size):
            logits = module(x[i : i + batch_size].to(dev)).double() / tau  # B x L
            if held is not None:
                if held.shape != logits.shape[1:]:
                    raise ConfigError(f"held mask has {held.shape[0]} classes, the teacher {logits.shape[1]}")
                logits = logits.masked_fill(~held.to(dev), -math.inf)
            parts.append(F.softmax(logits, dim=1).cpu())
    finally:
        module.train(was_training)
    return torch.cat(parts) if parts else torch.zeros(0, 0, dtype=torch.float64)


def _vote(
    modules: Sequence[nn.Module],
    x: Tensor,
    weigh: Callable[[int, Tensor], Tensor],
    *,
    tau: float,
    held: Tensor | None,
    batch_size: int,
    device: str | torch.device,
) -> Tensor:
    """N x L float64: sum over teachers j of weigh(j, p_j(x)), rows renormalised to sum to 1.

    The teachers are evaluated one at a time and accumulated, so memory is O(N x L) whatever K is.
    """
    if not modules:
        raise ConfigError("labelling needs at least one teacher")
    if batch_size < 1:
        raise ConfigError(f"batch_size must be >= 1, got {batch_size}")
    total: Tensor | None = None
    for j, module in enumerate(modules):
        probs = teacher_probs(
            module, x, tau=tau, held=None if held is None else held[j], batch_size=batch_size, device=device
        )
        if total is not None and probs.shape != total.shape:
            raise ConfigError(f"teacher {j} predicts {probs.shape[1]} classes, teacher 0 {total.shape[1]}")
        vote = weigh(j, probs)
        total = vote if total is None else total + vote
    assert total is not None
    return total / total.sum(dim=1, keepdim=True).clamp(min=1e-300)


def consensus(
    modules: Sequence[nn.Module],
    x: Tensor,
    *,
    tau: float,
    class_weights: Tensor | None = None,
    held: Tensor | None = None,
    batch_size: int = 512,
    device: str | torch.device = "cpu",
) -> Tensor:
    """N x L float32 ensemble of softmax(T_k(x) / tau) for images whose class is unknown (real test images).

    The mean over teachers (pFedZKD, Algorithm 4) or, with ``class_weights`` (K x L, :func:`class_shares`),
    p_c proportional to sum_k w_kc p_kc; ``held`` (K x L bool, :func:`held_classes`) masks each teacher's
    softmax to its classes.
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

    return _vote(modules, x, weigh, tau=tau, held=held, batch_size=batch_size, device=device).float()


def label_synthetic(
    modules: Sequence[nn.Module],
    x: Tensor,
    target_class: Tensor,
    label_counts: Sequence[Sequence[int]] | Tensor,
    *,
    config: LabelConfig,
    tau: float,
    batch_size: int = 512,
    device: str | torch.device = "cpu",
) -> Labels:
    """Label ``x`` (N samples made for ``target_class``) by ``config.rule``; see the module docstring.

    The report holds the agreement of the labels with the target class (overall and per class) and how
    many samples of each class survive ``drop_mismatch``.
    """
    counts = _counts(label_counts)
    k, num_classes = counts.shape
    if k != len(modules):
        raise ConfigError(f"label_counts has {k} rows for {len(modules)} teachers")
    n = x.shape[0]
    y = target_class.long()
    if tuple(y.shape) != (n,) or (n and (int(y.min()) < 0 or int(y.max()) >= num_classes)):
        raise ConfigError(f"target_class must be {n} indices in [0, {num_classes}), got {tuple(y.shape)}")
    held = held_classes(counts) if config.mask else None
    shares = class_shares(counts).double()  # K x L

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

    def vote(rule: str, xs: Tensor, ys: Tensor) -> Tensor:
        weigh = rule_for(rule, ys)
        return _vote(modules, xs, weigh, tau=tau, held=held, batch_size=batch_size, device=device)

    targets = vote(config.rule, x, y).float()
    hits = targets.argmax(dim=1) == y
    agree = torch.bincount(y[hits], minlength=num_classes)
    made = torch.bincount(y, minlength=num_classes)
    fallback: list[int] = []
    if config.drop_mismatch and config.rule != "conditioned":
        # never lose a class: where the rule rejects most samples made for c, the owners of c label them
        fallback = [c for c in range(num_classes) if made[c] > 0 and agree[c] < FALLBACK_BELOW * made[c]]
        if fallback:
            where = (y.view(-1, 1) == torch.tensor(fallback).view(1, -1)).any(dim=1)
            targets[where] = vote("conditioned", x[where], y[where]).float()
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
