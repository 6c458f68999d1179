"""Architecture search under a device budget: the strategy registry and :func:`search`.

Strategies, one module each under :mod:`edge_sdk.strategies`, with their own configs:

- ``pso`` (:mod:`~edge_sdk.strategies.pso`): PSO-FedNAS (pFedZKD, Algorithm 2) over the chain space.
- ``fixed`` and ``random-pool`` (:mod:`~edge_sdk.strategies.baselines`): pFedZKD's ablations.
- ``evolution`` (:mod:`~edge_sdk.strategies.evolution`): HAPFNAS's predictor-guided evolution, over the
  elastic space with a supernet file or over the chain space without one.

Every candidate goes through the shared evaluator (:mod:`edge_sdk.strategies.evaluator`): screened
against the budget before it is trained, cached by spec. The search returns specs, not weights: the
client trains the winner (PSO: each of the ``finalists`` best specs, keeping the most accurate on
validation) for ``final_epochs`` afterwards.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from common.checks import check_int
from common.configs import config_from_dict, refuse_renamed
from common.errors import ConfigError, DataError
from common.timing import Deadline
from edge_sdk.data import ArrayDataset
from edge_sdk.plan import final_training_flops, reference_flops, search_flop_budget
from edge_sdk.precision import resolve_precision
from edge_sdk.strategies import baselines, evolution, pso
from edge_sdk.strategies.base import RECORD_DEFAULTS, SearchConfig
from edge_sdk.strategies.evaluator import Evaluation, Evaluator, Found
from profiles import DeviceProfile

__all__ = [
    "STRATEGIES",
    "SearchResult",
    "Strategy",
    "build_search_config",
    "replace_search_config",
    "search",
    "search_config_from_dict",
]


@dataclass(frozen=True)
class Strategy:
    """A registered strategy: its config class and ``run(evaluator, config, seeds) -> Found`` (one seed
    per :meth:`SearchConfig.rng_streams`)."""

    config: type[SearchConfig]
    run: Callable[[Evaluator, Any, list[np.random.SeedSequence]], Found]


STRATEGIES: dict[str, Strategy] = {
    "pso": Strategy(pso.PSOConfig, pso.run),
    "fixed": Strategy(baselines.FixedConfig, baselines.run_fixed),
    "random-pool": Strategy(baselines.RandomPoolConfig, baselines.run_random_pool),
    "evolution": Strategy(evolution.EvolutionConfig, evolution.run),
}


def _strategy(name: object) -> Strategy:
    if not isinstance(name, str) or name not in STRATEGIES:
        raise ConfigError(f"strategy must be one of {tuple(STRATEGIES)}, got {name!r}")
    return STRATEGIES[name]


def _refuse_foreign(config_class: type[SearchConfig], options: dict[str, Any]) -> None:
    """An option of another strategy is refused by name, an old name by its new one (an unknown one is
    left to the config)."""
    refuse_renamed(config_class, options, "search")
    own = {f.name for f in dataclasses.fields(config_class)}
    for name in sorted(options):
        users = [
            key for key, s in STRATEGIES.items() if name in {f.name for f in dataclasses.fields(s.config)}
        ]
        if name not in own and users:
            raise ConfigError(
                f"search option {name!r} does not apply to strategy {config_class.strategy!r} "
                f"(it is an option of {', '.join(users)}); drop it, or choose strategy {users[0]}"
            )


def build_search_config(preset: str = "fast", *, strategy: str = "pso", **overrides: Any) -> SearchConfig:
    """The ``preset`` (``fast`` or ``paper``) of ``strategy``'s config with fields overridden by keyword;
    an option of another strategy is refused."""
    config_class = _strategy(strategy).config
    _refuse_foreign(config_class, overrides)
    return config_class.preset(preset, **overrides)


def replace_search_config(base: SearchConfig, **changes: Any) -> SearchConfig:
    """``base`` with ``changes``; a ``strategy`` change builds that strategy's config from the fields it
    shares with ``base`` (an option of another strategy is refused)."""
    config_class = _strategy(changes.pop("strategy", base.strategy)).config
    _refuse_foreign(config_class, changes)
    names = {f.name for f in dataclasses.fields(config_class)}
    unknown = sorted(set(changes) - names)
    if unknown:
        raise ConfigError(f"unknown search options {unknown}; valid options are {sorted(names)}")
    kept = {name: getattr(base, name) for name in names if hasattr(base, name)}
    return config_class(**(kept | changes))


def search_config_from_dict(data: object, base: SearchConfig | None = None) -> SearchConfig:
    """The inverse of :meth:`SearchConfig.to_dict`, and a search table a person wrote: ``strategy`` (else
    ``base``'s, else pso) picks the config class; the other keys are its fields, over ``base`` when it is
    of that class (else the class's defaults).

    A record (every key of :data:`RECORD_DEFAULTS`) carries the other strategies' options at their record
    defaults: those are dropped, one at another value is refused (no run of this strategy wrote it). In
    a table a person wrote, an option of another strategy is refused by name."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"search must be a table of keys, got {type(data).__name__}: {data!r}")
    options = dict(data)
    config_class = _strategy(options.pop("strategy", base.strategy if base is not None else "pso")).config
    own = {f.name for f in dataclasses.fields(config_class)}
    if set(data) == set(RECORD_DEFAULTS):
        changed = sorted(k for k, v in options.items() if k not in own and v != RECORD_DEFAULTS[k])
        if changed:
            raise ConfigError(
                f"search record of strategy {config_class.strategy!r} sets {changed}, options of other "
                f"strategies, away from their record defaults {[RECORD_DEFAULTS[k] for k in changed]}; "
                "fix: reset them or drop them from the table"
            )
        options = {k: v for k, v in options.items() if k in own}
    else:
        _refuse_foreign(config_class, options)
    kept = base if type(base) is config_class else None
    return config_from_dict(config_class, options, what="search", base=kept)


@dataclass(frozen=True)
class SearchResult:
    """What a search found and what it cost.

    ``rejected`` counts distinct specs rejected by the budget; ``cache_hits`` counts evaluations answered
    from the cache; ``candidate_epochs`` is the number of epochs actually trained; ``repeats_best`` holds
    (spec, fitness) of each independent swarm; ``finalists`` the specs the client trains fully and picks
    from, best fitness first (``best_spec`` alone unless ``PSOConfig.finalists`` > 1); ``incumbent`` the
    finalist that is the hand-made design the search was warm-started from, which the client keeps
    unless another is better beyond the noise or no costlier (:func:`edge_sdk.halving.rank_finalists`).
    """

    strategy: str
    best_spec: str
    best_fitness: float
    evaluations: tuple[Evaluation, ...]
    candidate_epochs: int
    rejected: int
    cache_hits: int
    seconds: float
    repeats_best: tuple[tuple[str, float], ...]
    details: dict[str, Any] = field(default_factory=dict)  # strategy-specific (evolution: predictor)
    finalists: tuple[str, ...] = ()
    incumbent: str | None = None
    budget_stopped: bool = False  # the time budget ended the search before its plan (see progress)
    flop_budget: int | None = None  # the training FLOPs the search could spend (None: unbounded)
    spent_flops: int = 0  # what its candidates' training spent (edge_sdk.plan's counting)
    flops_spent: bool = False  # the FLOP budget ended the search before its plan (see progress)
    flop_cap: int | None = None  # the most FLOPs per image a candidate could cost (None: max_flops alone)
    progress: dict[str, list[int]] = field(default_factory=dict)  # [done, planned] per strategy loop
    # the best spec's training loss per epoch (empty when a proxy scored it): the client report's curve
    best_curve: tuple[dict[str, float], ...] = ()

    def __post_init__(self) -> None:
        if not self.finalists:
            object.__setattr__(self, "finalists", (self.best_spec,))

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly: an infinite (rejected / diverged) fitness is written as ``None`` (null)."""
        return {
            "strategy": self.strategy,
            "best_spec": self.best_spec,
            "best_fitness": _finite(self.best_fitness),
            "candidate_epochs": self.candidate_epochs,
            "rejected": self.rejected,
            "cache_hits": self.cache_hits,
            "seconds": round(self.seconds, 3),
            "repeats_best": [{"spec": s, "fitness": _finite(f)} for s, f in self.repeats_best],
            "finalists": list(self.finalists),
            "incumbent": self.incumbent,
            "details": self.details,
            "budget_stopped": self.budget_stopped,
            "flop_budget": self.flop_budget,
            "spent_flops": self.spent_flops,
            "flops_spent": self.flops_spent,
            "flop_cap": self.flop_cap,
            "progress": self.progress,
            "evaluations": [
                dataclasses.asdict(e) | {"fitness": _finite(e.fitness), "seconds": round(e.seconds, 3)}
                for e in self.evaluations
            ],
        }


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


def search(
    train: ArrayDataset,
    val: ArrayDataset,
    *,
    profile: DeviceProfile,
    config: SearchConfig,
    seed: int,
    device: str | torch.device = "cpu",
    progress: bool = False,
    precision: str = "auto",
    deadline: Deadline | None = None,
) -> SearchResult:
    """Find an architecture for this client's data and device with ``config.strategy``.

    Deterministic for a given seed on a given device (weight init, batch order and Dropout are seeded per
    candidate). Candidates train and are scored at ``precision`` (:mod:`edge_sdk.precision`). Raises
    :class:`BudgetError` when the budget admits no candidate. Past ``deadline`` the strategy starts no
    new candidate and returns the best it found (at least one trained candidate): ``budget_stopped``.
    So it does once its candidates have spent ``config.search_budget`` times the final training's planned
    FLOPs (:func:`edge_sdk.plan.search_flop_budget`): ``flops_spent``. A candidate costing more FLOPs per
    image than ``config.flop_cap`` times the planned design's is rejected as one over the profile is.
    """
    check_int("seed", seed, 0)
    strategy = _strategy(config.strategy)
    config = config.for_input(train.input_shape)
    if not isinstance(config, strategy.config):
        raise ConfigError(f"config must be a {strategy.config.__name__}, got {type(config).__name__}")
    precision = resolve_precision(precision, device)
    if len(train) == 0 or len(val) == 0:
        raise DataError(
            f"search needs non-empty train and validation splits, got {len(train)} and {len(val)}"
        )
    if train.input_shape != val.input_shape or train.num_classes != val.num_classes:
        raise DataError(
            f"train and validation splits disagree: shapes {train.input_shape} vs {val.input_shape}, "
            f"classes {train.num_classes} vs {val.num_classes}"
        )
    start = time.perf_counter()
    subset_seq, *seeds = np.random.SeedSequence(seed).spawn(config.rng_streams() + 1)
    full = len(train)
    if config.max_train_samples is not None and len(train) > config.max_train_samples:
        picked = np.random.default_rng(subset_seq).choice(len(train), config.max_train_samples, replace=False)
        train = train.subset(np.sort(picked))
    planned = config.planned_candidates()
    final = final_training_flops(
        config,
        profile,
        n_train=full,
        n_val=len(val),
        input_shape=train.input_shape,
        num_classes=train.num_classes,
    )
    flop_budget = search_flop_budget(config, final)
    flop_cap = None
    if config.flop_cap is not None:
        reference = reference_flops(config, profile, train.input_shape, train.num_classes)
        flop_cap = int(config.flop_cap * reference)
    with tqdm(total=planned, desc=f"search ({config.strategy})", unit="cand", disable=not progress) as bar:
        ev = Evaluator(
            train,
            val,
            profile,
            config,
            seed,
            torch.device(device),
            bar,
            precision,
            final_samples=full,
            deadline=deadline,
            flop_budget=flop_budget,
            flop_cap=flop_cap,
        )
        found = strategy.run(ev, config, seeds)
    best_spec, best_fitness = min(found.repeats_best, key=lambda item: item[1])
    return SearchResult(
        strategy=config.strategy,
        best_spec=str(best_spec),
        best_fitness=float(best_fitness),
        evaluations=tuple(ev.evaluations),
        candidate_epochs=ev.candidate_epochs,
        rejected=ev.rejected,
        cache_hits=ev.cache_hits,
        seconds=time.perf_counter() - start,
        repeats_best=tuple((str(s), float(f)) for s, f in found.repeats_best),
        details=found.details,
        finalists=found.finalists,
        incumbent=found.incumbent,
        budget_stopped=ev.stopped,
        flop_budget=flop_budget,
        spent_flops=ev.spent_flops,
        flops_spent=ev.flops_spent,
        flop_cap=flop_cap,
        progress=found.progress,
        best_curve=tuple({"train_loss": loss} for loss in ev.curves.get(str(best_spec), ())),
    )
