"""FedMHO in `aggregate` and `simulate`: decoder sampling, centroid filter, init, fusion."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
import torch

from common.errors import ConfigError
from server_kit.aggregate import aggregate
from server_kit.aggregate_config import AggregateConfig
from server_kit.cli import main
from server_kit.synthesis import load_synthetic
from server_kit.synthesis.generator import GeneratorConfig
from server_kit.training.fusion import FusionConfig
from tests.server_kit.test_aggregate import SHAPE, SPECS, L, _bundle, bundles, tiny_config  # noqa: F401
from tests.server_kit.test_decoders import decoder_bundle

FUSION = FusionConfig(mode="md", epochs=2, batch_size=8)


def _decoder(tmp_path, name: str, seed: int, counts: tuple[int, ...]) -> str:
    return str(decoder_bundle(tmp_path, name, seed, counts, shape=SHAPE, latent=2))


@pytest.fixture(scope="module")
def decoders(tmp_path_factory) -> list[str]:
    tmp = tmp_path_factory.mktemp("decoders")
    return [_decoder(tmp, "d0.bundle", 0, (6, 0, 4)), _decoder(tmp, "d1.bundle", 1, (2, 8, 0))]


def test_decoder_fusion_with_heterogeneous_classifiers(tmp_path, bundles, decoders):  # noqa: F811
    config = tiny_config(synth=("decoder",), decoder_samples=40, fusion=FUSION)
    result = aggregate([*bundles, *decoders], tmp_path, config=config)
    report = json.loads(result.report_path.read_text())
    assert report["training"] == "FedMHO-md" and report["init"] == "consensus-distillation"
    assert len(report["teachers"]) == 3 and report["skipped"] == []  # decoders are not teachers
    dec = report["decoders"]
    assert dec["sampled"] == 40
    # the centroid filter keeps floor(0.8 * n_c) of every class
    kept = load_synthetic(tmp_path / "synthetic.npz")
    counts = torch.bincount(kept.target_class, minlength=L)
    assert dec["kept"] == len(kept) == int(counts.sum()) < 40
    assert len(report["fusion_loss"]) == 2 and len(report["distill_loss"]) == config.distill.epochs
    for grid in dec["grids"]:
        assert (tmp_path / grid).is_file()


def test_same_architecture_classifiers_are_averaged(tmp_path, decoders):
    same = [_bundle(tmp_path, f"c{k}", SPECS[0], k, [5, 5, 5]) for k in range(2)]
    config = tiny_config(synth=("decoder",), decoder_samples=30, fusion=FusionConfig(mode="sd", epochs=1))
    report = json.loads(aggregate([*same, *decoders], tmp_path / "s", config=config).report_path.read_text())
    assert report["init"] == "fedavg" and report["student"]["arch"] == SPECS[0]
    assert report["distill_loss"] == [] and len(report["fusion_loss"]) == 1


def test_pooled_inversion_and_decoder_samples_get_consensus_labels(tmp_path, bundles, decoders):  # noqa: F811
    config = tiny_config(synth=("inversion", "decoder"), decoder_samples=30)
    report = json.loads(aggregate([*bundles, *decoders], tmp_path, config=config).report_path.read_text())
    assert report["synthetic_sources"]["inversion"] == 36
    top_up = report["labels"]["top_up"]  # classes the vote thinned out get more decoder samples
    assert report["decoders"]["kept"] <= math.floor(0.8 * 30) + L
    assert report["synthetic_sources"]["decoder"] == report["decoders"]["kept"] + sum(top_up["filtered"])
    assert report["training"] == "consensus distillation" and report["labels"]["rule"] == "label-weighted"
    off = tiny_config(synth=("inversion", "decoder"), decoder_samples=30, top_up=False)
    report = json.loads(
        aggregate([*bundles, *decoders], tmp_path / "off", config=off).report_path.read_text()
    )
    assert (
        report["synthetic_sources"]["decoder"] == report["decoders"]["kept"]
        and "top_up" not in report["labels"]
    )


def test_config_refusals(tmp_path, bundles):  # noqa: F811
    with pytest.raises(ConfigError, match="add 'decoder'"):
        AggregateConfig(synth=("inversion",), fusion=FUSION)
    with pytest.raises(ConfigError, match="pass cvae_decoder bundles"):  # the default adds no decoder here
        aggregate(bundles, tmp_path, config=tiny_config(synth=None, fusion=FUSION))
    with pytest.raises(ConfigError, match="decoder_keep"):
        AggregateConfig(synth=("decoder",), decoder_keep=0.0)
    with pytest.raises(ConfigError, match="needs cvae_decoder bundles"):
        aggregate(bundles, tmp_path, config=tiny_config(synth=("decoder",)))


def test_simulate_mixes_classifier_and_cvae_clients(tmp_path):
    args = [
        "simulate", "--dataset", "digits", "--num-clients", "3", "--alpha", "1.0", "--seed", "0", "--quiet",
        "--profiles", "laptop-cpu,wearable", "--particles", "2", "--iterations", "1", "--final-epochs", "10",
        "--cvae-epochs", "10", "--synth", "decoder", "--decoder-samples", "300", "--fusion-mode", "md",
        "--fusion-preset", "fast", "--fusion-epochs", "10", "--distill-epochs", "10",
        "--aggregate-device", "cpu", "--out", str(tmp_path),
    ]  # fmt: skip
    assert main(args) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    assert [c["kind"] for c in results["clients"]] == ["classifier", "cvae_decoder", "classifier"]
    assert "test_accuracy" not in results["clients"][1] and results["clients"][1]["candidate_epochs"] == 0
    report = json.loads((tmp_path / "server" / "report.json").read_text())
    assert report["training"] == "FedMHO-md" and report["decoders"]["sampled"] == 300
    # three digits clients, ten classes: chance is 0.1; a wide margin under what the run reaches, so
    # another instruction set's rounding (a few test images) cannot cross it
    assert results["global_accuracy"] > 0.3


def test_fedmho_preset_end_to_end_on_digits(tmp_path):
    # the paper's setting on a small task: classifier and CVAE devices alternate, the classifiers share
    # the server's initial weights and upload no decoder, the server averages them and fuses (MD)
    args = [
        "simulate", "--federation-preset", "fedmho", "--dataset", "digits", "--num-clients", "4",
        "--alpha", "1.0", "--seed", "0", "--quiet", "--jobs", "2", "--out", str(tmp_path),
    ]  # fmt: skip
    assert main(args) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    assert [c["kind"] for c in results["clients"]] == ["classifier", "cvae_decoder"] * 2
    assert not (tmp_path / "clients" / "client_00.decoder.bundle").exists()  # classifiers alone
    reports = [
        json.loads((tmp_path / "clients" / f"client_0{k}.bundle.report.json").read_text()) for k in (0, 2)
    ]
    inits = {r["init"]["sha256"] for r in reports}
    assert len(inits) == 1 and reports[0]["config"]["search"]["strategy"] == "fixed"
    server = json.loads((tmp_path / "server" / "report.json").read_text())
    assert server["init"] == "fedavg" and server["training"] == "FedMHO-md"
    assert results["global_accuracy"] > 0.5  # as above: chance 0.1, a wide margin under the reached value
    # the preset's decoders: a class prior each, drawn at 0.9, the budget split by every upload's counts
    archs = {c["arch"] for c in results["clients"] if c["kind"] == "cvae_decoder"}
    assert archs == {"cvae-small-z20-classprior"}
    assert server["config"]["decoder_temperature"] == 0.9
    assert server["config"]["decoder_weighting"] == "federation"

    # the server side again with SD: the clients (same settings, same init file) are reused
    assert main([*args, "--fusion-mode", "sd"]) == 0
    assert json.loads((tmp_path / "results.json").read_text())["resumed_clients"] == 4
    assert json.loads((tmp_path / "server" / "report.json").read_text())["training"] == "FedMHO-sd"
    # other initial weights are another client setting: a resume would train the classifiers again
    from common.device import resolve_device
    from edge_sdk.shared_init import initial_weights
    from server_kit.federation.resume import client_verdict as _client_verdict
    from server_kit.federation.simulate import SimulateConfig, _client_config, _resume_key

    config = SimulateConfig.preset("fedmho", dataset="digits", out_dir=tmp_path, num_clients=4, alpha=1.0)
    bundle, data = tmp_path / "clients" / "client_00.bundle", tmp_path / "data" / "client_00.npz"
    init = tmp_path / "init.onnx"
    device = str(resolve_device(config.device))  # the clients ran on the device simulate resolved
    client = _client_config(config, 0, "classifier", init, device)
    assert _client_verdict(bundle, _resume_key(client, data, "laptop-cpu")).reuse
    init.write_bytes(initial_weights(config.search.fixed_arch, (1, 8, 8), 10, seed=1))
    client = _client_config(config, 0, "classifier", init, device)
    changed = _client_verdict(bundle, _resume_key(client, data, "laptop-cpu"))
    assert not changed.reuse and changed.differs == ("config.init.sha256",)


def test_generator_only_fills_the_decoders_gaps(tmp_path, bundles, decoders):  # noqa: F811
    """Left to the server, the sources run the generator only where some class a classifier holds has no
    decoder; where the decoders hold every class its samples are drawn from them. Named sources run as
    named."""
    generator = GeneratorConfig.preset("fast", nz=8, width=8, steps=3, batch_size=8, samples=20)
    config = tiny_config(synth=None, generator=generator, decoder_samples=30, verify_claims=False)

    def run(name: str, uploads: list[str], **overrides) -> dict:
        path = aggregate(uploads, tmp_path / name, config=replace(config, **overrides)).report_path
        return json.loads(path.read_text())

    covered = run("covered", [*bundles, *decoders])  # the decoders hold classes 0, 1 and 2
    assert "generator" not in covered["synthetic_sources"] and covered["generator_loss"] == []
    assert covered["decoders"]["sampled"] == 30 + 20
    assert "decoders hold every class" in covered["generator_skipped"]
    assert not (tmp_path / "covered" / "generator").exists()
    gap = run("gap", [*bundles, decoders[0]])  # no decoder holds class 1, which the classifiers hold
    assert gap["synthetic_sources"]["generator"] == 20 and gap["decoders"]["sampled"] == 30
    assert gap["generator_skipped"] is None
    named = run("named", [*bundles, *decoders], synth=("inversion", "generator", "decoder"))
    assert named["synthetic_sources"]["generator"] == 20 and named["decoders"]["sampled"] == 30
