"""Predictor-guided evolution (HAPFNAS Algorithm 2) over either search space.

One small interface per space (:class:`Space`): sample, mutate, crossover and encode-to-vector; cost
and budget screening go through the search's evaluator, so both spaces obey the same device budget.

* elastic space (:mod:`edge_sdk.elastic`) with a supernet: a candidate's fitness is the validation
  cross-entropy of its subnet with inherited weights after BatchNorm recalibration on the local
  training split (:func:`supernet_proxy`): no training at all.
* chain space without a supernet: the fitness is the short training of PSO (candidate-epochs), so the
  two strategies can be compared at equal candidate-epochs.

The initial population is reject-sampled under the budget and evaluated for real; a random forest
(scikit-learn, 100 trees, depth 15 as in HAPFNAS section 5.1) is fitted on (encoded spec, fitness);
each generation adds ``mutations`` mutants and ``crossovers`` children (budget-checked) scored by the
predictor, and keeps the best ``population``. The best ``reevaluate`` distinct specs are then evaluated
for real and the best of those wins. The predictor's Spearman / Kendall rank correlation on a held-out
fifth of the initial population is reported, so its quality is measured on every run.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from common.errors import BudgetError
from edge_sdk import elastic
from edge_sdk.arch import ArchSpec
from edge_sdk.chain import MAX_DEPTH, ChainSpec, Conv, Dense, Layer, Pool
from edge_sdk.data import ArrayDataset
from edge_sdk.train import evaluate, to_float

__all__ = [
    "CHAIN_SPACE",
    "ELASTIC_SPACE",
    "Space",
    "evolve",
    "predictor",
    "rank_correlation",
    "recalibrate_bn",
    "supernet_proxy",
]

SAMPLE_ATTEMPTS = 50  # per wanted candidate: bounded reject sampling


@dataclass(frozen=True)
class Space:
    """The operations evolution needs from a search space."""

    name: str
    sample: Callable[[np.random.Generator, tuple[int, int, int], int], ArchSpec]
    mutate: Callable[[ArchSpec, np.random.Generator, tuple[int, int, int]], ArchSpec]
    crossover: Callable[[ArchSpec, ArchSpec, np.random.Generator, tuple[int, int, int]], ArchSpec]
    encode: Callable[[ArchSpec], np.ndarray]


# ------------------------------------------------------------------------------------------ chain space

_KINDS = {"C": 1, "Pmax": 2, "Pavg": 3, "F": 4}


def _chain_sample(rng: np.random.Generator, shape: tuple[int, int, int], classes: int) -> ArchSpec:
    from edge_sdk.search import sample_spec

    return sample_spec(rng, shape, classes, max_depth=10)


def _chain_mutate(spec: ArchSpec, rng: np.random.Generator, shape: tuple[int, int, int]) -> ArchSpec:
    """Replace one module by a fresh one of a random kind, then repair with the alignment operator."""
    from edge_sdk.search import align, random_conv

    assert isinstance(spec, ChainSpec)
    layers = list(spec.layers)
    j = int(rng.integers(len(layers)))
    old = layers[j]
    if isinstance(old, Dense):
        if j < len(layers) - 1:  # a hidden F: new width (the head keeps the class count)
            layers[j] = Dense(int(rng.choice((32, 64, 128, 192, 256, 300))))
    elif j == 0 or rng.random() < 0.7:
        layers[j] = random_conv(rng)
    else:
        layers[j] = Pool("avg" if rng.random() < 0.5 else "max")
    return align(spec, ChainSpec(tuple(layers)), rng, shape)


def _chain_crossover(
    a: ArchSpec, b: ArchSpec, rng: np.random.Generator, shape: tuple[int, int, int]
) -> ArchSpec:
    """Layer-wise uniform crossover (the PSO target rule with cg 0.5), repaired by alignment."""
    from edge_sdk.search import align

    assert isinstance(a, ChainSpec) and isinstance(b, ChainSpec)
    target: list[Layer] = []
    for j in range(max(len(a.layers), len(b.layers))):
        pool = [s.layers[j] for s in (a, b) if j < len(s.layers)]
        target.append(pool[int(rng.integers(len(pool)))])
    return align(a, ChainSpec(tuple(target)), rng, shape)


def _chain_encode(spec: ArchSpec) -> np.ndarray:
    """MAX_DEPTH slots of (kind, channels, kernel, units), zero-padded."""
    assert isinstance(spec, ChainSpec)
    out = np.zeros((MAX_DEPTH, 4), dtype=np.float32)
    for j, layer in enumerate(spec.layers[:MAX_DEPTH]):
        if isinstance(layer, Conv):
            out[j] = (_KINDS["C"], layer.out_channels, layer.kernel_size, 0)
        elif isinstance(layer, Pool):
            out[j] = (_KINDS["Pmax" if layer.kind == "max" else "Pavg"], 0, 0, 0)
        else:
            out[j] = (_KINDS["F"], 0, 0, layer.units)
    return out.ravel()


CHAIN_SPACE = Space("chain", _chain_sample, _chain_mutate, _chain_crossover, _chain_encode)
ELASTIC_SPACE = Space(
    "elastic",
    lambda rng, shape, classes: elastic.sample_elastic(rng),
    lambda spec, rng, shape: elastic.mutate(spec, rng),  # type: ignore[arg-type]
    lambda a, b, rng, shape: elastic.crossover(a, b, rng),  # type: ignore[arg-type]
    lambda spec: elastic.encode(spec),  # type: ignore[arg-type]
)


# --------------------------------------------------------------------------------------- supernet proxy


@torch.no_grad()
def recalibrate_bn(
    model: nn.Module, data: ArrayDataset, *, batches: int, batch_size: int = 64, seed: int = 0
) -> None:
    """Reset every BatchNorm's running statistics and re-estimate them on ``batches`` batches of ``data``
    (cumulative average), the standard fix for subnet-specific statistics of weight-shared models."""
    norms = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    for bn in norms:
        bn.reset_running_stats()
        bn.momentum = None  # cumulative moving average over the calibration batches
    model.train()
    order = torch.randperm(len(data), generator=torch.Generator().manual_seed(seed))
    for i in range(batches):
        idx = order[i * batch_size : (i + 1) * batch_size]
        if idx.numel() < 2:
            break
        model(to_float(data.x[idx]))
    for bn in norms:
        bn.momentum = 0.1
    model.eval()


def supernet_proxy(
    supernet: elastic.SuperNet, train: ArrayDataset, val: ArrayDataset, *, batches: int = 8, seed: int = 0
) -> Callable[[ArchSpec], float]:
    """fitness(spec): validation cross-entropy of the extracted subnet, BN recalibrated on ``train``."""

    def fitness(spec: ArchSpec) -> float:
        assert isinstance(spec, elastic.ElasticSpec)
        model = elastic.extract(supernet, spec)
        recalibrate_bn(model, train, batches=batches, seed=seed)
        return evaluate(model, val)[0]

    return fitness


# -------------------------------------------------------------------------------------------- evolution


def predictor(seed: int) -> Any:
    """The unfitted accuracy predictor: a random forest with HAPFNAS's settings (section 5.1: 100 trees,
    max depth 15). One place, so the search and the benchmarks that check it fit the same model."""
    from sklearn.ensemble import RandomForestRegressor

    return RandomForestRegressor(n_estimators=100, max_depth=15, random_state=seed)


def rank_correlation(pred: np.ndarray, true: np.ndarray) -> dict[str, float | None]:
    """Spearman and Kendall of predictions against the truth (None when fewer than 3 or constant)."""
    from scipy.stats import kendalltau, spearmanr

    if len(pred) < 3 or np.ptp(true) == 0 or np.ptp(pred) == 0:
        return {"spearman": None, "kendall": None, "n": len(pred)}  # type: ignore[dict-item]
    return {
        "spearman": float(spearmanr(pred, true).statistic),
        "kendall": float(kendalltau(pred, true).statistic),
        "n": len(pred),  # type: ignore[dict-item]
    }


def evolve(
    space: Space,
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
) -> tuple[ArchSpec, float, dict[str, Any]]:
    """Run Algorithm 2; returns (best spec, its real fitness, details for the search report).

    ``evaluate_spec(spec) -> (fitness, rejection or None)`` is the real (cached) evaluation;
    ``admits(spec)`` is the cheap budget screen used for every generated candidate.
    """

    def draw(make: Callable[[], ArchSpec]) -> ArchSpec | None:
        for _ in range(SAMPLE_ATTEMPTS):
            spec = make()
            if admits(spec):
                return spec
        return None

    pool: dict[str, tuple[ArchSpec, float]] = {}  # real fitness of the initial population
    for _ in range(population):
        spec = draw(lambda: space.sample(rng, input_shape, num_classes))
        if spec is None:
            break
        fitness, rejected = evaluate_spec(spec)
        if rejected is None:
            pool[str(spec)] = (spec, fitness)
    finite = [(s, f) for s, f in pool.values() if np.isfinite(f)]
    if not finite:
        raise BudgetError(
            f"the device budget admits no architecture of the {space.name} space among "
            f"{population * SAMPLE_ATTEMPTS} samples; raise the budget or use another space"
        )
    x = np.stack([space.encode(s) for s, _ in finite])
    y = np.asarray([f for _, f in finite], dtype=np.float64)
    n_held = max(3, len(finite) // 5) if len(finite) >= 8 else 0  # a fifth, and at least 3 to rank
    held = np.random.default_rng(seed).permutation(len(finite))[:n_held]
    keep = np.setdiff1d(np.arange(len(finite)), held)
    details: dict[str, Any] = {
        "space": space.name,
        "initial_population": len(finite),
        "predictor_heldout": {"spearman": None, "kendall": None, "n": 0},
    }
    if n_held:
        probe = predictor(seed).fit(x[keep], y[keep])
        details["predictor_heldout"] = rank_correlation(probe.predict(x[held]), y[held])
    forest = predictor(seed).fit(x, y)

    scored = {str(s): (s, f) for s, f in finite}  # spec -> (spec, fitness: real or predicted)
    current = sorted(scored.values(), key=lambda item: item[1])[:population]
    for _ in range(generations):
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
        fresh = [c for c in children if str(c) not in scored]
        if fresh:
            predicted = forest.predict(np.stack([space.encode(c) for c in fresh]))
            for child, value in zip(fresh, predicted, strict=True):
                scored[str(child)] = (child, float(value))
        merged = {str(s): (s, f) for s, f in current} | {str(c): scored[str(c)] for c in children}
        current = sorted(merged.values(), key=lambda item: item[1])[:population]

    finalists = [s for s, _ in current[:reevaluate]]
    real = [(s, evaluate_spec(s)[0]) for s in finalists]  # cached for initial members
    best, best_fitness = min(real, key=lambda item: item[1])
    details |= {
        "explored": len(scored),
        "finalists": [{"spec": str(s), "fitness": float(f)} for s, f in real],
    }
    return best, float(best_fitness), details
