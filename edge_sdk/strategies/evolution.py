"""Predictor-guided evolution (HAPFNAS Algorithm 2) over a search space (:mod:`edge_sdk.models.spaces`).

Cost and budget screening go through the shared evaluator, so every space obeys the same device budget.

* elastic space (:mod:`edge_sdk.models.elastic.space`) with a supernet: a candidate's fitness is the
  validation cross-entropy of its subnet with inherited weights after BatchNorm recalibration on the
  local training split (:func:`~edge_sdk.strategies.supernet_proxy.supernet_proxy`): no training at all.
* chain space (:mod:`edge_sdk.models.chain.space`, up to ``max_depth`` modules) without a supernet: the
  fitness is the short training of PSO (candidate-epochs), so the two strategies can be compared at
  equal candidate-epochs.

The initial population is reject-sampled under the budget and evaluated for real; a random forest
(:func:`~edge_sdk.strategies.predictor.predictor`) is fitted on (encoded spec, fitness); each generation
adds ``mutations`` mutants and ``crossovers`` children (budget-checked) scored by the predictor, and
keeps the best ``population``. The best ``reevaluate`` distinct specs are then evaluated for real and
the best of those wins. The predictor's Spearman / Kendall rank correlation on a held-out fifth of the
initial population is reported, so its quality is measured on every run.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from common.checks import check_int
from common.errors import BudgetError, ConfigError
from edge_sdk.models.arch import ArchSpec
from edge_sdk.models.chain.space import DEFAULT_MAX_DEPTH, ChainSpace, check_max_depth
from edge_sdk.models.chain.spec import MAX_DEPTH
from edge_sdk.models.elastic.space import ElasticSpace
from edge_sdk.models.elastic.supernet_file import load_supernet
from edge_sdk.models.spaces import SearchSpace
from edge_sdk.strategies.base import SearchConfig
from edge_sdk.strategies.evaluator import Evaluator, Found
from edge_sdk.strategies.predictor import predictor, rank_correlation
from edge_sdk.strategies.supernet_proxy import supernet_proxy

__all__ = ["SAMPLE_ATTEMPTS", "EvolutionConfig", "evolve", "run", "supernet_of"]

SAMPLE_ATTEMPTS = 50  # per wanted candidate: bounded reject sampling


@dataclass(frozen=True, kw_only=True)
class EvolutionConfig(SearchConfig):
    """Evolution's options over the shared ones (:class:`~edge_sdk.strategies.base.SearchConfig`).

    Attributes:
        population: architectures the population keeps (N_pop); the initial ones are evaluated for
            real, the later ones scored by the accuracy predictor.
        mutations: mutants added in each generation (N_m).
        crossovers: crossover children added in each generation (N_c).
        generations: rounds of mutation, crossover and selection.
        reevaluate: the best distinct architectures of the last population evaluated for real at the
            end; the best of them wins.
        max_depth: longest chain the chain space draws (3 to 20; the elastic space has its own bounds).
        supernet: path of a supernet file (from server-kit supernet): evolution then searches the
            elastic space with inherited weights; none: the chain space, by short training.
        calib_batches: BatchNorm recalibration batches per elastic candidate.
    """

    strategy: ClassVar[str] = "evolution"
    own_presets: ClassVar[dict[str, dict[str, Any]]] = {
        "paper": {
            "max_depth": MAX_DEPTH,
            "population": 256,
            "mutations": 128,
            "crossovers": 128,
            "generations": 20,
        },
    }

    population: int = 24
    mutations: int = 12
    crossovers: int = 12
    generations: int = 5
    reevaluate: int = 3
    max_depth: int = DEFAULT_MAX_DEPTH
    supernet: str | None = None
    calib_batches: int = 8

    def __post_init__(self) -> None:
        super().__post_init__()
        check_max_depth(self.max_depth)
        for name in ("population", "reevaluate", "calib_batches"):
            check_int(name, getattr(self, name), 1)
        for name in ("mutations", "crossovers", "generations"):
            check_int(name, getattr(self, name), 0)
        if self.supernet is not None and not isinstance(self.supernet, str):
            raise ConfigError(f"supernet must be a file path or None, got {self.supernet!r}")

    def planned_candidates(self) -> int:
        return self.population + self.reevaluate


def run(ev: Evaluator, config: EvolutionConfig, seeds: list[np.random.SeedSequence]) -> Found:
    """Evolution over the elastic space with ``config.supernet``, else over the chain space."""
    space: SearchSpace = ChainSpace(max_depth=config.max_depth)
    if config.supernet is not None:
        supernet = load_supernet(config.supernet)
        if (supernet.input_shape, supernet.num_classes) != (ev.input_shape, ev.num_classes):
            raise ConfigError(
                f"supernet {config.supernet} is for {supernet.num_classes} classes of "
                f"{supernet.input_shape}, the data is {ev.num_classes} classes of {ev.input_shape}"
            )
        ev.proxy = supernet_proxy(
            supernet, ev.train_split, ev.val_split, batches=config.calib_batches, seed=ev.seed
        )
        space = ElasticSpace()

    def evaluate_spec(spec: ArchSpec) -> tuple[float, str | None]:
        result = ev.evaluate(spec)
        ev.bar.update(1)
        ev.bar.set_postfix(rejected=ev.rejected, cached=ev.cache_hits)
        return result.fitness, result.rejected

    best, fitness, details = evolve(
        space,
        evaluate_spec,
        np.random.default_rng(seeds[0]),
        input_shape=ev.input_shape,
        num_classes=ev.num_classes,
        population=config.population,
        mutations=config.mutations,
        crossovers=config.crossovers,
        generations=config.generations,
        reevaluate=config.reevaluate,
        admits=lambda spec: ev.screen(spec)[3] is None,
        seed=ev.seed,
        out_of_budget=ev.out_of_budget,
    )
    progress = details.pop("progress")
    return Found(repeats_best=[(best, fitness)], details=details, progress=progress)


def evolve(
    space: SearchSpace,
    evaluate_spec: Callable[[ArchSpec], tuple[float, str | None]],
    rng: np.random.Generator,
    *,
    input_shape: tuple[int, int, int],
    num_classes: int,
    population: int,
    mutations: int,
    crossovers: int,
    generations: int,
    reevaluate: int,
    admits: Callable[[ArchSpec], bool],
    seed: int,
    out_of_budget: Callable[[], bool] = lambda: False,
) -> tuple[ArchSpec, float, dict[str, Any]]:
    """Run Algorithm 2; returns (best spec, its real fitness, details for the search report, with
    ``progress``: [done, planned] of the initial population, the generations and the re-evaluations).

    ``evaluate_spec(spec) -> (fitness, rejection or None)`` is the real (cached) evaluation;
    ``admits(spec)`` is the cheap budget screen used for every generated candidate. ``out_of_budget()``
    (the search's time or FLOP budget) is asked before each real evaluation once one succeeded, and before
    each generation: on True no new work starts, and the best finalist already evaluated (else the best
    of the initial population) wins.
    """

    def draw(make: Callable[[], ArchSpec]) -> ArchSpec | None:
        return _draw(make, admits)

    def sample() -> ArchSpec | None:
        return draw(lambda: space.sample(rng, input_shape, num_classes))

    pool, sampled = _initial_population(sample, evaluate_spec, population, out_of_budget)
    finite = [(s, f) for s, f in pool.values() if np.isfinite(f)]
    if not finite:
        raise BudgetError(
            f"the device budget admits no architecture of the {space.name} space among "
            f"{population * SAMPLE_ATTEMPTS} samples; raise the budget or use another space"
        )
    forest, heldout = _predictor(space, finite, seed)
    details: dict[str, Any] = {
        "space": space.name,
        "initial_population": len(finite),
        "predictor_heldout": heldout,
    }
    scored = {str(s): (s, f) for s, f in finite}  # spec -> (spec, fitness: real or predicted)
    current = sorted(scored.values(), key=lambda item: item[1])[:population]
    generations_done = 0
    for _ in range(generations):
        if out_of_budget():
            break
        generations_done += 1
        children: list[ArchSpec] = []
        for _ in range(mutations):
            parent = current[int(rng.integers(len(current)))][0]
            child = draw(lambda p=parent: space.mutate(p, rng, input_shape))
            if child is not None:
                children.append(child)
        for _ in range(crossovers):
            a = current[int(rng.integers(len(current)))][0]
            b = current[int(rng.integers(len(current)))][0]
            child = draw(lambda a=a, b=b: space.crossover(a, b, rng, input_shape))
            if child is not None:
                children.append(child)
        current = _select(space, forest, scored, current, children, population)

    finalists = [s for s, _ in current[:reevaluate]]
    # real fitness: cached for initial members, which need no time
    real = [(s, evaluate_spec(s)[0]) for s in finalists if str(s) in pool or not out_of_budget()]
    best, best_fitness = min(real or finite, key=lambda item: item[1])
    details |= {
        "explored": len(scored),
        "finalists": [{"spec": str(s), "fitness": float(f)} for s, f in real],
        "progress": {
            "initial_population": [sampled, population],
            "generations": [generations_done, generations],
            "reevaluated": [len(real), len(finalists)],
        },
    }
    return best, float(best_fitness), details


def _draw(make: Callable[[], ArchSpec], admits: Callable[[ArchSpec], bool]) -> ArchSpec | None:
    """A candidate the budget screen admits, in at most ``SAMPLE_ATTEMPTS`` tries (None: none)."""
    for _ in range(SAMPLE_ATTEMPTS):
        spec = make()
        if admits(spec):
            return spec
    return None


def _initial_population(
    sample: Callable[[], ArchSpec | None],
    evaluate_spec: Callable[[ArchSpec], tuple[float, str | None]],
    population: int,
    out_of_budget: Callable[[], bool],
) -> tuple[dict[str, tuple[ArchSpec, float]], int]:
    """The initial population's real fitness by spec, and how many were sampled (the budgets are asked
    once one evaluation succeeded)."""
    pool: dict[str, tuple[ArchSpec, float]] = {}
    sampled = 0
    for _ in range(population):
        if any(np.isfinite(f) for _, f in pool.values()) and out_of_budget():
            break
        sampled += 1
        spec = sample()
        if spec is None:
            break
        fitness, rejected = evaluate_spec(spec)
        if rejected is None:
            pool[str(spec)] = (spec, fitness)
    return pool, sampled


def _predictor(
    space: SearchSpace, finite: list[tuple[ArchSpec, float]], seed: int
) -> tuple[Any, dict[str, Any]]:
    """The accuracy predictor fitted on every evaluated spec, and its rank correlation on a held-out fifth
    (fitted on the rest; at least 3 held out, none below 8 specs)."""
    x = np.stack([space.encode(s) for s, _ in finite])
    y = np.asarray([f for _, f in finite], dtype=np.float64)
    n_held = max(3, len(finite) // 5) if len(finite) >= 8 else 0  # a fifth, and at least 3 to rank
    held = np.random.default_rng(seed).permutation(len(finite))[:n_held]
    keep = np.setdiff1d(np.arange(len(finite)), held)
    heldout: dict[str, Any] = {"spearman": None, "kendall": None, "n": 0}
    if n_held:
        probe = predictor(seed).fit(x[keep], y[keep])
        heldout = rank_correlation(probe.predict(x[held]), y[held])
    return predictor(seed).fit(x, y), heldout


def _select(
    space: SearchSpace,
    forest: Any,
    scored: dict[str, tuple[ArchSpec, float]],
    current: list[tuple[ArchSpec, float]],
    children: list[ArchSpec],
    population: int,
) -> list[tuple[ArchSpec, float]]:
    """The next generation: the new children's fitness predicted (into ``scored``), then the best
    ``population`` of the current one and the children."""
    fresh = [c for c in children if str(c) not in scored]
    if fresh:
        predicted = forest.predict(np.stack([space.encode(c) for c in fresh]))
        for child, value in zip(fresh, predicted, strict=True):
            scored[str(child)] = (child, float(value))
    merged = {str(s): (s, f) for s, f in current} | {str(c): scored[str(c)] for c in children}
    return sorted(merged.values(), key=lambda item: item[1])[:population]


def supernet_of(search: SearchConfig) -> str | None:
    """The supernet file a search inherits weights from: an evolution config's ``supernet``; None for every
    other strategy, which trains its candidates from scratch."""
    return search.supernet if isinstance(search, EvolutionConfig) else None
