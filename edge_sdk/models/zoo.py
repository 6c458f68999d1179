"""Named baseline models: the heterogeneous pool of the ``random-pool`` ablation (pFedZKD, Table 4).

The paper's pool holds two small CNNs, MobileNetV2, VGG11 and ResNet18. The named three are written here
compactly for small images (8x8 to 32x32) the way CIFAR variants are: a stride-1 3x3 stem, BatchNorm
after every convolution, and only as many 2x downsamplings as the input affords (later stages keep
stride 1), then a global average pool and one ``nn.Linear`` head. VGG11 and ResNet18 keep their usual
widths (they stand for the well-resourced devices of the pool); MobileNetV2 is built at width 0.5, the
light member. All architecture decisions happen in ``__init__`` from the static input shape, so
``forward`` has no data-dependent control flow and exports to ONNX.

Every model takes float32 pixels in [0, 1] (N x C x H x W), normalises inside and returns logits; its
final ``nn.Linear`` is ``model.head``. A zoo model is written ``zoo:<name>`` (:class:`ZooSpec`, the ``zoo``
family of :mod:`edge_sdk.models.arch`'s registry); its head is sized at build time, so the spec has no class
count.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from common.errors import SpecError
from edge_sdk.data import PIXEL_MEAN, PIXEL_STD
from edge_sdk.models.chain.spec import ChainSpec

__all__ = ["CNN1", "CNN2", "RANDOM_POOL", "ZOO", "ZOO_FAMILY", "ZooFamily", "ZooSpec", "build_zoo_model"]

PREFIX = "zoo:"

# pFedZKD section 4.3.1: CNN1 has two conv layers (32 and 64 channels) and a single FC layer.
CNN1 = ChainSpec.parse("C32k5-P-C64k5-P-F10")
# CNN2 stacks more convolutions and adds a 256-unit hidden FC layer before the head.
CNN2 = ChainSpec.parse("C32k3-C32k3-P-C64k3-C64k3-P-F256-F10")


def _halvings(size: int, min_size: int, *, ceil: bool) -> int:
    """How many stride-2 steps keep a ``size`` map at least ``min_size`` wide.

    Strided 3x3 convs (padding 1) give ceil(size / 2); 2x2 max pooling gives floor(size / 2).
    """
    count = 0
    while True:
        nxt = (size + 1) // 2 if ceil else size // 2
        if nxt < min_size:
            return count
        size, count = nxt, count + 1


def _conv_bn(cin: int, cout: int, kernel: int = 3, stride: int = 1, groups: int = 1) -> list[nn.Module]:
    return [
        nn.Conv2d(cin, cout, kernel, stride=stride, padding=kernel // 2, groups=groups, bias=False),
        nn.BatchNorm2d(cout),
    ]


class _Classifier(nn.Module):
    """Shared tail: normalise -> ``features`` -> global average pool -> ``head``."""

    features: nn.Module
    head: nn.Linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: N x C x H x W in [0, 1]
        x = self.features((x - PIXEL_MEAN) / PIXEL_STD)
        return self.head(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1))


# ----------------------------------------------------------------------------------------------- VGG11

_VGG11 = (64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M")


class VGG11(_Classifier):
    """VGG11 with BatchNorm; max pools that would shrink the map below 1x1 are dropped (the last ones)."""

    def __init__(self, input_shape: tuple[int, int, int], num_classes: int) -> None:
        super().__init__()
        c, h, w = input_shape
        pools = _halvings(min(h, w), 1, ceil=False)
        layers: list[nn.Module] = []
        for item in _VGG11:
            if item == "M":
                if pools > 0:
                    layers.append(nn.MaxPool2d(2))
                    pools -= 1
                continue
            layers += [*_conv_bn(c, int(item)), nn.ReLU(inplace=True)]
            c = int(item)
        self.features = nn.Sequential(*layers)
        self.head = nn.Linear(c, num_classes)


# -------------------------------------------------------------------------------------------- ResNet18


class _BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.body = nn.Sequential(
            *_conv_bn(cin, cout, 3, stride), nn.ReLU(inplace=True), *_conv_bn(cout, cout)
        )
        self.shortcut = (
            nn.Sequential(*_conv_bn(cin, cout, 1, stride)) if stride != 1 or cin != cout else nn.Identity()
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.body(x) + self.shortcut(x))


class ResNet18(_Classifier):
    """CIFAR-style ResNet18 (stride-1 3x3 stem, no stem pool); stages 2-4 downsample while the map is >= 4."""

    def __init__(self, input_shape: tuple[int, int, int], num_classes: int) -> None:
        super().__init__()
        c, h, w = input_shape
        downs = _halvings(min(h, w), 4, ceil=True)
        layers: list[nn.Module] = [*_conv_bn(c, 64), nn.ReLU(inplace=True)]
        cin = 64
        for stage, cout in enumerate((64, 128, 256, 512)):
            stride = 2 if 1 <= stage <= downs else 1
            layers += [_BasicBlock(cin, cout, stride), _BasicBlock(cout, cout, 1)]
            cin = cout
        self.features = nn.Sequential(*layers)
        self.head = nn.Linear(cin, num_classes)


# ----------------------------------------------------------------------------------------- MobileNetV2


class _InvertedResidual(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int, expand: int) -> None:
        super().__init__()
        mid = cin * expand
        layers: list[nn.Module] = []
        if expand != 1:
            layers += [*_conv_bn(cin, mid, 1), nn.ReLU6(inplace=True)]
        layers += [
            *_conv_bn(mid, mid, 3, stride, groups=mid),
            nn.ReLU6(inplace=True),
            *_conv_bn(mid, cout, 1),
        ]
        self.body = nn.Sequential(*layers)
        self.residual = stride == 1 and cin == cout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.body(x)
        return x + out if self.residual else out  # decided in __init__: static for tracing


# (expansion, channels at width 1.0, blocks, stride) as in Sandler et al.; the stride-2 entries are the
# candidate downsamplings, used in order while the map stays >= 4 (3 of 4 at 32x32, like CIFAR variants).
_MBV2 = (
    (1, 16, 1, 1),
    (6, 24, 2, 2),
    (6, 32, 3, 2),
    (6, 64, 4, 2),
    (6, 96, 3, 1),
    (6, 160, 3, 2),
    (6, 320, 1, 1),
)


def _width(channels: float, divisor: int = 8) -> int:
    """Round to a multiple of ``divisor`` (never dropping more than 10%), as the reference does."""
    out = max(divisor, int(channels + divisor / 2) // divisor * divisor)
    return out + divisor if out < 0.9 * channels else out


class MobileNetV2(_Classifier):
    """MobileNetV2 at width 0.5 with a stride-1 stem for small inputs."""

    def __init__(self, input_shape: tuple[int, int, int], num_classes: int, width: float = 0.5) -> None:
        super().__init__()
        c, h, w = input_shape
        downs = _halvings(min(h, w), 4, ceil=True)
        cin = _width(32 * width)
        layers: list[nn.Module] = [*_conv_bn(c, cin), nn.ReLU6(inplace=True)]
        for expand, channels, blocks, stride in _MBV2:
            cout = _width(channels * width)
            for i in range(blocks):
                s = 1
                if i == 0 and stride == 2:
                    s = 2 if downs > 0 else 1
                    downs -= 1
                layers.append(_InvertedResidual(cin, cout, s, expand))
                cin = cout
        last = _width(1280 * max(1.0, width))  # the reference keeps the last conv at 1280 below width 1
        layers += [*_conv_bn(cin, last, 1), nn.ReLU6(inplace=True)]
        self.features = nn.Sequential(*layers)
        self.head = nn.Linear(last, num_classes)


ZOO: dict[str, Callable[[tuple[int, int, int], int], nn.Module]] = {
    "mobilenetv2": MobileNetV2,
    "vgg11": VGG11,
    "resnet18": ResNet18,
}

RANDOM_POOL: tuple[str, ...] = (str(CNN1), str(CNN2), "zoo:mobilenetv2", "zoo:vgg11", "zoo:resnet18")


def build_zoo_model(name: str, input_shape: tuple[int, int, int], num_classes: int) -> nn.Module:
    """Build the named zoo model for a (C, H, W) input and ``num_classes`` outputs."""
    if name not in ZOO:
        raise SpecError(f"unknown zoo model {name!r}; expected one of {sorted(ZOO)}")
    shape = tuple(int(v) for v in input_shape)
    if len(shape) != 3 or min(shape) < 1:
        raise SpecError(f"input_shape must be (C, H, W) with positive sizes, got {input_shape!r}")
    if num_classes < 1:
        raise SpecError(f"num_classes must be >= 1, got {num_classes}")
    return ZOO[name](shape, num_classes)  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------------- the family


@dataclass(frozen=True)
class ZooSpec:
    """A named architecture from :data:`ZOO` (e.g. ``zoo:resnet18``)."""

    name: str

    def __str__(self) -> str:
        return f"{PREFIX}{self.name}"

    def to_json(self) -> str:
        return json.dumps({"kind": "zoo", "name": self.name}, sort_keys=True)

    def validate(self, input_shape: tuple[int, int, int] | None = None) -> ZooSpec:
        if self.name not in ZOO:
            raise SpecError(f"unknown zoo model {self.name!r}; expected one of {sorted(ZOO)}")
        return self


class ZooFamily:
    """The zoo family for :mod:`edge_sdk.models.arch`'s registry: ``zoo:<name>``, JSON kind ``zoo``."""

    name = "zoo"
    prefix = PREFIX
    spec_type = ZooSpec

    def parse(self, text: str) -> ZooSpec:
        return ZooSpec(text[len(self.prefix) :]).validate()

    def from_json(self, text: str) -> ZooSpec:
        return ZooSpec(json.loads(text)["name"]).validate()

    def build(self, spec: ZooSpec, input_shape: tuple[int, int, int], num_classes: int) -> nn.Module:
        return build_zoo_model(spec.validate().name, input_shape, num_classes)

    def cost(
        self, spec: ZooSpec, input_shape: tuple[int, int, int], num_classes: int
    ) -> tuple[int, int] | None:
        """None: zoo models have no analytic cost; count them on a built model (the meta device will do)."""
        return None

    def with_num_classes(self, spec: ZooSpec, num_classes: int) -> ZooSpec:
        """``spec`` itself: a zoo model's head is sized by :meth:`build`, not written in the spec."""
        return spec

    def problems(self, spec: ZooSpec, input_shape: tuple[int, int, int]) -> list[str]:
        """None before building: a zoo model adapts to any input shape (its name is checked by parse)."""
        return []


ZOO_FAMILY = ZooFamily()
