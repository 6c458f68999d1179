"""Throughput ratios measured in one process (issue benchmarks), median of interleaved timings.

    .venv/bin/python benchmarks/teacher_throughput.py BUNDLE [BUNDLE ...] [--threads 1] [--out FILE]

1. inversion step (forward + backward to the input, batch 64) with teachers loaded from bundles
   (`server_kit.teachers.loading.load_teacher`: rebuilt from arch + ONNX weights, and the generic converter)
   vs the same teachers as native torch modules;
2. the SDK training loop (`edge_sdk.train.train`) vs a plain PyTorch loop on the same model and
   preloaded tensors;
3. onnxruntime latency of an exported model vs torch eager (batch 1 and 64).
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from edge_sdk.data import ArrayDataset
from edge_sdk.models.arch import build_model
from edge_sdk.train import TrainConfig, train
from export.atomic import atomic_write_json
from export.bundle import read_bundle
from export.onnx_export import onnx_session
from export.weights import initializer_state_dict
from server_kit.teachers.loading import load_teacher
from server_kit.teachers.onnx_convert import convert_onnx


def interleaved(fns: dict[str, Callable[[], None]], repeats: int) -> dict[str, float]:
    """Median seconds per call, the candidates interleaved so machine noise hits all alike."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def inversion_step(module: torch.nn.Module, x0: torch.Tensor, target: torch.Tensor):
    def step() -> None:
        x = x0.clone().requires_grad_(True)
        loss = F.cross_entropy(module(x) / 4.0, target)
        loss.backward()

    return step


def measure(path: Path, *, threads: int, repeats: int, gen: torch.Generator) -> dict:
    """All three ratios for one bundle."""
    bundle = read_bundle(path)
    shape = tuple(bundle.input_shape)
    native = build_model(bundle.arch, shape, bundle.num_classes)
    native.load_state_dict(initializer_state_dict(bundle.model_onnx, native))
    native.eval().requires_grad_(False)
    loaded = load_teacher(bundle).module
    converted = convert_onnx(bundle.model_onnx).eval().requires_grad_(False)
    x0 = torch.rand(64, *shape, generator=gen)
    target = torch.softmax(torch.randn(64, bundle.num_classes, generator=gen), 1)
    inv = interleaved(
        {
            "native": inversion_step(native, x0, target),
            "loaded": inversion_step(loaded, x0, target),
            "converted": inversion_step(converted, x0, target),
        },
        repeats,
    )
    # training loop: SDK vs plain loop, one epoch over the same 1024 preloaded samples
    n = 1024
    data = ArrayDataset(
        torch.randint(0, 256, (n, *shape), generator=gen, dtype=torch.uint8),
        torch.randint(0, bundle.num_classes, (n,), generator=gen),
        bundle.num_classes,
    )
    model_a, model_b = (
        copy.deepcopy(native).requires_grad_(True),
        copy.deepcopy(native).requires_grad_(True),
    )
    xf = data.x.float() / 255

    def sdk_epoch() -> None:
        train(model_a, data, config=TrainConfig(epochs=1, batch_size=64), seed=0)

    opt = torch.optim.Adam(model_b.parameters(), lr=1e-3)

    def plain_epoch() -> None:
        model_b.train()
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(0))
        for i in range(0, n, 64):
            idx = perm[i : i + 64]
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(model_b(xf[idx]), data.y[idx]).backward()
            opt.step()

    loop = interleaved({"sdk": sdk_epoch, "plain": plain_epoch}, max(5, repeats // 4))
    # inference latency: onnxruntime vs torch eager
    session = onnx_session(bundle.model_onnx, threads=threads)
    lat = {}
    for batch in (1, 64):
        xb = torch.rand(batch, *shape, generator=gen)
        xn = xb.numpy()

        def ort_run(xn=xn) -> None:
            session.run(None, {"x": xn})

        def torch_run(xb=xb) -> None:
            with torch.inference_mode():
                native(xb)

        t = interleaved({"onnxruntime": ort_run, "torch": torch_run}, repeats * 2)
        lat[f"batch{batch}"] = {k: round(v * 1e3, 4) for k, v in t.items()} | {
            "ort_speedup": round(t["torch"] / t["onnxruntime"], 3)
        }
    row = {
        "bundle": path.name,
        "arch": bundle.arch,
        "inversion_step_ms": {k: round(v * 1e3, 3) for k, v in inv.items()},
        "loaded_speed_vs_native": round(inv["native"] / inv["loaded"], 3),
        "converted_speed_vs_native": round(inv["native"] / inv["converted"], 3),
        "train_epoch_s": {k: round(v, 4) for k, v in loop.items()},
        "sdk_loop_speed_vs_plain": round(loop["plain"] / loop["sdk"], 3),
        "latency_ms": lat,
        "threads": threads,
    }
    return row


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("bundles", nargs="+", type=Path)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    rows = []
    for path in args.bundles:
        row = measure(path, threads=args.threads, repeats=args.repeats, gen=gen)
        print(json.dumps(row, sort_keys=True), flush=True)
        rows.append(row)
    if args.out:
        atomic_write_json(args.out, {"rows": rows})


if __name__ == "__main__":
    main(sys.argv[1:])
