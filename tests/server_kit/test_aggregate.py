"""The server pipeline end to end on three tiny heterogeneous bundles (1 x 8 x 8 images, 3 classes)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from PIL import Image

from common.errors import BundleError, ConfigError, TeacherError
from edge_sdk.data import ArrayDataset, deploy_metadata_for
from edge_sdk.models.arch import build_model
from export.bundle import Bundle, read_bundle, write_bundle
from export.onnx_export import export_onnx, read_deploy, read_metadata, validate_onnx
from server_kit.aggregate import aggregate
from server_kit.aggregate_config import AggregateConfig
from server_kit.labelling.labels import LabelConfig
from server_kit.synthesis import SYNTHETIC_FILE, load_synthetic
from server_kit.synthesis.generator import GeneratorConfig
from server_kit.synthesis.inversion import InversionConfig
from server_kit.teachers.loading import declared_class_names, teachers_from_bundles
from server_kit.training.distill import DistillConfig

SHAPE = (1, 8, 8)
L = 3
SPECS = ("C4k3-P-F3", "C6k5-P-F8-F3", "C4k3-C4k3-P-F3")


def _bundle(
    tmp_path,
    name: str,
    spec: str,
    seed: int,
    counts: list[int],
    *,
    unknown_output: bool = False,
    class_names: tuple[str, ...] | None = None,
) -> str:
    """A classifier bundle of an untrained ``spec`` (one more output than classes with ``unknown_output``),
    its ONNX naming the classes when ``class_names`` are given."""
    meta = {"arch": spec}
    if class_names is not None:
        meta |= deploy_metadata_for(SHAPE, len(counts), class_names, unknown_output=unknown_output)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = build_model(spec, SHAPE, len(counts) + int(unknown_output)).eval()
    bundle = Bundle(
        kind="classifier",
        model_onnx=export_onnx(model, SHAPE, metadata=meta),
        arch=spec,
        num_classes=len(counts),
        input_shape=SHAPE,
        label_counts=counts,
        num_examples=sum(counts),
        profile={"name": "test-device"},
        metrics={"val_accuracy": 0.5 + 0.1 * seed},
        seed=seed,
        sdk_version="test",
        unknown_output=unknown_output,
    )
    return str(write_bundle(bundle, tmp_path / f"{name}.bundle"))


@pytest.fixture(scope="module")
def bundles(tmp_path_factory) -> list[str]:
    tmp = tmp_path_factory.mktemp("bundles")
    counts = ([10, 0, 5], [3, 7, 0], [4, 4, 4])
    return [_bundle(tmp, f"client_{k}", spec, k, counts[k]) for k, spec in enumerate(SPECS)]


def tiny_config(**overrides) -> AggregateConfig:
    base = dict(
        student="C4k3-P-F16-F10",  # head written for 10 classes: resized to the task's 3
        device="cpu",
        seed=3,
        synth=("inversion",),
        inversion=InversionConfig(samples_per_teacher=12, steps=3, batch_size=8, lr=0.1, tau=2.0),
        distill=DistillConfig(epochs=2, batch_size=8),
    )
    return AggregateConfig(**{**base, **overrides})


def eval_data() -> ArrayDataset:
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (30, *SHAPE), generator=gen, dtype=torch.uint8)
    return ArrayDataset(x, torch.arange(30) % L, L)


def test_aggregate_end_to_end(tmp_path, bundles):
    out = tmp_path / "server"
    result = aggregate(bundles, out, config=tiny_config(), eval_data=eval_data())

    model_bytes = result.global_onnx.read_bytes()
    validate_onnx(model_bytes)
    meta = read_metadata(model_bytes)
    assert meta["role"] == "global-student" and meta["arch"] == "C4k3-P-F16-F3"
    deploy = read_deploy(model_bytes, num_logits=L)  # the teachers named no class: index names
    assert deploy is not None and deploy.class_names == ("0", "1", "2") and deploy.input_spec.shape == SHAPE

    report = json.loads(result.report_path.read_text())
    assert report == json.loads(json.dumps(result.report))
    assert report["synthetic_size"] == result.synthetic_size == 3 * 12
    assert report["seed"] == 3 and report["device"] == "cpu"
    assert report["config"]["inversion"]["samples_per_teacher"] == 12
    assert set(report["seconds"]) >= {"load", "inversion", "labels", "distill", "export", "evaluate"}
    assert [t["arch"] for t in report["teachers"]] == list(SPECS)
    assert report["teachers"][1]["label_counts"] == [3, 7, 0]
    assert report["teachers"][2]["val_accuracy"] == pytest.approx(0.7)  # 0.5 + 0.1 * 2 in float64
    assert report["skipped"] == []
    assert len(report["distill_loss"]) == 2
    assert set(report["label_agreement"]) == {"target_class", "generating_teacher"}
    assert 0.0 <= report["accuracy"] <= 1.0 and result.accuracy == report["accuracy"]
    assert len(report["per_class_accuracy"]) == L

    with Image.open(result.grid_path) as image:
        assert image.format == "PNG"
        # 3 rows of 8 cells of 16 x 16 pixels (8 x 8, scaled x2), 2-pixel padding
        assert image.size == (8 * 18 + 2, 3 * 18 + 2)
    assert len(list((out / "synthetic").glob("teacher_*_chunk_*.npz"))) == 3 * 2

    # a rerun resumes from the chunks and reproduces the same student, byte for byte
    again = aggregate(bundles, out, config=tiny_config(), eval_data=None)
    assert again.global_onnx.read_bytes() == model_bytes
    assert again.accuracy is None


def test_the_global_model_names_the_classes_the_teachers_agree_on(tmp_path, bundles):
    names = ("ant", "bee", "cat")
    named = [
        _bundle(tmp_path, "named_0", SPECS[0], 0, [10, 0, 5], class_names=names),
        _bundle(tmp_path, "named_1", SPECS[1], 1, [3, 7, 0], class_names=names, unknown_output=True),
    ]
    result = aggregate([*named, bundles[2]], tmp_path / "server", config=tiny_config())  # one unnamed
    deploy = read_deploy(result.global_onnx.read_bytes(), num_logits=L)
    assert deploy is not None and deploy.class_names == names
    assert result.report["student"]["class_names"] == list(names)
    other = _bundle(tmp_path, "other", SPECS[2], 2, [4, 4, 4], class_names=("x", "y", "z"))
    read = [read_bundle(p) for p in (*named, other)]
    assert declared_class_names(read[:2]) == names  # FedOV's extra "unknown" name is not the task's
    assert declared_class_names(read) is None  # teachers that disagree: index names


def test_a_changed_config_does_not_reuse_old_chunks(tmp_path, bundles):
    out = tmp_path / "server"
    aggregate(bundles, out, config=tiny_config())
    changed = tiny_config(
        inversion=InversionConfig(samples_per_teacher=12, steps=4, batch_size=8, lr=0.1, tau=2.0)
    )
    with pytest.raises(ConfigError, match="different inversion run"):
        aggregate(bundles, out, config=changed)


def test_mismatched_class_count_is_refused(tmp_path, bundles):
    odd = _bundle(tmp_path, "four_classes", "C4k3-P-F4", 9, [1, 1, 1, 1])
    with pytest.raises(TeacherError, match="num_classes"):
        aggregate([*bundles, odd], tmp_path / "stop", config=tiny_config())
    result = aggregate([*bundles, odd], tmp_path / "skip", config=tiny_config(on_error="skip"))
    assert [s["file"] for s in result.report["skipped"]] == [odd]
    assert len(result.report["teachers"]) == 3


@pytest.mark.parametrize(
    "overrides",
    [
        {"labels": LabelConfig(rule="label-weighted", mask=False, drop_mismatch=False)},
        {"labels": LabelConfig(rule="mean")},
        {"hard_labels": True},
    ],
)
def test_label_modes(tmp_path, bundles, overrides):
    result = aggregate(bundles, tmp_path / "server", config=tiny_config(**overrides))
    validate_onnx(result.global_onnx.read_bytes())
    labels = result.report["labels"]
    expected = "hard" if overrides.get("hard_labels") else overrides["labels"].rule
    assert labels["rule"] == expected
    if overrides.get("hard_labels"):  # trained on the target classes themselves
        assert result.report["label_agreement"]["target_class"] == 1.0
        assert result.report["distilled_samples"] == result.synthetic_size
    else:  # the samples whose label is not their target class are dropped only when asked
        kept = sum(labels["agree_per_class"]) if overrides["labels"].drop_mismatch else result.synthetic_size
        assert result.report["distilled_samples"] == labels["kept"] == kept


def test_inversion_of_held_classes_only(tmp_path, bundles):
    config = tiny_config(inversion=dataclasses.replace(tiny_config().inversion, classes="held"))
    result = aggregate(bundles, tmp_path / "held", config=config)
    synthetic = load_synthetic(result.out_dir / SYNTHETIC_FILE)
    counts = ([10, 0, 5], [3, 7, 0], [4, 4, 4])
    for k, row in enumerate(counts):  # every teacher's samples are of the classes it holds
        made = synthetic.target_class[synthetic.teacher == k]
        assert all(row[c] > 0 for c in made.tolist()) and len(made) == 12


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"labels": "conditioned"}, "labels"),
        ({"on_error": "ignore"}, "on_error"),
        ({"device": "tpu"}, "device"),
        ({"student": "X12"}, "student"),
        ({"threads": 0}, "threads"),
        ({"seed": -1}, "seed"),
    ],
)
def test_config_validation(overrides, match):
    with pytest.raises(ConfigError, match=match):
        AggregateConfig(**overrides)


def test_presets():
    default = AggregateConfig()
    assert default == AggregateConfig.preset("fast")
    paper = AggregateConfig.preset("paper", seed=4)
    assert paper.inversion.samples_per_teacher == 4000 and paper.distill.tau == 4.0 and paper.seed == 4
    assert paper.synth == ("inversion",) and paper.inversion.bn_weight == 0.0
    assert paper.labels.rule == "mean" and not paper.checks_claims  # pFedZKD as printed
    assert default.labels == LabelConfig(rule="label-weighted", mask=False, drop_mismatch=True)
    assert default.checks_claims and default.generator.ens_weight == 1.0
    assert default.synth is None and default.inversion.bn_weight == 1.0
    assert default.sources(False) == ("inversion", "generator")  # decoders join when there are any
    assert default.sources(True) == ("inversion", "decoder", "generator")  # SOURCES order
    assert default.construction_labels == ("decoder",)
    assert paper.sources(True) == ("inversion",)
    assert dataclasses.replace(default, hard_labels=True).hard_labels
    # one switch: the distillation loss inside an aggregation follows AggregateConfig.hard_labels
    with pytest.raises(ConfigError, match=r"distill\.hard_labels must be False"):
        dataclasses.replace(default, distill=dataclasses.replace(default.distill, hard_labels=True))
    with pytest.raises(ConfigError, match="unknown aggregate preset"):
        AggregateConfig.preset("slow")
    with pytest.raises(ConfigError, match="unknown aggregate options"):
        AggregateConfig.preset("fast", epochs=3)


def test_grid_rows_follow_the_consensus_argmax():
    import io

    import numpy as np

    from server_kit.report.grid import grid_png

    x = torch.stack([torch.full(SHAPE, v) for v in (0.2, 0.6, 1.0, 0.4)])  # 4 flat images
    probs = torch.tensor([[0.6, 0.4, 0.0], [0.9, 0.1, 0.0], [0.1, 0.8, 0.1], [0.7, 0.3, 0.0]])
    png = grid_png(x, probs, per_class=2, scale=1, padding=0)
    cells = np.asarray(Image.open(io.BytesIO(png)).convert("L"))[::8, ::8]  # one pixel per 8 x 8 cell
    expected = np.array([[0.6, 0.4], [1.0, 0.0], [0.0, 0.0]])  # class 0 by confidence; class 2: empty
    np.testing.assert_allclose(cells / 255, expected, atol=1 / 255)  # 8-bit PNG: one grey level of rounding
    with pytest.raises(ConfigError, match="probs"):
        grid_png(x, probs[:3])


@pytest.mark.parametrize(
    ("n", "channels", "columns", "padding"), [(6, 1, 2, 2), (7, 3, 3, 0), (5, 1, 8, 1), (1, 1, 4, 2)]
)
def test_tile_draws_what_torchvision_make_grid_drew(n, channels, columns, padding):
    make_grid = pytest.importorskip("torchvision.utils").make_grid

    from server_kit.report.grid import tile

    cells = torch.rand(n, channels, 5, 4, generator=torch.Generator().manual_seed(n))
    want = make_grid(cells, nrow=columns, padding=padding, pad_value=0.5)
    got = tile(cells, columns=columns, padding=padding, pad_value=0.5)
    assert got.shape == want.shape and torch.equal(got, want)  # copies of pixels, no arithmetic: exact


def _wrong_head_bundle(tmp_path) -> str:
    """A teacher whose ONNX gives 4 logits while its manifest says 3 classes: it loads (the converter
    reproduces onnxruntime exactly) and used to abort the run in the labelling phase."""
    with torch.random.fork_rng():
        torch.manual_seed(5)
        model = build_model("C4k3-P-F4", SHAPE, 4).eval()
    bundle = Bundle(
        kind="classifier",
        model_onnx=export_onnx(model, SHAPE, metadata={"arch": "C4k3-P-F4"}),
        arch="C4k3-P-F4",
        num_classes=L,
        input_shape=SHAPE,
        label_counts=[2, 2, 2],
        num_examples=6,
        profile={"name": "test-device"},
        metrics={},
        seed=5,
        sdk_version="test",
    )
    return str(write_bundle(bundle, tmp_path / "wrong_head.bundle"))


def test_a_teacher_with_the_wrong_head_is_skipped_or_stops_the_run(tmp_path, bundles):
    odd = _wrong_head_bundle(tmp_path)
    with pytest.raises(TeacherError, match=r"wrong_head\.bundle: .*\b4\b.*\b3\b"):
        aggregate([*bundles, odd], tmp_path / "stop", config=tiny_config())
    result = aggregate([odd, *bundles], tmp_path / "skip", config=tiny_config(on_error="skip"))
    assert [s["file"] for s in result.report["skipped"]] == [odd]
    assert [t["arch"] for t in result.report["teachers"]] == list(SPECS)


class _Broken(torch.nn.Module):
    """A loaded teacher that misbehaves only when run: one logit too many, or NaN."""

    def __init__(self, module: torch.nn.Module, mode: str) -> None:
        super().__init__()
        self.module, self.mode = module, mode

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.module(x)
        if self.mode == "extra":
            return torch.cat([out, out[:, :1]], dim=1)
        return out * float("nan")


@pytest.mark.parametrize(
    ("mode", "reason"), [("extra", r"outputs shape \(2, 4\)"), ("nan", "outputs non-finite")]
)
def test_the_run_probes_every_teacher_before_any_phase(tmp_path, bundles, monkeypatch, mode, reason):
    """Whatever the loader lets through, the run charges a failing teacher to its bundle up front."""
    import server_kit.aggregate as agg

    def load(bundles, **kwargs):
        teachers = teachers_from_bundles(bundles, **kwargs)
        broken = dataclasses.replace(teachers[1], module=_Broken(teachers[1].module, mode))
        return [teachers[0], broken, *teachers[2:]]

    monkeypatch.setattr(agg, "teachers_from_bundles", load)
    with pytest.raises(TeacherError, match=r"client_1\.bundle: " + reason):
        aggregate(bundles, tmp_path / "stop", config=tiny_config())
    result = aggregate(bundles, tmp_path / "skip", config=tiny_config(on_error="skip"))
    assert [s["file"] for s in result.report["skipped"]] == [bundles[1]]
    assert [t["arch"] for t in result.report["teachers"]] == [SPECS[0], SPECS[2]]


def test_bundles_as_bytes_give_the_files_result_and_are_checked_like_files(tmp_path, bundles):
    """name -> bytes (a Flower reply) is the same run as the files; a corrupt entry is refused by name."""
    from_files = aggregate(bundles, tmp_path / "files", config=tiny_config())
    uploads = {Path(path).name: Path(path).read_bytes() for path in bundles}
    from_bytes = aggregate(uploads, tmp_path / "bytes", config=tiny_config())
    assert from_bytes.global_onnx.read_bytes() == from_files.global_onnx.read_bytes()
    assert [t["file"] for t in from_bytes.report["teachers"]] == list(uploads)

    corrupt = bytearray(uploads["client_1.bundle"])
    corrupt[len(corrupt) // 2] ^= 0xFF
    hostile = {**uploads, "client_1.bundle": bytes(corrupt), "junk.bundle": b"\x00" * 64}
    with pytest.raises(BundleError, match=r"client_1\.bundle"):
        aggregate(hostile, tmp_path / "stop", config=tiny_config())
    result = aggregate(hostile, tmp_path / "skip", config=tiny_config(on_error="skip"))
    assert [s["file"] for s in result.report["skipped"]] == ["client_1.bundle", "junk.bundle"]
    assert "sha256 mismatch" in result.report["skipped"][0]["reason"]
    assert [t["arch"] for t in result.report["teachers"]] == [SPECS[0], SPECS[2]]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_aggregate_runs_on_cuda(tmp_path, bundles):
    """The server on a GPU: teachers checked against onnxruntime on the CPU (a GPU's TF32 convolutions
    would fail the 1e-4 parity), then inversion, generator, vote, distillation and evaluation there."""
    generator = GeneratorConfig(
        nz=8, width=4, steps=3, batch_size=12, lr=1e-2, ce_weight=1.0, div_weight=1.0, bn_weight=0.1,
        adv_weight=0.0, filter_fraction=0.0, samples=24, tau=4.0,
    )  # fmt: skip
    config = tiny_config(device="cuda", synth=("inversion", "generator"), generator=generator)
    result = aggregate(bundles, tmp_path / "server", config=config, eval_data=eval_data())
    report = json.loads(result.report_path.read_text())
    assert report["device"] == "cuda" and [t["method"] for t in report["teachers"]] == ["rebuilt"] * 3
    assert result.synthetic_size == 3 * 12 + 24 and 0.0 <= result.accuracy <= 1.0
    validate_onnx(result.global_onnx.read_bytes())
