"""Evolution's fitness without training (HAPFNAS): a subnet with the supernet's weights, its BatchNorm
statistics re-estimated on the local training split, scored on the validation split."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from common.errors import SpecError
from edge_sdk.data import ArrayDataset
from edge_sdk.models.arch import ArchSpec, family_of
from edge_sdk.models.elastic.network import ELASTIC_FAMILY
from edge_sdk.models.elastic.supernet import SuperNet, extract
from edge_sdk.train import evaluate, to_float

__all__ = ["recalibrate_bn", "supernet_proxy"]


@torch.no_grad()
def recalibrate_bn(
    model: nn.Module, data: ArrayDataset, *, batches: int, batch_size: int = 64, seed: int = 0
) -> None:
    """Reset every BatchNorm's running statistics and re-estimate them on ``batches`` batches of ``data``
    (cumulative average), the standard fix for subnet-specific statistics of weight-shared models."""
    norms = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    for bn in norms:
        bn.reset_running_stats()
        bn.momentum = None  # cumulative moving average over the calibration batches
    model.train()
    order = torch.randperm(len(data), generator=torch.Generator().manual_seed(seed))
    for i in range(batches):
        idx = order[i * batch_size : (i + 1) * batch_size]
        if idx.numel() < 2:
            break
        model(to_float(data.x[idx]))
    for bn in norms:
        bn.momentum = 0.1
    model.eval()


def supernet_proxy(
    supernet: SuperNet, train: ArrayDataset, val: ArrayDataset, *, batches: int = 8, seed: int = 0
) -> Callable[[ArchSpec], float]:
    """fitness(spec): validation cross-entropy of the extracted subnet, BN recalibrated on ``train``."""

    def fitness(spec: ArchSpec) -> float:
        if family_of(spec) is not ELASTIC_FAMILY:
            raise SpecError(f"the supernet proxy scores subnets of the elastic space only, got {spec}")
        model = extract(supernet, spec)
        recalibrate_bn(model, train, batches=batches, seed=seed)
        return evaluate(model, val)[0]

    return fitness
