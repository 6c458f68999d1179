"""The personalization package: round trip, determinism, and refusals (tampering, other client, schema)."""

import hashlib

import msgpack
import numpy as np
import pytest

from export.package import Package, package_from_bytes, package_to_bytes, read_package, write_package
from profiles.errors import BundleError

OWN_MODEL = b"the client's onnx bytes"


def make(**overrides) -> Package:
    rng = np.random.default_rng(0)
    base = dict(
        client="client_00",
        client_sha256=hashlib.sha256(OWN_MODEL).hexdigest(),
        global_onnx=b"global-onnx",
        global_arch="C4k3-P-F3",
        num_classes=3,
        input_shape=(1, 8, 8),
        inputs=rng.integers(0, 256, (5, 1, 8, 8), dtype=np.uint8),
        knowledge=rng.standard_normal((5, 3)).astype(np.float32),
        generator_onnx=None,
        knobs={"mu": 0.6, "epochs": 5},
        seed=0,
    )
    return Package(**{**base, **overrides})


def test_round_trip_and_determinism(tmp_path):
    package = make(generator_onnx=b"gen")
    data = package_to_bytes(package)
    assert package_to_bytes(make(generator_onnx=b"gen")) == data
    back = read_package(write_package(package, tmp_path / "c.package"))
    assert back.client == "client_00" and back.input_shape == (1, 8, 8) and back.generator_onnx == b"gen"
    np.testing.assert_array_equal(back.inputs, package.inputs)
    np.testing.assert_array_equal(back.knowledge, package.knowledge)
    assert back.knobs == {"epochs": 5, "mu": 0.6}


def test_a_package_for_another_client_is_refused():
    make().check_for(OWN_MODEL)  # its own client: accepted
    with pytest.raises(BundleError, match="made for 'client_00'"):
        make().check_for(b"another client's model")


def test_a_flipped_byte_is_refused():
    data = bytearray(package_to_bytes(make()))
    obj = msgpack.unpackb(bytes(data), raw=False)
    obj["knowledge"]["data"] = bytes([obj["knowledge"]["data"][0] ^ 1]) + obj["knowledge"]["data"][1:]
    with pytest.raises(BundleError, match="sha256 mismatch"):
        package_from_bytes(msgpack.packb(obj, use_bin_type=True))


@pytest.mark.parametrize("data", [b"", b"\x93\x01\x02", b"not msgpack at all \xc1"])
def test_garbage_and_truncation_are_refused(data):
    with pytest.raises(BundleError):
        package_from_bytes(data)
    with pytest.raises(BundleError):
        package_from_bytes(package_to_bytes(make())[:-10])


def test_wrong_schema_and_bad_fields_are_refused():
    obj = msgpack.unpackb(package_to_bytes(make()), raw=False)
    obj["schema_version"] = 99
    with pytest.raises(BundleError, match="schema_version 99"):
        package_from_bytes(msgpack.packb(obj, use_bin_type=True))
    with pytest.raises(BundleError, match="knowledge must be float32"):
        make(knowledge=np.zeros((4, 3), dtype=np.float32))
    with pytest.raises(BundleError, match="client_sha256"):
        make(client_sha256="abc")
