"""Contract tests over every zoo model and the random pool."""

from __future__ import annotations

import io
import warnings

import numpy as np
import onnxruntime as ort
import pytest
import torch
from torch import nn

from common.errors import SpecError
from edge_sdk.models.arch import build_model, parse_arch
from edge_sdk.models.chain.spec import ChainSpec
from edge_sdk.models.zoo import CNN1, CNN2, RANDOM_POOL, ZOO, ZooSpec, _halvings, build_zoo_model

SHAPES = [(1, 28, 28), (3, 32, 32), (1, 8, 8)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("name", sorted(ZOO))
def test_builds_with_head_and_logits(name: str, shape: tuple[int, int, int]) -> None:
    model = build_zoo_model(name, shape, 7)
    assert isinstance(model.head, nn.Linear)
    assert model.head.out_features == 7
    x = torch.rand(3, *shape, generator=torch.Generator().manual_seed(0))
    model.train()
    assert model(x).shape == (3, 7)
    model.eval()
    out = model(x)
    assert out.shape == (3, 7)
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("name", sorted(ZOO))
def test_normalises_inside(name: str) -> None:
    model = build_zoo_model(name, (1, 8, 8), 4).eval()
    seen: list[torch.Tensor] = []
    model.features.register_forward_pre_hook(lambda _m, args: seen.append(args[0].clone()))
    x = torch.rand(2, 1, 8, 8, generator=torch.Generator().manual_seed(1))
    model(x)
    torch.testing.assert_close(seen[0], (x - 0.5) / 0.5)  # one or two float32 roundings of values in [-1, 1]


def test_downsampling_follows_input_size() -> None:
    # ceil halving (strided 3x3 convs) down to >= 4: 32 -> 16 -> 8 -> 4; 28 -> 14 -> 7 -> 4; 8 -> 4
    assert [_halvings(s, 4, ceil=True) for s in (32, 28, 8, 4, 3)] == [3, 3, 1, 0, 0]
    # floor halving (2x2 max pool) down to >= 1: 32 -> 1 in 5; 28 -> 14 -> 7 -> 3 -> 1; 8 -> 1 in 3
    assert [_halvings(s, 1, ceil=False) for s in (32, 28, 8, 1)] == [5, 4, 3, 0]
    vgg = build_zoo_model("vgg11", (1, 28, 28), 10)
    assert sum(isinstance(m, nn.MaxPool2d) for m in vgg.modules()) == 4
    maps: list[tuple[int, ...]] = []
    resnet = build_zoo_model("resnet18", (3, 32, 32), 10).eval()
    resnet.features.register_forward_hook(lambda _m, _i, out: maps.append(tuple(out.shape)))
    resnet(torch.rand(1, 3, 32, 32))
    assert maps == [(1, 512, 4, 4)]  # the CIFAR ResNet18 layout


@pytest.mark.parametrize("name", sorted(ZOO))
def test_onnx_export_matches_with_another_batch_size(name: str) -> None:
    """No data-dependent control flow: a traced export runs at another batch size with the same numbers."""
    model = build_zoo_model(name, (1, 8, 8), 5).eval()
    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            model,
            (torch.rand(2, 1, 8, 8),),
            buffer,
            dynamo=False,
            input_names=["x"],
            output_names=["logits"],
            dynamic_axes={"x": {0: "n"}, "logits": {0: "n"}},
        )
    session = ort.InferenceSession(buffer.getvalue(), providers=["CPUExecutionProvider"])
    x = torch.rand(5, 1, 8, 8, generator=torch.Generator().manual_seed(2))
    got = session.run(None, {"x": x.numpy()})[0]
    with torch.inference_mode():
        want = model(x).numpy()
    # onnxruntime vs torch on logits after deep sums: summation order costs ~1e-6 relative, 1e-4 covers it
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_zoo_spec_round_trip() -> None:
    spec = parse_arch("zoo:resnet18")
    assert spec == ZooSpec("resnet18")
    assert str(spec) == "zoo:resnet18"
    assert parse_arch(spec.to_json()) == spec
    model = build_model("zoo:resnet18", (1, 8, 8), 3)
    assert model.head.out_features == 3


def test_unknown_zoo_model() -> None:
    with pytest.raises(SpecError, match="unknown zoo model 'resnet50'"):
        build_zoo_model("resnet50", (1, 8, 8), 10)
    with pytest.raises(SpecError, match="unknown zoo model"):
        parse_arch("zoo:resnet50")


def test_random_pool() -> None:
    assert RANDOM_POOL == (
        "C32k5-P-C64k5-P-F10",
        "C32k3-C32k3-P-C64k3-C64k3-P-F256-F10",
        "zoo:mobilenetv2",
        "zoo:vgg11",
        "zoo:resnet18",
    )
    assert isinstance(CNN1, ChainSpec) and isinstance(CNN2, ChainSpec)
    for text in RANDOM_POOL:
        spec = parse_arch(text).validate((1, 28, 28))
        assert str(spec) == text
    # CNN2's 256-unit hidden layer sees 64 x 7 x 7 features on MNIST: 3136 * 256 + 256 weights and biases
    _, params = CNN2.cost((1, 28, 28))
    convs = (32 * 9 + 64) + (32 * 32 * 9 + 64) + (64 * 32 * 9 + 128) + (64 * 64 * 9 + 128)  # + BN affine
    assert params == convs + (3136 * 256 + 256) + (256 * 10 + 10)
