"""The one minibatch loop: batch plans, the seeded order, and fit against a hand-written loop."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch
from torch import nn

from common.errors import ConfigError
from common.loop import adam, fit, fit_terms, minibatches, sgd, step


def _sizes(batches: list[torch.Tensor]) -> list[int]:
    return [len(b) for b in batches]


def test_batches_cover_one_permutation_drawn_from_the_generator() -> None:
    batches = minibatches(10, 4, generator=torch.Generator().manual_seed(3))
    assert _sizes(batches) == [4, 4, 2]
    want = torch.randperm(10, generator=torch.Generator().manual_seed(3))
    assert torch.equal(torch.cat(batches), want)  # one randperm draw, in order


@pytest.mark.parametrize(("lone_last", "sizes"), [("keep", [4, 4, 1]), ("merge", [4, 5]), ("drop", [4, 4])])
def test_a_lone_last_sample_is_kept_merged_or_dropped(lone_last: str, sizes: list[int]) -> None:
    batches = minibatches(9, 4, generator=torch.Generator().manual_seed(0), lone_last=lone_last)
    assert _sizes(batches) == sizes


def test_drop_leaves_no_batch_of_one_and_a_single_batch_alone() -> None:
    gen = torch.Generator().manual_seed(0)
    assert minibatches(5, 1, generator=gen, lone_last="drop") == []
    assert _sizes(minibatches(1, 4, generator=gen, lone_last="merge")) == [1]  # nothing to merge into


def test_unknown_lone_last_is_refused() -> None:
    with pytest.raises(ConfigError, match="lone_last must be one of"):
        minibatches(4, 2, generator=torch.Generator(), lone_last="pad")


def test_fit_equals_the_hand_written_loop() -> None:
    """Same permutations, same steps, and the epoch loss as the sample-weighted mean of the batch losses."""
    x = torch.randn(11, 3, generator=torch.Generator().manual_seed(1))
    y = torch.randn(11, 1, generator=torch.Generator().manual_seed(2))

    def make() -> tuple[nn.Module, torch.optim.Optimizer]:
        model = nn.Linear(3, 1)
        with torch.no_grad():
            model.weight.fill_(0.1)
            model.bias.zero_()
        return model, torch.optim.SGD(model.parameters(), lr=0.1)

    model, opt = make()
    losses = fit(
        lambda idx: nn.functional.mse_loss(model(x[idx]), y[idx]),
        opt,
        n=11,
        batch_size=4,
        epochs=2,
        generator=torch.Generator().manual_seed(5),
        device=torch.device("cpu"),
    )
    ref, ref_opt = make()
    gen = torch.Generator().manual_seed(5)
    want = []
    for _ in range(2):
        order, total = torch.randperm(11, generator=gen), 0.0
        for start in range(0, 11, 4):
            idx = order[start : start + 4]
            loss = nn.functional.mse_loss(ref(x[idx]), y[idx])
            ref_opt.zero_grad()
            loss.backward()
            ref_opt.step()
            total += loss.item() * len(idx)
        want.append(total / 11)
    # the loop runs the very ops written out above, so the weights match bitwise; the epoch means may
    # accumulate the batch losses in another precision or order: a few ulps, rel 1e-6
    assert losses == pytest.approx(want, rel=1e-6)
    assert torch.equal(model.weight, ref.weight) and torch.equal(model.bias, ref.bias)


def test_step_clears_the_previous_gradient() -> None:
    w = nn.Parameter(torch.ones(1))
    opt = torch.optim.SGD([w], lr=1.0)
    w.grad = torch.full((1,), 100.0)  # a stale gradient must not be applied
    step(opt, (2 * w).sum())
    assert w.item() == pytest.approx(-1.0)  # 1 - 1.0 * 2: exact


@pytest.mark.parametrize(
    ("answers", "epochs_run", "asked"), [([False] * 4, 5, 4), ([False, True], 2, 2), ([True], 1, 1)]
)
def test_stop_is_asked_between_epochs_and_ends_the_training(
    answers: list[bool], epochs_run: int, asked: int
) -> None:
    """Asked after every epoch but the last (never before the first, so one epoch always runs)."""
    model = nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(8, 3), torch.randn(8, 1)
    questions = iter(answers)
    calls: list[int] = []

    def stop() -> bool:
        calls.append(1)
        return next(questions)

    losses = fit(
        lambda idx: nn.functional.mse_loss(model(x[idx]), y[idx]),
        opt,
        n=8,
        batch_size=4,
        epochs=5,
        generator=torch.Generator().manual_seed(0),
        device=torch.device("cpu"),
        stop=stop,
    )
    assert (len(losses), len(calls)) == (epochs_run, asked)


def test_logged_terms_get_a_curve_and_leave_the_steps_alone() -> None:
    """A logged term (a part of the loss to see apart) is averaged like the others but never stepped on:
    the weights and the loss curve are those of the loss alone."""
    x = torch.randn(9, 3, generator=torch.Generator().manual_seed(1))
    y = torch.randn(9, 1, generator=torch.Generator().manual_seed(2))
    runs = []
    for logged in (True, False):
        model = nn.Linear(3, 1)
        with torch.no_grad():
            model.weight.fill_(0.1)
            model.bias.zero_()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)

        def terms(
            idx: torch.Tensor, model: nn.Module = model, logged: bool = logged
        ) -> dict[str, torch.Tensor]:
            loss = nn.functional.mse_loss(model(x[idx]), y[idx])
            return {"loss": loss, "tripled": 3 * loss.detach()} if logged else {"loss": loss}

        history = fit_terms(
            terms, opt, n=9, batch_size=4, epochs=2, generator=torch.Generator().manual_seed(5),
            device=torch.device("cpu"), logged=("tripled",) if logged else (),
        )  # fmt: skip
        runs.append((history, model))
    (logged_history, logged_model), (plain_history, plain_model) = runs
    assert [e["loss"] for e in logged_history] == [e["loss"] for e in plain_history]
    # logging an extra term changes no training op: bitwise; the tripled value is one float32 product
    assert [e["tripled"] for e in logged_history] == pytest.approx([3 * e["loss"] for e in plain_history])
    assert torch.equal(logged_model.weight, plain_model.weight)


@pytest.mark.parametrize("logged", [("loss",), ("missing",)])
def test_logged_terms_must_be_some_of_the_terms(logged: tuple[str, ...]) -> None:
    w = nn.Parameter(torch.ones(1))
    with pytest.raises(ConfigError, match="logged must name terms of the loss"):
        fit_terms(
            lambda idx: {"loss": (w * idx.float()).sum()}, torch.optim.SGD([w], lr=0.1), n=4, batch_size=2,
            epochs=1, generator=torch.Generator(), device=torch.device("cpu"), logged=logged,
        )  # fmt: skip


def _five_steps(make: Callable[[Iterator[nn.Parameter]], torch.optim.Optimizer]) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.Linear(4 * 6 * 6, 3))
    opt = make(model.parameters())
    gen = torch.Generator().manual_seed(1)
    for _ in range(5):
        x, y = torch.randn(8, 1, 8, 8, generator=gen), torch.randint(0, 3, (8,), generator=gen)
        step(opt, nn.functional.cross_entropy(model(x), y))
    return [p.detach() for p in model.parameters()]


@pytest.mark.parametrize(
    ("ours", "loop", "setting", "tolerance"),
    [
        (
            lambda ps: adam(ps, lr=1e-2, weight_decay=1e-3, betas=(0.5, 0.9)),
            lambda ps: torch.optim.Adam(ps, lr=1e-2, weight_decay=1e-3, betas=(0.5, 0.9), foreach=False),
            "fused",
            {"rtol": 1e-4, "atol": 1e-5},  # float32 rounding apart: 0.1 % of one step at lr 1e-2
        ),
        (
            lambda ps: sgd(ps, lr=1e-2, momentum=0.9),
            lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, foreach=False),
            "foreach",
            {"rtol": 1e-6, "atol": 1e-7},
        ),
    ],
    ids=["adam", "sgd"],
)
def test_the_fast_update_lands_where_the_per_tensor_loop_does(ours, loop, setting, tolerance) -> None:
    """adam() and sgd() only switch torch's update to a faster form (a speed setting: fused, multi-tensor):
    five steps of a small conv net land where torch's per-tensor loop lands."""
    assert ours([torch.zeros(1, requires_grad=True)]).defaults[setting] is True
    for got, want in zip(_five_steps(ours), _five_steps(loop), strict=True):
        torch.testing.assert_close(got, want, **tolerance)
