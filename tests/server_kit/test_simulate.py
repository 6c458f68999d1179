"""A whole simulated federation on scikit-learn digits through `server-kit simulate` (about half a minute)."""

import dataclasses
import json

import pytest

from common.errors import ConfigError
from export.bundle import read_bundle
from server_kit.cli import main
from server_kit.simulate import SimulateResult, _client_line, _finished, _uploads, assign_profiles

TINY = [
    "simulate", "--dataset", "digits", "--num-clients", "3", "--alpha", "1.0", "--seed", "0", "--quiet",
    "--profiles", "laptop-cpu,raspberry-pi-4-4gb,android-lowend",
    "--particles", "2", "--iterations", "1", "--final-epochs", "10",
    "--synth", "inversion", "--samples-per-teacher", "200", "--steps", "40", "--distill-epochs", "20",
    "--server-device", "cpu",
]  # fmt: skip


@pytest.fixture(scope="module")
def federation(tmp_path_factory):
    out = tmp_path_factory.mktemp("sim")
    assert main([*TINY, "--out", str(out)]) == 0
    return out, json.loads((out / "results.json").read_text())


def test_results_have_every_field(federation):
    out, results = federation
    assert set(results) >= {
        "config",
        "seed",
        "clients",
        "global_accuracy",
        "mean_client_test_accuracy",
        "synthetic_size",
        "seconds",
    }
    assert results["seed"] == 0 and results["config"]["num_clients"] == 3
    assert [c["profile"] for c in results["clients"]] == [
        "laptop-cpu",
        "raspberry-pi-4-4gb",
        "android-lowend",
    ]
    for client in results["clients"]:
        assert {
            "arch",
            "val_accuracy",
            "test_accuracy",
            "flops",
            "params",
            "candidate_epochs",
            "seconds",
        } <= set(client)
        assert client["candidate_epochs"] > 0
        bundle = read_bundle(out / "clients" / f"client_{client['client']:02d}.bundle")
        assert bundle.arch == client["arch"]
        # every client model respects its device budget
        assert (
            client["flops"] <= bundle.profile["max_flops"]
            and client["params"] <= bundle.profile["max_params"]
        )
    assert {"partition", "clients", "server_inversion", "server_distill", "total"} <= set(results["seconds"])
    assert results["synthetic_size"] == 3 * 200
    assert (out / "server" / "global.onnx").is_file() and (out / "server" / "pseudo_images.png").is_file()


def test_each_client_has_a_progress_line_with_its_validation_accuracy(federation):
    """The line simulate logs as a client finishes (#20): its profile, role, arch, seconds, val score."""
    out, results = federation
    for row in results["clients"]:
        k = row["client"]
        line = _client_line(k, out / "clients" / f"client_{k:02d}.bundle", "reused")
        assert line.startswith(f"client {k:02d} ({row['profile']}, ")
        assert f", {row['arch']}): reused, " in line
        assert line.endswith(f" s, val accuracy {row['val_accuracy']:.4f}")


def test_results_json_holds_every_field_of_the_simulate_result(federation):
    _, results = federation
    assert set(results) == {f.name for f in dataclasses.fields(SimulateResult)} | {"phase_order"}
    assert sorted(results["phase_order"]) == sorted(results["seconds"])
    assert results["server_report"] == "server/report.json"


def test_global_accuracy_is_well_above_chance(federation):
    _, results = federation
    assert results["global_accuracy"] > 0.5  # chance is 0.1 on ten digit classes


def test_rerun_resumes_finished_clients(federation):
    out, results = federation
    before = {p.name: p.read_bytes() for p in (out / "clients").glob("*.bundle")}
    assert main([*TINY, "--out", str(out)]) == 0
    again = json.loads((out / "results.json").read_text())
    assert again["resumed_clients"] == 3
    assert {p.name: p.read_bytes() for p in (out / "clients").glob("*.bundle")} == before
    assert again["global_accuracy"] == pytest.approx(results["global_accuracy"])


def test_classifier_devices_upload_a_decoder_and_a_resume_checks_the_settings(federation):
    out, _ = federation
    clients = out / "clients"
    # every profile here fits a digits CVAE beside its classifier (role auto -> both)
    assert all((clients / f"client_{k:02d}.decoder.bundle").is_file() for k in range(3))
    assert read_bundle(clients / "client_00.decoder.bundle").kind == "cvae_decoder"
    assert _uploads(clients / "client_00.bundle") == [
        clients / "client_00.bundle",
        clients / "client_00.decoder.bundle",
    ]
    recorded = json.loads((clients / "client_00.bundle.report.json").read_text())["config"]
    assert _finished(clients / "client_00.bundle", recorded)
    assert not _finished(clients / "client_00.bundle", {**recorded, "seed": recorded["seed"] + 1})
    # a client made without the unknown output is redone when the federation asks for it
    from server_kit.simulate import SimulateConfig, _client_config

    federation = SimulateConfig(dataset="digits", out_dir=out, unknown_output=True)
    fedov = _client_config(federation, 0, "both", None)
    assert fedov.unknown_output and not _finished(clients / "client_00.bundle", fedov.to_dict())
    (clients / "client_01.decoder.bundle").write_bytes(b"torn")  # a broken upload is redone
    recorded = json.loads((clients / "client_01.bundle.report.json").read_text())["config"]
    assert not _finished(clients / "client_01.bundle", recorded)


def test_profile_assignment(tmp_path):
    assert assign_profiles(3, ("laptop-cpu", "jetson-nano-4gb"), None) == [
        "laptop-cpu",
        "jetson-nano-4gb",
        "laptop-cpu",
    ]
    mapping = tmp_path / "map.toml"
    mapping.write_text('default = "laptop-cpu"\n[clients]\n1 = "raspberry-pi-4-4gb"\n')
    assert assign_profiles(3, (), mapping) == ["laptop-cpu", "raspberry-pi-4-4gb", "laptop-cpu"]
    mapping.write_text('[clients]\n7 = "laptop-cpu"\n')
    with pytest.raises(ConfigError, match="index"):
        assign_profiles(3, ("laptop-cpu",), mapping)


def test_worker_processes_train_the_same_clients(federation, tmp_path):
    # --jobs 2: the partition and each client in a fresh worker forked from the fork server; the models
    # must be those of the in-process run (same seeds), and the fork server must be gone afterwards
    import multiprocessing.forkserver

    out, _ = federation
    assert main([*TINY, "--jobs", "2", "--out", str(tmp_path)]) == 0
    for k in range(3):
        name = f"client_{k:02d}.bundle"
        ours, theirs = read_bundle(tmp_path / "clients" / name), read_bundle(out / "clients" / name)
        assert (ours.arch, ours.label_counts) == (theirs.arch, theirs.label_counts)
        assert ours.model_onnx == theirs.model_onnx
    assert (tmp_path / "data" / "partition.json").read_bytes() == (
        out / "data" / "partition.json"
    ).read_bytes()
    server = getattr(multiprocessing.forkserver, "_forkserver", None)
    assert getattr(server, "_forkserver_pid", None) is None
