"""The elastic MobileNetV3-like space of HAPFNAS (AttentiveNAS / Once-for-All style) for small inputs: its
spec, its choices and its cost.

A subnet is data, like a chain spec::

    mbv3:s16-24:k3e4-32:k5e3.k3e6-48:k3e4.k7e3-96:k5e6.k3e3

``s16`` is the stem width (conv 3x3 + BN + Hardswish); then one token per stage, ``width:blocks``, each
block ``k{kernel}e{expand}`` an inverted residual (1x1 expand, kxk depthwise with the stage's stride on
the first block, 1x1 project; a skip connection when shape allows), so a stage's depth is its number of
blocks. :data:`SPACE` fixes the choices: stem width, per-stage widths, depths and strides, kernels
{3, 5, 7} and expansion ratios {3, 4, 6}. Global average pooling and a linear head close the network.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from common.errors import SpecError

__all__ = ["EXPANDS", "KERNELS", "SPACE", "ElasticSpec", "StageSpace", "cost_of", "largest", "smallest"]

PREFIX = "mbv3:"
KERNELS = (3, 5, 7)
EXPANDS = (3, 4, 6)


@dataclass(frozen=True)
class StageSpace:
    widths: tuple[int, ...]
    depths: tuple[int, ...]
    stride: int


@dataclass(frozen=True)
class Space:
    stem_widths: tuple[int, ...]
    stages: tuple[StageSpace, ...]


# Four stages take 28x28 / 32x32 inputs to 4x4; widths and depths scaled down from AttentiveNAS's space
# (which targets 224x224 ImageNet) so the largest subnet stays within a Jetson-class training budget.
SPACE = Space(
    stem_widths=(16, 24),
    stages=(
        StageSpace(widths=(16, 24), depths=(1, 2), stride=1),
        StageSpace(widths=(24, 32), depths=(1, 2, 3), stride=2),
        StageSpace(widths=(32, 48), depths=(2, 3, 4), stride=2),
        StageSpace(widths=(64, 80, 96), depths=(2, 3, 4), stride=2),
    ),
)


@dataclass(frozen=True)
class ElasticSpec:
    """One subnet: stem width, and per stage (width, ((kernel, expand), ...))."""

    stem: int
    stages: tuple[tuple[int, tuple[tuple[int, int], ...]], ...]

    def __str__(self) -> str:
        body = "-".join(f"{w}:" + ".".join(f"k{k}e{e}" for k, e in blocks) for w, blocks in self.stages)
        return f"{PREFIX}s{self.stem}-{body}"

    @classmethod
    def parse(cls, text: str) -> ElasticSpec:
        text = text.strip()
        if not text.startswith(PREFIX):
            raise SpecError(f"an elastic spec starts with {PREFIX!r}, got {text!r}")
        tokens = text[len(PREFIX) :].split("-")
        try:
            if not tokens[0].startswith("s"):
                raise ValueError("the first token must be the stem width, e.g. s16")
            stem = int(tokens[0][1:])
            stages = []
            for token in tokens[1:]:
                width, blocks = token.split(":")
                parsed = []
                for block in blocks.split("."):
                    k, e = block[1:].split("e")
                    if block[0] != "k":
                        raise ValueError(f"block {block!r} must look like k3e4")
                    parsed.append((int(k), int(e)))
                stages.append((int(width), tuple(parsed)))
        except (ValueError, IndexError) as err:
            raise SpecError(
                f"malformed elastic spec {text!r} ({err}); expected e.g. mbv3:s16-24:k3e4-32:k5e3.k3e6-..."
            ) from err
        return cls(stem, tuple(stages)).validate()

    def validate(self, input_shape: tuple[int, int, int] | None = None) -> ElasticSpec:
        """Raise SpecError unless every choice is in :data:`SPACE` (and the input is large enough)."""
        problems = []
        if self.stem not in SPACE.stem_widths:
            problems.append(f"stem width {self.stem} not in {SPACE.stem_widths}")
        if len(self.stages) != len(SPACE.stages):
            problems.append(f"{len(self.stages)} stages, the space has {len(SPACE.stages)}")
        for i, ((width, blocks), space) in enumerate(zip(self.stages, SPACE.stages, strict=False)):
            if width not in space.widths:
                problems.append(f"stage {i} width {width} not in {space.widths}")
            if len(blocks) not in space.depths:
                problems.append(f"stage {i} depth {len(blocks)} not in {space.depths}")
            for k, e in blocks:
                if k not in KERNELS or e not in EXPANDS:
                    problems.append(f"stage {i} block k{k}e{e}: kernel in {KERNELS}, expand in {EXPANDS}")
        if input_shape is not None and min(input_shape[1:]) < 2 ** sum(s.stride > 1 for s in SPACE.stages):
            problems.append(f"input {input_shape} is too small for {len(SPACE.stages)} stages")
        if problems:
            raise SpecError(f"invalid elastic spec {self}: {'; '.join(problems)}")
        return self

    def to_json(self) -> str:
        return json.dumps({"kind": "elastic", "spec": str(self)}, sort_keys=True)

    @property
    def depth(self) -> int:
        return sum(len(blocks) for _, blocks in self.stages)


def largest() -> ElasticSpec:
    return ElasticSpec(
        max(SPACE.stem_widths),
        tuple((max(s.widths), ((max(KERNELS), max(EXPANDS)),) * max(s.depths)) for s in SPACE.stages),
    )


def smallest() -> ElasticSpec:
    return ElasticSpec(
        min(SPACE.stem_widths),
        tuple((min(s.widths), ((min(KERNELS), min(EXPANDS)),) * min(s.depths)) for s in SPACE.stages),
    )


def cost_of(spec: ElasticSpec, input_shape: tuple[int, int, int], num_classes: int) -> tuple[int, int]:
    """(FLOPs per sample, parameters) of the static subnet, computed analytically (microseconds).

    FLOPs follow the FlopCounterMode convention used everywhere in the SDK: 2 x MACs of convolutions and
    matrix multiplies only (a test checks equality with the counter). Evolution calls this thousands of
    times, where the counter (which runs the model) would dominate.
    """
    c, h, w = input_shape
    flops = 2 * c * spec.stem * 9 * h * w
    params = c * spec.stem * 9 + 2 * spec.stem
    cin = spec.stem
    for (width, blocks), space in zip(spec.stages, SPACE.stages, strict=True):
        for j, (k, e) in enumerate(blocks):
            stride = space.stride if j == 0 else 1
            hidden = cin * e
            flops += 2 * cin * hidden * h * w  # 1x1 expand at the input resolution
            h, w = (h + 2 * (k // 2) - k) // stride + 1, (w + 2 * (k // 2) - k) // stride + 1
            flops += 2 * hidden * k * k * h * w + 2 * hidden * width * h * w  # depthwise + project
            params += cin * hidden + hidden * k * k + hidden * width + 2 * (2 * hidden + width)
            cin = width
    flops += 2 * cin * num_classes
    params += cin * num_classes + num_classes
    return int(flops), int(params)
