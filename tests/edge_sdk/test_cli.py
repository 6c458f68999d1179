"""`edge-sdk` command line: help, one-line errors (exit 2 for an option, 1 for what the run met), no partial
output on bad input."""

import pytest

from edge_sdk.cli import main


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_help_lists_every_command(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for cmd in ("partition", "profile", "profiles", "search", "train", "export", "run", "inspect"):
        assert cmd in out


@pytest.mark.parametrize(
    ("args", "match", "code"),
    [
        (["--dataset", "imagenet-22k", "--num-clients", "2", "--alpha", "0.5"], "imagenet-22k", 2),
        (
            [
                "--dataset",
                "mnist",
                "--data-root",
                "/nonexistent/root",
                "--num-clients",
                "2",
                "--alpha",
                "0.5",
            ],
            "--download",
            1,  # a DataError: the data the run looked for (exit 1 since #20; was 2)
        ),
        (["--dataset", "digits", "--num-clients", "2", "--alpha", "0"], "alpha", 2),
        (["--dataset", "digits", "--num-clients", "5000", "--alpha", "0.5"], "client", 1),
    ],
)
def test_partition_bad_input_is_one_line_and_writes_nothing(capsys, tmp_path, args, match, code):
    out_dir = tmp_path / "parts"
    got, _, err = run(capsys, "partition", *args, "--out", str(out_dir))
    assert got == code
    assert err.startswith("edge-sdk: error:")
    assert len(err.strip().splitlines()) == 1
    assert match in err
    assert not out_dir.exists() or not any(out_dir.iterdir())


def test_malformed_profile_is_refused(capsys, tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text('name = "x"\nmemory_mb = = 3\n')
    data = tmp_path / "parts"
    assert (
        run(
            capsys,
            "partition",
            "--dataset",
            "digits",
            "--num-clients",
            "2",
            "--alpha",
            "1",
            "--out",
            str(data),
        )[0]
        == 0
    )
    out = tmp_path / "c.bundle"
    code, _, err = run(
        capsys,
        "run",
        "--data",
        str(data / "client_00.npz"),
        "--profile",
        str(bad),
        "--out",
        str(out),
        "--quiet",
    )
    assert code == 2
    assert "not valid TOML" in err
    assert not out.exists()


def test_debug_shows_the_traceback(tmp_path):
    from common.errors import ToolkitError

    with pytest.raises(ToolkitError):
        main(
            [
                "--debug",
                "partition",
                "--dataset",
                "nope",
                "--num-clients",
                "2",
                "--alpha",
                "1",
                "--out",
                str(tmp_path / "p"),
            ]
        )


def test_profiles_lists_shipped_profiles(capsys):
    code, out, _ = run(capsys, "profiles")
    assert code == 0
    assert "raspberry-pi-4-4gb" in out and "wearable" in out


def test_profile_measures_this_device(capsys, tmp_path):
    from profiles import load_profile

    path = tmp_path / "me.toml"
    code, _, _ = run(capsys, "profile", "--out", str(path), "--seconds", "0.1")
    assert code == 0
    profile = load_profile(path)
    assert profile.gflops > 0
    assert profile.max_flops > 0


def test_upgrade_rewrites_schema1_bundles_in_place(capsys, tmp_path):
    from export.bundle import read_bundle
    from tests.export.test_bundle import _bundle, _schema1

    old, current = tmp_path / "old.bundle", tmp_path / "new.bundle"
    old.write_bytes(_schema1(_bundle()))
    current.write_bytes(_schema1(_bundle(seed=1)))
    assert run(capsys, "upgrade", str(current))[0] == 0
    code, out, _ = run(capsys, "upgrade", str(old), str(current))
    assert code == 0 and out.splitlines() == [
        f"{old}: upgraded to schema 2",
        f"{current}: already schema 2",
    ]
    assert read_bundle(old) == _bundle()
    junk = tmp_path / "junk.bundle"
    junk.write_bytes(b"\xc1")
    code, _, err = run(capsys, "upgrade", str(junk))
    # a corrupt bundle is a runtime error: exit 1 since #20 (was 2, the code of usage errors)
    assert code == 1 and err.startswith(f"edge-sdk: error: {junk}: not a readable bundle")
