"""Configs people can replay: SimulateConfig.from_dict (the inverse of to_dict), `server-kit simulate
--config FILE` (a TOML file or a run's results.json) with flags over the file, `--print-config`."""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

import pytest

from common.errors import ConfigError
from edge_sdk.search import build_search_config, search_config_from_dict
from edge_sdk.strategies.base import RECORD_DEFAULTS
from edge_sdk.strategies.evolution import EvolutionConfig
from edge_sdk.strategies.pso import PSOConfig
from server_kit.cli import main
from server_kit.federation.simulate import SimulateConfig
from server_kit.training.adversarial import AdversarialConfig

CONFIGS = {
    "default": SimulateConfig(dataset="digits", out_dir="runs/a"),
    "fedmho": SimulateConfig.preset("fedmho", dataset="mnist", out_dir="runs/b"),
    "evolution": SimulateConfig.preset(
        "default",
        dataset="digits",
        out_dir="runs/c",
        search=build_search_config("paper", strategy="evolution", supernet="s.file"),
        profile_map="map.toml",
        precision="fp32",
    ),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_from_dict_inverts_to_dict_also_through_json(name):
    config = CONFIGS[name]
    assert SimulateConfig.from_dict(config.to_dict()) == config
    assert SimulateConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config


def test_a_nested_config_without_a_default_round_trips():
    aggregate = replace(
        CONFIGS["default"].aggregate, adversarial=AdversarialConfig(rounds=2), verify_claims=True
    )
    config = replace(CONFIGS["default"], aggregate=aggregate)
    assert SimulateConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config


def test_a_search_record_drops_the_other_strategies_keys_only_at_their_record_defaults():
    record = EvolutionConfig(population=4).to_dict()
    assert set(record) == set(RECORD_DEFAULTS)
    assert search_config_from_dict(record) == EvolutionConfig(population=4)
    with pytest.raises(ConfigError, match=r"strategy 'evolution' sets \['particles'\], options of other"):
        search_config_from_dict(record | {"particles": 7})
    # a table a person wrote: an option of another strategy is refused by name, the rest over the base
    with pytest.raises(ConfigError, match="'particles' does not apply to strategy 'fixed'"):
        search_config_from_dict({"strategy": "fixed", "particles": 6})
    assert search_config_from_dict({"search_epochs": 2}, PSOConfig(particles=3)) == PSOConfig(
        particles=3, search_epochs=2
    )
    with pytest.raises(ConfigError, match="strategy must be one of"):
        search_config_from_dict({"strategy": "annealing"})


def _write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


def _printed(capsys, argv: list[str]) -> dict:
    assert main([*argv, "--print-config"]) == 0
    return json.loads(capsys.readouterr().out)


def test_a_toml_file_is_read_and_flags_override_it(tmp_path, capsys):
    toml = _write(
        tmp_path / "run.toml",
        'dataset = "digits"\nnum_clients = 3\nseed = 5\nprofiles = ["laptop-cpu", "wearable"]\n'
        '[search]\nstrategy = "fixed"\nfinal_epochs = 2\n[aggregate.distill]\nepochs = 3\n',
    )
    printed = _printed(capsys, ["simulate", "--config", str(toml), "--out", str(tmp_path / "o")])
    assert (
        printed["num_clients"] == 3
        and printed["seed"] == 5
        and printed["profiles"] == ["laptop-cpu", "wearable"]
    )
    assert printed["search"]["strategy"] == "fixed" and printed["search"]["final_epochs"] == 2
    assert printed["aggregate"]["distill"]["epochs"] == 3 and printed["aggregate"]["distill"]["tau"] == 4.0
    assert printed["out_dir"] == str(tmp_path / "o")
    argv = ["simulate", "--config", str(toml), "--out", str(tmp_path / "p"), "--num-clients", "4"]
    argv += ["--seed", "0", "--final-epochs", "7", "--distill-epochs", "9", "--quiet"]
    over = _printed(capsys, argv)
    assert over["num_clients"] == 4 and over["seed"] == 0 and over["aggregate"]["seed"] == 0
    assert over["search"]["strategy"] == "fixed" and over["search"]["final_epochs"] == 7
    assert over["aggregate"]["distill"]["epochs"] == 9 and over["progress"] is False
    assert over["profiles"] == ["laptop-cpu", "wearable"] and over["out_dir"] == str(tmp_path / "p")
    # the printed config, saved as JSON, is read back to the same config
    saved = _write(tmp_path / "printed.json", json.dumps(over))
    assert _printed(capsys, ["simulate", "--config", str(saved)]) == over


def test_without_a_file_the_flags_keep_their_old_defaults(tmp_path, capsys):
    printed = _printed(capsys, ["simulate", "--dataset", "digits", "--out", str(tmp_path / "o")])
    expected = SimulateConfig(dataset="digits", out_dir=tmp_path / "o").to_dict()
    assert printed == json.loads(json.dumps(expected))
    fedmho = _printed(
        capsys, ["simulate", "--federation-preset", "fedmho", "--dataset", "digits", "--out", "o"]
    )
    assert fedmho == json.loads(
        json.dumps(SimulateConfig.preset("fedmho", dataset="digits", out_dir="o").to_dict())
    )


def test_the_config_seeds_the_server_as_the_cli_does(tmp_path, capsys):
    """#33: SimulateConfig(seed=3) left the server at seed 0 (only the CLI copied --seed into it)."""
    api = SimulateConfig(dataset="digits", out_dir=tmp_path / "o", seed=3)
    assert api.aggregate.seed == 3 and replace(api, seed=4).aggregate.seed == 4
    cli = _printed(capsys, ["simulate", "--dataset", "digits", "--out", str(tmp_path / "o"), "--seed", "3"])
    assert cli == json.loads(json.dumps(api.to_dict()))
    toml = _write(tmp_path / "run.toml", 'dataset = "digits"\nseed = 3\n')  # a file's seed, no --seed
    assert _printed(capsys, ["simulate", "--config", str(toml), "--out", str(tmp_path / "o")]) == cli
    with pytest.raises(ConfigError, match=r"aggregate\.seed is the federation's seed, got seed 3 and "):
        SimulateConfig.from_dict({"dataset": "digits", "out_dir": "o", "seed": 3, "aggregate": {"seed": 4}})


def test_a_missing_gpu_is_refused_before_the_partition(tmp_path, monkeypatch):
    """#33: simulate(device="cuda") split the data for seconds before torch refused; a server planning
    its clients' CUDA without a GPU of its own may still build the config."""
    import torch

    from server_kit.federation.simulate import simulate

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for where in ({"device": "cuda"}, {"aggregate": replace(CONFIGS["default"].aggregate, device="cuda:0")}):
        config = SimulateConfig(dataset="digits", out_dir=tmp_path / "o", **where)
        with pytest.raises(ConfigError, match="CUDA is not available"):
            simulate(config)
        assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(
    ("text", "extra", "message"),
    [
        (
            'dataset = "digits"\nnum_clientz = 3\n',
            ["--out", "o"],
            r"unknown keys \['num_clientz'\] in config; valid keys are \['aggregate', 'alpha', ",
        ),
        (
            'dataset = "digits"\n[aggregate.distill]\nepoch = 3\n',
            ["--out", "o"],
            r"unknown keys \['epoch'\] in config\.aggregate\.distill; "
            r"valid keys are \['average', 'batch_size', ",
        ),
        ('dataset = "digits"\n', [], "without out_dir; fix: add it to the file, or give --out"),
        (
            'dataset = "digits"\n',
            ["--out", "o", "--federation-preset", "fedmho"],
            "takes --federation-preset or --config",
        ),
        (
            'dataset = "digits"\nnum_clients = 0\n',
            ["--out", "o"],
            r"num_clients must be an integer in \[1, 100000\], got 0",
        ),
    ],
)
def test_a_bad_file_is_one_line_and_exit_2(tmp_path, capsys, text, extra, message):
    toml = _write(tmp_path / "bad.toml", text)
    assert main(["simulate", "--config", str(toml), *extra]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and err.startswith("server-kit: error: ")
    assert re.search(message, err), err


def test_simulate_without_dataset_or_out_is_refused(capsys):
    assert main(["simulate", "--dataset", "digits"]) == 2
    assert "simulate needs --dataset and --out, got only one" in capsys.readouterr().err


TINY = (
    'dataset = "digits"\nnum_clients = 2\nalpha = 1.0\nprofiles = ["laptop-cpu", "raspberry-pi-4-4gb"]\n'
    "decoders = false\nprogress = false\n"
    "[search]\nparticles = 2\niterations = 1\nfinal_epochs = 6\nfinalists = 1\nwarm_start = false\n"
    '[aggregate]\nsynth = ["inversion"]\ndevice = "cpu"\n'
    "[aggregate.inversion]\nsamples_per_teacher = 150\nsteps = 30\n[aggregate.distill]\nepochs = 10\n"
)


def test_a_run_replays_from_its_results_json(tmp_path):
    """The issue's done-when: `simulate --config run/results.json --out replay` gives the same numbers."""
    toml = _write(tmp_path / "tiny.toml", TINY)
    assert main(["simulate", "--config", str(toml), "--out", str(tmp_path / "run")]) == 0
    first = json.loads((tmp_path / "run" / "results.json").read_text(encoding="utf-8"))
    results = str(tmp_path / "run" / "results.json")
    assert main(["simulate", "--config", results, "--out", str(tmp_path / "replay")]) == 0
    again = json.loads((tmp_path / "replay" / "results.json").read_text(encoding="utf-8"))
    assert again["resumed_clients"] == 0  # a fresh directory: every client trained again
    # the replay runs the same seeded path on the same CPU: equal; chance is 0.1, so 0.2 is a loose floor
    assert again["global_accuracy"] == first["global_accuracy"] > 0.2
    assert [c["arch"] for c in again["clients"]] == [c["arch"] for c in first["clients"]]
    assert [c["test_accuracy"] for c in again["clients"]] == [c["test_accuracy"] for c in first["clients"]]
    assert again["config"] == first["config"] | {"out_dir": str(tmp_path / "replay")}
