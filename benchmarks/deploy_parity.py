"""`edge-sdk deploy` parity: accuracy of every target's artifact against the float32 ONNX on the digits
test set, one model per classifier family (as tests/edge_sdk/test_deploy.py trains them: 3 epochs).

    python benchmarks/deploy_parity.py onnx,ort                      # the core install
    python benchmarks/deploy_parity.py executorch,executorch-train,coreml   # with the [mobile] extra
    python benchmarks/deploy_parity.py tflite                        # with the [tflite] extra

A target whose runtime does not run here (coreml) is converted and reported as such.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

from edge_sdk.data import deploy_metadata_for, load_dataset
from edge_sdk.deploy import TARGETS, DeployConfig, deploy
from edge_sdk.models.arch import build_model
from edge_sdk.train import TrainConfig, to_float, train
from export.onnx_export import export_onnx, onnx_session

FAMILIES = {
    "chain": "C32k5-P-C64k5-P-F10",
    "elastic": "mbv3:s16-16:k3e3-24:k3e3-32:k3e3.k3e3-64:k3e3.k3e3",
    "student": "C32k3-P-C64k3-P-F128-F10",
}


def _trained(arch: str, tr, out: Path) -> Path:
    with torch.random.fork_rng():
        torch.manual_seed(0)
        module = build_model(arch, tr.input_shape, 10)
    train(module, tr, config=TrainConfig(epochs=3, precision="fp32"), seed=0)
    metadata = deploy_metadata_for(tr.input_shape, 10, None) | {"arch": arch}
    out.write_bytes(export_onnx(module.eval(), tr.input_shape, metadata=metadata))
    return out


def main(targets: list[str]) -> None:
    tr, te = load_dataset("digits", split="train"), load_dataset("digits", split="test")
    x, y = to_float(te.x).numpy(), te.y.numpy()
    calibration = to_float(tr.x[:256]).numpy()
    for family, arch in sorted(FAMILIES.items()):
        tmp = Path(tempfile.mkdtemp(prefix="deploy-parity-"))
        src = _trained(arch, tr, tmp / "global.onnx")
        ref = onnx_session(src.read_bytes()).run(None, {"x": x})[0].argmax(1)
        print(f"{family}: fp32 onnx accuracy {np.mean(ref == y):.4f}", flush=True)
        for name in targets:
            target = TARGETS[name]
            for int8 in (False, True) if target.int8 else (False,):
                out = tmp / f"model{target.suffix}"
                config = DeployConfig(target=name, int8=int8)
                deploy(src, out, config=config, calibration=calibration if int8 else None)
                label = f"{name}{' int8' if int8 else ''}"
                if target.run is None:
                    print(f"  {label}: converted (its runtime does not run here)", flush=True)
                    continue
                got = target.run({"": out.read_bytes()}, x).argmax(1)
                delta = 100 * (np.mean(got == y) - np.mean(ref == y))
                print(
                    f"  {label}: accuracy {np.mean(got == y):.4f} ({delta:+.2f} points), top-1 agreement "
                    f"{np.mean(got == ref):.4f}",
                    flush=True,
                )


if __name__ == "__main__":
    main(sys.argv[1].split(",") if len(sys.argv) > 1 else ["onnx", "ort"])
