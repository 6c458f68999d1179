"""The two ablation strategies of pFedZKD: ``fixed`` (one given architecture, the homogeneous
ablation) and ``random-pool`` (a seeded pick from :data:`edge_sdk.models.zoo.RANDOM_POOL` among the members
that fit the device, the random heterogeneous ablation)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from common.errors import BudgetError, SpecError
from edge_sdk.models.arch import ArchSpec, parse_arch, problems, with_num_classes
from edge_sdk.models.zoo import RANDOM_POOL
from edge_sdk.strategies.base import SearchConfig, check_arch
from edge_sdk.strategies.evaluator import Evaluator, Found

__all__ = ["FixedConfig", "RandomPoolConfig", "run_fixed", "run_random_pool"]


@dataclass(frozen=True, kw_only=True)
class FixedConfig(SearchConfig):
    """The ``fixed`` strategy: ``fixed_arch`` (its head resized to the class count), evaluated once."""

    strategy: ClassVar[str] = "fixed"

    fixed_arch: str | None = None  # none: from the input's recipe (SearchConfig.for_input)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.fixed_arch is not None:
            check_arch("fixed_arch", self.fixed_arch)


@dataclass(frozen=True, kw_only=True)
class RandomPoolConfig(SearchConfig):
    """The ``random-pool`` strategy: no options of its own."""

    strategy: ClassVar[str] = "random-pool"


def run_fixed(ev: Evaluator, config: FixedConfig, seeds: list[np.random.SeedSequence]) -> Found:
    spec = with_num_classes(parse_arch(config.fixed_arch), ev.num_classes)
    errs = problems(spec, ev.input_shape)
    if errs:
        raise SpecError(f"invalid architecture {spec}: " + "; ".join(errs))
    result = ev.evaluate(spec)
    if result.rejected is not None:
        raise BudgetError(f"fixed architecture {spec} does not fit the device: {result.rejected}")
    ev.bar.update(1)
    return Found(repeats_best=[(spec, result.fitness)])


def run_random_pool(ev: Evaluator, config: RandomPoolConfig, seeds: list[np.random.SeedSequence]) -> Found:
    rng = np.random.default_rng(seeds[0])
    candidates: list[ArchSpec] = []
    reasons: list[str] = []
    for text in RANDOM_POOL:
        spec = with_num_classes(parse_arch(text), ev.num_classes)
        errs = problems(spec, ev.input_shape)
        if errs:
            reasons.append(f"{spec}: {errs[0]}")
            continue
        reason = ev.screen(spec)[3]
        if reason is None:
            candidates.append(spec)
        else:
            reasons.append(f"{spec}: {reason}")
    if not candidates:
        raise BudgetError(f"no model of the random pool fits the device: {'; '.join(reasons)}")
    spec = candidates[int(rng.integers(len(candidates)))]
    fitness = ev.evaluate(spec).fitness
    ev.bar.update(1)
    return Found(repeats_best=[(spec, fitness)])
