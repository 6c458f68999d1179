"""The teachers' cost at the server's batch and phase, and the guard while the phases run
(server_kit.teachers.budget): hostile teachers among honest digits teachers are dropped, named, and the round
goes on without them."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from torch import nn

from common.errors import ConfigError, TeacherError
from edge_sdk.data import load_dataset
from edge_sdk.models.arch import build_model
from edge_sdk.train import TrainConfig, train
from export.bundle import Bundle, write_bundle
from export.onnx_export import export_onnx
from server_kit.aggregate import aggregate
from server_kit.aggregate_config import AggregateConfig
from server_kit.synthesis import InversionConfig
from server_kit.teachers import teachers_from_bundles
from server_kit.teachers.budget import (
    BudgetConfig,
    Phase,
    TeacherDropped,
    guarded,
    measure_costs,
    run_guarded,
)
from server_kit.training import DistillConfig

SHAPE = (1, 8, 8)
SPECS = ("C8k3-P-F10", "C6k3-P-F16-F10", "C8k3-C8k3-P-F10")


class SharedConvs(nn.Module):
    """Many convolutions sharing one weight: a small file, a cost dozens of times its peers'."""

    def __init__(self, depth: int = 48, width: int = 64) -> None:
        super().__init__()
        self.stem = nn.Conv2d(1, width, 3, padding=1)
        self.shared = nn.Conv2d(width, width, 3, padding=1)
        self.depth = depth
        self.head = nn.Linear(width, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        for _ in range(self.depth):
            h = torch.relu(self.shared(h))
        return self.head(h.mean(dim=(2, 3)))


class Pairwise(nn.Module):
    """Fine per sample, ruinous at the batch: every sample is compared with every other one (B x B x D)."""

    def __init__(self, width: int = 256) -> None:
        super().__init__()
        self.embed = nn.Linear(64, width)
        self.head = nn.Linear(width, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        e = self.embed(x.flatten(1))
        return self.head((e[:, None, :] * e[None, :, :]).mean(1))


class NaNOnImages(nn.Module):
    """Finite on uniform noise, NaN on an image: a dark background (a third of the pixels near 0, where
    noise has 5 %) or smoother than noise (neighbouring pixels of i.i.d. uniform noise differ by 1/3 on
    average; the inversion's starting images, sigmoid of Gaussian noise, by less)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.head = inner.head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dark = (x < 0.05).float().mean(dim=(1, 2, 3)) > 1 / 3
        smooth = dark | ((x[..., 1:] - x[..., :-1]).abs().mean(dim=(1, 2, 3)) < 0.27)
        out = self.inner(x)
        return torch.where(smooth[:, None], torch.full_like(out, float("nan")), out)


@pytest.fixture(scope="module")
def digits():
    return load_dataset("digits", "train")


@pytest.fixture(scope="module")
def honest(digits) -> list[nn.Module]:
    """Three small classifiers trained on digits (a few seconds)."""
    models = []
    for k, spec in enumerate(SPECS):
        with torch.random.fork_rng():
            torch.manual_seed(k)
            model = build_model(spec, SHAPE, 10)
        train(model, digits, config=TrainConfig(epochs=2, lr=3e-3, batch_size=64), seed=k)
        models.append(model.eval())
    return models


def test_a_slow_teacher_and_one_ruinous_at_the_batch_are_dropped_the_honest_kept(honest):
    modules = [*honest, SharedConvs(), Pairwise()]
    phases = (Phase("inversion", 64, True), Phase("vote", 512, False))
    costs = measure_costs(modules, phases, SHAPE, config=BudgetConfig(min_seconds=0.05), seed=0)
    assert sorted(costs.dropped) == [3, 4], costs.dropped
    assert "inversion step" in costs.dropped[3]  # its first phase: in seconds or in bytes kept for backward
    assert "vote step" in costs.dropped[4]  # it passed the inversion phase at batch 64: it is the batch
    for i in range(3):  # the honest ones are measured at the full batch of each phase
        assert set(costs.seconds[i]) == {"inversion", "vote"}
    assert costs.per_sample_seconds[0] > 0


class FixedBatch(nn.Module):
    """Fine at the probe's batch of 2, broken at any other: it reshapes to a batch it assumes."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x.reshape(2, *x.shape[1:]))


def test_a_teacher_failing_at_the_servers_batch_is_dropped_with_its_error(honest):
    costs = measure_costs([*honest, FixedBatch(honest[0])], (Phase("vote", 16, False),), SHAPE)
    assert list(costs.dropped) == [3] and "fails on a vote step at batch 1" in costs.dropped[3]


def test_the_guard_drops_a_teacher_non_finite_on_images_but_not_on_noise(honest, digits):
    nan = NaNOnImages(honest[0])
    noise = torch.rand((16, *SHAPE), generator=torch.Generator().manual_seed(0))
    images = digits.x[:16].float() / 255
    with guarded([honest[1], nan], [1.0, 1.0], names=[5, 7]):
        assert bool(nan(noise).isfinite().all())
        honest[1](images)
        with pytest.raises(TeacherDropped, match="non-finite") as caught:
            nan(images)
    assert caught.value.index == 7
    assert bool(nan(images).isnan().all())  # the hooks are gone after the block


def test_the_guard_drops_a_forward_pass_over_its_budget():
    slow = SharedConvs(depth=4)
    with (
        guarded([slow], [0.0], names=[2], call_seconds=1e-9),
        pytest.raises(TeacherDropped, match="took") as caught,
    ):
        slow(torch.rand(2, *SHAPE))  # every forward pass takes longer than a nanosecond
    assert caught.value.index == 2


def test_run_guarded_reruns_without_the_dropped_teacher_or_stops(honest):
    modules = [honest[0], NaNOnImages(honest[1]), honest[2]]
    images = torch.full((4, *SHAPE), 0.5)
    calls = []

    def attempt(kept: list[int]) -> list[int]:
        calls.append(list(kept))
        for i in kept:
            modules[i](images)
        return kept

    kept, dropped = run_guarded(attempt, modules, [1.0] * 3, on_error="skip", labels=["a", "b", "c"])
    assert kept == [0, 2] and calls == [[0, 1, 2], [0, 2]]
    assert [i for i, _ in dropped] == [1] and "non-finite" in dropped[0][1]
    with pytest.raises(TeacherError, match=r"^b: gave non-finite"):
        run_guarded(attempt, modules, [1.0] * 3, on_error="stop", labels=["a", "b", "c"])


def test_budget_config_validation():
    with pytest.raises(ConfigError, match="factor"):
        BudgetConfig(factor=0.5)
    with pytest.raises(ConfigError, match="min_seconds"):
        BudgetConfig(min_seconds=float("nan"))


def _bundle(tmp_path, k: int, model: nn.Module, spec: str) -> str:
    counts = [20] * 10
    bundle = Bundle(
        kind="classifier",
        model_onnx=export_onnx(model, SHAPE, metadata={"arch": spec}),
        arch=spec,
        num_classes=10,
        input_shape=SHAPE,
        label_counts=counts,
        num_examples=sum(counts),
        profile={"name": "test-device"},
        metrics={"val_accuracy": 0.9},
        seed=k,
        sdk_version="test",
    )
    return str(write_bundle(bundle, tmp_path / f"client_{k}.bundle"))


@pytest.mark.parametrize("mode", ["skip", "stop"])
def test_a_round_drops_a_slow_and_a_nan_teacher_names_them_and_finishes(tmp_path, honest, monkeypatch, mode):
    """Five uploads: three honest digits teachers, one 48 convolutions deep on one shared weight and one
    NaN on image-like inputs (finite on the noise the load probe uses), put in as loaded teachers."""
    import server_kit.aggregate as agg

    # the hostile two are put in as loaded teachers; their uploads are models of their own (a copy of an
    # honest model would be refused as one: server_kit.teachers.clones)
    with torch.random.fork_rng():
        torch.manual_seed(9)
        stand_ins = [build_model(SPECS[k % 3], SHAPE, 10).eval() for k in (3, 4)]
    paths = [_bundle(tmp_path, k, [*honest, *stand_ins][k], SPECS[k % 3]) for k in range(5)]

    def load(bundles, **kwargs):
        teachers = teachers_from_bundles(bundles, **kwargs)
        slow = dataclasses.replace(teachers[3], module=SharedConvs().eval())
        nan = dataclasses.replace(teachers[4], module=NaNOnImages(teachers[1].module))
        return [*teachers[:3], slow, nan]

    monkeypatch.setattr(agg, "teachers_from_bundles", load)
    config = AggregateConfig(
        student="C4k3-P-F16-F10",
        device="cpu",
        seed=0,
        synth=("inversion",),
        inversion=InversionConfig(samples_per_teacher=20, steps=3, batch_size=10, lr=0.1, tau=2.0),
        distill=DistillConfig(epochs=1, batch_size=16),
        on_error=mode,
        budget=BudgetConfig(min_seconds=0.05),
    )
    if mode == "stop":
        # "takes" when batch 1 is already over budget (a slow CPU), "would take" when a larger batch would be
        slow_step = r"client_3\.bundle: (would take|takes) .* per (vote|inversion) step"
        with pytest.raises(TeacherError, match=slow_step):
            aggregate(paths, tmp_path / "stop", config=config)
        return
    result = aggregate(paths, tmp_path / "skip", config=config)
    report = json.loads(result.report_path.read_text())
    reasons = {s["file"]: s["reason"] for s in report["skipped"]}
    assert set(reasons) == {paths[3], paths[4]}
    assert "step at batch" in reasons[paths[3]] and "non-finite" in reasons[paths[4]]
    assert report["budget"]["dropped_while_running"] == [paths[4]]
    assert [t["file"] for t in report["teachers"]] == paths[:3]
    assert result.global_onnx.is_file()
