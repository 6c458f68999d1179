"""The classifier pipeline of `run_client`: the search's finalists are trained and the best is bundled."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import numpy as np
import pytest

import edge_sdk.strategies.evaluator as evaluator_module
from common.errors import ConfigError
from edge_sdk.client import ClientConfig, plan_run, run_client
from edge_sdk.curves import check_curve
from edge_sdk.data import load_dataset
from edge_sdk.strategies.pso import PSOConfig
from export.bundle import read_bundle
from profiles import load_profile


def test_run_client_keeps_the_most_accurate_finalist(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    data = load_dataset("digits").subset(np.arange(600))
    search = PSOConfig(
        particles=3, iterations=1, max_depth=5, max_train_samples=100, final_epochs=4,
        finalists_beat_warm=False,  # the halving over all three
    )  # fmt: skip
    config = ClientConfig(search=search, seed=3, role="classifier")
    profile = load_profile("laptop-cpu")
    with caplog.at_level(logging.INFO, logger="edge_sdk"):
        result = run_client(data, profile=profile, config=config, out=tmp_path / "c.bundle")
    report = json.loads(result.report_path.read_text())
    # the plan, logged before the run: the planned FLOPs and the time they take at the profile's GFLOP/s
    plan = report["device_plan"]
    planned, actual = plan["planned"], plan["actual"]
    [line] = [r.getMessage() for r in caplog.records if r.getMessage().startswith("plan: ")]
    assert f"{planned['total'] / 1e12:.3g} TFLOP" in line and f"about {planned['seconds']:.0f} s" in line
    assert "at 100 GFLOP/s (profile 'laptop-cpu'" in line and profile.gflops == 100
    assert planned["cvae"] == 0 and planned["seconds"] == pytest.approx(planned["total"] / 100e9, abs=1e-3)
    # the same plan is known before any work, from the size alone (what `simulate` orders its clients by)
    role, _, before = plan_run(config, profile, n=600, input_shape=data.input_shape, num_classes=10)
    assert role == "classifier" and before == planned
    # 480 training images (the search's subset: 100), 120 validation ones; one candidate epoch each
    assert result.search is not None
    trained_candidates = [e for e in result.search.evaluations if e.epochs > 0]
    assert actual["search"] == sum(e.flops * (3 * 100 + 120) for e in trained_candidates)
    assert actual["total"] == actual["search"] + actual["final_training"] and actual["cvae"] == 0
    measured = report["seconds"]["search"] + report["seconds"]["train"]
    assert actual["seconds"] == pytest.approx(measured, abs=2e-3)
    ratio = plan["actual_over_planned"]["seconds"]
    # the ratio is of the unrounded seconds: the report's are rounded to 1 ms, the ratio to 4 decimals
    slack = 5e-4 / planned["seconds"] + 5e-5
    assert ratio == pytest.approx(actual["seconds"] / planned["seconds"], abs=slack)
    rows = report["finalists"]
    assert result.search is not None and [r["arch"] for r in rows] == list(result.search.finalists)
    assert len(rows) == 3 and sum(r["chosen"] for r in rows) == 1
    # successive halving: all three finalists train one epoch (a quarter of 4), the best two by the
    # one-standard-error ranking a second, and the best of those goes on to 4
    assert sorted(r["epochs"] for r in rows) == [1, 2, 2]
    assert [r["rungs"] for r in rows] == [1 if r["epochs"] == 1 else 2 for r in rows]
    chosen = next(r for r in rows if r["chosen"])
    # the last rung's one-standard-error choice: the warm start where it ties, unless a finalist there
    # costs no more in FLOPs and parameters; else the cheapest in FLOPs
    last = [r for r in rows if r["epochs"] == 2]
    top = max(r["val_accuracy"] for r in last)
    n_val = 600 - read_bundle(result.bundle_path).num_examples
    near = [r for r in last if r["val_accuracy"] >= top - math.sqrt(top * (1 - top) / n_val)]
    warm = next((r for r in near if r["arch"] == result.search.incumbent), None)
    if warm is not None:
        near = [r for r in near if r["flops"] <= warm["flops"] and r["params"] <= warm["params"]]
    assert chosen["flops"] == min(r["flops"] for r in near) and chosen["final_epochs"] == 4
    assert report["search"]["incumbent"] == result.search.incumbent
    assert all("final_val_accuracy" not in r for r in rows if not r["chosen"])
    bundle = read_bundle(result.bundle_path)
    assert bundle.arch == result.arch == chosen["arch"]
    assert bundle.metrics["val_accuracy"] == chosen["final_val_accuracy"] and bundle.metrics["finalists"] == 3
    assert bundle.metrics["final_epochs"] == 4
    # the report's curves: the chosen finalist's training over all its 4 epochs (2 in rungs, then 2), with
    # the validation numbers of every epoch (the plateau rule's); the bundle holds the weights of its
    # lowest validation loss, with that epoch's numbers; the best candidate's one search epoch; no CVAE
    curves = report["curves"]
    assert set(curves) == {"classifier", "search"}
    classifier = check_curve(curves["classifier"], "classifier")
    assert classifier["epoch"] == [1, 2, 3, 4]
    assert set(classifier) == {"epoch", "train_loss", "val_loss", "val_accuracy"}
    best = bundle.metrics["best_epoch"]
    assert best == chosen["best_epoch"] and classifier["val_loss"][best - 1] == min(classifier["val_loss"])
    # one number stored twice (JSON and the bundle's msgpack): float round trips, rel 1e-5 is ample
    for name in ("val_accuracy", "val_loss", "train_loss"):
        assert classifier[name][best - 1] == pytest.approx(bundle.metrics[name], rel=1e-5)
    assert classifier["train_loss"][-1] < classifier["train_loss"][0]
    assert check_curve(curves["search"], "search")["epoch"] == list(range(1, search.search_epochs + 1))
    assert all(not isinstance(v, list) for v in bundle.metrics.values())  # the manifest stays scalar


def test_finalist_share_one_trains_every_finalist_fully(tmp_path: Path) -> None:
    data = load_dataset("digits").subset(np.arange(400))
    search = PSOConfig(
        particles=3,
        iterations=0,
        max_depth=4,
        max_train_samples=100,
        final_epochs=2,
        finalist_share=1.0,
        finalist_keep=0.0,  # one rung: all finalists train the 2 epochs, then one is chosen
        finalists_beat_warm=False,
    )
    result = run_client(
        data,
        profile=load_profile("laptop-cpu"),
        config=ClientConfig(search=search, seed=1, role="classifier"),
        out=tmp_path / "c.bundle",
    )
    rows = json.loads(result.report_path.read_text())["finalists"]
    assert all(r["epochs"] == 2 and "final_val_accuracy" not in r for r in rows)
    chosen = next(r for r in rows if r["chosen"])
    assert read_bundle(result.bundle_path).metrics["val_accuracy"] == chosen["val_accuracy"]


def test_a_warm_start_the_search_ranks_first_trains_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No halving when no finalist beat the warm start in the search: the device trains the hand-made
    design alone, its whole final training from the client's seed."""
    warm = "C32k5-P-C64k5-P-F10"  # CNN1, the default warm start; it fits laptop-cpu on 8x8 digits
    monkeypatch.setattr(
        evaluator_module.Evaluator, "_fitness", lambda self, spec, key: 0.1 if key == warm else 2.0
    )
    data = load_dataset("digits").subset(np.arange(400))
    search = PSOConfig(particles=3, iterations=0, max_depth=5, max_train_samples=100, final_epochs=3)
    result = run_client(
        data,
        profile=load_profile("laptop-cpu"),
        config=ClientConfig(search=search, seed=1, role="classifier"),
        out=tmp_path / "c.bundle",
    )
    report = json.loads(result.report_path.read_text())
    assert report["search"]["finalists"] == [warm] and len(report["search"]["details"]["behind_warm"]) == 2
    [row] = report["finalists"]
    assert row["arch"] == warm and row["chosen"] and row["rungs"] == 0 and row["epochs"] == 3
    bundle = read_bundle(result.bundle_path)
    assert bundle.arch == warm and bundle.metrics["final_epochs"] == 3 and bundle.metrics["finalists"] == 1


def test_finalist_epochs_rule() -> None:
    assert PSOConfig().for_input((1, 8, 8)).finalist_epochs() == 2  # a quarter of 8
    assert PSOConfig().for_input((3, 32, 32)).finalist_epochs() == 10  # a quarter of 40
    assert PSOConfig(final_epochs=3).finalist_epochs() == 1
    assert PSOConfig(final_epochs=3, finalist_share=1.0).finalist_epochs() == 3
    assert PSOConfig(finalists=1, final_epochs=8).finalist_epochs() == 8
    assert PSOConfig(final_epochs=0).finalist_epochs() == 0
    for bad in (0.0, 1.5, True, "half"):
        with pytest.raises(ConfigError, match="finalist_share"):
            PSOConfig(finalist_share=bad)  # type: ignore[arg-type]


def test_train_final_goes_on_with_the_optimizer_it_is_given() -> None:
    from edge_sdk.data import split_train_val
    from edge_sdk.final_training import train_final

    train_split, val_split = split_train_val(
        load_dataset("digits").subset(np.arange(300)), val_fraction=0.2, seed=0
    )
    first = train_final("C4k3-P-F10", train_split, val_split, epochs=1, seed=0)
    assert first.optimizer is not None
    weight = next(first.module.parameters())
    steps = int(first.optimizer.state[weight]["step"])
    more = train_final(
        "C4k3-P-F10", train_split, val_split, epochs=1, seed=1, init=first.module, optimizer=first.optimizer
    )
    assert more.optimizer is first.optimizer and more.module is first.module
    assert int(more.optimizer.state[weight]["step"]) == 2 * steps  # Adam's moments went on
    with pytest.raises(ConfigError, match="init"):
        train_final("C4k3-P-F10", train_split, val_split, epochs=1, seed=0, optimizer=first.optimizer)
