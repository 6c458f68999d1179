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

from common.errors import BundleError, ConfigError
from export.bundle import (
    KINDS,
    SCHEMA_VERSION,
    Bundle,
    bundle_from_bytes,
    bundle_to_bytes,
    client_names,
    read_bundle,
    upgrade_bundle,
    write_bundle,
)
from export.wire import (
    MAX_CLASSES,
    MAX_DECODER_CLASSES,
    MAX_EXAMPLES,
    MAX_INPUT_ELEMENTS,
    MAX_LATENT_DIM,
)

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


def _sort(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _sort(value[k]) for k in sorted(value)}
    return [_sort(v) for v in value] if isinstance(value, list) else value


def _hash(wire: dict[str, Any]) -> str:
    """The schema-2 hash from its definition: sha256 of the key-sorted msgpack of every field but sha256."""
    body = _sort({k: v for k, v in wire.items() if k != "sha256"})
    return hashlib.sha256(msgpack.packb(body, use_bin_type=True, use_single_float=False)).hexdigest()


def _signed(wire: dict[str, Any]) -> bytes:
    """``wire`` packed with a matching sha256, as a hostile writer would: the checks after the hash run."""
    return _pack({**wire, "sha256": _hash(wire)})


def test_round_trip_and_manifest() -> None:
    bundle = _bundle()
    back = bundle_from_bytes(bundle_to_bytes(bundle))
    assert back == bundle
    assert back.model_sha256 == hashlib.sha256(MODEL).hexdigest()
    assert back.sha256 == _wire(bundle)["sha256"] == _hash(_wire(bundle)) != back.model_sha256
    assert isinstance(back.input_shape, tuple) and isinstance(back.label_counts, tuple)
    assert back.metrics["val_accuracy"] == 0.1  # float64 on the wire: exact
    manifest = back.manifest()
    assert "model_onnx" not in manifest
    assert manifest["sha256"] == back.sha256 and manifest["model_onnx_size_bytes"] == len(MODEL)
    assert manifest["model_sha256"] == back.model_sha256
    assert manifest["input_shape"] == [1, 8, 8] and manifest["schema_version"] == SCHEMA_VERSION
    assert json.loads(json.dumps(manifest)) == manifest


def test_cvae_decoder_round_trip(tmp_path: Path) -> None:
    bundle = _bundle(kind="cvae_decoder", latent_dim=16, arch="cvae:z16")
    path = write_bundle(bundle, tmp_path / "dec.bundle")
    back = read_bundle(path)
    assert back == bundle and back.latent_dim == 16
    assert _wire(bundle)["latent_dim"] == 16
    assert "latent_dim" not in _wire(_bundle())  # only written when set


def test_unknown_output_round_trips_and_older_bundles_keep_loading(tmp_path: Path) -> None:
    plain = _bundle()
    assert plain.unknown_output is False and plain.num_outputs == 3
    assert "unknown_output" not in _wire(plain)  # a bundle without it is byte-for-byte what it was
    fedov = _bundle(unknown_output=True)
    assert fedov.num_outputs == 4 and _wire(fedov)["unknown_output"] is True
    back = read_bundle(write_bundle(fedov, tmp_path / "fedov.bundle"))
    assert back == fedov and back.unknown_output and back.sha256 != plain.sha256
    assert back.manifest()["unknown_output"] is True
    # a writer that says false (or anything but true) is refused: omitted and false would hash apart
    for value in (False, 1, "yes"):
        with pytest.raises(BundleError, match="unknown_output must be omitted unless true"):
            bundle_from_bytes(_signed({**_wire(plain), "unknown_output": value}))
    with pytest.raises(BundleError, match="only for classifier"):
        _bundle(kind="cvae_decoder", latent_dim=4, unknown_output=True)
    with pytest.raises(BundleError, match="must be a bool"):
        _bundle(unknown_output=1)


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
    with pytest.raises(BundleError, match=r"bad\.bundle: sha256 mismatch"):
        read_bundle(path)


def _flip(data: bytes, old: bytes, new: bytes) -> bytes:
    """``data`` with the one occurrence of ``old`` replaced by ``new`` (same length: still valid msgpack)."""
    assert data.count(old) == 1 and len(old) == len(new)
    return data.replace(old, new)


@pytest.mark.parametrize(
    ("old", "new"),
    [
        (b"C8k3-P-F10", b"C8k3-P-F11"),  # arch
        (b"0.1.0", b"0.1.1"),  # sdk_version
        (b"raspberry-pi-4", b"raspberry-pi-5"),  # profile name
        (b"\x93\x05\x00\x07", b"\x93\x05\x01\x07"),  # label_counts (5, 0, 7) -> (5, 1, 7)
        (b"\xcb\x3f\xb9\x99\x99\x99\x99\x99\x9a", b"\xcb\x3f\xb9\x99\x99\x99\x99\x99\x9b"),  # metric 0.1
        (b"\xa4\x6e\x6f\x74\x65\xc0", b"\xa4\x6e\x6f\x74\x65\xc2"),  # metrics note: None -> False
    ],
)
def test_flipped_manifest_byte_is_refused(old: bytes, new: bytes) -> None:
    """Schema 1 hashed the model only: these flips were accepted. Now the hash covers every field."""
    data = bundle_to_bytes(_bundle())
    assert msgpack.unpackb(_flip(data, old, new), raw=False) != _wire()  # the flip decodes to a change
    with pytest.raises(BundleError, match=r"f\.bundle: sha256 mismatch: .* over the whole bundle"):
        bundle_from_bytes(_flip(data, old, new), source="f.bundle")


def _map(pairs: list[tuple[str, Any]], *, packed: bool = False) -> bytes:
    """A msgpack map of ``pairs`` in this order, repeated keys included (a dict cannot hold them);
    with ``packed`` the values are msgpack bytes already."""
    values = b"".join(_pack(k) + (v if packed else _pack(v)) for k, v in pairs)
    return msgpack.Packer().pack_map_header(len(pairs)) + values


def test_repeated_keys_are_refused_at_every_level() -> None:
    """msgpack keeps the last of two equal keys: a forged map could carry a second, matching sha256."""
    forged = _wire(_bundle(metrics={"val_accuracy": 0.99}))
    pairs = [(k, _wire()["sha256"] if k == "sha256" else v) for k, v in forged.items()]
    with pytest.raises(BundleError, match=r"d\.bundle: a map in this bundle has the key 'sha256' twice"):
        bundle_from_bytes(_map([*pairs, ("sha256", _hash(forged))]), source="d.bundle")
    nested = _map([("val_accuracy", 0.1), ("val_accuracy", 0.9)])
    pairs = [(k, nested if k == "metrics" else _pack(v)) for k, v in _wire().items()]
    with pytest.raises(BundleError, match="has the key 'val_accuracy' twice"):
        bundle_from_bytes(_map(pairs, packed=True))


@pytest.mark.parametrize(
    ("version", "message"),
    [
        (3, r"bundle schema 3 is newer than this SDK's 2; upgrade"),
        (1, r"bundle schema 1 is no longer read .* re-export the bundle with this SDK"),
        (0, r"schema_version must be 2, got 0"),
        (True, r"schema_version must be 2, got True"),
        ("2", r"schema_version must be 2, got '2'"),
    ],
)
def test_schema_version_refused(version: Any, message: str) -> None:
    wire = _wire()
    wire["schema_version"] = version
    with pytest.raises(BundleError, match=message):
        bundle_from_bytes(_signed(wire), source="up.bundle")


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
        ("num_classes", "3", "num_classes must be an integer"),
        ("num_classes", True, "num_classes must be an integer"),
        ("num_classes", -1, "num_classes must be an integer"),
        ("num_classes", 2**63, "num_classes must be an integer"),
        ("kind", "regressor", "kind must be one of"),
        ("model_onnx", "not bytes", "model_onnx must be bytes"),
        ("arch", 5, "arch must be a non-empty str"),
        ("input_shape", [1, 8], r"input_shape must be three integers \(C, H, W\)"),
        ("input_shape", [1, 0, 8], r"input_shape\[1\] must be an integer in \[1, "),
        ("input_shape", [-1, 8, 8], r"input_shape\[0\] must be an integer in \[1, "),
        ("input_shape", ["a", 8, 8], r"input_shape\[0\] must be an integer .* got 'a'"),
        ("input_shape", [True, 8, 8], r"input_shape\[0\] must be an integer .* got True"),
        ("input_shape", [1, 100_000, 100_000], r"C \* H \* W <= 1048576, got \[1, 100000, 100000\]"),
        ("input_shape", [17, 8, 8], r"with C <= 16"),
        ("input_shape", "1x8x8", "input_shape must be a list of integers"),
        ("label_counts", [5, "0", 7], r"label_counts\[1\] must be an integer"),
        ("label_counts", [5, True, 6], r"label_counts\[1\] must be an integer .* got True"),
        ("label_counts", [5, 7], "one entry per class"),
        ("label_counts", [5, -1, 8], r"label_counts\[1\] must be an integer in \[0, "),
        ("num_examples", 13, r"sum\(label_counts\) must equal num_examples"),
        ("num_examples", True, "num_examples must be an integer"),
        ("profile", {"max_flops": 1}, "profile must have a non-empty str 'name'"),
        ("profile", ["raspberry"], "profile must be a map"),
        ("metrics", {"history": [0.1, 0.2]}, r"metrics\['history'\] must be str, int, float, bool or None"),
        ("metrics", {"nested": {"a": 1}}, r"metrics\['nested'\]"),
        ("seed", -1, "seed must be an integer"),
        ("seed", 1.5, "seed must be an integer"),
        ("seed", True, "seed must be an integer"),
        ("sdk_version", "", "sdk_version must be a non-empty str"),
        ("latent_dim", 8, "latent_dim is only for cvae_decoder"),
        ("latent_dim", None, "latent_dim must be omitted when unset"),
    ],
)
def test_wrong_fields_refused(key: str, value: Any, message: str) -> None:
    """What a writer that hashes its own bad fields (a hostile device) gets: the field checks."""
    wire = _wire()
    wire[key] = value
    with pytest.raises(BundleError, match=r"in\.bundle: .*" + message):
        bundle_from_bytes(_signed(wire), source="in.bundle")


@pytest.mark.parametrize("value", ["00" * 32, 12, None])
def test_wrong_sha256_refused(value: Any) -> None:
    wire = _wire()
    wire["sha256"] = value
    with pytest.raises(BundleError, match=r"in\.bundle: sha256 mismatch"):
        bundle_from_bytes(_pack(wire), source="in.bundle")


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"latent_dim": True}, "latent_dim must be an integer"),
        ({"latent_dim": MAX_LATENT_DIM + 1}, rf"latent_dim must be an integer in \[1, {MAX_LATENT_DIM}\]"),
        ({"num_classes": True}, "num_classes of a cvae_decoder must be an integer"),
    ],
)
def test_decoder_fields_refused_on_read(overrides: dict[str, Any], message: str) -> None:
    wire = _wire(_bundle(kind="cvae_decoder", latent_dim=16))
    wire.update(overrides)
    with pytest.raises(BundleError, match=r"dec\.bundle: " + message):
        bundle_from_bytes(_signed(wire), source="dec.bundle")


def test_class_bounds_are_read_time_refusals() -> None:
    """A decoder's classes cost the server an L x L one-hot matrix: 100,000 is refused before any of it."""
    wide = [1] * MAX_DECODER_CLASSES
    ok = _bundle(
        kind="cvae_decoder", latent_dim=8, num_classes=len(wide), label_counts=wide, num_examples=len(wide)
    )
    assert bundle_from_bytes(bundle_to_bytes(ok)).num_classes == MAX_DECODER_CLASSES
    wire = _wire(ok)
    wire.update(num_classes=100_000, label_counts=[1] * 100_000, num_examples=100_000)
    with pytest.raises(BundleError, match="not a readable bundle"):  # an array past MAX_CLASSES
        bundle_from_bytes(_signed(wire))
    wire.update(num_classes=MAX_DECODER_CLASSES + 1, label_counts=[1] * 1025, num_examples=1025)
    with pytest.raises(
        BundleError,
        match=rf"num_classes of a cvae_decoder must be an integer in \[1, {MAX_DECODER_CLASSES}\]",
    ):
        bundle_from_bytes(_signed(wire))
    wire = _wire()
    wire.update(num_classes=MAX_CLASSES + 1)
    with pytest.raises(
        BundleError, match=rf"num_classes must be an integer in \[1, {MAX_CLASSES}\], got {MAX_CLASSES + 1}"
    ):
        bundle_from_bytes(_signed(wire))
    with pytest.raises(BundleError, match=r"num_examples must be an integer in \[1, "):
        _bundle(label_counts=(MAX_EXAMPLES, 0, 1), num_examples=MAX_EXAMPLES + 1)
    assert _bundle(input_shape=(1, 1024, 1024)).input_shape == (1, 1024, 1024)  # MAX_INPUT_ELEMENTS exactly
    with pytest.raises(BundleError, match=str(MAX_INPUT_ELEMENTS)):
        _bundle(input_shape=(3, 1024, 1024))


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
    wire["label_counts"] = [1] * (MAX_CLASSES + 1)
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
        ({"kind": "cvae_decoder", "latent_dim": 0}, r"latent_dim must be an integer in \[1, "),
        (
            {"kind": "cvae_decoder", "latent_dim": 8, "label_counts": (0, 0, 0), "num_examples": 0},
            "num_examples must be an integer",
        ),
        ({"kind": "cvae_decoder", "latent_dim": 8, "label_counts": None}, "label_counts must be a list"),
        ({"label_counts": None}, "label_counts must be a list"),
        ({"label_counts": (0, 0, 0), "num_examples": 0}, r"num_examples must be an integer in \[1, "),
        ({"num_classes": 0}, rf"num_classes must be an integer in \[1, {MAX_CLASSES}\]"),
        ({"input_shape": (1, 8, 8, 1)}, "input_shape must have at most 3 entries"),
        ({"schema_version": 3}, "newer than this SDK"),
        ({"schema_version": True}, "schema_version must be 2, got True"),
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
    from edge_sdk.models.arch import build_model
    from export.onnx_export import export_onnx, read_metadata

    onnx_bytes = export_onnx(
        build_model("C8k3-P-F10", (1, 8, 8), 3), (1, 8, 8), metadata={"arch": "C8k3-P-F10"}
    )
    back = read_bundle(write_bundle(_bundle(model_onnx=onnx_bytes), tmp_path / "t.bundle"))
    assert back.model_onnx == onnx_bytes and read_metadata(back.model_onnx)["arch"] == back.arch


# --- schema 1 -> 2 upgrade --------------------------------------------------------------------------


def _schema1(bundle: Bundle) -> bytes:
    """A bundle as SDK schema 1 wrote it: the same map, sha256 over the ONNX bytes only."""
    wire = _wire(bundle)
    wire.update(schema_version=1, sha256=hashlib.sha256(bundle.model_onnx).hexdigest())
    return msgpack.packb(_sort(wire), use_bin_type=True, use_single_float=False)


def test_upgrade_rewrites_a_schema1_bundle_in_place(tmp_path: Path) -> None:
    path = tmp_path / "old.bundle"
    path.write_bytes(_schema1(_bundle(kind="cvae_decoder", latent_dim=4)))
    with pytest.raises(
        BundleError, match=r"old\.bundle: bundle schema 1 is no longer read .*edge-sdk upgrade"
    ):
        read_bundle(path)
    assert upgrade_bundle(path) is True
    assert read_bundle(path) == _bundle(kind="cvae_decoder", latent_dim=4)
    assert path.read_bytes() == bundle_to_bytes(_bundle(kind="cvae_decoder", latent_dim=4))
    assert upgrade_bundle(path) is False  # already current: verified, untouched
    assert os.listdir(tmp_path) == ["old.bundle"]


def test_upgrade_refuses_what_schema1_would_have_refused(tmp_path: Path) -> None:
    path = tmp_path / "bad.bundle"
    data = bytearray(_schema1(_bundle()))
    data[bytes(data).index(MODEL) + 3] ^= 1  # a flipped model byte: schema 1's hash catches it
    path.write_bytes(bytes(data))
    with pytest.raises(BundleError, match=r"bad\.bundle: schema-1 model_onnx sha256 mismatch"):
        upgrade_bundle(path)
    path.write_bytes(_pack({**_wire(), "schema_version": 0}))
    with pytest.raises(BundleError, match="only schema-1 bundles can be upgraded, got schema_version 0"):
        upgrade_bundle(path)
    wire = _wire()
    wire.update(schema_version=1, sha256=hashlib.sha256(MODEL).hexdigest(), input_shape=[1, 8192, 8192])
    path.write_bytes(_pack(wire))  # fine under schema 1's bounds, not under today's
    with pytest.raises(BundleError, match=r"bad\.bundle: input_shape must be three integers"):
        upgrade_bundle(path)
    assert path.read_bytes() == _pack(wire)  # a refused upgrade writes nothing


# --- output names -----------------------------------------------------------------------------------


def test_client_names_never_collide() -> None:
    assert client_names(["a/client_00.bundle", "a/client_01.bundle"]) == ["client_00", "client_01"]
    names = client_names(["a/client_00.bundle", "b/client_00.bundle", "c/client_01.bundle"])
    assert names == ["client_00-0", "client_00-1", "client_01"]
    assert client_names(["a/X.bundle", "b/x.bundle"]) == ["X-0", "x-1"]  # case-insensitive file systems
    with pytest.raises(ConfigError, match="more than once"):
        client_names(["a/client_00.bundle", "a/../a/client_00.bundle"])
    with pytest.raises(ConfigError, match=r"same output name \['c-1'\]"):
        client_names(["a/c.bundle", "b/c.bundle", "c-1.bundle"])
