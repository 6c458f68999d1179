"""The CLIs' shared plumbing (common.cli): logging configured once per call, output in both formats."""

from __future__ import annotations

import json
import logging

from common.cli import Output, cli_main, configure_logging, root_parser
from common.errors import ConfigError, DataError


def _cli():
    parser, command = root_parser("tool", "a test CLI", version="0")

    def ok(args):
        logging.getLogger("edge_sdk").info("working")
        logging.getLogger("server_kit").debug("detail")
        return Output({"b": 1, "a": [2]}, ["done"])

    def usage(args):
        raise ConfigError("x must be 1, got 2; pass --x 1")

    def runtime(args):
        raise DataError("file f is truncated")

    command("ok", ok, "succeeds")
    command("usage", usage, "a usage error")
    command("runtime", runtime, "a runtime error")
    return parser


def test_logging_is_configured_once_however_often_main_runs(capsys):
    for _ in range(2):
        configure_logging("tool", logging.INFO)
    logging.getLogger("export").info("one line")
    assert capsys.readouterr().err == "tool: one line\n"


def test_formats_and_levels(capsys):
    assert cli_main("tool", _cli(), ["ok"]) == 0
    assert capsys.readouterr() == ("done\n", "tool: working\n")
    assert cli_main("tool", _cli(), ["ok", "--format", "json", "--verbose"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out) == {"a": [2], "b": 1} and out.index('"a"') < out.index('"b"')
    assert err == "tool: working\ntool: detail\n"
    assert cli_main("tool", _cli(), ["--quiet", "ok"]) == 0
    assert capsys.readouterr() == ("done\n", "")


def test_exit_codes(capsys):
    assert cli_main("tool", _cli(), ["usage"]) == 2
    assert capsys.readouterr().err == "tool: error: x must be 1, got 2; pass --x 1\n"
    assert cli_main("tool", _cli(), ["runtime", "--format", "json"]) == 1
    assert capsys.readouterr() == ("", "tool: error: file f is truncated\n")
