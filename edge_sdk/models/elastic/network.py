"""The static network of one elastic subnet (:class:`ElasticNet`: what a device trains, exports and
bundles) and the family's entry in :mod:`edge_sdk.models.arch`'s registry: ``build_model("mbv3:...")``
builds this network, freshly initialised (:data:`ELASTIC_FAMILY`).
"""

from __future__ import annotations

import json

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from edge_sdk.data import PIXEL_MEAN, PIXEL_STD
from edge_sdk.models.elastic.spec import PREFIX, SPACE, ElasticSpec, cost_of

__all__ = ["ELASTIC_FAMILY", "ElasticFamily", "ElasticNet"]

BN_EPS = 1e-5


class _Block(nn.Module):
    def __init__(self, cin: int, cout: int, kernel: int, expand: int, stride: int) -> None:
        super().__init__()
        hidden = cin * expand
        self.stride, self.residual = stride, stride == 1 and cin == cout
        self.expand = nn.Conv2d(cin, hidden, 1, bias=False)
        self.expand_bn = nn.BatchNorm2d(hidden, eps=BN_EPS)
        self.dw = nn.Conv2d(hidden, hidden, kernel, stride, kernel // 2, groups=hidden, bias=False)
        self.dw_bn = nn.BatchNorm2d(hidden, eps=BN_EPS)
        self.project = nn.Conv2d(hidden, cout, 1, bias=False)
        self.project_bn = nn.BatchNorm2d(cout, eps=BN_EPS)

    def forward(self, x: Tensor) -> Tensor:
        h = F.hardswish(self.expand_bn(self.expand(x)))
        h = F.hardswish(self.dw_bn(self.dw(h)))
        h = self.project_bn(self.project(h))
        return x + h if self.residual else h


class ElasticNet(nn.Module):
    """The static network of one :class:`ElasticSpec` (what a device trains, exports and bundles)."""

    def __init__(self, spec: ElasticSpec, input_shape: tuple[int, int, int], num_classes: int) -> None:
        super().__init__()
        spec.validate(input_shape)
        self.spec = spec
        self.stem = nn.Conv2d(input_shape[0], spec.stem, 3, 1, 1, bias=False)
        self.stem_bn = nn.BatchNorm2d(spec.stem, eps=BN_EPS)
        blocks = []
        cin = spec.stem
        for (width, stage_blocks), space in zip(spec.stages, SPACE.stages, strict=True):
            for j, (k, e) in enumerate(stage_blocks):
                blocks.append(_Block(cin, width, k, e, space.stride if j == 0 else 1))
                cin = width
        self.blocks = nn.Sequential(*blocks)
        self.head = nn.Linear(cin, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        x = (x - PIXEL_MEAN) / PIXEL_STD
        # channels-last: oneDNN's depthwise-conv backward runs faster in it on CPU (benchmarks/RESULTS.md,
        # "HAPFNAS on MNIST"); values are unchanged and the ONNX graph is the same
        x = F.hardswish(self.stem_bn(self.stem(x))).contiguous(memory_format=torch.channels_last)
        x = self.blocks(x)
        return self.head(x.mean(dim=(2, 3)))


class ElasticFamily:
    """The elastic family for :mod:`edge_sdk.models.arch`'s registry: ``mbv3:...``, JSON kind ``elastic``."""

    name = "elastic"
    prefix = PREFIX
    spec_type = ElasticSpec

    def parse(self, text: str) -> ElasticSpec:
        return ElasticSpec.parse(text)

    def from_json(self, text: str) -> ElasticSpec:
        return ElasticSpec.parse(json.loads(text)["spec"])

    def build(self, spec: ElasticSpec, input_shape: tuple[int, int, int], num_classes: int) -> nn.Module:
        return ElasticNet(spec, input_shape, num_classes)

    def cost(
        self, spec: ElasticSpec, input_shape: tuple[int, int, int], num_classes: int
    ) -> tuple[int, int] | None:
        return cost_of(spec, input_shape, num_classes)

    def with_num_classes(self, spec: ElasticSpec, num_classes: int) -> ElasticSpec:
        """``spec`` itself: a subnet's head is sized by :meth:`build`, not written in the spec."""
        return spec

    def problems(self, spec: ElasticSpec, input_shape: tuple[int, int, int]) -> list[str]:
        """None: an elastic spec is checked against its space when it is parsed or sampled."""
        return []


ELASTIC_FAMILY = ElasticFamily()
