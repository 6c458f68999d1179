"""The chain family's spec: pFedZKD's search space (section 3.2.1) as data, its rules and its cost.

A chain spec is a sequence of modules written as a readable string::

    C32k3-P-C64k5-Pavg-F128-F10
    C32k3-R32k3-P-R64k3-P-F10

``C{out}k{kernel}`` is conv (stride 1, same padding, no bias) + BatchNorm + ReLU; ``R{out}k{kernel}`` is a
residual block (two such convs, the second's ReLU after the sum with the block's input, through a 1x1
conv + BatchNorm where the channel count changes: what lets a chain grow deep enough for natural images
and still train); ``P`` / ``Pavg`` is a 2x2 max / average pooling with stride 2; ``F{units}`` is a fully
connected layer. Every F but the last is followed by ReLU and Dropout(0.3); the last F is the
classification head and has ``num_classes`` units. Rules: the first module is C (the stem), the chain
ends with at least one F, no C, R or P after the first F, depth 3..20, at most 128 channels, kernel at
most 7, hidden F at most 300 units, and no pooling may shrink the feature map below 1x1.

The chain is the family of unprefixed strings in :mod:`edge_sdk.models.arch`'s registry, and the only family
whose head is part of the spec (:meth:`ChainSpec.with_num_classes` resizes it to a task).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Literal

from common.errors import SpecError

__all__ = [
    "MAX_CHANNELS",
    "MAX_DEPTH",
    "MAX_KERNEL",
    "MAX_UNITS",
    "MIN_DEPTH",
    "ChainSpec",
    "Conv",
    "Dense",
    "Features",
    "Layer",
    "Pool",
    "Residual",
]


MIN_DEPTH = 3
MAX_DEPTH = 20
MAX_CHANNELS = 128
MAX_KERNEL = 7
MAX_UNITS = 300


@dataclass(frozen=True)
class Conv:
    """Conv(k x k, same padding) + BatchNorm + ReLU."""

    out_channels: int
    kernel_size: int

    def __str__(self) -> str:
        return f"C{self.out_channels}k{self.kernel_size}"


@dataclass(frozen=True)
class Residual:
    """Two Conv(k x k) + BatchNorm, ReLU between; the sum with the input (1x1 conv + BN when the
    channels change), then ReLU."""

    out_channels: int
    kernel_size: int

    def __str__(self) -> str:
        return f"R{self.out_channels}k{self.kernel_size}"


@dataclass(frozen=True)
class Pool:
    """2x2 pooling with stride 2."""

    kind: Literal["max", "avg"] = "max"

    def __str__(self) -> str:
        return "P" if self.kind == "max" else "Pavg"


@dataclass(frozen=True)
class Dense:
    """Fully connected layer (hidden: + ReLU + Dropout; last: the classification head)."""

    units: int

    def __str__(self) -> str:
        return f"F{self.units}"


Layer = Conv | Residual | Pool | Dense
Features = Conv | Residual  # the modules that convolve (channels and kernel)

# at most 9 digits a number: int() of a hostile 5,000-digit one raises ValueError, a spec never needs it
_TOKEN = re.compile(r"^(?:(?P<kind>[CR])(?P<c>\d{1,9})k(?P<k>\d{1,9})|(?P<p>P|Pmax|Pavg)|F(?P<f>\d{1,9}))$")


def _parse_layer(token: str) -> Layer:
    match = _TOKEN.match(token)
    if match is None:
        raise SpecError(
            f"cannot parse module {token!r}; expected C<channels>k<kernel> (e.g. C32k3), "
            "R<channels>k<kernel> (e.g. R64k3), P, Pavg or F<units>"
        )
    if match["c"] is not None:
        kind = Conv if match["kind"] == "C" else Residual
        return kind(int(match["c"]), int(match["k"]))
    if match["p"] is not None:
        return Pool("avg" if match["p"] == "Pavg" else "max")
    return Dense(int(match["f"]))


@dataclass(frozen=True)
class ChainSpec:
    """A variable-length C/P/F chain (immutable, hashable, so it can key a fitness cache)."""

    layers: tuple[Layer, ...]

    @classmethod
    def parse(cls, text: str) -> ChainSpec:
        text = text.strip()
        if not text:
            raise SpecError("empty architecture string; expected e.g. 'C32k3-P-C64k5-P-F128-F10'")
        return cls(tuple(_parse_layer(tok) for tok in text.split("-")))

    def __str__(self) -> str:
        return "-".join(str(layer) for layer in self.layers)

    def to_json(self) -> str:
        """Sorted JSON: ``{"kind": "chain", "layers": [{"type": "C", ...}, ...]}``."""
        out = []
        for layer in self.layers:
            if isinstance(layer, Features):
                kind = "C" if isinstance(layer, Conv) else "R"
                out.append(
                    {"type": kind, "out_channels": layer.out_channels, "kernel_size": layer.kernel_size}
                )
            elif isinstance(layer, Pool):
                out.append({"type": "P", "kind": layer.kind})
            else:
                out.append({"type": "F", "units": layer.units})
        return json.dumps({"kind": "chain", "layers": out}, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> ChainSpec:
        try:
            data = json.loads(text)
            layers: list[Layer] = []
            for item in data["layers"]:
                if item["type"] in ("C", "R"):
                    kind = Conv if item["type"] == "C" else Residual
                    layers.append(kind(int(item["out_channels"]), int(item["kernel_size"])))
                elif item["type"] == "P":
                    layers.append(Pool(item.get("kind", "max")))
                elif item["type"] == "F":
                    layers.append(Dense(int(item["units"])))
                else:
                    raise SpecError(f"unknown layer type {item['type']!r}; expected C, R, P or F")
        except (KeyError, TypeError, ValueError, json.JSONDecodeError) as err:
            if isinstance(err, SpecError):
                raise
            raise SpecError(f"malformed chain spec JSON: {err}") from err
        return cls(tuple(layers))

    @property
    def num_classes(self) -> int:
        last = self.layers[-1] if self.layers else None
        if not isinstance(last, Dense):
            raise SpecError(f"spec {self} does not end with an F module")
        return last.units

    def with_num_classes(self, num_classes: int) -> ChainSpec:
        """The same chain with its head resized to ``num_classes``."""
        if not self.layers or not isinstance(self.layers[-1], Dense):
            raise SpecError(f"spec {self} does not end with an F module")
        return ChainSpec((*self.layers[:-1], Dense(num_classes)))

    def problems(self, input_shape: tuple[int, int, int] | None = None) -> list[str]:
        """Every rule this spec breaks (empty when valid). ``input_shape`` = (C, H, W) enables size checks."""
        errs: list[str] = []
        layers = self.layers
        if not MIN_DEPTH <= len(layers) <= MAX_DEPTH:
            errs.append(f"depth must be in [{MIN_DEPTH}, {MAX_DEPTH}], got {len(layers)}")
        if not layers:
            return errs
        if not isinstance(layers[0], Conv):
            errs.append(f"the first module must be C, got {layers[0]}")
        if not isinstance(layers[-1], Dense):
            errs.append(f"the last module must be F, got {layers[-1]}")
        seen_dense = False
        for i, layer in enumerate(layers):
            if isinstance(layer, Dense):
                seen_dense = True
                if i < len(layers) - 1 and not 1 <= layer.units <= MAX_UNITS:
                    errs.append(f"module {i} ({layer}): hidden units must be in [1, {MAX_UNITS}]")
                if layer.units < 1:
                    errs.append(f"module {i} ({layer}): units must be >= 1")
            elif seen_dense:
                errs.append(f"module {i} ({layer}): C, R and P modules must come before the first F")
            if isinstance(layer, Features):
                if not 1 <= layer.out_channels <= MAX_CHANNELS:
                    errs.append(f"module {i} ({layer}): channels must be in [1, {MAX_CHANNELS}]")
                if not 1 <= layer.kernel_size <= MAX_KERNEL or layer.kernel_size % 2 == 0:
                    errs.append(f"module {i} ({layer}): kernel must be odd and in [1, {MAX_KERNEL}]")
        if input_shape is not None:
            _, h, w = input_shape
            for i, layer in enumerate(layers):
                if isinstance(layer, Pool):
                    if h < 2 or w < 2:
                        errs.append(f"module {i} ({layer}): pooling a {h}x{w} feature map would go below 1x1")
                        break
                    h, w = h // 2, w // 2
        return errs

    def validate(self, input_shape: tuple[int, int, int] | None = None) -> ChainSpec:
        errs = self.problems(input_shape)
        if errs:
            raise SpecError(f"invalid architecture {self}: " + "; ".join(errs))
        return self

    def cost(self, input_shape: tuple[int, int, int]) -> tuple[int, int]:
        """Analytic (FLOPs per sample, parameters); FLOPs = 2 x conv/FC MACs, as FlopCounterMode counts.

        Microseconds per call, so the search can screen candidates before building anything.
        """
        c, h, w = input_shape
        macs = params = 0
        features = None
        for layer in self.layers:
            if isinstance(layer, Features):
                m, p = _conv_cost(layer, c, h * w)
                macs, params, c = macs + m, params + p, layer.out_channels
            elif isinstance(layer, Pool):
                h, w = h // 2, w // 2
            else:
                if features is None:
                    features = c * h * w
                macs += features * layer.units
                params += features * layer.units + layer.units
                features = layer.units
        return 2 * macs, params


def _conv_cost(layer: Features, c: int, pixels: int) -> tuple[int, int]:
    """(MACs, parameters) of a C or R module on ``c`` channels of ``pixels`` pixels (no conv bias; every
    BatchNorm's affine pair counted)."""
    out, k = layer.out_channels, layer.kernel_size
    macs, params = pixels * out * c * k * k, out * c * k * k + 2 * out
    if isinstance(layer, Residual):
        macs += pixels * out * out * k * k
        params += out * out * k * k + 2 * out
        if c != out:  # the projection shortcut
            macs += pixels * out * c
            params += out * c + 2 * out
    return macs, params
