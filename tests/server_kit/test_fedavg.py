"""FedAvg initialisation: weighted / uniform parameter means, BN buffers, heterogeneous federations."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from common.errors import ConfigError
from edge_sdk.models.arch import build_model
from export.bundle import Bundle
from server_kit.teachers.loading import Teacher
from server_kit.training.fedavg import average_state_dicts, fedavg_init

ARCH = "C4k3-P-F6-F3"
SHAPE = (1, 4, 4)


def _module(seed: int, arch: str = ARCH) -> nn.Module:
    """A chain model with random weights and BN statistics (as after training), frozen like a teacher."""
    gen = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = build_model(arch, SHAPE, 3)
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            if name.endswith("num_batches_tracked"):
                tensor.fill_(seed + 1)
            elif name.endswith("running_var"):
                tensor.copy_(torch.rand(tensor.shape, generator=gen) + 0.5)
            else:
                tensor.copy_(torch.randn(tensor.shape, generator=gen))
    return model.eval().requires_grad_(False)


def _teacher(seed: int, num_examples: int, arch: str = ARCH, kind: str = "classifier") -> Teacher:
    counts = (num_examples, 0, 0)
    bundle = Bundle(
        kind=kind,
        model_onnx=b"onnx",  # not read by fedavg_init
        arch=arch,
        num_classes=3,
        input_shape=SHAPE,
        label_counts=counts,
        num_examples=num_examples,
        profile={"name": "test"},
        metrics={},
        seed=seed,
        sdk_version="0",
        latent_dim=2 if kind == "cvae_decoder" else None,
    )
    return Teacher(path=None, bundle=bundle, module=_module(seed, arch))


def test_average_state_dicts_equals_the_manual_mean() -> None:
    states = [_module(s).state_dict() for s in (1, 2, 3)]
    weights = [1.0, 3.0, 6.0]
    out = average_state_dicts(states, weights)
    assert list(out) == list(states[0])
    for key, value in out.items():
        if key.endswith("num_batches_tracked"):
            assert int(value) == 4  # integer buffers take the maximum (seeds 1..3 -> 2..4)
            continue
        manual = (states[0][key] * 1 + states[1][key] * 3 + states[2][key] * 6) / 10
        # the mean is taken in float64; the manual side rounds four elementwise float32 ops (each exactly
        # rounded on every instruction set): a few ulps of |values| < 5, below 1e-6
        torch.testing.assert_close(value, manual, rtol=0, atol=1e-6)
        assert value.dtype == states[0][key].dtype
    uniform = average_state_dicts(states)
    key = "classifier.0.weight"
    torch.testing.assert_close(uniform[key], (states[0][key] + states[1][key] + states[2][key]) / 3)
    assert torch.equal(average_state_dicts(states[:1])[key], states[0][key])  # weight 1: float64 round trip


def test_average_state_dicts_rejects_mismatches() -> None:
    a, b = _module(1).state_dict(), _module(2, "C4k3-P-F5-F3").state_dict()
    with pytest.raises(ConfigError, match=r"classifier\.0\.weight"):
        average_state_dicts([a, b])
    with pytest.raises(ConfigError, match="other keys"):
        average_state_dicts([a, {k: v for k, v in a.items() if "running" not in k}])
    with pytest.raises(ConfigError, match="weights"):
        average_state_dicts([a, a], [1.0, -1.0])
    with pytest.raises(ConfigError, match="2 weights for 1"):
        average_state_dicts([a], [1.0, 1.0])
    with pytest.raises(ConfigError, match="at least one"):
        average_state_dicts([])


def test_fedavg_init_weights_by_examples_or_uniformly() -> None:
    teachers = [_teacher(1, 10), _teacher(2, 30)]
    before = [{k: v.clone() for k, v in t.module.state_dict().items()} for t in teachers]
    model = fedavg_init(teachers)
    assert model is not None and model is not teachers[0].module
    assert all(p.requires_grad for p in model.parameters())
    state = model.state_dict()
    for key in (
        "features.0.weight",
        "features.1.running_mean",
        "features.1.running_var",
        "classifier.3.bias",
    ):
        expected = 0.25 * before[0][key] + 0.75 * before[1][key]
        torch.testing.assert_close(
            state[key], expected, rtol=0, atol=1e-6
        )  # as above: float64 vs 3 roundings
    uniform = fedavg_init(teachers, weighting="uniform")
    assert uniform is not None
    key = "classifier.0.weight"
    torch.testing.assert_close(
        uniform.state_dict()[key], (before[0][key] + before[1][key]) / 2, rtol=0, atol=1e-6
    )
    for teacher, saved in zip(teachers, before, strict=True):  # teachers untouched
        for k, v in teacher.module.state_dict().items():
            assert torch.equal(v, saved[k]), k  # untouched: bitwise
    x = torch.rand(2, *SHAPE)
    assert model(x).shape == (2, 3)


def test_fedavg_init_returns_none_when_heterogeneous_or_empty() -> None:
    assert fedavg_init([]) is None
    assert fedavg_init([_teacher(1, 5), _teacher(2, 5, arch="C4k3-P-F5-F3")]) is None
    assert fedavg_init([_teacher(1, 5)]) is not None  # a single classifier is its own average
    fedov = _teacher(2, 5)
    fedov = dataclasses.replace(fedov, bundle=dataclasses.replace(fedov.bundle, unknown_output=True))
    assert fedavg_init([_teacher(1, 5), fedov]) is None  # an "unknown" row is no class of the task
    with pytest.raises(ConfigError, match="averages classifiers"):
        fedavg_init([_teacher(1, 5), _teacher(2, 5, kind="cvae_decoder")])
    with pytest.raises(ConfigError, match="weighting"):
        fedavg_init([_teacher(1, 5)], weighting="median")
