"""PSO-FedNAS (pFedZKD, Algorithm 2): a swarm of chain specs (:mod:`edge_sdk.models.chain.space`).

Each candidate is trained a few epochs on the local training split; its fitness is the cross-entropy on
the local validation split (lower is better). Every iteration, particle i draws a target layer by layer
from the global best (probability ``cg``) or its personal best, then moves onto it with the alignment
operator :func:`~edge_sdk.models.chain.space.align`. ``repeats`` independent swarms run and the best spec over
all of them wins; the client then trains the ``finalists`` best specs and keeps the most accurate.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from common.checks import check_int, is_number
from common.errors import ConfigError, SpecError
from edge_sdk.halving import schedule_epochs
from edge_sdk.models.arch import family_of, parse_arch
from edge_sdk.models.chain.network import CHAIN_FAMILY
from edge_sdk.models.chain.space import DEFAULT_MAX_DEPTH, ChainSpace, check_max_depth, narrow
from edge_sdk.models.chain.spec import MAX_DEPTH, ChainSpec, Layer
from edge_sdk.strategies.base import SearchConfig, check_arch
from edge_sdk.strategies.evaluator import Evaluation, Evaluator, Found

__all__ = ["INIT_ATTEMPTS", "WARM_NARROWINGS", "PSOConfig", "run"]

INIT_ATTEMPTS = 50  # samples per initial particle before giving up on the budget
WARM_NARROWINGS = 3  # halvings of the warm-start architecture's widths tried before a random particle 0


@dataclass(frozen=True, kw_only=True)
class PSOConfig(SearchConfig):
    """PSO's options over the shared ones (:class:`~edge_sdk.strategies.base.SearchConfig`).

    Attributes:
        particles: swarm size.
        iterations: PSO generations after the initial swarm.
        repeats: independent swarms; the best architecture over all of them is returned.
        cg: probability that a target layer comes from the global best rather than the personal best.
        max_depth: longest chain the sampler draws (3 to 20); PSO never grows a particle past the longer
            of its two guides, so this bounds the whole search.
        fixed_arch: the architecture a warm-started swarm begins from (strategy pso) or that is trained
            as it is (strategy fixed); none: from the input's recipe, pFedZKD's CNN1 for plain images
            and a three-stage design of 3x3 convolutions for the pictures the recipe augments.
        warm_start: particle 0 of every swarm starts at the fixed architecture (its widths halved until
            it fits the budget) instead of a random architecture, so the search never does worse by
            fitness than that baseline; ours, not in the paper's Algorithm 2 (the paper preset turns it
            off).
        finalists: how many of the best distinct architectures by fitness the client trains fully,
            keeping the most accurate on validation: a short training's fitness misranks candidates
            whose learning curves cross later. 1: the paper's Algorithm 2.
        finalist_share: successive halving of the finalists: this share of the final epochs (at least
            one) is spread over the rungs of the halving on the whole training split, and the last
            finalist goes on to all of them: of those within one standard error of the most accurate on
            validation, the warm start unless another costs no more FLOPs, parameters and training
            memory, else the cheapest in FLOPs. 1.0 with no halving trains every finalist fully.
        finalist_keep: the share of the finalists that goes on after each rung of the halving: 0.5
            with three finalists trains all three one epoch, the best two a second, and the best of
            those on; 0 decides among all of them at once.
        finalists_beat_warm: a finalist other than the warm start must have beaten it by fitness in
            the search. The search's short training is the halving's first look: a spec it measured
            behind the hand-made design has already lost to it there, and the halving keeps the warm
            start on a tie. When the warm start is the search's best, it trains alone: no halving.
    """

    strategy: ClassVar[str] = "pso"
    own_presets: ClassVar[dict[str, dict[str, Any]]] = {
        "paper": {
            "particles": 20,
            "iterations": 10,
            "repeats": 10,
            "max_depth": MAX_DEPTH,
            "warm_start": False,
            "finalists": 1,
        },
    }

    particles: int = 6
    iterations: int = 3
    repeats: int = 1
    cg: float = 0.5
    max_depth: int = DEFAULT_MAX_DEPTH
    fixed_arch: str | None = None  # none: from the input's recipe (SearchConfig.for_input)
    warm_start: bool = True
    finalists: int = 3
    finalist_share: float = 0.25
    finalist_keep: float = 0.5
    finalists_beat_warm: bool = True

    def __post_init__(self) -> None:
        for name, low in (("particles", 1), ("iterations", 0), ("repeats", 1), ("finalists", 1)):
            check_int(name, getattr(self, name), low)
        super().__post_init__()
        check_max_depth(self.max_depth)
        for name in ("warm_start", "finalists_beat_warm"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if not (is_number(self.finalist_share) and 0.0 < self.finalist_share <= 1.0):  # type: ignore[operator]
            raise ConfigError(f"finalist_share must be a number in (0, 1], got {self.finalist_share!r}")
        if not (is_number(self.finalist_keep) and 0.0 <= self.finalist_keep < 1.0):  # type: ignore[operator]
            raise ConfigError(
                f"finalist_keep must be a number in [0, 1), got {self.finalist_keep!r}; fix: the share of "
                "finalists kept after each rung (0: one rung)"
            )
        if not (isinstance(self.cg, int | float) and 0.0 <= self.cg <= 1.0):
            raise ConfigError(f"cg must be a number in [0, 1], got {self.cg!r}")
        if self.fixed_arch is not None:
            check_arch("fixed_arch", self.fixed_arch)

    def finalist_epochs(self) -> int:
        """Epochs every finalist trains before all but the best stop (``final_epochs`` when one)."""
        final_epochs = self.resolved_final_epochs()
        if self.finalists == 1 or final_epochs == 0:
            return final_epochs
        return min(final_epochs, max(1, round(self.finalist_share * final_epochs)))

    def final_training_epochs(self) -> int:
        final_epochs = self.resolved_final_epochs()
        return schedule_epochs(self.finalists, self.finalist_epochs(), self.finalist_keep, final_epochs)

    def rng_streams(self) -> int:
        return self.repeats

    def planned_candidates(self) -> int:
        return self.repeats * self.particles * (self.iterations + 1)


def _warm_spec(ev: Evaluator, config: PSOConfig) -> tuple[ChainSpec, Evaluation] | None:
    """``fixed_arch`` as the warm-start particle, narrowed until the budget admits it, evaluated; None
    if it is no chain, is too deep, or no narrowing fits."""
    spec = parse_arch(config.fixed_arch)
    if family_of(spec) is not CHAIN_FAMILY or len(spec.layers) > config.max_depth:
        return None
    try:
        spec = spec.with_num_classes(ev.num_classes).validate(ev.input_shape)
    except SpecError:
        return None
    for _ in range(WARM_NARROWINGS + 1):
        if ev.screen(spec)[3] is None:  # screening only: the rejected widths are never trained
            return spec, ev.evaluate(spec)
        spec = narrow(spec)
    return None


def _swarm(
    ev: Evaluator, config: PSOConfig, rng: np.random.Generator
) -> tuple[ChainSpec, float, ChainSpec | None, int, int]:
    """One swarm (Algorithm 2) over the chain space; returns its global best (spec, fitness), the
    warm-start particle (None: none fitted, or warm start off), its particles and the iterations it
    completed.

    When the search's time or FLOPs are spent (:meth:`Evaluator.out_of_budget`, asked before each
    candidate once one trained) the swarm stops where it is: fewer particles, or a partial iteration,
    and its best so far."""
    cfg, shape = config, ev.input_shape
    space = ChainSpace(max_depth=cfg.max_depth)
    positions: list[ChainSpec] = []
    fitness: list[float] = []
    trainable: list[bool] = []
    warm = _warm_spec(ev, cfg) if cfg.warm_start else None
    for i in range(cfg.particles):
        if any(trainable) and ev.out_of_budget():
            break
        if i == 0 and warm is not None:
            spec, result = warm
        else:
            for _ in range(INIT_ATTEMPTS):  # bounded: a tight budget may reject most samples
                spec = space.sample(rng, shape, ev.num_classes)
                result = ev.evaluate(spec)
                if result.rejected is None:
                    break
        positions.append(spec)
        fitness.append(result.fitness)
        trainable.append(result.rejected is None)
        ev.bar.update(1)
        ev.bar.set_postfix(rejected=ev.rejected)
    if not any(trainable):
        raise ev.infeasible(f"architecture among {cfg.particles * INIT_ATTEMPTS} sampled candidates")
    best = min(range(len(positions)), key=lambda i: (not trainable[i], fitness[i]))
    pbest, pfit = list(positions), list(fitness)
    gbest, gfit = pbest[best], pfit[best]
    for iteration in range(cfg.iterations):
        for i in range(len(positions)):
            if ev.out_of_budget():
                return gbest, gfit, None if warm is None else warm[0], len(positions), iteration
            own, glob = pbest[i].layers, gbest.layers
            target: list[Layer] = []
            for j in range(max(len(own), len(glob))):
                take_global = rng.random() <= cfg.cg
                if j >= len(own) or (take_global and j < len(glob)):
                    target.append(glob[j])
                else:
                    target.append(own[j])
            positions[i] = space.align(positions[i], ChainSpec(tuple(target)), rng, shape)
            new = ev.evaluate(positions[i]).fitness
            if new < pfit[i]:
                pbest[i], pfit[i] = positions[i], new
                if new < gfit:
                    gbest, gfit = positions[i], new
            ev.bar.update(1)
            ev.bar.set_postfix(best=f"{gfit:.4f}", rejected=ev.rejected, cached=ev.cache_hits)
    return gbest, gfit, None if warm is None else warm[0], len(positions), cfg.iterations


def run(ev: Evaluator, config: PSOConfig, seeds: list[np.random.SeedSequence]) -> Found:
    """``repeats`` swarms, one per seed (those the search's budgets leave: at least one); the finalists are
    the best distinct specs the search met."""
    swarms = []
    for seq in seeds:
        if swarms and ev.out_of_budget():
            break
        swarms.append(_swarm(ev, config, np.random.default_rng(seq)))
    repeats_best = [(spec, fitness) for spec, fitness, *_ in swarms]
    best_spec, _ = min(repeats_best, key=lambda item: item[1])
    # one spec: every swarm's is the same
    warms = {str(warm) for _, _, warm, *_ in swarms if warm is not None}
    warm = warms.pop() if warms else None
    finalists = [str(best_spec)]
    if config.finalists > 1:
        ranked = sorted(
            (e for e in ev.cache.values() if math.isfinite(e.fitness)), key=lambda e: (e.fitness, e.spec)
        )
        finalists += [e.spec for e in ranked if e.spec != finalists[0]][: config.finalists - 1]
        if warm is not None and warm not in finalists and math.isfinite(ev.cache[warm].fitness):
            finalists[-1] = warm  # the baseline always competes in the final ranking
    details: dict[str, Any] = {}
    if config.finalists_beat_warm and warm in finalists:
        # the finalists are in fitness order, so those behind the warm start are the tail
        bar = ev.cache[warm].fitness
        details["behind_warm"] = [s for s in finalists if s != warm and not ev.cache[s].fitness < bar]
        finalists = [s for s in finalists if s not in details["behind_warm"]]
    progress = {
        "swarms": [len(swarms), config.repeats],
        "particles": [sum(swarm[3] for swarm in swarms), config.repeats * config.particles],
        "iterations": [sum(swarm[4] for swarm in swarms), config.repeats * config.iterations],
    }
    incumbent = warm if warm in finalists else None
    return Found(
        repeats_best=repeats_best,
        details=details,
        finalists=tuple(finalists),
        incumbent=incumbent,
        progress=progress,
    )
