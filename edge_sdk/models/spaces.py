"""The search-space interface and the registry of every space (Once-for-All's habit: the space is an
object behind a small interface; strategies see specs only, never torch modules)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import numpy as np

from common.errors import ConfigError
from edge_sdk.models.arch import ArchSpec
from edge_sdk.models.chain.space import ChainSpace
from edge_sdk.models.elastic.space import ElasticSpace

__all__ = ["SPACES", "SearchSpace", "get_space"]


class SearchSpace(Protocol):
    """What a strategy needs from a space. ``mutate`` and ``crossover`` return valid specs of the space
    (repaired, not rejected), drawing only from ``rng``; ``encode`` is a fixed-length vector per space
    (the accuracy predictor's input)."""

    @property
    def name(self) -> str: ...

    def sample(
        self, rng: np.random.Generator, input_shape: tuple[int, int, int], num_classes: int
    ) -> ArchSpec: ...

    def mutate(
        self, spec: ArchSpec, rng: np.random.Generator, input_shape: tuple[int, int, int]
    ) -> ArchSpec: ...

    def crossover(
        self, a: ArchSpec, b: ArchSpec, rng: np.random.Generator, input_shape: tuple[int, int, int]
    ) -> ArchSpec: ...

    def encode(self, spec: ArchSpec) -> np.ndarray: ...


# name -> constructor; every constructor's options have defaults, so ``SPACES[name]()`` is a usable space
SPACES: dict[str, Callable[[], SearchSpace]] = {"chain": ChainSpace, "elastic": ElasticSpace}


def get_space(name: str) -> SearchSpace:
    """The space registered as ``name``, with its default options."""
    if name not in SPACES:
        raise ConfigError(f"search space must be one of {sorted(SPACES)}, got {name!r}")
    return SPACES[name]()
