"""FedMHO knowledge fusion: train the global model on decoder samples (section 4.2.3, Eqs. 5-8).

Three losses, one per variant:

- ``ce`` (FedMHO): cross-entropy on the synthetic labels (Eq. 5).
- ``md`` (FedMHO-MD): lam * CE + (1 - lam) * KL(p_T || p_student), where p_T is the softmax of the mean
  logits of the classifier teachers (Eq. 6 averages logits, as the reference code does).
- ``sd`` (FedMHO-SD): the same with p_T from the initial global model w_0 (Eq. 7), which keeps the
  student close to the FedAvg initialisation it started from.

Who the teacher is (``FusionConfig.teacher``):

- ``mean``: the paper's p_T above, the same for every sample.
- ``conditioned`` (ours): the teacher of a sample made for class y is every bundle that holds y, weighted
  by its share of y's examples, n_ky / sum_j n_jy, over the classifiers *and* the decoders. A classifier
  votes with its softmax (md: each classifier; sd: w_0, the average of them all, with their summed share);
  a decoder votes for y, the class it was asked to draw. Under label skew the mean teacher is wrong on the
  classes few classifiers hold (benchmarks/RESULTS.md, "FedMHO at the paper's numbers"); a teacher
  that never saw y has weight 0 on y's samples, the same rule as ``server_kit.labelling.labels``'
  ``conditioned``.
- ``agreeing`` (ours, the default): ``conditioned``, with each classifier's share of y scaled by how much
  it recognises y on y's decoder samples (its mean probability of y there); the share it loses goes to
  the label y. It matters for sd: FedAvg can lose a class that one classifier held (w_0 then hardly
  recognises it), and a w_0 that calls those samples something else would teach that.

KL uses ``reduction="batchmean"`` (the true KL per sample). The reference code sums CE and
``nn.KLDivLoss()`` with its default ``"mean"`` reduction, which divides by batch x classes, so its KL term
is 1/K of this one, and it drops the lam weights. No temperature (the paper uses none).

Teachers are frozen and the synthetic set is fixed, so p_T is computed once for the whole set before
training, not per batch.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, get_args

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from common.checks import from_preset
from common.device import resolve_device
from common.errors import ConfigError, DataError
from common.loop import adam, fit
from common.seeding import seeded
from common.torch_utils import INFER_BATCH, batched_logits
from server_kit.teachers import check_label_counts

__all__ = ["MODES", "TEACHERS", "FusionConfig", "conditioned_targets", "fuse", "fusion_loss", "teacher_probs"]

Mode = Literal["ce", "md", "sd"]
MODES: tuple[str, ...] = get_args(Mode)
FusionTeacher = Literal["agreeing", "conditioned", "mean"]
TEACHERS: tuple[str, ...] = get_args(FusionTeacher)

# The paper's Table 3: Adam, batch 64, global epochs / learning rate per dataset (MNIST 10 / 1e-5,
# Fashion 20 / 5e-4, SVHN 20 / 5e-5, EMNIST 30 / 5e-5); lam = 0.5 (section 4.3). The reference code runs
# MNIST for 20 epochs. Those rates were tuned for a VGG-9 starting from a FedAvg initialisation; the
# "fast" default (ours) suits the small students of this toolkit, often trained from scratch.
_PRESETS: dict[str, dict[str, Any]] = {
    "fast": {},
    "mnist": {"epochs": 10, "lr": 1e-5, "batch_size": 64},
    "fashionmnist": {"epochs": 20, "lr": 5e-4, "batch_size": 64},
    "svhn": {"epochs": 20, "lr": 5e-5, "batch_size": 64},
    "emnist": {"epochs": 30, "lr": 5e-5, "batch_size": 64},
}


@dataclass(frozen=True, kw_only=True)
class FusionConfig:
    """Global-model training on the synthetic set.

    Attributes:
        mode: the FedMHO loss: ce (FedMHO), md (FedMHO-MD) or sd (FedMHO-SD).
        lam: weight of the cross-entropy term in md and sd (the paper's Eq. 8); unused by ce.
        teacher: who teaches md and sd: the uploads that hold the sample's class, by their share of it
            (conditioned), those shares scaled by how well each classifier recognises the class
            (agreeing), or the plain mean (mean, the paper's Eqs. 6-7). Mode ce has no teacher: another
            value than the default is refused.
        epochs: passes over the synthetic set.
        lr: Adam learning rate.
        batch_size: images per step (a trailing batch of one image joins the previous one, for BatchNorm).
        weight_decay: Adam L2 penalty.
    """

    mode: Mode = "md"
    lam: float = 0.5
    teacher: FusionTeacher = "agreeing"
    epochs: int = 10
    lr: float = 1e-3
    batch_size: int = 64
    weight_decay: float = 0.0

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ConfigError(f"mode must be one of {MODES}, got {self.mode!r}")
        _check_lam(self.lam)
        if self.teacher not in TEACHERS:
            raise ConfigError(f"teacher must be one of {TEACHERS}, got {self.teacher!r}")
        if self.mode == "ce" and self.teacher != "agreeing":
            raise ConfigError("mode 'ce' has no teacher: leave teacher at its default or pick md / sd")
        for name, low in (("epochs", 0), ("batch_size", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ConfigError(f"{name} must be an integer >= {low}, got {value!r}")
        if (
            isinstance(self.lr, bool)
            or not isinstance(self.lr, int | float)
            or not (math.isfinite(self.lr) and self.lr > 0)
        ):
            raise ConfigError(f"lr must be a positive finite number, got {self.lr!r}")
        if (
            isinstance(self.weight_decay, bool)
            or not isinstance(self.weight_decay, int | float)
            or not (self.weight_decay >= 0)
        ):
            raise ConfigError(f"weight_decay must be a number >= 0, got {self.weight_decay!r}")

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> FusionConfig:
        """``fast`` or a dataset's Table 3 settings (``mnist``, ``fashionmnist``, ``svhn``, ``emnist``),
        with any field overridden by keyword."""
        return from_preset(cls, _PRESETS, name, "fusion", **overrides)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _check_lam(lam: float) -> None:
    if isinstance(lam, bool) or not isinstance(lam, int | float) or not 0.0 <= lam <= 1.0:
        raise ConfigError(f"lam must be a number in [0, 1], got {lam!r}")


def fusion_loss(
    student_logits: Tensor,
    y_hard: Tensor,
    *,
    mode: str,
    teacher_probs: Tensor | None = None,
    lam: float = 0.5,
) -> Tensor:
    """Scalar loss of one batch: CE(student, y) for ``ce``; lam * CE + (1 - lam) * KL(teacher || student)
    (batchmean) for ``md`` / ``sd``, where ``teacher_probs`` (N x L, rows summing to 1) is required."""
    if mode not in MODES:
        raise ConfigError(f"mode must be one of {MODES}, got {mode!r}")
    _check_lam(lam)
    ce = F.cross_entropy(student_logits, y_hard)
    if mode == "ce":
        if teacher_probs is not None:
            raise ConfigError("teacher_probs is only used by the md and sd modes; pass None for ce")
        return ce
    if teacher_probs is None:
        raise ConfigError(f"mode {mode!r} needs teacher_probs (N x L probabilities)")
    if teacher_probs.shape != student_logits.shape:
        raise ConfigError(
            f"teacher_probs shape {tuple(teacher_probs.shape)} != student logits shape "
            f"{tuple(student_logits.shape)}"
        )
    kl = F.kl_div(F.log_softmax(student_logits, dim=1), teacher_probs, reduction="batchmean")
    return lam * ce + (1.0 - lam) * kl


def _logits(
    teachers: Sequence[nn.Module],
    x: Tensor,
    *,
    batch_size: int = INFER_BATCH,
    device: str | torch.device = "cpu",
) -> list[Tensor]:
    """Each teacher's N x L float32 logits on ``x``, on CPU (eval mode; training flags restored)."""
    modules = [getattr(t, "module", t) for t in teachers]  # a server_kit.teachers.loading.Teacher or a module
    if not modules:
        raise ConfigError("the fusion teacher needs at least one classifier")
    return [batched_logits(m, x, device=device, batch_size=batch_size) for m in modules]


def teacher_probs(
    teachers: Sequence[nn.Module],
    x: Tensor,
    *,
    batch_size: int = INFER_BATCH,
    device: str | torch.device = "cpu",
) -> Tensor:
    """N x L softmax of the teachers' mean logits on ``x`` (Eq. 6; one teacher gives Eq. 7), on CPU."""
    logits = _logits(teachers, x, batch_size=batch_size, device=device)
    return F.softmax(torch.stack(logits).mean(dim=0), dim=1)


def conditioned_targets(
    probs: Sequence[Tensor],
    y: Tensor,
    label_counts: Sequence[Sequence[int]] | Tensor,
    decoder_counts: Sequence[Sequence[int]] | Tensor = (),
    *,
    agreement: bool = False,
) -> Tensor:
    """N x L soft targets of the ``conditioned`` (``agreeing``) teacher: for a sample of class y,
    sum_k w_ky p_k + w_dy one_hot(y), with w_ky = n_ky / N_y for classifier k (``probs[k]``, N x L, its
    softmax on the samples), w_dy = (sum_d m_dy) / N_y for the decoders and N_y every bundle's count of y.
    A class nobody claims (N_y = 0) gets its one-hot label. ``label_counts``: one row per entry of ``probs``.

    ``agreement``: classifier k's weight on y is further scaled by a_ky, its mean probability of y on
    the samples made for y (how far it recognises the class it claims; measured on these synthetic
    samples, no real data), and the weight it loses goes to the one-hot label. A FedAvg w_0 that lost a
    class in the averaging then stops teaching that class's samples away from it."""
    if not probs:
        raise ConfigError("conditioned_targets needs the probabilities of at least one classifier")
    n, num_classes = probs[0].shape
    y = y.long()
    if tuple(y.shape) != (n,) or (n and (int(y.min()) < 0 or int(y.max()) >= num_classes)):
        raise ConfigError(f"y must be {n} labels in [0, {num_classes}), got shape {tuple(y.shape)}")
    counts = check_label_counts(label_counts, num_classes=num_classes, min_rows=0, error=DataError)
    decoders = check_label_counts(
        decoder_counts, num_classes=num_classes, min_rows=0, what="decoder_counts", error=DataError
    )
    if counts.shape[0] != len(probs):
        raise ConfigError(f"label_counts has {counts.shape[0]} rows for {len(probs)} classifiers")
    total = counts.sum(dim=0) + decoders.sum(dim=0)  # L: every bundle's examples of each class
    safe = total.clamp(min=1.0)
    held_by_decoders = torch.where(total > 0, decoders.sum(dim=0) / safe, torch.ones_like(total))
    one_hot = F.one_hot(y, num_classes).double()
    out = one_hot * held_by_decoders[y].unsqueeze(1)
    for k, p in enumerate(probs):
        if tuple(p.shape) != (n, num_classes):
            raise ConfigError(f"probs[{k}] is {tuple(p.shape)}, probs[0] {(n, num_classes)}")
        share = counts[k] / safe  # L
        if agreement:  # a_ky: mean p_k(y | x) over the samples of y (1 for a class with no sample)
            hits = torch.zeros(num_classes, dtype=torch.float64).index_add_(
                0, y, p.double()[torch.arange(n), y]
            )
            made = torch.bincount(y, minlength=num_classes).double()
            agree = torch.where(made > 0, hits / made.clamp(min=1.0), torch.ones_like(made))
            out += one_hot * (share * (1.0 - agree))[y].unsqueeze(1)
            share = share * agree
        out += p.double() * share[y].unsqueeze(1)
    return out.float()


def _targets(
    student: nn.Module,
    x: Tensor,
    y: Tensor,
    config: FusionConfig,
    teachers: Sequence[nn.Module] | None,
    initial: nn.Module | None,
    label_counts: Sequence[Sequence[int]] | None,
    decoder_counts: Sequence[Sequence[int]],
    dev: torch.device,
) -> Tensor | None:
    """The teacher probabilities ``md`` and ``sd`` distil (N x L), None for ``ce``: the mean teacher, or
    the teachers conditioned on each sample's class (by the label counts)."""
    if config.mode == "ce":
        return None
    if config.mode == "md" and not teachers:
        raise ConfigError("mode 'md' needs the classifier teachers (teachers=[...])")
    if config.mode == "sd":
        reference = initial if initial is not None else copy.deepcopy(student)
    if config.teacher == "mean":
        return teacher_probs(teachers if config.mode == "md" else [reference], x, device=dev)
    if label_counts is None or (config.mode == "md" and len(label_counts) != len(teachers or ())):
        raise ConfigError(
            f"the {config.teacher} {config.mode} teacher needs label_counts, one row per classifier "
            f"({len(teachers or ())}), got {None if label_counts is None else len(label_counts)}; "
            "pass the bundles' counts or use teacher='mean'"
        )
    if config.mode == "md":
        logits = _logits(teachers, x, device=dev)  # type: ignore[arg-type]
        rows: Sequence[Sequence[int]] | Tensor = label_counts
    else:  # w_0 speaks for every classifier it was averaged from
        logits = _logits([reference], x, device=dev)
        rows = torch.as_tensor(label_counts, dtype=torch.float64).sum(dim=0, keepdim=True)
    return conditioned_targets(
        [F.softmax(z, dim=1) for z in logits], y, rows, decoder_counts, agreement=config.teacher == "agreeing"
    )


def fuse(
    student: nn.Module,
    x: Tensor,
    y: Tensor,
    *,
    config: FusionConfig,
    teachers: Sequence[nn.Module] | None = None,
    initial: nn.Module | None = None,
    label_counts: Sequence[Sequence[int]] | None = None,
    decoder_counts: Sequence[Sequence[int]] = (),
    seed: int,
    device: str | torch.device = "cpu",
    progress: bool = False,
) -> list[float]:
    """Train ``student`` in place on (x, y) with Adam and the ``config.mode`` loss; returns the mean loss
    of each epoch.

    x: float32 N x C x H x W in [0, 1] (uint8 is converted); y: int64 labels. ``md`` needs ``teachers``
    (the classifier modules or Teachers). ``sd`` uses ``initial`` as w_0, or a frozen copy of ``student``
    as it is on entry (which is w_0 when the student was just initialised by FedAvg). The conditioned
    teachers need ``label_counts`` (one row per teacher: the classifiers' counts, which w_0 speaks for in
    ``sd``) and ``decoder_counts`` (the decoders' rows). ``seed`` fixes the batch order and Dropout.
    """
    if not isinstance(config, FusionConfig):
        raise ConfigError(f"config must be a FusionConfig, got {type(config).__name__}")
    if x.ndim != 4 or y.ndim != 1 or len(x) != len(y):
        raise DataError(f"x must be N x C x H x W and y N labels, got {tuple(x.shape)} and {tuple(y.shape)}")
    if len(y) == 0:
        raise DataError("the synthetic set is empty; nothing to train on")
    if x.dtype == torch.uint8:
        x = x.float() / 255.0
    dev = resolve_device(device)
    probs = _targets(student, x, y, config, teachers, initial, label_counts, decoder_counts, dev)
    x_dev, y_dev = x.to(dev), y.to(device=dev, dtype=torch.long)
    probs_dev = probs.to(dev) if probs is not None else None
    student.to(dev).train()
    optimizer = adam(student.parameters(), lr=config.lr, weight_decay=config.weight_decay)

    def batch_loss(idx: Tensor) -> Tensor:
        return fusion_loss(
            student(x_dev[idx]),
            y_dev[idx],
            mode=config.mode,
            teacher_probs=probs_dev[idx] if probs_dev is not None else None,
            lam=config.lam,
        )

    with seeded(seed, dev):
        return fit(
            batch_loss,
            optimizer,
            n=len(y_dev),
            batch_size=config.batch_size,
            epochs=config.epochs,
            generator=torch.Generator().manual_seed(seed),
            device=dev,
            lone_last="merge",  # a lone last image would break BatchNorm on 1x1 maps
            desc="fusion",
            progress=progress,
        )
