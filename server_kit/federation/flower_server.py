"""The server side of the Flower app (issue #21): a ServerApp for the one-shot round.

One round, as ``server-kit simulate`` runs it but with the clients on Flower nodes:

1. wait for ``num_clients`` nodes, ask each which client it is (``query``: its ``partition-id``);
2. plan the clients exactly as :func:`server_kit.federation.simulate.simulate` does
(:func:`simulate.plan_clients`:
   profile, seed ``seed + k``, role, shared initial weights) and send each its
   :class:`edge_sdk.flower_client.FlowerTask` (``train``);
3. hold every reply to the checks of a bundle file (:func:`check_reply`: the size bound before anything
   is parsed, then :func:`export.bundle.bundle_from_bytes`); a bad, oversized or missing reply is refused
   and logged, and the round goes on with the rest;
4. :func:`server_kit.aggregate.aggregate` on the accepted bundles in memory (named as simulate names its
   files, in client order; ``on_error="skip"``: an upload whose model fails the ONNX contract or the
   teacher probe is refused too), ``global.onnx`` and the accuracy on the dataset's test split;
5. optionally (``personalize``) PKE packages (:func:`server_kit.personalization.pke.personalize_server`),
each sent to
   its device in a second message (``train.personalize``).

The same federation knobs give the same clients, the same uploads and so the same ``global.onnx`` as
``server-kit simulate`` (tests/server_kit/test_flower.py). ``out_dir`` gets ``clients/`` (the accepted
uploads), ``server/`` (the aggregation), ``packages/`` and ``flower_results.json``. The knobs are the
app's run config (``[tool.flwr.app.config]`` in pyproject.toml, ``flwr run --run-config``):
:class:`FlowerServerConfig`.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MessageType, RecordDict
from flwr.serverapp import Grid, ServerApp

from common.checks import check_int, check_number, check_real_dir
from common.configs import config_from_dict
from common.errors import BundleError, ConfigError, TeacherError
from common.timing import timed
from edge_sdk.artifacts import decoder_bundle_path
from edge_sdk.data import client_name, load_dataset, partition_settings
from edge_sdk.flower_client import (
    PERSONALIZE_ACTION,
    FlowerTask,
    NodeId,
    array_bytes,
    bytes_array,
    check_keys,
)
from export.atomic import atomic_write_bytes, atomic_write_json
from export.bundle import MAX_BUNDLE_BYTES, bundle_from_bytes
from profiles import load_profile
from server_kit.aggregate import aggregate
from server_kit.federation.simulate import SimulateConfig, plan_clients
from server_kit.personalization import PKEConfig, personalize_server

__all__ = [
    "DEFAULT_MAX_BUNDLE_BYTES",
    "RESULTS_FILE",
    "FlowerResult",
    "FlowerServerConfig",
    "Refusal",
    "app",
    "check_reply",
    "make_server_app",
    "run_round",
]

log = logging.getLogger(__name__)

# a reply's bytes (its bundles together) the server accepts: MNIST-sized teachers are far below it
# (benchmarks/RESULTS.md, "Numbers once kept in the code's comments", gives the sizes seen)
DEFAULT_MAX_BUNDLE_BYTES = 256 << 20
RESULTS_FILE = "flower_results.json"
_ERROR_CHARS = 500  # of a device's error text kept in a log line


@dataclass(frozen=True, kw_only=True)
class FlowerServerConfig:
    """The ServerApp's knobs: ``federation`` (what ``server-kit simulate`` takes; ``out_dir`` is where the
    ServerApp writes), the bound on a reply's bytes, how long to wait for the nodes and for the replies,
    and whether to send PKE personalization packages in a second message."""

    federation: SimulateConfig
    max_bundle_bytes: int = DEFAULT_MAX_BUNDLE_BYTES
    wait_nodes_s: float = 300.0  # for num_clients nodes to connect (a deployment's SuperNodes start late)
    timeout_s: float = 3600.0  # for the replies of one message round
    personalize: bool = False
    pke: PKEConfig = field(default_factory=PKEConfig)

    def __post_init__(self) -> None:
        if not isinstance(self.federation, SimulateConfig):
            raise ConfigError(f"federation must be a SimulateConfig, got {type(self.federation).__name__}")
        if self.federation.image_size is not None:
            raise ConfigError(
                "image_size does not travel to Flower nodes; fix: resize the images to one size beforehand "
                "and drop image_size, or run the federation with server-kit simulate"
            )
        check_int("max_bundle_bytes", self.max_bundle_bytes, 1, MAX_BUNDLE_BYTES)
        check_number("wait_nodes_s", self.wait_nodes_s, positive=True)
        check_number("timeout_s", self.timeout_s, positive=True)
        if not isinstance(self.personalize, bool):
            raise ConfigError(f"personalize must be a bool, got {self.personalize!r}")
        if not isinstance(self.pke, PKEConfig):
            raise ConfigError(f"pke must be a PKEConfig, got {type(self.pke).__name__}")

    @classmethod
    def from_run_config(cls, run_config: Mapping[str, Any]) -> FlowerServerConfig:
        """From Flower's run config: flat keys, nested tables joined by dots (``search.strategy``). The
        keys of this class (``max_bundle_bytes``, ``wait_nodes_s``, ``timeout_s``, ``personalize``,
        ``pke.*``) are its own; every other key is a :class:`SimulateConfig` field (``dataset``,
        ``out_dir``, ``num_clients``, ``search.*``, ``aggregate.*``, ...), unknown ones refused."""
        table: dict[str, Any] = {}
        for key, value in run_config.items():
            *parents, leaf = str(key).split(".")
            node = table
            for part in parents:
                node = node.setdefault(part, {})
                if not isinstance(node, dict):
                    raise ConfigError(f"run config key {key!r} nests under a value; fix: rename one of them")
            node[leaf] = list(value) if isinstance(value, list) else value
        own = {f.name for f in dataclasses.fields(cls)} - {"federation"}
        settings = {k: table.pop(k) for k in list(table) if k in own}
        if "pke" in settings:
            settings["pke"] = config_from_dict(PKEConfig, settings["pke"], what="pke")
        if isinstance(table.get("profiles"), str):  # TOML lists are fine; a comma list reads as in the CLI
            table["profiles"] = [name.strip() for name in table["profiles"].split(",") if name.strip()]
        table.setdefault("progress", False)
        return cls(federation=SimulateConfig.from_dict(table), **settings)


@dataclass(frozen=True)
class Refusal:
    """A client whose upload the round went on without, and why."""

    client: str
    node_id: int
    reason: str


def check_reply(reply: Message, *, name: str, max_bytes: int) -> dict[str, bytes]:
    """The uploads in one ``train`` reply as file name -> bytes (``<name>.bundle``, and
    ``<name>.decoder.bundle`` for a device that uploads both), each held to the checks of a bundle file.

    The reply's size (every array's bytes together) is checked against ``max_bytes`` before any of it
    is parsed. BundleError for an error reply, records other than ``bundles``, arrays other than
    ``bundle`` / ``decoder``, a wrong dtype / stype / shape, or a bundle that fails
    :func:`export.bundle.bundle_from_bytes` (``decoder`` must be a cvae_decoder bundle).
    """
    if reply.has_error():
        reason = str(reply.error.reason)[:_ERROR_CHARS]
        raise BundleError(f"{name}: the device replied with error {reply.error.code}: {reason}")
    check_keys(reply.content, {"bundles"}, set(), name)
    record = reply.content["bundles"]
    if not isinstance(record, ArrayRecord):
        raise BundleError(f"{name}: 'bundles' must be an ArrayRecord, got {type(record).__name__}")
    roles = set(record)
    if "bundle" not in roles or not roles <= {"bundle", "decoder"}:
        raise BundleError(
            f"{name}: 'bundles' must hold 'bundle' (and 'decoder' for role both), got "
            f"{sorted(str(r)[:40] for r in roles)[:10]}"
        )
    total = sum(len(a.data) if isinstance(a.data, bytes) else 0 for a in record.values())
    if total > max_bytes:
        raise BundleError(
            f"{name}: the reply holds {total} bytes of bundles, more than the {max_bytes} accepted; refused "
            "before parsing (fix: raise max_bundle_bytes if such uploads are expected)"
        )
    files: dict[str, bytes] = {}
    for role in ("bundle", "decoder"):
        if role not in roles:
            continue
        file = f"{name}.bundle" if role == "bundle" else decoder_bundle_path(Path(f"{name}.bundle")).name
        data = array_bytes(record, role, max_bytes=max_bytes, source=file)
        bundle = bundle_from_bytes(data, source=file)
        if role == "decoder" and bundle.kind != "cvae_decoder":
            raise BundleError(f"{file}: the 'decoder' upload is a {bundle.kind!r} bundle, not a cvae_decoder")
        files[file] = data
    return files


def _wait_for_nodes(grid: Grid, wanted: int, wait_s: float) -> list[int]:
    """The connected nodes once ``wanted`` are there, or those there after ``wait_s`` seconds."""
    deadline = time.monotonic() + wait_s
    while True:
        nodes = sorted(grid.get_node_ids())
        if len(nodes) >= wanted or time.monotonic() >= deadline:
            if len(nodes) < wanted:
                log.warning("%d of %d nodes connected after %.0f s; going on", len(nodes), wanted, wait_s)
            return nodes
        time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))


def _identify(
    grid: Grid, nodes: list[int], num_clients: int, timeout_s: float, refused: list[Refusal]
) -> dict[int, int]:
    """node id -> client index, from each node's ``query`` reply (checked: ints, in range, unique)."""
    messages = [Message(RecordDict(), dst_node_id=node, message_type=MessageType.QUERY) for node in nodes]
    clients: dict[int, int] = {}
    for reply in grid.send_and_receive(messages, timeout=timeout_s):
        node = reply.metadata.src_node_id
        try:
            if reply.has_error():
                raise BundleError(f"error {reply.error.code}: {str(reply.error.reason)[:_ERROR_CHARS]}")
            check_keys(reply.content, {"node"}, set(), "query reply")
            record = reply.content["node"]
            if not isinstance(record, ConfigRecord):
                raise BundleError(f"'node' must be a ConfigRecord, got {type(record).__name__}")
            identity = NodeId(record.get("partition-id"), record.get("num-partitions"))  # type: ignore[arg-type]
            if identity.num_partitions != num_clients:
                raise BundleError(
                    f"the node is partition {identity.partition} of {identity.num_partitions}, the "
                    f"federation has {num_clients} clients; fix: give every node num-partitions={num_clients}"
                )
            if identity.partition in clients.values():
                raise BundleError(f"partition-id {identity.partition} is claimed by another node already")
        except BundleError as err:
            log.warning("node %d refused: %s", node, err)
            refused.append(Refusal("?", node, str(err)))
            continue
        clients[node] = identity.partition
    return dict(sorted(clients.items(), key=lambda item: item[1]))


@dataclass(frozen=True)
class FlowerResult:
    """What one round did (``flower_results.json``)."""

    global_onnx: Path
    global_accuracy: float | None
    clients: tuple[dict[str, Any], ...]
    refused: tuple[Refusal, ...]
    packages: tuple[str, ...]
    seconds: dict[str, float]


def run_round(grid: Grid, config: FlowerServerConfig) -> FlowerResult:
    """The one-shot round on ``grid`` (see the module docstring)."""
    fed = config.federation
    out = fed.out_dir
    for name in ("clients", "server", "packages"):  # a link there would take the files elsewhere
        check_real_dir(out / name)
    out.mkdir(parents=True, exist_ok=True)
    seconds: dict[str, float] = {}
    refused: list[Refusal] = []
    settings = partition_settings(
        fed.dataset, num_clients=fed.num_clients, alpha=fed.alpha, seed=fed.seed, min_size=fed.min_size
    )
    partition = {k: settings[k] for k in ("dataset", "num_clients", "alpha", "seed", "min_size")}

    with timed(seconds, "connect"):
        nodes = _wait_for_nodes(grid, fed.num_clients, config.wait_nodes_s)
        clients = _identify(grid, nodes, fed.num_clients, config.timeout_s, refused)
    test = load_dataset(fed.dataset, fed.data_root, split="test")
    plan = plan_clients(fed, test)
    names = {node: client_name(k, fed.num_clients) for node, k in clients.items()}

    with timed(seconds, "clients"):
        uploads_of = _train_round(grid, config, plan, clients, names, partition, refused)
    if not uploads_of:
        raise TeacherError(
            f"no device replied with a valid upload ({len(refused)} refused: "
            f"{'; '.join(f'{r.client}: {r.reason}' for r in refused)[:2000]}); see the log above"
        )
    # client order, each client's classifier before its decoder: the order simulate passes its files in
    uploads = {
        file: data for node in clients if node in uploads_of for file, data in uploads_of[node].items()
    }
    # a bundle that passes the file checks can still fail the ONNX contract or the teacher probe: that
    # upload is skipped and refused like a bad reply, never the round stopped by one device
    server_config = dataclasses.replace(fed.aggregate, on_error="skip")
    agg = aggregate(uploads, out / "server", config=server_config, eval_data=test, progress=False)
    for phase, value in agg.seconds.items():
        seconds[f"server_{phase}"] = value
    node_of = {name: node for node, name in names.items()}
    for skipped in agg.report["skipped"]:
        name = Path(skipped["file"]).name.split(".")[0]
        log.warning("%s refused by the server: %s", skipped["file"], skipped["reason"])
        refused.append(Refusal(name, node_of.get(name, -1), str(skipped["reason"])))

    packages: list[str] = []
    if config.personalize:
        with timed(seconds, "personalize"):
            teachers = {t["file"] for t in agg.report["teachers"]}  # the classifiers the server accepted
            accepted = {file: data for file, data in uploads.items() if file in teachers}
            packages = _personalize(grid, config, accepted, node_of, out, refused)
    rows = [
        {"client": clients[node], "name": names[node], "node_id": node, "uploads": sorted(uploads_of[node])}
        for node in clients
        if node in uploads_of
    ]
    result = FlowerResult(
        agg.global_onnx, agg.accuracy, tuple(rows), tuple(refused), tuple(packages), seconds
    )
    atomic_write_json(
        out / RESULTS_FILE,
        {
            "config": fed.to_dict(),
            "max_bundle_bytes": config.max_bundle_bytes,
            "global_accuracy": agg.accuracy,
            "clients": rows,
            "refused": [dataclasses.asdict(r) for r in refused],
            "packages": packages,
            "server_report": str(agg.report_path.relative_to(out)),
            "seconds": {k: round(v, 3) for k, v in seconds.items()},
        },
    )
    return result


def _train_round(
    grid: Grid,
    config: FlowerServerConfig,
    plan: Any,
    clients: dict[int, int],
    names: dict[int, str],
    partition: dict[str, Any],
    refused: list[Refusal],
) -> dict[int, dict[str, bytes]]:
    """Send each identified node its client's task and collect the replies: each held to a bundle file's
    checks and kept as simulate keeps its files, a bad or missing one refused (the round goes on)."""
    fed, out = config.federation, config.federation.out_dir
    init = plan.init.read_bytes() if plan.init is not None else None
    messages = []
    for node, k in clients.items():
        task = FlowerTask(
            client=dataclasses.replace(plan.configs[k], init=None),
            profile=load_profile(plan.profiles[k]),
            partition=partition,
            data_root=fed.data_root,
            init=init if plan.configs[k].init is not None else None,
        )
        messages.append(Message(task.to_content(), dst_node_id=node, message_type=MessageType.TRAIN))
    uploads_of: dict[int, dict[str, bytes]] = {}
    for reply in grid.send_and_receive(messages, timeout=config.timeout_s):
        node = reply.metadata.src_node_id
        if node not in clients:
            log.warning("a reply from node %d, which was sent no task, is ignored", node)
            continue
        try:
            uploads_of[node] = check_reply(reply, name=names[node], max_bytes=config.max_bundle_bytes)
        except BundleError as err:
            log.warning("%s (node %d) refused: %s", names[node], node, err)
            refused.append(Refusal(names[node], node, str(err)))
            continue
        for file, data in uploads_of[node].items():  # what was accepted, kept as simulate keeps it
            atomic_write_bytes(out / "clients" / file, data)
    for node in clients:
        if node not in uploads_of and all(r.node_id != node for r in refused):
            reason = f"no reply within timeout_s {config.timeout_s:g}"
            log.warning("%s (node %d) refused: %s", names[node], node, reason)
            refused.append(Refusal(names[node], node, reason))
    return uploads_of


def _personalize(
    grid: Grid,
    config: FlowerServerConfig,
    teachers: dict[str, bytes],
    node_of: dict[str, int],
    out: Path,
    refused: list[Refusal],
) -> list[str]:
    """PKE packages for the accepted classifier uploads (``teachers``, file name -> bytes), each sent to
    its device (``train.personalize``); returns the names of the clients that acknowledged theirs."""
    if not teachers:
        log.warning("no classifier upload was accepted, so no personalization package")
        return []
    pke = personalize_server(teachers, out / "server", out / "packages", config=config.pke)
    by_name = {path.stem: path for path in pke.packages}
    messages = [
        Message(
            RecordDict({"package": ArrayRecord({"package": bytes_array(path.read_bytes())})}),
            dst_node_id=node_of[name],
            message_type=f"{MessageType.TRAIN}.{PERSONALIZE_ACTION}",
        )
        for name, path in by_name.items()
    ]
    names = {node: name for name, node in node_of.items()}
    delivered = []
    for reply in grid.send_and_receive(messages, timeout=config.timeout_s):
        node = reply.metadata.src_node_id
        name = names.get(node, "?")
        if reply.has_error():
            reason = f"package refused by the device: {str(reply.error.reason)[:_ERROR_CHARS]}"
            log.warning("%s (node %d): %s", name, node, reason)
            refused.append(Refusal(name, node, reason))
            continue
        delivered.append(name)
    return sorted(delivered)


def make_server_app(config: FlowerServerConfig | None = None) -> ServerApp:
    """A ServerApp running :func:`run_round`: on ``config``, or (None) on the run config of the run."""
    server = ServerApp()

    @server.main()
    def main(grid: Grid, context: Context) -> None:
        run_round(grid, config or FlowerServerConfig.from_run_config(context.run_config))

    return server


app = (
    make_server_app()
)  # `flwr run`: [tool.flwr.app.components] serverapp = "server_kit.federation.flower_server:app"
