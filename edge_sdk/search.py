"""Architecture search under a device budget: PSO-FedNAS (pFedZKD, Algorithm 2) and two ablation strategies.

- ``pso``: a swarm of chain specs (:mod:`edge_sdk.arch`). Each candidate is trained a few epochs on the
  local training split; its fitness is the cross-entropy on the local validation split (lower is better).
  Every iteration, particle i draws a target layer by layer from the global best (probability ``cg``) or
  its personal best, then moves onto it with the alignment operator :func:`align`. ``repeats``
  independent swarms run and the best spec over all of them wins.
- ``fixed``: one given architecture (the homogeneous ablation).
- ``random-pool``: a seeded pick from :data:`edge_sdk.zoo.RANDOM_POOL` among the members that fit the device
  (the random heterogeneous ablation).
- ``evolution``: HAPFNAS's predictor-guided evolution (:mod:`edge_sdk.evolution`): over the elastic
  MobileNetV3-like space with a supernet file (fitness = inherited weights + BN recalibration, no
  training), or over the chain space without one (fitness = the same short training as PSO).

Every candidate is screened before it is trained: the analytic cost (:meth:`ChainSpec.cost`, microseconds)
against the FLOP and parameter budgets, then the estimated training memory
(:func:`edge_sdk.profiling.profile_model`). A candidate over budget is never trained; it gets fitness
``inf`` and the budget message. Fitness is cached by spec string, so a spec met again costs nothing.

The search returns specs, not weights: the client trains the winner (PSO: each of the ``finalists`` best
specs, keeping the most accurate on validation) for ``final_epochs`` afterwards.
"""

from __future__ import annotations

import dataclasses
import math
import time
import zlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from common.checks import check_int, from_preset
from common.errors import BudgetError, ConfigError, DataError, SpecError
from common.seeding import seeded
from edge_sdk.arch import ArchSpec, build_model, parse_arch
from edge_sdk.chain import (
    MAX_CHANNELS,
    MAX_DEPTH,
    MAX_KERNEL,
    MAX_UNITS,
    MIN_DEPTH,
    ChainSpec,
    Conv,
    Dense,
    Layer,
    Pool,
)
from edge_sdk.data import ArrayDataset
from edge_sdk.elastic import ElasticSpec, cost_of, load_supernet
from edge_sdk.precision import resolve_precision
from edge_sdk.profiling import (
    FINAL_TRAINING_SHARE,
    ModelProfile,
    fits,
    profile_model,
    train_seconds,
    trains_in_time,
)
from edge_sdk.train import TrainConfig, evaluate, train
from edge_sdk.zoo import RANDOM_POOL
from profiles import DeviceProfile

__all__ = [
    "STRATEGIES",
    "Evaluation",
    "SearchConfig",
    "SearchResult",
    "align",
    "random_conv",
    "sample_spec",
    "search",
]

STRATEGIES = ("pso", "fixed", "random-pool", "evolution")

# Discrete choices of the sampler (within the arch rules: <= 128 channels, odd kernels <= 7, <= 300 units).
CHANNELS = (8, 16, 32, 48, 64, 96, 128)
KERNELS = (1, 3, 5, 7)
HIDDEN_UNITS = (32, 64, 128, 192, 256, 300)
CONV_PROBABILITY = 0.7  # vs 0.3 for pooling (pFedZKD section 4.1.2)
MAX_DENSE = 3  # F modules per sampled chain, the head included
INIT_ATTEMPTS = 50  # samples per initial particle before giving up on the budget
WARM_NARROWINGS = 3  # halvings of the warm-start architecture's widths tried before a random particle 0


@dataclass(frozen=True, kw_only=True)
class SearchConfig:
    """Search options. The defaults are the ``fast`` preset; ``preset("paper")`` is section 4.1.2.

    Attributes:
        strategy: one of :data:`STRATEGIES`.
        particles: swarm size N.
        iterations: PSO generations after the initial swarm.
        epochs: training epochs per candidate (fitness evaluation).
        repeats: independent swarms; the best spec over all of them is returned.
        final_epochs: epochs the client trains the winner for afterwards (read by the client, not here).
        cg: probability that a target layer comes from the global best rather than the personal best.
        lr, batch_size: Adam settings of candidate training (also the batch of the memory estimate).
        fixed_arch: the architecture of the ``fixed`` strategy (its head is resized to the class count).
        max_train_samples: train each candidate on a seeded random subset this large (None = the whole
            split). A speed knob: fitness is still measured on the whole validation split. The fast
            default of 2000 keeps a 6,000-image MNIST client's search to a few minutes on 2 CPU cores.
        max_depth: longest chain the sampler draws (3..20). Shorter chains train faster; PSO never grows
            a particle past the longer of its two guides, so this bounds the whole search.
        population, mutations, crossovers, generations, reevaluate: evolution knobs (N_pop, N_m, N_c,
            generations, finalists evaluated for real); the paper preset is 256/128/128/20.
        supernet: path of a supernet file (``server-kit supernet``): evolution then searches the elastic
            space with inherited weights; None searches the chain space by short training.
        calib_batches: BatchNorm recalibration batches per elastic candidate.
        warm_start: ours, not in Algorithm 2: particle 0 of every swarm starts at ``fixed_arch`` (a
            chain spec; when the budget rejects it, its widths are halved until it fits, at most
            :data:`WARM_NARROWINGS` times) instead of a random spec, so the swarm's global best is never
            worse by fitness than that baseline and the other particles are pulled toward it. The
            ``paper`` preset turns it off.
        finalists: ours, not in Algorithm 2: PSO returns its ``finalists`` best distinct specs by
            fitness (with a warm start the warm-start spec is always one of them, taking the last place
            if its fitness ranks it lower) and the client trains each for ``final_epochs``, keeping the
            most accurate on the validation split.
            Short-training fitness misranks candidates whose curves cross later (measured on MNIST:
            CNN1 lost to a chain that ended 1.4 points below it); this buys the final ranking for
            ``finalists - 1`` extra final trainings. 1 = Algorithm 2 (``paper``).
        finalist_share: ours, successive halving of the finalists: each trains
            :meth:`finalist_epochs` (this share of ``final_epochs``, at least one) on the whole training
            split, and one goes on to ``final_epochs``: the cheapest within one standard error of the
            most accurate on validation (``edge_sdk.client``). 1.0 trains every finalist fully.
            Measured on the MNIST clients (benchmarks/RESULTS.md, "Speed"): the three full trainings
            cost 2.5x the winner's alone, while the finalists' validation accuracies spanned 0-1.8
            points (median 0.55); a quarter of the epochs on all the data is 4-10x the data the
            search's fitness saw, and the cost falls from 3 to 1.5 final trainings.
    """

    strategy: str = "pso"
    particles: int = 6
    iterations: int = 3
    epochs: int = 1
    repeats: int = 1
    final_epochs: int = 8
    cg: float = 0.5
    lr: float = 1e-3
    batch_size: int = 64
    fixed_arch: str = "C32k5-P-C64k5-P-F10"  # CNN1
    max_train_samples: int | None = 2000
    max_depth: int = 10
    population: int = 24
    mutations: int = 12
    crossovers: int = 12
    generations: int = 5
    reevaluate: int = 3
    supernet: str | None = None
    calib_batches: int = 8
    warm_start: bool = True
    finalists: int = 3
    finalist_share: float = 0.25

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ConfigError(f"strategy must be one of {STRATEGIES}, got {self.strategy!r}")
        for name, low in (("particles", 1), ("iterations", 0), ("epochs", 1), ("repeats", 1)):
            check_int(name, getattr(self, name), low)
        check_int("final_epochs", self.final_epochs, 0)
        check_int("batch_size", self.batch_size, 1)
        check_int("max_depth", self.max_depth, MIN_DEPTH)
        for name in ("population", "reevaluate", "calib_batches", "finalists"):
            check_int(name, getattr(self, name), 1)
        for name in ("mutations", "crossovers", "generations"):
            check_int(name, getattr(self, name), 0)
        if not isinstance(self.warm_start, bool):
            raise ConfigError(f"warm_start must be a bool, got {self.warm_start!r}")
        if self.supernet is not None and not isinstance(self.supernet, str):
            raise ConfigError(f"supernet must be a file path or None, got {self.supernet!r}")
        if self.max_depth > MAX_DEPTH:
            raise ConfigError(f"max_depth must be in [{MIN_DEPTH}, {MAX_DEPTH}], got {self.max_depth}")
        if self.max_train_samples is not None:
            check_int("max_train_samples", self.max_train_samples, 1)
        if not (
            isinstance(self.finalist_share, int | float)
            and not isinstance(self.finalist_share, bool)
            and 0.0 < self.finalist_share <= 1.0
        ):
            raise ConfigError(f"finalist_share must be a number in (0, 1], got {self.finalist_share!r}")
        if not (isinstance(self.cg, int | float) and 0.0 <= self.cg <= 1.0):
            raise ConfigError(f"cg must be a number in [0, 1], got {self.cg!r}")
        if not (isinstance(self.lr, int | float) and math.isfinite(self.lr) and self.lr > 0):
            raise ConfigError(f"lr must be a positive finite number, got {self.lr!r}")
        try:
            parse_arch(self.fixed_arch)
        except SpecError as err:
            raise ConfigError(f"fixed_arch {self.fixed_arch!r} is not a valid spec: {err}") from err

    def finalist_epochs(self) -> int:
        """Epochs every finalist trains before all but the best stop (``final_epochs`` when one)."""
        if self.finalists == 1 or self.final_epochs == 0:
            return self.final_epochs
        return min(self.final_epochs, max(1, round(self.finalist_share * self.final_epochs)))

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> SearchConfig:
        """``fast`` (the defaults, minutes on a CPU) or ``paper`` (20 particles, 10 iterations, 10 epochs,
        10 repeats, 50 final epochs, the whole training split, chains up to 20 modules), with any field
        overridden by keyword."""
        presets: dict[str, dict[str, Any]] = {
            "fast": {},
            "paper": {
                "particles": 20,
                "iterations": 10,
                "epochs": 10,
                "repeats": 10,
                "final_epochs": 50,
                "max_train_samples": None,
                "max_depth": MAX_DEPTH,
                "population": 256,
                "mutations": 128,
                "crossovers": 128,
                "generations": 20,
                "warm_start": False,
                "finalists": 1,
            },
        }
        return from_preset(cls, presets, name, "search", **overrides)


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
class SearchResult:
    """What a search found and what it cost.

    ``rejected`` counts distinct specs rejected by the budget; ``cache_hits`` counts evaluations answered
    from the cache; ``candidate_epochs`` is the number of epochs actually trained; ``repeats_best`` holds
    (spec, fitness) of each independent swarm; ``finalists`` the specs the client trains fully and picks
    from, best fitness first (``best_spec`` alone unless ``SearchConfig.finalists`` > 1 with PSO).
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
            "details": self.details,
            "evaluations": [
                dataclasses.asdict(e) | {"fitness": _finite(e.fitness), "seconds": round(e.seconds, 3)}
                for e in self.evaluations
            ],
        }


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


# ------------------------------------------------------------------------------------- the search space


def random_conv(rng: np.random.Generator) -> Conv:
    return Conv(int(rng.choice(CHANNELS)), int(rng.choice(KERNELS)))


def sample_spec(
    rng: np.random.Generator,
    input_shape: tuple[int, int, int],
    num_classes: int,
    *,
    max_depth: int = MAX_DEPTH,
) -> ChainSpec:
    """A random valid chain for ``input_shape``.

    Depth is uniform in [3, ``max_depth``]; 1..3 of those modules are the F block (hidden units from
    :data:`HIDDEN_UNITS`, then the ``num_classes`` head); the rest is a C followed by C (probability 0.7)
    or P (0.3, max or average at even odds). A P that would shrink the map below 1x1 becomes a C.
    """
    check_int("max_depth", max_depth, MIN_DEPTH)
    if max_depth > MAX_DEPTH:
        raise ConfigError(f"max_depth must be in [{MIN_DEPTH}, {MAX_DEPTH}], got {max_depth}")
    check_int("num_classes", num_classes, 1)
    depth = int(rng.integers(MIN_DEPTH, max_depth + 1))
    n_dense = int(rng.integers(1, min(MAX_DENSE, depth - 1) + 1))
    size = min(input_shape[1], input_shape[2])
    layers: list[Layer] = [random_conv(rng)]
    for _ in range(depth - n_dense - 1):
        if rng.random() >= CONV_PROBABILITY and size >= 2:
            layers.append(Pool("max" if rng.random() < 0.5 else "avg"))
            size //= 2
        else:
            layers.append(random_conv(rng))
    layers += [Dense(int(rng.choice(HIDDEN_UNITS))) for _ in range(n_dense - 1)]
    layers.append(Dense(num_classes))
    return ChainSpec(tuple(layers))


def _odd_kernel(kernel: int) -> int:
    kernel = min(max(kernel, 1), MAX_KERNEL)
    return kernel if kernel % 2 else kernel - 1


def align(
    current: ChainSpec, target: ChainSpec, rng: np.random.Generator, input_shape: tuple[int, int, int]
) -> ChainSpec:
    """The alignment operator T: move ``current`` onto ``target`` and return a valid spec.

    Aligning the lengths (insertion / deletion) and then replacing every module that differs in type or
    parameters leaves exactly the target's modules, so T(x, t) == t for a valid t. The targets PSO builds
    layer by layer can break the rules, though (a C taken from one parent after an F taken from the
    other, more pools than the map affords), so the result is repaired, in this order:

    1. F block at the end: the C/P modules keep their order, then the F modules keep theirs.
    2. First module C: a leading P is replaced by (or, with no C/P at all, preceded by) ``current``'s first C.
    3. No pooling below 1x1: such a P becomes a copy of the nearest C before it.
    4. Out-of-range parameters are clamped (channels, odd kernel, hidden units); the last F is the head
       with ``current``'s class count (a missing F block becomes just the head).
    5. Depth: past 20 modules, random (``rng``) non-first C/P or hidden F modules are deleted; under 3, the
       last C is repeated.
    """
    current.validate(input_shape)
    num_classes = current.num_classes
    features: list[Layer] = [layer for layer in target.layers if not isinstance(layer, Dense)]
    dense = [layer for layer in target.layers if isinstance(layer, Dense)]
    first = current.layers[0]
    if not features:
        features = [first]
    elif not isinstance(features[0], Conv):
        features[0] = first
    size = min(input_shape[1], input_shape[2])
    for i, layer in enumerate(features):
        if isinstance(layer, Conv):
            features[i] = Conv(min(max(layer.out_channels, 1), MAX_CHANNELS), _odd_kernel(layer.kernel_size))
        elif size >= 2:
            size //= 2
        else:
            features[i] = next(f for f in reversed(features[:i]) if isinstance(f, Conv))
    dense = [Dense(min(max(d.units, 1), MAX_UNITS)) for d in dense[:-1]] + [Dense(num_classes)]
    while len(features) + len(dense) > MAX_DEPTH:
        removable = len(features) - 1 + len(dense) - 1  # never the first C nor the head
        k = int(rng.integers(removable))
        if k < len(features) - 1:
            del features[k + 1]
        else:
            del dense[k - (len(features) - 1)]
    while len(features) + len(dense) < MIN_DEPTH:
        last_conv = next(f for f in reversed(features) if isinstance(f, Conv))
        features.append(last_conv)
    return ChainSpec((*features, *dense)).validate(input_shape)


# ---------------------------------------------------------------------------------------- evaluation


@dataclass
class _Evaluator:
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
    proxy: Any = None  # spec -> fitness without training (the supernet proxy of evolution)
    warm: str | None = None  # the PSO warm-start spec, once one fits
    screened: dict[str, tuple[int, int, int, str | None]] = field(default_factory=dict)
    final_samples: int = 0  # images of the final training (the whole split; candidates see a subset)

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
        if isinstance(spec, ChainSpec):
            flops, params = spec.cost(self.input_shape)
            self._note(flops=flops, params=params)
        elif isinstance(spec, ElasticSpec):
            flops, params = cost_of(spec, self.input_shape, self.num_classes)
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
            reason = self._slow(flops)
        if reason is not None:
            return flops, params, 0, reason
        with torch.random.fork_rng(devices=[]):  # weight init here must not consume the caller's RNG
            model = build_model(spec, self.input_shape, self.num_classes)
        cost = profile_model(model, self.input_shape, batch_size=self.config.batch_size)
        self._note(flops=cost.flops, params=cost.params, memory=cost.train_memory_bytes)
        reason = fits(cost, self.profile) or self._slow(cost.flops)
        return cost.flops, cost.params, cost.train_memory_bytes, reason

    def _slow(self, flops: int) -> str | None:
        """The device-time budget: the final training of this candidate, the finalists' shared epochs
        included, at the profile's GFLOP/s (a model that fits in memory and FLOPs can still need hours)."""
        cfg = self.config
        shared = (cfg.finalists - 1) * cfg.finalist_epochs() if cfg.strategy == "pso" else 0  # PSO only
        epochs = cfg.final_epochs + shared
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
                fitness, epochs = self._fitness(spec, key), self.config.epochs
                self.candidate_epochs += epochs
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
            epochs=self.config.epochs,
            lr=self.config.lr,
            batch_size=self.config.batch_size,
            precision=self.precision,
        )
        train(model, self.train_split, config=config, seed=seed, device=self.device)
        loss, _ = evaluate(model, self.val_split, device=self.device, precision=self.precision)
        return loss if math.isfinite(loss) else math.inf  # a diverged candidate is never the best

    def infeasible(self, what: str) -> BudgetError:
        parts = [
            f"{name}: smallest need {share:.2f}x the budget" for name, share in sorted(self.needs.items())
        ]
        tightest = max(self.needs, key=self.needs.__getitem__) if self.needs else "unknown"
        return BudgetError(
            f"the budget of profile {self.profile.name!r} admits no {what} ({'; '.join(parts)}); "
            f"tightest budget: {tightest}. Raise it in the profile or use a larger device"
        )


# -------------------------------------------------------------------------------------- strategies


def _narrow(spec: ChainSpec) -> ChainSpec:
    """The same chain at half the width: conv channels and hidden FC units halved (at least 8)."""
    layers: list[Layer] = []
    for i, layer in enumerate(spec.layers):
        if isinstance(layer, Conv):
            layer = Conv(max(8, layer.out_channels // 2), layer.kernel_size)
        elif isinstance(layer, Dense) and i < len(spec.layers) - 1:
            layer = Dense(max(8, layer.units // 2))
        layers.append(layer)
    return ChainSpec(tuple(layers))


def _warm_spec(ev: _Evaluator) -> tuple[ChainSpec, Evaluation] | None:
    """``fixed_arch`` as the warm-start particle, narrowed until the budget admits it, evaluated; None
    if it is no chain, is too deep, or no narrowing fits."""
    spec = parse_arch(ev.config.fixed_arch)
    if not isinstance(spec, ChainSpec) or len(spec.layers) > ev.config.max_depth:
        return None
    try:
        spec = spec.with_num_classes(ev.num_classes).validate(ev.input_shape)
    except SpecError:
        return None
    for _ in range(WARM_NARROWINGS + 1):
        if ev.screen(spec)[3] is None:  # screening only: the rejected widths are never trained
            ev.warm = str(spec)
            return spec, ev.evaluate(spec)
        spec = _narrow(spec)
    return None


def _pso(ev: _Evaluator, rng: np.random.Generator) -> tuple[ChainSpec, float]:
    """One swarm (Algorithm 2); returns its global best (spec, fitness)."""
    cfg, shape = ev.config, ev.input_shape
    positions: list[ChainSpec] = []
    fitness: list[float] = []
    trainable: list[bool] = []
    warm = _warm_spec(ev) if cfg.warm_start else None
    for i in range(cfg.particles):
        if i == 0 and warm is not None:
            spec, result = warm
        else:
            for _ in range(INIT_ATTEMPTS):  # bounded: a tight budget may reject most samples
                spec = sample_spec(rng, shape, ev.num_classes, max_depth=cfg.max_depth)
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
    best = min(range(cfg.particles), key=lambda i: (not trainable[i], fitness[i]))
    pbest, pfit = list(positions), list(fitness)
    gbest, gfit = pbest[best], pfit[best]
    for _ in range(cfg.iterations):
        for i in range(cfg.particles):
            own, glob = pbest[i].layers, gbest.layers
            target: list[Layer] = []
            for j in range(max(len(own), len(glob))):
                take_global = rng.random() <= cfg.cg
                if j >= len(own) or (take_global and j < len(glob)):
                    target.append(glob[j])
                else:
                    target.append(own[j])
            positions[i] = align(positions[i], ChainSpec(tuple(target)), rng, shape)
            new = ev.evaluate(positions[i]).fitness
            if new < pfit[i]:
                pbest[i], pfit[i] = positions[i], new
                if new < gfit:
                    gbest, gfit = positions[i], new
            ev.bar.update(1)
            ev.bar.set_postfix(best=f"{gfit:.4f}", rejected=ev.rejected, cached=ev.cache_hits)
    return gbest, gfit


def _fixed(ev: _Evaluator) -> tuple[ArchSpec, float]:
    spec = parse_arch(ev.config.fixed_arch)
    if isinstance(spec, ChainSpec):
        spec = spec.with_num_classes(ev.num_classes).validate(ev.input_shape)
    result = ev.evaluate(spec)
    if result.rejected is not None:
        raise BudgetError(f"fixed architecture {spec} does not fit the device: {result.rejected}")
    return spec, result.fitness


def _random_pool(ev: _Evaluator, rng: np.random.Generator) -> tuple[ArchSpec, float]:
    candidates: list[ArchSpec] = []
    reasons: list[str] = []
    for text in RANDOM_POOL:
        spec = parse_arch(text)
        if isinstance(spec, ChainSpec):
            spec = spec.with_num_classes(ev.num_classes)
            problems = spec.problems(ev.input_shape)
            if problems:
                reasons.append(f"{spec}: {problems[0]}")
                continue
        reason = ev.screen(spec)[3]
        if reason is None:
            candidates.append(spec)
        else:
            reasons.append(f"{spec}: {reason}")
    if not candidates:
        raise BudgetError(f"no model of the random pool fits the device: {'; '.join(reasons)}")
    spec = candidates[int(rng.integers(len(candidates)))]
    return spec, ev.evaluate(spec).fitness


def _evolution(ev: _Evaluator, rng: np.random.Generator) -> tuple[ArchSpec, float, dict[str, Any]]:
    from edge_sdk.evolution import CHAIN_SPACE, ELASTIC_SPACE, evolve, supernet_proxy

    cfg = ev.config
    space = CHAIN_SPACE
    if cfg.supernet is not None:
        supernet = load_supernet(cfg.supernet)
        if (supernet.input_shape, supernet.num_classes) != (ev.input_shape, ev.num_classes):
            raise ConfigError(
                f"supernet {cfg.supernet} is for {supernet.num_classes} classes of {supernet.input_shape}, "
                f"the data is {ev.num_classes} classes of {ev.input_shape}"
            )
        ev.proxy = supernet_proxy(
            supernet, ev.train_split, ev.val_split, batches=cfg.calib_batches, seed=ev.seed
        )
        space = ELASTIC_SPACE

    def evaluate_spec(spec: ArchSpec) -> tuple[float, str | None]:
        result = ev.evaluate(spec)
        ev.bar.update(1)
        ev.bar.set_postfix(rejected=ev.rejected, cached=ev.cache_hits)
        return result.fitness, result.rejected

    return evolve(
        space,
        evaluate_spec,
        rng,
        input_shape=ev.input_shape,
        num_classes=ev.num_classes,
        population=cfg.population,
        mutations=cfg.mutations,
        crossovers=cfg.crossovers,
        generations=cfg.generations,
        reevaluate=cfg.reevaluate,
        admits=lambda spec: ev.screen(spec)[3] is None,
        seed=ev.seed,
    )


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
) -> SearchResult:
    """Find an architecture for this client's data and device with ``config.strategy``.

    Deterministic for a given seed on a given device (weight init, batch order and Dropout are seeded per
    candidate). Candidates train and are scored at ``precision`` (:mod:`edge_sdk.precision`). Raises
    :class:`BudgetError` when the budget admits no candidate.
    """
    check_int("seed", seed, 0)
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
    subset_seq, *repeat_seqs = np.random.SeedSequence(seed).spawn(config.repeats + 1)
    full = len(train)
    if config.max_train_samples is not None and len(train) > config.max_train_samples:
        picked = np.random.default_rng(subset_seq).choice(len(train), config.max_train_samples, replace=False)
        train = train.subset(np.sort(picked))
    planned = {
        "pso": config.repeats * config.particles * (config.iterations + 1),
        "evolution": config.population + config.reevaluate,
    }.get(config.strategy, 1)
    details: dict[str, Any] = {}
    with tqdm(total=planned, desc=f"search ({config.strategy})", unit="cand", disable=not progress) as bar:
        ev = _Evaluator(
            train, val, profile, config, seed, torch.device(device), bar, precision, final_samples=full
        )
        if config.strategy == "pso":
            repeats_best = [_pso(ev, np.random.default_rng(seq)) for seq in repeat_seqs]
        elif config.strategy == "evolution":
            best, fitness, details = _evolution(ev, np.random.default_rng(repeat_seqs[0]))
            repeats_best = [(best, fitness)]
        elif config.strategy == "fixed":
            repeats_best = [_fixed(ev)]
            bar.update(1)
        else:
            repeats_best = [_random_pool(ev, np.random.default_rng(repeat_seqs[0]))]
            bar.update(1)
    best_spec, best_fitness = min(repeats_best, key=lambda item: item[1])
    finalists = [str(best_spec)]
    if config.strategy == "pso" and config.finalists > 1:
        ranked = sorted(
            (e for e in ev.cache.values() if math.isfinite(e.fitness)), key=lambda e: (e.fitness, e.spec)
        )
        finalists += [e.spec for e in ranked if e.spec != finalists[0]][: config.finalists - 1]
        if ev.warm is not None and ev.warm not in finalists and math.isfinite(ev.cache[ev.warm].fitness):
            finalists[-1] = ev.warm  # the baseline always competes in the final ranking
    return SearchResult(
        strategy=config.strategy,
        best_spec=str(best_spec),
        best_fitness=float(best_fitness),
        evaluations=tuple(ev.evaluations),
        candidate_epochs=ev.candidate_epochs,
        rejected=ev.rejected,
        cache_hits=ev.cache_hits,
        seconds=time.perf_counter() - start,
        repeats_best=tuple((str(s), float(f)) for s, f in repeats_best),
        details=details,
        finalists=tuple(finalists),
    )
