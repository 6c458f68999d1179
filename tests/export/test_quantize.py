"""int8 static quantization round-trips through onnxruntime and keeps the predictions."""

import numpy as np
import torch

from edge_sdk.arch import build_model
from export.onnx_export import INPUT_NAME, export_onnx, onnx_session, validate_onnx
from export.quantize import latency_ms, quantize_int8


def test_int8_round_trips_through_onnxruntime():
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = build_model("C8k3-P-C16k3-P-F32-F10", (1, 16, 16), 10).eval()
    fp32 = export_onnx(model, (1, 16, 16), keep_batchnorm=False)
    x = np.random.default_rng(0).random((64, 1, 16, 16), dtype=np.float32)
    int8 = quantize_int8(fp32, x[:32])
    validate_onnx(int8)
    assert len(int8) < len(fp32)
    ops = {node.op_type for node in __import__("onnx").load_model_from_string(int8).graph.node}
    assert {"QuantizeLinear", "DequantizeLinear"} <= ops  # QDQ format
    ref = onnx_session(fp32).run(None, {INPUT_NAME: x})[0]
    out = onnx_session(int8).run(None, {INPUT_NAME: x})[0]
    assert out.shape == ref.shape == (64, 10)
    assert (out.argmax(1) == ref.argmax(1)).mean() >= 0.9
    assert latency_ms(int8, (1, 16, 16), repeats=3) > 0
