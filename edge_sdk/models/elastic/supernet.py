"""The elastic supernet: :class:`SuperNet` holds the largest weights of :data:`~.spec.SPACE`;
``supernet(x, spec)`` runs any subnet by slicing (leading channels, centre-cropped depthwise kernels,
BatchNorm statistics of the leading channels), and :func:`extract` copies those slices into a static
:class:`~.network.ElasticNet` that computes the same function and exports to ONNX like every other model.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from edge_sdk.data import PIXEL_MEAN, PIXEL_STD
from edge_sdk.models.elastic.network import ElasticNet, _Block
from edge_sdk.models.elastic.spec import SPACE, ElasticSpec, largest

__all__ = ["SuperNet", "extract", "subnet_slices"]


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
