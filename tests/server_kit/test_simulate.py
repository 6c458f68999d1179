"""A whole simulated federation on scikit-learn digits through `server-kit simulate` (about half a minute)."""

import dataclasses
import json
import logging
import shutil

import pytest

from common.errors import ConfigError
from edge_sdk.client import CODE_VERSION
from edge_sdk.data import client_name
from edge_sdk.roles import resolve_role
from export.bundle import read_bundle
from export.onnx_export import read_deploy
from profiles import load_profile
from server_kit.cli import main
from server_kit.federation.resume import client_verdict as _client_verdict
from server_kit.federation.resume import prepare_server as _prepare_server
from server_kit.federation.resume import uploads_of as _uploads
from server_kit.federation.simulate import (
    SimulateConfig,
    SimulateResult,
    _client_config,
    _client_line,
    _partition_verdict,
    assign_profiles,
)

TINY = [
    "simulate", "--dataset", "digits", "--num-clients", "3", "--alpha", "1.0", "--seed", "0", "--quiet",
    "--profiles", "laptop-cpu,raspberry-pi-4-4gb,android-lowend",
    "--particles", "2", "--iterations", "1", "--final-epochs", "10",
    "--synth", "inversion", "--inversion-samples-per-teacher", "200", "--inversion-steps", "40",
    "--distill-epochs", "20", "--aggregate-device", "cpu",
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
        bundle = read_bundle(out / "clients" / f"{client_name(client['client'], 3)}.bundle")
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
        name = client_name(k, 3)
        line = _client_line(out / "clients" / f"{name}.bundle", "reused")
        assert line.startswith(f"{name} ({row['profile']}, ")
        assert f", {row['arch']}): reused, " in line
        assert line.endswith(f" s, val accuracy {row['val_accuracy']:.4f}")


def test_results_json_holds_every_field_of_the_simulate_result(federation):
    _, results = federation
    assert set(results) == {f.name for f in dataclasses.fields(SimulateResult)} | {"phase_order"}
    assert sorted(results["phase_order"]) == sorted(results["seconds"])
    assert results["server_report"] == "server/report.json"


def test_global_accuracy_is_well_above_chance(federation):
    _, results = federation
    # chance is 0.1 on ten digit classes; the bound is a wide margin under what the run reaches, so the
    # rounding of another instruction set (which moves it by a few test images) cannot cross it
    assert results["global_accuracy"] > 0.5


def test_every_deployable_model_names_the_digits(federation):
    """The digits' names go from the partition's files into each client's classifier and the global model."""
    out, _ = federation
    digits = tuple("0123456789")
    models = [read_bundle(p).model_onnx for p in sorted((out / "clients").glob("client_??.bundle"))]
    assert len(models) == 3
    for model in [*models, (out / "server" / "global.onnx").read_bytes()]:
        meta = read_deploy(model, num_logits=10)
        assert meta is not None and meta.class_names == digits and meta.input_spec.shape == (1, 8, 8)


def test_rerun_resumes_finished_clients(federation):
    out, results = federation
    before = {p.name: p.read_bytes() for p in (out / "clients").glob("*.bundle")}
    assert main([*TINY, "--out", str(out)]) == 0
    again = json.loads((out / "results.json").read_text())
    assert again["resumed_clients"] == 3
    assert {p.name: p.read_bytes() for p in (out / "clients").glob("*.bundle")} == before
    assert again["global_accuracy"] == pytest.approx(results["global_accuracy"])  # same bundles, same path


def test_classifier_devices_upload_a_decoder_and_a_resume_checks_the_settings(federation, tmp_path):
    out, _ = federation
    clients = out / "clients"
    # every profile here fits a digits CVAE beside its classifier (role auto -> both)
    assert all((clients / f"{client_name(k, 3)}.decoder.bundle").is_file() for k in range(3))
    assert read_bundle(clients / "client_00.decoder.bundle").kind == "cvae_decoder"
    assert _uploads(clients / "client_00.bundle") == [
        clients / "client_00.bundle",
        clients / "client_00.decoder.bundle",
    ]
    report = json.loads((clients / "client_00.bundle.report.json").read_text())
    recorded = {key: report[key] for key in ("config", "data_sha256", "device_profile", "version")}
    assert recorded["version"] == CODE_VERSION and len(recorded["data_sha256"]) == 64
    assert recorded["device_profile"]["name"] == "laptop-cpu"
    assert _client_verdict(clients / "client_00.bundle", recorded).reuse
    changed = _client_verdict(clients / "client_00.bundle", {**recorded, "version": "0.0.0+client.0"})
    assert not changed.reuse and changed.differs == ("version",)
    seed = {**recorded, "config": {**recorded["config"], "seed": recorded["config"]["seed"] + 1}}
    assert _client_verdict(clients / "client_00.bundle", seed).differs == ("config.seed",)
    # another device (a smaller budget) searches another space: redone too
    small = {**recorded, "device_profile": {**recorded["device_profile"], "max_flops": 1000}}
    assert _client_verdict(clients / "client_00.bundle", small).differs == ("device_profile.max_flops",)
    # a client made without the unknown output is redone when the federation asks for it
    federation = SimulateConfig(dataset="digits", out_dir=out, unknown_output=True)
    fedov = _client_config(federation, 0, "both", None)
    wanted = {**recorded, "config": json.loads(json.dumps(fedov.to_dict()))}
    assert (
        fedov.unknown_output
        and "config.unknown_output" in _client_verdict(clients / "client_00.bundle", wanted).differs
    )
    # a CVAE-only device of that federation trains no classifier, so it is asked for no unknown output
    assert not _client_config(federation, 1, "cvae", None).unknown_output
    # a broken upload is redone (torn in a copy: the later tests rerun copies of this federation)
    for name in ("client_01.bundle", "client_01.bundle.report.json", "client_01.decoder.bundle"):
        shutil.copy(clients / name, tmp_path / name)
    (tmp_path / "client_01.decoder.bundle").write_bytes(b"torn")
    report = json.loads((tmp_path / "client_01.bundle.report.json").read_text())
    torn = _client_verdict(tmp_path / "client_01.bundle", {key: report[key] for key in recorded})
    assert not torn.reuse and torn.differs == () and "unreadable bundle" in torn.reason


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


def test_the_default_fleet_mixes_budgets_and_roles():
    """#31: ten laptops bundled the same CNN; the default fleet mixes classifier devices of budgets an
    order of magnitude apart with CVAE-only devices, as `--role auto` resolves them on MNIST's shape."""
    config = SimulateConfig(dataset="digits", out_dir="o")
    names = assign_profiles(10, config.profiles, None)
    fleet = [load_profile(name) for name in sorted(set(names))]
    roles = {p.name: resolve_role("auto", p, (1, 28, 28), 10, config.search, config.cvae) for p in fleet}
    budgets = [p.max_flops for p in fleet if roles[p.name] != "cvae"]
    assert len(fleet) >= 4 and "cvae" in roles.values() and max(budgets) >= 10 * min(budgets)
    assert sorted(names.count(p.name) for p in fleet) == [2] * len(fleet)  # ten clients, evenly


def test_worker_processes_train_the_same_clients(federation, tmp_path):
    # --jobs 2: the partition and each client in a fresh worker forked from the fork server; the models
    # must be those of the in-process run (same seeds), and the fork server must be gone afterwards
    import multiprocessing.forkserver

    out, _ = federation
    assert main([*TINY, "--jobs", "2", "--out", str(tmp_path)]) == 0
    for k in range(3):
        name = f"{client_name(k, 3)}.bundle"
        ours, theirs = read_bundle(tmp_path / "clients" / name), read_bundle(out / "clients" / name)
        assert (ours.arch, ours.label_counts) == (theirs.arch, theirs.label_counts)
        assert ours.model_onnx == theirs.model_onnx
    assert (tmp_path / "data" / "partition.json").read_bytes() == (
        out / "data" / "partition.json"
    ).read_bytes()
    server = getattr(multiprocessing.forkserver, "_forkserver", None)
    assert getattr(server, "_forkserver_pid", None) is None


def _bundles(out):
    return {p.name: p.read_bytes() for p in (out / "clients").glob("*.bundle")}


def _with(args, **flags):
    """TINY with ``--flag value`` replaced or added."""
    args = list(args)
    for flag, value in flags.items():
        name = "--" + flag.replace("_", "-")
        if name in args:
            args[args.index(name) + 1] = value
        else:
            args += [name, value]
    return args


def test_changed_epochs_redo_every_client(federation, tmp_path, caplog):
    # the done-when of issue #20: a rerun into the same --out with other training epochs must not reuse
    # the bundles of the earlier epochs; it redoes them, and the server's inversion chunks with them
    out = tmp_path / "run"
    shutil.copytree(federation[0], out)
    before = _bundles(out)
    with caplog.at_level(logging.INFO, logger="server_kit.federation.simulate"):
        assert main([*_with(TINY, final_epochs="11"), "--out", str(out)]) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["resumed_clients"] == 0 and [r["client"] for r in results["redone_clients"]] == [0, 1, 2]
    assert all("config.search.final_epochs" in r["reason"] for r in results["redone_clients"])
    after = _bundles(out)
    # the classifiers trained longer; the decoders, retrained from the same seed and data, may come out equal
    assert set(after) == set(before)
    assert all(after[name] != before[name] for name in before if not name.endswith(".decoder.bundle"))
    for k in range(3):
        name = client_name(k, 3)
        assert read_bundle(out / "clients" / f"{name}.bundle").metrics["final_epochs"] == 11
        report = json.loads((out / "clients" / f"{name}.bundle.report.json").read_text())
        assert report["config"]["search"]["final_epochs"] == 11 and "decoder" in report
        line = f"{name} runs: made with other settings (differs in: ['config.search.final_epochs'])"
        assert line in caplog.messages
    assert "partition reused" in caplog.text and "server: redone the inversion chunks" in caplog.text
    assert json.loads((out / "server" / "inputs.json").read_text())["version"] == CODE_VERSION


def test_strict_refuses_a_changed_config_in_one_line_and_resumes_an_unchanged_one(federation, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(federation[0], out)
    before = _bundles(out)
    with pytest.raises(ConfigError) as err:
        main(["--debug", *_with(TINY, final_epochs="11", resume="strict"), "--out", str(out)])
    message = str(err.value)
    assert "\n" not in message and "client_00.bundle was made with other settings" in message
    assert "['config.search.final_epochs']" in message and "--resume auto" in message and "--out" in message
    assert _bundles(out) == before  # nothing was retrained
    assert main([*_with(TINY, resume="strict"), "--out", str(out)]) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["resumed_clients"] == 3 and results["redone_clients"] == []
    assert _bundles(out) == before


def test_changed_alpha_redoes_the_partition_and_the_clients(federation, tmp_path, caplog):
    out = tmp_path / "run"
    shutil.copytree(federation[0], out)
    old_data = (out / "data" / "client_00.npz").read_bytes()
    with caplog.at_level(logging.INFO, logger="server_kit.federation.simulate"):
        assert main([*_with(TINY, alpha="0.5"), "--out", str(out)]) == 0
    assert json.loads((out / "data" / "partition.json").read_text())["alpha"] == 0.5
    assert (out / "data" / "client_00.npz").read_bytes() != old_data
    assert "partition runs: made with other settings (differs in: ['alpha'])" in caplog.messages
    results = json.loads((out / "results.json").read_text())
    assert results["resumed_clients"] == 0
    assert all(
        r["reason"] == "made with other settings (differs in: ['data_sha256'])"
        for r in results["redone_clients"]
    )


def test_resume_off_redoes_what_matches_and_the_mode_is_validated(federation):
    out, _ = federation
    config = SimulateConfig(dataset="digits", num_clients=3, alpha=1.0, out_dir=out)
    assert _partition_verdict(config, out / "data").reuse
    off = _partition_verdict(dataclasses.replace(config, resume="off"), out / "data")
    assert not off.reuse and off.reason == "--resume off"
    assert _partition_verdict(dataclasses.replace(config, min_size=11), out / "data").differs == ("min_size",)
    with pytest.raises(ConfigError, match="resume must be one of"):
        SimulateConfig(dataset="digits", out_dir=out, resume="always")


def test_server_chunks_are_kept_only_for_the_same_inputs(tmp_path):
    server = tmp_path / "server"
    (server / "synthetic").mkdir(parents=True)
    (server / "synthetic" / "chunk.npz").write_bytes(b"x")
    key = {"inversion": {"steps": 40}, "uploads": {"client_00.bundle": "ab"}}
    _prepare_server(server, key, "strict")  # no record (older code): left to the inversion's own check
    assert (server / "synthetic" / "chunk.npz").is_file()
    _prepare_server(server, key, "auto")  # recorded now: the same inputs keep the chunks
    assert (server / "synthetic" / "chunk.npz").is_file()
    other = {**key, "inversion": {"steps": 41}}
    with pytest.raises(ConfigError, match=r"differs in: \['inversion.steps'\].*--resume auto"):
        _prepare_server(server, other, "strict")
    assert (server / "synthetic" / "chunk.npz").is_file()
    # other uploads alone (clients this run redid, having passed their own check): redone, even by strict
    _prepare_server(server, {**key, "uploads": {"client_00.bundle": "cd"}}, "strict")
    assert not (server / "synthetic").exists()
    (server / "synthetic").mkdir()
    _prepare_server(server, other, "auto")
    assert not (server / "synthetic").exists()
    assert json.loads((server / "inputs.json").read_text()) == other
    (server / "synthetic").mkdir()
    _prepare_server(server, other, "off")
    assert not (server / "synthetic").exists()
