"""The device side of the Flower app (issue #21): a ClientApp over the device pipeline, and the messages.

One-shot over Flower's Message API, three messages a device answers (``server_kit.federation.flower_server``
sends
them; both sides share the encoding defined here):

* ``query``: the device says which client it is (``partition-id`` / ``num-partitions`` of its node
  config, what the simulation engine sets and a SuperNode is given with ``--node-config``).
* ``train``: its :class:`FlowerTask` (the client settings, its device profile as TOML, how to find its
  data, the shared initial weights when there are any); it runs :func:`edge_sdk.client.run_client` on
  its local data, exactly as ``server-kit simulate`` runs client ``k``, and replies with its bundles.
* ``train.personalize``: its personalization package (:mod:`export.package`), checked against the model
  it uploaded and kept in its node state for ``edge-sdk personalize``.

Files travel as one uint8 :class:`flwr.app.Array` each with stype :data:`RAW_STYPE`: ``data`` is the
file's bytes verbatim (nothing to unpickle or parse before the reader's own bounded decoder), and Flower
chunks arrays for the transport. Everything read from a message is bounded before it is parsed.

A node finds its data in its node config: ``data-path`` (a client ``.npz``, a real device's own data),
else ``partition-id`` of ``num-partitions``: the split :func:`edge_sdk.data.client_datasets` gives that
client for the task's partition settings, the tensors ``server-kit simulate`` writes to its file.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, RecordDict
from flwr.clientapp import ClientApp

from common.checks import check_int, load_json, load_toml
from common.configs import config_from_dict
from common.errors import BundleError, ConfigError, DataError
from edge_sdk.artifacts import decoder_bundle_path
from edge_sdk.client import ClientConfig, run_client
from edge_sdk.data import ArrayDataset, client_datasets, load_client_data
from edge_sdk.search import search_config_from_dict
from edge_sdk.shared_init import MAX_INIT_BYTES, read_initial_weights
from export.atomic import atomic_write_bytes
from export.bundle import MAX_MODEL_BYTES, bundle_from_bytes
from export.package import MAX_PACKAGE_BYTES, package_from_bytes
from profiles import DeviceProfile, profile_to_toml

__all__ = [
    "MAX_TASK_TEXT_BYTES",
    "PACKAGE_FILE",
    "PERSONALIZE_ACTION",
    "RAW_STYPE",
    "FlowerTask",
    "NodeId",
    "app",
    "array_bytes",
    "bytes_array",
    "check_keys",
    "node_data",
    "node_identity",
    "run_task",
]

RAW_STYPE = "raw"  # an Array whose data is a file's bytes as they are (dtype uint8, shape (len,))
MAX_TASK_TEXT_BYTES = 1 << 20  # each text field of a task (JSON settings, profile TOML): far above real ones
PERSONALIZE_ACTION = "personalize"  # message type train.personalize
PACKAGE_FILE = "personalization.package"  # where a node with a work-dir keeps its package
STATE_KEY = "oneshot"  # the node state's record: the model this node uploaded


def bytes_array(data: bytes) -> Array:
    """``data`` as a uint8 Array of stype :data:`RAW_STYPE` (no copy into a numpy file format)."""
    return Array(dtype="uint8", shape=(len(data),), stype=RAW_STYPE, data=bytes(data))


def array_bytes(record: object, key: str, *, max_bytes: int, source: str) -> bytes:
    """The bytes of ``record[key]`` (an ArrayRecord from a message), refused with a BundleError before
    anything is parsed when it is not a uint8 :data:`RAW_STYPE` array whose shape is its length, or holds
    more than ``max_bytes``."""
    if not isinstance(record, ArrayRecord):
        raise BundleError(f"{source}: expected an ArrayRecord, got {type(record).__name__}")
    array = record.get(key)
    if not isinstance(array, Array):
        raise BundleError(f"{source}: expected the array {key!r}, got keys {sorted(record)[:10]}")
    size = len(array.data) if isinstance(array.data, bytes) else -1
    if size > max_bytes:
        raise BundleError(
            f"{source}: {key!r} is {size} bytes, more than the {max_bytes} accepted; fix: raise the bound "
            "(max_bundle_bytes) if such files are expected"
        )
    if (array.dtype, array.stype, tuple(array.shape)) != ("uint8", RAW_STYPE, (size,)) or size < 1:
        raise BundleError(
            f"{source}: {key!r} must be a non-empty uint8 array of stype {RAW_STYPE!r} and shape (its "
            f"length,), got dtype {str(array.dtype)[:40]!r}, stype {str(array.stype)[:40]!r}, shape "
            f"{tuple(array.shape)[:4]} over {size} bytes; fix: send it with bytes_array"
        )
    return array.data


def check_keys(content: RecordDict, required: set[str], optional: set[str], source: str) -> None:
    """BundleError unless ``content`` holds the ``required`` records and nothing but ``optional`` ones."""
    keys = set(content)
    missing, unknown = sorted(required - keys), sorted(keys - required - optional)
    if missing or unknown:
        raise BundleError(
            f"{source}: message records wrong: missing {missing}, unknown {[k[:40] for k in unknown[:10]]}; "
            f"expected {sorted(required)} (+ optional {sorted(optional)})"
        )


def _text(record: ConfigRecord, key: str, source: str, *, required: bool = True) -> str | None:
    value = record.get(key)
    if value is None and not required:
        return None
    if not isinstance(value, str) or len(value.encode("utf-8")) > MAX_TASK_TEXT_BYTES:
        raise BundleError(
            f"{source}: {key!r} must be a str of at most {MAX_TASK_TEXT_BYTES} bytes, got "
            f"{type(value).__name__} of {len(value) if isinstance(value, str) else 0} characters"
        )
    return value


def _client_config_dict(config: ClientConfig) -> dict[str, Any]:
    """Every field of ``config`` but ``init`` (a path on the server; the bytes travel in the task) and
    ``progress``, as :func:`common.configs.config_from_dict` reads it back."""
    return {
        "search": config.search.to_dict(),
        "cvae": config.cvae.to_dict(),
        "val_fraction": config.val_fraction,
        "seed": config.seed,
        "device": config.device,
        "role": config.role,
        "unknown_output": config.unknown_output,
        "precision": config.precision,
    }


@dataclass(frozen=True, kw_only=True)
class FlowerTask:
    """What the server asks of one device: ``client`` (its settings, ``init`` unset: the initial weights
    travel as ``init`` bytes), its ``profile``, the ``partition`` settings that name its split when its
    node holds no data file (:func:`edge_sdk.data.partition_settings`: dataset, num_clients, alpha, seed,
    min_size) and the ``data_root`` of datasets other than digits."""

    client: ClientConfig
    profile: DeviceProfile
    partition: Mapping[str, Any]
    data_root: str | None = None
    init: bytes | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.client, ClientConfig) or self.client.init is not None:
            raise ConfigError("client must be a ClientConfig without init (its bytes travel as init)")
        if not isinstance(self.profile, DeviceProfile):
            raise ConfigError(f"profile must be a DeviceProfile, got {type(self.profile).__name__}")
        expected = {"dataset", "num_clients", "alpha", "seed", "min_size"}
        if not isinstance(self.partition, Mapping) or set(self.partition) != expected:
            raise ConfigError(f"partition must have the keys {sorted(expected)}, got {self.partition!r}")
        if self.init is not None and not 0 < len(self.init) <= MAX_INIT_BYTES:
            raise ConfigError(f"init must be 1 to {MAX_INIT_BYTES} bytes, got {len(self.init)}")

    def to_content(self) -> RecordDict:
        """The task message's content."""
        task = ConfigRecord(
            {
                "client-config": json.dumps(_client_config_dict(self.client), sort_keys=True),
                "profile": profile_to_toml(self.profile),
                "partition": json.dumps(dict(self.partition), sort_keys=True),
                "data-root": self.data_root or "",
            }
        )
        records: dict[str, Any] = {"task": task}
        if self.init is not None:
            records["init"] = ArrayRecord({"init": bytes_array(self.init)})
        return RecordDict(records)

    @classmethod
    def from_content(cls, content: RecordDict, *, source: str = "task") -> FlowerTask:
        """The task in a message's content, every field bounded and validated (BundleError for a
        malformed message, ConfigError / ProfileError for settings that are not valid)."""
        check_keys(content, {"task"}, {"init"}, source)
        task = content["task"]
        if not isinstance(task, ConfigRecord):
            raise BundleError(f"{source}: 'task' must be a ConfigRecord, got {type(task).__name__}")
        settings = load_json(
            _text(task, "client-config", source) or "", f"{source} client-config", error=BundleError
        )
        partition = load_json(
            _text(task, "partition", source) or "", f"{source} partition", error=BundleError
        )
        profile_data = load_toml(_text(task, "profile", source) or "", f"{source} profile", error=BundleError)
        client = config_from_dict(
            ClientConfig, settings, what="client-config", builders={"search": search_config_from_dict}
        )
        init = None
        if "init" in content:
            init = array_bytes(content["init"], "init", max_bytes=MAX_INIT_BYTES, source=f"{source} init")
        return cls(
            client=client,
            profile=DeviceProfile.from_dict(profile_data, source=f"{source} profile"),
            partition=partition,
            data_root=_text(task, "data-root", source, required=False) or None,
            init=init,
        )


@dataclass(frozen=True)
class NodeId:
    """Which client a node is: ``partition`` of ``num_partitions``."""

    partition: int
    num_partitions: int

    def __post_init__(self) -> None:
        check_int("num-partitions", self.num_partitions, 1, error=BundleError)
        check_int("partition-id", self.partition, 0, self.num_partitions - 1, error=BundleError)


def node_identity(node_config: Mapping[str, Any]) -> NodeId:
    """The node's ``partition-id`` / ``num-partitions`` (ConfigError naming the fix when absent)."""
    if "partition-id" not in node_config or "num-partitions" not in node_config:
        raise ConfigError(
            "the node config must give partition-id and num-partitions (the simulation engine sets them; "
            'a SuperNode: --node-config "partition-id=0 num-partitions=2"), got '
            f"{sorted(node_config)}"
        )
    try:
        return NodeId(node_config["partition-id"], node_config["num-partitions"])
    except BundleError as err:
        raise ConfigError(f"node config: {err}") from err


@functools.lru_cache(maxsize=2)
def _partition(
    dataset: str, data_root: str | None, num_clients: int, alpha: float, seed: int, min_size: int
) -> list[ArrayDataset]:
    """Every client's split (cached: a simulation worker serves many nodes of one partition)."""
    return client_datasets(
        dataset, data_root, num_clients=num_clients, alpha=alpha, seed=seed, min_size=min_size
    )


def node_data(node_config: Mapping[str, Any], task: FlowerTask) -> ArrayDataset:
    """This node's local data: its ``data-path`` file, else its partition of the task's data set."""
    if "data-path" in node_config:
        return load_client_data(str(node_config["data-path"]))
    node = node_identity(node_config)
    if node.num_partitions != task.partition["num_clients"]:
        raise DataError(
            f"this node is partition {node.partition} of {node.num_partitions}, the task partitions the "
            f"data among {task.partition['num_clients']} clients; fix: start as many nodes as num_clients"
        )
    p = task.partition
    splits = _partition(p["dataset"], task.data_root, p["num_clients"], p["alpha"], p["seed"], p["min_size"])
    return splits[node.partition]


def run_task(task: FlowerTask, data: ArrayDataset) -> dict[str, bytes]:
    """Run the device pipeline on ``data`` in a scratch directory; returns the bundles' bytes by role:
    ``bundle`` (the classifier, or the decoder of a ``cvae`` client) and ``decoder`` (role ``both``)."""
    with tempfile.TemporaryDirectory(prefix="oneshot-flower-") as scratch:
        config = task.client
        if task.init is not None:  # held to the contract for this device's task before it is written
            read_initial_weights(task.init, input_shape=data.input_shape, num_classes=data.num_classes)
            path = atomic_write_bytes(Path(scratch) / "init.onnx", task.init)
            config = dataclasses.replace(config, init=str(path))
        out = Path(scratch) / "client.bundle"
        result = run_client(data, profile=task.profile, config=config, out=out)
        files = {"bundle": result.bundle_path.read_bytes()}
        if result.role == "both":
            files["decoder"] = decoder_bundle_path(out).read_bytes()
        return files


app = ClientApp()


@app.query()
def identify(msg: Message, context: Context) -> Message:
    """Reply which client this node is."""
    node = node_identity(context.node_config)
    record = ConfigRecord({"partition-id": node.partition, "num-partitions": node.num_partitions})
    return Message(RecordDict({"node": record}), reply_to=msg)


@app.train()
def train(msg: Message, context: Context) -> Message:
    """Run the task on this node's data and reply with the bundles (an exception becomes Flower's error
    reply, which the server refuses and logs). The uploaded model stays in the node state, so a
    personalization package can be checked against it."""
    task = FlowerTask.from_content(msg.content)
    data = node_data(context.node_config, task)
    files = run_task(task, data)
    model = bundle_from_bytes(files["bundle"], source="own bundle").model_onnx
    context.state[STATE_KEY] = ArrayRecord({"model": bytes_array(model)})
    bundles = ArrayRecord({role: bytes_array(data) for role, data in files.items()})
    return Message(RecordDict({"bundles": bundles}), reply_to=msg)


@app.train(PERSONALIZE_ACTION)
def receive_package(msg: Message, context: Context) -> Message:
    """Check the personalization package against the model this node uploaded and keep it (the node
    config's ``work-dir``, when given, gets :data:`PACKAGE_FILE` for ``edge-sdk personalize``)."""
    source = "personalization message"
    check_keys(msg.content, {"package"}, set(), source)
    data = array_bytes(msg.content["package"], "package", max_bytes=MAX_PACKAGE_BYTES, source=source)
    package = package_from_bytes(data, source=source)
    own = context.state.get(STATE_KEY)
    if not isinstance(own, ArrayRecord):
        raise BundleError(f"{source}: this node uploaded no model in this run, so no package is for it")
    package.check_for(array_bytes(own, "model", max_bytes=MAX_MODEL_BYTES, source="node state"))
    written = ""
    if "work-dir" in context.node_config:  # a fixed name: the package's client field comes from the wire
        target = Path(str(context.node_config["work-dir"])) / PACKAGE_FILE
        written = str(atomic_write_bytes(target, data))
    ack = ConfigRecord({"client": package.client, "bytes": len(data), "path": written})
    return Message(RecordDict({"ack": ack}), reply_to=msg)
