"""FedOV's local outliers and the "unknown" output they train (edge_sdk.outliers, train, client)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from common.errors import ConfigError
from edge_sdk.artifacts import bundle_model, load_trained_model, save_trained_model
from edge_sdk.client import ClientConfig
from edge_sdk.data import load_dataset, split_train_val
from edge_sdk.final_training import train_final
from edge_sdk.outliers import make_outliers
from edge_sdk.strategies.evolution import EvolutionConfig
from export.bundle import read_bundle
from profiles import load_profile


def _images(n: int) -> torch.Tensor:
    return torch.rand((n, 1, 8, 8), generator=torch.Generator().manual_seed(0))


def test_outliers_shuffle_tiles_and_blend_only_two_classes() -> None:
    x, y = _images(6), torch.tensor([0, 0, 0, 1, 1, 1])
    out = make_outliers(x, y, 8, torch.Generator().manual_seed(1))
    again = make_outliers(x, y, 8, torch.Generator().manual_seed(1))
    assert out.shape == (8, 1, 8, 8) and torch.equal(out, again)  # seeded
    # a shuffled image holds the same pixels as one batch image (a permutation: exact), a blend the mean of
    # two of different classes (one or two roundings, within allclose's defaults)
    shuffled = [
        any(torch.equal(o.flatten().sort().values, s.flatten().sort().values) for s in x) for o in out
    ]
    blends = {(i, j) for i in range(6) for j in range(6) if y[i] != y[j]}
    blended = [any(torch.allclose(o, 0.5 * (x[i] + x[j])) for i, j in blends) for o in out]
    assert all(a or b for a, b in zip(shuffled, blended, strict=True)) and any(blended[:4])
    assert not any(torch.equal(o, s) for o in out for s in x)  # never an image as it was
    one_class = make_outliers(x, torch.zeros(6, dtype=torch.long), 8, torch.Generator().manual_seed(1))
    assert all(  # one class: nothing to blend, every outlier is a shuffle
        any(torch.equal(o.flatten().sort().values, s.flatten().sort().values) for s in x) for o in one_class
    )
    with pytest.raises(ConfigError, match="too small"):
        make_outliers(torch.rand(2, 1, 3, 3), torch.tensor([0, 1]), 2, torch.Generator())


def test_unknown_output_goes_from_training_to_a_teacher_that_abstains(tmp_path: Path) -> None:
    from server_kit.teachers.abstain import Abstaining, own_probability
    from server_kit.teachers.loading import classifier_weight, load_teacher

    data = load_dataset("digits").subset(np.arange(300))
    train_split, val_split = split_train_val(data, val_fraction=0.2, seed=0)
    trained = train_final("C8k3-P-F16-F10", train_split, val_split, epochs=2, seed=0, unknown_output=True)
    assert trained.unknown_output and trained.module(torch.rand(2, 1, 8, 8)).shape == (2, 11)
    again = train_final("C8k3-P-F16-F10", train_split, val_split, epochs=2, seed=0, unknown_output=True)
    assert all(
        torch.equal(a, b)
        for a, b in zip(trained.module.state_dict().values(), again.module.state_dict().values(), strict=True)
    )
    # edge-sdk train -> export keeps the flag through the model file
    reloaded, onnx_bytes = load_trained_model(save_trained_model(trained, tmp_path / "m.onnx"))
    assert reloaded.unknown_output and reloaded.num_classes == 10
    bundle = bundle_model(
        reloaded, load_profile("laptop-cpu"), tmp_path / "c.bundle", seed=0, onnx_bytes=onnx_bytes
    )
    back = read_bundle(tmp_path / "c.bundle")
    assert back == bundle and back.unknown_output and back.num_classes == 10 and back.num_outputs == 11
    teacher = load_teacher(back)  # the ONNX is checked for 11 outputs, parity with onnxruntime on 11
    assert isinstance(teacher.module, Abstaining)
    x = torch.rand(5, 1, 8, 8)
    logits, own = own_probability(teacher.module, x)
    assert teacher.module(x).shape == logits.shape == (5, 10) and own.shape == (5,)
    assert ((own >= 0) & (own <= 1)).all()
    assert classifier_weight(teacher.module).shape == (10, 16)  # the "unknown" row left out
    # an old bundle (no unknown output) loads as a plain teacher
    plain = train_final("C8k3-P-F16-F10", train_split, val_split, epochs=1, seed=0)
    old = bundle_model(plain, load_profile("laptop-cpu"), tmp_path / "old.bundle", seed=0)
    assert not old.unknown_output and not isinstance(load_teacher(old).module, Abstaining)
    assert own_probability(load_teacher(old).module, x)[1] is None


def test_unknown_output_is_refused_where_it_cannot_apply() -> None:
    with pytest.raises(ConfigError, match="role 'cvae'"):
        ClientConfig(role="cvae", unknown_output=True)
    with pytest.raises(ConfigError, match="supernet"):
        ClientConfig(search=EvolutionConfig(supernet="s.pt"), unknown_output=True)
    assert ClientConfig(unknown_output=True).to_dict()["unknown_output"] is True
    assert "unknown_output" not in ClientConfig().to_dict()  # older client reports still match a resume


def test_cli_train_and_export_carry_the_unknown_output(tmp_path: Path, capsys) -> None:
    from edge_sdk.cli import main
    from edge_sdk.data import save_client_data

    data = save_client_data(tmp_path / "d.npz", load_dataset("digits").subset(np.arange(120)))
    model, bundle = tmp_path / "m.onnx", tmp_path / "c.bundle"
    argv = ["train", "--data", str(data), "--arch", "C4k3-P-F10", "--train-epochs", "1", "--quiet"]
    assert main([*argv, "--out", str(model), "--unknown-output"]) == 0
    assert main(["export", "--model", str(model), "--profile", "laptop-cpu", "--out", str(bundle)]) == 0
    assert read_bundle(bundle).unknown_output and read_bundle(bundle).num_outputs == 11
    assert main([*argv, "--out", str(tmp_path / "plain.onnx")]) == 0
    assert not load_trained_model(tmp_path / "plain.onnx")[0].unknown_output
