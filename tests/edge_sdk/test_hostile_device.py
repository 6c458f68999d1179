"""Issue #34, classes 1 and 4 on the device: architecture strings and JSON, shared initial weights'
metadata, a Flower task's fields and the client settings are bounded before use; each refusal is the
toolkit's own error, never a builtin one (ValueError from int(), KeyError, TypeError, RecursionError)."""

import json
import math

import onnx
import pytest
from flwr.app import ConfigRecord, RecordDict

from common.errors import BundleError, ConfigError, SpecError
from edge_sdk.client import ClientConfig
from edge_sdk.cvae import build_cvae, parse_cvae_arch
from edge_sdk.flower_client import FlowerTask
from edge_sdk.models.arch import parse_arch
from edge_sdk.shared_init import initial_weights, read_initial_weights
from profiles import load_profile, profile_to_toml

DEEP = "[" * 5000 + "]" * 5000


@pytest.mark.parametrize(
    "text",
    [
        "C" + "9" * 5000 + "k3-P-F10",
        "C4k3-P-F1000000000",
        "mbv3:s" + "1" * 4500 + "-16:k3e3",
        '{"kind": "unknown"}',
        '{"kind": ["chain"]}',
        '{"kind": "elastic"}',
        '{"kind": "chain", "layers": 5}',
        '{"kind": "chain", "layers": [' + "1" * 5000 + "]}",
        '{"kind": "zoo", "name": NaN}',
        DEEP,
        "{" + DEEP,
        "C4k3-" * 20_000 + "F10",
    ],
)
def test_hostile_architectures_raise_spec_error(text):
    with pytest.raises(SpecError):
        parse_arch(text)


def test_hostile_cvae_arch_raises_spec_error():
    with pytest.raises(SpecError):
        parse_cvae_arch("cvae-small-z" + "7" * 5000)
    with pytest.raises(SpecError):
        build_cvae("cvae-small-z" + "7" * 5000, (1, 8, 8), 10)


@pytest.mark.parametrize("seed", [math.nan, -1, True, 1.5, "3", 2**64])
def test_client_config_refuses_a_seed_that_is_not_a_64_bit_count(seed):
    with pytest.raises(ConfigError, match="seed"):
        ClientConfig(seed=seed)


@pytest.mark.parametrize(("field", "value"), [("device", 5), ("progress", "yes"), ("val_fraction", "0.2")])
def test_client_config_refuses_wrong_types(field, value):
    with pytest.raises(ConfigError, match=field):
        ClientConfig(**{field: value})


def _task(**fields: str) -> RecordDict:
    base = {
        "client-config": json.dumps({"seed": 1}),
        "profile": profile_to_toml(load_profile("laptop-cpu")),
        "partition": json.dumps(
            {"dataset": "digits", "num_clients": 2, "alpha": 0.5, "seed": 0, "min_size": 1}
        ),
        "data-root": "",
    }
    return RecordDict({"task": ConfigRecord({**base, **fields})})


def test_the_honest_task_is_read():
    assert FlowerTask.from_content(_task()).client.seed == 1


@pytest.mark.parametrize(
    ("fields", "error"),
    [
        ({"client-config": DEEP}, BundleError),
        ({"client-config": '{"seed": ' + "9" * 5000 + "}"}, BundleError),
        ({"client-config": '{"seed": NaN}'}, BundleError),
        ({"client-config": '{"seed": -1}'}, ConfigError),
        ({"client-config": '{"seed": true}'}, ConfigError),
        ({"client-config": "[1]"}, ConfigError),
        ({"partition": '{"dataset": ' + DEEP + "}"}, BundleError),
        ({"profile": "x = " + DEEP}, BundleError),
        ({"profile": "memory_mb = " + "9" * 5000}, BundleError),
    ],
)
def test_hostile_task_fields_are_refused(fields, error):
    with pytest.raises(error):
        FlowerTask.from_content(_task(**fields))


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("input_shape", DEEP),
        ("input_shape", "[1, 8, " + "8" * 5000 + "]"),
        ("seed", "9" * 5000),
        ("seed", "-1"),
    ],
)
def test_hostile_initial_weights_metadata_is_refused(key, value):
    model = onnx.load_from_string(initial_weights("C4k3-P-F10", (1, 8, 8), 10, seed=0))
    for prop in model.metadata_props:
        if prop.key == key:
            prop.value = value
    with pytest.raises(ConfigError):
        read_initial_weights(model.SerializeToString(), input_shape=(1, 8, 8), num_classes=10)
