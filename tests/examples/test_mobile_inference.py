"""examples/mobile_inference.py on a digits model deployed here: in each runtime present (onnxruntime for
``.ort``; LiteRT and ExecuTorch where their extras are installed), it prints the same classes as
onnx_inference.py prints for the float32 ONNX, and refuses a file it cannot use in one line."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from edge_sdk.data import deploy_metadata_for
from edge_sdk.deploy import DeployConfig, deploy
from export.onnx_export import export_onnx
from tests.examples.test_onnx_inference import ENTRY, LINE, WORDS, digits_model  # noqa: F401

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
TARGETS = {"ort": ("model.ort", "onnxruntime"), "tflite": ("model.tflite", "ai_edge_litert"),
           "executorch": ("model.pte", "executorch")}  # fmt: skip


@pytest.fixture(scope="module")
def kept_bn(digits_model, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, np.ndarray]:  # noqa: F811
    """The example's digits model exported with BatchNorm kept (the torch-based targets rebuild from it,
    as from global.onnx), and its six test images."""
    _, module, pixels = digits_model
    meta = {"arch": "C8k3-P-F10"} | deploy_metadata_for((1, 8, 8), 10, WORDS)
    path = tmp_path_factory.mktemp("mobile") / "global.onnx"
    path.write_bytes(export_onnx(module, (1, 8, 8), metadata=meta, keep_batchnorm=True))
    return path, pixels


def _run(script: str, tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(EXAMPLES / script), *args],
        capture_output=True,
        text=True,
        cwd=tmp_path,  # not the repository: the example needs its runtime, not the toolkit
        env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"},
        timeout=300,
    )


def _rows(stdout: str) -> list[list[tuple[str, float]]]:
    """Per printed row: its (class name, probability) pairs, best first."""
    rows = [LINE.match(line) for line in stdout.splitlines()[1:]]
    return [[(m["name"].strip(), float(m["p"])) for m in ENTRY.finditer(r["top"])] for r in rows]  # type: ignore[index]


@pytest.mark.parametrize("target", sorted(TARGETS))
def test_the_example_runs_each_target_as_the_onnx(target: str, tmp_path: Path, kept_bn) -> None:
    name, module = TARGETS[target]
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"the {target} runtime ({module}) is not installed")
    onnx_path, pixels = kept_bn
    artifact = tmp_path / name
    deploy(onnx_path, artifact, config=DeployConfig(target=target))
    np.save(tmp_path / "batch.npy", pixels)
    want = _run("onnx_inference.py", tmp_path, str(onnx_path), "batch.npy", "--top-k", "2")
    got = _run("mobile_inference.py", tmp_path, str(artifact), "batch.npy", "--top-k", "2")
    assert want.returncode == 0 and got.returncode == 0, want.stderr + got.stderr
    assert got.stdout.splitlines()[0].startswith(f"{name}: 10 classes; input 'x' [N, *[1, 8, 8]] float32")
    assert len(_rows(got.stdout)) == len(_rows(want.stdout)) == 6
    for mine, theirs in zip(_rows(got.stdout), _rows(want.stdout), strict=True):
        # deploy held the target's logits to the ONNX's within its parity bound (1e-4), so probabilities
        # agree to 2e-4 with the 4-decimal printout; only classes that close may swap ranks
        assert mine[0][1] == pytest.approx(theirs[0][1], abs=2e-4)
        assert mine[0][0] == theirs[0][0] or abs(theirs[0][1] - theirs[1][1]) <= 2e-4


def test_the_example_refuses_a_file_it_cannot_use(tmp_path: Path) -> None:
    np.save(tmp_path / "one.npy", np.zeros((8, 8), dtype=np.uint8))
    (tmp_path / "model.onnx").write_bytes(b"not for this example")
    done = _run("mobile_inference.py", tmp_path, "model.onnx", "one.npy")
    lines = done.stderr.splitlines()
    assert done.returncode == 1 and len(lines) == 1, done.stderr  # one line, no traceback
    assert lines[0].startswith("mobile_inference.py: error: expected a ['.ort', '.pte', '.tflite'] file")
