"""Data-free supernet training on the server (HAPFNAS section 4.1.2, with our synthetic data).

HAPFNAS distils the ensemble of client models into the elastic supernet on a public unlabeled set with
the sandwich rule and inplace distillation (Eq. 6): every step, the largest subnet learns the ensemble's
mean logits, and the smallest plus ``random_subnets`` uniformly drawn subnets learn the largest subnet's
(detached) output; KL at temperature ``distill_tau`` (1.0 in the paper). We have no public data, so the
inputs are the aggregation's synthetic set (``synthetic.npz``); a public unlabeled ``.npz`` can be given
instead. The trained supernet is written with
:func:`edge_sdk.models.elastic.supernet_file.save_supernet` (safetensors, no pickle).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch
from torch import Tensor, nn
from tqdm.auto import tqdm

from common.device import check_device, resolve_device
from common.errors import ConfigError, DataError
from common.loop import adam, step
from common.seeding import seeded
from common.torch_utils import batched_logits
from edge_sdk.models.elastic.space import sample_elastic
from edge_sdk.models.elastic.spec import largest, smallest
from edge_sdk.models.elastic.supernet import SuperNet
from edge_sdk.models.elastic.supernet_file import save_supernet
from edge_sdk.train import kd_loss_logits
from export.atomic import atomic_write_json
from server_kit.synthesis import SYNTHETIC_FILE, load_synthetic
from server_kit.teachers import load_teachers

__all__ = ["SupernetConfig", "supernet_from_bundles", "train_supernet"]


@dataclass(frozen=True, kw_only=True)
class SupernetConfig:
    """Sandwich-rule training knobs (Adam; ``random_subnets`` is k of Eq. 6, ``distill_tau`` the KL
    temperature)."""

    # fields renamed, old name -> new (common.configs: the old key and flag are refused naming the new)
    renamed_keys: ClassVar[dict[str, str]] = {"tau": "distill_tau"}

    steps: int = 300  # sandwich-rule steps
    batch_size: int = 64
    lr: float = 1e-3  # Adam learning rate
    random_subnets: int = 2  # k random subnets per step
    # distillation temperature: of the KL from the teachers' mean to the largest subnet, and from it to
    # the others
    distill_tau: float = 1.0
    seed: int = 0
    device: str = "auto"  # auto (CUDA when present), cpu, cuda or cuda:N

    def __post_init__(self) -> None:
        check_device(self.device)
        for name, low in (("steps", 1), ("batch_size", 2), ("random_subnets", 0), ("seed", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ConfigError(f"{name} must be an integer >= {low}, got {value!r}")
        for name in ("lr", "distill_tau"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
                raise ConfigError(f"{name} must be a positive number, got {value!r}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _ensemble_logits(teachers: Sequence[nn.Module], x: Tensor, device: torch.device) -> Tensor:
    total = torch.zeros(0)
    for module in teachers:
        out = batched_logits(module, x, device=device)
        total = out if total.numel() == 0 else total + out
    return total / len(teachers)  # N x L, HAPFNAS: the mean of the client logits


def train_supernet(
    teachers: Sequence[nn.Module],
    x: Tensor,
    *,
    input_shape: tuple[int, int, int],
    num_classes: int,
    config: SupernetConfig,
    progress: bool = False,
    device: torch.device | None = None,
) -> tuple[SuperNet, list[float]]:
    """Train a fresh supernet on ``x`` (float N x C x H x W in [0, 1]); returns it (eval mode) and the
    summed sandwich loss of every step. ``device``: the caller's, resolved once (else ``config.device``)."""
    if not teachers:
        raise ConfigError("supernet training needs at least one teacher")
    if x.ndim != 4 or len(x) < 2:
        raise DataError(f"x must be N x C x H x W with N >= 2, got {tuple(x.shape)}")
    device = resolve_device(config.device) if device is None else device
    targets = _ensemble_logits(teachers, x, device)
    with seeded(config.seed):
        supernet = SuperNet(input_shape, num_classes)
    supernet.to(device).train()
    optimizer = adam(supernet.parameters(), lr=config.lr)
    gen = torch.Generator().manual_seed(config.seed)
    rng = np.random.default_rng(config.seed)
    big, small = largest(), smallest()
    x_dev, t_dev = x.to(device), targets.to(device)
    losses: list[float] = []
    with seeded(config.seed, device):
        for _ in tqdm(range(config.steps), desc="supernet", unit="step", disable=not progress):
            idx = torch.randint(len(x), (config.batch_size,), generator=gen).to(device)
            xb = x_dev[idx]
            out_large = supernet(xb, big)
            loss = kd_loss_logits(out_large, t_dev[idx], config.distill_tau)  # ensemble -> largest
            guide = out_large.detach()
            for spec in [small, *(sample_elastic(rng) for _ in range(config.random_subnets))]:
                guided = kd_loss_logits(supernet(xb, spec), guide, config.distill_tau)
                loss = loss + guided  # inplace distillation
            step(optimizer, loss)
            losses.append(float(loss.detach()))
    return supernet.cpu().eval(), losses


def supernet_from_bundles(
    bundle_paths: Sequence[str | Path],
    out: str | Path,
    *,
    aggregate_dir: str | Path | None = None,
    unlabeled: str | Path | None = None,
    config: SupernetConfig,
    progress: bool = False,
) -> dict[str, Any]:
    """`server-kit supernet`: teachers from the bundles, inputs from the aggregation's synthetic set (or
    a public unlabeled ``.npz`` with uint8 ``x``); writes the supernet file and ``<out>.json``."""
    t0 = time.perf_counter()
    device = resolve_device(config.device)  # once: the teachers and the training use it
    teachers, skipped = load_teachers(bundle_paths, device=device)
    shape = tuple(teachers[0].bundle.input_shape)
    classes = teachers[0].bundle.num_classes
    if unlabeled is not None:
        with np.load(Path(unlabeled)) as data:
            if "x" not in data or data["x"].dtype != np.uint8:
                raise DataError(f"{unlabeled} must hold uint8 images under 'x' (N x C x H x W)")
            x = torch.from_numpy(data["x"]).float() / 255.0
        source = f"unlabeled:{Path(unlabeled).name}"
    elif aggregate_dir is not None:
        x = load_synthetic(Path(aggregate_dir) / SYNTHETIC_FILE).x
        source = "synthetic"
    else:
        raise ConfigError("give the aggregation directory (its synthetic set) or an unlabeled .npz")
    if tuple(x.shape[1:]) != shape:
        raise DataError(f"inputs are {tuple(x.shape[1:])} but the teachers take {shape}")
    supernet, losses = train_supernet(
        [t.module for t in teachers],
        x,
        input_shape=shape,  # type: ignore[arg-type]
        num_classes=classes,
        config=config,
        progress=progress,
        device=device,
    )
    provenance = {"data": source, "teachers": len(teachers), "steps": config.steps, "seed": config.seed}
    path = save_supernet(supernet, out, provenance=provenance)
    report = {
        "config": config.to_dict(),
        "data": source,
        "inputs": len(x),
        "teachers": [t.name for t in teachers],
        "skipped": [{"file": p, "reason": r} for p, r in skipped],
        "loss": losses[:: max(1, len(losses) // 100)],
        "seconds": time.perf_counter() - t0,
        "file": path.name,
    }
    atomic_write_json(path.with_name(path.name + ".json"), report)
    return report
