"""Successive halving over the finalists and the plateau stop, on made-up curves (no training)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch

from common.errors import ConfigError
from common.timing import Deadline
from edge_sdk import client
from edge_sdk.client import ClientConfig
from edge_sdk.data import load_dataset, split_train_val
from edge_sdk.final_training import train_final
from edge_sdk.halving import halving_rungs, plateaued, rank_finalists, schedule_epochs
from edge_sdk.search import SearchResult
from edge_sdk.strategies.base import (
    AUGMENTED_FINAL_EPOCHS,
    AUGMENTED_WARM_START,
    PLAIN_FINAL_EPOCHS,
    PLAIN_WARM_START,
    PLATEAU_PATIENCE,
    RECORD_DEFAULTS,
)
from edge_sdk.strategies.baselines import FixedConfig
from edge_sdk.strategies.pso import PSOConfig


def test_halving_rungs_and_their_epochs() -> None:
    assert halving_rungs(3, 2, 0.5) == [(3, 1), (2, 1)]  # the default: 3 -> 2 -> 1, one epoch a rung
    assert halving_rungs(3, 2, 0.0) == [(3, 2)]  # keep 0: one rung, the choice after 2 epochs
    assert halving_rungs(8, 2, 0.5) == [(8, 1), (4, 1), (2, 1)]  # more rungs than epochs: one each
    assert halving_rungs(4, 5, 0.5) == [(4, 3), (2, 2)]
    assert halving_rungs(1, 2, 0.5) == [] and halving_rungs(3, 0, 0.5) == [(3, 0)]
    # the grayscale default trains fewer final epochs than the one-rung halving it replaced (3 x 2 + 4)
    gray = PSOConfig().for_input((1, 28, 28))
    assert schedule_epochs(3, 2, 0.5, 6) == 3 + 2 + 4 == gray.final_training_epochs() < 10
    assert schedule_epochs(3, 2, 0.0, 6) == 10
    assert schedule_epochs(3, 2, 0.0, 8) == 12 and schedule_epochs(1, 8, 0.5, 8) == 8
    for bad in (1.0, -0.1, "half"):
        with pytest.raises(ConfigError, match="finalist_keep"):
            PSOConfig(finalist_keep=bad)  # type: ignore[arg-type]


def test_rank_finalists_is_the_one_standard_error_rule() -> None:
    rows = [
        {"val_accuracy": 0.990, "val_loss": 0.03, "flops": 300},
        {"val_accuracy": 0.986, "val_loss": 0.04, "flops": 20},  # 0.4 under: within 1 SE of 400
        {"val_accuracy": 0.970, "val_loss": 0.09, "flops": 5},  # 2 points under: out
    ]
    rows = [r | {"params": 9, "train_memory_bytes": 1} for r in rows]
    assert rank_finalists(rows, 400) == [1, 0, 2]  # SE = sqrt(0.99 * 0.01 / 400) = 0.5 points
    assert rank_finalists(rows, 40_000) == [0, 1, 2]  # SE = 0.05 points: only the best is near
    assert rank_finalists([{**rows[0], "val_accuracy": 1.0}, rows[1]], 400) == [0, 1]


def test_rank_finalists_keeps_the_incumbent_on_a_tie() -> None:
    """Within the noise the search's warm start stays, unless a finalist costs no more in FLOPs, in
    parameters and in training memory; out of the noise it has no say."""
    mb = 2**20
    rows = [
        {"val_accuracy": 0.750, "val_loss": 0.80, "flops": 13, "params": 3_161, "train_memory_bytes": 9 * mb},
        {"val_accuracy": 0.745, "val_loss": 0.77, "flops": 31, "params": 95, "train_memory_bytes": 8 * mb},
        {"val_accuracy": 0.748, "val_loss": 0.79, "flops": 74, "params": 138, "train_memory_bytes": 9 * mb},
        {"val_accuracy": 0.700, "val_loss": 0.95, "flops": 5, "params": 11, "train_memory_bytes": 2 * mb},
    ]  # 0: fewer FLOPs, a wide head; 1: the warm start; 2: costlier in all; 3: out of the noise
    assert rank_finalists(rows, 1000) == [0, 1, 2, 3]  # SE = 1.4 points: no incumbent, cheapest first
    assert rank_finalists(rows, 1000, incumbent=1) == [1, 0, 2, 3]  # the tie stays with the warm start
    cheaper = [*rows[:3], {**rows[3], "val_accuracy": 0.744}]  # now in the noise, cheaper in all three
    assert rank_finalists(cheaper, 1000, incumbent=1) == [3, 1, 0, 2]
    assert rank_finalists(rows, 40_000, incumbent=1) == [0, 2, 1, 3]  # SE = 0.2 points: accuracy decides


def test_rank_finalists_counts_training_memory_as_a_cost() -> None:
    """A tie with fewer FLOPs and parameters but wide full-resolution maps (more training memory: the
    activations a step reads and writes) does not replace the warm start; with less memory it does."""
    warm = {"val_accuracy": 0.36, "val_loss": 1.9, "flops": 31, "params": 95, "train_memory_bytes": 35}
    wide = {"val_accuracy": 0.37, "val_loss": 1.9, "flops": 11, "params": 47, "train_memory_bytes": 92}
    assert rank_finalists([wide, warm], 500, incumbent=1) == [1, 0]
    assert rank_finalists([{**wide, "train_memory_bytes": 35}, warm], 500, incumbent=1) == [0, 1]


# validation accuracy after each epoch of three made-up finalists: c starts worst (and would end best),
# b leads after one epoch, a after two
CURVES = {
    "a": [0.90, 0.95, 0.96, 0.97, 0.97, 0.97, 0.97, 0.97],
    "b": [0.93, 0.94, 0.95, 0.95, 0.95, 0.95, 0.95, 0.95],
    "c": [0.80, 0.99, 0.99, 0.99, 0.99, 0.99, 0.99, 0.99],
}
FLOPS = {"a": 100, "b": 50, "c": 10}
PARAMS = {"a": 1_000, "b": 5_000, "c": 100}


@dataclass(frozen=True)
class _Trained:
    arch: str
    metrics: dict[str, Any]
    history: tuple[dict[str, float], ...]


def _fake_train_more(calls: list[tuple[str, int]], sizes: list[int] | None = None) -> Any:
    def train_more(*_: Any, **__: Any) -> Any:
        before, arch, epochs = _[3], _[4], _[5]
        calls.append((arch, epochs))
        if sizes is not None:
            sizes.append(len(_[0]))  # the training split's images
        done = (before.metrics["final_epochs"] if before is not None else 0) + epochs
        acc = CURVES[arch][done - 1]
        metrics = {
            "val_accuracy": acc,
            "val_loss": 1 - acc,
            "train_seconds": float(done),
            "flops": FLOPS[arch],
            "params": PARAMS[arch],
            "train_memory_bytes": 1,
            "final_epochs": done,
            "best_epoch": done,
            "plateau_stopped": False,
        }
        history = tuple({"val_loss": 1 - CURVES[arch][e]} for e in range(done))
        return _Trained(arch=arch, metrics=metrics, history=history)

    return train_more


class _Split:
    def __init__(self, n: int = 10_000) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def concat(self, other: _Split) -> _Split:
        return _Split(self.n + other.n)


def test_successive_halving_keeps_the_right_finalists(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[str, int]] = []
    monkeypatch.setattr(client, "_train_more", _fake_train_more(calls))
    result = SearchResult("pso", "a", 0.1, (), 0, 0, 0, 0.0, (("a", 0.1),), finalists=("a", "b", "c"))
    config = ClientConfig(
        search=PSOConfig(final_epochs=8, plateau_patience=0, rest_on_all=False), role="classifier"
    )
    # 10,000 validation images: a standard error of 0.2 points, no near ties
    best, rows, cut = client._train_finalists(
        result,
        _Split(),
        _Split(),
        config,
        Deadline.after(math.inf),  # type: ignore[arg-type]
    )
    # rung 1: all three one epoch; c (0.80) drops; rung 2: a and b a second; a (0.95) beats b (0.94)
    # and trains on to 8 in one go
    assert calls == [("a", 1), ("b", 1), ("c", 1), ("b", 1), ("a", 1), ("a", 6)]
    assert [(r["arch"], r["epochs"], r["rungs"], r["chosen"]) for r in rows] == [
        ("a", 2, 2, True),
        ("b", 2, 2, False),
        ("c", 1, 1, False),
    ]
    assert best.arch == "a" and rows[0]["final_epochs"] == 8 and rows[0]["final_val_accuracy"] == 0.97
    assert not cut and sum(epochs for _, epochs in calls) == 11


def test_successive_halving_keeps_the_warm_start_on_a_tie(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[str, int]] = []
    monkeypatch.setattr(client, "_train_more", _fake_train_more(calls))
    config = ClientConfig(
        search=PSOConfig(final_epochs=8, plateau_patience=0, rest_on_all=False), role="classifier"
    )
    # 100 validation images: a standard error of about 2 points; after two epochs a (0.95) and the warm
    # start b (0.94) tie, a costs more FLOPs, so b trains on; with a as the warm start, b (fewer FLOPs,
    # more parameters) is not cheaper in both budgets, so a does
    for warm in ("b", "a"):
        calls.clear()
        result = SearchResult(
            "pso", "a", 0.1, (), 0, 0, 0, 0.0, (("a", 0.1),), finalists=("a", "b", "c"), incumbent=warm
        )
        best, _, _ = client._train_finalists(
            result, _Split(), _Split(100), config, Deadline.after(math.inf)  # type: ignore[arg-type]
        )  # fmt: skip
        assert calls == [("a", 1), ("b", 1), ("c", 1), ("b", 1), ("a", 1), (warm, 6)] and best.arch == warm


def test_the_winner_trains_its_last_epochs_on_every_image(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[str, int]] = []
    sizes: list[int] = []
    monkeypatch.setattr(client, "_train_more", _fake_train_more(calls, sizes))
    config = ClientConfig(search=PSOConfig(final_epochs=8, plateau_patience=0), role="classifier")
    assert config.search.for_input((3, 8, 8)).rests_on_all()  # on where no plateau rule reads the curve
    result = SearchResult("pso", "a", 0.1, (), 0, 0, 0, 0.0, (("a", 0.1),), finalists=("a", "b", "c"))
    best, rows, _ = client._train_finalists(
        result, _Split(8_000), _Split(2_000), config, Deadline.after(math.inf)  # type: ignore[arg-type]
    )  # fmt: skip
    # the rungs on the training split, the winner's rest on all 10,000 images
    assert calls == [("a", 1), ("b", 1), ("c", 1), ("b", 1), ("a", 1), ("a", 6)]
    assert sizes == [8_000] * 5 + [10_000]
    # its validation numbers are those measured on images it had not seen (after two epochs), and the
    # report says when; the device plan counts the six epochs' extra images
    assert (best.metrics["val_accuracy"], best.metrics["val_epochs"]) == (0.95, 2)
    assert rows[0]["epochs_on_all"] == 6 and rows[0]["final_epochs"] == 8
    assert "final_val_accuracy" not in rows[0]
    # a lone finalist holds the validation images back for the halving's share first
    calls.clear()
    sizes.clear()
    lone = SearchResult("pso", "a", 0.1, (), 0, 0, 0, 0.0, (("a", 0.1),), finalists=("a",))
    best, rows, _ = client._train_finalists(
        lone, _Split(8_000), _Split(2_000), config, Deadline.after(math.inf)  # type: ignore[arg-type]
    )  # fmt: skip
    assert calls == [("a", 2), ("a", 6)] and sizes == [8_000, 10_000]
    assert (best.metrics["val_accuracy"], best.metrics["val_epochs"]) == (0.95, 2)
    assert rows[0]["epochs_on_all"] == 6
    # a plateau rule reads the validation curve to the end: the two do not go together
    with pytest.raises(ConfigError, match="rest_on_all trains on the validation images"):
        PSOConfig(final_epochs=8, plateau_patience=2, rest_on_all=True).rests_on_all()
    assert not PSOConfig(final_epochs=8, plateau_patience=2).rests_on_all()


def test_final_epochs_and_plateau_follow_the_recipe() -> None:
    gray, color = (1, 28, 28), (3, 32, 32)
    plain = PSOConfig().for_input(gray)
    assert (plain.final_epochs, plain.plateau_patience) == (PLAIN_FINAL_EPOCHS, PLATEAU_PATIENCE)
    # a grayscale run records what it did before the rule existed, so its resume keys still match (all
    # but the search's FLOP budget and cap and the plain final epochs, later changes that redo the clients)
    now = {"search_budget": 0.125, "flop_cap": 1.0, "final_epochs": PLAIN_FINAL_EPOCHS}
    assert plain.to_dict() == RECORD_DEFAULTS | now
    rich = PSOConfig().for_input(color)  # crop-flip and a cosine rate: more epochs, no plateau stop
    assert (rich.final_epochs, rich.plateau_patience) == (AUGMENTED_FINAL_EPOCHS, 0)
    assert AUGMENTED_FINAL_EPOCHS > PLAIN_FINAL_EPOCHS
    # the recipe decides, not the channel count; given values are kept
    flat = PSOConfig(augment="none", schedule="constant").for_input(color)
    assert (flat.final_epochs, flat.plateau_patience) == (PLAIN_FINAL_EPOCHS, PLATEAU_PATIENCE)
    cropped = PSOConfig(augment="crop-flip").for_input(gray)
    assert (cropped.final_epochs, cropped.plateau_patience) == (AUGMENTED_FINAL_EPOCHS, PLATEAU_PATIENCE)
    given = PSOConfig(final_epochs=5, plateau_patience=3).for_input(color)
    assert (given.final_epochs, given.plateau_patience) == (5, 3)
    # the hand-made design follows the recipe too: CNN1 for plain images, three 3x3 stages for pictures
    assert (plain.fixed_arch, rich.fixed_arch) == (PLAIN_WARM_START, AUGMENTED_WARM_START)
    assert FixedConfig().for_input(color).fixed_arch == AUGMENTED_WARM_START
    assert PSOConfig(fixed_arch="C8k3-P-F10").for_input(color).fixed_arch == "C8k3-P-F10"
    with pytest.raises(ConfigError, match="for_input"):
        PSOConfig().final_training_epochs()
    with pytest.raises(ConfigError, match="for_input"):
        PSOConfig(final_epochs=8).plateau()


def test_plateau_stops_at_the_right_epoch() -> None:
    losses = [1.0, 0.5, 0.3, 0.25, 0.249, 0.2485, 0.26, 0.27]
    rule = {"patience": 2, "min_epochs": 4, "min_delta": 0.01}
    stops = [n for n in range(1, len(losses) + 1) if plateaued(losses[:n], **rule)]
    # after epoch 6: epochs 5 and 6 came within 1 % of epoch 4's 0.25
    assert stops[0] == 6
    flat = [1.0] * 6
    assert [plateaued(flat[:n], **rule) for n in range(1, 7)] == [False, False, False, True, True, True]
    assert not any(plateaued(flat[:n], **rule | {"patience": 0}) for n in range(1, 7))
    assert plateaued([1.0, 0.9, 0.8, math.nan, math.nan], **rule)  # a diverged run stops
    assert not plateaued([1.0, 0.9, 0.8, 0.7, 0.6], **rule)


def test_train_final_stops_on_the_plateau_rule() -> None:
    train_split, val_split = split_train_val(
        load_dataset("digits").subset(np.arange(300)), val_fraction=0.2, seed=0
    )
    seen: list[list[float]] = []

    def rule(losses: Any) -> bool:
        seen.append(list(losses))
        return len(losses) >= 3

    trained = train_final(
        "C4k3-P-F10", train_split, val_split, epochs=6, seed=0, plateau=rule, prior_val=[9.0]
    )
    assert trained.metrics["final_epochs"] == 2 and trained.metrics["plateau_stopped"]
    assert [len(s) for s in seen] == [2, 3] and seen[0][0] == 9.0  # the earlier epochs' losses first
    assert [h["val_loss"] for h in trained.history] == seen[-1][1:]
    # the weights of the lowest validation loss are kept: the starting ones (9.0) lost to both epochs
    losses = [h["val_loss"] for h in trained.history]
    kept = trained.metrics["best_epoch"]
    assert losses[kept - 1] == min(losses) and trained.metrics["val_loss"] == min(losses)
    full = train_final("C4k3-P-F10", train_split, val_split, epochs=3, seed=0, track_val=True)
    assert full.metrics["final_epochs"] == 3 and not full.metrics["plateau_stopped"]
    assert len(full.history) == 3 and full.history[0]["val_loss"] == trained.history[0]["val_loss"]
    assert full.metrics["best_epoch"] == 3  # no plateau rule: the last weights


def test_the_plateau_rule_returns_to_the_best_weights() -> None:
    """A run whose every epoch is worse than the weights it started from returns those weights."""
    train_split, val_split = split_train_val(
        load_dataset("digits").subset(np.arange(300)), val_fraction=0.2, seed=0
    )
    first = train_final("C4k3-P-F10", train_split, val_split, epochs=1, seed=0)
    start = {k: v.clone() for k, v in first.module.state_dict().items()}
    more = train_final(
        "C4k3-P-F10", train_split, val_split, epochs=2, seed=1, init=first.module,
        optimizer=first.optimizer, plateau=lambda _: False, prior_val=[-1.0],
    )  # fmt: skip
    assert more.metrics["best_epoch"] == 0 and more.metrics["final_epochs"] == 2
    assert all(torch.equal(v, start[k]) for k, v in more.module.state_dict().items())
    assert more.metrics["val_loss"] == pytest.approx(first.metrics["val_loss"], rel=1e-6)
