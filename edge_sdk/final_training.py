"""The final training of a device's model: a classifier from its spec (or from given initial weights) for
the configured epochs, and a CVAE, each with its validation metrics and cost as the bundle reports them."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

from common.device import resolve_device
from common.errors import BudgetError, ConfigError
from common.seeding import seeded
from edge_sdk.arch import build_model, parse_arch
from edge_sdk.artifacts import TrainedCVAE, TrainedModel
from edge_sdk.cvae import CVAEConfig, build_cvae, evaluate_cvae, profile_cvae, train_cvae
from edge_sdk.data import ArrayDataset
from edge_sdk.profiling import fits, profile_model
from edge_sdk.train import TrainConfig, evaluate, to_float, train
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
    (:func:`edge_sdk.halving.plateaued`; the metrics' ``plateau_stopped``).
    """
    spec = parse_arch(arch)
    num_classes = train_split.num_classes
    if init is not None:
        with torch.inference_mode():
            where = next(init.parameters()).device
            outputs = init.eval()(to_float(train_split.x[:2]).to(where)).shape[1]
        if outputs != num_classes + int(unknown_output):
            raise ConfigError(
                f"init module has {outputs} outputs, expected {num_classes + int(unknown_output)} "
                f"({num_classes} classes{' + unknown' if unknown_output else ''}); pass a model of that shape"
            )
        model = init
    else:
        with seeded(seed):  # seeded weight init without touching the caller's global RNG
            model = build_model(spec, train_split.input_shape, num_classes + int(unknown_output))
    if optimizer is not None and init is None:
        raise ConfigError("an optimizer continues a model: pass that model as init")
    dev = resolve_device(device)
    start = time.perf_counter()
    if optimizer is None:
        optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    curve: list[tuple[float, float]] = []  # (val loss, val accuracy) after each epoch, when tracked
    why: list[str] = []

    def after_epoch() -> bool:  # asked after every epoch but the last
        if track_val or plateau is not None:
            curve.append(evaluate(model, val_split, device=dev))
            model.train()
        if stop is not None and stop():
            why.append("budget")
        elif plateau is not None and plateau([*prior_val, *(loss for loss, _ in curve)]):
            why.append("plateau")
        return bool(why)

    losses = train(
        model,
        train_split,
        config=TrainConfig(
            epochs=epochs, lr=lr, batch_size=batch_size, unknown_output=unknown_output, precision=precision
        ),
        seed=seed,
        device=dev,
        progress=progress,
        optimizer=optimizer,
        stop=after_epoch,
    )
    if len(curve) < len(losses) or not losses:  # the last epoch's numbers are not measured yet
        curve.append(evaluate(model, val_split, device=dev))
    val_loss, val_acc = curve[-1]
    model = model.cpu().eval()
    cost = profile_model(model, train_split.input_shape, batch_size=batch_size)
    metrics = {
        "val_accuracy": float(val_acc),
        "val_loss": float(val_loss),
        "train_loss": float(losses[-1]) if losses else float("nan"),
        "final_epochs": len(losses),
        "plateau_stopped": why == ["plateau"],
        "train_seconds": round(time.perf_counter() - start, 3),
        **{k: int(v) for k, v in cost.to_dict().items()},
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
        history=_history(losses, curve if track_val or plateau is not None else []),
    )


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
    memory), then train it and measure its loss on the validation split."""
    with seeded(seed):
        probe = build_cvae(config.arch, train_split.input_shape, train_split.num_classes)
    cost = profile_cvae(probe, batch_size=config.batch_size)
    problem = fits(cost.model, profile)
    if problem is not None:
        raise BudgetError(
            f"{config.arch} does not fit the device: {problem}; fix: a smaller --cvae-latent-dim or "
            "--cvae-model cvae-small"
        )
    dev = resolve_device(device)
    start = time.perf_counter()
    model, history = train_cvae(train_split, config=config, seed=seed, device=dev, progress=progress)
    val = evaluate_cvae(model, val_split, seed=seed, device=dev)
    model = model.cpu().eval()
    metrics = {
        "model": config.model,
        "latent_dim": config.latent_dim,
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
