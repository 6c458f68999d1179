"""The bundle wire format: round trip, determinism, and one refusal per validation rule."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest

from export.bundle import (
    KINDS,
    SCHEMA_VERSION,
    Bundle,
    bundle_from_bytes,
    bundle_to_bytes,
    read_bundle,
    write_bundle,
)
from profiles.errors import BundleError

MODEL = b"\x08\x08fake-onnx-bytes" * 64


def _bundle(**overrides: Any) -> Bundle:
    fields: dict[str, Any] = {
        "kind": "classifier",
        "model_onnx": MODEL,
        "arch": "C8k3-P-F10",
        "num_classes": 3,
        "input_shape": (1, 8, 8),
        "label_counts": (5, 0, 7),
        "num_examples": 12,
        "profile": {
            "name": "raspberry-pi-4",
            "max_flops": 2_000_000,
            "memory_mb": 512.0,
            "role": "classifier",
        },
        "metrics": {"val_accuracy": 0.1, "flops": 1234, "params": 99, "converged": True, "note": None},
        "seed": 7,
        "sdk_version": "0.1.0",
    }
    fields.update(overrides)
    return Bundle(**fields)


def _wire(bundle: Bundle | None = None) -> dict[str, Any]:
    return msgpack.unpackb(bundle_to_bytes(bundle or _bundle()), raw=False)


def _pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def test_round_trip_and_manifest() -> None:
    bundle = _bundle()
    back = bundle_from_bytes(bundle_to_bytes(bundle))
    assert back == bundle
    assert back.sha256 == hashlib.sha256(MODEL).hexdigest()
    assert isinstance(back.input_shape, tuple) and isinstance(back.label_counts, tuple)
    assert back.metrics["val_accuracy"] == 0.1  # float64 on the wire: exact
    manifest = back.manifest()
    assert "model_onnx" not in manifest
    assert manifest["sha256"] == back.sha256 and manifest["model_onnx_size_bytes"] == len(MODEL)
    assert manifest["input_shape"] == [1, 8, 8] and manifest["schema_version"] == SCHEMA_VERSION
    assert json.loads(json.dumps(manifest)) == manifest


def test_cvae_decoder_round_trip(tmp_path: Path) -> None:
    bundle = _bundle(kind="cvae_decoder", latent_dim=16, arch="cvae:z16")
    path = write_bundle(bundle, tmp_path / "dec.bundle")
    back = read_bundle(path)
    assert back == bundle and back.latent_dim == 16
    assert _wire(bundle)["latent_dim"] == 16
    assert "latent_dim" not in _wire(_bundle())  # only written when set


def test_wire_keys() -> None:
    wire = _wire()
    assert set(wire) == {
        "schema_version",
        "kind",
        "model_onnx",
        "sha256",
        "arch",
        "num_classes",
        "input_shape",
        "label_counts",
        "num_examples",
        "profile",
        "metrics",
        "seed",
        "sdk_version",
    }
    assert isinstance(wire["model_onnx"], bytes) and wire["input_shape"] == [1, 8, 8]


def test_deterministic_bytes_and_files(tmp_path: Path) -> None:
    reordered = _bundle(
        profile=dict(reversed(list(_bundle().profile.items()))),
        metrics=dict(reversed(list(_bundle().metrics.items()))),
        label_counts=[5, 0, 7],
    )
    assert bundle_to_bytes(_bundle()) == bundle_to_bytes(_bundle()) == bundle_to_bytes(reordered)
    first = write_bundle(_bundle(), tmp_path / "a.bundle").read_bytes()
    second = write_bundle(reordered, tmp_path / "a.bundle").read_bytes()
    assert first == second
    # Keys sorted at every level (maps decoded as lists of pairs keep the wire order).
    pairs = msgpack.unpackb(first, raw=False, object_pairs_hook=list)
    assert [k for k, _ in pairs] == sorted(k for k, _ in pairs)
    for key in ("profile", "metrics"):
        nested = dict(pairs)[key]
        assert [k for k, _ in nested] == sorted(k for k, _ in nested) and len(nested) > 1


def test_floats_are_float64_and_plain() -> None:
    bundle = _bundle(metrics={"val_loss": np.float64(1 / 3), "lr": 0.1})
    assert type(bundle.metrics["val_loss"]) is float
    data = bundle_to_bytes(bundle)
    assert b"\xcb" in data and b"\xca" not in data  # msgpack float64 marker, never float32
    assert bundle_from_bytes(data).metrics == {"lr": 0.1, "val_loss": 1 / 3}


def _random_scalar(rng: np.random.Generator) -> Any:
    choice = int(rng.integers(6))
    if choice == 0:
        return None
    if choice == 1:
        return bool(rng.integers(2))
    if choice == 2:
        return int(rng.integers(-(2**63), 2**63 - 1, dtype=np.int64))
    if choice == 3:
        return int(rng.integers(0, 2**64 - 1, dtype=np.uint64))
    if choice == 4:
        return float(rng.standard_normal() * 10.0 ** int(rng.integers(-300, 300)))
    return "".join(chr(int(c)) for c in rng.integers(32, 0x2FFF, size=int(rng.integers(0, 30))))


@pytest.mark.parametrize("seed", range(30))
def test_round_trip_random_bundles(seed: int) -> None:
    """Property: any valid bundle survives the round trip exactly, and re-encodes to the same bytes."""
    rng = np.random.default_rng(seed)
    counts = [int(c) for c in rng.integers(0, 10**6, size=int(rng.integers(1, 60)))]
    counts[0] += 1  # sum > 0
    metrics = {f"m{i}_{int(rng.integers(1000))}": _random_scalar(rng) for i in range(int(rng.integers(0, 9)))}
    kind = KINDS[seed % len(KINDS)]
    bundle = _bundle(
        kind=kind,
        latent_dim=int(rng.integers(1, 512)) if kind == "cvae_decoder" else None,
        model_onnx=rng.bytes(int(rng.integers(1, 4096))),
        num_classes=len(counts),
        label_counts=counts,
        num_examples=sum(counts),
        metrics=metrics,
        seed=int(rng.integers(0, 2**64 - 1, dtype=np.uint64)),
    )
    data = bundle_to_bytes(bundle)
    back = bundle_from_bytes(data)
    assert back == bundle
    assert bundle_to_bytes(back) == data


# --- refusals on read -------------------------------------------------------------------------------


def test_flipped_model_byte_is_refused(tmp_path: Path) -> None:
    data = bytearray(bundle_to_bytes(_bundle()))
    at = bytes(data).index(MODEL) + len(MODEL) // 2
    data[at] ^= 0x01
    path = tmp_path / "bad.bundle"
    path.write_bytes(bytes(data))
    with pytest.raises(BundleError, match=r"bad\.bundle: model_onnx sha256 mismatch"):
        read_bundle(path)


@pytest.mark.parametrize(
    ("version", "message"),
    [
        (2, r"bundle schema 2 is newer than this SDK's 1; upgrade"),
        (0, r"schema_version must be 1, got 0"),
        (True, r"schema_version must be 1, got True"),
        ("1", r"schema_version must be 1, got '1'"),
    ],
)
def test_schema_version_refused(version: Any, message: str) -> None:
    wire = _wire()
    wire["schema_version"] = version
    with pytest.raises(BundleError, match=message):
        bundle_from_bytes(_pack(wire), source="up.bundle")


def test_truncated_file_refused(tmp_path: Path) -> None:
    data = bundle_to_bytes(_bundle())
    path = tmp_path / "short.bundle"
    path.write_bytes(data[: len(data) - 10])
    with pytest.raises(BundleError, match=r"short\.bundle: not a readable bundle .*truncated"):
        read_bundle(path)


@pytest.mark.parametrize("data", [b"PK\x03\x04 a zip, not a bundle", b"\xc1", b"", _pack(b"x") + b"extra"])
def test_non_msgpack_refused(tmp_path: Path, data: bytes) -> None:
    path = tmp_path / "junk.bundle"
    path.write_bytes(data)
    with pytest.raises(BundleError, match=r"junk\.bundle: "):
        read_bundle(path)


@pytest.mark.parametrize("obj", [[1, 2, 3], 42, "bundle", None])
def test_not_a_map_refused(obj: Any) -> None:
    with pytest.raises(BundleError, match=r"x\.bundle: .*(msgpack map|not a readable)"):
        bundle_from_bytes(_pack(obj), source="x.bundle")


def test_missing_file_refused(tmp_path: Path) -> None:
    with pytest.raises(BundleError, match="cannot read bundle"):
        read_bundle(tmp_path / "absent.bundle")


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("num_classes", "3", "num_classes must be an int"),
        ("num_classes", True, "num_classes must be an int"),
        ("kind", "regressor", "kind must be one of"),
        ("model_onnx", "not bytes", "model_onnx must be bytes"),
        ("arch", 5, "arch must be a non-empty str"),
        ("input_shape", [1, 8], "input_shape must be three positive ints"),
        ("input_shape", [1, 0, 8], "input_shape must be three positive ints"),
        ("input_shape", "1x8x8", "input_shape must be a sequence of ints"),
        ("label_counts", [5, "0", 7], "label_counts must hold ints only"),
        ("label_counts", [5, 7], "one entry per class"),
        ("label_counts", [5, -1, 8], "label_counts must be >= 0"),
        ("num_examples", 13, r"sum\(label_counts\) must equal num_examples"),
        ("profile", {"max_flops": 1}, "profile must have a non-empty str 'name'"),
        ("profile", ["raspberry"], "profile must be a map"),
        ("metrics", {"history": [0.1, 0.2]}, r"metrics\['history'\] must be str, int, float, bool or None"),
        ("metrics", {"nested": {"a": 1}}, r"metrics\['nested'\]"),
        ("seed", -1, "seed must be an int"),
        ("seed", 1.5, "seed must be an int"),
        ("sdk_version", "", "sdk_version must be a non-empty str"),
        ("sha256", "00" * 32, "sha256 mismatch"),
        ("sha256", 12, "sha256 mismatch"),
        ("latent_dim", 8, "latent_dim is only for cvae_decoder"),
    ],
)
def test_wrong_fields_refused(key: str, value: Any, message: str) -> None:
    wire = _wire()
    wire[key] = value
    with pytest.raises(BundleError, match=r"in\.bundle: .*" + message):
        bundle_from_bytes(_pack(wire), source="in.bundle")


def test_missing_and_unknown_keys_refused() -> None:
    wire = _wire()
    del wire["label_counts"]
    with pytest.raises(BundleError, match=r"missing \['label_counts'\], unknown \[\]"):
        bundle_from_bytes(_pack(wire))
    wire = _wire()
    wire["weights"] = b"..."
    with pytest.raises(BundleError, match=r"missing \[\], unknown \['weights'\]"):
        bundle_from_bytes(_pack(wire))


def test_sizes_out_of_range_refused() -> None:
    wire = _wire()
    wire["arch"] = "C" * 10_001  # msgpack's max_str_len refuses it before any allocation
    with pytest.raises(BundleError, match="not a readable bundle"):
        bundle_from_bytes(_pack(wire))
    wire = _wire()
    wire["num_classes"] = 100_001
    with pytest.raises(BundleError, match=r"num_classes must be an int in \[1, 100000\]"):
        bundle_from_bytes(_pack(wire))
    wire = _wire()
    wire["label_counts"] = [1] * 100_001
    with pytest.raises(BundleError, match="not a readable bundle"):
        bundle_from_bytes(_pack(wire))
    wire = _wire()
    wire["metrics"] = {f"m{i}": i for i in range(1001)}
    with pytest.raises(BundleError, match="not a readable bundle"):
        bundle_from_bytes(_pack(wire))
    ext = msgpack.packb({"x": msgpack.ExtType(1, b"abc")}, use_bin_type=True)
    with pytest.raises(BundleError, match="not a readable bundle"):
        bundle_from_bytes(ext)
    with pytest.raises(BundleError, match="model_onnx must hold 1 B to 1 GiB"):
        _bundle(model_onnx=b"")


# --- rules on construction --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"kind": "cvae_decoder"}, "cvae_decoder bundle needs latent_dim"),
        ({"kind": "cvae_decoder", "latent_dim": 0}, r"latent_dim must be an int in \[1, "),
        (
            {"kind": "cvae_decoder", "latent_dim": 8, "label_counts": (0, 0, 0), "num_examples": 0},
            "num_examples must be an int",
        ),
        ({"kind": "cvae_decoder", "latent_dim": 8, "label_counts": None}, "label_counts must be a sequence"),
        ({"label_counts": None}, "label_counts must be a sequence"),
        ({"label_counts": (0, 0, 0), "num_examples": 0}, r"num_examples must be an int in >= 1"),
        ({"num_classes": 0}, r"num_classes must be an int in \[1, 100000\]"),
        ({"input_shape": (1, 8, 8, 1)}, "three positive ints"),
        ({"schema_version": 2}, "newer than this SDK"),
        ({"metrics": {"": 1}}, "metrics key must be a non-empty str"),
        ({"metrics": {"big": 2**64}}, "does not fit in 64 bits"),
        ({"metrics": {"arr": np.zeros(2)}}, r"metrics\['arr'\] must be str"),
    ],
)
def test_construction_rules(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(BundleError, match=message):
        _bundle(**overrides)


def test_every_kind_constructs() -> None:
    for kind in KINDS:
        extra = {"latent_dim": 4} if kind == "cvae_decoder" else {}
        assert _bundle(kind=kind, **extra).kind == kind


def test_bundle_is_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        _bundle().num_classes = 4  # type: ignore[misc]


# --- atomic writes ----------------------------------------------------------------------------------


def test_write_leaves_no_temp_file(tmp_path: Path) -> None:
    write_bundle(_bundle(), tmp_path / "out" / "a.bundle")
    write_bundle(_bundle(), tmp_path / "out" / "a.bundle")  # overwrite
    assert os.listdir(tmp_path / "out") == ["a.bundle"]


def test_failed_serialisation_writes_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(*args: object, **kwargs: object) -> bytes:
        raise TypeError("cannot serialize")

    monkeypatch.setattr(msgpack, "packb", boom)
    with pytest.raises(TypeError, match="cannot serialize"):
        write_bundle(_bundle(), tmp_path / "a.bundle")
    assert os.listdir(tmp_path) == []


def test_failed_rename_keeps_old_file_and_no_temp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import export.atomic

    path = write_bundle(_bundle(), tmp_path / "a.bundle")
    before = path.read_bytes()

    def fail(*args: object) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(export.atomic.os, "replace", fail)
    with pytest.raises(OSError, match="disk full"):
        write_bundle(_bundle(seed=8), path)
    assert os.listdir(tmp_path) == ["a.bundle"] and path.read_bytes() == before


def test_real_onnx_round_trip(tmp_path: Path) -> None:
    from edge_sdk.arch import build_model
    from export.onnx_export import export_onnx, read_metadata

    onnx_bytes = export_onnx(
        build_model("C8k3-P-F10", (1, 8, 8), 3), (1, 8, 8), metadata={"arch": "C8k3-P-F10"}
    )
    back = read_bundle(write_bundle(_bundle(model_onnx=onnx_bytes), tmp_path / "t.bundle"))
    assert back.model_onnx == onnx_bytes and read_metadata(back.model_onnx)["arch"] == back.arch
