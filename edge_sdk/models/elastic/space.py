"""The elastic MobileNetV3-like space of HAPFNAS as a search space: the spec maths is
:mod:`edge_sdk.models.elastic.spec`'s; this adapter gives it the :class:`~edge_sdk.models.spaces.SearchSpace`
interface (the elastic operators need neither the input shape nor the class count: a subnet's stem and
head follow the supernet)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from edge_sdk.models.arch import ArchSpec
from edge_sdk.models.elastic import spec as elastic

__all__ = ["ElasticSpace"]


@dataclass(frozen=True, kw_only=True)
class ElasticSpace:
    """Subnets of a supernet (:class:`edge_sdk.models.elastic.spec.ElasticSpec`)."""

    name: str = "elastic"

    def sample(
        self, rng: np.random.Generator, input_shape: tuple[int, int, int], num_classes: int
    ) -> elastic.ElasticSpec:
        return elastic.sample_elastic(rng)

    def mutate(
        self, spec: ArchSpec, rng: np.random.Generator, input_shape: tuple[int, int, int]
    ) -> elastic.ElasticSpec:
        assert isinstance(spec, elastic.ElasticSpec)
        return elastic.mutate(spec, rng)

    def crossover(
        self, a: ArchSpec, b: ArchSpec, rng: np.random.Generator, input_shape: tuple[int, int, int]
    ) -> elastic.ElasticSpec:
        assert isinstance(a, elastic.ElasticSpec) and isinstance(b, elastic.ElasticSpec)
        return elastic.crossover(a, b, rng)

    def encode(self, spec: ArchSpec) -> np.ndarray:
        assert isinstance(spec, elastic.ElasticSpec)
        return elastic.encode(spec)
