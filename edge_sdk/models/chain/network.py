"""The chain family's torch modules (:class:`ChainNet`, :class:`ResidualBlock`) and its entry in
:mod:`edge_sdk.models.arch`'s registry (:data:`CHAIN_FAMILY`): what a :class:`~.spec.ChainSpec` builds.
"""

from __future__ import annotations

import torch
from torch import nn

from edge_sdk.data import PIXEL_MEAN, PIXEL_STD
from edge_sdk.models.chain.spec import ChainSpec, Conv, Dense, Pool, Residual

__all__ = ["CHAIN_FAMILY", "ChainFamily", "ChainNet", "ResidualBlock"]

DROPOUT = 0.3


class ResidualBlock(nn.Module):
    """The torch module of a :class:`Residual` module (stride 1, same padding)."""

    def __init__(self, in_channels: int, layer: Residual) -> None:
        super().__init__()
        out, k = layer.out_channels, layer.kernel_size
        self.conv1 = nn.Conv2d(in_channels, out, k, padding=k // 2, bias=False)
        self.bn1 = nn.BatchNorm2d(out)
        self.conv2 = nn.Conv2d(out, out, k, padding=k // 2, bias=False)
        self.bn2 = nn.BatchNorm2d(out)
        self.shortcut: nn.Module = nn.Identity()
        if in_channels != out:
            self.shortcut = nn.Sequential(nn.Conv2d(in_channels, out, 1, bias=False), nn.BatchNorm2d(out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(y)) + self.shortcut(x))


class ChainNet(nn.Module):
    """The torch module of a :class:`ChainSpec`. ``features`` (conv/pool), then ``classifier`` (FC)."""

    def __init__(self, spec: ChainSpec, input_shape: tuple[int, int, int], num_classes: int) -> None:
        super().__init__()
        spec = spec.with_num_classes(num_classes).validate(input_shape)
        c, h, w = input_shape
        feats: list[nn.Module] = []
        dense: list[Dense] = []
        for layer in spec.layers:
            if isinstance(layer, Conv):
                k = layer.kernel_size
                feats += [
                    nn.Conv2d(c, layer.out_channels, k, padding=k // 2, bias=False),
                    nn.BatchNorm2d(layer.out_channels),
                    nn.ReLU(inplace=True),
                ]
                c = layer.out_channels
            elif isinstance(layer, Residual):
                feats.append(ResidualBlock(c, layer))
                c = layer.out_channels
            elif isinstance(layer, Pool):
                feats.append(nn.MaxPool2d(2) if layer.kind == "max" else nn.AvgPool2d(2))
                h, w = h // 2, w // 2
            else:
                dense.append(layer)
        self.spec = spec
        self.features = nn.Sequential(*feats)
        cls: list[nn.Module] = []
        width = c * h * w
        for layer in dense[:-1]:
            cls += [nn.Linear(width, layer.units), nn.ReLU(inplace=True), nn.Dropout(DROPOUT)]
            width = layer.units
        cls.append(nn.Linear(width, num_classes))
        self.classifier = nn.Sequential(*cls)

    @property
    def head(self) -> nn.Linear:
        return self.classifier[-1]  # type: ignore[return-value]

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: N x C x H x W in [0, 1]
        x = (x - PIXEL_MEAN) / PIXEL_STD
        x = self.features(x)
        return self.classifier(torch.flatten(x, 1))


class ChainFamily:
    """The chain family for :mod:`edge_sdk.models.arch`'s registry: unprefixed strings, JSON kind
    ``chain``."""

    name = "chain"
    prefix = None  # the registry's default: any string no other family claims
    spec_type = ChainSpec

    def parse(self, text: str) -> ChainSpec:
        return ChainSpec.parse(text)

    def from_json(self, text: str) -> ChainSpec:
        return ChainSpec.from_json(text)

    def build(self, spec: ChainSpec, input_shape: tuple[int, int, int], num_classes: int) -> nn.Module:
        return ChainNet(spec, input_shape, num_classes)

    def cost(
        self, spec: ChainSpec, input_shape: tuple[int, int, int], num_classes: int
    ) -> tuple[int, int] | None:
        """:meth:`ChainSpec.cost`; the head's size is the spec's own (resize it first for another task)."""
        return spec.cost(input_shape)

    def with_num_classes(self, spec: ChainSpec, num_classes: int) -> ChainSpec:
        return spec.with_num_classes(num_classes)

    def problems(self, spec: ChainSpec, input_shape: tuple[int, int, int]) -> list[str]:
        return spec.problems(input_shape)


CHAIN_FAMILY = ChainFamily()
