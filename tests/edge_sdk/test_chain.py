"""Chain family (edge_sdk.models.chain): string/JSON round trips, validation rules, builder, analytic
cost."""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from common.errors import SpecError
from edge_sdk.models.arch import build_model, parse_arch
from edge_sdk.models.chain.spec import (
    MAX_CHANNELS,
    MAX_DEPTH,
    MAX_KERNEL,
    MAX_UNITS,
    ChainSpec,
    Conv,
    Dense,
    Pool,
    Residual,
)

MIN_SPEC = "C1k1-F4-F10"
MAX_SPEC = "-".join(
    [f"C{MAX_CHANNELS}k{MAX_KERNEL}"] * 2
    + ["P", "Pavg"]
    + [f"C{MAX_CHANNELS}k3"] * 13
    + [f"F{MAX_UNITS}", "F10"]
)


RESIDUAL_SPEC = "C16k3-R16k3-P-R32k5-Pavg-R32k1-F64-F10"  # identity and projection shortcuts


@pytest.mark.parametrize(
    "text", ["C32k3-P-C64k5-P-F128-F10", "C8k1-Pavg-F10", MIN_SPEC, MAX_SPEC, RESIDUAL_SPEC]
)
def test_string_and_json_round_trip(text):
    spec = ChainSpec.parse(text)
    assert str(spec) == text
    assert ChainSpec.from_json(spec.to_json()) == spec
    assert parse_arch(spec.to_json()) == spec
    assert parse_arch(text) == spec
    assert hash(spec) == hash(ChainSpec.parse(text))


def test_pmax_alias_renders_as_p():
    assert str(ChainSpec.parse("C8k3-Pmax-F10")) == "C8k3-P-F10"


def test_parsed_modules():
    spec = ChainSpec.parse("C32k3-Pavg-F128-F10")
    assert spec.layers == (Conv(32, 3), Pool("avg"), Dense(128), Dense(10))
    assert ChainSpec.parse("C8k3-R16k5-F10").layers == (Conv(8, 3), Residual(16, 5), Dense(10))


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("P-C8k3-F10", "first module must be C"),
        ("R8k3-P-F10", "first module must be C"),
        ("C8k3-F20-R8k3-F10", "before the first F"),
        (f"C8k3-R{MAX_CHANNELS + 1}k3-F10", "channels"),
        ("C8k3-R8k4-F10", "kernel"),
        ("C8k3-P-C8k3", "last module must be F"),
        ("C8k3-F10", "depth must be"),
        ("C8k3-F20-C8k3-F10", "before the first F"),
        (f"C{MAX_CHANNELS + 1}k3-P-F10", "channels"),
        ("C8k9-P-F10", "kernel"),
        ("C8k4-P-F10", "kernel"),
        (f"C8k3-F{MAX_UNITS + 1}-F10", "hidden units"),
        ("-".join(["C8k3"] * MAX_DEPTH + ["F10"]), "depth must be"),
    ],
)
def test_invalid_specs_are_refused(text, match):
    with pytest.raises(SpecError, match=match):
        ChainSpec.parse(text).validate((1, 28, 28))


def test_pooling_below_one_pixel_is_invalid():
    ChainSpec.parse("C8k3-P-P-P-F10").validate((1, 8, 8))  # 8 -> 4 -> 2 -> 1
    with pytest.raises(SpecError, match="below 1x1"):
        ChainSpec.parse("C8k3-P-P-P-P-F10").validate((1, 8, 8))


@pytest.mark.parametrize("bad", ["", "C8-F10", "X3", "C8k3--F10", "F"])
def test_unparseable_strings(bad):
    with pytest.raises(SpecError):
        ChainSpec.parse(bad)


def test_unknown_zoo_model():
    with pytest.raises(SpecError, match="unknown zoo model"):
        parse_arch("zoo:alexnet-xl")


@pytest.mark.parametrize("text", [MIN_SPEC, "C32k3-P-C64k5-Pavg-F128-F10", MAX_SPEC, RESIDUAL_SPEC])
@pytest.mark.parametrize("shape", [(1, 28, 28), (3, 32, 32), (1, 8, 8)])
def test_builder_output_and_cost_match_flop_counter(text, shape):
    spec = ChainSpec.parse(text)
    if spec.problems(shape):
        pytest.skip("spec pools below 1x1 on this input")
    model = build_model(spec, shape, 7).eval()
    x = torch.rand(2, *shape)
    assert model(x).shape == (2, 7)
    assert model.head.out_features == 7
    with FlopCounterMode(display=False) as counter:
        model(x[:1])
    flops, params = spec.with_num_classes(7).cost(shape)
    assert flops == counter.get_total_flops()
    assert params == sum(p.numel() for p in model.parameters())


def test_cost_by_hand():
    # C4k3 on 1x8x8: 8*8*4*1*9 = 2304 MACs, params 4*9 + 2*4 (BN) = 44
    # P: 8x8 -> 4x4; F3 head: 4*4*4 = 64 inputs -> 3: 192 MACs, 195 params
    flops, params = ChainSpec.parse("C4k3-P-F3").cost((1, 8, 8))
    assert flops == 2 * (2304 + 192)
    assert params == 44 + 195


def test_builder_resizes_head_and_normalises_inside():
    model = build_model("C4k3-P-F10", (1, 8, 8), 3).eval()
    assert model.spec.num_classes == 3
    # inputs are pixels in [0, 1]; the model subtracts 0.5 / divides by 0.5 itself
    zeros = model(torch.zeros(1, 1, 8, 8))
    with torch.no_grad():
        manual = model.classifier(torch.flatten(model.features(torch.full((1, 1, 8, 8), -1.0)), 1))
    torch.testing.assert_close(zeros, manual)  # (0 - 0.5) / 0.5 = -1 exactly; the same layers after it
