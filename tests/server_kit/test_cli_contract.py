"""What both command lines promise (#20): every error is one stderr line with exit code 2 (the command as
given cannot run) or 1 (the run met bad data, a bad bundle, an I/O error or a bug), never a traceback
without --debug; `--format json` prints one JSON object; `--quiet` / `--verbose` set the log level; `--help`
shows defaults and choices; options another setting would ignore are refused."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from edge_sdk.cli import main as edge_main
from export.bundle import write_bundle
from server_kit.cli import main as server_main
from tests.export.test_bundle import _bundle
from tests.server_kit.test_aggregate import bundles  # noqa: F401
from tests.server_kit.test_server_cli import TINY

ROOT = Path(__file__).resolve().parents[2]


def _run(main, argv: list[str]) -> int:
    """The exit code of ``main(argv)``, an argparse error's SystemExit included."""
    try:
        return main(argv)
    except SystemExit as exc:
        return int(exc.code or 0)


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    """A small client file (digits-shaped: 1 x 8 x 8, 10 classes)."""
    path = tmp_path_factory.mktemp("data") / "c.npz"
    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, (60, 1, 8, 8), dtype=np.uint8)
    np.savez(path, x=x, y=np.arange(60, dtype=np.int64) % 10, num_classes=np.int64(10))
    return path


def _error_cases(tmp: Path, data: Path) -> list[tuple[str, object, list[str], int, str]]:
    corrupt = tmp / "corrupt.bundle"
    corrupt.write_bytes(b"\xc1 not msgpack")
    search = ["search", "--data", str(data), "--out", str(tmp / "s.json")]
    run = ["run", "--data", str(data), "--profile", "laptop-cpu", "--out", str(tmp / "c.bundle")]
    # fmt: off
    return [
        ("bad flag", edge_main, [*search, "--profile", "laptop-cpu", "--bogus"], 2, "unrecognized"),
        ("bad choice", edge_main, [*search, "--profile", "laptop-cpu", "--strategy", "x"], 2, "invalid"),
        ("bad format", server_main, ["evaluate", "m.onnx", "--data", "d", "--format", "yaml"], 2, "invalid"),
        ("unknown profile", edge_main, [*search, "--profile", "nope"], 2, "unknown profile 'nope'"),
        ("bad device", edge_main, [*search, "--profile", "laptop-cpu", "--device", "gpu"], 2, "'gpu'"),
        ("missing file", edge_main, ["search", "--data", str(tmp / "no.npz"), "--profile", "laptop-cpu",
                                     "--out", str(tmp / "s.json")], 1, "does not exist"),
        ("corrupt bundle", edge_main, ["inspect", str(corrupt)], 1, "not a readable bundle"),
        ("corrupt bundle (server)", server_main, ["aggregate", str(corrupt), "--out", str(tmp / "a")], 1,
         "not a readable bundle"),
        ("out dir not writable", edge_main, ["partition", "--dataset", "digits", "--num-clients", "2",
         "--alpha", "1", "--out", "/proc/r20-parts"], 1, "/proc"),
        ("population with pso", edge_main, [*run, "--population", "4"], 2, "'population' does not apply"),
        ("supernet with pso", edge_main, [*run, "--supernet", "s.file"], 2, "'supernet' does not apply"),
        ("finalists with evolution", edge_main, [*run, "--strategy", "evolution", "--finalists", "2"], 2,
         "'finalists' does not apply"),
        ("warm start with evolution", server_main, ["simulate", "--dataset", "digits", "--out",
         str(tmp / "m"), "--strategy", "evolution", "--warm-start"], 2, "'warm_start' does not apply"),
        ("fusion knobs without fusion", server_main, ["aggregate", "a.bundle", "--out", str(tmp / "f"),
         "--fusion-lam", "0.3"], 2, "--fusion-lam configure FedMHO's fusion"),
        ("fusion preset without fusion", server_main, ["simulate", "--dataset", "digits", "--out",
         str(tmp / "g"), "--fusion-preset", "mnist"], 2, "--fusion-preset"),
        # #33: every bad input below is refused before anything is written, where it was late or never
        ("unknown dataset", server_main, ["simulate", "--dataset", "nosuch", "--out", str(tmp / "h"),
         "--print-config"], 2, "unknown dataset 'nosuch'"),
        ("no GPU (print-config)", server_main, ["simulate", "--dataset", "digits", "--out", str(tmp / "i"),
         "--device", "cuda", "--print-config"], 2, "CUDA is not available"),
        ("no GPU (simulate)", server_main, ["simulate", "--dataset", "digits", "--out", str(tmp / "j"),
         "--device", "cuda"], 2, "CUDA is not available"),
        ("no GPU (server)", server_main, ["simulate", "--dataset", "digits", "--out", str(tmp / "k"),
         "--aggregate-device", "cuda:0"], 2, "CUDA is not available"),
        ("no GPU (aggregate)", server_main, ["aggregate", str(corrupt), "--out", str(tmp / "l"),
         "--device", "cuda", "--print-config"], 2, "CUDA is not available"),
        ("no GPU (device)", edge_main, [*run, "--device", "cuda"], 2, "CUDA is not available"),
        ("missing bundle", server_main, ["aggregate", str(tmp / "no.bundle"), "--out", str(tmp / "m")], 1,
         "cannot read bundle"),
        ("hard labels of the loss alone", server_main, ["aggregate", str(corrupt), "--out", str(tmp / "n"),
         "--distill-hard-labels"], 2, "unrecognized arguments: --distill-hard-labels"),
        ("data not an npz", edge_main, ["run", "--data", str(corrupt), "--profile", "laptop-cpu", "--out",
         str(tmp / "o" / "c.bundle")], 1, "is not an .npz archive"),
    ]
    # fmt: on


def test_every_error_is_one_line_with_its_exit_code(capsys, monkeypatch, tmp_path, data):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # this machine has no GPU, whatever it has
    for name, main, argv, code, match in _error_cases(tmp_path, data):
        assert _run(main, argv) == code, name
        captured = capsys.readouterr()
        err = captured.err
        assert len(err.strip().splitlines()) == 1, (name, err)
        assert "Traceback" not in err and match in err, (name, err)
        assert ": error: " in err, (name, err)
        assert captured.out == "", (name, captured.out)  # --print-config printed nothing either
    # no command wrote a file or made a directory
    assert [p.name for p in tmp_path.rglob("*")] == ["corrupt.bundle"]


def test_an_unexpected_exception_is_one_line_and_debug_shows_it(capsys, monkeypatch, data):
    """A bug (any exception the toolkit did not raise on purpose) is "internal error", exit 1."""
    import edge_sdk.data

    def broken(*args, **kwargs):
        raise KeyError("boom")

    monkeypatch.setattr(edge_sdk.data, "load_client_data", broken)
    argv = ["train", "--data", str(data), "--arch", "C4k3-P-F10", "--out", "m.onnx"]
    assert edge_main(argv) == 1
    err = capsys.readouterr().err
    assert err.startswith("edge-sdk: internal error: KeyError: 'boom'; rerun with --debug")
    assert len(err.strip().splitlines()) == 1
    with pytest.raises(KeyError, match="boom"):
        edge_main(["--debug", *argv])


def test_the_real_entry_point_exits_1_without_a_traceback(tmp_path, data):
    """`python -m edge_sdk.cli search --device gpu` was a torch RuntimeError traceback (exit 1)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    argv = [sys.executable, "-m", "edge_sdk.cli", "inspect", str(tmp_path / "missing.bundle")]
    done = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert done.returncode == 1, done.stderr
    assert done.stderr.startswith("edge-sdk: error: ") and done.stderr.count("\n") == 1
    assert "Traceback" not in done.stderr and done.stdout == ""


def _json(capsys, main, argv: list[str]) -> dict:
    assert main([*argv, "--format", "json"]) == 0
    out = capsys.readouterr().out
    result = json.loads(out)
    assert isinstance(result, dict) and out == json.dumps(result, sort_keys=True, indent=2) + "\n"
    return result


def test_every_light_command_prints_one_json_object(capsys, tmp_path, data, bundles):  # noqa: F811
    parts = tmp_path / "parts"
    result = _json(capsys, edge_main, ["partition", "--dataset", "digits", "--num-clients", "2", "--alpha",
                                       "1", "--out", str(parts)])  # fmt: skip
    assert result["clients"] == [str(parts / "client_00.npz"), str(parts / "client_01.npz")]
    assert len(result["label_histogram"]) == 2 and result["test"] == str(parts / "test.npz")
    names = [p["name"] for p in _json(capsys, edge_main, ["profiles"])["profiles"]]
    assert "wearable" in names and "laptop-cpu" in names
    result = _json(capsys, edge_main, ["profile", "--seconds", "0.05", "--out", str(tmp_path / "me.toml")])
    assert result["wrote"] == str(tmp_path / "me.toml") and result["profile"]["gflops"] > 0

    model, bundle = tmp_path / "m.onnx", tmp_path / "m.bundle"
    train = ["train", "--data", str(data), "--arch", "C4k3-P-F10", "--train-epochs", "1", "--quiet"]
    result = _json(capsys, edge_main, [*train, "--out", str(model)])
    assert result["arch"] == "C4k3-P-F10" and 0 <= result["metrics"]["val_accuracy"] <= 1
    result = _json(capsys, edge_main, ["export", "--model", str(model), "--profile", "laptop-cpu", "--out",
                                       str(bundle)])  # fmt: skip
    assert result["kind"] == "classifier" and result["wrote"] == str(bundle)
    manifest = _json(capsys, edge_main, ["inspect", str(bundle)])
    assert manifest["arch"] == "C4k3-P-F10"
    assert _json(capsys, edge_main, ["upgrade", str(bundle)])["upgraded"] == {str(bundle): False}

    search = ["search", "--data", str(data), "--profile", "laptop-cpu", "--out", str(tmp_path / "s.json"),
              "--particles", "2", "--iterations", "1", "--search-epochs", "1", "--final-epochs", "1",
              "--quiet"]  # fmt: skip
    result = _json(capsys, edge_main, search)
    assert result["best_spec"] == json.loads((tmp_path / "s.json").read_text())["best_spec"]
    run = ["run", "--data", str(data), "--profile", "laptop-cpu", "--out", str(tmp_path / "r.bundle"),
           "--strategy", "fixed", "--fixed-arch", "C4k3-P-F10", "--final-epochs", "1", "--role", "classifier",
           "--quiet"]  # fmt: skip
    result = _json(capsys, edge_main, run)
    assert result["role"] == "classifier" and result["wrote"][0] == str(tmp_path / "r.bundle")

    init = tmp_path / "init.onnx"
    result = _json(capsys, server_main, ["init", "--arch", "C4k3-P-F10", "--data", str(data), "--out",
                                         str(init)])  # fmt: skip
    assert result == {"arch": "C4k3-P-F10", "input_shape": [1, 8, 8], "num_classes": 10, "seed": 0,
                      "wrote": str(init)}  # fmt: skip
    assert 0 <= _json(capsys, server_main, ["evaluate", str(init), "--data", str(data)])["accuracy"] <= 1
    corrupt = tmp_path / "corrupt.bundle"
    corrupt.write_bytes(b"\xc1")
    argv = ["aggregate", *bundles, str(corrupt), "--out", str(tmp_path / "agg"), "--on-error", "skip", *TINY]
    result = _json(capsys, server_main, argv)
    assert result["wrote"][0] == str(tmp_path / "agg" / "global.onnx") and result["accuracy"] is None
    assert [row["file"] for row in result["skipped"]] == [str(corrupt)]


def test_text_stays_today_lines_and_inspect_stays_json(capsys, tmp_path):
    bundle = tmp_path / "a.bundle"
    write_bundle(_bundle(), bundle)
    assert edge_main(["inspect", str(bundle)]) == 0
    assert json.loads(capsys.readouterr().out)["arch"] == "C8k3-P-F10"
    assert edge_main(["upgrade", str(bundle)]) == 0
    assert capsys.readouterr().out == f"{bundle}: already schema 2\n"


def test_quiet_and_verbose_set_what_reaches_stderr(capsys, tmp_path):
    bundle = tmp_path / "a.bundle"
    write_bundle(_bundle(), bundle)
    onnx = tmp_path / "a.onnx"
    assert edge_main(["inspect", str(bundle), "--extract-onnx", str(onnx)]) == 0
    assert capsys.readouterr().err == f"edge-sdk: wrote {onnx}\n"  # an info line, as before #20
    assert edge_main(["inspect", str(bundle), "--extract-onnx", str(onnx), "--quiet"]) == 0
    assert capsys.readouterr().err == ""
    assert edge_main(["--verbose", "inspect", str(bundle)]) == 0  # the root's flags reach the command
    assert capsys.readouterr().err == ""
    assert _run(edge_main, ["inspect", str(bundle), "--quiet", "--verbose"]) == 2
    assert "not allowed with argument" in capsys.readouterr().err


def test_help_shows_defaults_choices_and_one_meaning_per_name(capsys):
    def helps(main, command: str) -> str:
        with pytest.raises(SystemExit):
            main([command, "--help-all"])  # the expert options too
        return " ".join(capsys.readouterr().out.split())

    text = helps(server_main, "simulate")
    # simulate's plain options default to None (a --config file or the preset fills them): the help
    # names the value they take when neither does
    assert "clients in the federation (default: 10)" in text
    assert "Dirichlet concentration of the label skew (default: 0.5)" in text
    assert "(default: 0)" in text and "(default: None)" not in text
    assert "--strategy {pso,fixed,random-pool,evolution}" in text and "--search-preset {fast,paper}" in text
    assert "--resume {auto,strict,off}" in text and "(default: auto)" in text  # a Literal field's choices
    assert "--distill-tau" in text and "--tau " not in text  # every tau is a temperature, named by its phase
    assert "--pkt-weight-pull FLOAT" in helps(edge_main, "personalize")
    assert "--format {text,json}" in helps(edge_main, "profiles")


def test_the_cli_choices_are_the_registries(capsys):
    """--strategy and --search-preset offer what the registries hold (the CLI reads them when it builds the
    command's options)."""
    from edge_sdk.search import STRATEGIES
    from edge_sdk.strategies.base import SHARED_PRESETS

    with pytest.raises(SystemExit):
        edge_main(["run", "--help"])
    text = capsys.readouterr().out
    assert f"--strategy {{{','.join(STRATEGIES)}}}" in text
    assert f"--search-preset {{{','.join(SHARED_PRESETS)}}}" in text


def test_distill_tau_reaches_the_distillation_config():
    from common.config_args import given_table
    from server_kit.cli import aggregate_config, build_parser

    args = build_parser().parse_args(["aggregate", "a.bundle", "--out", "o", "--distill-tau", "2.5"])
    assert aggregate_config(args, given_table(args, args.flags)).distill.tau == 2.5
