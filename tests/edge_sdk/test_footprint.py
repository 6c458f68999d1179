"""Devices too small for the toolkit itself: `edge-sdk run` refuses them in one line, before torch; ``auto``
steps down to the CVAE role where only it fits; a simulation (or ``--emulate``) stands in for them."""

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from common.errors import ResourceError
from edge_sdk.cli import main
from edge_sdk.data import load_dataset, save_client_data
from edge_sdk.footprint import RUNTIME_MB, check_hosts, host_role, hosts
from edge_sdk.roles import resolve_role
from edge_sdk.strategies.pso import PSOConfig
from profiles import list_profiles, load_profile


def _with_memory(memory_mb: float):
    return dataclasses.replace(load_profile("laptop-cpu"), name="probe", memory_mb=memory_mb)


def test_auto_steps_down_to_the_role_whose_runtime_fits() -> None:
    cvae_only = _with_memory(RUNTIME_MB["cvae"])  # exactly the CVAE role's floor, below the classifier's
    assert hosts(cvae_only, "cvae") and not hosts(cvae_only, "classifier")
    for resolved in ("both", "classifier", "cvae"):
        assert host_role(cvae_only, "auto", resolved) == "cvae"
    roomy = _with_memory(max(RUNTIME_MB.values()))
    for resolved in ("both", "classifier", "cvae"):
        assert host_role(roomy, "auto", resolved) == resolved  # nothing changes where it all fits
    classifier_only = _with_memory(RUNTIME_MB["classifier"])  # measured: both needs a little more
    assert RUNTIME_MB["both"] > RUNTIME_MB["classifier"] > RUNTIME_MB["cvae"]
    assert host_role(classifier_only, "auto", "both") == "classifier"
    with pytest.raises(ResourceError, match=r"'probe' allows .* MB, but `edge-sdk run` needs at least"):
        host_role(cvae_only, "classifier", "classifier")  # an explicit role is refused, never changed


def test_a_device_below_every_role_is_refused_with_the_fix() -> None:
    small = _with_memory(min(RUNTIME_MB.values()) - 1)
    with pytest.raises(ResourceError, match=r"in the cvae role .* --emulate") as err:
        check_hosts(small, "auto")
    assert isinstance(err.value, RuntimeError) and "\n" not in str(err.value)
    with pytest.raises(ResourceError):
        resolve_role("auto", small, (1, 8, 8), 10, PSOConfig(), hosted=True)
    # a simulation stands in for the device: the profile's model budgets alone decide the role
    assert resolve_role("auto", small, (1, 8, 8), 10, PSOConfig()) == "both"


def test_shipped_profiles_that_cannot_host_edge_sdk_run() -> None:
    """The profiles whose memory_mb is below the smallest measured run (benchmarks/RESULTS.md, "Devices too
    small for the toolkit")."""
    refused = {name for name in list_profiles() if not hosts(load_profile(name), "auto")}
    assert refused == {"raspberry-pi-zero-2w", "wearable"}
    cvae_only = {
        n
        for n in list_profiles()
        if hosts(load_profile(n), "cvae") and not hosts(load_profile(n), "classifier")
    }
    assert cvae_only == {"android-lowend"}


def test_cli_run_refuses_a_device_too_small_before_reading_data(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "c.bundle"
    missing = tmp_path / "absent.npz"  # the refusal comes first: no torch, no data read
    code = main(["run", "--data", str(missing), "--profile", "raspberry-pi-zero-2w", "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 1 and len(err.strip().splitlines()) == 1
    assert (
        err.startswith("edge-sdk: error: profile 'raspberry-pi-zero-2w' allows 160 MB") and "--emulate" in err
    )
    assert not out.exists()


def test_cli_run_emulate_stands_in_for_the_device(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = tmp_path / "client.npz"
    save_client_data(data, load_dataset("digits").subset(np.arange(200)))
    out = tmp_path / "w.bundle"
    argv = [
        "run",
        "--data",
        str(data),
        "--profile",
        "wearable",
        "--out",
        str(out),
        "--quiet",
        "--cvae-epochs",
        "1",
    ]
    assert main(argv) == 1 and "'wearable' allows 192 MB" in capsys.readouterr().err
    assert main([*argv, "--emulate"]) == 0
    assert "cvae_decoder" in capsys.readouterr().out and out.exists()
