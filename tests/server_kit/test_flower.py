"""The Flower app: the one-shot round on Flower's simulation engine reproduces `server-kit simulate`, and
the ServerApp refuses a bad reply and goes on with the rest."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

flwr = pytest.importorskip("flwr")
pytest.importorskip("ray")

from flwr.app import (  # noqa: E402
    Array,
    ArrayRecord,
    ConfigRecord,
    Context,
    Error,
    Message,
    MessageType,
    RecordDict,
)
from flwr.common.config import flatten_dict  # noqa: E402
from flwr.supercore.task_identity import TaskIdentity  # noqa: E402

from common.errors import BundleError, ConfigError  # noqa: E402
from edge_sdk import flower_client  # noqa: E402
from edge_sdk.cvae import CVAEConfig  # noqa: E402
from edge_sdk.strategies.baselines import FixedConfig  # noqa: E402
from export.bundle import read_bundle  # noqa: E402
from export.package import read_package  # noqa: E402
from server_kit.aggregate_config import AggregateConfig  # noqa: E402
from server_kit.federation import flower_server  # noqa: E402
from server_kit.federation.flower_server import FlowerServerConfig, check_reply, make_server_app, run_round  # noqa: E402
from server_kit.federation.simulate import SimulateConfig, simulate  # noqa: E402
from server_kit.personalization.pke import PKEConfig  # noqa: E402
from server_kit.synthesis.inversion import InversionConfig  # noqa: E402
from server_kit.training.distill import DistillConfig  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def tiny_federation(out: Path, num_clients: int = 3) -> SimulateConfig:
    """Digits, one fixed architecture from shared initial weights, a classifier+decoder device (laptop-cpu,
    role both) beside a CVAE-only one (wearable), a few seconds of server work."""
    return SimulateConfig(
        dataset="digits",
        num_clients=num_clients,
        alpha=1.0,
        seed=0,
        out_dir=out,
        profiles=("laptop-cpu", "wearable"),
        search=FixedConfig(fixed_arch="C8k3-P-F10", final_epochs=2),
        cvae=CVAEConfig(epochs=1),
        aggregate=AggregateConfig(
            synth=("inversion",),
            inversion=InversionConfig(samples_per_teacher=20, steps=5, batch_size=20, lr=0.1, tau=2.0),
            distill=DistillConfig(epochs=2, batch_size=32),
            device="cpu",
            seed=0,
        ),
        progress=False,
    )


def test_the_simulation_engine_reproduces_simulate(tmp_path, monkeypatch):
    """Same partition, seeds and knobs: the same client models, the same global.onnx, the same accuracy;
    each classifier device gets its PKE package in a second message and checks it against its model."""
    from flwr.simulation import run_simulation

    monkeypatch.setenv("FLWR_TELEMETRY_ENABLED", "0")
    monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", "0")
    fed = tiny_federation(tmp_path / "flower")
    config = FlowerServerConfig(
        federation=fed, personalize=True, pke=PKEConfig(train_epochs=1, max_inputs=32)
    )
    run_simulation(
        server_app=make_server_app(config),
        client_app=flower_client.app,
        num_supernodes=fed.num_clients,
        backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0}, "init_args": {"num_cpus": 2}},
    )
    results = json.loads((fed.out_dir / flower_server.RESULTS_FILE).read_text())
    reference = simulate(dataclasses.replace(fed, out_dir=tmp_path / "simulate"))

    assert results["refused"] == []
    assert results["global_accuracy"] == reference.global_accuracy is not None
    global_onnx = (fed.out_dir / "server" / "global.onnx").read_bytes()
    assert global_onnx == (tmp_path / "simulate" / "server" / "global.onnx").read_bytes()
    # the uploads: the same models (a bundle's metrics hold its training's wall time, so not its hash)
    uploads = sorted(p.name for p in (fed.out_dir / "clients").glob("*.bundle"))
    assert uploads == ["client_00.bundle", "client_00.decoder.bundle", "client_01.bundle", "client_02.bundle",
                       "client_02.decoder.bundle"]  # fmt: skip
    for name in uploads:
        ours, theirs = (
            read_bundle(fed.out_dir / "clients" / name),
            read_bundle(tmp_path / "simulate" / "clients" / name),
        )
        assert (ours.kind, ours.model_sha256) == (theirs.kind, theirs.model_sha256), name
    # the second message: packages for the classifier devices, each acknowledged by its device
    assert results["packages"] == ["client_00", "client_02"]
    for name in results["packages"]:
        package = read_package(fed.out_dir / "packages" / f"{name}.package")
        package.check_for(read_bundle(fed.out_dir / "clients" / f"{name}.bundle").model_onnx)


def test_the_deployment_engine_round_on_localhost(tmp_path):
    """Real processes: a SuperLink and two SuperNodes (insecure) on localhost, `flwr run` of this checkout;
    the round writes global.onnx and each device keeps the package of the second message
    (benchmarks/flower_deployment.sh, its deployment part, with small knobs)."""
    bin_dir = Path(sys.executable).parent
    if not (bin_dir / "flower-superlink").is_file() or shutil.which("setsid") is None:
        pytest.fail(f"the [flower] extra's commands must be in {bin_dir} and setsid on PATH")
    small = (
        "search.final_epochs=2 aggregate.inversion.samples_per_teacher=50 aggregate.inversion.steps=5 "
        "aggregate.distill.epochs=2 pke.train_epochs=1 pke.max_inputs=64"
    )
    env = {**os.environ, "BIN": str(bin_dir), "ENGINES": "deployment", "EXTRA_RUN_CONFIG": small}
    done = subprocess.run(
        ["bash", str(ROOT / "benchmarks" / "flower_deployment.sh"), str(tmp_path)],
        env=env, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads((tmp_path / "deploy" / flower_server.RESULTS_FILE).read_text())
    assert [c["name"] for c in results["clients"]] == ["client_00", "client_01"] and results["refused"] == []
    assert results["packages"] == ["client_00", "client_01"]
    assert 0.0 <= results["global_accuracy"] <= 1.0
    for k in (0, 1):
        package = read_package(tmp_path / f"node{k}" / flower_client.PACKAGE_FILE)
        package.check_for(read_bundle(tmp_path / "deploy" / "clients" / f"client_0{k}.bundle").model_onnx)


# ---------------------------------------------------------------------------------- the reply check


@pytest.fixture
def identity(monkeypatch):
    """The identity Flower gives the process a ServerApp runs in (messages are stamped with it)."""
    for name, value in (("_run_id", 1), ("_task_id", 1), ("_node_id", 1)):
        monkeypatch.setattr(TaskIdentity, name, value)


@pytest.fixture(scope="module")
def good_bundle(tmp_path_factory) -> bytes:
    from tests.server_kit.test_aggregate import _bundle

    return Path(_bundle(tmp_path_factory.mktemp("b"), "c", "C4k3-P-F3", 0, [3, 2, 1])).read_bytes()


def _reply(content: RecordDict | Error) -> Message:
    request = Message(RecordDict(), dst_node_id=7, message_type=MessageType.TRAIN)
    return Message(content, reply_to=request)


def _bundles(**arrays: Array) -> RecordDict:
    return RecordDict({"bundles": ArrayRecord(arrays)})


def test_a_good_reply_is_its_bundles(identity, good_bundle):
    files = check_reply(
        _reply(_bundles(bundle=flower_client.bytes_array(good_bundle))), name="c7", max_bytes=1 << 20
    )
    assert files == {"c7.bundle": good_bundle}


def test_an_oversized_reply_is_refused_before_parsing(identity, good_bundle, monkeypatch):
    def never(*args, **kwargs):
        raise AssertionError("parsed")

    monkeypatch.setattr(flower_server, "bundle_from_bytes", never)
    reply = _reply(_bundles(bundle=flower_client.bytes_array(good_bundle)))
    with pytest.raises(
        BundleError, match=rf"c7: the reply holds {len(good_bundle)} bytes .* more than the 100 accepted"
    ):
        check_reply(reply, name="c7", max_bytes=100)


def _flipped(data: bytes) -> bytes:
    out = bytearray(data)
    out[len(out) // 2] ^= 0x01
    return bytes(out)


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda b: Error(code=3, reason="Traceback: boom"), "replied with error 3: Traceback: boom"),
        (
            lambda b: RecordDict({"other": ConfigRecord({"x": 1})}),
            r"missing \['bundles'\], unknown \['other'\]",
        ),
        (lambda b: _bundles(model=flower_client.bytes_array(b)), "must hold 'bundle'"),
        (lambda b: _bundles(bundle=flower_client.bytes_array(_flipped(b))), "c7.bundle: sha256 mismatch"),
        (
            lambda b: _bundles(bundle=Array(dtype="float32", shape=(len(b),), stype="raw", data=b)),
            "dtype 'float32'",
        ),
        (
            lambda b: _bundles(bundle=Array(dtype="uint8", shape=(1, len(b)), stype="raw", data=b)),
            r"shape \(1, ",
        ),
        (
            lambda b: _bundles(bundle=Array(dtype="uint8", shape=(len(b),), stype="numpy.ndarray", data=b)),
            "stype",
        ),
        (
            lambda b: _bundles(bundle=flower_client.bytes_array(b), decoder=flower_client.bytes_array(b)),
            "'decoder' upload is a 'classifier' bundle",
        ),
    ],
)
def test_a_bad_reply_is_refused_with_its_reason(identity, good_bundle, make, match):
    with pytest.raises(BundleError, match=match):
        check_reply(_reply(make(good_bundle)), name="c7", max_bytes=1 << 20)


class _Grid:
    """Nodes in this process: each message goes to the ClientApp's own handler with the node's context;
    ``tamper`` may rewrite a node's train reply (a hostile or broken device)."""

    def __init__(self, num_nodes: int, tamper) -> None:
        self.contexts = {
            100 + k: Context(1, 100 + k, {"partition-id": k, "num-partitions": num_nodes}, RecordDict(), {})
            for k in range(num_nodes)
        }
        self.tamper = tamper

    def get_node_ids(self):
        return list(self.contexts)

    def send_and_receive(self, messages, *, timeout=None):
        handlers = {
            "query": flower_client.identify,
            "train": flower_client.train,
            "train.personalize": flower_client.receive_package,
        }
        for message in messages:
            node = message.metadata.dst_node_id
            reply = handlers[message.metadata.message_type](message, self.contexts[node])
            if message.metadata.message_type == "train":
                reply = self.tamper(node, message, reply)
            if reply is not None:
                yield reply


def test_the_round_goes_on_without_a_bad_reply(identity, tmp_path, good_bundle):
    """Node 101 uploads a corrupt bundle, node 102 none at all, node 103 a valid bundle of another task
    (refused by the server's teacher checks, not by the file checks): all three are refused and logged,
    the round aggregates node 100's upload alone and still sends it its package."""

    def tamper(node, message, reply):
        if node == 101:
            data = reply.content["bundles"]["bundle"].data
            return Message(_bundles(bundle=flower_client.bytes_array(_flipped(data))), reply_to=message)
        if node == 103:
            return Message(_bundles(bundle=flower_client.bytes_array(good_bundle)), reply_to=message)
        return None if node == 102 else reply

    fed = tiny_federation(tmp_path / "run", num_clients=4)
    fed = dataclasses.replace(fed, profiles=("laptop-cpu",), decoders=False, min_size=5)
    config = FlowerServerConfig(
        federation=fed, personalize=True, pke=PKEConfig(train_epochs=1, max_inputs=16)
    )
    result = run_round(_Grid(4, tamper), config)
    assert [(r.client, r.node_id) for r in result.refused] == [
        ("client_01", 101),
        ("client_02", 102),
        ("client_03", 103),
    ]
    assert "sha256 mismatch" in result.refused[0].reason and "no reply" in result.refused[1].reason
    assert "disagree" in result.refused[2].reason
    report = json.loads((fed.out_dir / "server" / "report.json").read_text())
    assert [t["file"] for t in report["teachers"]] == ["client_00.bundle"]
    assert result.global_onnx.is_file() and result.packages == ("client_00",)
    saved = json.loads((fed.out_dir / flower_server.RESULTS_FILE).read_text())
    assert [r["client"] for r in saved["refused"]] == ["client_01", "client_02", "client_03"]


# ------------------------------------------------------------------------------------- the messages


def test_a_task_travels_whole_and_a_bad_one_is_refused(identity):
    fed = tiny_federation(Path("unused"))
    client = flower_client.ClientConfig(search=fed.search, cvae=fed.cvae, seed=5, role="classifier")
    from profiles import load_profile

    task = flower_client.FlowerTask(
        client=client,
        profile=load_profile("raspberry-pi-4-4gb"),
        partition={"dataset": "digits", "num_clients": 3, "alpha": 1.0, "seed": 0, "min_size": 10},
        init=b"\x01\x02",
    )
    assert flower_client.FlowerTask.from_content(task.to_content()) == task
    content = task.to_content()
    content["task"]["client-config"] = json.dumps({"val_fraction": 2.0})
    with pytest.raises(ConfigError, match="val_fraction must be in"):
        flower_client.FlowerTask.from_content(content)
    content = task.to_content()
    content["task"]["profile"] = "x" * (flower_client.MAX_TASK_TEXT_BYTES + 1)
    with pytest.raises(BundleError, match="'profile' must be a str of at most"):
        flower_client.FlowerTask.from_content(content)


def test_the_app_config_in_pyproject_is_a_valid_round(tmp_path):
    """`flwr run .` reads [tool.flwr.app]: its components exist and its config builds the round's knobs."""
    app = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["flwr"]["app"]
    assert app["components"] == {
        "serverapp": "server_kit.federation.flower_server:app",
        "clientapp": "edge_sdk.flower_client:app",
    }
    run_config = flatten_dict(app["config"])
    config = FlowerServerConfig.from_run_config({**run_config, "out_dir": str(tmp_path)})
    assert config.federation.dataset == "digits" and config.federation.out_dir == tmp_path
    assert config.federation.search.strategy == "fixed"
    with pytest.raises(ConfigError, match="unknown keys"):
        FlowerServerConfig.from_run_config({**run_config, "num_clientz": 3})
