"""The elastic MobileNetV3-like space of HAPFNAS (AttentiveNAS / Once-for-All style) for small inputs.

A subnet is data, like a chain spec::

    mbv3:s16-24:k3e4-32:k5e3.k3e6-48:k3e4.k7e3-96:k5e6.k3e3

``s16`` is the stem width (conv 3x3 + BN + Hardswish); then one token per stage, ``width:blocks``, each
block ``k{kernel}e{expand}`` an inverted residual (1x1 expand, kxk depthwise with the stage's stride on
the first block, 1x1 project; a skip connection when shape allows), so a stage's depth is its number of
blocks. :data:`SPACE` fixes the choices: stem width, per-stage widths, depths and strides, kernels
{3, 5, 7} and expansion ratios {3, 4, 6}. Global average pooling and a linear head close the network.

:class:`SuperNet` holds the largest weights; ``supernet(x, spec)`` runs any subnet by slicing (leading
channels, centre-cropped depthwise kernels, BatchNorm statistics of the leading channels), and
:func:`extract` copies those slices into a static :class:`ElasticNet` that computes the same function and
exports to ONNX like every other model. ``build_model("mbv3:...")`` builds the same static network,
freshly initialised (:data:`ELASTIC_FAMILY`, the ``elastic`` family of :mod:`edge_sdk.models.arch`'s
registry).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from common.checks import check_input_shape, check_int
from common.errors import BundleError, SpecError
from edge_sdk.data import PIXEL_MEAN, PIXEL_STD
from export.weights_file import read_weights_file, write_weights_file
from export.wire import MAX_CLASSES, MAX_INPUT_CHANNELS, MAX_INPUT_ELEMENTS

__all__ = [
    "ELASTIC_FAMILY",
    "EXPANDS",
    "KERNELS",
    "SPACE",
    "ElasticFamily",
    "ElasticNet",
    "ElasticSpec",
    "StageSpace",
    "SuperNet",
    "cost_of",
    "crossover",
    "encode",
    "extract",
    "largest",
    "load_supernet",
    "mutate",
    "sample_elastic",
    "save_supernet",
    "smallest",
    "subnet_slices",
]

PREFIX = "mbv3:"
KERNELS = (3, 5, 7)
EXPANDS = (3, 4, 6)
BN_EPS = 1e-5


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


def sample_elastic(rng: np.random.Generator) -> ElasticSpec:
    """A uniformly random subnet (every choice drawn independently)."""

    def pick(options: Sequence[int]) -> int:
        return int(options[int(rng.integers(len(options)))])

    stages = []
    for space in SPACE.stages:
        depth = pick(space.depths)
        stages.append((pick(space.widths), tuple((pick(KERNELS), pick(EXPANDS)) for _ in range(depth))))
    return ElasticSpec(pick(SPACE.stem_widths), tuple(stages))


def mutate(spec: ElasticSpec, rng: np.random.Generator, *, prob: float = 0.2) -> ElasticSpec:
    """Resample each choice (stem, widths, depths, kernels, expands) with probability ``prob``."""
    fresh = sample_elastic(rng)
    stem = fresh.stem if rng.random() < prob else spec.stem
    stages = []
    for (width, blocks), (new_width, new_blocks), space in zip(
        spec.stages, fresh.stages, SPACE.stages, strict=True
    ):
        width = new_width if rng.random() < prob else width
        depth = (
            int(space.depths[int(rng.integers(len(space.depths)))]) if rng.random() < prob else len(blocks)
        )
        out = []
        for j in range(depth):
            k, e = blocks[j] if j < len(blocks) else new_blocks[j % len(new_blocks)]
            if rng.random() < prob:
                k = int(KERNELS[int(rng.integers(len(KERNELS)))])
            if rng.random() < prob:
                e = int(EXPANDS[int(rng.integers(len(EXPANDS)))])
            out.append((k, e))
        stages.append((width, tuple(out)))
    return ElasticSpec(stem, tuple(stages))


def crossover(a: ElasticSpec, b: ElasticSpec, rng: np.random.Generator) -> ElasticSpec:
    """Uniform crossover: stem and each stage's width, depth and blocks come from either parent."""
    stem = a.stem if rng.random() < 0.5 else b.stem
    stages = []
    for (wa, ba), (wb, bb) in zip(a.stages, b.stages, strict=True):
        width = wa if rng.random() < 0.5 else wb
        depth = len(ba) if rng.random() < 0.5 else len(bb)
        blocks = []
        for j in range(depth):
            options = [blk[j] for blk in (ba, bb) if j < len(blk)]
            blocks.append(options[int(rng.integers(len(options)))])
        stages.append((width, tuple(blocks)))
    return ElasticSpec(stem, tuple(stages))


def encode(spec: ElasticSpec) -> np.ndarray:
    """Fixed-length vector for the predictor: stem, then per stage width, depth and (kernel, expand) of
    every block slot up to the stage's maximum depth (0 for absent blocks)."""
    values: list[float] = [spec.stem]
    for (width, blocks), space in zip(spec.stages, SPACE.stages, strict=True):
        values += [width, len(blocks)]
        for j in range(max(space.depths)):
            values += list(blocks[j]) if j < len(blocks) else [0, 0]
    return np.asarray(values, dtype=np.float32)


# ------------------------------------------------------------------------------------------ static net


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


# -------------------------------------------------------------------------------------------- supernet


def _bn(x: Tensor, bn: nn.BatchNorm2d, channels: int) -> Tensor:
    """BatchNorm over the leading ``channels`` of ``bn`` (training mode updates those running stats)."""
    assert bn.running_mean is not None and bn.running_var is not None
    return F.batch_norm(
        x,
        bn.running_mean[:channels],
        bn.running_var[:channels],
        bn.weight[:channels],
        bn.bias[:channels],
        bn.training,
        bn.momentum if bn.momentum is not None else 0.1,
        bn.eps,
    )


def _crop(weight: Tensor, kernel: int) -> Tensor:
    start = (weight.shape[-1] - kernel) // 2
    return weight[..., start : start + kernel, start : start + kernel]


class SuperNet(nn.Module):
    """The largest network of :data:`SPACE`; ``forward(x, spec)`` runs any subnet by weight slicing."""

    def __init__(self, input_shape: tuple[int, int, int], num_classes: int) -> None:
        super().__init__()
        self.input_shape, self.num_classes = tuple(input_shape), num_classes
        self.max = ElasticNet(largest(), self.input_shape, num_classes)  # type: ignore[arg-type]
        # block index of (stage, j) in the largest net
        self.offsets = np.cumsum([0] + [max(s.depths) for s in SPACE.stages[:-1]]).tolist()

    def forward(self, x: Tensor, spec: ElasticSpec) -> Tensor:
        net = self.max
        x = (x - PIXEL_MEAN) / PIXEL_STD
        x = F.conv2d(x, net.stem.weight[: spec.stem], padding=1)
        x = F.hardswish(_bn(x, net.stem_bn, spec.stem))
        x = x.contiguous(memory_format=torch.channels_last)  # see ElasticNet.forward
        cin = spec.stem
        for s, ((width, blocks), space) in enumerate(zip(spec.stages, SPACE.stages, strict=True)):
            for j, (k, e) in enumerate(blocks):
                block: _Block = net.blocks[self.offsets[s] + j]  # type: ignore[assignment]
                stride = space.stride if j == 0 else 1
                hidden = cin * e
                h = F.conv2d(x, block.expand.weight[:hidden, :cin])
                h = F.hardswish(_bn(h, block.expand_bn, hidden))
                h = F.conv2d(
                    h, _crop(block.dw.weight[:hidden], k), stride=stride, padding=k // 2, groups=hidden
                )
                h = F.hardswish(_bn(h, block.dw_bn, hidden))
                h = _bn(F.conv2d(h, block.project.weight[:width, :hidden]), block.project_bn, width)
                x = x + h if stride == 1 and cin == width else h
                cin = width
        return F.linear(x.mean(dim=(2, 3)), net.head.weight[:, :cin], net.head.bias)


def subnet_slices(
    supernet: SuperNet, spec: ElasticSpec, net: ElasticNet | None = None
) -> dict[str, tuple[str, tuple[slice, ...]]]:
    """For every state-dict key of the static subnet: (supernet key, index of the subnet's elements in
    that supernet tensor). Leading channels everywhere; depthwise kernels are the centred k x k window.
    ``net`` is the static subnet when the caller already built it (its shapes are read, not its values)."""
    spec.validate(supernet.input_shape)  # type: ignore[arg-type]
    if net is None:
        net = ElasticNet(spec, supernet.input_shape, supernet.num_classes)  # type: ignore[arg-type]
    big = supernet.max.state_dict()
    rename = {}
    block = 0
    for s, (_, blocks) in enumerate(spec.stages):
        for j in range(len(blocks)):
            rename[f"blocks.{block}."] = f"blocks.{supernet.offsets[s] + j}."
            block += 1
    out = {}
    for key, ref in net.state_dict().items():
        source = key
        for small, large in rename.items():
            if key.startswith(small):
                source = large + key[len(small) :]
                break
        full = big[source]
        index = [slice(0, n) for n in ref.shape]
        if full.ndim == 4 and full.shape[-1] != ref.shape[-1]:  # centred depthwise window
            start = (full.shape[-1] - ref.shape[-1]) // 2
            index[2] = index[3] = slice(start, start + ref.shape[-1])
        out[key] = (source, tuple(index))
    return out


def extract(supernet: SuperNet, spec: ElasticSpec) -> ElasticNet:
    """A static :class:`ElasticNet` holding the supernet's slices for ``spec`` (same outputs in eval mode)."""
    net = ElasticNet(spec, supernet.input_shape, supernet.num_classes)  # type: ignore[arg-type]
    big = supernet.max.state_dict()
    slices = subnet_slices(supernet, spec, net)
    state = {key: big[source][index].clone() for key, (source, index) in slices.items()}
    net.load_state_dict(state, strict=True)
    return net


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


SUPERNET_KIND = "elastic-supernet"


def save_supernet(supernet: SuperNet, path: str | Path, *, provenance: dict[str, Any] | None = None) -> Path:
    """Write the supernet's weights (safetensors in a validated manifest; never a pickle)."""
    manifest = {
        "space": repr(SPACE),
        "input_shape": list(supernet.input_shape),
        "num_classes": supernet.num_classes,
        **(provenance or {}),
    }
    return write_weights_file(path, supernet.max.state_dict(), kind=SUPERNET_KIND, manifest=manifest)


def load_supernet(path: str | Path) -> SuperNet:
    """Read a file written by :func:`save_supernet`; refuses another search space or a tampered file."""
    tensors, manifest = read_weights_file(path, kind=SUPERNET_KIND)
    if manifest.get("space") != repr(SPACE):
        raise BundleError(f"{path} was trained for another elastic search space; retrain it with this SDK")
    try:  # bounded before the supernet's weights are allocated from them (bounds: export.wire)
        shape = check_input_shape(
            "input_shape",
            manifest.get("input_shape"),
            max_channels=MAX_INPUT_CHANNELS,
            max_elements=MAX_INPUT_ELEMENTS,
            error=BundleError,
        )
        classes = check_int("num_classes", manifest.get("num_classes"), 1, MAX_CLASSES, error=BundleError)
    except BundleError as err:
        raise BundleError(
            f"{path}: manifest {err}; write the supernet again with server-kit supernet"
        ) from err
    supernet = SuperNet(shape, classes)
    try:
        supernet.max.load_state_dict(tensors, strict=True)
    except RuntimeError as err:
        raise BundleError(f"{path}: weights do not fit the supernet: {err}") from err
    return supernet.eval()
