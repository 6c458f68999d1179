"""The chain search space of pFedZKD (section 4.1.2): C/P feature modules then an F block.

Every constant of the space lives here, so PSO (:mod:`edge_sdk.strategies.pso`) and evolution
(:mod:`edge_sdk.strategies.evolution`) draw from the same choices. On color inputs (the input spec's
channels, :data:`edge_sdk.augment.COLOR_CHANNELS`) a drawn conv module is a residual block R at even odds:
natural images need deeper feature stacks than digits, and a plain chain that deep trains badly; on
grayscale inputs the space, and every draw from it, is pFedZKD's. The space's own operator is the
alignment T (:func:`align`), which PSO moves particles with and evolution repairs children with.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from common.checks import check_int
from common.errors import ConfigError
from edge_sdk.augment import COLOR_CHANNELS
from edge_sdk.models.chain.spec import (
    MAX_CHANNELS,
    MAX_DEPTH,
    MAX_KERNEL,
    MAX_UNITS,
    MIN_DEPTH,
    ChainSpec,
    Conv,
    Dense,
    Features,
    Layer,
    Pool,
    Residual,
)

__all__ = [
    "CHANNELS",
    "CONV_PROBABILITY",
    "DEFAULT_MAX_DEPTH",
    "HIDDEN_UNITS",
    "KERNELS",
    "MAX_DENSE",
    "RESIDUAL_PROBABILITY",
    "ChainSpace",
    "align",
    "check_max_depth",
    "narrow",
    "random_conv",
    "sample_spec",
]

# Discrete choices of the sampler (within the arch rules: <= 128 channels, odd kernels <= 7, <= 300 units).
CHANNELS = (8, 16, 32, 48, 64, 96, 128)
KERNELS = (1, 3, 5, 7)
HIDDEN_UNITS = (32, 64, 128, 192, 256, 300)
CONV_PROBABILITY = 0.7  # vs 0.3 for pooling (pFedZKD section 4.1.2)
MAX_DENSE = 3  # F modules per sampled chain, the head included
DEFAULT_MAX_DEPTH = 10  # the fast presets' longest sampled chain
RESIDUAL_PROBABILITY = 0.5  # a drawn conv module is an R block, on color inputs only

_KINDS = {"C": 1, "Pmax": 2, "Pavg": 3, "F": 4, "R": 5}  # encode: one code per module kind


def check_max_depth(max_depth: object) -> int:
    """``max_depth`` as an int in [MIN_DEPTH, MAX_DEPTH], else :class:`ConfigError`."""
    check_int("max_depth", max_depth, MIN_DEPTH)
    if max_depth > MAX_DEPTH:  # type: ignore[operator]
        raise ConfigError(f"max_depth must be in [{MIN_DEPTH}, {MAX_DEPTH}], got {max_depth}")
    return int(max_depth)  # type: ignore[call-overload]


def random_conv(rng: np.random.Generator, input_shape: tuple[int, int, int] | None = None) -> Conv | Residual:
    """A random C module; on a color ``input_shape``, an R block instead with :data:`RESIDUAL_PROBABILITY`
    (the extra draw only there, so grayscale draws stay the same)."""
    conv = Conv(int(rng.choice(CHANNELS)), int(rng.choice(KERNELS)))
    if input_shape is not None and input_shape[0] == COLOR_CHANNELS and rng.random() < RESIDUAL_PROBABILITY:
        return Residual(conv.out_channels, conv.kernel_size)
    return conv


def sample_spec(
    rng: np.random.Generator,
    input_shape: tuple[int, int, int],
    num_classes: int,
    *,
    max_depth: int = MAX_DEPTH,
) -> ChainSpec:
    """A random valid chain for ``input_shape``.

    Depth is uniform in [3, ``max_depth``]; 1..3 of those modules are the F block (hidden units from
    :data:`HIDDEN_UNITS`, then the ``num_classes`` head); the rest is a C followed by C (probability 0.7)
    or P (0.3, max or average at even odds). A P that would shrink the map below 1x1 becomes a C. On
    color inputs a C after the first is an R block at even odds (:func:`random_conv`).
    """
    check_max_depth(max_depth)
    check_int("num_classes", num_classes, 1)
    depth = int(rng.integers(MIN_DEPTH, max_depth + 1))
    n_dense = int(rng.integers(1, min(MAX_DENSE, depth - 1) + 1))
    size = min(input_shape[1], input_shape[2])
    layers: list[Layer] = [random_conv(rng)]
    for _ in range(depth - n_dense - 1):
        if rng.random() >= CONV_PROBABILITY and size >= 2:
            layers.append(Pool("max" if rng.random() < 0.5 else "avg"))
            size //= 2
        else:
            layers.append(random_conv(rng, input_shape))
    layers += [Dense(int(rng.choice(HIDDEN_UNITS))) for _ in range(n_dense - 1)]
    layers.append(Dense(num_classes))
    return ChainSpec(tuple(layers))


def _odd_kernel(kernel: int) -> int:
    kernel = min(max(kernel, 1), MAX_KERNEL)
    return kernel if kernel % 2 else kernel - 1


def align(
    current: ChainSpec, target: ChainSpec, rng: np.random.Generator, input_shape: tuple[int, int, int]
) -> ChainSpec:
    """The alignment operator T: move ``current`` onto ``target`` and return a valid spec.

    Aligning the lengths (insertion / deletion) and then replacing every module that differs in type or
    parameters leaves exactly the target's modules, so T(x, t) == t for a valid t. The targets PSO builds
    layer by layer can break the rules, though (a C taken from one parent after an F taken from the
    other, more pools than the map affords), so the result is repaired, in this order:

    1. F block at the end: the C/P modules keep their order, then the F modules keep theirs.
    2. First module C: a leading P is replaced by (or, with no C/P at all, preceded by) ``current``'s first C.
    3. No pooling below 1x1: such a P becomes a copy of the nearest C or R before it.
    4. Out-of-range parameters are clamped (channels, odd kernel, hidden units); the last F is the head
       with ``current``'s class count (a missing F block becomes just the head).
    5. Depth: past 20 modules, random (``rng``) non-first C/R/P or hidden F modules are deleted; under 3,
       the last C or R is repeated.
    """
    current.validate(input_shape)
    num_classes = current.num_classes
    features: list[Layer] = [layer for layer in target.layers if not isinstance(layer, Dense)]
    dense = [layer for layer in target.layers if isinstance(layer, Dense)]
    first = current.layers[0]
    if not features:
        features = [first]
    elif not isinstance(features[0], Conv):
        features[0] = first
    size = min(input_shape[1], input_shape[2])
    for i, layer in enumerate(features):
        if isinstance(layer, Features):
            kind = type(layer)
            features[i] = kind(min(max(layer.out_channels, 1), MAX_CHANNELS), _odd_kernel(layer.kernel_size))
        elif size >= 2:
            size //= 2
        else:
            features[i] = next(f for f in reversed(features[:i]) if isinstance(f, Features))
    dense = [Dense(min(max(d.units, 1), MAX_UNITS)) for d in dense[:-1]] + [Dense(num_classes)]
    while len(features) + len(dense) > MAX_DEPTH:
        removable = len(features) - 1 + len(dense) - 1  # never the first C nor the head
        k = int(rng.integers(removable))
        if k < len(features) - 1:
            del features[k + 1]
        else:
            del dense[k - (len(features) - 1)]
    while len(features) + len(dense) < MIN_DEPTH:
        last_conv = next(f for f in reversed(features) if isinstance(f, Features))
        features.append(last_conv)
    return ChainSpec((*features, *dense)).validate(input_shape)


@dataclass(frozen=True, kw_only=True)
class ChainSpace:
    """The chain space as a :class:`~edge_sdk.models.spaces.SearchSpace`: chains up to ``max_depth``
    modules; mutation and crossover are repaired by :func:`align`, so every child is valid."""

    max_depth: int = DEFAULT_MAX_DEPTH
    name: str = "chain"

    def __post_init__(self) -> None:
        check_max_depth(self.max_depth)

    def sample(
        self, rng: np.random.Generator, input_shape: tuple[int, int, int], num_classes: int
    ) -> ChainSpec:
        return sample_spec(rng, input_shape, num_classes, max_depth=self.max_depth)

    def mutate(
        self, spec: ChainSpec, rng: np.random.Generator, input_shape: tuple[int, int, int]
    ) -> ChainSpec:
        """Replace one module by a fresh one of a random kind, then repair with the alignment operator."""
        assert isinstance(spec, ChainSpec)
        layers = list(spec.layers)
        j = int(rng.integers(len(layers)))
        old = layers[j]
        if isinstance(old, Dense):
            if j < len(layers) - 1:  # a hidden F: new width (the head keeps the class count)
                layers[j] = Dense(int(rng.choice(HIDDEN_UNITS)))
        elif j == 0:
            layers[j] = random_conv(rng)  # the stem stays a C
        elif rng.random() < CONV_PROBABILITY:
            layers[j] = random_conv(rng, input_shape)
        else:
            layers[j] = Pool("avg" if rng.random() < 0.5 else "max")
        return align(spec, ChainSpec(tuple(layers)), rng, input_shape)

    def crossover(
        self, a: ChainSpec, b: ChainSpec, rng: np.random.Generator, input_shape: tuple[int, int, int]
    ) -> ChainSpec:
        """Layer-wise uniform crossover (the PSO target rule with cg 0.5), repaired by alignment."""
        assert isinstance(a, ChainSpec) and isinstance(b, ChainSpec)
        target: list[Layer] = []
        for j in range(max(len(a.layers), len(b.layers))):
            pool = [s.layers[j] for s in (a, b) if j < len(s.layers)]
            target.append(pool[int(rng.integers(len(pool)))])
        return align(a, ChainSpec(tuple(target)), rng, input_shape)

    def align(
        self,
        current: ChainSpec,
        target: ChainSpec,
        rng: np.random.Generator,
        input_shape: tuple[int, int, int],
    ) -> ChainSpec:
        """The alignment operator T (:func:`align`): PSO's move, beyond the :class:`SearchSpace` interface."""
        return align(current, target, rng, input_shape)

    def encode(self, spec: ChainSpec) -> np.ndarray:
        """MAX_DEPTH slots of (kind, channels, kernel, units), zero-padded (the same width for any
        ``max_depth``, so encodings of differently bounded searches compare)."""
        assert isinstance(spec, ChainSpec)
        out = np.zeros((MAX_DEPTH, 4), dtype=np.float32)
        for j, layer in enumerate(spec.layers[:MAX_DEPTH]):
            if isinstance(layer, Features):
                kind = "C" if isinstance(layer, Conv) else "R"
                out[j] = (_KINDS[kind], layer.out_channels, layer.kernel_size, 0)
            elif isinstance(layer, Pool):
                out[j] = (_KINDS["Pmax" if layer.kind == "max" else "Pavg"], 0, 0, 0)
            else:
                out[j] = (_KINDS["F"], 0, 0, layer.units)
        return out.ravel()


def narrow(spec: ChainSpec) -> ChainSpec:
    """The same chain at half the width (conv channels and hidden FC units halved, at least 8): what PSO
    tries when its warm-start architecture does not fit the budget."""
    layers: list[Layer] = []
    for i, layer in enumerate(spec.layers):
        if isinstance(layer, Features):
            layer = type(layer)(max(8, layer.out_channels // 2), layer.kernel_size)
        elif isinstance(layer, Dense) and i < len(spec.layers) - 1:
            layer = Dense(max(8, layer.units // 2))
        layers.append(layer)
    return ChainSpec(tuple(layers))
