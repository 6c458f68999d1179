"""ONNX export: interface, BN handling, names, determinism, validation and parity failures."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
import torch
from onnx import numpy_helper
from torch import nn

from common.errors import ExportError
from edge_sdk.models.arch import build_model
from export.onnx_export import (
    OPSET,
    check_parity,
    export_onnx,
    onnx_session,
    read_metadata,
    validate_onnx,
)

ARCH = "C8k3-P-C16k3-P-F32-F10"
SHAPE = (1, 12, 12)


def _trained_like(seed: int = 0) -> nn.Module:
    """A chain model with non-trivial BN statistics and biases, as after training."""
    gen = torch.Generator().manual_seed(seed)
    model = build_model(ARCH, SHAPE, 10)
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            if name.endswith("num_batches_tracked"):
                tensor.fill_(7)
            elif name.endswith("running_var"):
                tensor.copy_(torch.rand(tensor.shape, generator=gen) + 0.5)
            else:
                tensor.copy_(torch.randn(tensor.shape, generator=gen) * 0.3)
    return model


def _load_from_initializers(module: nn.Module, model_bytes: bytes) -> nn.Module:
    """Rebuild as the server does: initializers by state_dict key (num_batches_tracked is not exported)."""
    inits = {i.name: numpy_helper.to_array(i) for i in onnx.load_from_string(model_bytes).graph.initializer}
    state = {
        key: value if key.endswith("num_batches_tracked") else torch.from_numpy(inits[key].copy())
        for key, value in module.state_dict().items()
    }
    module.load_state_dict(state, strict=True)
    return module.eval()


def _ops(model_bytes: bytes) -> list[str]:
    return [node.op_type for node in onnx.load_from_string(model_bytes).graph.node]


@pytest.fixture(scope="module")
def model() -> nn.Module:
    return _trained_like()


@pytest.fixture(scope="module")
def teacher_bytes(model: nn.Module) -> bytes:
    return export_onnx(model, SHAPE, metadata={"arch": ARCH, "sdk_version": "0.1.0", "producer": "test"})


def test_interface_opset_and_metadata(teacher_bytes: bytes) -> None:
    proto = validate_onnx(teacher_bytes)
    assert [(op.domain, op.version) for op in proto.opset_import] == [("", OPSET)] and OPSET == 18
    assert [i.name for i in proto.graph.input] == ["x"]
    assert [o.name for o in proto.graph.output] == ["logits"]
    dims = proto.graph.input[0].type.tensor_type.shape.dim
    assert dims[0].dim_param == "batch" and [d.dim_value for d in dims[1:]] == list(SHAPE)
    assert proto.graph.input[0].type.tensor_type.elem_type == onnx.TensorProto.FLOAT
    assert read_metadata(teacher_bytes) == {
        "arch": ARCH,
        "sdk_version": "0.1.0",
        "producer": "test",
        "opset": "18",
        "input_shape": json.dumps(list(SHAPE)),
        "batchnorm": "kept",
    }


def test_batchnorm_kept_and_names_equal_state_dict(model: nn.Module, teacher_bytes: bytes) -> None:
    assert _ops(teacher_bytes).count("BatchNormalization") == 2  # one per C module
    inits = {i.name: numpy_helper.to_array(i) for i in onnx.load_from_string(teacher_bytes).graph.initializer}
    state = {k: v for k, v in model.state_dict().items() if not k.endswith("num_batches_tracked")}
    assert set(state) <= set(inits)
    for key, value in state.items():
        np.testing.assert_array_equal(inits[key], value.numpy(), err_msg=key)  # copied bytes: exact


def test_fresh_model_keeps_every_name_despite_equal_values() -> None:
    # Untrained BN layers share running stats (zeros / ones): the exporter would de-dup them.
    fresh = build_model(ARCH, SHAPE, 10)
    data = export_onnx(fresh, SHAPE)
    names = {i.name for i in onnx.load_from_string(data).graph.initializer}
    assert {k for k in fresh.state_dict() if not k.endswith("num_batches_tracked")} <= names
    assert "Identity" not in _ops(data)


def test_rebuild_from_initializers_matches(model: nn.Module, teacher_bytes: bytes) -> None:
    rebuilt = _load_from_initializers(build_model(ARCH, SHAPE, 10), teacher_bytes)
    x = torch.rand(4, *SHAPE, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():  # the same weights through the same torch kernels: bitwise
        assert torch.equal(rebuilt(x), model.eval()(x))


def test_keep_batchnorm_false_folds(model: nn.Module, teacher_bytes: bytes) -> None:
    folded = export_onnx(model, SHAPE, keep_batchnorm=False)
    assert _ops(folded).count("BatchNormalization") == 0
    assert read_metadata(folded)["batchnorm"] == "folded"
    assert len(folded) < len(teacher_bytes)  # running stats gone
    assert export_onnx(model, SHAPE, keep_batchnorm=False) == folded


def test_deterministic_bytes(model: nn.Module, teacher_bytes: bytes) -> None:
    again = export_onnx(model, SHAPE, metadata={"producer": "test", "sdk_version": "0.1.0", "arch": ARCH})
    assert again == teacher_bytes


@pytest.mark.parametrize("batch", [1, 5])
def test_dynamic_batch(model: nn.Module, teacher_bytes: bytes, batch: int) -> None:
    x = torch.rand(batch, *SHAPE, generator=torch.Generator().manual_seed(batch))
    (got,) = onnx_session(teacher_bytes).run(["logits"], {"x": x.numpy()})
    with torch.no_grad():
        expected = model.eval()(x).numpy()
    assert got.shape == (batch, 10)
    # onnxruntime vs torch on logits of a few units after sums of up to 144 terms: float32 summation order
    # costs a few 1e-7, so 1e-5 catches a wrong graph without depending on either side's kernels
    np.testing.assert_allclose(got, expected, atol=1e-5, rtol=0)


def test_mode_restored_per_module() -> None:
    model = build_model(ARCH, SHAPE, 10).train()
    model.classifier.eval()  # mixed modes must survive the export
    export_onnx(model, SHAPE)
    assert model.training and model.features.training and not model.classifier.training


def test_parity_value_is_small(model: nn.Module, teacher_bytes: bytes) -> None:
    diff = check_parity(model, teacher_bytes, SHAPE, seed=1, batch_size=3)
    assert 0.0 <= diff <= 1e-4  # check_parity's own default bound (torch vs onnxruntime summation order)


def test_parity_against_other_weights_fails(teacher_bytes: bytes) -> None:
    other = _trained_like(seed=1)
    with pytest.raises(ExportError, match=r"max abs diff .* > atol"):
        check_parity(other, teacher_bytes, SHAPE)


class _PythonState(nn.Module):
    """Tracing freezes the Python-side counter, so the ONNX graph disagrees with later calls."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(16, 3)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.head(torch.flatten(x, 1)) + float(self.calls)


def test_export_refuses_model_with_broken_parity() -> None:
    with pytest.raises(ExportError, match="parity failed"):
        export_onnx(_PythonState(), (1, 4, 4))


def test_export_refuses_patched_bytes(monkeypatch: pytest.MonkeyPatch, model: nn.Module) -> None:
    import export.onnx_export as mod

    real = mod.check_parity
    other = _trained_like(seed=2)

    def parity_against_other(_model: nn.Module, data: bytes, *args: object, **kwargs: object) -> float:
        return real(other, data, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(mod, "check_parity", parity_against_other)
    with pytest.raises(ExportError, match="parity"):
        export_onnx(model, SHAPE)


def test_export_wraps_shape_errors_and_restores_mode() -> None:
    model = build_model(ARCH, SHAPE, 10).train()
    with pytest.raises(ExportError, match=r"torch\.onnx\.export failed"):
        export_onnx(model, (3, 12, 12))  # the model expects one channel
    assert model.training and model.features[1].training


@pytest.mark.parametrize("shape", [(1, 12), (0, 12, 12), (1, 12.0, 12), (True, 12, 12)])
def test_bad_input_shape(model: nn.Module, shape: tuple) -> None:
    with pytest.raises(ExportError, match="three positive ints"):
        export_onnx(model, shape)


def test_metadata_rules(model: nn.Module) -> None:
    with pytest.raises(ExportError, match="must be str"):
        export_onnx(model, SHAPE, metadata={"num_classes": 10})  # type: ignore[dict-item]
    with pytest.raises(ExportError, match="set by the exporter"):
        export_onnx(model, SHAPE, metadata={"opset": "17"})
    # Agreeing with the exporter is fine (clients record input_shape themselves).
    data = export_onnx(model, SHAPE, metadata={"input_shape": "[1, 12, 12]"})
    assert read_metadata(data)["input_shape"] == "[1, 12, 12]"


def test_validate_refuses_garbage_and_invalid_graphs(teacher_bytes: bytes) -> None:
    with pytest.raises(ExportError, match="not an ONNX model"):
        validate_onnx(b"\xff\xff\xff\xff not protobuf")
    with pytest.raises(ExportError, match="expected serialized ONNX bytes"):
        validate_onnx(b"")
    proto = onnx.load_from_string(teacher_bytes)
    proto.graph.node[-1].input[0] = "no_such_tensor"
    with pytest.raises(ExportError, match="failed validation"):
        validate_onnx(proto.SerializeToString())


def test_onnx_session_threads(teacher_bytes: bytes) -> None:
    session = onnx_session(teacher_bytes, threads=1)
    assert session.get_providers() == ["CPUExecutionProvider"]
    with pytest.raises(ExportError, match="threads"):
        onnx_session(teacher_bytes, threads=0)


class _ZooLike(nn.Module):
    """torchvision-style blocks: residual Add, depthwise conv, Hardswish, ReLU6, AdaptiveAvgPool."""

    def __init__(self, num_classes: int = 5) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.Hardswish()
        )
        self.block = nn.Sequential(
            nn.Conv2d(8, 8, 3, padding=1, groups=8, bias=False),
            nn.BatchNorm2d(8),
            nn.ReLU6(),
            nn.Conv2d(8, 8, 1, bias=False),
            nn.BatchNorm2d(8),
        )
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Linear(8, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        x = torch.relu(x + self.block(x))
        return self.head(torch.flatten(self.pool(x), 1))


def test_zoo_like_model_exports() -> None:
    torch.manual_seed(0)
    zoo = _ZooLike()
    data = export_onnx(zoo, (3, 16, 16))
    ops = _ops(data)
    assert {"Add", "HardSwish", "GlobalAveragePool"} <= set(ops)
    assert ops.count("BatchNormalization") == 3
    rebuilt = _load_from_initializers(_ZooLike(), data)
    assert check_parity(rebuilt, data, (3, 16, 16)) <= 1e-4  # check_parity's default bound


@pytest.mark.parametrize(
    "arch",
    [
        "C32k5-P-C64k5-P-F10",  # CNN1, the search's warm start, on color images
        "C8k3-R8k3-P-R16k5-Pavg-F32-F10",  # residual blocks: identity and projection shortcuts
        "mbv3:s16-16:k3e3-24:k3e3-32:k3e3.k3e3-64:k3e3.k3e3",  # the elastic space's smallest subnet
    ],
)
def test_color_sized_models_export_with_parity_and_rebuild(arch: str) -> None:
    shape = (3, 16, 16)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = build_model(arch, shape, 10)
        model.train()(torch.rand(8, *shape))  # non-trivial BatchNorm running statistics
    data = export_onnx(model.eval(), shape, metadata={"arch": arch})
    assert "BatchNormalization" in _ops(data)
    rebuilt = _load_from_initializers(build_model(arch, shape, 10), data)  # as the server rebuilds a teacher
    assert check_parity(rebuilt, data, shape) <= 1e-4  # check_parity's default bound
