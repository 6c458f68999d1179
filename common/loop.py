"""The one minibatch loop: epochs of seeded permutations of preloaded tensors, one optimizer step a batch.

Every epoch-based trainer of the toolkit holds its whole training set on the device and trains on index
batches of a permutation drawn from its own ``torch.Generator``: no DataLoader, no worker processes. The
permutation is drawn on the CPU, so the batch order is the same on every device. :func:`fit` runs the
device's classifier and CVAE, the server's distillation and fusion: they differ only in the loss of a
batch, so that is what they pass in; :func:`fit_terms` (the loop itself) runs the personalizations, whose
loss is a sum of named terms each with its own curve. Step-based trainers (inversion, generator,
supernet), which draw a fresh batch every step rather than walk epochs, use :func:`step`.

The loop does not seed torch's global RNG (Dropout, weight init): a caller that needs it wraps the call in
:func:`common.seeding.seeded`, whose scope it knows.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import Tensor
from tqdm.auto import tqdm

from common.errors import ConfigError

__all__ = ["LONE_LAST", "adam", "batches_per_epoch", "fit", "fit_terms", "minibatches", "sgd", "step"]

# what becomes of a trailing batch of one sample, which BatchNorm cannot normalise on 1x1 maps: kept,
# merged into the batch before it, or dropped (every batch of one is dropped, so batch size 1 trains nothing)
LONE_LAST = ("keep", "merge", "drop")


def minibatches(
    n: int,
    batch_size: int,
    *,
    generator: torch.Generator,
    device: torch.device | None = None,
    lone_last: str = "keep",
) -> list[Tensor]:
    """One epoch: a permutation of ``range(n)`` drawn from ``generator`` (one ``randperm`` draw, on the
    CPU), cut into ``batch_size`` index slices, moved to ``device`` when given.

    Drawn whole before the first batch, so a loss that draws from the same generator (augmentation) draws
    after it, as a hand-written loop would.
    """
    bounds = _bounds(n, batch_size, lone_last)
    order = torch.randperm(n, generator=generator)
    if device is not None:
        order = order.to(device)
    return [order[start:stop] for start, stop in bounds]


def batches_per_epoch(n: int, batch_size: int, *, lone_last: str = "keep") -> int:
    """The number of batches (optimizer steps) :func:`minibatches` cuts an epoch into: what a learning-
    rate schedule over a whole training run counts its steps in."""
    return len(_bounds(n, batch_size, lone_last))


def _bounds(n: int, batch_size: int, lone_last: str) -> list[tuple[int, int]]:
    if lone_last not in LONE_LAST:
        raise ConfigError(f"lone_last must be one of {LONE_LAST}, got {lone_last!r}")
    bounds = [(start, min(start + batch_size, n)) for start in range(0, n, batch_size)]
    if lone_last == "merge" and len(bounds) > 1 and bounds[-1][1] - bounds[-1][0] == 1:
        bounds[-2:] = [(bounds[-2][0], n)]
    elif lone_last == "drop":
        bounds = [(start, stop) for start, stop in bounds if stop - start >= 2]
    return bounds


def adam(
    params: Iterable[Tensor],
    *,
    lr: float,
    weight_decay: float = 0.0,
    betas: tuple[float, float] = (0.9, 0.999),
) -> torch.optim.Adam:
    """The toolkit's Adam: torch's, with the fused update on every device.

    On a CPU torch's default updates one parameter at a time, a dozen small ops each; the multi-tensor
    (``foreach``) form still makes one pass over the moments per op. The fused kernel makes one pass per
    parameter, the same formula to float32 rounding: a small model with wide dense layers (the CVAE)
    spends a large share of its step in the update (benchmarks/RESULTS.md, "The device's time, not only
    its FLOPs")."""
    return torch.optim.Adam(params, lr=lr, betas=betas, weight_decay=weight_decay, fused=True)


def sgd(params: Iterable[Tensor], *, lr: float, momentum: float = 0.0) -> torch.optim.SGD:
    """The toolkit's SGD, with the multi-tensor update (one pass over the parameters per op, not a loop
    over them)."""
    return torch.optim.SGD(params, lr=lr, momentum=momentum, foreach=True)


def step(optimizer: torch.optim.Optimizer, loss: Tensor) -> None:
    """One optimizer step on ``loss``: gradients cleared (set to None), back-propagated, applied."""
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()


def fit_terms(
    terms_fn: Callable[[Tensor], dict[str, Tensor]],
    optimizer: torch.optim.Optimizer,
    *,
    n: int,
    batch_size: int,
    epochs: int,
    generator: torch.Generator,
    device: torch.device,
    lone_last: str = "keep",
    desc: str = "train",
    progress: bool = False,
    stop: Callable[[], bool] | None = None,
    logged: tuple[str, ...] = (),
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
    after_step: Callable[[], None] | None = None,
) -> list[dict[str, float]]:
    """The loop. Train for ``epochs`` of :func:`minibatches`; returns, per epoch, the mean of each named
    term over the samples of the epoch.

    ``terms_fn(idx)`` gives the named scalar terms of the batch of samples ``idx`` (on ``device``); the
    optimizer steps on their sum (in the dict's order) but for the ``logged`` ones, which get a curve only
    (the parts of a loss the caller wants to see apart, detached); the model and its data are the caller's.
    Each epoch draws one permutation from ``generator``, before anything ``terms_fn`` draws from it. The
    terms are summed on the device, weighted by batch size (no host sync per step), and read once at the
    epoch's end.

    ``stop()`` (a time budget's :meth:`common.timing.Deadline.expired`) is asked after every epoch but the
    last: True ends the training there, so the epoch during which a budget runs out is the last one and
    at least one epoch always runs. ``scheduler`` (over ``optimizer``) steps after every optimizer step:
    a schedule counts batches, so it decays as smoothly over a short run as over a long one.
    ``after_step()`` runs after every optimizer step (and the scheduler's): what follows the weights
    step by step, such as a moving average of them.
    """
    history: list[dict[str, float]] = []
    bar = tqdm(range(epochs), desc=desc, unit="epoch", disable=not progress, leave=False)
    for epoch in bar:
        if epoch > 0 and stop is not None and stop():
            break
        totals: dict[str, Tensor] = {}
        seen = 0
        batches = minibatches(n, batch_size, generator=generator, device=device, lone_last=lone_last)
        for idx in batches:
            terms = terms_fn(idx)
            trained = [value for name, value in terms.items() if name not in logged]
            if not trained or not terms.keys() >= set(logged):
                raise ConfigError(
                    f"logged must name terms of the loss and leave one to train on, got {list(logged)} "
                    f"of the terms {list(terms)}; fix: log only some of the terms terms_fn returns"
                )
            step(optimizer, sum(trained))  # type: ignore[arg-type]
            if scheduler is not None:
                scheduler.step()
            if after_step is not None:
                after_step()
            for name, value in terms.items():
                weighted = value.detach() * len(idx)
                totals[name] = totals[name] + weighted if name in totals else weighted
            seen += len(idx)
        if seen == 0:
            raise ConfigError(
                f"an epoch of {n} samples in batches of {batch_size} (lone_last={lone_last!r}) has no batch "
                "to train on; fix: a batch size of at least 2, or more samples"
            )
        history.append({name: float(total) / seen for name, total in totals.items()})
        bar.set_postfix({name: f"{value:.4g}" for name, value in history[-1].items()})
    return history


def fit(
    loss_fn: Callable[[Tensor], Tensor],
    optimizer: torch.optim.Optimizer,
    *,
    n: int,
    batch_size: int,
    epochs: int,
    generator: torch.Generator,
    device: torch.device,
    lone_last: str = "keep",
    desc: str = "train",
    progress: bool = False,
    stop: Callable[[], bool] | None = None,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
    after_step: Callable[[], None] | None = None,
) -> list[float]:
    """:func:`fit_terms` with one term, ``loss_fn(idx)``: the mean loss of each epoch over its samples."""
    history = fit_terms(
        lambda idx: {"loss": loss_fn(idx)},
        optimizer,
        n=n,
        batch_size=batch_size,
        epochs=epochs,
        generator=generator,
        device=device,
        lone_last=lone_last,
        desc=desc,
        progress=progress,
        stop=stop,
        scheduler=scheduler,
        after_step=after_step,
    )
    return [epoch["loss"] for epoch in history]
