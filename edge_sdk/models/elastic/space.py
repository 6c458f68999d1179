"""The elastic space's search operators (sampling, mutation, crossover, the predictor's encoding) and the
space itself as a :class:`~edge_sdk.models.spaces.SearchSpace`. The operators need neither the input shape
nor the class count: a subnet's stem and head follow the supernet.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from edge_sdk.models.elastic.spec import EXPANDS, KERNELS, SPACE, ElasticSpec

__all__ = ["ElasticSpace", "crossover", "encode", "mutate", "sample_elastic"]


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


@dataclass(frozen=True, kw_only=True)
class ElasticSpace:
    """Subnets of a supernet (:class:`~.spec.ElasticSpec`)."""

    name: str = "elastic"

    def sample(
        self, rng: np.random.Generator, input_shape: tuple[int, int, int], num_classes: int
    ) -> ElasticSpec:
        return sample_elastic(rng)

    def mutate(
        self, spec: ElasticSpec, rng: np.random.Generator, input_shape: tuple[int, int, int]
    ) -> ElasticSpec:
        assert isinstance(spec, ElasticSpec)
        return mutate(spec, rng)

    def crossover(
        self, a: ElasticSpec, b: ElasticSpec, rng: np.random.Generator, input_shape: tuple[int, int, int]
    ) -> ElasticSpec:
        assert isinstance(a, ElasticSpec) and isinstance(b, ElasticSpec)
        return crossover(a, b, rng)

    def encode(self, spec: ElasticSpec) -> np.ndarray:
        assert isinstance(spec, ElasticSpec)
        return encode(spec)
