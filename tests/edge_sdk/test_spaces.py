"""Contract tests over every registered search space: valid, deterministic, fixed-length encodings."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from common.errors import ConfigError
from edge_sdk.chain import ChainSpec
from edge_sdk.elastic import ElasticSpec
from edge_sdk.spaces.chain import ChainSpace
from edge_sdk.spaces.registry import SPACES, SearchSpace, get_space

SHAPE = (1, 28, 28)


def _valid(space: SearchSpace, spec: object) -> None:
    if isinstance(spec, ChainSpec):
        assert spec.problems(SHAPE) == [] and spec.num_classes == 10
    else:
        assert isinstance(spec, ElasticSpec)
        assert ElasticSpec.parse(str(spec)) == spec


@pytest.mark.parametrize("name", sorted(SPACES))
def test_space_contract(name: str) -> None:
    space = get_space(name)
    assert space.name == name
    rng = np.random.default_rng(0)
    specs = [space.sample(rng, SHAPE, 10) for _ in range(20)]
    width = {space.encode(s).shape for s in specs}
    assert len(width) == 1 and len(next(iter(width))) == 1
    for a, b in itertools.pairwise(specs):
        _valid(space, a)
        _valid(space, space.mutate(a, rng, SHAPE))
        _valid(space, space.crossover(a, b, rng, SHAPE))
    again = get_space(name)
    rng2 = np.random.default_rng(0)
    assert [str(again.sample(rng2, SHAPE, 10)) for _ in range(20)] == [str(s) for s in specs]


def test_chain_space_depth_and_registry_errors() -> None:
    rng = np.random.default_rng(1)
    space = ChainSpace(max_depth=4)
    assert all(len(space.sample(rng, SHAPE, 10).layers) <= 4 for _ in range(100))
    with pytest.raises(ConfigError, match="max_depth"):
        ChainSpace(max_depth=21)
    with pytest.raises(ConfigError, match="search space must be one of"):
        get_space("grid")
