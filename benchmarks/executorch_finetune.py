"""On-device fine-tuning without Python: the ExecuTorch training program (`edge-sdk deploy --target
executorch-train`) run step by step in ExecuTorch's runtime against the same steps in torch, on digits, one
model per classifier family (as tests/edge_sdk/test_deploy.py trains them: 3 epochs), then the trained
weights taken back into the architecture and evaluated as ONNX.

    python benchmarks/executorch_finetune.py [EPOCHS]          # with the [mobile] extra; default 2 epochs

Prints per family: the program's size, each epoch's mean loss in ExecuTorch and in torch, the largest
per-step loss difference, the same difference between torch and itself with channels-last kernels (the
spread float32 summation order alone makes on this run), and the digits test accuracy before and after.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

from edge_sdk.data import deploy_metadata_for, load_dataset
from edge_sdk.deploy import DeployConfig, deploy
from edge_sdk.mobile_targets import rebuild
from edge_sdk.mobile_training import torch_steps, trainer_steps
from edge_sdk.models.arch import build_model
from edge_sdk.personalize import PersonalizeConfig
from edge_sdk.train import TrainConfig, to_float, train
from export.onnx_export import export_onnx, onnx_session, read_metadata

FAMILIES = {
    "chain": "C32k5-P-C64k5-P-F10",
    "elastic": "mbv3:s16-16:k3e3-24:k3e3-32:k3e3.k3e3-64:k3e3.k3e3",
    "student": "C32k3-P-C64k3-P-F128-F10",
}
BATCH, LR, MOMENTUM = PersonalizeConfig.batch_size, PersonalizeConfig.lr, PersonalizeConfig.momentum


def _batches(x: np.ndarray, y: np.ndarray, epochs: int) -> list[tuple[np.ndarray, np.ndarray]]:
    rng, out = np.random.default_rng(0), []
    for _ in range(epochs):
        order = rng.permutation(len(x))
        out += [
            (x[order[i : i + BATCH]], y[order[i : i + BATCH]]) for i in range(0, len(x) - BATCH + 1, BATCH)
        ]
    return out


def _accuracy(model: bytes, x: np.ndarray, y: np.ndarray) -> float:
    return float(np.mean(onnx_session(model).run(None, {"x": x})[0].argmax(1) == y))


def main(epochs: int) -> None:
    tr, te = load_dataset("digits", split="train"), load_dataset("digits", split="test")
    x, y = to_float(tr.x).numpy(), tr.y.numpy().astype(np.int64)
    x_test, y_test = to_float(te.x).numpy(), te.y.numpy()
    batches = _batches(x, y, epochs)
    per_epoch = len(batches) // epochs
    for family, arch in sorted(FAMILIES.items()):
        tmp = Path(tempfile.mkdtemp(prefix="executorch-finetune-"))
        with torch.random.fork_rng():
            torch.manual_seed(0)
            module = build_model(arch, tr.input_shape, 10)
        train(module, tr, config=TrainConfig(epochs=3, precision="fp32"), seed=0)
        source = export_onnx(
            module.eval(),
            tr.input_shape,
            metadata=deploy_metadata_for(tr.input_shape, 10, None) | {"arch": arch},
        )
        props = read_metadata(source)
        out = tmp / "train.pte"
        deploy(source, out, config=DeployConfig(target="executorch-train"))
        et, params = trainer_steps(out.read_bytes(), batches, lr=LR, momentum=MOMENTUM)
        reference = torch_steps(rebuild(source, props, tr.input_shape, 10), batches, lr=LR, momentum=MOMENTUM)
        channels_last = rebuild(source, props, tr.input_shape, 10).to(memory_format=torch.channels_last)
        spread = torch_steps(channels_last, batches, lr=LR, momentum=MOMENTUM)
        trained = rebuild(source, props, tr.input_shape, 10)
        trained.load_state_dict(params, strict=False)
        back = export_onnx(trained.eval(), tr.input_shape, metadata=props)

        def means(losses: list[float]) -> str:
            return ", ".join(
                f"{np.mean(losses[e * per_epoch : (e + 1) * per_epoch]):.5f}" for e in range(epochs)
            )

        print(
            f"{family}: program {out.stat().st_size} bytes, {len(batches)} steps of {BATCH}; epoch mean loss "
            f"executorch [{means(et)}] torch [{means(reference)}]; max step |diff| executorch-torch "
            f"{np.max(np.abs(np.subtract(et, reference))):.2e}, torch-torch(channels-last) "
            f"{np.max(np.abs(np.subtract(spread, reference))):.2e}; test accuracy "
            f"{_accuracy(source, x_test, y_test):.4f} -> {_accuracy(back, x_test, y_test):.4f}",
            flush=True,
        )


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else PersonalizeConfig.train_epochs)
