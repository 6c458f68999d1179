"""PSO-FedNAS and the ablation strategies on 8x8 digits: validity, budget, cache, determinism."""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest
import torch
from sklearn.datasets import load_digits

import edge_sdk.strategies.evaluator as evaluator_module
from common.errors import BudgetError, ConfigError
from edge_sdk.data import ArrayDataset
from edge_sdk.models.arch import parse_arch
from edge_sdk.models.chain.space import CHANNELS, HIDDEN_UNITS, KERNELS, align, sample_spec
from edge_sdk.models.chain.spec import MAX_DEPTH, MIN_DEPTH, ChainSpec, Conv, Dense, Pool
from edge_sdk.search import STRATEGIES, build_search_config, replace_search_config, search
from edge_sdk.strategies.base import PLAIN_FINAL_EPOCHS, RECORD_DEFAULTS, SearchConfig
from edge_sdk.strategies.baselines import FixedConfig
from edge_sdk.strategies.pso import PSOConfig
from profiles import DeviceProfile

SHAPES = [(1, 8, 8), (1, 28, 28), (3, 32, 32), (1, 2, 2), (1, 1, 1)]


@pytest.fixture(scope="module")
def digits() -> tuple[ArrayDataset, ArrayDataset]:
    d = load_digits()
    x = torch.from_numpy(np.round(d.images * 255 / 16).astype(np.uint8))[:, None]
    data = ArrayDataset(x, torch.from_numpy(d.target.astype(np.int64)), 10)
    return data.subset(np.arange(0, 500)), data.subset(np.arange(500, 700))


def _profile(**overrides: object) -> DeviceProfile:
    values: dict[str, object] = {
        "name": "test",
        "memory_mb": 4096.0,
        "gflops": 10.0,
        "max_flops": 10**9,
        "max_params": 10**8,
    }
    return DeviceProfile(**(values | overrides))  # type: ignore[arg-type]


def _fast(strategy: str = "pso", **overrides: object) -> SearchConfig:
    """The fast preset of ``strategy``, its whole plan and the profile's FLOPs (no FLOP budget, no FLOP
    cap: tests/edge_sdk/test_budget.py has them); PSO with a small swarm of short chains."""
    small = {"particles": 3, "iterations": 2, "max_depth": 5} if strategy == "pso" else {}
    whole = {"search_budget": None, "flop_cap": None}
    return build_search_config("fast", strategy=strategy, **(whole | small | overrides))


@pytest.fixture
def trained_specs(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int]]:
    """Record (spec, training samples) of every candidate the search actually trains."""
    seen: list[tuple[str, int]] = []
    real_train = evaluator_module.train

    def spy(model, data, **kwargs):  # type: ignore[no-untyped-def]
        seen.append((str(model.spec), len(data)))
        return real_train(model, data, **kwargs)

    monkeypatch.setattr(evaluator_module, "train", spy)
    return seen


# ---------------------------------------------------------------------------------------- sampling


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("max_depth", [MIN_DEPTH, 10, MAX_DEPTH])
def test_sampled_specs_are_valid(shape: tuple[int, int, int], max_depth: int) -> None:
    rng = np.random.default_rng(0)
    depths = set()
    for _ in range(300):
        spec = sample_spec(rng, shape, 7, max_depth=max_depth).validate(shape)
        depths.add(len(spec.layers))
        assert len(spec.layers) <= max_depth
        assert spec.num_classes == 7
        for layer in spec.layers:
            if isinstance(layer, Conv):
                assert layer.out_channels in CHANNELS and layer.kernel_size in KERNELS
            elif isinstance(layer, Dense) and layer is not spec.layers[-1]:
                assert layer.units in HIDDEN_UNITS
    assert depths == set(range(MIN_DEPTH, max_depth + 1))


def test_sampler_pools_three_times_in_ten() -> None:
    """Where pooling is always possible (a huge input, short chains), 30% of the body modules are P."""
    rng = np.random.default_rng(1)
    body = [
        layer
        for _ in range(3000)
        for layer in sample_spec(rng, (1, 1024, 1024), 10, max_depth=8).layers[1:]
        if not isinstance(layer, Dense)
    ]
    share = sum(isinstance(layer, Pool) for layer in body) / len(body)
    assert 0.28 < share < 0.32


def test_sampler_turns_impossible_pools_into_convs() -> None:
    rng = np.random.default_rng(2)
    specs = [sample_spec(rng, (1, 1, 1), 3, max_depth=12) for _ in range(200)]
    assert not any(isinstance(layer, Pool) for spec in specs for layer in spec.layers)


# ------------------------------------------------------------------------------ the alignment operator T


def _garbage(rng: np.random.Generator) -> ChainSpec:
    """Any sequence of modules, rules ignored (out-of-range values included)."""
    layers = []
    for _ in range(int(rng.integers(0, 30))):
        kind = rng.integers(3)
        if kind == 0:
            layers.append(Conv(int(rng.integers(1, 300)), int(rng.integers(1, 12))))
        elif kind == 1:
            layers.append(Pool("max" if rng.random() < 0.5 else "avg"))
        else:
            layers.append(Dense(int(rng.integers(1, 600))))
    return ChainSpec(tuple(layers))


def _crossover(a: ChainSpec, b: ChainSpec, rng: np.random.Generator) -> ChainSpec:
    """A PSO target: each position from a or b at random, the longer one's tail."""
    out = []
    for j in range(max(len(a.layers), len(b.layers))):
        pick = a if j >= len(b.layers) or (j < len(a.layers) and rng.random() < 0.5) else b
        out.append(pick.layers[j])
    return ChainSpec(tuple(out))


@pytest.mark.parametrize("shape", [(1, 8, 8), (1, 28, 28), (1, 2, 2)])
def test_align_properties(shape: tuple[int, int, int]) -> None:
    rng = np.random.default_rng(3)
    for _ in range(400):
        x = sample_spec(rng, shape, 10)
        y = sample_spec(rng, shape, 10)
        assert align(x, x, rng, shape) == x
        assert align(x, y, rng, shape) == y  # a valid target is copied
        for target in (_crossover(x, y, rng), _garbage(rng)):
            out = align(x, target, rng, shape)
            assert out.problems(shape) == [], (str(x), str(target), str(out))
            assert out.num_classes == 10


def test_align_repairs() -> None:
    rng = np.random.default_rng(0)
    current = ChainSpec.parse("C16k3-P-F10")
    shape = (1, 8, 8)
    # an F taken from one parent before a C/P of the other: the F block moves to the end
    assert str(align(current, ChainSpec.parse("C8k3-F32-P-C16k3-F10"), rng, shape)) == "C8k3-P-C16k3-F32-F10"
    # 8 -> 4 -> 2 -> 1: the fourth pool becomes a copy of the last conv
    assert str(align(current, ChainSpec.parse("C8k3-P-P-P-P-F10"), rng, shape)) == "C8k3-P-P-P-C8k3-F10"
    # a leading pool becomes the current first conv; the head takes the current class count
    assert str(align(current, ChainSpec.parse("P-C8k3-F300-F4"), rng, shape)) == "C16k3-C8k3-F300-F10"
    # out-of-range parameters are clamped; too short chains repeat the last conv
    assert str(align(current, ChainSpec.parse("C500k8-F999-F3"), rng, shape)) == "C128k7-F300-F10"
    assert str(align(current, ChainSpec.parse("C8k3-F10"), rng, shape)) == "C8k3-C8k3-F10"
    too_long = ChainSpec.parse("-".join(["C8k3"] * 25 + ["F10"]))
    assert len(align(current, too_long, rng, shape).layers) == MAX_DEPTH


# ------------------------------------------------------------------------------------------- search


def test_pso_is_deterministic_and_valid(digits, trained_specs) -> None:  # type: ignore[no-untyped-def]
    train, val = digits
    config = _fast(max_train_samples=200)
    runs = [search(train, val, profile=_profile(), config=config, seed=s) for s in (0, 0, 1)]
    a, b, c = runs
    trace = [(e.spec, e.fitness, e.cached, e.rejected) for e in a.evaluations]
    assert trace == [(e.spec, e.fitness, e.cached, e.rejected) for e in b.evaluations]
    assert (a.best_spec, a.best_fitness) == (b.best_spec, b.best_fitness)
    assert [e.spec for e in c.evaluations] != [e.spec for e in a.evaluations]
    assert len(a.evaluations) == 3 * (1 + 2)
    for e in a.evaluations:
        assert parse_arch(e.spec).problems((1, 8, 8)) == []
    assert a.best_fitness == min(e.fitness for e in a.evaluations)
    assert math.isfinite(a.best_fitness)
    assert {n for _, n in trained_specs} == {200}  # the subsample knob
    first_seen = {}
    for e in a.evaluations:  # every repeat of a spec is a cache hit that trains nothing
        assert e.cached == (e.spec in first_seen)
        if e.cached:
            assert e.epochs == 0 and e.fitness == first_seen[e.spec].fitness
        first_seen.setdefault(e.spec, e)
    assert a.cache_hits == sum(e.cached for e in a.evaluations)
    assert a.candidate_epochs == sum(e.epochs for e in a.evaluations)
    assert a.candidate_epochs == sum(not e.cached and e.rejected is None for e in a.evaluations)
    assert len(trained_specs) == a.candidate_epochs + b.candidate_epochs + c.candidate_epochs


def test_single_particle_hits_the_cache(digits) -> None:  # type: ignore[no-untyped-def]
    """With one particle, pBest = gBest = X, so every move is T(X, X) = X: answered from the cache."""
    train, val = digits
    result = search(train, val, profile=_profile(), config=_fast(particles=1, iterations=3), seed=0)
    assert [e.cached for e in result.evaluations] == [False, True, True, True]
    assert result.cache_hits == 3
    assert result.candidate_epochs == 1
    assert len({e.spec for e in result.evaluations}) == 1


def test_over_budget_candidates_are_never_trained(digits, trained_specs) -> None:  # type: ignore[no-untyped-def]
    train, val = digits
    result = search(
        train, val, profile=_profile(max_params=20_000), config=_fast(max_train_samples=100), seed=0
    )
    rejected = {e.spec for e in result.evaluations if e.rejected is not None}
    assert rejected, "expected the small budget to reject some sampled candidates"
    assert result.rejected == len(rejected)
    assert not rejected & {spec for spec, _ in trained_specs}
    for e in result.evaluations:
        if e.rejected is not None:
            assert e.fitness == math.inf and e.epochs == 0
            assert "max_params" in e.rejected and e.params > 20_000
        else:
            assert e.params <= 20_000 and e.train_memory_bytes > 0
    assert parse_arch(result.best_spec).cost((1, 8, 8))[1] <= 20_000
    payload = json.loads(json.dumps(result.to_dict(), allow_nan=False))
    assert any(e["fitness"] is None for e in payload["evaluations"])  # inf is written as null


def test_budget_that_admits_nothing(digits, trained_specs) -> None:  # type: ignore[no-untyped-def]
    train, val = digits
    with pytest.raises(BudgetError, match=r"admits no architecture.*tightest budget: max_params"):
        search(train, val, profile=_profile(max_params=50), config=_fast(), seed=0)
    assert trained_specs == []


def test_warm_start_particle(digits) -> None:  # type: ignore[no-untyped-def]
    """Particle 0 starts at fixed_arch, so the best is never worse by fitness; off or over budget: random."""
    train, val = digits
    config = _fast(fixed_arch="C8k3-P-F3", max_train_samples=100)
    warm = search(train, val, profile=_profile(), config=config, seed=0)
    assert warm.evaluations[0].spec == "C8k3-P-F10"
    assert warm.best_fitness <= warm.evaluations[0].fitness
    cold = search(
        train, val, profile=_profile(), config=_fast(fixed_arch="C8k3-P-F3", warm_start=False), seed=0
    )
    assert cold.evaluations[0].spec != "C8k3-P-F10"
    # 20k parameters reject C64k3-C64k3-P-F10 (~48k): particle 0 is the same chain at half width
    # (~15k), and the rejected width is only screened, never counted as an evaluation
    big = _fast(fixed_arch="C64k3-C64k3-P-F3", max_train_samples=100)
    tight = search(train, val, profile=_profile(max_params=20_000), config=big, seed=0)
    assert tight.evaluations[0].spec == "C32k3-C32k3-P-F10" and tight.evaluations[0].rejected is None
    assert "C64k3-C64k3-P-F10" not in {e.spec for e in tight.evaluations}
    # 6k: two halvings (C16k3-C16k3-P-F10, ~5k)
    tiny = search(train, val, profile=_profile(max_params=6_000), config=big, seed=0)
    assert tiny.evaluations[0].spec == "C16k3-C16k3-P-F10"
    # without pooling even 8 channels need ~5.8k > 2.5k: particle 0 is random, the search goes on
    wide = _fast(fixed_arch="C64k3-C64k3-F3", max_train_samples=100)
    none = search(train, val, profile=_profile(max_params=2_500), config=wide, seed=0)
    assert none.evaluations[0].spec not in {f"C{c}k3-C{c}k3-F10" for c in (64, 32, 16, 8)}
    assert math.isfinite(none.best_fitness)
    assert not PSOConfig.preset("paper").warm_start


def _warm_start_at(mp: pytest.MonkeyPatch, fitness: float) -> SearchConfig:
    """A config warm-started at ``C8k3-P-F10``, with the search's fitness made up: ``fitness`` for the
    warm start, 1 + a hundredth per character of the spec for the others."""
    mp.setattr(
        evaluator_module.Evaluator,
        "_fitness",
        lambda self, spec, key: fitness if key == "C8k3-P-F10" else 1.0 + len(key) / 100,
    )
    return _fast(fixed_arch="C8k3-P-F3", max_train_samples=100)


def test_finalists(digits) -> None:  # type: ignore[no-untyped-def]
    """PSO hands the client its best distinct specs by fitness, the winner first; one in the paper preset."""
    train, val = digits
    config = _fast(max_train_samples=100, finalists_beat_warm=False)
    result = search(train, val, profile=_profile(), config=config, seed=0)
    assert len(result.finalists) == 3 == len(set(result.finalists))
    assert result.finalists[0] == result.best_spec
    best = {e.spec: e.fitness for e in result.evaluations if not e.cached}
    assert [best[s] for s in result.finalists] == sorted(best[s] for s in result.finalists)
    assert max(best[s] for s in result.finalists) <= sorted(best.values())[2]
    assert result.to_dict()["finalists"] == list(result.finalists)
    one = search(train, val, profile=_profile(), config=_fast(max_train_samples=100, finalists=1), seed=0)
    assert one.finalists == (one.best_spec,) and one.best_spec == result.best_spec
    # a warm-start spec whose short-training fitness ranks it last still competes in the final ranking
    with pytest.MonkeyPatch.context() as mp:
        config = _warm_start_at(mp, 9.0)
        warm = search(train, val, profile=_profile(), config=config, seed=0)
        cold = search(
            train, val, profile=_profile(), config=dataclasses.replace(config, warm_start=False), seed=0
        )
    assert warm.finalists[-1] == "C8k3-P-F10" and len(warm.finalists) == 3
    assert "C8k3-P-F10" not in cold.finalists
    fixed = search(train, val, profile=_profile(), config=_fast(strategy="fixed"), seed=0)
    assert fixed.finalists == (fixed.best_spec,)
    assert PSOConfig.preset("paper").finalists == 1
    with pytest.raises(ConfigError, match="finalists"):
        PSOConfig(finalists=0)


def test_finalists_must_beat_the_warm_start(digits) -> None:  # type: ignore[no-untyped-def]
    """A finalist other than the warm start has beaten it by fitness in the search; the others are
    dropped (the report's ``behind_warm``), and a warm start the search ranks first trains alone."""
    train, val = digits
    on = search(train, val, profile=_profile(), config=_fast(max_train_samples=100), seed=0)
    off = search(
        train, val, profile=_profile(), config=_fast(max_train_samples=100, finalists_beat_warm=False), seed=0
    )
    fitness = {e.spec: e.fitness for e in on.evaluations if not e.cached}
    warm, dropped = on.incumbent, on.details["behind_warm"]
    assert warm is not None and warm in on.finalists and warm == off.incumbent
    assert dropped and all(fitness[s] >= fitness[warm] for s in dropped)  # digits, seed 0: one dropped
    assert all(fitness[s] < fitness[warm] for s in on.finalists if s != warm)
    assert sorted(on.finalists + tuple(dropped)) == sorted(off.finalists)  # the same search, fewer finalists
    assert on.to_dict()["details"]["behind_warm"] == dropped and "behind_warm" not in off.details
    with pytest.MonkeyPatch.context() as mp:  # the warm start is the search's best: it alone goes on
        config = _warm_start_at(mp, 0.5)
        alone = search(train, val, profile=_profile(), config=config, seed=0)
    assert alone.finalists == ("C8k3-P-F10",) == (alone.best_spec,) and alone.incumbent == "C8k3-P-F10"
    assert len(alone.details["behind_warm"]) == 2
    with pytest.raises(ConfigError, match="finalists_beat_warm must be a bool"):
        PSOConfig(finalists_beat_warm=1)  # type: ignore[arg-type]


def test_repeats_keep_the_best(digits) -> None:  # type: ignore[no-untyped-def]
    train, val = digits
    config = _fast(particles=2, iterations=1, repeats=2, max_train_samples=100)
    result = search(train, val, profile=_profile(), config=config, seed=4)
    assert len(result.repeats_best) == 2
    assert (result.best_spec, result.best_fitness) == min(result.repeats_best, key=lambda item: item[1])


def test_fixed_strategy(digits) -> None:  # type: ignore[no-untyped-def]
    train, val = digits
    config = _fast(strategy="fixed", fixed_arch="C8k3-P-F3")  # the head is resized to the 10 classes
    result = search(train, val, profile=_profile(), config=config, seed=0)
    assert result.best_spec == "C8k3-P-F10"
    assert len(result.evaluations) == 1 and result.candidate_epochs == 1
    assert math.isfinite(result.best_fitness)
    with pytest.raises(BudgetError, match=r"fixed architecture C8k3-P-F10 does not fit.*max_params"):
        search(train, val, profile=_profile(max_params=1000), config=config, seed=0)


def test_random_pool_strategy(digits) -> None:  # type: ignore[no-untyped-def]
    train, val = digits
    config = _fast(strategy="random-pool", max_train_samples=100)
    # 200k parameters admit CNN1 (54.8k on 8x8) and CNN2 (133k) but no zoo model (>= 0.7M)
    picks = {
        search(train, val, profile=_profile(max_params=200_000), config=config, seed=s).best_spec
        for s in range(8)
    }
    assert picks == {"C32k5-P-C64k5-P-F10", "C32k3-C32k3-P-C64k3-C64k3-P-F256-F10"}
    with pytest.raises(BudgetError, match="no model of the random pool fits"):
        search(train, val, profile=_profile(max_params=1000), config=config, seed=0)


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"strategy": "grid"}, "strategy"),
        ({"particles": 0}, "particles"),
        ({"cg": 1.5}, "cg"),
        ({"max_depth": 21}, "max_depth"),
        ({"max_train_samples": 0}, "max_train_samples"),
        ({"fixed_arch": "C8k3-Q-F10"}, "fixed_arch"),
        ({"swarm": 3}, "unknown search options"),
        ({"warm_start": 1}, "warm_start"),
    ],
)
def test_config_validation(overrides: dict[str, object], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        build_search_config("fast", **overrides)  # type: ignore[arg-type]


def test_presets() -> None:
    assert build_search_config("fast") == PSOConfig()
    paper = build_search_config("paper")
    assert isinstance(paper, PSOConfig)
    assert (paper.particles, paper.iterations, paper.search_epochs, paper.repeats, paper.final_epochs) == (
        20,
        10,
        10,
        10,
        50,
    )
    assert (paper.lr, paper.batch_size, paper.max_depth, paper.max_train_samples) == (
        1e-3,
        64,
        MAX_DEPTH,
        None,
    )
    assert PSOConfig.preset("paper", repeats=2).repeats == 2
    with pytest.raises(ConfigError, match="unknown search preset"):
        build_search_config("slow")


def test_training_time_is_part_of_the_budget(digits, trained_specs) -> None:  # type: ignore[no-untyped-def]
    """A candidate whose final training (finalists' shared epochs included) would take the device longer
    than half its time budget is rejected before any training, with the estimate in the message."""
    train, val = digits
    config = _fast(max_train_samples=100)
    resolved = config.for_input(train.input_shape)
    epochs = resolved.resolved_final_epochs() + (resolved.finalists - 1) * resolved.finalist_epochs()
    # 3 x FLOPs x 500 images x epochs / (1 GFLOP/s) <= 0.5 x budget admits models up to ~0.5 MFLOP
    budget = 2 * 3 * 500_000 * len(train) * epochs / 1e9
    profile = _profile(gflops=1.0, time_budget_s=budget)
    result = search(train, val, profile=profile, config=config, seed=0)
    slow = [e for e in result.evaluations if e.rejected is not None]
    assert slow and all("time_budget_s" in e.rejected and e.flops > 500_000 for e in slow)
    assert all(e.flops <= 500_000 for e in result.evaluations if e.rejected is None)
    assert not {e.spec for e in slow} & {spec for spec, _ in trained_specs}
    with pytest.raises(BudgetError, match="tightest budget: time_budget_s"):
        search(train, val, profile=_profile(time_budget_s=1e-6), config=config, seed=0)


# ------------------------------------------------------------------------------- per-strategy configs


def test_registry_names_match_the_configs() -> None:
    assert list(STRATEGIES) == ["pso", "fixed", "random-pool", "evolution"]
    for name, strategy in STRATEGIES.items():
        assert strategy.config.strategy == name and issubclass(strategy.config, SearchConfig)
    with pytest.raises(ConfigError, match="shared options"):
        SearchConfig()


def test_an_option_of_another_strategy_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"'particles' does not apply to strategy 'fixed'.*pso"):
        build_search_config(strategy="fixed", particles=3)
    with pytest.raises(ConfigError, match=r"'supernet' does not apply to strategy 'pso'.*evolution"):
        build_search_config(supernet="s.pt")
    with pytest.raises(ConfigError, match="'fixed_arch' does not apply to strategy 'random-pool'"):
        replace_search_config(PSOConfig(), strategy="random-pool", fixed_arch="C8k3-P-F10")
    with pytest.raises(TypeError):
        FixedConfig(particles=3)  # type: ignore[call-arg]


def test_replace_switches_strategy_keeping_the_shared_options() -> None:
    base = FixedConfig(fixed_arch="C8k3-P-F10", final_epochs=10, lr=3e-3)
    pso = replace_search_config(base, strategy="pso", particles=4)
    assert pso == PSOConfig(fixed_arch="C8k3-P-F10", final_epochs=10, lr=3e-3, particles=4)
    evolution = replace_search_config(pso, strategy="evolution")
    assert (evolution.strategy, evolution.final_epochs, evolution.lr) == ("evolution", 10, 3e-3)
    assert replace_search_config(base, final_epochs=2) == dataclasses.replace(base, final_epochs=2)


def test_record_keeps_the_single_config_shape() -> None:
    """The default PSO config records what the one SearchConfig of before the split recorded, plus the
    halving and plateau fields (#32: a resume redoes a client trained without them), the training
    recipe's (#31, likewise) and the search's FLOP budget (#32: its default differs from the unbounded
    search of older records, so a resume redoes those clients), with ``epochs`` named ``search_epochs``
    (#33); other strategies fill the foreign keys with those defaults."""
    old_default = {
        "strategy": "pso",
        "particles": 6,
        "iterations": 3,
        "search_epochs": 1,
        "repeats": 1,
        "final_epochs": 8,
        "cg": 0.5,
        "lr": 1e-3,
        "batch_size": 64,
        "fixed_arch": "C32k5-P-C64k5-P-F10",
        "max_train_samples": 2000,
        "max_depth": 10,
        "population": 24,
        "mutations": 12,
        "crossovers": 12,
        "generations": 5,
        "reevaluate": 3,
        "supernet": None,
        "calib_batches": 8,
        "warm_start": True,
        "finalists": 3,
        "finalist_share": 0.25,
        "finalist_keep": 0.5,
        "plateau_patience": 2,
        "plateau_min_epochs": 4,
        "plateau_min_delta": 0.01,
        "augment": "auto",
        "schedule": "auto",
        "weight_decay": None,
    }
    gray = (1, 28, 28)  # resolved for grayscale input, the input of every run before #31
    # the fields added since: an old record had no budget and no cap; PSO's finalists must beat the warm
    # start; the winner's rest on every image is left to the recipe
    added = {"search_budget": None, "finalists_beat_warm": True, "flop_cap": None, "rest_on_all": None}
    assert old_default | added == RECORD_DEFAULTS
    now = {"search_budget": 0.125, "flop_cap": 1.0, "final_epochs": PLAIN_FINAL_EPOCHS}
    current = {key: (old_default | added | now)[key] for key in RECORD_DEFAULTS}
    assert PSOConfig().for_input(gray).to_dict() == current
    assert list(PSOConfig().for_input(gray).to_dict()) == list(current)
    fixed = FixedConfig(fixed_arch="C8k3-P-F10", final_epochs=1).for_input(gray).to_dict()
    assert fixed == current | {"strategy": "fixed", "fixed_arch": "C8k3-P-F10", "final_epochs": 1}
    for strategy in STRATEGIES.values():  # every field's default is the current default
        assert strategy.config.preset("fast").for_input(gray).to_dict() == current | {
            "strategy": strategy.config.strategy
        }


def test_evolution_draws_chains_up_to_max_depth(digits) -> None:  # type: ignore[no-untyped-def]
    """The chain space of evolution is bounded by the configured max_depth (it was fixed at 10)."""
    train, val = digits
    knobs = dict(population=4, mutations=4, crossovers=4, generations=1, reevaluate=1, max_train_samples=100)
    result = search(train, val, profile=_profile(), config=_fast("evolution", max_depth=4, **knobs), seed=0)
    assert result.evaluations and all(len(parse_arch(e.spec).layers) <= 4 for e in result.evaluations)
    assert build_search_config("paper", strategy="evolution").max_depth == MAX_DEPTH  # type: ignore[attr-defined]
