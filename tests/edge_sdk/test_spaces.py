"""Contract tests over every registered search space: valid, deterministic, fixed-length encodings."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from common.errors import ConfigError
from edge_sdk.models.chain.space import ChainSpace
from edge_sdk.models.chain.spec import ChainSpec, Conv, Residual
from edge_sdk.models.elastic.spec import ElasticSpec
from edge_sdk.models.spaces import SPACES, SearchSpace, get_space

SHAPE = (1, 28, 28)
COLOR = (3, 16, 16)


def _valid(space: SearchSpace, spec: object, shape: tuple[int, int, int] = SHAPE) -> None:
    if isinstance(spec, ChainSpec):
        assert spec.problems(shape) == [] and spec.num_classes == 10
    else:
        assert isinstance(spec, ElasticSpec)
        assert ElasticSpec.parse(str(spec)) == spec


@pytest.mark.parametrize("shape", [SHAPE, COLOR])
@pytest.mark.parametrize("name", sorted(SPACES))
def test_space_contract(name: str, shape: tuple[int, int, int]) -> None:
    space = get_space(name)
    assert space.name == name
    rng = np.random.default_rng(0)
    specs = [space.sample(rng, shape, 10) for _ in range(20)]
    width = {space.encode(s).shape for s in specs}
    assert len(width) == 1 and len(next(iter(width))) == 1
    for a, b in itertools.pairwise(specs):
        _valid(space, a, shape)
        _valid(space, space.mutate(a, rng, shape), shape)
        _valid(space, space.crossover(a, b, rng, shape), shape)
    again = get_space(name)
    rng2 = np.random.default_rng(0)
    assert [str(again.sample(rng2, shape, 10)) for _ in range(20)] == [str(s) for s in specs]


def test_chain_space_draws_residual_blocks_on_color_inputs_only() -> None:
    space = ChainSpace()
    for shape, residual in ((SHAPE, False), (COLOR, True)):
        rng = np.random.default_rng(0)
        specs = [space.sample(rng, shape, 10) for _ in range(60)]
        specs += [space.mutate(s, rng, shape) for s in specs]
        kinds = {type(layer) for s in specs for layer in s.layers}
        assert (Residual in kinds) is residual
        assert all(isinstance(s.layers[0], Conv) for s in specs)  # the stem stays a plain C
    codes = space.encode(ChainSpec.parse("C8k3-R16k5-F10")).reshape(-1, 4)
    assert codes[1].tolist() == [5, 16, 5, 0]  # R has its own kind code


def test_chain_space_depth_and_registry_errors() -> None:
    rng = np.random.default_rng(1)
    space = ChainSpace(max_depth=4)
    assert all(len(space.sample(rng, SHAPE, 10).layers) <= 4 for _ in range(100))
    with pytest.raises(ConfigError, match="max_depth"):
        ChainSpace(max_depth=21)
    with pytest.raises(ConfigError, match="search space must be one of"):
        get_space("grid")
