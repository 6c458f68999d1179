"""Local training on preloaded tensors: the inner loop of the search and of the final fit.

A client's split is small (thousands of images), so it lives on the device once as uint8 and batches are
slices of a seeded permutation: no DataLoader, no worker processes, no per-sample Python. Keeping the
pixels uint8 and converting each batch costs one elementwise op per batch and a quarter of the memory a
float copy would (a 50,000-image CIFAR split is 150 MB as uint8, 600 MB as float32).

Optimizer and defaults follow pFedZKD (section 4.1.2): Adam, learning rate 1e-3, batch size 64. Color
inputs add the recipe of :mod:`edge_sdk.augment` (crops and flips drawn per batch from the uint8 images,
weight decay, a cosine schedule) inside the same loop; grayscale ones train as before.
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from common.checks import check_ints
from common.errors import ConfigError, DataError
from common.loop import adam, batches_per_epoch, fit
from common.seeding import derive_seed, seeded
from common.torch_utils import INFER_BATCH
from edge_sdk.augment import Augment, Recipe, Schedule, check_recipe, cosine_factor, crop_flip, resolve_recipe
from edge_sdk.data import ArrayDataset
from edge_sdk.outliers import make_outliers
from edge_sdk.precision import autocast, check_precision, resolve_precision

__all__ = [
    "TrainConfig",
    "cosine_scheduler",
    "evaluate",
    "kd_loss",
    "kd_loss_logits",
    "make_optimizer",
    "release_memory",
    "to_float",
    "train",
]


# outliers per real image in a batch when training an "unknown" output, and their RNG stream
OUTLIER_FRACTION = 0.5
OUTLIER_STREAM = 2
AUGMENT_STREAM = 4  # derive_seed stream of the crops and flips
_MALLOC_TRIM: Any = None  # libc's malloc_trim, False where there is none, None until first looked up


def release_memory() -> None:
    """Hand freed heap pages back to the OS (glibc's ``malloc_trim``; nothing elsewhere).

    glibc keeps much of the freed memory in the process heap, so a process that once ran a wide model
    can stay that large while it trains everything after it; in a simulation two client workers and the
    server each keep their own. Called after each training run, evaluation, client and synthesis source.
    """
    global _MALLOC_TRIM
    if _MALLOC_TRIM is None:
        try:
            _MALLOC_TRIM = ctypes.CDLL("libc.so.6").malloc_trim
        except (OSError, AttributeError):
            _MALLOC_TRIM = False
    if _MALLOC_TRIM:
        _MALLOC_TRIM(0)


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """Options of one local training run.

    Attributes:
        epochs: passes over the training split.
        lr: Adam learning rate.
        batch_size: images per step (a trailing batch of one image joins the previous batch, because
            BatchNorm cannot normalise a single 1x1 feature map).
        weight_decay: Adam L2 penalty; None takes the input's (:func:`edge_sdk.augment.resolve_recipe`:
            some for color images, none for grayscale).
        augment: ``crop-flip`` (random crops from a zero-padded border and horizontal flips of every
            batch), ``none``, or ``auto``: crop-flip for color images, none for grayscale.
        schedule: the learning rate over the run: ``constant``, ``cosine`` (from ``lr`` to 0 over the
            run's steps), or ``auto``: cosine for color images, constant for grayscale.
        schedule_span: (epochs trained before this run, epochs of the whole schedule) when this run is
            a part of a longer training (successive halving's rungs, then the rest): the schedule goes on
            where the last part stopped instead of starting over; None: this run is the whole schedule.
        unknown_output: the model has one output more than the data has classes, "none of my classes"
            (FedOV), trained on ``OUTLIER_FRACTION`` x batch corrupted copies of each batch's images
            (:mod:`edge_sdk.outliers`).
        precision: ``auto``, ``fp32`` or ``bf16`` (:mod:`edge_sdk.precision`): the forward passes run in
            bfloat16 autocast where the hardware has it; weights and optimizer stay float32.
    """

    epochs: int = 5
    lr: float = 1e-3
    batch_size: int = 64
    weight_decay: float | None = None
    augment: Augment = "auto"
    schedule: Schedule = "auto"
    schedule_span: tuple[int, int] | None = None
    unknown_output: bool = False
    precision: str = "auto"

    def __post_init__(self) -> None:
        check_precision(self.precision)
        if isinstance(self.epochs, bool) or not isinstance(self.epochs, int) or self.epochs < 0:
            raise ConfigError(f"epochs must be an integer >= 0, got {self.epochs!r}")
        if not (isinstance(self.lr, int | float) and math.isfinite(self.lr) and self.lr > 0):
            raise ConfigError(f"lr must be a positive finite number, got {self.lr!r}")
        if isinstance(self.batch_size, bool) or not isinstance(self.batch_size, int) or self.batch_size < 1:
            raise ConfigError(f"batch_size must be an integer >= 1, got {self.batch_size!r}")
        check_recipe(self.augment, self.schedule, self.weight_decay)
        if self.schedule_span is not None:
            span = check_ints("schedule_span", self.schedule_span, 0, max_length=2)
            if len(span) != 2:
                raise ConfigError(f"schedule_span must be (epochs before, total epochs), got {span!r}")
            before, total = span
            if total < before + self.epochs:
                raise ConfigError(
                    f"schedule_span {self.schedule_span!r}: a schedule of {total} epochs cannot hold "
                    f"{self.epochs} epochs after {before}; fix: a total of at least {before + self.epochs}"
                )
        if not isinstance(self.unknown_output, bool):
            raise ConfigError(f"unknown_output must be a bool, got {self.unknown_output!r}")

    def recipe(self, input_shape: tuple[int, int, int]) -> Recipe:
        """The recipe this config trains images of ``input_shape`` with (its ``auto`` choices resolved)."""
        return resolve_recipe(
            input_shape, augment=self.augment, schedule=self.schedule, weight_decay=self.weight_decay
        )


def make_optimizer(
    model: nn.Module, config: TrainConfig, input_shape: tuple[int, int, int]
) -> torch.optim.Optimizer:
    """The Adam a run of ``config`` on images of ``input_shape`` starts with (its recipe's weight decay)."""
    return adam(model.parameters(), lr=config.lr, weight_decay=config.recipe(input_shape).weight_decay)


def to_float(x_uint8: torch.Tensor) -> torch.Tensor:
    """uint8 pixels -> float32 in [0, 1], the input every model of the toolkit expects."""
    if x_uint8.dtype != torch.uint8:
        raise DataError(f"images must be uint8, got {x_uint8.dtype}")
    return x_uint8.float().div_(255.0)


def _check(data: ArrayDataset, what: str) -> None:
    if len(data) == 0:
        raise DataError(f"{what} split is empty; give it at least one image")


def train(
    model: nn.Module,
    train: ArrayDataset,
    *,
    config: TrainConfig,
    seed: int,
    device: str | torch.device = "cpu",
    progress: bool = False,
    optimizer: torch.optim.Optimizer | None = None,
    stop: Callable[[], bool] | None = None,
) -> list[float]:
    """Train ``model`` in place with Adam and cross-entropy; returns the mean training loss of each epoch
    trained (fewer than ``config.epochs`` when ``stop()``, asked after each epoch, said so: a time budget).

    ``optimizer`` (over ``model``'s parameters) continues an earlier run with its moments, as if it had
    not stopped; None starts a fresh Adam from ``config`` (:func:`make_optimizer`). A cosine schedule
    runs over this call's epochs from the optimizer's initial rate, or over ``config.schedule_span``.

    ``seed`` fixes the batch order, Dropout and the outliers, so the same model, data and seed give
    identical weights. With ``config.unknown_output`` each batch gets outliers labelled
    ``train.num_classes`` (the model's extra output); the loss is over both.
    """
    _check(train, "training")
    device = torch.device(device)
    # channels-last conv weights make oneDNN run the convolutions channels-last: faster training steps on
    # CPU for chain CNNs (benchmarks/RESULTS.md); same values, and export reads the weights either way
    model.to(device, memory_format=torch.channels_last).train()
    x = train.x.to(device)  # N x C x H x W uint8, converted per batch
    y = train.y.to(device=device, dtype=torch.long)
    if optimizer is None:
        optimizer = make_optimizer(model, config, train.input_shape)
    recipe = config.recipe(train.input_shape)
    order_rng = torch.Generator(device="cpu").manual_seed(seed)
    outlier_rng = torch.Generator(device="cpu").manual_seed(derive_seed(seed, OUTLIER_STREAM))
    augment_rng = torch.Generator(device="cpu").manual_seed(derive_seed(seed, AUGMENT_STREAM))
    unknown = train.num_classes if config.unknown_output else None
    precision = resolve_precision(config.precision, device)

    def batch_loss(idx: torch.Tensor) -> torch.Tensor:
        xb = x[idx] if recipe.pad == 0 else crop_flip(x[idx], recipe.pad, augment_rng)
        xb, yb = to_float(xb), y[idx]
        if unknown is not None:
            count = max(1, round(OUTLIER_FRACTION * len(idx)))
            xb = torch.cat([xb, make_outliers(xb, yb, count, outlier_rng)])
            yb = torch.cat([yb, yb.new_full((count,), unknown)])
        with autocast(precision, device):  # per step: autocast caches cast weights until exit
            return nn.functional.cross_entropy(model(xb), yb)

    with seeded(seed, device):
        losses = fit(
            batch_loss,
            optimizer,
            n=len(y),
            batch_size=config.batch_size,
            epochs=config.epochs,
            generator=order_rng,
            device=device,
            lone_last="merge",  # a lone last image would break BatchNorm on 1x1 maps
            progress=progress,
            stop=stop,
            scheduler=_scheduler(optimizer, recipe, len(y), config),
        )
    release_memory()
    return losses


def _scheduler(
    optimizer: torch.optim.Optimizer, recipe: Recipe, n: int, config: TrainConfig
) -> torch.optim.lr_scheduler.LRScheduler | None:
    """The recipe's per-step schedule over this run's planned steps (None: a constant rate)."""
    if recipe.schedule == "constant":
        return None
    per_epoch = batches_per_epoch(n, config.batch_size, lone_last="merge")
    before, total = config.schedule_span or (0, config.epochs)
    return cosine_scheduler(optimizer, done=before * per_epoch, total=total * per_epoch)


def cosine_scheduler(
    optimizer: torch.optim.Optimizer, *, done: int, total: int
) -> torch.optim.lr_scheduler.LRScheduler:
    """A cosine decay of ``optimizer``'s rate to 0 over ``total`` steps (stepped once a step), ``done`` of
    them taken before: a continued run keeps the first run's base rate and its place in the schedule."""
    for group in optimizer.param_groups:
        group["lr"] = group.setdefault("initial_lr", group["lr"])
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: cosine_factor(done + step, total))


@torch.inference_mode()
def evaluate(
    model: nn.Module,
    data: ArrayDataset,
    *,
    batch_size: int = INFER_BATCH,
    device: str | torch.device = "cpu",
    precision: str = "fp32",
) -> tuple[float, float]:
    """(mean cross-entropy, accuracy) of ``model`` on ``data``, in eval mode (BatchNorm running stats).

    ``precision`` defaults to float32, the exported model's precision: a reported accuracy is that
    model's; the search's fitness passes its own precision (it only ranks candidates)."""
    _check(data, "evaluation")
    if batch_size < 1:
        raise ConfigError(f"batch_size must be >= 1, got {batch_size}")
    device = torch.device(device)
    model.to(device).eval()
    x = data.x.to(device)
    y = data.y.to(device=device, dtype=torch.long)
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    correct = torch.zeros((), dtype=torch.long, device=device)
    precision = resolve_precision(precision, device)
    for start in range(0, len(y), batch_size):
        with autocast(precision, device):
            logits = model(to_float(x[start : start + batch_size]))
        target = y[start : start + batch_size]
        loss_sum += nn.functional.cross_entropy(logits.float(), target, reduction="sum").double()
        correct += (logits.argmax(dim=1) == target).sum()
    n = len(y)
    result = float(loss_sum) / n, int(correct) / n
    release_memory()
    return result


def kd_loss(student_logits: torch.Tensor, target_probs: torch.Tensor, tau: float) -> torch.Tensor:
    """KL(targets || softmax(student / tau)) * tau^2, mean over the batch.

    The one distillation loss of the toolkit (server consensus distillation, supernet training, device
    personalization). The tau^2 factor (Hinton et al. 2015) keeps the gradient magnitude independent of
    tau, since the soft-target gradients scale as 1 / tau^2.
    """
    log_q = F.log_softmax(student_logits / tau, dim=1)  # B x L
    return F.kl_div(log_q, target_probs, reduction="batchmean") * tau * tau


def kd_loss_logits(student_logits: torch.Tensor, teacher_logits: torch.Tensor, tau: float) -> torch.Tensor:
    """:func:`kd_loss` with the teacher given as logits (softened at the same tau)."""
    return kd_loss(student_logits, F.softmax(teacher_logits / tau, dim=1), tau)
