"""#33, one name per meaning across both CLIs: the old options and config keys are refused with one line
naming the new ones, every help speaks the new names, ``--device`` is ``auto`` everywhere (the CPU on a
machine without CUDA, where a default run gives what ``--device cpu`` gives), and ``simulate`` runs on the
devices its CLI resolved."""

from __future__ import annotations

import argparse
import json
import re
import types
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch

from common.configs import config_from_dict
from common.errors import ConfigError
from edge_sdk.cli import build_parser as edge_parser
from edge_sdk.cli import main as edge_main
from edge_sdk.client import ClientConfig
from edge_sdk.data import load_dataset, save_client_data
from edge_sdk.personalize import PersonalizeConfig
from edge_sdk.search import build_search_config, replace_search_config, search_config_from_dict
from edge_sdk.strategies.pso import PSOConfig
from server_kit.aggregate_config import AggregateConfig
from server_kit.cli import build_parser as server_parser
from server_kit.cli import main as server_main
from server_kit.federation import SimulateConfig
from server_kit.federation.simulate import _client_config
from server_kit.personalization import PKEConfig, SupernetConfig

EDGE, SERVER = "edge-sdk", "server-kit"
MAINS = {EDGE: edge_main, SERVER: server_main}
PARSERS = {EDGE: edge_parser, SERVER: server_parser}

# (cli, command, old option, new option)
RENAMED = [
    (EDGE, "search", "--epochs", "--search-epochs"),
    (EDGE, "run", "--epochs", "--search-epochs"),
    (SERVER, "simulate", "--epochs", "--search-epochs"),
    (EDGE, "train", "--epochs", "--train-epochs"),
    (EDGE, "personalize", "--epochs", "--train-epochs"),
    (SERVER, "personalize", "--epochs", "--train-epochs"),
    (EDGE, "search", "--preset", "--search-preset"),
    (EDGE, "run", "--preset", "--search-preset"),
    (SERVER, "simulate", "--preset", "--search-preset"),
    (SERVER, "simulate", "--method", "--federation-preset"),
    (SERVER, "simulate", "--server-preset", "--aggregate-preset"),
    (SERVER, "aggregate", "--server-preset", "--aggregate-preset"),
    (EDGE, "personalize", "--tau", "--pkt-weight-pull"),
    (EDGE, "personalize", "--alpha-lr", "--pkt-weight-lr"),
    (EDGE, "personalize", "--kd-temperature", "--distill-tau"),
    (SERVER, "supernet", "--tau", "--distill-tau"),
]
OPTION = re.compile(r"^ {2}(-[-\w]+)", re.MULTILINE)


def _commands(cli: str) -> dict[str, argparse.ArgumentParser]:
    sub = next(a for a in PARSERS[cli]()._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def _help_all(capsys, cli: str, command: str) -> str:
    with pytest.raises(SystemExit) as stop:
        MAINS[cli]([command, "--help-all"])
    assert stop.value.code == 0
    return capsys.readouterr().out


@pytest.mark.parametrize(("cli", "command", "old", "new"), RENAMED)
def test_an_old_option_is_refused_in_one_line_naming_the_new_one(capsys, cli, command, old, new):
    with pytest.raises(SystemExit) as stop:
        MAINS[cli]([command, old, "3"])  # before any other check: the required options are missing too
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert f"{cli} {command}: error: {old} was renamed: expected {new}, got {old}; fix: use {new}" in err


@pytest.mark.parametrize(("cli", "command", "old", "new"), RENAMED)
def test_each_help_lists_the_new_name_and_not_the_old_one(capsys, monkeypatch, cli, command, old, new):
    monkeypatch.setenv("COLUMNS", "200")
    listed = set(OPTION.findall(_help_all(capsys, cli, command)))
    assert new in listed and old not in listed


@pytest.mark.parametrize("cli", [EDGE, SERVER])
def test_no_help_lists_an_old_name_in_another_meaning(capsys, monkeypatch, cli):
    """``--method`` is left to edge-sdk personalize (the personalization method) alone; the other old
    names are nowhere, and each command that trains on a device has ``--device`` at ``auto``."""
    monkeypatch.setenv("COLUMNS", "200")
    for command in _commands(cli):
        text = _help_all(capsys, cli, command)
        listed = set(OPTION.findall(text))
        gone = {"--epochs", "--preset", "--server-preset", "--tau", "--kd-temperature", "--alpha-lr"}
        gone |= set() if (cli, command) == (EDGE, "personalize") else {"--method"}
        assert not listed & gone, (cli, command, listed & gone)
        device = re.search(r"^  --device \S+\s+(.*?)(?=^  -)", text, re.MULTILINE | re.DOTALL)
        if device is not None:
            assert "(default: auto)" in " ".join(device.group(1).split()), (cli, command)


def test_every_device_option_defaults_to_auto():
    configs = [ClientConfig(), PersonalizeConfig(), PKEConfig(), SupernetConfig(), AggregateConfig()]
    configs.append(SimulateConfig(dataset="digits", out_dir=Path("o")))
    assert [config.device for config in configs] == ["auto"] * len(configs)
    for command, needs in (("search", ["--profile", "p"]), ("train", ["--arch", "a"])):
        args = edge_parser().parse_args([command, "--data", "d", "--out", "o", *needs])
        assert args.device == "auto"


@pytest.mark.parametrize(
    ("cls", "table", "new"),
    [
        (PersonalizeConfig, {"epochs": 1}, "train_epochs"),
        (PersonalizeConfig, {"tau": 0.5}, "pkt_weight_pull"),
        (PersonalizeConfig, {"kd_temperature": 2.0}, "distill_tau"),
        (PKEConfig, {"epochs": 1}, "train_epochs"),
        (SupernetConfig, {"tau": 1.0}, "distill_tau"),
    ],
)
def test_an_old_key_is_refused_naming_the_new_one(cls, table, new):
    (old,) = table
    with pytest.raises(ConfigError, match=rf"expected the key '{new}', got '{old}', its old name.*fix"):
        config_from_dict(cls, table, what="config")


def test_the_search_refuses_its_old_key_in_a_table_a_record_and_a_call():
    with pytest.raises(ConfigError, match="'search_epochs', got 'epochs'"):
        search_config_from_dict({"epochs": 2})
    record = PSOConfig().for_input((1, 28, 28)).to_dict()
    record["epochs"] = record.pop("search_epochs")  # a client report or results.json written before #33
    with pytest.raises(ConfigError, match="'search_epochs', got 'epochs'"):
        search_config_from_dict(record)
    for call in (lambda: build_search_config(epochs=2), lambda: replace_search_config(PSOConfig(), epochs=2)):
        with pytest.raises(ConfigError, match="'search_epochs', got 'epochs'"):
            call()
    old_run = {"dataset": "digits", "out_dir": "o", "search": record}
    with pytest.raises(ConfigError, match="'search_epochs', got 'epochs'"):
        SimulateConfig.from_dict(old_run)


def test_a_config_file_with_an_old_key_is_one_usage_error(tmp_path, capsys):
    path = tmp_path / "run.toml"
    path.write_text('dataset = "digits"\nout_dir = "o"\n[search]\nepochs = 2\n', encoding="utf-8")
    assert server_main(["simulate", "--config", str(path), "--print-config"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "fix: rename 'epochs' to 'search_epochs'" in err
    results = tmp_path / "results.json"
    record = SimulateConfig(dataset="digits", out_dir=Path("o")).to_dict()
    record["search"]["epochs"] = record["search"].pop("search_epochs")
    results.write_text(json.dumps({"config": record}), encoding="utf-8")
    assert server_main(["simulate", "--config", str(results), "--print-config"]) == 2
    assert "'search_epochs', got 'epochs'" in capsys.readouterr().err


def test_simulate_runs_on_the_devices_its_cli_resolved(tmp_path, monkeypatch):
    seen = {}

    def fake(config, **devices):
        seen.update(devices)
        return types.SimpleNamespace(
            global_accuracy=0.5, mean_client_test_accuracy=0.5, resumed_clients=0, seconds={"total": 1.0}
        )

    monkeypatch.setattr("server_kit.federation.simulate", fake)
    assert server_main(["simulate", "--dataset", "digits", "--out", str(tmp_path / "run"), "--quiet"]) == 0
    expected = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    assert seen == {"device": expected, "server_device": expected}


def test_the_clients_get_the_resolved_device_and_a_plan_without_one_keeps_the_asked():
    config = SimulateConfig(dataset="digits", out_dir=Path("o"))
    assert _client_config(config, 0, "classifier", None, "cpu").device == "cpu"
    assert _client_config(config, 0, "classifier", None).device == "auto"  # a Flower client resolves it


@pytest.mark.skipif(torch.cuda.is_available(), reason="auto is the CPU only where there is no CUDA")
def test_the_default_device_trains_what_cpu_trains(tmp_path):
    data = save_client_data(tmp_path / "d.npz", load_dataset("digits").subset(np.arange(120)))
    argv = ["train", "--data", str(data), "--arch", "C4k3-P-F10", "--train-epochs", "1", "--quiet"]
    assert edge_main([*argv, "--out", str(tmp_path / "auto.onnx")]) == 0
    assert edge_main([*argv, "--device", "cpu", "--out", str(tmp_path / "cpu.onnx")]) == 0
    auto, cpu = (onnx.load(tmp_path / name) for name in ("auto.onnx", "cpu.onnx"))
    assert [i.SerializeToString() for i in auto.graph.initializer] == [
        i.SerializeToString() for i in cpu.graph.initializer
    ]
    metrics = [json.loads(_metadata(model)["metrics"]) for model in (auto, cpu)]
    for row in metrics:
        del row["train_seconds"]  # the one entry that is a clock's
    assert metrics[0] == metrics[1]


def _metadata(model: onnx.ModelProto) -> dict[str, str]:
    return {prop.key: prop.value for prop in model.metadata_props}
