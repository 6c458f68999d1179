"""The personalization package: round trip, determinism, and refusals (tampering, other client, schema,
models that do not fit the shapes the package declares)."""

import hashlib
from functools import cache

import msgpack
import numpy as np
import pytest
import torch

from common.errors import BundleError
from edge_sdk.cvae import build_cvae
from edge_sdk.models.arch import build_model
from export.onnx_export import export_decoder_onnx, export_onnx
from export.package import Package, package_from_bytes, package_to_bytes, read_package, write_package

OWN_MODEL = b"the client's onnx bytes"
SHAPE = (1, 8, 8)


@cache
def _global_onnx(num_classes: int = 3) -> bytes:
    torch.manual_seed(0)
    return export_onnx(build_model(f"C4k3-P-F{num_classes}", SHAPE, num_classes).eval(), SHAPE)


@cache
def _generator_onnx() -> bytes:
    torch.manual_seed(1)
    cvae = build_cvae("cvae-small", SHAPE, 3, 2).eval()
    return export_decoder_onnx(cvae.decoder, latent_dim=2, num_classes=3, output_shape=SHAPE)


def make(**overrides) -> Package:
    rng = np.random.default_rng(0)
    base = dict(
        client="client_00",
        client_sha256=hashlib.sha256(OWN_MODEL).hexdigest(),
        global_onnx=_global_onnx(),
        global_arch="C4k3-P-F3",
        num_classes=3,
        input_shape=SHAPE,
        inputs=rng.integers(0, 256, (5, *SHAPE), dtype=np.uint8),
        knowledge=rng.standard_normal((5, 3)).astype(np.float32),
        generator_onnx=None,
        knobs={"mu": 0.6, "epochs": 5},
        seed=0,
    )
    return Package(**{**base, **overrides})


def test_round_trip_and_determinism(tmp_path):
    package = make(generator_onnx=_generator_onnx())
    data = package_to_bytes(package)
    assert package_to_bytes(make(generator_onnx=_generator_onnx())) == data
    back = read_package(write_package(package, tmp_path / "c.package"))
    assert back.client == "client_00" and back.input_shape == SHAPE
    assert back.generator_onnx == _generator_onnx() and back.global_onnx == _global_onnx()
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


def _signed(obj) -> bytes:
    """``obj`` with a matching sha256 (the package hash definition), so the field checks run."""
    body = {k: v for k, v in sorted(obj.items()) if k != "sha256"}
    digest = hashlib.sha256(msgpack.packb(body, use_bin_type=True, use_single_float=False)).hexdigest()
    return msgpack.packb({**body, "sha256": digest}, use_bin_type=True)


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("schema_version", True, "schema_version True is not supported"),
        ("num_classes", True, "num_classes must be an integer"),
        ("seed", True, "seed must be an integer"),
        ("input_shape", [True, 8, 8], r"input_shape\[0\] must be an integer .* got True"),
        ("input_shape", [1, 100_000, 100_000], r"C \* H \* W <= 1048576"),
        ("input_shape", ["a", 8, 8], r"input_shape\[0\] must be an integer"),
        ("num_classes", 10_001, r"num_classes must be an integer in \[2, 10000\]"),
        ("inputs", {"shape": [True, 1, 8, 8], "data": b"\0" * 64}, r"inputs.shape\[0\] must be an integer"),
        ("inputs", {"shape": [5, 1, 8, 8], "data": None}, "inputs.data must hold 320 bytes .* got NoneType"),
    ],
)
def test_bools_and_out_of_bound_fields_are_refused(key, value, message):
    obj = msgpack.unpackb(package_to_bytes(make()), raw=False)
    obj[key] = value
    with pytest.raises(BundleError, match=r"p\.package: .*" + message):
        package_from_bytes(_signed(obj), source="p.package")


def test_a_repeated_key_is_refused():
    data = package_to_bytes(make())
    obj = msgpack.unpackb(data, raw=False)
    packer = msgpack.Packer(use_bin_type=True)
    pairs = [*obj.items(), ("seed", 1)]
    forged = packer.pack_map_header(len(pairs)) + b"".join(packer.pack(k) + packer.pack(v) for k, v in pairs)
    with pytest.raises(BundleError, match="has the key 'seed' twice"):
        package_from_bytes(forged)


def _flip_text(model: bytes, name: bytes) -> bytes:
    """``model`` with every ``name`` made undecodable (its last byte 0xad: not UTF-8), same length."""
    assert name in model
    return model.replace(name, name[:-1] + b"\xad")


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("global_onnx", b"not onnx", r"global_onnx: not a valid ONNX model"),
        ("global_onnx", _global_onnx(4), r"global_onnx: ONNX output .* expected float32 \[1, 3\]"),
        (  # a flipped byte in the protobuf text (names, op types): issue #16's UnicodeDecodeError
            "global_onnx",
            _flip_text(_global_onnx(), b"Relu"),
            r"global_onnx: model\.graph\.node\[\d+\]\.\w+(\[\d+\])? is not UTF-8 text \(got b'.*Rel\\xad",
        ),
        ("generator_onnx", _global_onnx(), r"generator_onnx: expected ONNX inputs \['z', 'y'\]"),
    ],
)
def test_the_reader_holds_the_models_to_the_onnx_contract(field, value, message):
    """A package's models must fit the shapes it declares (export.onnx_check), checked by the reader:
    the device refuses a bad package at read time, before personalization loads or runs anything."""
    obj = msgpack.unpackb(package_to_bytes(make()), raw=False)
    obj[field] = value
    with pytest.raises(BundleError, match=r"p\.package: " + message):
        package_from_bytes(_signed(obj), source="p.package")
