"""The deployment table of issue #35: every `edge-sdk deploy` target of real federation models, run in its own
runtime on a whole test set, with file size, load time, single-image latency and the runtime's version.

For each ``--model NAME=FILE`` (a toolkit classifier: ``global.onnx``, a personalized ``personal.fp32.onnx``)
and each target this environment has (``edge_sdk.deploy.TARGETS``: onnx and ort in the core install,
executorch, executorch-train and coreml with ``[mobile]``, tflite with ``[tflite]``), in fp32 and, where the
target has it, ``--int8``:

* the artifact is written by :func:`edge_sdk.deploy.deploy` (the function behind `edge-sdk deploy`), with the
  device's own images as ``--calibration`` (they calibrate int8 and are the deploy's own check images);
* its top-1 on the test set is computed in the target's runtime, by the target's own runner (``Target.run``:
  onnxruntime for onnx and ort, the LiteRT interpreter, ExecuTorch's runtime bindings), one thread, and
  compared with the float32 ONNX in onnxruntime (accuracy, agreement, largest logit difference);
* its load time (the file read into a runnable session, median of ``--loads``) and single-image latency
  (median of ``--runs`` after ``--warmup``, one thread, test images in turn) are measured here;
* Core ML is converted only (it runs on Apple devices); executorch-train's forward is checked on
  ``--train-images`` test images (evenly spaced), not timed (each call runs a fixed batch of ``batch_size``
  images with its backward, in ExecuTorch's portable kernels: seconds per batch, no single-image latency).

The targets' packages cannot all share one environment (``[tflite]`` and ``[mobile]`` are separate extras):
run the same command once per environment, each run adds its targets' rows to one JSON per model under
``--out`` (``NAME.json``, rows keyed ``target precision``); ``--table`` prints the markdown table from them.

    OMP_NUM_THREADS=1 python benchmarks/deploy_table.py --dataset mnist --data-root /work/shared/datasets \
        --model mnist-global=fleet/server/global.onnx --model mnist-personal=personal/personal.fp32.onnx \
        --calibration fleet/data/client_00.npz --work /tmp/deploy-table     # in each environment
    python benchmarks/deploy_table.py --table                               # the markdown table
    ... --timing-only     # load time and latency only (the accuracy fields are kept); deploys what is missing
    ... --limit 500       # 500 test images, evenly spaced (a quick check: use another --out)

Timings are wall-clock on whatever machine runs this: each JSON records the CPU, the core count and
``--machine-note``.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from common.errors import ExportError
from edge_sdk import mobile_targets
from edge_sdk.data import load_client_data, load_dataset
from edge_sdk.deploy import TARGETS, DeployConfig, available_targets, deploy
from edge_sdk.train import to_float
from export.onnx_export import onnx_logits, onnx_session

OUT = Path(__file__).parent / "results" / "deploy_table"
INT8_BOUND, FP32_BOUND = 1.0, 0.1  # points of top-1 a target may differ from the float32 ONNX (issue #35)
Runner = mobile_targets.Runner


# ------------------------------------------------------------------------------------------ runtimes


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "absent"


RUNTIMES = {  # target -> (the runtime that runs it here, its distribution, the converter's distributions)
    "onnx": ("onnxruntime", "onnxruntime", ("onnx", "torch")),
    "ort": ("onnxruntime", "onnxruntime", ("onnxruntime",)),
    "tflite": ("LiteRT interpreter", "ai-edge-litert", ("litert-torch", "torch")),
    "executorch": ("ExecuTorch runtime (XNNPACK)", "executorch", ("executorch", "torch")),
    "executorch-train": ("ExecuTorch runtime (training)", "executorch", ("executorch", "torch")),
    "coreml": ("Core ML (Apple devices; not run here)", "coremltools", ("coremltools", "torch")),
}

# what the artifact computes in, where it is not what --int8 says: coremltools writes an ML program's weights
# and sets its compute precision to float16 unless told otherwise (the .mlpackage's weights are float16)
COMPUTES = {"coreml": "float16 (coremltools' default for an ML program)"}


def _one_thread() -> None:
    """Every runtime on one thread (onnxruntime's sessions here are built with one; ExecuTorch's XNNPACK
    thread pool is sized to the cores unless reset; LiteRT's interpreter takes num_threads)."""
    try:
        from executorch.extension.pybindings.portable_lib import _unsafe_reset_threadpool
    except ImportError:
        return
    _unsafe_reset_threadpool(1)


def _ort(path: Path) -> Runner:
    session = onnx_session(path.read_bytes(), threads=1)
    name = session.get_inputs()[0].name
    return lambda image: session.run(None, {name: image})[0]


LOADERS: dict[str, Callable[[Path], Runner]] = {
    "onnx": _ort,
    "ort": _ort,
    "tflite": mobile_targets.load_tflite,
    "executorch": mobile_targets.load_executorch,
}


# ------------------------------------------------------------------------------------------ measuring


def _timing(target: str, path: Path, images: np.ndarray, loads: int, warmup: int, runs: int) -> dict:
    """Load time (the file to a session ready to run, median of ``loads`` fresh loads), the first inference
    after a load (some runtimes finish preparing there) and single-image latency (median of ``runs`` after
    ``warmup``, test images in turn), in milliseconds."""
    load = LOADERS[target]
    load_ms, first_ms = [], []
    for _ in range(loads):
        start = time.perf_counter()
        run = load(path)
        loaded = time.perf_counter()
        run(images[:1])
        load_ms.append(1e3 * (loaded - start))
        first_ms.append(1e3 * (time.perf_counter() - loaded))
    for i in range(warmup):
        run(images[i % len(images)][None])
    latency = []
    for i in range(runs):
        image = images[i % len(images)][None]
        start = time.perf_counter()
        run(image)
        latency.append(1e3 * (time.perf_counter() - start))
    q = np.quantile(latency, [0.1, 0.9])
    return {
        "load_ms": round(statistics.median(load_ms), 3),
        "load_runs": loads,
        "first_inference_ms": round(statistics.median(first_ms), 3),
        "latency_ms": round(statistics.median(latency), 4),
        "latency_p10_ms": round(float(q[0]), 4),
        "latency_p90_ms": round(float(q[1]), 4),
        "latency_runs": runs,
        "latency_warmup": warmup,
        "threads": 1,
    }


def _accuracy(target: str, files: dict[str, bytes], x: np.ndarray, y: np.ndarray, ref: np.ndarray) -> dict:
    """Top-1 of the artifact in its runtime (the deploy module's runner), against the labels and the float32
    ONNX's logits ``ref``."""
    start = time.perf_counter()
    got = TARGETS[target].run(files, x)  # type: ignore[misc]
    return {
        "accuracy": round(float(np.mean(got.argmax(1) == y)), 6),
        "agreement": round(float(np.mean(got.argmax(1) == ref.argmax(1))), 6),
        "max_logit_diff": float(f"{float(np.max(np.abs(got - ref))):.3g}"),
        "test_seconds": round(time.perf_counter() - start, 2),
    }


def _artifact_files(out: Path, written: tuple[Path, ...]) -> dict[str, int]:
    """Each written path's size in bytes (a package directory: its files summed)."""
    sizes = {}
    for path in written:
        if path.is_dir():
            sizes[path.name] = sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
        else:
            sizes[path.name] = path.stat().st_size
    return sizes


def _deployed(src: Path, out: Path, target: str, int8: bool, calibration: np.ndarray) -> tuple[dict, float]:
    """Write the artifact with the deploy function as `edge-sdk deploy SRC --target T [--int8] --calibration
    C --out OUT` does; what it reported, and the seconds it took."""
    start = time.perf_counter()
    result = deploy(src, out, config=DeployConfig(target=target, int8=int8), calibration=calibration)  # type: ignore[arg-type]
    seconds = time.perf_counter() - start
    report = {
        "files": _artifact_files(out, result.files),
        "deploy_check_images": result.check_images,
        "deploy_check_agreement": result.top1_agreement,
        "deploy_check_max_logit_diff": result.max_logit_diff,
    }
    return report, seconds


def _spread(total: int, n: int | None) -> np.ndarray:
    """``n`` indices evenly spaced through ``total`` (all of them when ``n`` is None or larger): test sets
    read from image folders are ordered by class, so their first images are one class."""
    if n is None or n >= total:
        return np.arange(total)
    return np.linspace(0, total - 1, n).round().astype(np.int64)


def _row(
    src: Path, work: Path, target: str, int8: bool, row: dict, args: argparse.Namespace, data: dict
) -> dict:
    """One target and precision: deployed (unless ``--timing-only`` finds the artifact), run on the test
    images, timed; a deploy that refuses the model is recorded with its one-line reason."""
    x, y, ref = data["x"], data["y"], data["ref"]
    precision = "int8" if int8 else "fp32"
    out = work / f"{target}.{precision}{TARGETS[target].suffix}"  # two targets write .pte
    runtime, dist, converters = RUNTIMES[target]
    row |= {
        "target": target,
        "precision": precision,
        "computes": COMPUTES.get(target, "int8" if int8 else "float32"),
        "runtime": runtime,
        "runtime_version": _version(dist),
        "converters": {c: _version(c) for c in converters},
    }
    if not (args.timing_only and out.exists()):
        # executorch-train checks its forward in batches with the backward: seconds each, so fewer images
        calibration = data["calibration"][: args.train_images if target == "executorch-train" else None]
        try:
            report, seconds = _deployed(src, out, target, int8, calibration)
        except ExportError as err:  # the deploy's own refusal (e.g. int8's agreement rule): a result
            out.unlink(missing_ok=True)
            return row | {"refused": str(err), "size_bytes": None}
        if not args.timing_only:
            row |= report | {"deploy_seconds": round(seconds, 2)}
    row["size_bytes"] = _artifact_files(out, (out,))[out.name]
    if TARGETS[target].run is not None and not args.timing_only:
        n = args.train_images if target == "executorch-train" else len(x)
        pick = _spread(len(x), n)
        row |= _accuracy(target, {"": out.read_bytes()}, x[pick], y[pick], ref[pick])
        base = float(np.mean(ref[pick].argmax(1) == y[pick]))
        row |= {"test_images": len(pick), "onnx_fp32_accuracy_same_images": round(base, 6)}
        row["delta_points"] = round(100 * (row["accuracy"] - base), 4)
        row["bound_points"] = INT8_BOUND if int8 else FP32_BOUND
        row["within_bound"] = abs(row["delta_points"]) <= row["bound_points"] + 1e-9
    if target in LOADERS:
        row |= _timing(target, out, x, args.loads, args.warmup, args.runs)
        row["timed_on"] = args.machine_note
    return row


def measure_model(name: str, src: Path, args: argparse.Namespace, targets: list[str], data: dict) -> dict:
    """Deploy ``src`` to each target (fp32, and int8 where it applies) and measure each artifact; the rows
    merged into ``OUT/NAME.json`` (rows of other targets kept, so each environment adds its own)."""
    x, y, calibration = data["x"], data["y"], data["calibration"]
    record_path = args.out / f"{name}.json"
    record = json.loads(record_path.read_text()) if record_path.exists() else {"rows": {}}
    ref = onnx_logits(src.read_bytes(), x)
    onnx_accuracy = float(np.mean(ref.argmax(1) == y))
    if not args.timing_only:
        record.update(
            model=name,
            source=str(src),
            dataset=args.dataset,
            test_images=len(x),
            calibration=str(args.calibration),
            calibration_images=len(calibration),
            onnx_fp32_accuracy=round(onnx_accuracy, 6),
        )
    record["machine"] = {
        "cpu": _cpu_name(),
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "note": args.machine_note,
    }
    work = args.work / name
    work.mkdir(parents=True, exist_ok=True)
    print(f"{name}: float32 ONNX top-1 {onnx_accuracy:.4f} on {len(x)} test images", flush=True)
    done: list[str] = []
    for target in targets:
        for int8 in (False, True) if TARGETS[target].int8 else (False,):
            key = f"{target} {'int8' if int8 else 'fp32'}"
            old = record["rows"].get(key, {}) if args.timing_only else {}
            record["rows"][key] = row = _row(src, work, target, int8, old, args, data | {"ref": ref})
            done.append(key)
            print(f"  {key}: {_line(row)}", flush=True)
    # read again before writing: another environment's run may have added its rows meanwhile
    rows = json.loads(record_path.read_text())["rows"] if record_path.exists() else {}
    rows |= {key: record["rows"][key] for key in done}
    record["rows"] = dict(sorted(rows.items(), key=lambda kv: _order(kv[0])))
    args.out.mkdir(parents=True, exist_ok=True)
    record_path.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    return record


def _line(row: dict) -> str:
    if "refused" in row:
        return f"refused: {row['refused']}"
    parts = [f"{row['size_bytes']:,} B"]
    if "accuracy" in row:
        parts.append(f"top-1 {row['accuracy']:.4f} ({row['delta_points']:+.2f} points)")
        parts.append(f"agreement {row['agreement']:.4f}")
    if "latency_ms" in row:
        parts.append(f"load {row['load_ms']:.1f} ms, latency {row['latency_ms']:.3f} ms")
    if TARGETS[row["target"]].run is None:
        parts.append("converted only")
    return ", ".join(parts)


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


# ------------------------------------------------------------------------------------------ the table


def _order(key: str) -> tuple[int, int]:
    target, precision = key.split()
    return list(TARGETS).index(target), precision == "int8"


def _cell(row: dict, key: str, fmt: str) -> str:
    return format(row[key], fmt) if key in row else "n/a"


def table(out: Path) -> str:
    """The markdown table of every ``out/*.json``: one row per model, target and precision."""
    lines = [
        "| model | target | precision | file size (B) | load (ms) | latency, median (ms) | top-1 "
        "| vs ONNX fp32 (points) | agreement | runtime |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for path in sorted(out.glob("*.json")):
        record = json.loads(path.read_text())
        for row in sorted(record["rows"].values(), key=lambda r: _order(f"{r['target']} {r['precision']}")):
            converted = TARGETS[row["target"]].run is None
            precision = row["precision"] + (" (float16 weights)" if row["target"] in COMPUTES else "")
            top1 = "converted only" if converted else _cell(row, "accuracy", ".4f")
            if row.get("test_images", record["test_images"]) < record["test_images"]:
                top1 += f" ({row['test_images']:,} images)"
            delta = "" if converted else _cell(row, "delta_points", "+.2f")
            if "refused" in row:  # the deploy's own refusal, its reason in the JSON
                top1, delta = f"refused by deploy: {row['refused'].split(';')[0]}", ""
            size = "n/a" if row["size_bytes"] is None else f"{row['size_bytes']:,}"
            lines.append(
                f"| {record['model']} | {row['target']} | {precision} | {size} | "
                f"{_cell(row, 'load_ms', '.1f')} | {_cell(row, 'latency_ms', '.3f')} | {top1} | {delta} | "
                f"{'' if converted else _cell(row, 'agreement', '.4f')} | {row['runtime'].split(' (')[0]} "
                f"{row['runtime_version']} |"
            )
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------ main


def _model(text: str) -> tuple[str, Path]:
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"expected NAME=FILE, got {text!r}")
    return name, Path(path)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=_model, action="append", default=[], help="NAME=FILE, repeatable")
    p.add_argument("--dataset", help="the test set: a load_dataset name (mnist, cifar10, ...)")
    p.add_argument("--data-root", help="its root (torchvision layout, or holding cifar10-jpeg.tar.gz)")
    p.add_argument("--calibration", type=Path, help="a device's data (.npz): deploy's --calibration")
    p.add_argument("--targets", help="comma-separated; default: every target this environment has")
    p.add_argument("--work", type=Path, default=Path("/tmp/deploy-table"), help="where artifacts are written")
    p.add_argument("--out", type=Path, default=OUT, help="the JSON directory")
    p.add_argument("--limit", type=int, help="N test images only, evenly spaced through the test set")
    p.add_argument(
        "--train-images",
        type=int,
        default=1000,
        help="executorch-train: its forward is checked on the first N calibration images (the deploy's "
        "check) and N test images evenly spaced through the set (a batch-64 forward and backward in the "
        "portable kernels: seconds per batch)",
    )
    p.add_argument("--timing-only", action="store_true", help="load time and latency only")
    p.add_argument("--loads", type=int, default=10)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--runs", type=int, default=200)
    p.add_argument("--machine-note", default="", help="recorded with the timings (e.g. 'shared machine')")
    p.add_argument("--table", action="store_true", help="print the markdown table of --out and exit")
    args = p.parse_args(argv)
    if args.table:
        print(table(args.out))
        return
    if not args.model or not args.dataset or args.calibration is None:
        p.error("--model, --dataset and --calibration are required (or --table)")
    targets = args.targets.split(",") if args.targets else list(available_targets())
    unknown = sorted(set(targets) - set(TARGETS))
    if unknown:
        p.error(f"unknown targets {unknown}; known: {sorted(TARGETS)}")
    _one_thread()
    test = load_dataset(args.dataset, args.data_root, split="test")
    x, y = to_float(test.x).numpy(), test.y.numpy()
    pick = _spread(len(x), args.limit)
    x, y = x[pick], y[pick]
    calibration = load_client_data(args.calibration).x.float().div(255).numpy()
    data = {"x": x, "y": y, "calibration": calibration}
    print(f"targets here: {', '.join(targets)}", flush=True)
    for name, src in args.model:
        measure_model(name, src, args, targets, data)


if __name__ == "__main__":
    main()
