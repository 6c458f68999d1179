"""#33: the help of every command of both CLIs, with --help and --help-all: plain sentences (no docstring
markup, no benchmark percentages), every option under --help-all, and simulate's --help short enough to
read, its expert options under --help-all only."""

from __future__ import annotations

import argparse
import re

import pytest

from edge_sdk.cli import build_parser as edge_parser
from edge_sdk.cli import main as edge_main
from server_kit.cli import build_parser as server_parser
from server_kit.cli import main as server_main

CLIS = {"edge-sdk": (edge_main, edge_parser), "server-kit": (server_main, server_parser)}
# Sphinx roles, reST literals and percentages belong to docstrings and benchmarks/RESULTS.md, not to --help
MARKUP = re.compile(r":(?:meth|func|data|mod|class|attr):|``|%")
OPTION = re.compile(r"^ {2}(-[-\w]+)", re.MULTILINE)


def _commands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def _help(capsys, main, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as stop:
        main(argv)
    assert stop.value.code == 0, argv
    return capsys.readouterr().out


def _options(parser: argparse.ArgumentParser) -> set[str]:
    """The first option string of every option of a command (what its help lists it by); a renamed
    option's old name, which only refuses, is hidden."""
    parser.format_help()  # a command's options are added when it is parsed or its help shown
    return {a.option_strings[0] for a in parser._actions if a.option_strings and a.help != argparse.SUPPRESS}


@pytest.mark.parametrize("cli", list(CLIS))
def test_every_help_is_plain_text_and_help_all_lists_every_option(cli, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")  # argparse wraps at the terminal's width
    main, build = CLIS[cli]
    commands = _commands(build())
    assert _help(capsys, main, ["--help-all"]) == _help(capsys, main, ["--help"])  # no expert option
    for name, parser in commands.items():
        short, every = (_help(capsys, main, [name, flag]) for flag in ("--help", "--help-all"))
        for flag, text in (("--help", short), ("--help-all", every)):
            bad = [line for line in text.splitlines() if MARKUP.search(line)]
            assert not bad, (cli, name, flag, bad)
        listed = set(OPTION.findall(every))
        assert listed == _options(parser), (cli, name, _options(parser) ^ listed)
        assert set(OPTION.findall(short)) <= listed
        hidden = len(listed - set(OPTION.findall(short)))
        if hidden:  # --help says what it leaves out
            assert f"--help-all also lists {hidden} options for experts." in short, (cli, name)


def test_simulate_help_shows_the_common_options_by_phase_and_leaves_the_rest_to_help_all(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    short = _help(capsys, server_main, ["simulate", "--help"])
    every = _help(capsys, server_main, ["simulate", "--help-all"])
    assert len(short.splitlines()) <= 120, len(short.splitlines())
    titles = re.findall(r"^(\S[^\n]*):$", short, re.MULTILINE)
    assert titles[:4] == [
        "options",
        "federation",
        "clients: architecture search",
        "clients: CVAE (devices too small for a classifier)",
    ]
    assert titles[4] == "server"
    for option in (
        "--dataset",
        "--out",
        "--num-clients",
        "--seed",
        "--federation-preset",
        "--strategy",
        "--final-epochs",
    ):
        assert re.search(rf"^  {option}\b", short, re.MULTILINE), option
    for option in ("--particles", "--inversion-steps", "--generator-nz", "--fusion-mode", "--cvae-kl-weight"):
        assert not re.search(rf"^  {option}\b", short, re.MULTILINE), option
        assert re.search(rf"^  {option}\b", every, re.MULTILINE), option
    # one text per option: the five evolution options each say what they are
    population, mutations = (re.search(rf"^  --{o} INT\s+(.+?)\(default", every, re.MULTILINE | re.DOTALL)
                             for o in ("population", "mutations"))  # fmt: skip
    assert population and mutations and population.group(1) != mutations.group(1)
