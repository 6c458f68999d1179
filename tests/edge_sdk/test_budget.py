"""The device's time budget: the search and the final training stop at a deadline and say so.

The deadlines run on a fake clock that advances one second per reading, so where the work stops follows
from how often the code asks, not from how fast this machine is: with a deadline ``B`` seconds after its
first reading, the asks at 2, 3, ... get "time left" while they come before ``1 + B``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from common.errors import ConfigError
from common.timing import Deadline
from edge_sdk.cli import main
from edge_sdk.client import ClientConfig, resume_key, run_client
from edge_sdk.data import ArrayDataset, load_dataset, save_client_data
from edge_sdk.final_training import train_final
from edge_sdk.models.arch import parse_arch
from edge_sdk.plan import final_training_flops, pass_flops, plan_flops, reference_flops
from edge_sdk.search import SearchResult, search
from edge_sdk.shared_init import initial_weights
from edge_sdk.strategies.baselines import FixedConfig
from edge_sdk.strategies.evolution import EvolutionConfig
from edge_sdk.strategies.pso import PSOConfig
from export.bundle import read_bundle
from profiles import DeviceProfile, load_profile
from tests.common.test_timing import Ticking

# budgets no candidate comes near: only the deadline stops the work
ROOMY = DeviceProfile(name="roomy", memory_mb=4096.0, gflops=1e6, max_flops=10**9, max_params=10**8)


@pytest.fixture(scope="module")
def splits() -> tuple[ArrayDataset, ArrayDataset]:
    data = load_dataset("digits")
    return data.subset(np.arange(0, 400)), data.subset(np.arange(400, 560))


def _search(
    splits: tuple[ArrayDataset, ArrayDataset], config: object, deadline: Deadline | None
) -> SearchResult:
    train, val = splits
    return search(train, val, profile=ROOMY, config=config, seed=0, deadline=deadline)  # type: ignore[arg-type]


def _valid(result: SearchResult) -> None:
    """The winner and the finalists are candidates the search trained, the winner with finite fitness."""
    trained = {e.spec: e.fitness for e in result.evaluations if e.rejected is None}
    assert result.best_spec in trained and math.isfinite(result.best_fitness)
    assert result.best_fitness == trained[result.best_spec] == min(trained.values())
    assert set(result.finalists) <= set(trained)
    parse_arch(result.best_spec)


def test_pso_stops_at_the_deadline_with_its_best_so_far(splits: tuple[ArrayDataset, ArrayDataset]) -> None:
    config = PSOConfig(particles=3, iterations=3, max_depth=5, max_train_samples=100, finalists=2)
    result = _search(splits, config, Deadline.after(4.5, Ticking()))  # ends at 5.5
    # the warm start trains unasked; asks at 2, 3 start particles 1 and 2, at 4, 5 the first two moves of
    # iteration 1; the ask at 6 stops the swarm
    assert result.budget_stopped
    assert result.progress == {"swarms": [1, 1], "particles": [3, 3], "iterations": [0, 3]}
    assert len(result.evaluations) == 5
    _valid(result)
    again = _search(splits, config, Deadline.after(4.5, Ticking()))
    assert [(e.spec, e.fitness) for e in again.evaluations] == [
        (e.spec, e.fitness) for e in result.evaluations
    ]
    assert (again.best_spec, again.finalists) == (result.best_spec, result.finalists)


def test_pso_spent_before_it_starts_still_trains_one_candidate(
    splits: tuple[ArrayDataset, ArrayDataset],
) -> None:
    config = PSOConfig(particles=3, iterations=2, repeats=2, max_depth=5, max_train_samples=100)
    result = _search(splits, config, Deadline.after(0.5, Ticking()))
    assert result.budget_stopped and len(result.evaluations) == 1
    assert result.progress == {"swarms": [1, 2], "particles": [1, 6], "iterations": [0, 4]}
    assert result.finalists == (result.best_spec,)
    _valid(result)


def test_a_deadline_never_reached_changes_nothing(splits: tuple[ArrayDataset, ArrayDataset]) -> None:
    config = PSOConfig(particles=2, iterations=1, max_depth=5, max_train_samples=100)
    free = _search(splits, config, None)
    roomy = _search(splits, config, Deadline.after(math.inf, Ticking()))
    assert not roomy.budget_stopped and roomy.progress["iterations"] == [1, 1]
    assert [(e.spec, e.fitness) for e in roomy.evaluations] == [(e.spec, e.fitness) for e in free.evaluations]
    assert (roomy.best_spec, roomy.finalists) == (free.best_spec, free.finalists)


def test_the_search_stops_once_its_flops_are_spent(splits: tuple[ArrayDataset, ArrayDataset]) -> None:
    """The FLOP budget cuts the same trajectory the unbounded search takes, at the first ask after the
    candidates' training FLOPs (counted as the device plan counts them) reached it."""
    train, val = splits
    base = {"particles": 3, "iterations": 3, "max_depth": 5, "max_train_samples": 100, "finalists": 2}
    free = _search(splits, PSOConfig(**base, search_budget=None), None)
    assert free.flop_budget is None and not free.flops_spent
    trained = [e for e in free.evaluations if e.epochs]
    costs = [pass_flops(e.flops, 1, 100, len(val)) for e in trained]
    assert free.spent_flops == sum(costs)
    final = final_training_flops(
        PSOConfig(**base).for_input(train.input_shape),
        ROOMY,
        n_train=len(train),
        n_val=len(val),
        input_shape=train.input_shape,
        num_classes=train.num_classes,
    )
    share = sum(costs[:3]) / final  # spent once the third trained candidate is done
    cut = _search(splits, PSOConfig(**base, search_budget=share), None)
    assert cut.flops_spent and not cut.budget_stopped
    assert cut.flop_budget == int(share * final) and cut.spent_flops == sum(costs[:3])
    assert [e.spec for e in cut.evaluations if e.epochs] == [e.spec for e in trained[:3]]
    prefix = [(e.spec, e.fitness) for e in free.evaluations[: len(cut.evaluations)]]
    assert [(e.spec, e.fitness) for e in cut.evaluations] == prefix
    _valid(cut)
    # a budget below one candidate still trains the first one, as a deadline does
    tiny = _search(splits, PSOConfig(**base, search_budget=1e-9), None)
    assert tiny.flops_spent and [e.epochs for e in tiny.evaluations] == [1]
    assert tiny.progress["particles"] == [1, 3] and tiny.finalists == (tiny.best_spec,)


def test_the_plan_prices_the_search_at_its_flop_budget() -> None:
    shape = {"n_train": 4000, "n_val": 500, "input_shape": (1, 28, 28), "num_classes": 10}
    free = plan_flops(
        search=PSOConfig(search_budget=None).for_input((1, 28, 28)), cvae=None, profile=ROOMY, **shape
    )
    config = PSOConfig(search_budget=0.1).for_input((1, 28, 28))
    cut = plan_flops(search=config, cvae=None, profile=ROOMY, **shape)
    candidate = free["search"] // config.planned_candidates()
    assert cut["final_training"] == free["final_training"]
    assert cut["search"] == int(0.1 * free["final_training"]) + candidate < free["search"]
    roomy = plan_flops(
        search=PSOConfig(search_budget=10.0).for_input((1, 28, 28)), cvae=None, profile=ROOMY, **shape
    )
    assert roomy["search"] == free["search"]
    assert PSOConfig.preset("paper").search_budget is None  # the paper's Algorithm 2 runs its whole plan
    with pytest.raises(ConfigError, match="search_budget"):
        PSOConfig(search_budget=0)


def test_no_candidate_costs_more_than_the_planned_design(splits: tuple[ArrayDataset, ArrayDataset]) -> None:
    """The FLOP cap rejects, before training, every candidate costing more per image than the design the
    device plan prices (PSO's warm start), naming the cap; without the cap the same search trains some."""
    train, _ = splits
    base = {"particles": 4, "iterations": 2, "max_depth": 5, "max_train_samples": 100, "search_budget": None}
    base |= {"fixed_arch": "C8k3-P-C16k3-P-F10"}
    reference = reference_flops(PSOConfig(**base), ROOMY, train.input_shape, train.num_classes)
    free = _search(splits, PSOConfig(**base, flop_cap=None), None)
    assert free.flop_cap is None and any(e.epochs and e.flops > reference for e in free.evaluations)
    capped = _search(splits, PSOConfig(**base), None)  # the default: the design's own price
    assert capped.flop_cap == reference == capped.to_dict()["flop_cap"]
    trained = [e for e in capped.evaluations if e.epochs]
    assert trained[0].spec == "C8k3-P-C16k3-P-F10" and all(e.flops <= reference for e in trained)
    over = [e for e in capped.evaluations if e.rejected and "the search's cap" in e.rejected]
    assert over and all(e.flops > reference and e.epochs == 0 for e in over)
    _valid(capped)
    double = _search(splits, PSOConfig(**base, flop_cap=2.0), None)
    assert double.flop_cap == 2 * reference
    assert all(e.flops <= 2 * reference for e in double.evaluations if e.epochs)
    assert PSOConfig.preset("paper").flop_cap is None  # the paper's search is bound by the device alone
    with pytest.raises(ConfigError, match="flop_cap"):
        PSOConfig(flop_cap=0)


def test_evolution_stops_at_the_deadline_with_its_best_so_far(
    splits: tuple[ArrayDataset, ArrayDataset],
) -> None:
    config = EvolutionConfig(
        population=6,
        mutations=2,
        crossovers=2,
        generations=2,
        reevaluate=2,
        max_depth=5,
        max_train_samples=100,
    )
    result = _search(splits, config, Deadline.after(2.5, Ticking()))  # ends at 3.5
    # the first sample trains unasked, the asks at 2 and 3 start two more, the one at 4 stops: no
    # generation runs and the finalists are initial members (their re-evaluation is cached, free)
    assert result.budget_stopped
    assert result.progress == {"initial_population": [3, 6], "generations": [0, 2], "reevaluated": [2, 2]}
    assert sum(not e.cached for e in result.evaluations) == 3
    _valid(result)
    free = _search(splits, config, None)
    assert not free.budget_stopped and free.progress["generations"] == [2, 2]


def test_the_final_training_stops_after_the_epoch_the_deadline_passed_in(
    splits: tuple[ArrayDataset, ArrayDataset],
) -> None:
    train, val = splits
    deadline = Deadline.after(2.5, Ticking())  # ends at 3.5: asked after epochs 1, 2 (time left), 3 (stop)
    trained = train_final("C8k3-P-F10", train, val, epochs=6, seed=0, stop=deadline.expired)
    assert trained.metrics["final_epochs"] == 3
    assert math.isfinite(trained.metrics["train_loss"])


def test_run_client_records_where_the_budget_cut(tmp_path: Path) -> None:
    data = load_dataset("digits").subset(np.arange(500))
    search_config = PSOConfig(
        particles=3, iterations=2, max_depth=5, max_train_samples=100, final_epochs=4,
        finalists_beat_warm=False,  # three finalists, for the budget to skip two
    )  # fmt: skip
    config = ClientConfig(search=search_config, seed=0, role="classifier", time_budget_s=6.0)
    profile = load_profile("laptop-cpu")
    result = run_client(data, profile=profile, config=config, out=tmp_path / "c.bundle", clock=Ticking())
    # readings: budget starts at 1 (ends 7), search phase at 2, its share (3 s) from 3: ends at 6; the
    # asks at 4, 5 start particles 1, 2, the one at 6 stops the search. The first finalist trains its one
    # shared epoch unasked (train phase read at 8); the ask at 9 skips the other two and the rest epochs
    report = json.loads(result.report_path.read_text())
    assert report["budget"] == {
        "time_budget_s": 6.0,
        "source": "config",
        "search_share_s": 3.0,
        "stopped": "search,train",
        "final_epochs": [1, 4],
        "finalists": [1, 3],
    }
    assert report["search"]["budget_stopped"] and report["search"]["progress"]["iterations"] == [0, 2]
    assert [row["epochs"] for row in report["finalists"]] == [1]
    assert report["seconds"]["search"] == 5.0  # on the fake clock: readings 2 and 7
    metrics = read_bundle(result.bundle_path).metrics
    assert (metrics["budget_stopped"], metrics["time_budget_s"], metrics["final_epochs"]) == (
        "search,train",
        6.0,
        1,
    )
    # the override is part of what a resume compares
    assert report["config"]["time_budget_s"] == 6.0
    assert resume_key(config, data, profile) != resume_key(
        ClientConfig(search=search_config, seed=0, role="classifier"), data, profile
    )


def test_training_from_shared_weights_stops_at_the_deadline(tmp_path: Path) -> None:
    init = tmp_path / "init.onnx"
    init.write_bytes(initial_weights("C8k3-P-C16k3-P-F10", (1, 8, 8), 10, seed=7))
    search_config = FixedConfig(fixed_arch="C8k3-P-C16k3-P-F10", final_epochs=5)
    config = ClientConfig(init=str(init), search=search_config, role="classifier", time_budget_s=4.0)
    data = load_dataset("digits").subset(np.arange(300))
    out = tmp_path / "c.bundle"
    run_client(data, profile=load_profile("laptop-cpu"), config=config, out=out, clock=Ticking())
    # the budget starts at 1 (ends 5), the train phase at 2; asked after epochs 1, 2, 3: 3, 4, then 5 stops
    budget = json.loads(out.with_name(out.name + ".report.json").read_text())["budget"]
    assert (budget["stopped"], budget["final_epochs"], budget["search_share_s"]) == ("train", [3, 5], 0.0)
    assert read_bundle(out).metrics["final_epochs"] == 3


@pytest.mark.parametrize("value", [0, -1.0, math.nan, math.inf, "10", True])
def test_a_time_budget_must_be_positive_seconds(value: object) -> None:
    with pytest.raises(ConfigError, match="time_budget_s must be a finite number of seconds > 0"):
        ClientConfig(time_budget_s=value)  # type: ignore[arg-type]


def test_a_time_budget_is_refused_where_no_classifier_trains() -> None:
    with pytest.raises(ConfigError, match="role 'cvae' trains no classifier"):
        ClientConfig(role="cvae", time_budget_s=10.0)
    assert "time_budget_s" not in ClientConfig().to_dict()  # older client reports still match a resume


def test_cli_run_with_a_tiny_real_budget_finishes_and_says_where_it_stopped(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = tmp_path / "client.npz"
    save_client_data(data, load_dataset("digits"))
    profile = tmp_path / "roomy.toml"
    profile.write_text(
        'name = "roomy"\nmemory_mb = 4096.0\ngflops = 1e6\nmax_flops = 1000000000\nmax_params = 100000000\n'
    )
    out = tmp_path / "c.bundle"
    argv = ["run", "--data", str(data), "--profile", str(profile), "--out", str(out), "--quiet"]
    # 0.2 s: the fast preset's 24 candidates and 8 final epochs take this machine far longer
    assert main([*argv, "--role", "classifier", "--time-budget-s", "0.2", "--format", "json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    report = json.loads(out.with_name(out.name + ".report.json").read_text())
    assert report["budget"]["time_budget_s"] == 0.2 and report["budget"]["stopped"] is not None
    assert printed["metrics"]["budget_stopped"] == report["budget"]["stopped"]
    assert read_bundle(out).metrics["budget_stopped"] == report["budget"]["stopped"]
    assert main([*argv, "--time-budget-s", "0"]) == 2
    assert "time_budget_s must be a finite number of seconds > 0" in capsys.readouterr().err


def test_final_epochs_left_to_the_recipe_are_what_the_budget_pays_for() -> None:
    color, n = (3, 32, 32), 5_000
    n_train = 4_000  # the 80 % split of 5,000
    # the warm start costs about 20.7 MFLOP per 32x32x3 image: at 10 GFLOP/s one epoch of training on
    # 4,000 images is ~25 s, and the final training may take FINAL_TRAINING_SHARE (half) of the budget
    slow = DeviceProfile(name="slow", memory_mb=4096.0, gflops=10.0, max_flops=10**9, max_params=10**8,
                         time_budget_s=600.0)  # fmt: skip
    config = ClientConfig(search=FixedConfig())
    resolved = config.for_device(slow, n=n, input_shape=color, num_classes=10)
    epochs = resolved.search.final_epochs
    flops = reference_flops(resolved.search, slow, color, 10)
    assert 1 <= epochs < PSOConfig().for_input(color).final_epochs
    assert 3 * flops * n_train * epochs <= 0.5 * 600 * 10e9 < 3 * flops * n_train * (epochs + 1)
    # a fast device trains the recipe's epochs; a given number is kept whatever the budget
    fast = config.for_device(ROOMY, n=n, input_shape=color, num_classes=10).search
    assert fast.final_epochs == PSOConfig().for_input(color).final_epochs
    given = ClientConfig(search=FixedConfig(final_epochs=30)).for_device(
        slow, n=n, input_shape=color, num_classes=10
    )
    assert given.search.final_epochs == 30
    # the config's own time budget counts, and the key a resume compares records what will run
    longer = ClientConfig(search=FixedConfig(), time_budget_s=1200.0)
    assert longer.for_device(slow, n=n, input_shape=color, num_classes=10).search.final_epochs >= epochs
    data = ArrayDataset(x=torch.zeros((n, *color), dtype=torch.uint8), y=torch.arange(n) % 10, num_classes=10)
    assert resume_key(config, data, slow)["config"]["search"]["final_epochs"] == epochs
