"""The architecture registry (edge_sdk.models.arch): a contract every registered family keeps, and the
dispatch."""

import json

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from common.errors import SpecError
from edge_sdk.models.arch import (
    DEFAULT_FAMILY,
    FAMILIES,
    analytic_cost,
    build_model,
    family_of,
    family_of_text,
    parse_arch,
    with_num_classes,
)
from edge_sdk.models.chain.spec import ChainSpec

SHAPE = (1, 8, 8)  # the smallest input every family accepts (the elastic space halves it three times)

# One small spec per family; the contract test below fails when a family is registered without one.
EXAMPLES = {
    "chain": "C4k3-P-F16-F10",
    "zoo": "zoo:mobilenetv2",
    "elastic": "mbv3:s16-16:k3e3-24:k3e3-32:k3e3.k3e3-64:k3e3.k3e3",
}


def test_every_family_has_an_example():
    assert set(EXAMPLES) == set(FAMILIES)


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_family_contract(name):
    family = FAMILIES[name]
    assert family.name == name
    spec = parse_arch(EXAMPLES[name])
    assert type(spec) is family.spec_type
    assert family_of(spec) is family
    assert family_of_text(EXAMPLES[name]) is family
    # string and JSON forms round-trip through the registry; the JSON kind is the family's name
    assert parse_arch(str(spec)) == spec
    assert parse_arch(spec.to_json()) == spec
    assert json.loads(spec.to_json())["kind"] == name
    if family.prefix is None:
        assert name == DEFAULT_FAMILY
    else:
        assert str(spec).startswith(family.prefix)
    # resized for a task, the built model has that many outputs behind model.head
    resized = with_num_classes(spec, 7)
    assert with_num_classes(resized, 7) == resized
    model = build_model(resized, SHAPE, 7).eval()
    x = torch.rand(2, *SHAPE)
    assert model(x).shape == (2, 7)
    assert model.head.out_features == 7
    # an analytic cost, where the family has one, is what the counter measures on the built model
    cost = analytic_cost(resized, SHAPE, 7)
    if cost is not None:
        with FlopCounterMode(display=False) as counter:
            model(x[:1])
        assert cost == (counter.get_total_flops(), sum(p.numel() for p in model.parameters()))


def test_only_a_chain_carries_its_head():
    chain = parse_arch(EXAMPLES["chain"])
    assert with_num_classes(chain, 3) == ChainSpec.parse("C4k3-P-F16-F3")
    for name in ("zoo", "elastic"):
        spec = parse_arch(EXAMPLES[name])
        assert with_num_classes(spec, 3) is spec


def test_prefixes_are_unambiguous():
    prefixes = [family.prefix for family in FAMILIES.values() if family.prefix is not None]
    assert len(prefixes) == len(FAMILIES) - 1  # every family but the default has one
    for a in prefixes:
        assert not any(b != a and b.startswith(a) for b in prefixes)


def test_unprefixed_strings_and_unknown_json_kinds_go_to_the_default_family():
    default = FAMILIES[DEFAULT_FAMILY]
    assert type(parse_arch("  C8k3-P-F10 ")) is default.spec_type
    assert family_of_text("resnet18") is default  # nothing is parsed
    layers = json.loads(parse_arch("C8k3-P-F10").to_json())["layers"]
    assert type(parse_arch(json.dumps({"layers": layers}))) is default.spec_type
    with pytest.raises(SpecError, match="cannot parse module"):
        parse_arch("resnet18")


def test_malformed_json_and_foreign_objects_are_refused():
    with pytest.raises(SpecError, match="architecture JSON does not parse"):
        parse_arch("{not json")
    with pytest.raises(SpecError, match="not an architecture spec"):
        family_of("C8k3-P-F10")  # a string, not a spec
    with pytest.raises(SpecError, match="not an architecture spec"):
        build_model(object(), SHAPE, 10)  # type: ignore[arg-type]
