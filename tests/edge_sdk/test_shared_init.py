"""Shared initial weights: the server's file, the device's checks, FedAvg of clients that started there."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from common.errors import BudgetError, ConfigError, ExportError
from common.seeding import seeded
from edge_sdk.artifacts import save_trained_model
from edge_sdk.client import ClientConfig, run_client
from edge_sdk.data import load_dataset, split_train_val
from edge_sdk.final_training import train_final
from edge_sdk.models.arch import build_model
from edge_sdk.shared_init import initial_weights, read_initial_weights
from edge_sdk.strategies.baselines import FixedConfig
from export.bundle import read_bundle
from profiles import load_profile
from server_kit.evaluate import evaluate_module
from server_kit.teachers.loading import load_teachers
from server_kit.training.fedavg import fedavg_init

ARCH = "C8k3-P-C16k3-P-F10"
SHAPE = (1, 8, 8)  # scikit-learn digits


def _write(tmp_path: Path, arch: str = ARCH, classes: int = 10, seed: int = 7) -> Path:
    path = tmp_path / f"init_{seed}.onnx"
    path.write_bytes(initial_weights(arch, SHAPE, classes, seed=seed))
    return path


def test_the_file_holds_the_seeded_weights_and_is_reproducible(tmp_path: Path) -> None:
    data = initial_weights("C8k3-P-C16k3-P-F4", SHAPE, 10, seed=7)  # the head is resized to the task
    assert data == initial_weights("C8k3-P-C16k3-P-F4", SHAPE, 10, seed=7)
    assert data != initial_weights("C8k3-P-C16k3-P-F4", SHAPE, 10, seed=8)
    got = read_initial_weights(data, input_shape=SHAPE, num_classes=10)
    assert got.arch == ARCH and got.seed == 7
    with seeded(7):
        want = build_model(ARCH, SHAPE, 10).state_dict()
    for key, value in got.module.state_dict().items():
        torch.testing.assert_close(value, want[key], rtol=0, atol=0)  # rebuilt from the seed: exact


def test_a_file_for_another_task_or_no_init_file_is_refused(tmp_path: Path) -> None:
    path = _write(tmp_path)
    with pytest.raises(ExportError):  # the ONNX contract, against this task's 12 classes
        read_initial_weights(path, input_shape=SHAPE, num_classes=12)
    with pytest.raises(ExportError):  # and its input shape
        read_initial_weights(path, input_shape=(1, 9, 9), num_classes=10)
    digits = load_dataset("digits").subset(np.arange(200))
    train_split, val_split = split_train_val(digits, val_fraction=0.2, seed=0)
    trained = train_final(ARCH, train_split, val_split, epochs=1, seed=0)
    model_file = save_trained_model(trained, tmp_path / "trained.onnx")  # a model file, not an init file
    with pytest.raises(ConfigError, match="not an initial-weights file"):
        read_initial_weights(model_file, input_shape=SHAPE, num_classes=10)


def test_init_is_refused_with_a_searching_strategy_or_role_cvae(tmp_path: Path) -> None:
    path = str(_write(tmp_path))
    with pytest.raises(ConfigError, match="fix the architecture"):
        ClientConfig(init=path)  # strategy pso
    with pytest.raises(ConfigError, match="role 'cvae'"):
        ClientConfig(init=path, role="cvae", search=FixedConfig(fixed_arch=ARCH))


def test_mismatched_architecture_or_budget_is_refused(tmp_path: Path) -> None:
    digits = load_dataset("digits").subset(np.arange(300))
    path = str(_write(tmp_path))
    other = FixedConfig(fixed_arch="C16k3-P-F10", final_epochs=1)
    config = ClientConfig(init=path, role="classifier", search=other)
    with pytest.raises(ConfigError, match="configured architecture is C16k3-P-F10"):
        run_client(digits, profile=load_profile("laptop-cpu"), config=config, out=tmp_path / "a.bundle")
    same = FixedConfig(fixed_arch=ARCH, final_epochs=1)
    config = ClientConfig(init=path, role="classifier", search=same)
    tiny = load_profile("laptop-cpu")
    tiny = dataclasses.replace(tiny, max_params=100)
    with pytest.raises(BudgetError, match="does not fit the device"):
        run_client(digits, profile=tiny, config=config, out=tmp_path / "b.bundle")


def _client(tmp_path: Path, name: str, data, init: Path | None, seed: int) -> Path:
    search = FixedConfig(fixed_arch=ARCH, final_epochs=10)
    config = ClientConfig(
        search=search, seed=seed, role="classifier", init=None if init is None else str(init)
    )
    out = tmp_path / f"{name}.bundle"
    run_client(data, profile=load_profile("laptop-cpu"), config=config, out=out)
    return out


def test_clients_from_one_init_average_into_a_working_model(tmp_path: Path) -> None:
    digits = load_dataset("digits")
    order = np.random.default_rng(0).permutation(len(digits))
    test = digits.subset(order[:400])
    halves = [digits.subset(order[400:1100]), digits.subset(order[1100:1797])]
    init = _write(tmp_path, seed=3)
    shared = [_client(tmp_path, f"shared{k}", halves[k], init, seed=k) for k in range(2)]
    report = json.loads(Path(f"{shared[0]}.report.json").read_text())
    assert report["init"]["seed"] == 3 and report["search"]["candidate_epochs"] == 0
    assert read_bundle(shared[0]).arch == ARCH

    teachers, _ = load_teachers(shared)
    average = fedavg_init(teachers, weighting="uniform")
    assert average is not None
    states = [t.module.state_dict() for t in teachers]
    for key, value in average.state_dict().items():  # FedAvg is the elementwise mean of the two uploads
        if value.is_floating_point():
            torch.testing.assert_close(value, (states[0][key] + states[1][key]) / 2)  # two roundings
    shared_accuracy = evaluate_module(average, test)["accuracy"]

    alone = [_client(tmp_path, f"alone{k}", halves[k], None, seed=k) for k in range(2)]
    unrelated = fedavg_init(load_teachers(alone)[0], weighting="uniform")
    assert unrelated is not None
    # averaging models that started apart averages unrelated features: that is what the init is for
    assert shared_accuracy > 0.7 and shared_accuracy > evaluate_module(unrelated, test)["accuracy"] + 0.3
