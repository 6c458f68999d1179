"""The classifier pipeline of `run_client`: the search's finalists are trained and the best is bundled."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from common.errors import ConfigError
from edge_sdk.client import ClientConfig, run_client
from edge_sdk.curves import check_curve
from edge_sdk.data import load_dataset
from edge_sdk.strategies.pso import PSOConfig
from export.bundle import read_bundle
from profiles import load_profile


def test_run_client_keeps_the_most_accurate_finalist(tmp_path: Path) -> None:
    data = load_dataset("digits").subset(np.arange(600))
    search = PSOConfig(particles=3, iterations=1, max_depth=5, max_train_samples=100, final_epochs=4)
    config = ClientConfig(search=search, seed=3, role="classifier")
    result = run_client(data, profile=load_profile("laptop-cpu"), config=config, out=tmp_path / "c.bundle")
    report = json.loads(result.report_path.read_text())
    rows = report["finalists"]
    assert result.search is not None and [r["arch"] for r in rows] == list(result.search.finalists)
    assert len(rows) == 3 and sum(r["chosen"] for r in rows) == 1
    # successive halving: every finalist trains a quarter of the 4 final epochs, the best goes on to 4
    assert all(r["epochs"] == 1 for r in rows)
    chosen = next(r for r in rows if r["chosen"])
    # the cheapest finalist within one standard error of the best validation accuracy
    top = max(r["val_accuracy"] for r in rows)
    n_val = 600 - read_bundle(result.bundle_path).num_examples
    near = [r for r in rows if r["val_accuracy"] >= top - math.sqrt(top * (1 - top) / n_val)]
    assert chosen["flops"] == min(r["flops"] for r in near) and chosen["final_epochs"] == 4
    assert all("final_val_accuracy" not in r for r in rows if not r["chosen"])
    bundle = read_bundle(result.bundle_path)
    assert bundle.arch == result.arch == chosen["arch"]
    assert bundle.metrics["val_accuracy"] == chosen["final_val_accuracy"] and bundle.metrics["finalists"] == 3
    assert bundle.metrics["final_epochs"] == 4
    # the report's curves: the chosen finalist's training over all its 4 epochs (1 shared, then 3), its
    # last point the bundle's final train loss; the best candidate's one search epoch; no CVAE
    curves = report["curves"]
    assert set(curves) == {"classifier", "search"}
    classifier = check_curve(curves["classifier"], "classifier")
    assert classifier["epoch"] == [1, 2, 3, 4] and set(classifier) == {"epoch", "train_loss"}
    # one number stored twice (JSON and the bundle's msgpack): float round trips, rel 1e-5 is ample
    assert classifier["train_loss"][-1] == pytest.approx(bundle.metrics["train_loss"], rel=1e-5)
    assert classifier["train_loss"][-1] < classifier["train_loss"][0]
    assert check_curve(curves["search"], "search")["epoch"] == list(range(1, search.epochs + 1))
    assert all(not isinstance(v, list) for v in bundle.metrics.values())  # the manifest stays scalar


def test_finalist_share_one_trains_every_finalist_fully(tmp_path: Path) -> None:
    data = load_dataset("digits").subset(np.arange(400))
    search = PSOConfig(
        particles=3, iterations=0, max_depth=4, max_train_samples=100, final_epochs=2, finalist_share=1.0
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


def test_finalist_epochs_rule() -> None:
    assert PSOConfig().finalist_epochs() == 2  # a quarter of 8
    assert PSOConfig(final_epochs=3).finalist_epochs() == 1
    assert PSOConfig(final_epochs=3, finalist_share=1.0).finalist_epochs() == 3
    assert PSOConfig(finalists=1).finalist_epochs() == 8
    assert PSOConfig(final_epochs=0).finalist_epochs() == 0
    for bad in (0.0, 1.5, True, "half"):
        with pytest.raises(ConfigError, match="finalist_share"):
            PSOConfig(finalist_share=bad)  # type: ignore[arg-type]


def test_one_standard_error_rule_prefers_the_cheaper_of_near_ties() -> None:
    from edge_sdk.client import _one_standard_error

    rows = [
        {"val_accuracy": 0.990, "val_loss": 0.03, "flops": 300},
        {"val_accuracy": 0.986, "val_loss": 0.04, "flops": 20},  # 0.4 points under: within 1 SE of 400
        {"val_accuracy": 0.970, "val_loss": 0.09, "flops": 5},  # 2 points under: out
    ]
    assert _one_standard_error(rows, 400) == 1  # SE = sqrt(0.99 * 0.01 / 400) = 0.5 points
    assert _one_standard_error(rows, 40_000) == 0  # SE = 0.05 points: only the best is near
    assert _one_standard_error([{**rows[0], "val_accuracy": 1.0}, rows[1]], 400) == 0


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
