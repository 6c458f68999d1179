"""Consensus soft labels and multi-teacher distillation into the student (pFedZKD section 3.3.2-3.3.3).

Every pseudo-image is labelled by all teachers, not only the one that generated it: the mean of the
teachers' temperature-softened predictions averages out the inversion errors of single models. With
``class_weights`` a teacher's vote for class c is scaled by its share of the federation's examples of c
(from the bundles' label counts), so a client that never saw a class cannot out-vote one that did.
The student then minimises KL(consensus || softmax(student / tau)) over the synthetic set (Algorithm 4).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from edge_sdk.train import kd_loss
from profiles.errors import ConfigError

__all__ = ["DistillConfig", "consensus", "distill", "label_count_weights"]


def _resolve_device(device: str | torch.device) -> torch.device:
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def label_count_weights(label_counts: Sequence[Sequence[int]]) -> Tensor:
    """K x L vote weights: teacher k's share of the federation's examples of class c (columns sum to 1).

    A class no teacher has examples of gets uniform weights 1/K (every teacher is equally uninformed).
    """
    counts = torch.as_tensor([list(row) for row in label_counts], dtype=torch.float64)  # K x L
    if counts.ndim != 2 or counts.shape[0] < 1 or counts.shape[1] < 2:
        raise ConfigError(f"label_counts must be K x L with K >= 1, L >= 2, got shape {tuple(counts.shape)}")
    if (counts < 0).any() or not torch.isfinite(counts).all():
        raise ConfigError("label_counts must be finite and >= 0")
    total = counts.sum(dim=0, keepdim=True)  # 1 x L
    uniform = torch.full_like(counts, 1.0 / counts.shape[0])
    return torch.where(total > 0, counts / total.clamp(min=1.0), uniform).float()


@torch.no_grad()
def consensus(
    modules: Sequence[nn.Module],
    x: Tensor,
    *,
    tau: float,
    class_weights: Tensor | None = None,
    batch_size: int = 512,
    device: str | torch.device = "cpu",
) -> Tensor:
    """N x L consensus soft labels: mean over teachers of softmax(T_k(x) / tau) (Algorithm 4, step 2).

    With ``class_weights`` (K x L, see :func:`label_count_weights`) p_c = sum_k w_kc p_kc, rows then
    renormalised to sum to 1. Modules are evaluated in eval mode; their training flag is restored.
    """
    if not modules:
        raise ConfigError("consensus needs at least one teacher")
    if tau <= 0:
        raise ConfigError(f"tau must be > 0, got {tau}")
    if batch_size < 1:
        raise ConfigError(f"batch_size must be >= 1, got {batch_size}")
    dev = _resolve_device(device)
    if class_weights is not None and class_weights.shape[0] != len(modules):
        raise ConfigError(f"class_weights has {class_weights.shape[0]} rows for {len(modules)} teachers")
    total: Tensor | None = None  # N x L, float64 accumulator
    for k, module in enumerate(modules):
        was_training = module.training
        module.eval().to(dev)
        probs = torch.cat(
            [
                F.softmax(module(x[i : i + batch_size].to(dev)).double() / tau, dim=1).cpu()
                for i in range(0, x.shape[0], batch_size)
            ]
        )  # N x L
        module.train(was_training)
        if class_weights is not None:
            if class_weights.shape[1] != probs.shape[1]:
                raise ConfigError(
                    f"class_weights has {class_weights.shape[1]} classes, teacher {k} {probs.shape[1]}"
                )
            probs = probs * class_weights[k].double()  # N x L, vote of k for c scaled by w_kc
        if total is not None and total.shape != probs.shape:
            raise ConfigError(f"teacher {k} predicts {probs.shape[1]} classes, teacher 0 {total.shape[1]}")
        total = probs if total is None else total + probs
    assert total is not None
    if class_weights is None:
        return (total / len(modules)).float()
    return (total / total.sum(dim=1, keepdim=True).clamp(min=1e-300)).float()


@dataclass(frozen=True, kw_only=True)
class DistillConfig:
    """Student training on (X, Y). ``tau`` is the distillation temperature (the paper uses 4)."""

    epochs: int
    batch_size: int = 64
    lr: float = 1e-3
    tau: float = 4.0
    hard_labels: bool = False  # the "w/o ZSKD" ablation: CE on class indices instead of KL on soft labels
    weight_decay: float = 0.0

    def __post_init__(self) -> None:
        for name in ("epochs", "batch_size"):
            value = getattr(self, name)
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

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def distill(
    student: nn.Module,
    x: Tensor,
    targets: Tensor,
    *,
    config: DistillConfig,
    seed: int,
    device: str | torch.device = "cpu",
    progress: bool = False,
) -> list[float]:
    """Train ``student`` in place on (x, targets); returns the mean loss of every epoch.

    ``targets``: N x L soft labels (KL, tau-scaled) or, with ``config.hard_labels``, N int64 class
    indices (cross entropy). Dropout and shuffling draw from ``seed`` inside a forked RNG scope, so the
    same seed gives the same student and the caller's global RNG state is untouched. The student is
    left in eval mode.
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
    dev = _resolve_device(device)
    student.to(dev).train()
    optimizer = torch.optim.Adam(student.parameters(), lr=config.lr, weight_decay=config.weight_decay)
    gen = torch.Generator().manual_seed(seed)
    x_dev, y_dev = x.to(dev), targets.to(dev)  # preloaded once; batches are index gathers
    history: list[float] = []
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=config.epochs, desc="distill", unit="epoch")
    fork_devices = (
        [dev.index if dev.index is not None else torch.cuda.current_device()] if dev.type == "cuda" else []
    )
    with torch.random.fork_rng(devices=fork_devices):
        torch.manual_seed(seed)  # dropout stream, scoped by fork_rng
        for _ in range(config.epochs):
            order = torch.randperm(n, generator=gen).to(dev)
            total, seen = torch.zeros((), device=dev), 0  # summed on device: no sync per batch
            for i in range(0, n, config.batch_size):
                idx = order[i : i + config.batch_size]
                if idx.numel() < 2:  # a lone trailing sample: BatchNorm cannot train on batch 1
                    continue
                logits = student(x_dev[idx])  # B x L
                if config.hard_labels:
                    loss = F.cross_entropy(logits, y_dev[idx])
                else:
                    loss = kd_loss(logits, y_dev[idx], config.tau)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                total += loss.detach() * idx.numel()
                seen += idx.numel()
            history.append(float(total) / seen)
            if bar is not None:
                bar.set_postfix(loss=f"{history[-1]:.4f}")
                bar.update(1)
    if bar is not None:
        bar.close()
    student.eval()
    return history
