"""Teachers from bundles: exact rebuild, generic fallback, parity with onnxruntime, gradients to the input,
BN statistics, agreement across bundles and error handling per file."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from torch import nn

from common.errors import BundleError, ConfigError, TeacherError
from edge_sdk.models.arch import build_model
from export.bundle import Bundle, bundle_to_bytes, write_bundle
from export.onnx_export import export_onnx, onnx_session
from server_kit.teachers import loading as teachers_module
from server_kit.teachers.loading import (
    Teacher,
    batchnorm_layers,
    classifier_weight,
    load_teacher,
    load_teachers,
    rebuild_teacher,
)
from server_kit.teachers.onnx_convert import OnnxModule
from tests.export.test_onnx_check import external_weight, loop_in_front

ARCH = "C8k3-P-C16k3-Pavg-F32-F10"
SHAPE = (3, 12, 12)


def _trained_like(arch: str = ARCH, num_classes: int = 10, seed: int = 0) -> nn.Module:
    """Random weights, BN running stats and affine parameters far from their defaults (BN matters)."""
    gen = torch.Generator().manual_seed(seed)
    model = build_model(arch, SHAPE, num_classes)
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            if name.endswith("num_batches_tracked"):
                continue
            if name.endswith("running_var"):
                tensor.copy_(torch.rand(tensor.shape, generator=gen) + 0.5)
            else:
                tensor.copy_(torch.randn(tensor.shape, generator=gen) * 0.5)
    return model.eval()


def _bundle(model: nn.Module, arch: str, num_classes: int, kind: str = "classifier") -> Bundle:
    return Bundle(
        kind=kind,
        model_onnx=export_onnx(model, SHAPE),
        arch=arch,
        num_classes=num_classes,
        input_shape=SHAPE,
        label_counts=(3,) * num_classes,
        num_examples=3 * num_classes,
        profile={"name": "test-device"},
        metrics={},
        seed=0,
        sdk_version="0.1.0",
        latent_dim=4 if kind == "cvae_decoder" else None,
    )


@pytest.fixture(scope="module")
def model() -> nn.Module:
    return _trained_like()


@pytest.fixture(scope="module")
def bundle(model: nn.Module) -> Bundle:
    return _bundle(model, ARCH, 10)


def _ort_logits(bundle: Bundle, x: torch.Tensor) -> np.ndarray:
    return onnx_session(bundle.model_onnx).run(None, {"x": x.numpy()})[0]


def test_rebuilt_teacher_equals_original_and_matches_onnxruntime(model: nn.Module, bundle: Bundle) -> None:
    rebuilt = rebuild_teacher(bundle)
    original = model.state_dict()
    assert set(rebuilt.state_dict()) == set(original)
    for key, value in rebuilt.state_dict().items():
        if not key.endswith("num_batches_tracked"):
            assert torch.equal(value, original[key]), key  # weights are copied bytes: no arithmetic

    teacher = load_teacher(bundle, path="clients/alice.bundle")
    assert teacher.method == "rebuilt" and teacher.name == "alice"
    assert not teacher.module.training
    assert all(not p.requires_grad and p.dtype == torch.float32 for p in teacher.module.parameters())
    x = torch.rand(6, *SHAPE, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        got = teacher.module(x).numpy()
    # torch and onnxruntime sum in different orders: O(1) float32 logits after a few hundred MACs each
    # differ by ~1e-6; 1e-4 is the export's own parity bound (check_parity's atol), kernel-independent.
    assert np.abs(got - _ort_logits(bundle, x)).max() <= 1e-4
    assert len(batchnorm_layers(teacher.module)) == 2  # one per C module


def test_gradients_reach_the_input_through_ce_and_bn_losses(bundle: Bundle) -> None:
    module = load_teacher(bundle).module
    terms: list[torch.Tensor] = []

    def hook(bn: nn.Module, inputs: tuple[torch.Tensor, ...], _out: torch.Tensor) -> None:
        mean = inputs[0].mean(dim=(0, 2, 3))
        terms.append(torch.linalg.vector_norm(mean - bn.running_mean))

    handles = [bn.register_forward_hook(hook) for bn in batchnorm_layers(module)]
    x = torch.rand(4, *SHAPE, requires_grad=True)
    loss = nn.functional.cross_entropy(module(x), torch.tensor([0, 1, 2, 3])) + torch.stack(terms).sum()
    loss.backward()
    for handle in handles:
        handle.remove()
    assert len(terms) == 2
    assert x.grad is not None and torch.isfinite(x.grad).all() and x.grad.abs().sum() > 0
    assert all(p.grad is None for p in module.parameters())


def test_classifier_weight_is_num_classes_by_features(model: nn.Module, bundle: Bundle) -> None:
    weight = classifier_weight(load_teacher(bundle).module)
    assert weight.shape == (10, 32)
    assert torch.equal(weight, model.head.weight)  # both paths copy the initializer: exact
    converted = load_teacher(dataclasses.replace(bundle, arch="foreign-net")).module
    assert torch.equal(classifier_weight(converted), model.head.weight)
    with pytest.raises(TeacherError, match=r"no final nn\.Linear"):
        classifier_weight(nn.Sequential(nn.Conv2d(3, 4, 3)))


def test_unknown_or_mismatched_arch_falls_back_to_the_converter(model: nn.Module, bundle: Bundle) -> None:
    wrong_width = dataclasses.replace(bundle, arch="C8k3-P-C16k3-Pavg-F64-F10")
    with pytest.raises(TeacherError, match="do not fit arch"):
        rebuild_teacher(wrong_width)
    with pytest.raises(TeacherError, match="cannot rebuild arch 'foreign-net'"):
        rebuild_teacher(dataclasses.replace(bundle, arch="foreign-net"))
    x = torch.rand(3, *SHAPE)
    for variant in (wrong_width, dataclasses.replace(bundle, arch="foreign-net")):
        teacher = load_teacher(variant)
        assert teacher.method == "converted" and isinstance(teacher.module, OnnxModule)
        assert len(batchnorm_layers(teacher.module)) == 2
        with torch.no_grad():  # torch vs onnxruntime summation order: the export's parity bound
            assert np.abs(teacher.module(x).numpy() - _ort_logits(bundle, x)).max() <= 1e-4


def test_parity_failure_names_the_file_and_the_difference(
    model: nn.Module, bundle: Bundle, monkeypatch: pytest.MonkeyPatch
) -> None:
    def off_by_one(_: object) -> nn.Module:
        broken = rebuild_teacher(bundle)
        with torch.no_grad():
            broken.head.bias.add_(1.0)
        return broken

    monkeypatch.setattr(teachers_module, "rebuild_teacher", off_by_one)
    monkeypatch.setattr(teachers_module, "convert_onnx", off_by_one)
    with pytest.raises(TeacherError, match=r"bob\.bundle: .*max abs diff 1 > 0\.0001"):
        load_teacher(bundle, path="bob.bundle")
    unchecked = load_teacher(bundle, check_parity=False).module
    assert torch.equal(unchecked.head.bias, model.head.bias + 1.0)  # the same one addition on both sides


def _write(tmp_path: Path, name: str, bundle: Bundle) -> Path:
    return write_bundle(bundle, tmp_path / name)


def test_the_contract_refuses_hostile_onnx_before_anything_is_built_or_run(
    tmp_path: Path, bundle: Bundle, monkeypatch: pytest.MonkeyPatch
) -> None:
    """11 logits against a manifest of 10, a Loop of 2**62 iterations in front, weights read from
    ./secret.bin: each is refused naming the file, and nothing of it is rebuilt, converted or run."""

    def never(*args: object, **kwargs: object) -> None:
        raise AssertionError("a file that fails the contract must not be rebuilt, converted or run")

    for name in ("rebuild_teacher", "convert_onnx", "onnx_session"):
        monkeypatch.setattr(teachers_module, name, never)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "secret.bin").write_bytes(bytes(1 << 16))
    eleven = export_onnx(_trained_like("C8k3-P-C16k3-Pavg-F32-F11", num_classes=11), SHAPE)
    looped = loop_in_front(onnx.load_from_string(bundle.model_onnx)).SerializeToString()
    secret = onnx.load_from_string(bundle.model_onnx)
    external_weight(secret, "secret.bin")
    hostile = {
        "eleven.bundle": (
            eleven,
            r"output 'logits' is float32 \[1, 11\] at batch 1, expected float32 \[1, 10\]",
        ),
        "looped.bundle": (looped, r"\(Loop\) has a graph attribute 'body'"),
        "secret.bundle": (secret.SerializeToString(), r"external file \('secret\.bin'\)"),
    }
    for name, (model_onnx, match) in hostile.items():
        path = _write(tmp_path, name, dataclasses.replace(bundle, model_onnx=model_onnx))
        with pytest.raises(TeacherError, match=rf"{name}: .*{match}"):
            load_teachers([path])
    with pytest.raises(
        TeacherError, match=r"no teacher could be loaded from 3 bundle.*external file"
    ) as info:
        load_teachers([tmp_path / name for name in hostile], on_error="skip")
    assert str(info.value).count("fix: ") >= 3  # every skipped file says how to fix it


def test_mismatched_class_counts_name_the_odd_file(tmp_path: Path, bundle: Bundle) -> None:
    ten = _write(tmp_path, "ten.bundle", bundle)
    five = _write(
        tmp_path, "five.bundle", _bundle(_trained_like(num_classes=5), "C8k3-P-C16k3-Pavg-F32-F5", 5)
    )
    with pytest.raises(TeacherError, match=r"five\.bundle: num_classes 5 .* disagree with .*ten\.bundle"):
        load_teachers([ten, five])
    teachers, skipped = load_teachers([ten, five], on_error="skip")
    assert [t.name for t in teachers] == ["ten"]
    assert [(Path(p).name, "num_classes 5" in reason) for p, reason in skipped] == [("five.bundle", True)]


def test_corrupt_bundle_stops_or_is_recorded(tmp_path: Path, bundle: Bundle) -> None:
    good = _write(tmp_path, "good.bundle", bundle)
    corrupt = tmp_path / "corrupt.bundle"
    corrupt.write_bytes(bundle_to_bytes(bundle)[:-100])  # truncated
    with pytest.raises(BundleError, match=r"corrupt\.bundle"):
        load_teachers([good, corrupt])
    teachers, skipped = load_teachers([good, corrupt], on_error="skip")
    assert [t.path for t in teachers] == [good]
    assert len(skipped) == 1 and skipped[0][0] == str(corrupt) and "corrupt.bundle" in skipped[0][1]


def test_unloadable_model_and_other_kinds(tmp_path: Path, bundle: Bundle) -> None:
    good = _write(tmp_path, "good.bundle", bundle)
    garbage = _write(tmp_path, "garbage.bundle", dataclasses.replace(bundle, model_onnx=b"not onnx"))
    decoder = _write(
        tmp_path, "decoder.bundle", dataclasses.replace(bundle, kind="cvae_decoder", latent_dim=4)
    )
    with pytest.raises(TeacherError, match=r"garbage\.bundle: not a valid ONNX model"):
        load_teachers([good, garbage])
    teachers, skipped = load_teachers([decoder, good, garbage], on_error="skip")
    assert len(teachers) == 1 and isinstance(teachers[0], Teacher)
    reasons = dict(skipped)
    assert "kind 'cvae_decoder' is not a classifier teacher" in reasons[str(decoder)]
    assert "not a valid ONNX model" in reasons[str(garbage)]
    with pytest.raises(TeacherError, match="no teacher could be loaded"):
        load_teachers([decoder], on_error="skip")
    with pytest.raises(ConfigError, match="on_error"):
        load_teachers([good], on_error="ignore")
    with pytest.raises(ConfigError, match="kinds"):
        load_teachers([good], kinds=("generator",))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batch_statistics_gap_matches_autograd_through_mean_and_var(dtype: torch.dtype) -> None:
    from server_kit.teachers.loading import batch_statistics_gap

    bn = nn.BatchNorm2d(5)
    bn.running_mean.uniform_(-1, 1, generator=torch.Generator().manual_seed(1))
    bn.running_var.uniform_(0.5, 2, generator=torch.Generator().manual_seed(2))
    base = torch.randn(6, 5, 7, 7, generator=torch.Generator().manual_seed(0)) * 1.5 + 0.3
    x = base.to(dtype).to(memory_format=torch.channels_last).requires_grad_(True)
    ref = base.to(dtype).float().requires_grad_(True)  # the reference in float32 on the same values
    got = batch_statistics_gap(bn, x)
    mean, var = ref.mean(dim=(0, 2, 3)), ref.var(dim=(0, 2, 3), unbiased=False)
    want = torch.linalg.vector_norm(mean - bn.running_mean) + torch.linalg.vector_norm(var - bn.running_var)
    got.backward()
    want.backward()
    assert got.dtype == torch.float32
    # Both sides reduce the same float32 values (bf16 inputs are upcast first) over 294 elements per
    # channel in possibly different orders: ~1e-6 relative, so 1e-5 leaves a tenfold margin.
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # bfloat16 gradients: three significant digits
    torch.testing.assert_close(x.grad.float(), ref.grad, rtol=tol, atol=tol * ref.grad.abs().max().item())
