"""Generic ONNX -> torch converter: parity with onnxruntime across opsets, input gradients, BN modules
with hooks, opset-specific attribute forms, and refusal of unsupported operators."""

from __future__ import annotations

import copy
import io
import pickle
import warnings

import numpy as np
import onnx
import onnxruntime
import pytest
import torch
import torch.nn.functional as F
from onnx import TensorProto, helper, numpy_helper
from torch import nn

from common.errors import TeacherError
from export.onnx_check import ALLOWED_OPS
from server_kit.teachers.onnx_convert import SUPPORTED_OPS, OnnxModule, convert_onnx
from tests.export.test_onnx_check import external_weight, loop_in_front


class _SqueezeExcite(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.reduce = nn.Conv2d(channels, channels // 2, 1)
        self.expand = nn.Conv2d(channels // 2, channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = x.mean(dim=(2, 3), keepdim=True)  # ReduceMean: axes attribute < 18, axes input >= 18
        return x * F.hardsigmoid(self.expand(F.relu(self.reduce(w))))


class SmallNet(nn.Module):
    """torchvision-style: stem, depthwise block with ReLU6 and squeeze-excite, residual add, pools, GAP."""

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, 2, 1, bias=False), nn.BatchNorm2d(16), nn.Hardswish())
        self.depthwise = nn.Sequential(
            nn.Conv2d(16, 16, 3, 1, 1, groups=16, bias=False), nn.BatchNorm2d(16), nn.ReLU6()
        )
        self.se = _SqueezeExcite(16)
        self.project = nn.Sequential(nn.Conv2d(16, 16, 1, bias=False), nn.BatchNorm2d(16))
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        self.avgpool = nn.AvgPool2d(3, 2, 1, ceil_mode=True, count_include_pad=False)
        self.act = nn.LeakyReLU(0.1)
        self.gap = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(16, 24)
        self.head = nn.Linear(24, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem((x - 0.5) / 0.25)
        x = x + self.project(self.se(self.depthwise(x)))
        x = self.act(self.avgpool(self.maxpool(x)))
        h = self.fc(torch.flatten(self.gap(x), 1))
        return self.head(torch.tanh(h) + torch.sigmoid(h))


class ShapeOps(nn.Module):
    """Batch-dependent reshape (Shape/Gather/Unsqueeze/Concat/Reshape), squeeze, MatMul, (log-)softmax."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3)
        self.fc = nn.Linear(8 * 6 * 6, 5)
        self.proj = nn.Parameter(torch.randn(5, 7))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.max_pool2d(self.conv(x), 2, ceil_mode=True)
        y = F.avg_pool2d(y, 3, 1, 1, ceil_mode=True, count_include_pad=True)
        z = self.fc(y.view(y.size(0), -1)).unsqueeze(1).squeeze(1) @ self.proj
        z = z.transpose(0, 1).transpose(0, 1)
        return torch.cat([F.softmax(z, dim=1), F.log_softmax(z, -1)], 1).reshape(x.shape[0], 2, 7).mean(1)


def _randomize_bn(model: nn.Module, seed: int = 0) -> nn.Module:
    """Running stats and affine parameters far from their defaults, so BN changes the output."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.copy_(torch.rand(m.num_features, generator=gen) * 2 - 1)
                m.running_var.copy_(torch.rand(m.num_features, generator=gen) * 1.5 + 0.5)
                m.weight.copy_(torch.rand(m.num_features, generator=gen) + 0.5)
                m.bias.copy_(torch.rand(m.num_features, generator=gen) - 0.5)
    return model.eval()


def _export(model: nn.Module, x: torch.Tensor, opset: int) -> bytes:
    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            model.eval(),
            (x,),
            buffer,
            dynamo=False,
            opset_version=opset,
            training=torch.onnx.TrainingMode.PRESERVE,
            input_names=["x"],
            output_names=["logits"],
            dynamic_axes={"x": {0: "batch"}, "logits": {0: "batch"}},
        )
    return buffer.getvalue()


def _ort(model_bytes: bytes, x: np.ndarray) -> np.ndarray:
    session = onnxruntime.InferenceSession(model_bytes, providers=["CPUExecutionProvider"])
    return session.run(None, {session.get_inputs()[0].name: x})[0]


def _ops(model_bytes: bytes) -> set[str]:
    return {node.op_type for node in onnx.load_from_string(model_bytes).graph.node}


@pytest.fixture(scope="module")
def small_net() -> nn.Module:
    torch.manual_seed(0)
    return _randomize_bn(SmallNet())


@pytest.mark.parametrize("opset", [13, 17, 18])
def test_small_net_matches_onnxruntime_with_gradients_and_bn_hooks(small_net: nn.Module, opset: int) -> None:
    x = torch.rand(5, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    model_bytes = _export(small_net, x[:2], opset)
    assert {"BatchNormalization", "Conv", "Add", "Gemm", "GlobalAveragePool", "ReduceMean"} <= _ops(
        model_bytes
    )
    module = convert_onnx(model_bytes)

    seen: list[torch.Tensor] = []
    bns = [m for m in module.modules() if isinstance(m, nn.BatchNorm2d)]
    handles = [bn.register_forward_hook(lambda _m, inp, _out: seen.append(inp[0])) for bn in bns]
    x_in = x.clone().requires_grad_(True)
    out = module(x_in)
    for handle in handles:
        handle.remove()

    expected = _ort(model_bytes, x.numpy())
    # torch vs onnxruntime convolutions sum in different orders: ~1e-6 on O(1) logits; 1e-4 is the export's
    # parity bound. BN statistics are copied initializers, hence exact.
    assert np.abs(out.detach().numpy() - expected).max() <= 1e-4
    assert len(bns) == 3 and len(seen) == 3 and all(not bn.training for bn in bns)
    original = [m for m in small_net.modules() if isinstance(m, nn.BatchNorm2d)]
    for got, want in zip(bns, original, strict=True):
        assert torch.equal(got.running_mean, want.running_mean)
        assert torch.equal(got.running_var, want.running_var)
        assert got.eps == want.eps
    (out.logsumexp(1).sum() + sum(s.pow(2).mean() for s in seen)).backward()
    assert x_in.grad is not None and torch.isfinite(x_in.grad).all() and x_in.grad.abs().sum() > 0
    assert isinstance(module.head, nn.Linear) and module.head.weight.shape == (10, 24)


@pytest.mark.parametrize("opset", [11, 13, 18])
def test_shape_ops_and_legacy_softmax_match_onnxruntime(opset: int) -> None:
    torch.manual_seed(0)
    x = torch.rand(3, 3, 14, 14)
    model_bytes = _export(ShapeOps(), x, opset)
    assert {"Shape", "Gather", "Reshape", "Squeeze", "Unsqueeze", "MatMul", "Softmax"} <= _ops(model_bytes)
    module = convert_onnx(model_bytes)
    x_other_batch = torch.rand(4, 3, 14, 14)  # the batch dimension is read at run time
    got = module(x_other_batch).detach().numpy()
    # outputs are (log-)probabilities of magnitude ~1 after a 288-term dot product: float32 summation-order
    # differences are a few 1e-7, so 1e-5 catches a wrong op yet not another kernel's rounding
    assert np.abs(got - _ort(model_bytes, x_other_batch.numpy())).max() <= 1e-5


def _graph(
    nodes: list, initializers: dict[str, np.ndarray], in_shape: list, out_rank: int, opset: int
) -> bytes:
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, in_shape)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None] * out_rank)],
        [numpy_helper.from_array(v, k) for k, v in initializers.items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=8)
    onnx.checker.check_model(model)
    return model.SerializeToString()


def test_asymmetric_and_auto_pads_match_onnxruntime() -> None:
    rng = np.random.default_rng(0)
    w1 = rng.standard_normal((4, 3, 3, 3)).astype(np.float32)
    w2 = rng.standard_normal((4, 4, 2, 2)).astype(np.float32)
    nodes = [
        helper.make_node("Conv", ["x", "w1"], ["c"], auto_pad="SAME_UPPER", strides=[2, 2]),
        helper.make_node("MaxPool", ["c"], ["p"], kernel_shape=[2, 2], pads=[0, 0, 1, 1], strides=[2, 2]),
        helper.make_node("AveragePool", ["p"], ["a"], kernel_shape=[3, 3], pads=[1, 0, 2, 1]),
        helper.make_node(
            "AveragePool", ["p"], ["a2"], kernel_shape=[3, 3], pads=[1, 0, 2, 1], count_include_pad=1
        ),
        helper.make_node("Conv", ["a", "w2"], ["c2"], pads=[0, 0, 1, 1]),
        helper.make_node("Add", ["a2", "c2"], ["y"]),
    ]
    model_bytes = _graph(nodes, {"w1": w1, "w2": w2}, ["N", 3, 11, 11], 4, 18)
    x = rng.random((2, 3, 11, 11), dtype=np.float32)
    expected = _ort(model_bytes, x)
    assert expected.shape == (2, 4, 4, 2)
    got = convert_onnx(model_bytes)(torch.from_numpy(x)).detach().numpy()
    # values of a few units after 27- and 16-term sums: torch vs onnxruntime rounding is ~1e-6
    assert np.abs(got - expected).max() <= 1e-4


def test_opset_attribute_forms_of_clip_squeeze_and_reduce() -> None:
    """Opset 11 gives axes as attributes and Clip bounds as inputs; opset 18 gives axes as inputs."""
    x = np.random.default_rng(1).standard_normal((2, 1, 3, 4)).astype(np.float32)
    old = [
        helper.make_node("Clip", ["x", "lo", "hi"], ["c"]),
        helper.make_node("Squeeze", ["c"], ["s"], axes=[1]),
        helper.make_node("ReduceMean", ["s"], ["r"], axes=[-1], keepdims=0),
        helper.make_node("Unsqueeze", ["r"], ["y"], axes=[0]),
    ]
    new = [
        helper.make_node("Clip", ["x", "lo", "hi"], ["c"]),
        helper.make_node("Squeeze", ["c", "axis1"], ["s"]),
        helper.make_node("ReduceMean", ["s", "axis_last"], ["r"], keepdims=0),
        helper.make_node("Unsqueeze", ["r", "axis0"], ["y"]),
    ]
    scalars = {"lo": np.array(-0.5, np.float32), "hi": np.array(0.7, np.float32)}
    axes = {k: np.array(v, np.int64) for k, v in [("axis1", [1]), ("axis_last", [-1]), ("axis0", [0])]}
    for nodes, inits, opset in [(old, scalars, 11), (new, {**scalars, **axes}, 18)]:
        model_bytes = _graph(nodes, inits, ["N", 1, 3, 4], 3, opset)
        got = convert_onnx(model_bytes)(torch.from_numpy(x)).numpy()
        # a clip and a 4-term mean of values below 1: a few ulps (~1e-7) whatever the summation order
        np.testing.assert_allclose(got, _ort(model_bytes, x), atol=1e-6)
        np.testing.assert_allclose(got, np.clip(x, -0.5, 0.7)[:, 0].mean(-1)[None], atol=1e-6)


def test_unsupported_operators_are_all_named_at_conversion() -> None:
    class Foreign(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lstm = nn.LSTM(4, 4, batch_first=True)
            self.fc = nn.Linear(4, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y, _ = self.lstm(torch.erf(x))
            return self.fc(y[:, -1])

    model_bytes = _export(Foreign(), torch.rand(2, 5, 4), 17)
    with pytest.raises(
        TeacherError, match=r"unsupported ONNX operators 'Erf' \(node .*'LSTM' \(node "
    ) as info:
        convert_onnx(model_bytes)
    assert "supported: ['Add'," in str(info.value)


def test_single_unsupported_operator_message_format() -> None:
    nodes = [helper.make_node("Erf", ["x"], ["y"], name="my_erf")]
    model_bytes = _graph(nodes, {}, ["N", 4], 2, 18)
    expected = f"unsupported ONNX operator 'Erf' (node 'my_erf'); supported: {list(SUPPORTED_OPS)}"
    with pytest.raises(TeacherError) as info:
        convert_onnx(model_bytes)
    assert str(info.value) == expected


def test_refuses_garbage_and_training_mode_batchnorm() -> None:
    with pytest.raises(TeacherError, match="not a valid ONNX model"):
        convert_onnx(b"definitely not onnx")
    stats = {k: np.ones(2, np.float32) for k in ("scale", "bias", "mean", "var")}
    nodes = [helper.make_node("BatchNormalization", ["x", *stats], ["y"], training_mode=1)]
    with pytest.raises(TeacherError, match="training_mode=1"):
        convert_onnx(_graph(nodes, stats, ["N", 2, 3, 3], 4, 15))


def test_converted_module_copies_and_pickles(small_net: nn.Module) -> None:
    x = torch.rand(2, 3, 32, 32)
    module = convert_onnx(_export(small_net, x, 18))
    want = module(x)
    for clone in (copy.deepcopy(module), pickle.loads(pickle.dumps(module))):
        assert isinstance(clone, OnnxModule)
        assert torch.equal(clone(x), want)  # the same module and input on the same kernels: bitwise
    assert set(module.state_dict()) == set(copy.deepcopy(module).state_dict())


def test_every_supported_operator_is_allowed_by_the_load_time_contract() -> None:
    assert set(SUPPORTED_OPS) <= ALLOWED_OPS


def test_hostile_files_are_refused_before_a_tensor_is_read(tmp_path, monkeypatch) -> None:
    rng = np.random.default_rng(0)
    nodes = [helper.make_node("Flatten", ["x"], ["f"]), helper.make_node("Gemm", ["f", "w"], ["y"], transB=1)]
    model_bytes = _graph(nodes, {"w": rng.standard_normal((3, 4)).astype(np.float32)}, ["N", 4], 2, 18)
    assert convert_onnx(model_bytes)(torch.ones(2, 4)).shape == (2, 3)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "secret.bin").write_bytes(np.arange(12, dtype=np.float32).tobytes())
    secret = onnx.load_from_string(model_bytes)
    external_weight(secret, "secret.bin")
    with pytest.raises(TeacherError, match=r"external file \('secret\.bin'\)"):
        convert_onnx(secret.SerializeToString())
    with pytest.raises(TeacherError, match=r"\(Loop\) has a graph attribute 'body'"):
        convert_onnx(loop_in_front(onnx.load_from_string(model_bytes)).SerializeToString())
    blown = onnx.load_from_string(model_bytes)
    blown.graph.input[0].type.tensor_type.shape.dim[1].dim_value = 1 << 24  # x: N x 16 M
    with pytest.raises(
        TeacherError, match=r"ONNX input 'x' has shape \[N, 16777216\], expected \[batch, static"
    ):
        convert_onnx(blown.SerializeToString())
