"""The final training of a device's model: a classifier from its spec (or from given initial weights) for
the configured epochs, and a CVAE, each with its validation metrics and cost as the bundle reports them."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from common.device import resolve_device
from common.errors import BudgetError, ConfigError
from common.seeding import seeded
from edge_sdk.artifacts import TrainedCVAE, TrainedModel
from edge_sdk.cvae import CVAEConfig, cvae_cost, evaluate_cvae, fit_width, train_cvae
from edge_sdk.data import ArrayDataset
from edge_sdk.models.arch import ArchSpec, build_model, parse_arch
from edge_sdk.profiling import fits, profile_model
from edge_sdk.train import TrainConfig, evaluate, make_optimizer, to_float, train
from profiles import DeviceProfile

__all__ = ["train_cvae_final", "train_final"]


def train_final(
    arch: str,
    train_split: ArrayDataset,
    val_split: ArrayDataset,
    *,
    epochs: int,
    lr: float = 1e-3,
    batch_size: int = 64,
    seed: int,
    device: str = "cpu",
    progress: bool = False,
    init: torch.nn.Module | None = None,
    unknown_output: bool = False,
    optimizer: torch.optim.Optimizer | None = None,
    precision: str = "auto",
    stop: Callable[[], bool] | None = None,
    track_val: bool = False,
    plateau: Callable[[Sequence[float]], bool] | None = None,
    prior_val: Sequence[float] = (),
    augment: str = "auto",
    schedule: str = "auto",
    weight_decay: float | None = None,
    schedule_span: tuple[int, int] | None = None,
) -> TrainedModel:
    """Full local training of the chosen architecture (the paper's final 50-epoch step, scaled).

    ``init`` (a module of exactly this architecture: a subnet extracted from a supernet, or a finalist
    that trains on, with its ``optimizer`` to keep Adam's moments) is trained in place instead of a
    freshly initialised model. ``unknown_output`` adds
    the "none of my classes" output (:mod:`edge_sdk.outliers`); the validation accuracy then counts an
    image called unknown as wrong. ``precision`` is the training's (:mod:`edge_sdk.precision`); the
    validation numbers are measured in float32, the exported model's precision. ``stop`` (a time budget,
    asked after each epoch) may end the training early; ``final_epochs`` records the epochs trained.
    ``track_val`` measures the validation loss and accuracy after every epoch (the history's ``val_loss``
    and ``val_accuracy``); ``plateau`` (which implies it) is asked after each epoch with the validation
    losses so far, ``prior_val`` (the epochs ``init`` already trained) first, and True ends the training
    (:func:`edge_sdk.halving.plateaued`; the metrics' ``plateau_stopped``); with it, the model returned is
    the one of the lowest validation loss (``best_epoch`` of the epochs trained here; 0: ``init`` as it
    came, whose loss is the last of ``prior_val``). ``augment``, ``schedule``, ``weight_decay`` and
    ``schedule_span`` are the training recipe (:class:`edge_sdk.train.TrainConfig`; ``auto`` / None: from
    the input's spec; the span: this call is part of a longer schedule).
    """
    spec = parse_arch(arch)
    num_classes = train_split.num_classes
    config = TrainConfig(
        epochs=epochs, lr=lr, batch_size=batch_size, unknown_output=unknown_output, precision=precision,
        augment=augment, schedule=schedule, weight_decay=weight_decay, schedule_span=schedule_span,
    )  # fmt: skip
    if optimizer is not None and init is None:
        raise ConfigError("an optimizer continues a model: pass that model as init")
    model = _initial_model(spec, train_split, init=init, unknown_output=unknown_output, seed=seed)
    dev = resolve_device(device)
    start = time.perf_counter()
    if optimizer is None:
        optimizer = make_optimizer(model, config, train_split.input_shape)
    watch = _Watch(model, val_split, dev, stop=stop, track=track_val, plateau=plateau, prior_val=prior_val)
    losses = train(
        model, train_split, config=config, seed=seed, device=dev, progress=progress, optimizer=optimizer,
        stop=watch,
    )  # fmt: skip
    val_loss, val_acc, kept = watch.finish(len(losses))
    model = model.cpu().eval()
    cost = profile_model(model, train_split.input_shape, batch_size=batch_size)
    metrics = _metrics(losses, watch, (val_loss, val_acc, kept), time.perf_counter() - start) | {
        k: int(v) for k, v in cost.to_dict().items()
    }
    return TrainedModel(
        module=model,
        arch=str(spec),
        num_classes=num_classes,
        input_shape=train_split.input_shape,
        label_counts=tuple(train_split.label_counts()),
        num_examples=len(train_split),
        metrics=metrics,
        unknown_output=unknown_output,
        class_names=train_split.class_names,
        optimizer=optimizer,
        history=_history(losses, watch.curve if watch.track else []),
    )


def _metrics(
    losses: list[float], watch: _Watch, val: tuple[float, float, int], seconds: float
) -> dict[str, Any]:
    """A final training's metrics: its losses, its watch, the validation numbers of the weights kept."""
    val_loss, val_acc, kept = val
    return {
        "val_accuracy": float(val_acc),
        "val_loss": float(val_loss),
        "train_loss": float(losses[kept - 1]) if kept else float("nan"),
        "final_epochs": len(losses),
        "best_epoch": kept,
        "plateau_stopped": watch.why == "plateau",
        "train_seconds": round(seconds, 3),
    }


def _initial_model(
    spec: ArchSpec,
    train_split: ArrayDataset,
    *,
    init: torch.nn.Module | None,
    unknown_output: bool,
    seed: int,
) -> torch.nn.Module:
    """``init``, checked to have the task's outputs, or a fresh model of ``spec`` (seeded weights)."""
    num_classes = train_split.num_classes
    if init is None:
        with seeded(seed):  # seeded weight init without touching the caller's global RNG
            return build_model(spec, train_split.input_shape, num_classes + int(unknown_output))
    with torch.inference_mode():
        where = next(init.parameters()).device
        outputs = init.eval()(to_float(train_split.x[:2]).to(where)).shape[1]
    if outputs != num_classes + int(unknown_output):
        raise ConfigError(
            f"init module has {outputs} outputs, expected {num_classes + int(unknown_output)} "
            f"({num_classes} classes{' + unknown' if unknown_output else ''}); pass a model of that shape"
        )
    return init


class _Watch:
    """The training's ``stop`` callback, asked after every epoch but the last: measures the validation
    numbers (when tracked), asks the time budget, then the plateau rule; with a plateau rule it also keeps
    the weights of the epoch of lowest validation loss (the starting weights count, at the last of
    ``prior_val``), which :meth:`finish` returns to: the epochs after the best one only overfit."""

    def __init__(
        self,
        model: torch.nn.Module,
        val_split: ArrayDataset,
        device: torch.device,
        *,
        stop: Callable[[], bool] | None,
        track: bool,
        plateau: Callable[[Sequence[float]], bool] | None,
        prior_val: Sequence[float],
    ) -> None:
        self.model, self.val_split, self.device = model, val_split, device
        self.stop, self.plateau, self.prior_val = stop, plateau, list(prior_val)
        self.track = track or plateau is not None
        self.curve: list[tuple[float, float]] = []  # (val loss, val accuracy) after each epoch
        self.why: str | None = None
        self.best_epoch = 0  # epochs of this run the kept weights had trained (0: the starting ones)
        keeps = plateau is not None and bool(prior_val)
        self.best_loss = self.prior_val[-1] if keeps else math.inf
        self.best_state = _snapshot(model) if keeps else None

    def measure(self) -> None:
        self.curve.append(evaluate(self.model, self.val_split, device=self.device))
        if self.plateau is not None and self.curve[-1][0] < self.best_loss:
            self.best_loss, self.best_epoch = self.curve[-1][0], len(self.curve)
            self.best_state = _snapshot(self.model)

    def __call__(self) -> bool:
        if self.track:
            self.measure()
            self.model.train()
        if self.stop is not None and self.stop():
            self.why = "budget"
        elif self.plateau is not None and self.plateau([*self.prior_val, *(v for v, _ in self.curve)]):
            self.why = "plateau"
        return self.why is not None

    def finish(self, epochs: int) -> tuple[float, float, int]:
        """(validation loss, accuracy, epochs the returned weights trained) after ``epochs`` trained."""
        if epochs == 0:
            return (*evaluate(self.model, self.val_split, device=self.device), 0)
        if len(self.curve) < epochs:  # the last epoch is not measured yet
            self.measure()
        if self.plateau is None or self.best_state is None or self.best_epoch == epochs:
            return (*self.curve[-1], epochs)
        self.model.load_state_dict(self.best_state)
        if self.best_epoch > 0:
            return (*self.curve[self.best_epoch - 1], self.best_epoch)
        return (*evaluate(self.model, self.val_split, device=self.device), 0)


def _snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: value.detach().clone() for name, value in model.state_dict().items()}


def _history(losses: list[float], curve: list[tuple[float, float]]) -> tuple[dict[str, float], ...]:
    """Per epoch: the training loss, and the validation numbers where they were measured every epoch."""
    if not curve:
        return tuple({"train_loss": loss} for loss in losses)
    return tuple(
        {"train_loss": loss, "val_loss": val_loss, "val_accuracy": val_acc}
        for loss, (val_loss, val_acc) in zip(losses, curve, strict=False)
    )


def train_cvae_final(
    train_split: ArrayDataset,
    val_split: ArrayDataset,
    *,
    config: CVAEConfig,
    profile: DeviceProfile,
    seed: int,
    device: str = "cpu",
    progress: bool = False,
) -> TrainedCVAE:
    """Check the whole CVAE against the budget (FLOPs and parameters of encoder + decoder, training
    memory) at its width (:func:`edge_sdk.cvae.fit_width`: the widest that fits, unless one is given),
    then train it and measure its loss on the validation split."""
    config = fit_width(config, profile, train_split.input_shape, train_split.num_classes)
    cost = cvae_cost(config, train_split.input_shape, train_split.num_classes)
    problem = fits(cost.model, profile)
    if problem is not None:
        raise BudgetError(
            f"{config.arch} does not fit the device: {problem}; fix: a smaller --cvae-width, "
            "--cvae-latent-dim or --cvae-model cvae-small"
        )
    dev = resolve_device(device)
    start = time.perf_counter()
    model, history = train_cvae(train_split, config=config, seed=seed, device=dev, progress=progress)
    val = evaluate_cvae(model, val_split, seed=seed, device=dev)
    model = model.cpu().eval()
    metrics = {
        "model": config.model,
        "latent_dim": config.latent_dim,
        "width": model.width,
        "epochs": config.epochs,
        "lr": float(config.lr),
        "batch_size": config.batch_size,
        "train_loss": float(history[-1]["loss"]) if history else float("nan"),
        "val_loss": val["loss"],
        "val_recon": val["recon"],
        "val_kl": val["kl"],
        "train_seconds": round(time.perf_counter() - start, 3),
        **cost.to_metrics(),
    }
    return TrainedCVAE(
        module=model,
        arch=model.arch,
        num_classes=train_split.num_classes,
        input_shape=train_split.input_shape,
        label_counts=tuple(train_split.label_counts()),
        num_examples=len(train_split),
        latent_dim=model.latent_dim,
        metrics=metrics,
        history=tuple(history),
    )
