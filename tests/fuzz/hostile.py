"""Issue #34's boundaries beyond the wire files: config files, shared initial weights, a Flower task's
fields and a run directory given to ``server-kit report``. One honest seed, one consumer and one
generator of hostile variants per boundary.

A seed here is bytes the harness can mutate like any other file; what the bytes stand for is the
consumer's business: ``config`` is ``<suffix>\\n<file text>`` (or ``fifo:<suffix>`` / ``link:<target>``
for a special file), ``init`` the ONNX file itself, ``task`` a msgpack map of the task's text fields,
``run`` a msgpack map of run-relative paths to file bytes, or to ``{"link": target}``, ``{"fifo": 1}``
or ``{"sparse": size}`` entries. Links point at the secret the runner plants (``../`` from the case's
work dir): following one is a leak the runner sees.
"""

from __future__ import annotations

import io
import json
import os
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import onnx
from flwr.app import ConfigRecord, RecordDict
from PIL import Image

from common.configs import read_config_file
from edge_sdk.flower_client import FlowerTask
from edge_sdk.shared_init import initial_weights, read_initial_weights
from profiles import load_profile, profile_to_toml
from server_kit.federation.simulate import SimulateConfig
from server_kit.report.html import write_report
from tests.fuzz.onnx_mutators import ONNX_MUTATIONS, SECRET_NAME

__all__ = ["HOSTILE_KINDS", "HOSTILE_MUTATIONS", "build_hostile_seeds", "hostile_consumers"]

HOSTILE_KINDS = ("config", "init", "task", "run")
_SHAPE, _CLASSES, _ARCH = (1, 8, 8), 10, "C4k3-P-F10"
Variant = tuple[bytes, str, bool]  # (mutant bytes, note, must_refuse)


def _pick(rng: np.random.Generator, options: list[Any]) -> Any:
    return options[int(rng.integers(len(options)))]


def _pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


# ------------------------------------------------------------------------------------------------ seeds


def _png() -> bytes:
    out = io.BytesIO()
    Image.fromarray(np.arange(64, dtype=np.uint8).reshape(8, 8)).save(out, format="PNG")
    return out.getvalue()


def _run_files() -> dict[str, Any]:
    results = {
        "config": {"dataset": "digits", "num_clients": 2},
        "seed": 0,
        "global_accuracy": 0.5,
        "mean_client_test_accuracy": 0.4,
        "seconds": {"total": 3.0, "clients": 2.0, "server": 1.0},
        "phase_order": ["clients", "server"],
        "clients": [{"index": 0, "test_accuracy": 0.4}, {"index": 1, "test_accuracy": 0.4}],
    }
    server = {"distill_loss": [2.0, 1.0, 0.5], "accuracy": 0.5, "per_class_accuracy": [0.5] * 10}
    return {
        "results.json": json.dumps(results).encode(),
        "server/report.json": json.dumps(server).encode(),
        "server/pseudo_images.png": _png(),
    }


def build_hostile_seeds(root: Path) -> dict[str, Path]:
    """Write the four honest seeds under ``root``; returns kind -> path."""
    config = SimulateConfig.from_dict({"dataset": "digits", "out_dir": "out", "num_clients": 2}).to_dict()
    client = {"seed": 3, "val_fraction": 0.2, "role": "classifier"}
    task = {
        "client-config": json.dumps(client),
        "profile": profile_to_toml(load_profile("laptop-cpu")),
        "partition": json.dumps(
            {"dataset": "digits", "num_clients": 2, "alpha": 0.5, "seed": 0, "min_size": 1}
        ),
        "data-root": "",
    }
    blobs = {
        "config": b"json\n" + json.dumps(config).encode(),
        "init": initial_weights(_ARCH, _SHAPE, _CLASSES, seed=0),
        "task": _pack(task),
        "run": _pack(_run_files()),
    }
    paths = {}
    for kind, data in blobs.items():
        paths[kind] = root / f"{kind}.seed"
        paths[kind].write_bytes(data)
    return paths


# -------------------------------------------------------------------------------------------- consumers


def consume_config(path: Path, _seeds: object, workdir: Path) -> list[bytes]:
    """``--config FILE``: read it and build the federation's config from it."""
    header, _, body = path.read_bytes().partition(b"\n")
    kind = header.decode("ascii", "replace")
    suffix = "".join(c for c in kind.rpartition(":")[2] if c.isalnum())[:8]
    target = workdir / f"config.{suffix}"
    if kind.startswith("fifo:"):
        os.mkfifo(target)
    elif kind.startswith("link:"):
        target = workdir / "config.toml"
        target.symlink_to(kind.removeprefix("link:"))
    else:
        target.write_bytes(body)
    data = read_config_file(target)
    return [json.dumps(SimulateConfig.from_dict(data).to_dict(), default=str).encode()]


def consume_init(path: Path, _seeds: object, _workdir: Path) -> list[bytes]:
    """``edge-sdk run --init FILE``: the shared initial weights, for this device's task."""
    weights = read_initial_weights(path, input_shape=_SHAPE, num_classes=_CLASSES)
    return [t.detach().numpy().tobytes() for t in weights.module.state_dict().values()]


def consume_task(path: Path, _seeds: object, _workdir: Path) -> list[bytes]:
    """A Flower task message's content, as the device reads it (and the config it builds)."""
    fields = msgpack.unpackb(path.read_bytes(), raw=False)
    task = FlowerTask.from_content(RecordDict({"task": ConfigRecord(fields)}))
    return [json.dumps(task.client.to_dict(), default=str).encode()]


def _materialize(files: dict[str, Any], run: Path) -> None:
    for rel, value in files.items():
        target = run / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(value, bytes):
            target.write_bytes(value)
        elif "link" in value:
            target.symlink_to(value["link"])
        elif "fifo" in value:
            os.mkfifo(target)
        else:  # a sparse file: its size on disk is nothing, reading it whole is not
            with open(target, "wb") as fh:
                fh.truncate(value["sparse"])


def consume_run(path: Path, _seeds: object, workdir: Path) -> list[bytes]:
    """``server-kit report RUN_DIR`` on a run directory whose files came from elsewhere."""
    run = workdir / "run"
    _materialize(msgpack.unpackb(path.read_bytes(), raw=False), run)
    return [write_report(run).read_bytes()]


def hostile_consumers() -> dict[str, Any]:
    return {"config": consume_config, "init": consume_init, "task": consume_task, "run": consume_run}


# ------------------------------------------------------------------------------------------- mutations

_BOMB = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{b}: &{b} [{', '.join([f'*{a}'] * 9)}]\n" for a, b in zip("abcdefgh", "bcdefghi", strict=True)
)
_DEEP = 5000


_CONFIG_FILES = ["bomb", "deep", "utf8", "fifo", "zero"]
_CONFIG_VALUES = ["container", "value", "bigint", "nonfinite"]


def _config_variant(rng: np.random.Generator, seed: dict[str, Any], variants: list[str]) -> Variant:
    """Config files that must be refused: special files, undecodable bytes, bombs, deep or wrong
    containers, values of the wrong type or range."""
    what = str(_pick(rng, variants))
    if what == "bomb":
        return b"yaml\n" + _BOMB.encode(), "YAML alias bomb", True
    if what == "deep":
        fmt = str(_pick(rng, ["json", "toml", "yaml"]))
        body = {"json": "[" * _DEEP + "]" * _DEEP, "toml": "x = " + "[" * _DEEP + "]" * _DEEP}
        text = body.get(fmt, "x: " + "[" * _DEEP + "]" * _DEEP)
        return f"{fmt}\n{text}".encode(), f"{fmt} nested {_DEEP} deep", True
    if what == "utf8":
        return b"toml\nseed = 1\n# \xff\xfe\xc3\x28\n", "non-UTF-8 bytes", True
    if what == "fifo":
        return b"fifo:toml\n", "a FIFO as --config", True
    if what == "zero":
        return _pick(rng, [b"link:/dev/zero\n", b"link:/dev/urandom\n"]), "a device as --config", True
    changed = dict(seed)
    if what == "container":
        key = str(_pick(rng, ["aggregate", "search", "cvae", "profiles", "num_clients", "seed"]))
        changed[key] = _pick(rng, [[1, 2], {"k": 1}, "x", []])  # {} is a partial table: valid
        note = f"{key} = {changed[key]!r}"
    elif what == "value":
        key, value = _pick(
            rng,
            [
                ("seed", -1),
                ("seed", True),
                ("seed", 1.5),
                ("num_clients", 0),
                ("num_clients", -3),
                ("alpha", -1.0),
                ("alpha", 0),
                ("jobs", 0),
                ("dataset", ""),
            ],
        )
        changed[key] = value
        note = f"{key} = {value!r}"
    elif what == "bigint":
        key = str(_pick(rng, ["seed", "num_clients"]))
        text = json.dumps(changed).replace(f'"{key}": {changed[key]}', f'"{key}": {"9" * 5000}')
        return b"json\n" + text.encode(), f"{key} of 5000 digits", True
    else:
        key = str(_pick(rng, ["alpha", "seed"]))
        text = json.dumps({**changed, key: float(_pick(rng, [np.nan, np.inf]))})
        return b"json\n" + text.encode(), f"{key} not finite", True
    return b"json\n" + json.dumps(changed).encode(), note, True


def config_files(data: bytes, rng: np.random.Generator, _: Path) -> Variant:
    return _config_variant(rng, json.loads(data.partition(b"\n")[2]), _CONFIG_FILES)


def config_values(data: bytes, rng: np.random.Generator, _: Path) -> Variant:
    return _config_variant(rng, json.loads(data.partition(b"\n")[2]), _CONFIG_VALUES)


def _set_metadata(model: onnx.ModelProto, key: str, value: str) -> None:
    kept = [(p.key, p.value) for p in model.metadata_props if p.key != key]
    del model.metadata_props[:]
    for k, v in [*kept, (key, value)]:
        model.metadata_props.add(key=k, value=v)


def init_graph(data: bytes, rng: np.random.Generator, workdir: Path) -> Variant:
    """Shared initial weights with a hostile graph (every ONNX mutation, NaN weights included)."""
    model = onnx.load_from_string(data)
    name = str(_pick(rng, sorted(ONNX_MUTATIONS)))
    note = ONNX_MUTATIONS[name](model, rng, workdir)
    return model.SerializeToString(), f"{name}: {note}", name != "onnx_input_dims"


def init_metadata(data: bytes, rng: np.random.Generator, _: Path) -> Variant:
    """Shared initial weights with hostile metadata (deep JSON, long ints, a foreign arch)."""
    model = onnx.load_from_string(data)
    key, value = _pick(
        rng,
        [
            ("input_shape", "[" * 3000 + "]" * 3000),
            ("input_shape", "[1, 8, " + "8" * 5000 + "]"),
            ("input_shape", "[1, 8, NaN]"),
            ("seed", "9" * 5000),
            ("seed", "-1"),
            ("arch", "C" + "4" * 5000 + "k3-P-F10"),
            ("arch", '{"kind": "fuzz"}'),
            ("role", "x" * 100),
        ],
    )
    _set_metadata(model, key, value)
    return model.SerializeToString(), f"metadata {key} = {value[:30]!r}...", True


def _task_variants(client: dict[str, Any]) -> list[tuple[str, str, bool]]:
    return [
        ("client-config", "[" * _DEEP + "]" * _DEEP, True),
        ("client-config", json.dumps({**client, "seed": "NaN"}).replace('"NaN"', "NaN"), True),
        ("client-config", json.dumps({**client, "seed": -1}), True),
        ("client-config", json.dumps({**client, "seed": True}), True),
        ("client-config", json.dumps({**client, "seed": 2**70}), True),
        ("client-config", json.dumps(client).replace("0.2", "9" * 5000), True),
        ("client-config", json.dumps({**client, "search": [1]}), True),
        ("client-config", json.dumps({**client, "device": 5}), True),
        ("client-config", json.dumps([client]), True),
        ("partition", '{"dataset": ' + "[" * _DEEP + "]" * _DEEP + "}", True),
        ("partition", json.dumps({"a": 1}), True),
        ("profile", "x = " + "[" * _DEEP + "]" * _DEEP, True),
        ("profile", "memory_mb = " + "9" * 5000, True),
        ("profile", "name = 5", True),
        ("data-root", "\x00" * 8, False),
    ]


def _task(data: bytes, rng: np.random.Generator, json_fields: bool) -> Variant:
    """A Flower task whose fields are deep, huge, non-finite or of the wrong type."""
    fields = msgpack.unpackb(data, raw=False)
    variants = _task_variants(json.loads(fields["client-config"]))
    variants = [v for v in variants if (v[0] in ("client-config", "partition")) == json_fields]
    field, value, refuse = _pick(rng, variants)
    fields[field] = value
    return _pack(fields), f"{field} = {value[:40]!r}...", refuse


def task_json(data: bytes, rng: np.random.Generator, _: Path) -> Variant:
    return _task(data, rng, json_fields=True)


def task_text(data: bytes, rng: np.random.Generator, _: Path) -> Variant:
    return _task(data, rng, json_fields=False)


_OUTSIDE = f"../../{SECRET_NAME}"  # from run/server/: the case's work dir, where the secret lies


def _run(data: bytes, rng: np.random.Generator, variants: list[str]) -> Variant:
    """A run directory with links out of it, special or huge files, and values past any drawable range."""
    files = msgpack.unpackb(data, raw=False)
    results = json.loads(files["results.json"])
    what = str(_pick(rng, variants))
    refuse = what not in ("grid_link", "huge")
    if what == "grid_link":  # not drawn, not opened: the runner watches the secret
        files["server/pseudo_images.png"] = {"link": _OUTSIDE}
    elif what == "dir_link":
        files["outside/report.json"] = files.pop("server/report.json")
        del files["server/pseudo_images.png"]
        files["server"] = {"link": "outside"}
    elif what == "json_link":
        files[str(_pick(rng, ["results.json", "server/report.json"]))] = {"link": f"../{SECRET_NAME}"}
    elif what == "fifo":
        files[str(_pick(rng, ["results.json", "server/report.json"]))] = {"fifo": 1}
    elif what == "sparse":
        files["results.json"] = {"sparse": 1 << 30}
    elif what == "huge":
        value = _pick(rng, [1e308, -1e308, 2**63, -(2**63), 1e300])
        results.update(global_accuracy=value, started_at=value, seconds={"total": value, "clients": value})
        results["clients"] = [{"index": 0, "test_accuracy": value}]
        files["results.json"] = json.dumps(results).encode()
        files["server/report.json"] = json.dumps({"distill_loss": [value, 1.0], "accuracy": value}).encode()
    elif what == "deep":
        files["server/report.json"] = ("[" * _DEEP + "]" * _DEEP).encode()
    else:
        files["results.json"] = b'{"config": "\xff\xfe"}'
    return _pack(files), what, refuse


def run_links(data: bytes, rng: np.random.Generator, _: Path) -> Variant:
    return _run(data, rng, ["grid_link", "dir_link", "json_link"])


def run_files(data: bytes, rng: np.random.Generator, _: Path) -> Variant:
    return _run(data, rng, ["fifo", "sparse", "deep", "utf8"])


def run_values(data: bytes, rng: np.random.Generator, _: Path) -> Variant:
    return _run(data, rng, ["huge"])


HOSTILE_MUTATIONS = {
    "config_files": (("config",), config_files),
    "config_values": (("config",), config_values),
    "init_graph": (("init",), init_graph),
    "init_metadata": (("init",), init_metadata),
    "task_json": (("task",), task_json),
    "task_text": (("task",), task_text),
    "run_links": (("run",), run_links),
    "run_files": (("run",), run_files),
    "run_values": (("run",), run_values),
}
