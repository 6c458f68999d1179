"""Both command lines on bad invocations: one stderr line, exit code 2 (1 for a bad bundle), nothing
written; `--on-error`."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import msgpack
import pytest

from edge_sdk.cli import main as edge_main
from server_kit.cli import main as server_main
from tests.server_kit.test_aggregate import bundles  # noqa: F401

# every sub-command that writes, with its other required arguments, and whether --out is a directory
WRITERS = [
    (edge_main, ["partition", "--dataset", "digits", "--num-clients", "2", "--alpha", "1"], "--out", True),
    (edge_main, ["profile"], "--out", False),
    (edge_main, ["search", "--data", "d.npz", "--profile", "laptop-cpu"], "--out", False),
    (edge_main, ["train", "--data", "d.npz", "--arch", "C4k3-P-F3"], "--out", False),
    (edge_main, ["export", "--model", "m.onnx", "--profile", "laptop-cpu"], "--out", False),
    (edge_main, ["run", "--data", "d.npz", "--profile", "laptop-cpu"], "--out", False),
    (edge_main, ["personalize", "--data", "d.npz", "--model", "a.bundle", "--package", "p"], "--out", True),
    (edge_main, ["inspect", "a.bundle"], "--extract-onnx", False),
    (server_main, ["aggregate", "a.bundle"], "--out", True),
    (server_main, ["simulate", "--dataset", "digits"], "--out", True),
    (server_main, ["personalize", "a.bundle", "--aggregate", "agg"], "--out", True),
    (server_main, ["supernet", "a.bundle", "--aggregate", "agg"], "--out", False),
    (server_main, ["hetero-avg", "a.bundle", "--supernet", "s"], "--out", True),
]


def _fails_in_one_line(capsys, main, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    return err


@pytest.mark.parametrize(("main", "argv", "option", "is_dir"), WRITERS, ids=[w[1][0] for w in WRITERS])
def test_an_output_of_the_wrong_kind_is_one_line_before_any_work(
    capsys, tmp_path, main, argv, option, is_dir
):
    """Was a FileExistsError traceback (exit 1) at the end of the run."""
    afile = tmp_path / "taken"
    afile.write_text("not a directory")
    if is_dir:
        err = _fails_in_one_line(capsys, main, [*argv, option, str(afile)])
        assert f"argument {option}: must be a directory, got '{afile}', an existing file" in err
    else:
        err = _fails_in_one_line(capsys, main, [*argv, option, str(tmp_path)])
        assert f"argument {option}: must be a file path, got '{tmp_path}', an existing directory" in err
    err = _fails_in_one_line(capsys, main, [*argv, option, str(afile / "under")])
    assert f"'{afile}' is an existing file, not a directory" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken"]


@pytest.mark.parametrize("command", ["aggregate", "personalize", "supernet", "hetero-avg"])
def test_an_empty_bundle_list_is_one_line(capsys, tmp_path, command):
    """Was the 32-line usage of the sub-command with the error at the bottom."""
    err = _fails_in_one_line(capsys, server_main, [command, "--out", str(tmp_path / "o")])
    assert f"server-kit {command}: error: the following arguments are required: bundles" in err
    assert f"see server-kit {command} --help" in err


TINY = [
    "--synth", "inversion", "--inversion-samples-per-teacher", "12", "--inversion-steps", "3",
    "--inversion-batch-size", "8",
    "--distill-epochs", "1", "--distill-batch-size", "8", "--student", "C4k3-P-F16-F10",
    "--device", "cpu", "--seed", "3", "--quiet",
]  # fmt: skip


def test_on_error_skip_drops_each_bad_bundle_with_one_stderr_line(capsys, tmp_path, bundles):  # noqa: F811
    corrupt = tmp_path / "corrupt.bundle"
    corrupt.write_bytes(Path(bundles[0]).read_bytes()[:-7])
    old = tmp_path / "old.bundle"  # schema 1 (sha256 of the model only): refused with the way to fix it
    wire = msgpack.unpackb(Path(bundles[2]).read_bytes(), raw=False)
    wire.update(schema_version=1, sha256=hashlib.sha256(wire["model_onnx"]).hexdigest())
    old.write_bytes(msgpack.packb(wire, use_bin_type=True))
    argv = ["aggregate", *bundles, str(corrupt), "--out", str(tmp_path / "stop"), *TINY]
    assert server_main(argv) == 1  # a corrupt bundle is a runtime error (exit 1 since #20; was 2)
    err = capsys.readouterr().err
    assert err.startswith(f"server-kit: error: {corrupt}: not a readable bundle") and err.count("\n") == 1

    argv = [
        "aggregate",
        str(corrupt),
        *bundles,
        str(old),
        "--out",
        str(tmp_path / "skip"),
        "--on-error",
        "skip",
    ]
    assert server_main([*argv, *TINY]) == 0
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert len(lines) == 2
    assert lines[0].startswith(f"server-kit: skipped {corrupt}: not a readable bundle")
    assert lines[1].startswith(f"server-kit: skipped {old}: bundle schema 1 is no longer read")
    assert lines[1].endswith("`edge-sdk upgrade FILE`")
    assert "wrote" in captured.out
    report = json.loads((tmp_path / "skip" / "report.json").read_text())
    assert [s["file"] for s in report["skipped"]] == [str(corrupt), str(old)]
