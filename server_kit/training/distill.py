"""Multi-teacher distillation into the student (pFedZKD section 3.3.3, Algorithm 4).

The soft targets come from :mod:`server_kit.labelling.labels` (how the teachers' votes are combined); the
student
minimises KL(targets || softmax(student / tau)) over the synthetic set.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import Literal, get_args

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from common.checks import is_number
from common.device import resolve_device
from common.errors import ConfigError
from common.loop import adam, batches_per_epoch, fit
from common.seeding import seeded
from edge_sdk.augment import is_color
from edge_sdk.precision import autocast, resolve_precision
from edge_sdk.train import cosine_scheduler, kd_loss

__all__ = [
    "COLOR_AVERAGE",
    "COLOR_EPOCHS",
    "COLOR_MIX_EPOCHS",
    "PLAIN_AVERAGE",
    "PLAIN_EPOCHS",
    "DistillConfig",
    "distill",
    "mixed",
    "random_shift",
]

# Distillation epochs left undecided: one-channel images, where twice as many gave the same MNIST uploads no
# better a student; color ones, where the residual student on the harder set kept improving
# (benchmarks/RESULTS.md, "Speed" and "Color images, server side"); color ones with mixtures, half as many:
# the teachers' vote on every step's mixtures costs about what the student's step does, and half the
# epochs keep the distillation's time where it was without them and most of their gain
# (benchmarks/RESULTS.md, "The mixtures at half the epochs")
PLAIN_EPOCHS = 10
COLOR_EPOCHS = 30
COLOR_MIX_EPOCHS = 15
# The weight average's share of the steps left undecided: on for one-channel images, where it lifted every
# MNIST student measured; off for color ones, where it did not (benchmarks/RESULTS.md, "The student's
# weight average")
PLAIN_AVERAGE = 0.1
COLOR_AVERAGE = 0.0
DistillSchedule = Literal["constant", "cosine"]
DISTILL_SCHEDULES: tuple[str, ...] = get_args(DistillSchedule)


@dataclass(frozen=True, kw_only=True)
class DistillConfig:
    """Student training on (X, Y). ``tau`` is the distillation temperature (the paper uses 4)."""

    # passes of the student over the synthetic set; none: 10 for one-channel images, 30 for color ones, 15
    # for color ones with mixtures
    epochs: int | None
    batch_size: int = 64
    lr: float = 1e-3  # Adam learning rate
    tau: float = 4.0  # distillation temperature (the paper: 4)
    hard_labels: bool = False  # the "w/o ZSKD" ablation: CE on class indices instead of KL on soft labels
    weight_decay: float = 0.0  # Adam L2 penalty
    # every batch shifted by up to this fraction of the image side (random per sample, zero padding): a
    # synthetic set is small and made by optimisation, and a student that must match the label under
    # small translations learns the object rather than the exact pixels the teachers were optimised on
    shift: float = 0.0
    # every image mirrored left-right with probability 1/2 (drawn per sample): a natural image keeps its
    # class under the flip, so the student sees twice the views of the same small set
    flip: bool = False
    # the learning rate over the distillation: constant, or cosine (decaying to 0 by the last step)
    schedule: DistillSchedule = "constant"
    # the student kept is the moving average of its weights (and BatchNorm statistics) over about this
    # share of the last steps, not the last step's weights: on a small synthetic set at a constant rate the
    # last weights are one noisy point of a wandering trajectory, and their average generalizes better to
    # real images; 0 keeps the last weights; none: on for one-channel images, off for color ones, where
    # it has not helped
    average: float | None = None
    # this share of every batch is replaced by mixtures of two of its images (weights drawn uniformly),
    # labelled on the fly by the teachers' vote: a fixed synthetic set covers little of what lies
    # between its images, and the student learns the teachers' function there too; 0 is off, the
    # default: a mixture carries only the vote, which is weakest under strong label skew
    mix: float = 0.0

    def __post_init__(self) -> None:
        for name in ("epochs", "batch_size"):
            value = getattr(self, name)
            if name == "epochs" and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        for name in ("lr", "tau"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
                raise ConfigError(f"{name} must be a positive number, got {value!r}")
        if not isinstance(self.weight_decay, int | float) or not self.weight_decay >= 0:
            raise ConfigError(f"weight_decay must be >= 0, got {self.weight_decay!r}")
        if not isinstance(self.hard_labels, bool):
            raise ConfigError(f"hard_labels must be a bool, got {self.hard_labels!r}")
        if not is_number(self.shift) or not 0 <= self.shift < 0.5:
            raise ConfigError(f"shift must be a fraction in [0, 0.5), got {self.shift!r}")
        if not isinstance(self.flip, bool):
            raise ConfigError(f"flip must be true or false, got {self.flip!r}")
        if self.schedule not in DISTILL_SCHEDULES:
            raise ConfigError(f"schedule must be one of {DISTILL_SCHEDULES}, got {self.schedule!r}")
        if self.average is not None and not (is_number(self.average) and 0 <= self.average <= 1):
            raise ConfigError(
                f"average must be a share of the steps in [0, 1], got {self.average!r}; fix: 0 keeps the "
                "last weights"
            )

        if not (is_number(self.mix) and 0 <= self.mix <= 1):
            raise ConfigError(f"mix must be a share of the batch in [0, 1], got {self.mix!r}; fix: 0 is off")
        if self.mix and self.hard_labels:
            raise ConfigError(
                "mix labels its mixtures by the teachers' soft vote, which hard_labels replaces: set mix=0 "
                "or hard_labels=False"
            )

    def for_images(self, input_shape: tuple[int, ...]) -> DistillConfig:
        """``epochs`` and ``average`` decided where None, by the images
        (:func:`edge_sdk.augment.is_color`) and, for the epochs, by the mixtures."""
        color = is_color(input_shape)
        undecided = (COLOR_MIX_EPOCHS if self.mix else COLOR_EPOCHS) if color else PLAIN_EPOCHS
        epochs = self.epochs if self.epochs is not None else undecided
        average = self.average if self.average is not None else COLOR_AVERAGE if color else PLAIN_AVERAGE
        return replace(self, epochs=epochs, average=average)

    def to_dict(self) -> dict[str, object]:
        """The fields; ``flip`` only when on and ``schedule`` only when not constant, so reports made
        before they existed match on resume. ``mix`` always, as every report since it was added records
        it. ``average`` always: a report made before it kept the last weights, and a resume redoes it
        rather than assume so."""
        out = asdict(self)
        if not out["flip"]:
            del out["flip"]
        if out["schedule"] == "constant":
            del out["schedule"]
        return out


def _scheduler(
    optimizer: torch.optim.Optimizer, config: DistillConfig, steps: int
) -> torch.optim.lr_scheduler.LRScheduler | None:
    """The resolved config's per-step schedule over the distillation's ``steps`` (None: a constant rate)."""
    if config.schedule == "constant":
        return None
    return cosine_scheduler(optimizer, done=0, total=steps)


class _WeightAverage:
    """An exponential moving average of a module's floating-point state (weights and BatchNorm
    statistics), over about ``horizon`` optimizer steps; :meth:`update` after every step. It starts at the
    initial weights, whose share has decayed to about exp(-steps / horizon) by the end."""

    def __init__(self, module: nn.Module, horizon: float) -> None:
        # state_dict's tensors share storage with the module's: the optimizer and BatchNorm update them in
        # place, so these references follow the training
        self.live = [v for v in module.state_dict().values() if v.is_floating_point()]
        self.mean = [v.detach().clone() for v in self.live]
        self.weight = 1.0 / max(1.0, horizon)

    @torch.no_grad()
    def update(self) -> None:
        torch._foreach_lerp_(self.mean, self.live, self.weight)

    @torch.no_grad()
    def apply(self) -> None:
        """Copy the average into the module (its integer buffers keep their last values)."""
        for live, mean in zip(self.live, self.mean, strict=True):
            live.copy_(mean)


def random_shift(x: Tensor, fraction: float, generator: torch.Generator) -> Tensor:
    """Translate each image by a random whole number of pixels, up to ``fraction`` of its side, in each
    direction; vacated pixels are 0. Offsets are drawn on the CPU from ``generator`` (device-independent)."""
    n, _, h, w = x.shape
    pad_h, pad_w = int(fraction * h), int(fraction * w)
    if pad_h == 0 and pad_w == 0:
        return x
    dy = torch.randint(-pad_h, pad_h + 1, (n,), generator=generator).to(x.device)
    dx = torch.randint(-pad_w, pad_w + 1, (n,), generator=generator).to(x.device)
    padded = F.pad(x, (pad_w, pad_w, pad_h, pad_h))  # N x C x (H + 2p) x (W + 2p)
    rows = (torch.arange(h, device=x.device).view(1, h) + pad_h - dy.view(n, 1)).view(n, 1, h, 1)
    cols = (torch.arange(w, device=x.device).view(1, w) + pad_w - dx.view(n, 1)).view(n, 1, 1, w)
    index_rows = rows.expand(n, x.shape[1], h, padded.shape[3])
    picked = padded.gather(2, index_rows)  # N x C x H x (W + 2p)
    return picked.gather(3, cols.expand(n, x.shape[1], h, w))


def mixed(
    x: Tensor, targets: Tensor, share: float, relabel: Callable[[Tensor], Tensor], generator: torch.Generator
) -> tuple[Tensor, Tensor]:
    """The batch with its first ``share`` of images replaced by mixtures lam * x_i + (1 - lam) * x_j
    (j drawn from the batch, lam uniform in [0, 1], both from ``generator`` on the CPU) and their targets
    by ``relabel`` of the mixtures (N x L probabilities)."""
    m = round(share * x.shape[0])
    if m == 0:
        return x, targets
    partner = torch.randint(x.shape[0], (m,), generator=generator).to(x.device)
    lam = torch.rand((m, 1, 1, 1), generator=generator).to(x.device, x.dtype)
    mixes = lam * x[:m] + (1 - lam) * x[partner]
    votes = relabel(mixes).to(targets.device, targets.dtype)
    return torch.cat([mixes, x[m:]]), torch.cat([votes, targets[m:]])


def distill(
    student: nn.Module,
    x: Tensor,
    targets: Tensor,
    *,
    config: DistillConfig,
    seed: int,
    device: str | torch.device = "cpu",
    progress: bool = False,
    precision: str = "auto",
    relabel: Callable[[Tensor], Tensor] | None = None,
) -> list[float]:
    """Train ``student`` in place on (x, targets); returns the mean loss of every epoch.

    ``targets``: N x L soft labels (KL, tau-scaled) or, with ``config.hard_labels``, N int64 class
    indices (cross entropy). Dropout and shuffling draw from ``seed`` inside a forked RNG scope, so the
    same seed gives the same student and the caller's global RNG state is untouched. The student is
    left in eval mode, its convolution weights channels-last (oneDNN's fast layout on CPU; same values).
    Forward passes run at ``precision`` (:mod:`edge_sdk.precision`); the loss and Adam in float32.
    With ``config.average`` the student ends with the moving average of its weights (see the field).
    ``relabel`` (the teachers' vote on images made for no class) labels the mixtures of ``config.mix``.
    """
    n = x.shape[0]
    if n < 2:
        raise ConfigError(f"distillation needs at least 2 samples, got {n}")
    if targets.shape[0] != n:
        raise ConfigError(f"x has {n} samples but targets {targets.shape[0]}")
    if config.hard_labels and (targets.ndim != 1 or targets.dtype != torch.int64):
        raise ConfigError("hard_labels=True needs int64 class indices of shape N")
    if not config.hard_labels and (targets.ndim != 2 or not targets.is_floating_point()):
        raise ConfigError(
            "soft distillation needs float N x L targets (use hard_labels=True for class indices)"
        )
    config = config.for_images(tuple(x.shape[1:]))  # undecided epochs and average: by the images' channels
    assert config.epochs is not None and config.average is not None
    if config.mix > 0 and relabel is None:
        raise ConfigError("mix needs the teachers' vote to label its mixtures: pass relabel, or set mix=0")
    # the optimizer steps of the whole run, which the schedule and the average are sized by
    steps = batches_per_epoch(n, config.batch_size, lone_last="drop") * config.epochs
    dev = resolve_device(device)
    precision = resolve_precision(precision, dev)
    student.to(dev, memory_format=torch.channels_last).train()
    optimizer = adam(student.parameters(), lr=config.lr, weight_decay=config.weight_decay)
    gen = torch.Generator().manual_seed(seed)  # batch order, then each batch's shifts
    x_dev, y_dev = x.to(dev), targets.to(dev)  # preloaded once; batches are index gathers

    def batch_loss(idx: Tensor) -> Tensor:
        xb = x_dev[idx]
        if config.shift > 0:
            xb = random_shift(xb, config.shift, gen)
        if config.flip:
            mirror = (torch.rand((len(xb),), generator=gen) < 0.5).to(xb.device)
            xb = torch.where(mirror.view(-1, 1, 1, 1), xb.flip(3), xb)
        yb = y_dev[idx]
        if config.mix > 0:
            assert relabel is not None
            xb, yb = mixed(xb, yb, config.mix, relabel, gen)
        with autocast(precision, dev):
            logits = student(xb).float()  # B x L
        if config.hard_labels:
            return F.cross_entropy(logits, yb)
        return kd_loss(logits, yb, config.tau)

    average = _WeightAverage(student, config.average * steps) if config.average > 0 else None
    with seeded(seed, dev):  # the Dropout stream
        history = fit(
            batch_loss,
            optimizer,
            n=n,
            batch_size=config.batch_size,
            epochs=config.epochs,
            generator=gen,
            device=dev,
            lone_last="drop",  # BatchNorm cannot train on a batch of one
            scheduler=_scheduler(optimizer, config, steps),
            desc="distill",
            progress=progress,
            after_step=None if average is None else average.update,
        )
    if average is not None:
        average.apply()
    student.eval()
    return history
