"""Command-line options generated from config dataclasses (#20): every field is a flag named by its path,
its docs and default in --help, its Literal choices enforced; a given flag lands in the field's table."""

from __future__ import annotations

import argparse
import dataclasses
import json
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import pytest

from common.cli import EXIT_USAGE, cli_main, root_parser
from common.config_args import add_config_args, config_flags, field_docs, given_table
from common.errors import ConfigError
from edge_sdk.cli import main as edge_main
from server_kit.cli import build_parser
from server_kit.cli import main as server_main


@dataclass(frozen=True, kw_only=True)
class Inner:
    """A nested config.

    Attributes:
        rate, width: two knobs documented
            together.
    """

    rate: float = 0.5
    width: int = 3


@dataclass(frozen=True, kw_only=True)
class Outer:
    name: str  # what it is called
    # how it runs: fast or slow
    mode: Literal["fast", "slow"] = "fast"
    sizes: tuple[int, ...] = (1, 2)
    limit: int | None = None
    on: bool = True
    inner: Inner = field(default_factory=Inner)
    spare: Inner | None = None


def test_field_docs_read_comments_and_attributes():
    assert field_docs(Outer)["name"] == "what it is called"
    assert field_docs(Outer)["mode"] == "how it runs: fast or slow"
    assert field_docs(Inner) == {
        "rate": "two knobs documented together.",
        "width": "two knobs documented together.",
    }


def test_a_field_is_a_flag_named_by_its_path():
    flags = {f.option: f.path for f in config_flags(Outer)}
    assert flags == {
        "--name": ("name",),
        "--mode": ("mode",),
        "--sizes": ("sizes",),
        "--limit": ("limit",),
        "--on": ("on",),
        "--inner-rate": ("inner", "rate"),
        "--inner-width": ("inner", "width"),
        "--spare-rate": ("spare", "rate"),
        "--spare-width": ("spare", "width"),
    }
    flattened = {f.option: f.path for f in config_flags(Outer, flatten=("inner",), skip=("spare.width",))}
    assert flattened["--rate"] == ("inner", "rate") and "--spare-width" not in flattened


def test_a_flattened_field_whose_name_is_taken_keeps_its_path():
    @dataclass(frozen=True)
    class Clash:
        width: int = 1
        inner: Inner = field(default_factory=Inner)

    flags = {f.option: f.path for f in config_flags(Clash, flatten=("inner",))}
    assert flags == {"--width": ("width",), "--rate": ("inner", "rate"), "--inner-width": ("inner", "width")}


def _parse(argv: list[str]) -> dict:
    parser = argparse.ArgumentParser()
    flags = add_config_args(parser, Outer)
    return given_table(parser.parse_args(argv), flags)


def test_given_flags_become_a_nested_table_of_typed_values():
    assert _parse([]) == {}  # nothing given: the preset or file keeps every value
    table = _parse(["--name", "x", "--mode", "slow", "--sizes", "3,4", "--limit", "none", "--no-on"])
    assert table == {"name": "x", "mode": "slow", "sizes": (3, 4), "limit": None, "on": False}
    assert _parse(["--inner-rate", "0.25", "--spare-width", "7", "--sizes", "none"]) == {
        "inner": {"rate": 0.25},
        "spare": {"width": 7},
        "sizes": (),
    }


def test_help_shows_docs_defaults_and_choices(capsys):
    parser = argparse.ArgumentParser()
    add_config_args(parser, Outer)
    text = " ".join(parser.format_help().split())
    assert "--mode {fast,slow} how it runs: fast or slow (default: fast)" in text
    assert "--sizes A,B,... (default: 1,2)" in text and "--limit INT (default: none)" in text
    assert "--on, --no-on" in text
    assert "--spare-rate FLOAT two knobs documented together. (default when spare is set: 0.5)" in text


def test_help_lists_the_common_fields_by_group_and_help_all_every_field(capsys):
    parser, command = root_parser("tool", "a test CLI", version="0")

    def build(p: argparse.ArgumentParser) -> None:
        groups = {"": p.add_argument_group("basics"), "inner": p.add_argument_group("inner knobs")}
        p.set_defaults(flags=add_config_args(p, Outer, groups=groups, common=("name", "inner.rate")))

    command("go", lambda args: None, "runs", build)

    def shown(flag: str) -> str:
        with pytest.raises(SystemExit) as stop:
            cli_main("tool", parser, ["go", flag])
        assert stop.value.code == 0
        return capsys.readouterr().out

    short, every = shown("--help"), shown("--help-all")
    assert "basics:\n  --name TEXT" in short and "inner knobs:\n  --inner-rate FLOAT" in short
    for option in ("--mode", "--inner-width", "--spare-rate", "spare options:"):  # a group left empty: gone
        assert option not in short and option in every, option
    assert short.rstrip().endswith("--help-all also lists 7 options for experts.")
    assert "for experts" not in every
    with pytest.raises(
        ConfigError, match=r"common options must name fields that have a flag, got \['nmae'\]"
    ):
        add_config_args(argparse.ArgumentParser(), Outer, common=("nmae",))


def test_a_bad_value_is_a_one_line_usage_error(capsys):
    parser, command = root_parser("tool", "a test CLI", version="0")
    command("go", lambda args: None, "runs", lambda p: p.set_defaults(flags=add_config_args(p, Outer)))
    for argv, match in [
        (["go", "--mode", "medium"], "argument --mode: invalid str value: 'medium'"),
        (["go", "--inner-width", "x"], "argument --inner-width: invalid int value: 'x'"),
    ]:
        with pytest.raises(SystemExit) as exc:
            cli_main("tool", parser, argv)
        assert exc.value.code == EXIT_USAGE
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and match in err, err


def test_an_unsupported_field_type_is_refused_when_the_parser_is_built():
    @dataclass(frozen=True)
    class Odd:
        table: dict[str, int] = field(default_factory=dict)

    with pytest.raises(ConfigError, match="no command-line form"):
        add_config_args(argparse.ArgumentParser(), Odd)


# --- the real commands: every field of their config has a flag ----------------------------------------


def _leaves(
    cls: type, prefix: tuple[str, ...], families: dict[str, tuple[type, ...]]
) -> set[tuple[str, ...]]:
    """Every scalar field path of ``cls``, walked with the stdlib (not with the code under test)."""
    paths: set[tuple[str, ...]] = set()
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        path = (*prefix, f.name)
        hint = hints[f.name]
        members = [m for m in typing.get_args(hint) if m is not type(None)] or [hint]
        if ".".join(path) in families:
            for member in families[".".join(path)]:
                paths |= _leaves(member, path, families)
        elif len(members) == 1 and dataclasses.is_dataclass(members[0]):
            paths |= _leaves(members[0], path, families)
        else:
            paths.add(path)
    return paths


def _paths(main_parser: argparse.ArgumentParser, argv: list[str]) -> set[tuple[str, ...]]:
    return {flag.path for flag in main_parser.parse_args(argv).flags}


def test_every_field_of_the_commands_configs_has_a_flag():
    from edge_sdk.cli import build_parser as edge_parser
    from edge_sdk.client import ClientConfig
    from edge_sdk.personalize import PersonalizeConfig
    from edge_sdk.search import STRATEGIES
    from server_kit.aggregate_config import AggregateConfig
    from server_kit.federation.simulate import SimulateConfig
    from server_kit.personalization.pke import PKEConfig
    from server_kit.personalization.supernet import SupernetConfig

    search = {"search": tuple(s.config for s in STRATEGIES.values())}
    # the server's seed is --seed; the loss's hard labels follow --hard-labels
    simulate = _leaves(SimulateConfig, (), search) - {
        ("out_dir",),
        ("progress",),
        ("aggregate", "seed"),
        ("aggregate", "distill", "hard_labels"),
    }
    assert _paths(build_parser(), ["simulate"]) == simulate
    aggregate = _leaves(AggregateConfig, (), {}) - {("distill", "hard_labels")}
    assert _paths(build_parser(), ["aggregate", "b", "--out", "o"]) == aggregate
    assert _paths(build_parser(), ["personalize", "b", "--aggregate", "a", "--out", "o"]) == _leaves(
        PKEConfig, (), {}
    )
    assert _paths(build_parser(), ["supernet", "b", "--out", "o.file"]) == _leaves(SupernetConfig, (), {})
    run = ["run", "--data", "d", "--profile", "p", "--out", "o"]
    assert _paths(edge_parser(), run) == _leaves(ClientConfig, (), search) - {("progress",)}
    union = set().union(*(_leaves(cls, (), {}) for cls in search["search"]))
    assert _paths(edge_parser(), ["search", "--data", "d", "--profile", "p", "--out", "o"]) == union
    personalize = ["personalize", "--data", "d", "--model", "m", "--package", "p", "--out", "o"]
    assert _paths(edge_parser(), personalize) == _leaves(PersonalizeConfig, (), {})


def test_a_new_field_shows_up_as_a_flag_without_a_cli_edit(monkeypatch):
    """A field added to a config (here: a subclass put in its place) is a flag of the command."""
    import server_kit.personalization
    from server_kit.personalization import PKEConfig

    @dataclass(frozen=True, kw_only=True)
    class Extended(PKEConfig):
        warmup_epochs: int = 0  # epochs before the proximal term weighs in

    monkeypatch.setattr(server_kit.personalization, "PKEConfig", Extended)  # where the CLI takes it from
    args = build_parser().parse_args(
        ["personalize", "b", "--aggregate", "a", "--out", "o", "--warmup-epochs", "2"]
    )
    assert given_table(args, args.flags) == {"warmup_epochs": 2}


def test_help_shows_the_fields_defaults_and_choices(capsys):
    def helps(main, command: str) -> str:
        with pytest.raises(SystemExit):
            main([command, "--help-all"])  # the expert options too
        return " ".join(capsys.readouterr().out.split())

    text = helps(server_main, "aggregate")
    assert "--labels-rule {mean,label-weighted,conditioned}" in text and "(default: label-weighted)" in text
    assert "--on-error {stop,skip}" in text and "--inversion-classes {all,held}" in text
    epochs = "--distill-epochs INT passes of the student over the synthetic set; none: 10 for one-channel"
    assert epochs in text and "30 for color ones, 15 for color ones with mixtures (default: none)" in text
    assert "--fusion-mode {ce,md,sd}" in text and "(default when fusion is set: md)" in text
    text = helps(edge_main, "run")
    assert "--role {auto,classifier,cvae,both}" in text and "--cvae-model {cvae-small,cvae-large}" in text
    assert "--precision {auto,fp32,bf16}" in text


def test_simulate_keeps_the_clients_and_the_servers_device_apart(tmp_path):
    from server_kit.cli import simulate_config

    def config(*extra: str):
        args = build_parser().parse_args(["simulate", "--dataset", "digits", "--out", str(tmp_path), *extra])
        return simulate_config(args)

    both = config("--device", "cpu", "--aggregate-device", "cpu", "--precision", "fp32", "--seed", "4")
    assert both.device == "cpu" and both.aggregate.device == "cpu"
    assert both.precision == both.aggregate.precision == "fp32"  # the server's follows --precision
    assert both.aggregate.seed == 4  # and its seed --seed
    apart = config("--precision", "fp32", "--aggregate-precision", "bf16", "--max-train-samples", "none")
    assert (apart.precision, apart.aggregate.precision) == ("fp32", "bf16")
    assert apart.search.max_train_samples is None


def _printed(capsys, argv: list[str]) -> dict:
    assert server_main([*argv, "--print-config"]) == 0
    return json.loads(capsys.readouterr().out)


def test_config_files_in_toml_and_yaml_give_the_same_config(tmp_path, capsys):
    toml = tmp_path / "run.toml"
    toml.write_text(
        'dataset = "digits"\nnum_clients = 3\n[search]\nstrategy = "fixed"\nfinal_epochs = 2\n'
        "[aggregate.distill]\nepochs = 4\nlr = 2e-3\n",
        encoding="utf-8",
    )
    yaml = tmp_path / "run.yaml"
    yaml.write_text(
        "dataset: digits\nnum_clients: 3\nsearch:\n  strategy: fixed\n  final_epochs: 2\n"
        "aggregate:\n  distill:\n    epochs: 4\n    lr: 2e-3\n",
        encoding="utf-8",
    )
    out = ["--out", str(tmp_path / "o")]
    from_toml = _printed(capsys, ["simulate", "--config", str(toml), *out])
    assert from_toml == _printed(capsys, ["simulate", "--config", str(yaml), *out])
    assert from_toml["search"]["strategy"] == "fixed" and from_toml["aggregate"]["distill"]["lr"] == 0.002
    # a flag given overrides the file; the printed config reads back to itself
    over = _printed(capsys, ["simulate", "--config", str(yaml), *out, "--distill-epochs", "6"])
    assert over["aggregate"]["distill"]["epochs"] == 6 and over["num_clients"] == 3
    saved = tmp_path / "printed.json"
    saved.write_text(json.dumps(over), encoding="utf-8")
    assert _printed(capsys, ["simulate", "--config", str(saved)]) == over
    agg = tmp_path / "server.yaml"
    agg.write_text("labels:\n  rule: conditioned\nsynth: [inversion]\n", encoding="utf-8")
    printed = _printed(capsys, ["aggregate", "b.bundle", "--out", str(tmp_path / "a"), "--config", str(agg)])
    assert printed["labels"]["rule"] == "conditioned" and printed["synth"] == ["inversion"]


def test_an_option_of_another_strategy_or_source_is_refused_in_one_line(capsys, tmp_path):
    argv = ["simulate", "--dataset", "digits", "--out", str(tmp_path / "o"), "--strategy", "fixed"]
    assert server_main([*argv, "--particles", "3"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "'particles' does not apply to strategy 'fixed'" in err
    assert server_main([*argv, "--fusion-epochs", "3"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--fusion-epochs configure FedMHO's fusion, which is off" in err
    assert not Path(tmp_path / "o").exists()
