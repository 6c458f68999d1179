"""Accuracy of ONNX files and torch modules against a count done by hand."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper
from torch import nn

from common.errors import BundleError, ConfigError, DataError
from edge_sdk.data import ArrayDataset
from edge_sdk.models.arch import build_model
from export.onnx_export import export_onnx
from server_kit.evaluate import evaluate_module, evaluate_onnx

SHAPE = (1, 8, 8)
NUM_CLASSES = 4


@pytest.fixture(scope="module")
def model() -> nn.Module:
    torch.manual_seed(0)
    return build_model("C4k3-P-F16-F4", SHAPE, NUM_CLASSES).eval()


@pytest.fixture(scope="module")
def data() -> ArrayDataset:
    gen = torch.Generator().manual_seed(1)
    x = torch.randint(0, 256, (50, *SHAPE), generator=gen, dtype=torch.uint8)
    y = torch.randint(0, NUM_CLASSES - 1, (50,), generator=gen)  # class 3 has no examples
    return ArrayDataset(x, y, NUM_CLASSES)


def _by_hand(model: nn.Module, data: ArrayDataset) -> tuple[int, list[float | None]]:
    with torch.no_grad():
        predictions = [int(model(data.x[i : i + 1].float() / 255).argmax()) for i in range(len(data))]
    labels = data.y.tolist()
    correct = sum(p == t for p, t in zip(predictions, labels, strict=True))
    per_class: list[float | None] = []
    for c in range(NUM_CLASSES):
        hits = [p == t for p, t in zip(predictions, labels, strict=True) if t == c]
        per_class.append(sum(hits) / len(hits) if hits else None)
    return correct, per_class


def test_onnx_and_module_accuracy_match_a_manual_count(
    model: nn.Module, data: ArrayDataset, tmp_path: Path
) -> None:
    correct, per_class = _by_hand(model, data)
    with torch.no_grad():
        top2 = model(data.x.float() / 255).topk(2, dim=1).values
    # every path below is within the export's parity bound (1e-4) of these logits, so a top-two gap above
    # twice that fixes every argmax on any CPU and the counts must agree exactly
    assert float((top2[:, 0] - top2[:, 1]).min()) > 2e-4
    model_bytes = export_onnx(model, SHAPE)
    path = tmp_path / "global.onnx"
    path.write_bytes(model_bytes)
    results = [
        evaluate_onnx(model_bytes, data, batch_size=16),
        evaluate_onnx(path, data),
        evaluate_onnx(str(path), data, batch_size=7),
        evaluate_module(model, data, batch_size=9),
    ]
    for result in results:
        assert result["correct"] == correct
        assert result["num_examples"] == 50
        assert result["accuracy"] == pytest.approx(correct / 50)  # one division of integers
        assert result["per_class_accuracy"] == pytest.approx(per_class)
        assert result["per_class_accuracy"][3] is None


def test_constant_model_scores_its_class_share(data: ArrayDataset) -> None:
    """A model that always says class 1 (fixed batch of 8) is right exactly on the class-1 examples."""
    nodes = [
        helper.make_node("ReduceMean", ["x"], ["mean"], axes=[1, 2, 3], keepdims=1),  # 8 x 1 x 1 x 1
        helper.make_node("Flatten", ["mean"], ["column"]),  # 8 x 1
        helper.make_node("Mul", ["column", "zeros"], ["zero_logits"]),  # 8 x 4
        helper.make_node("Add", ["zero_logits", "bias"], ["logits"]),
    ]
    graph = helper.make_graph(
        nodes,
        "constant",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [8, *SHAPE])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [8, NUM_CLASSES])],
        [
            numpy_helper.from_array(np.zeros((1, NUM_CLASSES), np.float32), "zeros"),
            numpy_helper.from_array(np.array([0, 1, 0, 0], np.float32), "bias"),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)
    onnx.checker.check_model(model)
    model_bytes = model.SerializeToString()
    result = evaluate_onnx(model_bytes, data)  # 50 examples in batches of 8: the last one is padded
    ones = int((data.y == 1).sum())
    assert result["correct"] == ones
    assert result["per_class_accuracy"][:3] == [0.0, 1.0, 0.0]


def test_refusals(model: nn.Module, data: ArrayDataset, tmp_path: Path) -> None:
    model_bytes = export_onnx(model, SHAPE)
    with pytest.raises(BundleError, match=r"missing\.onnx"):
        evaluate_onnx(tmp_path / "missing.onnx", data)
    with pytest.raises(ConfigError, match="batch_size"):
        evaluate_onnx(model_bytes, data, batch_size=0)
    wrong_shape = ArrayDataset(
        torch.zeros(2, 3, 8, 8, dtype=torch.uint8), torch.zeros(2, dtype=torch.long), 4
    )
    with pytest.raises(DataError, match=r"expects input"):
        evaluate_onnx(model_bytes, wrong_shape)
    wrong_classes = ArrayDataset(data.x, data.y, 7)
    with pytest.raises(DataError, match="7 classes"):
        evaluate_onnx(model_bytes, wrong_classes)
    with pytest.raises(DataError, match="7 classes"):
        evaluate_module(model, wrong_classes)
