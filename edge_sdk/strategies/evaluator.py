"""The shared evaluator of every strategy: screen a candidate against the device budget, then score it
(a short training, or a strategy's proxy), with a per-spec cache and the search's running counters.

Every candidate is screened before it is trained: the analytic cost (:meth:`ChainSpec.cost`) against
the FLOP and parameter budgets, then the estimated training memory
(:func:`edge_sdk.profiling.profile_model`) and the final training's time. A candidate over budget is
never trained; it gets fitness ``inf`` and the budget message. Fitness is cached by spec string, so a
spec met again costs nothing. The search as a whole has two budgets a strategy asks about before each new
candidate (:meth:`Evaluator.out_of_budget`): its share of the device's time and the training FLOPs it may
spend (counted as the device plan counts them, :mod:`edge_sdk.plan`).
"""

from __future__ import annotations

import dataclasses
import math
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from common.errors import BudgetError
from common.seeding import seeded
from common.timing import Deadline
from edge_sdk.data import ArrayDataset
from edge_sdk.models.arch import ArchSpec, analytic_cost, build_model
from edge_sdk.plan import pass_flops
from edge_sdk.profiling import (
    FINAL_TRAINING_SHARE,
    ModelProfile,
    budget_pair,
    fits,
    profile_model,
    train_seconds,
    trains_in_time,
)
from edge_sdk.strategies.base import SearchConfig
from edge_sdk.train import TrainConfig, evaluate, train
from profiles import DeviceProfile

__all__ = ["Evaluation", "Evaluator", "Found"]


@dataclass(frozen=True)
class Evaluation:
    """One candidate met by the search.

    ``fitness`` is the validation cross-entropy, ``inf`` when the candidate was rejected (``rejected`` holds
    the budget message) or its training diverged. ``train_memory_bytes`` is 0 when the FLOP/parameter
    screen rejected the candidate before its memory was estimated (and ``flops`` is 0 for a zoo model
    rejected on parameters before its FLOPs were counted). A ``cached`` entry repeats an earlier result of
    the same spec and trained nothing (``epochs`` 0).
    """

    spec: str
    fitness: float
    flops: int
    params: int
    train_memory_bytes: int
    epochs: int
    seconds: float
    cached: bool
    rejected: str | None


@dataclass(frozen=True)
class Found:
    """What one strategy run returns to :func:`edge_sdk.search.search`: (spec, fitness) of each
    independent run (the best of them wins), strategy-specific details for the report, the finalists
    the client trains (empty: the winner alone), ``incumbent``: the hand-made design among them that the
    search started from (None: none), and ``progress``: [done, planned] of each of the strategy's loops
    (PSO's swarms and iterations, evolution's generations), what a time budget cut."""

    repeats_best: list[tuple[ArchSpec, float]]
    details: dict[str, Any] = field(default_factory=dict)
    finalists: tuple[str, ...] = ()
    incumbent: str | None = None
    progress: dict[str, list[int]] = field(default_factory=dict)


@dataclass
class Evaluator:
    """Screens, trains and caches candidates for one search; keeps the running counters."""

    train_split: ArrayDataset
    val_split: ArrayDataset
    profile: DeviceProfile
    config: SearchConfig
    seed: int
    device: torch.device
    bar: Any
    precision: str = "fp32"  # resolved: fp32 or bf16 (edge_sdk.precision), for training and fitness
    cache: dict[str, Evaluation] = field(default_factory=dict)
    evaluations: list[Evaluation] = field(default_factory=list)
    candidate_epochs: int = 0
    rejected: int = 0
    cache_hits: int = 0
    needs: dict[str, float] = field(default_factory=dict)  # smallest budget share seen, per budget
    proxy: Callable[[ArchSpec], float] | None = None  # fitness without training (evolution's supernet)
    screened: dict[str, tuple[int, int, int, str | None]] = field(default_factory=dict)
    final_samples: int = 0  # images of the final training (the whole split; candidates see a subset)
    deadline: Deadline | None = None  # the search's share of the device's time budget (None: unbounded)
    stopped: bool = False  # a strategy asked for more time than was left and stopped (out_of_budget)
    flop_budget: int | None = None  # training FLOPs the search may spend (None: unbounded)
    # FLOPs per image a candidate may cost (SearchConfig.flop_cap times the plan's design; None: the profile's
    # max_flops alone)
    flop_cap: int | None = None
    spent_flops: int = 0  # training FLOPs of the candidates trained so far (the plan's counting)
    flops_spent: bool = False  # the FLOP budget ended the search (out_of_budget)
    curves: dict[str, list[float]] = field(default_factory=dict)  # spec -> its training's loss per epoch

    @property
    def input_shape(self) -> tuple[int, int, int]:
        return self.train_split.input_shape

    @property
    def num_classes(self) -> int:
        return self.train_split.num_classes

    def screen(self, spec: ArchSpec) -> tuple[int, int, int, str | None]:
        """(flops, params, train memory bytes, budget message or None), memoised per spec."""
        key = str(spec)
        if key not in self.screened:
            self.screened[key] = self._screen(spec)
        return self.screened[key]

    def _screen(self, spec: ArchSpec) -> tuple[int, int, int, str | None]:
        # Cheapest checks first: a chain's FLOPs and parameters are analytic, so an oversized chain is
        # never built; a zoo model's parameters are counted on the meta device (no weights allocated).
        # Only what passes gets the training-memory dry run of profile_model.
        cost = analytic_cost(spec, self.input_shape, self.num_classes)
        if cost is not None:
            flops, params = cost
            self._note(flops=flops, params=params)
        else:
            with torch.device("meta"):
                shell = build_model(spec, self.input_shape, self.num_classes)
            flops, params = 0, sum(p.numel() for p in shell.parameters())  # FLOPs: counted below
            self._note(params=params)
        reason = fits(
            ModelProfile(
                flops=flops,
                macs=flops // 2,
                params=params,
                param_bytes=4 * params,
                train_memory_bytes=0,
                inference_memory_bytes=0,
            ),
            self.profile,
        )
        if reason is None and flops:
            reason = self._over_cap(flops) or self._slow(flops)
        if reason is not None:
            return flops, params, 0, reason
        with torch.random.fork_rng(devices=[]):  # weight init here must not consume the caller's RNG
            model = build_model(spec, self.input_shape, self.num_classes)
        cost = profile_model(model, self.input_shape, batch_size=self.config.batch_size)
        self._note(flops=cost.flops, params=cost.params, memory=cost.train_memory_bytes)
        reason = fits(cost, self.profile) or self._over_cap(cost.flops) or self._slow(cost.flops)
        return cost.flops, cost.params, cost.train_memory_bytes, reason

    def _over_cap(self, flops: int) -> str | None:
        """The search's own FLOP cap per image (``flop_cap``), checked beside the profile's ``max_flops``."""
        if self.flop_cap is None or flops <= self.flop_cap:
            return None
        self.needs["flop_cap"] = min(self.needs.get("flop_cap", math.inf), flops / self.flop_cap)
        got, limit = budget_pair(flops, self.flop_cap, "FLOP")
        return (
            f"flops {got} exceeds the search's cap {limit} "
            f"(flop_cap {self.config.flop_cap:g} x the planned design's FLOPs)"
        )

    def _slow(self, flops: int) -> str | None:
        """The device-time budget: the final training of this candidate, the finalists' shared epochs
        included, at the profile's GFLOP/s (a model that fits in memory and FLOPs can still need hours)."""
        epochs = self.config.final_training_epochs()
        samples = self.final_samples or len(self.train_split)
        need = train_seconds(flops, samples, epochs, self.profile)
        self.needs["time_budget_s"] = min(
            self.needs.get("time_budget_s", math.inf),
            need / (FINAL_TRAINING_SHARE * self.profile.time_budget_s),
        )
        return trains_in_time(flops, samples, epochs, self.profile)

    def _note(self, *, flops: int | None = None, params: int, memory: int | None = None) -> None:
        shares = {"max_params": params / self.profile.max_params}
        if flops is not None:
            shares["max_flops"] = flops / self.profile.max_flops
        if memory is not None:
            shares["memory_mb"] = memory / self.profile.memory_bytes
        for name, share in shares.items():
            self.needs[name] = min(self.needs.get(name, math.inf), share)

    def evaluate(self, spec: ArchSpec) -> Evaluation:
        key = str(spec)
        if key in self.cache:
            result = dataclasses.replace(self.cache[key], epochs=0, seconds=0.0, cached=True)
            self.cache_hits += 1
        else:
            start = time.perf_counter()
            flops, params, memory, reason = self.screen(spec)
            fitness, epochs = math.inf, 0
            if reason is None and self.proxy is not None:
                fitness, epochs = float(self.proxy(spec)), 0
            elif reason is None:
                fitness, epochs = self._fitness(spec, key), self.config.search_epochs
                self.candidate_epochs += epochs
                self.spent_flops += pass_flops(flops, 1, epochs * len(self.train_split), len(self.val_split))
            else:
                self.rejected += 1
            result = Evaluation(
                spec=key,
                fitness=fitness,
                flops=flops,
                params=params,
                train_memory_bytes=memory,
                epochs=epochs,
                seconds=time.perf_counter() - start,
                cached=False,
                rejected=reason,
            )
            self.cache[key] = result
        self.evaluations.append(result)
        return result

    def _fitness(self, spec: ArchSpec, key: str) -> float:
        # A spec's seed depends on (search seed, spec) only, so its fitness does not depend on when the
        # search first meets it.
        seed = int(np.random.SeedSequence([self.seed, zlib.crc32(key.encode())]).generate_state(1)[0])
        with seeded(seed, self.device):
            model = build_model(spec, self.input_shape, self.num_classes)
        config = TrainConfig(
            epochs=self.config.search_epochs,
            lr=self.config.lr,
            batch_size=self.config.batch_size,
            precision=self.precision,
            **self.config.recipe(),
        )
        self.curves[key] = train(model, self.train_split, config=config, seed=seed, device=self.device)
        loss, _ = evaluate(model, self.val_split, device=self.device, precision=self.precision)
        return loss if math.isfinite(loss) else math.inf  # a diverged candidate is never the best

    def out_of_budget(self) -> bool:
        """Whether the search's time or its FLOPs are spent: a strategy asks before it starts another
        candidate (never before its first trainable one) and, on True, returns the best it has; which
        budget ended it is recorded (``stopped``: the time, ``flops_spent``: the FLOPs)."""
        if self.deadline is not None and self.deadline.expired():
            self.stopped = True
        if self.flop_budget is not None and self.spent_flops >= self.flop_budget:
            self.flops_spent = True
        return self.stopped or self.flops_spent

    def infeasible(self, what: str) -> BudgetError:
        parts = [
            f"{name}: smallest need {share:.2f}x the budget" for name, share in sorted(self.needs.items())
        ]
        tightest = max(self.needs, key=self.needs.__getitem__) if self.needs else "unknown"
        return BudgetError(
            f"the budget of profile {self.profile.name!r} admits no {what} ({'; '.join(parts)}); "
            f"tightest budget: {tightest}. Raise it in the profile or use a larger device"
        )
