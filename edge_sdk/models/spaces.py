"""The search-space interface and the registry of every space (Once-for-All's habit: the space is an
object behind a small interface; strategies see specs only, never torch modules)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, TypeVar

import numpy as np

from common.errors import ConfigError
from edge_sdk.models.chain.space import ChainSpace
from edge_sdk.models.elastic.space import ElasticSpace

__all__ = ["SPACES", "SearchSpace", "get_space"]

S = TypeVar("S")


class SearchSpace(Protocol[S]):
    """What a strategy needs from a space of specs of type ``S`` (its family's spec class, as for
    :class:`~edge_sdk.models.arch.ArchFamily`). ``mutate`` and ``crossover`` return valid specs of the space
    (repaired, not rejected), drawing only from ``rng``; ``encode`` is a fixed-length vector per space
    (the accuracy predictor's input)."""

    @property
    def name(self) -> str: ...

    def sample(self, rng: np.random.Generator, input_shape: tuple[int, int, int], num_classes: int) -> S: ...

    def mutate(self, spec: S, rng: np.random.Generator, input_shape: tuple[int, int, int]) -> S: ...

    def crossover(self, a: S, b: S, rng: np.random.Generator, input_shape: tuple[int, int, int]) -> S: ...

    def encode(self, spec: S) -> np.ndarray: ...


# name -> constructor; every constructor's options have defaults, so ``SPACES[name]()`` is a usable space
SPACES: dict[str, Callable[[], SearchSpace[Any]]] = {"chain": ChainSpace, "elastic": ElasticSpace}


def get_space(name: str) -> SearchSpace[Any]:
    """The space registered as ``name``, with its default options."""
    if name not in SPACES:
        raise ConfigError(f"search space must be one of {sorted(SPACES)}, got {name!r}")
    return SPACES[name]()
