"""examples/onnx_inference.py on a digits model exported here: run in a fresh interpreter that cannot
import the toolkit, it prints the class names the metadata gives with the probabilities torch computes,
and never imports torch."""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from edge_sdk.data import deploy_metadata_for, load_dataset
from edge_sdk.final_training import train_final
from export.onnx_export import export_onnx

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "onnx_inference.py"
WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
FORBIDDEN = ("torch", "common", "export", "edge_sdk", "server_kit", "profiles")
# runpy in a fresh interpreter, then the toolkit's and torch's modules it loaded, as one JSON line
WRAPPER = """
import json, runpy, sys
forbidden = set(json.loads(sys.stdin.readline()))
script, args = sys.argv[1], sys.argv[2:]
sys.argv = [script, *args]
try:
    runpy.run_path(script, run_name="__main__")
except SystemExit as stop:
    code = stop.code
else:
    code = 0
loaded = sorted(m for m in sys.modules if m.split(".")[0] in forbidden)
print("LOADED " + json.dumps({"code": code, "modules": loaded}))
"""
LINE = re.compile(r"^(?P<label>\S+): (?P<top>.+)$")
ENTRY = re.compile(r"(?P<name>[^,()]+) \((?P<p>[0-9.]+)\)")


@pytest.fixture(scope="module")
def digits_model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module, np.ndarray]:
    """A small classifier trained on digits (class names spelt out), exported as deploy.onnx; six test
    images as uint8 pixels."""
    train = dataclasses.replace(load_dataset("digits", split="train"), class_names=WORDS)
    trained = train_final(
        "C8k3-P-F10", train, train.subset(np.arange(100)), epochs=3, seed=0, precision="fp32"
    )
    assert trained.class_names == WORDS  # the names travel from the data to the trained model
    meta = {"arch": trained.arch} | deploy_metadata_for(trained.input_shape, 10, trained.class_names)
    path = tmp_path_factory.mktemp("example") / "deploy.onnx"
    path.write_bytes(export_onnx(trained.module, trained.input_shape, metadata=meta, keep_batchnorm=False))
    test = load_dataset("digits", split="test")
    return path, trained.module, test.x[:6].numpy()


def _run(tmp_path: Path, *args: str) -> tuple[list[str], dict]:
    done = subprocess.run(
        [sys.executable, "-c", WRAPPER, str(EXAMPLE), *args],
        input=json.dumps(FORBIDDEN),
        capture_output=True,
        text=True,
        cwd=tmp_path,  # not the repository: the toolkit cannot be imported from here
        env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"},
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    status = json.loads(lines[-1].removeprefix("LOADED "))
    return lines[:-1], status


def _expected(module: torch.nn.Module, pixels: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return torch.softmax(module.eval()(torch.from_numpy(pixels).float() / 255), dim=1).numpy()


def test_the_example_labels_images_and_arrays_without_torch(tmp_path: Path, digits_model) -> None:
    model_path, module, pixels = digits_model
    pngs = []
    for i, image in enumerate(pixels[:3]):
        pngs.append(tmp_path / f"digit{i}.png")
        Image.fromarray(image[0], mode="L").save(pngs[-1])
    np.save(tmp_path / "batch.npy", pixels)
    lines, status = _run(
        tmp_path, str(model_path), *map(str, pngs), str(tmp_path / "batch.npy"), "--top-k", "2"
    )
    assert status == {"code": 0, "modules": []}, status  # ran to the end; no torch, no toolkit module

    assert lines[0].startswith("deploy.onnx: 10 classes; input 'x' [N, *[1, 8, 8]] float32 NCHW")
    rows = [LINE.match(line) for line in lines[1:]]
    assert [r["label"] for r in rows] == [  # type: ignore[index]
        *(p.name for p in pngs),
        *(f"batch.npy[{i}]" for i in range(6)),
    ]
    expected = _expected(module, np.concatenate([pixels[:3], pixels]))
    for row, probabilities in zip(rows, expected, strict=True):
        top = [(m["name"].strip(), float(m["p"])) for m in ENTRY.finditer(row["top"])]  # type: ignore[index]
        order = np.argsort(-probabilities, kind="stable")[:2]
        # onnxruntime and torch logits agree within the export's parity bound (1e-4), so probabilities agree
        # within 2e-4 relative: only classes that close may swap ranks between the two runtimes
        for (name, _), want in zip(top, order, strict=True):
            got = probabilities[WORDS.index(name)]
            assert name == WORDS[want] or abs(got - probabilities[want]) <= 2e-4 * probabilities[want]
        # printed to 4 decimals (5e-5) plus that runtime difference
        assert [p for _, p in top] == pytest.approx(probabilities[order], abs=2e-4)


def _refusal(tmp_path: Path, model: Path) -> str:
    """The example run as a user runs it on ``model`` and one array of pixels: its one stderr line."""
    np.save(tmp_path / "one.npy", np.zeros((8, 8), dtype=np.uint8))
    done = subprocess.run(
        [sys.executable, str(EXAMPLE), str(model), str(tmp_path / "one.npy")],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"},
        timeout=120,
    )
    assert done.returncode == 1 and done.stdout == ""
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("onnx_inference.py: error: "), done.stderr  # no traceback
    return lines[0]


def test_the_example_refuses_a_model_without_the_schema(tmp_path: Path, digits_model) -> None:
    _, module, _ = digits_model
    bare = tmp_path / "bare.onnx"
    bare.write_bytes(export_onnx(module, (1, 8, 8), keep_batchnorm=False))
    assert "expected deploy_schema '1'" in _refusal(tmp_path, bare)


def test_the_example_refuses_a_file_that_is_no_model(tmp_path: Path) -> None:
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"not a protobuf")
    assert "cannot load" in _refusal(tmp_path, bad)
