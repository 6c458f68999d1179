"""Seeded, deterministic mutators: case ``index`` of ``seed`` for (kind, mutator) is always the same file.

Three levels: raw bytes (flips, truncations, insertions; hashes left stale, so these probe the parser
and the hash check), msgpack fields and ONNX / safetensors payloads (hashes recomputed by
:mod:`tests.fuzz.wire`, so these probe everything behind the hash check). ``must_refuse`` marks mutants
no reader may accept whatever else it does: external data, duplicate keys, unknown schema versions.
The only input besides (kind, mutator, seed, index) is the case's working directory, which absolute
external-data paths point into.
"""

from __future__ import annotations

import copy
import json
import math
import struct
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from export.bundle import read_bundle
from export.package import read_package
from export.weights_file import read_weights_file
from tests.fuzz import seeds as seeds_module
from tests.fuzz.hostile import HOSTILE_MUTATIONS
from tests.fuzz.onnx_mutators import MUST_REFUSE as ONNX_MUST_REFUSE
from tests.fuzz.onnx_mutators import ONNX_MUTATIONS
from tests.fuzz.wire import (
    HarnessError,
    HashScheme,
    decode,
    detect_hashes,
    encode_map,
    encode_with_duplicate,
    via_bundle_writer,
    via_package_writer,
    via_weights_writer,
)

Path_ = tuple[str | int, ...]  # a path into the decoded map: keys and list indices
_DELETE = object()


@dataclass(frozen=True)
class Mutant:
    data: bytes
    note: str
    must_refuse: bool = False


@dataclass
class SeedFile:
    """One honest file, decoded once: the raw map, its hash scheme and the object its reader returns."""

    kind: str
    data: bytes
    wire: dict[str, Any]
    scheme: HashScheme
    obj: Any  # Bundle, Package, or (tensors, manifest) of a weights file

    @property
    def hash_keys(self) -> set[str]:
        return {key for key, _, _ in self.scheme.steps}


def load_seed(kind: str, path: Path) -> SeedFile:
    data = path.read_bytes()
    if kind not in seeds_module.WIRE_KINDS:  # issue #34's boundaries: bytes the consumer interprets
        return SeedFile(kind, data, {}, HashScheme(()), None)
    wire = decode(data)
    if kind in ("classifier", "decoder"):
        obj: Any = read_bundle(path)
    elif kind == "package":
        obj = read_package(path)
    else:
        obj = read_weights_file(path, kind=wire["kind"])
    return SeedFile(kind, data, wire, detect_hashes(wire), obj)


# --------------------------------------------------------------------------------- writing a change


def _set(root: dict[str, Any], path: Path_, value: Any) -> None:
    node: Any = root
    for step in path[:-1]:
        node = node[step]
    if value is _DELETE:
        del node[path[-1]]
    else:
        node[path[-1]] = value


def rewrite(seed: SeedFile, changes: dict[Path_, Any]) -> bytes:
    """The seed with ``changes`` (path -> value or _DELETE), through the public writer when it can encode
    them, else as a raw map with hashes recomputed."""
    wire = copy.deepcopy(seed.wire)
    for path, value in changes.items():
        _set(wire, path, value)
    top = {path[0] for path in changes}
    deleted = any(value is _DELETE for value in changes.values())
    data = None
    if not deleted and not top & seed.hash_keys:
        fields = {str(key): wire[key] for key in top}
        if seed.kind in ("classifier", "decoder"):
            data = via_bundle_writer(seed.obj, fields)
        elif seed.kind == "package":
            data = via_package_writer(seed.obj, fields)
        elif top == {"manifest"} and isinstance(wire["manifest"], dict):
            data = via_weights_writer(seed.obj[0], kind=wire["kind"], manifest=wire["manifest"])
    return data if data is not None else encode_map(wire, seed.scheme)


def _paths(value: Any, prefix: Path_ = ()) -> list[Path_]:
    """Every path into nested maps (and into lists of at most 16 entries)."""
    out: list[Path_] = []
    if isinstance(value, dict):
        for key in sorted(value, key=str):
            out += [(*prefix, key), *_paths(value[key], (*prefix, key))]
    elif isinstance(value, list) and len(value) <= 16:
        for i, item in enumerate(value):
            out += [(*prefix, i), *_paths(item, (*prefix, i))]
    return out


def _field_paths(seed: SeedFile) -> list[Path_]:
    return [p for p in _paths(seed.wire) if p[0] not in seed.hash_keys]


def _get(root: Any, path: Path_) -> Any:
    for step in path:
        root = root[step]
    return root


def _pick(rng: np.random.Generator, options: list[Any]) -> Any:
    return options[int(rng.integers(len(options)))]


# ------------------------------------------------------------------------------------------ mutators

Mutate = Callable[[SeedFile, np.random.Generator, Path], Mutant]


def byte_flip(seed: SeedFile, rng: np.random.Generator, _: Path) -> Mutant:
    data = bytearray(seed.data)
    spots = rng.integers(0, len(data), int(rng.integers(1, 9)))
    for spot in spots:
        data[spot] ^= int(rng.integers(1, 256))
    return Mutant(bytes(data), f"{len(spots)} bytes xored at {sorted(spots.tolist())[:4]}...")


def truncate(seed: SeedFile, rng: np.random.Generator, _: Path) -> Mutant:
    cut = int(rng.integers(0, len(seed.data)))
    return Mutant(seed.data[:cut], f"truncated to {cut} of {len(seed.data)} bytes")


def insert(seed: SeedFile, rng: np.random.Generator, _: Path) -> Mutant:
    at = int(rng.integers(0, len(seed.data) + 1))
    if rng.random() < 0.5:
        extra = rng.integers(0, 256, int(rng.integers(1, 65)), dtype=np.uint8).tobytes()
    else:  # a copy of another slice: plausible msgpack structure in the wrong place
        start = int(rng.integers(0, len(seed.data)))
        extra = seed.data[start : start + int(rng.integers(1, 257))]
    return Mutant(seed.data[:at] + extra + seed.data[at:], f"{len(extra)} bytes inserted at {at}")


_WRONG_TYPES: list[Any] = [
    None,
    True,
    False,
    "fuzz",
    "",
    3.5,
    math.nan,
    [],
    {},
    b"\x00bytes",
    -1,
    [1, "a"],
    {"k": 1},
]


def field_type(seed: SeedFile, rng: np.random.Generator, _: Path) -> Mutant:
    path = _pick(rng, _field_paths(seed))
    value = _pick(rng, [v for v in _WRONG_TYPES if type(v) is not type(_get(seed.wire, path))])
    return Mutant(rewrite(seed, {path: value}), f"{path} = {value!r}")


_INTS: list[Any] = [
    0,
    -1,
    1,
    2,
    True,
    False,
    2**63 - 1,
    2**64 - 1,
    -(2**63),
    2_000_000,
    10**9,
    1.0,
    7.5,
    math.inf,
]


def field_int(seed: SeedFile, rng: np.random.Generator, _: Path) -> Mutant:
    paths = [
        p
        for p in _field_paths(seed)
        if isinstance(_get(seed.wire, p), int) and not isinstance(_get(seed.wire, p), bool)
    ]
    path, value = _pick(rng, paths), _pick(rng, _INTS)
    return Mutant(rewrite(seed, {path: value}), f"{path} = {value!r}")


def huge_container(seed: SeedFile, rng: np.random.Generator, _: Path) -> Mutant:
    """Lists just under and over the readers' array caps, 1 MB strings, maps of 100,000 entries."""
    paths = _field_paths(seed)
    lists = [p for p in paths if isinstance(_get(seed.wire, p), list)]
    strings = [p for p in paths if isinstance(_get(seed.wire, p), str)]
    maps = [p for p in paths if isinstance(_get(seed.wire, p), dict)]
    what = str(_pick(rng, [k for k, v in (("list", lists), ("str", strings), ("map", maps)) if v]))
    if what == "list":
        path, size = _pick(rng, lists), int(_pick(rng, [1_000, 99_999, 100_000, 100_001, 1_048_577]))
        value: Any = [1] * size
    elif what == "str":
        path, size = _pick(rng, strings), int(_pick(rng, [10_001, 1 << 20]))
        value = "x" * size
    else:
        path, size = _pick(rng, maps), int(_pick(rng, [1_001, 65_537, 100_000]))
        value = {f"k{i:06d}": i for i in range(size)}
    return Mutant(rewrite(seed, {path: value}), f"{path} = {what} of {size}")


def extra_key(seed: SeedFile, rng: np.random.Generator, _: Path) -> Mutant:
    maps = [()] + [p for p in _field_paths(seed) if isinstance(_get(seed.wire, p), dict)]
    parent = _pick(rng, maps)
    key = str(_pick(rng, ["fuzz_extra", "__proto__", "model_onnx_2", "external_data", "sha256x"]))
    value = _pick(rng, [1, "x", b"\x00" * 16, [1, 2], {"a": 1}])
    return Mutant(rewrite(seed, {(*parent, key): value}), f"extra key {(*parent, key)} = {value!r}")


def missing_key(seed: SeedFile, rng: np.random.Generator, _: Path) -> Mutant:
    keyed = [p for p in _field_paths(seed) if isinstance(p[-1], str)]
    path = _pick(rng, keyed)
    return Mutant(rewrite(seed, {path: _DELETE}), f"missing key {path}")


def duplicate_key(seed: SeedFile, rng: np.random.Generator, _: Path) -> Mutant:
    key = str(_pick(rng, sorted(k for k in seed.wire if k not in seed.hash_keys)))
    honest = seed.wire[key]
    first = _pick(rng, [v for v in (2, 1000, "other", [1, 2, 3], b"other", None) if v != honest])
    data = encode_with_duplicate(seed.wire, key, first, seed.scheme)
    return Mutant(data, f"key {key!r} twice, first {first!r}", must_refuse=True)


def schema_version(seed: SeedFile, rng: np.random.Generator, _: Path) -> Mutant:
    current = seed.wire["schema_version"]
    value = _pick(
        rng, [current + 1, current + 1000, 0, -1, True, str(current), float(current), None, 2**64 - 1]
    )
    if current > 1 and rng.random() < 0.2:
        value = current - 1  # an older version may legitimately still be readable
    legit_older = isinstance(value, int) and not isinstance(value, bool) and 1 <= value < current
    data = rewrite(seed, {("schema_version",): value})
    return Mutant(data, f"schema_version {current} -> {value!r}", must_refuse=not legit_older)


def _semantic_changes(seed: SeedFile, rng: np.random.Generator) -> tuple[dict[Path_, Any], str]:
    """Changes that keep the manifest self-consistent but make it disagree with the payload."""
    wire = seed.wire
    if seed.kind in ("classifier", "decoder"):
        what = str(_pick(rng, ["num_classes", "input_shape", "latent_dim", "kind", "arch", "counts"]))
        if what == "num_classes":
            classes = int(_pick(rng, [1, 2, 5, 11, 1000, 100_000]))
            counts = [1] * classes
            return {("num_classes",): classes, ("label_counts",): counts, ("num_examples",): classes}, what
        if what == "input_shape":
            shape = _pick(rng, [[3, 8, 8], [1, 2_000_000, 2_000_000], [1, 1, 1], [1, 28, 28], [64, 64, 64]])
            return {("input_shape",): shape}, f"input_shape {shape}"
        if what == "latent_dim":
            latent = int(_pick(rng, [1, 2, 4, 100_000]))
            return {("latent_dim",): latent}, f"latent_dim {latent}"
        if what == "kind":
            if wire["kind"] == "classifier":
                return {("kind",): "cvae_decoder", ("latent_dim",): 3}, "classifier relabelled as decoder"
            return {("kind",): "classifier", ("latent_dim",): _DELETE}, "decoder relabelled as classifier"
        if what == "arch":
            arch = _pick(
                rng, ["C4k3-P-F11", "mbv3:s16-16:k3e3-24:k3e3-32:k3e3.k3e3-64:k3e3.k3e3", "F10", "?"]
            )
            return {("arch",): arch}, f"arch {arch!r}"
        counts = [int(v) for v in rng.multinomial(wire["num_examples"], [0.1] * 10)]
        return {("label_counts",): counts}, f"label_counts {counts} (same total)"
    if seed.kind == "package":
        what = str(_pick(rng, ["num_classes", "input_shape", "client", "arch", "inputs"]))
        n = wire["inputs"]["shape"][0]
        if what == "num_classes":
            classes = int(_pick(rng, [2, 5, 11, 1000]))
            knowledge = {"shape": [n, classes], "data": bytes(4 * n * classes)}
            return {("num_classes",): classes, ("knowledge",): knowledge}, f"num_classes {classes}"
        if what == "input_shape":
            shape = _pick(rng, [[3, 8, 8], [1, 4, 4], [1, 1, 1]])
            inputs = {"shape": [n, *shape], "data": bytes(n * int(np.prod(shape)))}
            return {("input_shape",): shape, ("inputs",): inputs}, f"input_shape {shape}"
        if what == "client":
            return {("client_sha256",): "0" * 64}, "made for another client"
        if what == "arch":
            arch = _pick(rng, ["C4k3-P-F11", "C8k3-P-F10", "F10", "?"])
            return {("global_arch",): arch}, f"global_arch {arch!r}"
        count = int(_pick(rng, [1, 4096]))
        inputs = {
            "shape": [count, *wire["input_shape"]],
            "data": bytes(count * int(np.prod(wire["input_shape"]))),
        }
        knowledge = {"shape": [count, wire["num_classes"]], "data": bytes(4 * count * wire["num_classes"])}
        return {("inputs",): inputs, ("knowledge",): knowledge}, f"{count} distillation inputs"
    what = str(_pick(rng, ["num_classes", "input_shape", "space", "kind"]))
    if what == "num_classes":
        classes = _pick(rng, [0, -1, 11, 10**9, 2**63 - 1])
        return {("manifest", "num_classes"): classes}, f"num_classes {classes}"
    if what == "input_shape":
        shape = _pick(rng, [[1, 2_000_000, 2_000_000], [0, 8, 8], [-1, 8, 8], [3, 32, 32], [1, 8]])
        return {("manifest", "input_shape"): shape}, f"input_shape {shape}"
    if what == "space":
        return {("manifest", "space"): "Space(other)"}, "another search space"
    return {("kind",): _pick(rng, ["elastic-supernet", "fuzz-weights", "other"])}, "kind swapped"


def semantic(seed: SeedFile, rng: np.random.Generator, _: Path) -> Mutant:
    changes, note = _semantic_changes(seed, rng)
    return Mutant(rewrite(seed, changes), note)


def _onnx_fields(seed: SeedFile) -> list[str]:
    return ["global_onnx", "generator_onnx"] if seed.kind == "package" else ["model_onnx"]


def onnx_bytes(seed: SeedFile, rng: np.random.Generator, _: Path) -> Mutant:
    field = str(_pick(rng, _onnx_fields(seed)))
    blob = bytearray(seed.wire[field])
    if rng.random() < 0.7:
        for spot in rng.integers(0, len(blob), int(rng.integers(1, 9))):
            blob[spot] ^= int(rng.integers(1, 256))
        note = "bytes xored"
    else:
        blob = blob[: int(rng.integers(1, len(blob)))]
        note = f"truncated to {len(blob)}"
    return Mutant(rewrite(seed, {(field,): bytes(blob)}), f"{field} {note}")


def _onnx_mutator(name: str) -> Mutate:
    mutation = ONNX_MUTATIONS[name]

    def mutate(seed: SeedFile, rng: np.random.Generator, workdir: Path) -> Mutant:
        field = str(_pick(rng, _onnx_fields(seed)))
        model = onnx.load_from_string(seed.wire[field])
        note = mutation(model, rng, workdir)
        data = rewrite(seed, {(field,): model.SerializeToString()})
        return Mutant(data, f"{field}: {note}", must_refuse=name in ONNX_MUST_REFUSE)

    mutate.__name__ = name
    return mutate


def _safetensors_parts(blob: bytes) -> tuple[dict[str, Any], bytes]:
    (size,) = struct.unpack("<Q", blob[:8])
    return json.loads(blob[8 : 8 + size]), blob[8 + size :]


def _safetensors(header_text: bytes, body: bytes, size: int | None = None) -> bytes:
    return struct.pack("<Q", len(header_text) if size is None else size) + header_text + body


def safetensors_header(seed: SeedFile, rng: np.random.Generator, _: Path) -> Mutant:
    header, body = _safetensors_parts(seed.wire["tensors"])
    names = sorted(k for k in header if k != "__metadata__")
    name = str(_pick(rng, names))
    variant = str(
        _pick(rng, ["length", "dtype", "shape", "offsets", "duplicate", "metadata", "drop", "rename", "json"])
    )
    size = None
    if variant == "length":
        size = int(_pick(rng, [2**63, 2**32, len(seed.wire["tensors"]) + 1, 0]))
    elif variant == "dtype":
        header[name]["dtype"] = _pick(rng, ["F64", "I8", "BOOL", "F8_E4M3", "U64", "C64", "OBJ"])
    elif variant == "shape":
        header[name]["shape"] = _pick(rng, [[2**40], [0], [-1, 4], [2**31, 2**31, 2**31], []])
    elif variant == "offsets":
        begin, end = header[name]["data_offsets"]
        header[name]["data_offsets"] = _pick(rng, [[end, begin], [0, 2**62], [begin, end + 8], [-8, end]])
    elif variant == "metadata":
        header["__metadata__"] = {"k": "v" * (1 << 20), "n": "1"}
    elif variant == "drop":
        del header[name]
    elif variant == "rename":
        header[f"{name}.x"] = header.pop(name)
    text = json.dumps(header).encode()
    if variant == "duplicate":  # the same tensor name twice in the JSON text, the second one empty
        empty = {"dtype": header[name]["dtype"], "shape": [0], "data_offsets": [0, 0]}
        text = text[:-1] + f", {json.dumps(name)}: {json.dumps(empty)}}}".encode()
    elif variant == "json":
        text = text[: int(rng.integers(1, len(text)))]
    blob = _safetensors(text, body, size)
    return Mutant(rewrite(seed, {("tensors",): blob}), f"safetensors {variant} ({name})")


# ---------------------------------------------------------------- issue #34: well-formed but hostile


def mixed_keys(seed: SeedFile, rng: np.random.Generator, _: Path) -> Mutant:
    """A bytes key beside the str keys of a map (msgpack allows both): sorting or hashing such a map
    raises TypeError in a reader that does not check key types first."""
    maps = [()] + [p for p in _field_paths(seed) if isinstance(_get(seed.wire, p), dict)]
    parent = _pick(rng, maps)
    key = _pick(rng, [b"fuzz", b"sha256", b"\xff\xfe", b""])
    wire = copy.deepcopy(seed.wire)
    _set(wire, (*parent, key), _pick(rng, [1, "x", b"y", None]))
    return Mutant(encode_map(wire, seed.scheme), f"bytes key {key!r} in {parent}", must_refuse=True)


def _nested(depth: int, leaf: Any, as_map: bool) -> Any:
    value = leaf
    for _ in range(depth):
        value = {"k": value} if as_map else [value]
    return value


def deep_nesting(seed: SeedFile, rng: np.random.Generator, _: Path) -> Mutant:
    """A field (or a new key) holding lists or maps nested 17 to 500 levels deep: a recursive sort,
    hash or print of it raises RecursionError before any hash check."""
    depth = int(_pick(rng, [17, 64, 200, 500]))
    value = _nested(depth, int(_pick(rng, [1, 0])), bool(rng.random() < 0.5))
    path = _pick(rng, [p for p in _field_paths(seed) if len(p) == 1] + [("fuzz_deep",)])
    wire = copy.deepcopy(seed.wire)
    _set(wire, path, value)
    return Mutant(encode_map(wire, seed.scheme), f"{path} nested {depth} deep", must_refuse=True)


_HOSTILE_ARCHS = [
    "C" + "9" * 5000 + "k3-P-F10",
    "C4k3-P-F" + "1" * 4400,
    "cvae-small-z" + "7" * 5000,
    "mbv3:s" + "1" * 4500 + "-16:k3e3",
    '{"kind": "fuzz"}',
    '{"kind": ["chain"]}',
    '{"kind": "chain", "layers": 5}',
    '{"kind": "chain", "layers": [{"type": "C", "out_channels": "x", "kernel_size": []}]}',
    '{"kind": "elastic"}',
    '{"kind": "zoo", "name": ' + "[" * 300 + "]" * 300 + "}",
    "[" * 5000 + "]" * 5000,
    '{"kind": "chain", "layers": [' + "1" * 5000 + "]}",
    '{"kind": "chain", "x": NaN}',
]


def arch_text(seed: SeedFile, rng: np.random.Generator, _: Path) -> Mutant:
    """The architecture string a reader parses into a model: digit runs past int()'s 4,300-digit limit,
    JSON of an unknown kind, of wrong types, too deep, or with NaN."""
    field = "global_arch" if seed.kind == "package" else "arch"
    arch = str(_pick(rng, _HOSTILE_ARCHS))
    # the device builds the package's global model from its arch; the server runs a teacher's ONNX and
    # keeps its arch as a label, so an unparsable one may be accepted there, but must not crash
    refuse = seed.kind == "package"
    return Mutant(rewrite(seed, {(field,): arch}), f"{field} = {arch[:40]!r}...", must_refuse=refuse)


def nonfinite_tensors(seed: SeedFile, rng: np.random.Generator, _: Path) -> Mutant:
    """NaN or +-Inf in a float tensor of a weights file (a supernet, shared weights)."""
    header, body = _safetensors_parts(seed.wire["tensors"])
    names = sorted(k for k in header if k != "__metadata__" and header[k]["dtype"] in ("F32", "F64"))
    name = str(_pick(rng, names))
    dtype = np.float32 if header[name]["dtype"] == "F32" else np.float64
    begin, end = header[name]["data_offsets"]
    values = np.frombuffer(body[begin:end], dtype=dtype).copy()
    value = _pick(rng, [np.nan, np.inf, -np.inf])
    values[int(rng.integers(values.size))] = value
    blob = seed.wire["tensors"][: len(seed.wire["tensors"]) - len(body)]
    blob += body[:begin] + values.tobytes() + body[end:]
    return Mutant(rewrite(seed, {("tensors",): blob}), f"one value of {name} = {value}", must_refuse=True)


def _hostile(fn: Callable[[bytes, np.random.Generator, Path], tuple[bytes, str, bool]]) -> Mutate:
    def mutate(seed: SeedFile, rng: np.random.Generator, workdir: Path) -> Mutant:
        return Mutant(*fn(seed.data, rng, workdir))

    mutate.__name__ = fn.__name__
    return mutate


@dataclass(frozen=True)
class Mutator:
    name: str
    kinds: tuple[str, ...]
    mutate: Mutate


_ALL = seeds_module.WIRE_KINDS
_BYTES = (*_ALL, "config", "init")  # raw byte mutations: files read as they are
_ONNX_KINDS = ("classifier", "decoder", "package")
_WEIGHTS_KINDS = ("supernet", "weights")

MUTATORS: dict[str, Mutator] = {
    m.name: m
    for m in [
        Mutator("byte_flip", _BYTES, byte_flip),
        Mutator("truncate", _BYTES, truncate),
        Mutator("insert", _BYTES, insert),
        Mutator("field_type", _ALL, field_type),
        Mutator("field_int", _ALL, field_int),
        Mutator("huge_container", _ALL, huge_container),
        Mutator("extra_key", _ALL, extra_key),
        Mutator("missing_key", _ALL, missing_key),
        Mutator("duplicate_key", _ALL, duplicate_key),
        Mutator("schema_version", _ALL, schema_version),
        Mutator("semantic", _ALL, semantic),
        Mutator("onnx_bytes", _ONNX_KINDS, onnx_bytes),
        *(Mutator(name, _ONNX_KINDS, _onnx_mutator(name)) for name in ONNX_MUTATIONS),
        Mutator("safetensors_header", _WEIGHTS_KINDS, safetensors_header),
        Mutator("mixed_keys", _ALL, mixed_keys),
        Mutator("deep_nesting", _ALL, deep_nesting),
        Mutator("arch_text", _ONNX_KINDS, arch_text),
        Mutator("nonfinite_tensors", _WEIGHTS_KINDS, nonfinite_tensors),
        *(Mutator(name, kinds, _hostile(fn)) for name, (kinds, fn) in HOSTILE_MUTATIONS.items()),
    ]
}


def case_rng(kind: str, mutator: str, seed: int, index: int) -> np.random.Generator:
    """The one random stream of a case (crc32, not hash(): stable across processes and runs)."""
    return np.random.default_rng([seed, index, zlib.crc32(kind.encode()), zlib.crc32(mutator.encode())])


def make_mutant(seed_file: SeedFile, mutator: str, seed: int, index: int, workdir: Path) -> Mutant:
    if mutator not in MUTATORS or seed_file.kind not in MUTATORS[mutator].kinds:
        raise HarnessError(f"mutator {mutator!r} does not apply to {seed_file.kind!r}")
    return MUTATORS[mutator].mutate(seed_file, case_rng(seed_file.kind, mutator, seed, index), workdir)
