"""The color training recipe (edge_sdk.augment, in edge_sdk.train's loop): chosen by the input spec, crops and
flips that are windows of the padded image, determinism under a seed, grayscale training untouched."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from common.errors import ConfigError
from edge_sdk.augment import COLOR_WEIGHT_DECAY, Recipe, cosine_factor, crop_flip, resolve_recipe
from edge_sdk.data import ArrayDataset
from edge_sdk.models.arch import build_model
from edge_sdk.strategies.pso import PSOConfig
from edge_sdk.train import TrainConfig, make_optimizer, train

COLOR = (3, 16, 16)
GRAY = (1, 16, 16)


def _images(shape: tuple[int, int, int], n: int = 96, seed: int = 0) -> ArrayDataset:
    """Two classes of random-ish uint8 images: class 1 has a bright top half in every channel."""
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 2, n)
    x = rng.integers(0, 140, (n, *shape))
    x[y == 1, :, : shape[1] // 2] += 110
    return ArrayDataset(torch.from_numpy(x.astype(np.uint8)), torch.from_numpy(y.astype(np.int64)), 2)


def _model(shape: tuple[int, int, int]) -> nn.Module:
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return build_model("C8k3-P-R8k3-P-F2", shape, 2)


def _trained(data: ArrayDataset, config: TrainConfig, seed: int) -> tuple[list[float], dict]:
    model = _model(data.input_shape)
    losses = train(model, data, config=config, seed=seed)
    return losses, model.state_dict()


def _same(a: dict, b: dict) -> bool:
    return all(torch.equal(a[k], b[k]) for k in a)


def test_recipe_follows_the_input_spec_not_a_name() -> None:
    assert resolve_recipe(COLOR, augment="auto", schedule="auto", weight_decay=None) == Recipe(
        pad=2, schedule="cosine", weight_decay=COLOR_WEIGHT_DECAY
    )  # 16 // 8: a 2-pixel border on 16x16 (4 on 32x32)
    assert resolve_recipe((3, 32, 32), augment="auto", schedule="auto", weight_decay=None).pad == 4
    assert resolve_recipe(GRAY, augment="auto", schedule="auto", weight_decay=None) == Recipe(
        pad=0, schedule="constant", weight_decay=0.0
    )
    # an explicit choice is kept whatever the input
    assert resolve_recipe(GRAY, augment="crop-flip", schedule="cosine", weight_decay=0.1) == Recipe(
        pad=2, schedule="cosine", weight_decay=0.1
    )
    assert resolve_recipe(COLOR, augment="none", schedule="constant", weight_decay=0).pad == 0


@pytest.mark.parametrize(
    ("field", "value"),
    [("augment", "mixup"), ("schedule", "step"), ("weight_decay", -1e-4), ("weight_decay", float("inf"))],
)
def test_recipe_options_are_checked(field: str, value: object) -> None:
    with pytest.raises(ConfigError, match=field):
        TrainConfig(**{field: value})
    with pytest.raises(ConfigError, match=field):
        PSOConfig(**{field: value})


def test_crops_and_flips_are_windows_of_the_padded_image() -> None:
    x = torch.randint(0, 256, (40, 3, 6, 5), dtype=torch.uint8)
    out = crop_flip(x, 2, torch.Generator().manual_seed(3))
    assert out.dtype == torch.uint8 and out.shape == x.shape
    padded = torch.nn.functional.pad(x, (2, 2, 2, 2))
    flipped = 0
    for image, source in zip(out, padded, strict=True):
        windows = [
            (flip, source[:, r : r + 6, c : c + 5].flip(2) if flip else source[:, r : r + 6, c : c + 5])
            for r in range(5)
            for c in range(5)
            for flip in (False, True)
        ]
        matches = [flip for flip, window in windows if torch.equal(window, image)]
        assert matches, "every augmented image is a (mirrored) window of its padded original"
        flipped += matches[0]
    assert 0 < flipped < 40  # flips happen, not always
    again = crop_flip(x, 2, torch.Generator().manual_seed(3))
    assert torch.equal(out, again)
    assert not torch.equal(out, crop_flip(x, 2, torch.Generator().manual_seed(4)))


def test_cosine_factor_decays_from_one_to_zero() -> None:
    assert cosine_factor(0, 10) == 1.0
    assert cosine_factor(5, 10) == pytest.approx(0.5)
    assert cosine_factor(10, 10) == pytest.approx(0.0)
    assert cosine_factor(3, 0) == 1.0


def test_color_training_is_deterministic_under_its_seed_and_augments() -> None:
    data = _images(COLOR)
    config = TrainConfig(epochs=2, batch_size=16)
    loss_a, a = _trained(data, config, seed=5)
    loss_b, b = _trained(data, config, seed=5)
    assert loss_a == loss_b and _same(a, b)
    _, c = _trained(data, config, seed=6)
    assert not _same(a, c)
    # the recipe is on: without augmentation (and its decay and schedule) the same seed trains otherwise
    _, plain = _trained(data, TrainConfig(epochs=2, batch_size=16, augment="none"), seed=5)
    assert not _same(a, plain)


def test_grayscale_training_is_the_plain_recipe_exactly() -> None:
    data = _images(GRAY)
    auto = _trained(data, TrainConfig(epochs=2, batch_size=16), seed=5)
    plain = _trained(
        data,
        TrainConfig(epochs=2, batch_size=16, augment="none", schedule="constant", weight_decay=0.0),
        seed=5,
    )
    assert auto[0] == plain[0] and _same(auto[1], plain[1])
    forced = _trained(data, TrainConfig(epochs=2, batch_size=16, augment="crop-flip"), seed=5)
    assert not _same(auto[1], forced[1])


@pytest.mark.parametrize(("schedule", "shape"), [("auto", COLOR), ("auto", GRAY), ("cosine", GRAY)])
def test_schedule_runs_over_the_call(schedule: str, shape: tuple[int, int, int]) -> None:
    data = _images(shape, n=50)
    model = _model(shape)
    config = TrainConfig(epochs=3, batch_size=16, lr=0.01, schedule=schedule)
    optimizer = make_optimizer(model, config, shape)
    train(model, data, config=config, seed=0, optimizer=optimizer)
    cosine = shape == COLOR or schedule == "cosine"
    assert optimizer.param_groups[0]["lr"] == (pytest.approx(0.0, abs=1e-12) if cosine else 0.01)
    decay = optimizer.param_groups[0]["weight_decay"]
    assert decay == (COLOR_WEIGHT_DECAY if shape == COLOR else 0.0)
    if cosine:  # a continued run without a span starts its own schedule at the optimizer's first rate
        rates: list[float] = []
        train(
            model,
            data,
            config=config,
            seed=1,
            optimizer=optimizer,
            stop=lambda: rates.append(optimizer.param_groups[0]["lr"]) or False,
        )
        assert rates[0] > 0.005 and optimizer.param_groups[0]["lr"] == pytest.approx(0.0, abs=1e-12)


def test_a_run_in_parts_follows_one_schedule() -> None:
    """Two runs of 2 epochs with schedule_span (0, 4) and (2, 4) end where one run of 4 epochs ends, and
    the second starts where the first stopped (successive halving's rungs, then the rest)."""
    data = _images(COLOR, n=48)
    model = _model(COLOR)
    config = TrainConfig(epochs=2, batch_size=16, lr=0.01, schedule_span=(0, 4))
    optimizer = make_optimizer(model, config, COLOR)
    train(model, data, config=config, seed=0, optimizer=optimizer)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.005)  # half way down the cosine
    rates: list[float] = []
    more = TrainConfig(epochs=2, batch_size=16, lr=0.01, schedule_span=(2, 4))
    train(model, data, config=more, seed=1, optimizer=optimizer, stop=lambda: rates.append(0.0) or False)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.0, abs=1e-12)
    with pytest.raises(ConfigError, match="schedule_span"):
        TrainConfig(epochs=3, schedule_span=(2, 4))
    with pytest.raises(ConfigError, match="schedule_span"):
        TrainConfig(epochs=1, schedule_span=(-1, 4))
