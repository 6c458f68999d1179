"""Personalization: PKE on the server, finetune / pkt / kdg on the device, deployable fp32 and int8 ONNX."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import helper, numpy_helper

from common.errors import BundleError, ConfigError
from edge_sdk.cli import main as edge_main
from edge_sdk.curves import check_curve
from edge_sdk.data import ArrayDataset, save_client_data
from edge_sdk.mobile_targets import rebuild
from edge_sdk.models.arch import build_model
from edge_sdk.personalize import PersonalizeConfig, personalize, pkt_loss, update_alpha
from export.bundle import read_bundle
from export.onnx_export import INPUT_NAME, onnx_session, read_deploy, read_metadata
from export.package import read_package
from server_kit.aggregate import aggregate
from server_kit.personalization.pke import PKEConfig, extractor_names, personalize_server, train_server_models
from tests.export.test_onnx_check import loop_in_front
from tests.server_kit.test_aggregate import SHAPE, L, _bundle, bundles, tiny_config  # noqa: F401
from tests.server_kit.test_synth_sources import TINY_GENERATOR

# ------------------------------------------------------------------------------------------- PKT alpha


def test_alpha_drops_for_disagreeing_samples_and_the_regulariser_pulls_it_back():
    alpha = torch.ones(4)
    l1 = torch.tensor([0.0, 0.1, 2.0, 8.0])  # the last samples disagree most with the knowledge
    stepped = update_alpha(alpha.clone(), l1, lr=0.5, tau=0.5)
    assert stepped[0] == 1.0 and (stepped[1:] < 1).all()
    assert stepped[3] < stepped[2] < stepped[1]
    # with no disagreement left, tau * (alpha - 1) moves alpha back toward 1, and never past it
    back = stepped.clone()
    for _ in range(50):
        back = update_alpha(back, torch.zeros(4), lr=0.5, tau=0.5)
    assert (
        (back > stepped[1:].min()).all()
        and (back <= 1).all()
        and torch.allclose(back, torch.ones(4), atol=1e-3)  # 50 contractions by 0.75: 0.75**50 ~ 6e-7
    )
    assert (update_alpha(torch.ones(2), torch.tensor([1e6, 1e6]), lr=1.0, tau=0.1) == 0).all()  # clamped


def test_pkt_loss_weights_samples_by_alpha():
    out, z = torch.zeros(2, 3), torch.tensor([[1.0, 1.0, 1.0], [3.0, 3.0, 3.0]])
    loss, per = pkt_loss(out, z, torch.tensor([1.0, 0.0]))
    # mean absolute errors of small integers and their alpha-weighted mean: exact in float32
    assert torch.allclose(per, torch.tensor([1.0, 3.0])) and float(loss) == pytest.approx(0.5)


# ------------------------------------------------------------------------------------------------- PKE


def test_mu_pulls_server_extractors_together():
    torch.manual_seed(0)
    x = torch.rand(24, *SHAPE)
    knowledge = [torch.randn(24, L) * 3 for _ in range(3)]

    def spread(mu: float) -> float:
        models = []
        for k in range(3):
            with torch.random.fork_rng():
                torch.manual_seed(k)
                models.append(build_model("C4k3-P-F8-F3", SHAPE, L))
        config = PKEConfig(train_epochs=4, batch_size=8, mu=mu, lr=1e-2)
        train_server_models(models, x, knowledge, config=config)
        names = extractor_names(models[0])
        assert not any(n.startswith("head") for n in names)
        params = [dict(m.named_parameters()) for m in models]
        return sum(float((params[0][n] - params[k][n]).detach().norm()) for k in (1, 2) for n in names)

    assert spread(mu=5.0) < 0.5 * spread(mu=0.0)


# -------------------------------------------------------------------------------------------- end to end


@pytest.fixture(scope="module")
def federation(tmp_path_factory, bundles):  # noqa: F811
    tmp = tmp_path_factory.mktemp("personal")
    aggregate(bundles, tmp / "server", config=tiny_config(synth=("generator",), generator=TINY_GENERATOR))
    result = personalize_server(
        bundles,
        tmp / "server",
        tmp / "packages",
        config=PKEConfig(train_epochs=1, batch_size=8, max_inputs=16),
    )
    gen = torch.Generator().manual_seed(1)
    data = ArrayDataset(
        torch.randint(0, 256, (60, *SHAPE), generator=gen, dtype=torch.uint8), torch.arange(60) % L, L
    )
    return tmp, result, data


def test_server_writes_one_valid_package_per_client(federation, bundles):  # noqa: F811
    _, result, _ = federation
    assert len(result.packages) == len(bundles)
    for path, bundle_path in zip(result.packages, bundles, strict=True):
        package = read_package(path)
        package.check_for(read_bundle(bundle_path).model_onnx)
        assert package.inputs.shape == (16, *SHAPE) and package.knowledge.shape == (16, L)
        assert package.generator_onnx is not None and package.knobs["mu"] == 0.6
    report = json.loads(result.report_path.read_text())
    assert [c["package"] for c in report["clients"]] == [p.name for p in result.packages]


def test_bundles_with_the_same_file_name_get_distinct_packages(capsys, federation, bundles):  # noqa: F811
    """`personalize a/client_00.bundle b/client_00.bundle` said "wrote 2 packages" and wrote one."""
    from server_kit.cli import main as server_main

    tmp, _, _ = federation
    same = [tmp / "a" / "client.bundle", tmp / "b" / "client.bundle"]
    for source, target in zip(bundles[:2], same, strict=True):
        target.parent.mkdir(exist_ok=True)
        shutil.copyfile(source, target)
    argv = ["personalize", *map(str, same), "--aggregate", str(tmp / "server"), "--out", str(tmp / "same")]
    assert (
        server_main([*argv, "--train-epochs", "1", "--batch-size", "8", "--max-inputs", "16", "--quiet"]) == 0
    )
    assert "wrote 2 packages" in capsys.readouterr().out
    written = sorted((tmp / "same").glob("*.package"))
    assert [p.name for p in written] == ["client-0.package", "client-1.package"]
    for path, bundle_path in zip(written, same, strict=True):
        package = read_package(path)
        assert package.client == path.stem
        package.check_for(read_bundle(bundle_path).model_onnx)  # each one for its own client
    with pytest.raises(ConfigError, match="more than once"):
        personalize_server(
            [same[0], same[0]], tmp / "server", tmp / "twice", config=PKEConfig(train_epochs=1)
        )
    assert not (tmp / "twice").exists()


def test_bundles_as_bytes_give_the_same_packages(federation, bundles):  # noqa: F811
    """name -> bytes (a Flower reply) makes the packages the files make, named after the names."""
    tmp, result, _ = federation
    uploads = {Path(path).name: Path(path).read_bytes() for path in bundles}
    again = personalize_server(
        uploads,
        tmp / "server",
        tmp / "from_bytes",
        config=PKEConfig(train_epochs=1, batch_size=8, max_inputs=16),
    )
    assert [p.name for p in again.packages] == [p.name for p in result.packages]
    for ours, theirs in zip(again.packages, result.packages, strict=True):
        assert ours.read_bytes() == theirs.read_bytes()


@pytest.mark.parametrize("method", ["finetune", "pkt", "kdg"])
def test_each_method_writes_deployable_models(federation, bundles, method):  # noqa: F811
    tmp, result, data = federation
    config = PersonalizeConfig(
        method=method,
        train_epochs=1,
        batch_size=8,
        distill_batch_size=8,
        local_generator_steps=2,
        calibration_size=16,
    )
    out = tmp / f"client0-{method}"
    named = dataclasses.replace(data, class_names=("ant", "bee", "cat"))
    res = personalize(named, read_bundle(bundles[0]), read_package(result.packages[0]), out, config=config)
    report = json.loads((out / "report.json").read_text())
    assert res.kept in ("int8", "fp32") and report["kept"] == res.kept
    int8_ok = report["val_accuracy"]["int8"] >= report["val_accuracy"]["fp32"] - config.int8_tolerance
    assert (res.kept == "int8") == int8_ok
    expected = (out / f"personal.{res.kept}.onnx").read_bytes()
    assert res.deploy_onnx.read_bytes() == expected
    logits = onnx_session(expected).run(None, {INPUT_NAME: torch.rand(4, *SHAPE).numpy()})[0]
    assert logits.shape == (4, L)
    for precision in ("fp32", "int8"):  # both deployable models name the classes and describe the input
        meta = read_deploy((out / f"personal.{precision}.onnx").read_bytes(), num_logits=L)
        assert meta is not None and meta.class_names == ("ant", "bee", "cat")
        assert meta.input_spec.shape == SHAPE and meta.input_spec.normalization == "inside"
    assert report["size_bytes"]["int8"] > 0 and report["latency"]["fp32"]["batch_1_ms"] > 0
    # fp32 keeps BatchNorm: the torch-based deploy targets rebuild it into its architecture, exactly
    fp32 = (out / "personal.fp32.onnx").read_bytes()
    x = torch.rand(4, *SHAPE)
    with torch.no_grad():
        rebuilt = rebuild(fp32, read_metadata(fp32), SHAPE, L)(x).numpy()
    np.testing.assert_allclose(rebuilt, onnx_session(fp32).run(None, {INPUT_NAME: x.numpy()})[0], atol=1e-5)
    if method == "kdg":
        assert set(report["training"]["loss"][0]) == {"ce", "dis", "lat", "tea", "disg"}
    # the report's curve (edge_sdk.curves): the training's terms, per epoch
    curve = check_curve(report["curves"]["personalize"], "personalize")
    assert curve["epoch"] == [1] and set(curve) - {"epoch"} == set(report["training"]["loss"][0])
    if method == "pkt":
        assert 0 <= report["training"]["alpha"]["min"] <= 1


def test_package_of_another_client_is_refused(federation, bundles):  # noqa: F811
    tmp, result, data = federation
    with pytest.raises(BundleError, match="made for"):
        personalize(
            data,
            read_bundle(bundles[1]),
            read_package(result.packages[0]),
            tmp / "x",
            config=PersonalizeConfig(),
        )
    assert not (tmp / "x" / "deploy.onnx").exists()


def test_a_hostile_package_is_refused_before_its_models_load_or_run(federation, bundles):  # noqa: F811
    """Knowledge of L + 1 columns, a global model with a 2**62-iteration Loop in front, a generator with a
    16 GB ConstantOfShape (onnxruntime would fold it at session creation) or one onnxruntime cannot run:
    each is a BundleError."""
    tmp, result, data = federation
    bundle, package = read_bundle(bundles[0]), read_package(result.packages[0])
    wider = dataclasses.replace(
        package, num_classes=L + 1, knowledge=np.zeros((len(package.inputs), L + 1), np.float32)
    )
    looped = loop_in_front(onnx.load_from_string(package.global_onnx)).SerializeToString()
    assert package.generator_onnx is not None
    generator = onnx.load_from_string(package.generator_onnx)
    generator.graph.node.append(helper.make_node("ConstantOfShape", ["huge"], ["zeros"]))
    generator.graph.initializer.append(numpy_helper.from_array(np.array([4, 1 << 30], np.int64), "huge"))
    # a Gemm bias of the wrong length passes shape inference; onnxruntime refuses it when it runs
    short_bias = onnx.load_from_string(package.generator_onnx)
    gemm = next(n for n in short_bias.graph.node if n.op_type == "Gemm" and len(n.input) == 3)
    bias = next(i for i in short_bias.graph.initializer if i.name == gemm.input[2])
    bias.CopyFrom(numpy_helper.from_array(np.zeros(3, np.float32), bias.name))
    hostile = [
        (wider, rf"the package is for {L + 1} classes .*knowledge {L + 1} columns.*for {L} of"),
        (dataclasses.replace(package, global_onnx=looped), r"the package's global model: .*\(Loop\)"),
        (
            dataclasses.replace(package, generator_onnx=generator.SerializeToString()),
            r"the package's generator: operators outside the allowlist: 'ConstantOfShape'",
        ),
        (
            dataclasses.replace(package, generator_onnx=short_bias.SerializeToString()),
            r"the package's generator failed on a batch of 8: .*Invalid bias shape",
        ),
    ]
    config = PersonalizeConfig(
        method="kdg",
        kdg_terms=("pre", "tea"),
        train_epochs=1,
        batch_size=8,
        calibration_size=8,
        local_generator_steps=0,
    )
    for package, match in hostile:
        with pytest.raises(BundleError, match=match):
            personalize(data, bundle, package, tmp / "hostile", config=config)
    assert not (tmp / "hostile" / "deploy.onnx").exists()


def test_cli_runs_and_refuses_bad_knobs(federation, bundles, tmp_path, capsys):  # noqa: F811
    _, result, data = federation
    npz = save_client_data(tmp_path / "c.npz", data)
    args = ["personalize", "--data", str(npz), "--model", bundles[0], "--package", str(result.packages[0])]
    out = tmp_path / "cli"
    assert (
        edge_main(
            [
                *args,
                "--method",
                "finetune",
                "--train-epochs",
                "1",
                "--batch-size",
                "8",
                "--quiet",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    assert (out / "deploy.onnx").is_file() and "kept" in capsys.readouterr().out
    assert edge_main([*args, "--kdg-terms", "pre,nope", "--out", str(tmp_path / "bad")]) == 2
    assert "kdg_terms" in capsys.readouterr().err
    with pytest.raises(ConfigError):
        PersonalizeConfig(method="distill")
    with pytest.raises(ConfigError, match="kdg_dis_weight"):
        PersonalizeConfig(method="kdg", kdg_dis_weight=-1.0)
    assert PersonalizeConfig().kdg_disg_weight == 0.01  # FedKDG's weight of the distillation terms


def test_a_federation_with_an_unknown_output_teacher_aggregates_and_personalizes(tmp_path, bundles):  # noqa: F811
    """A FedOV bundle (one more output than classes) is a teacher like the others on the server, and
    its device's personalized model answers over the task's L classes."""
    fedov = _bundle(tmp_path, "fedov", "C4k3-P-F3", 5, [0, 6, 6], unknown_output=True)
    paths = [*bundles[:2], fedov]
    config = tiny_config(synth=("inversion", "generator"), generator=TINY_GENERATOR)
    server = aggregate(paths, tmp_path / "server", config=config)
    assert [t["file"] for t in server.report["teachers"]] == paths and not server.report["skipped"]
    result = personalize_server(
        paths,
        tmp_path / "server",
        tmp_path / "packages",
        config=PKEConfig(train_epochs=1, batch_size=8, max_inputs=16),
    )
    gen = torch.Generator().manual_seed(1)
    data = ArrayDataset(
        torch.randint(0, 256, (40, *SHAPE), generator=gen, dtype=torch.uint8), torch.arange(40) % L, L
    )
    config = PersonalizeConfig(method="pkt", train_epochs=1, batch_size=8, calibration_size=16)
    res = personalize(
        data, read_bundle(fedov), read_package(result.packages[2]), tmp_path / "dev", config=config
    )
    logits = onnx_session(res.deploy_onnx.read_bytes()).run(
        None, {INPUT_NAME: torch.rand(2, *SHAPE).numpy()}
    )[0]
    assert logits.shape == (2, L)
    # the device's own model was evaluated over the L classes, less its unknown row
    before = json.loads((tmp_path / "dev" / "report.json").read_text())["val_accuracy_before"]
    assert 0 <= before["own_model"] <= 1 and set(before) == {"own_model", "global_model"}
