"""A toolkit classifier (``global.onnx``, a personalized model, a bundle's model) as a file a phone runtime
loads: one registry of targets, each a converter plus, where its runtime runs here, a parity check.

The input is held to the ONNX load contract (``export.onnx_check``) and must carry the deployment metadata
(``export.metadata``: class names, input spec) before anything is converted or written: a deployed model
nobody can label is useless, and a hostile file is refused in one line. Every artifact keeps that
metadata in the form its runtime reads (ONNX and ORT: ``metadata_props``, which onnxruntime's ORT
format keeps and ``InferenceSession.get_modelmeta().custom_metadata_map`` returns), and is run against
the float32 ONNX on check images before it is written (atomically, every file or none).

The torch-based targets (ExecuTorch, LiteRT, Core ML) start from a torch module: rebuilt from the
model's ``arch`` metadata and its ONNX weights, as the server rebuilds teachers. Their packages are
optional (the ``[mobile]`` extra); a target whose package is absent, or that cannot be installed beside
the toolkit's torch, is refused in one line saying which and why.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import io
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np

from common.checks import check_int
from common.errors import ConfigError, ExportError
from edge_sdk import mobile_targets, mobile_training
from edge_sdk.personalize import PersonalizeConfig
from export.atomic import atomic_write_bytes
from export.bundle import read_bundle
from export.metadata import DEPLOY_KEYS, DeployMetadata, check_metadata_props, read_deploy_metadata
from export.onnx_check import check_classifier_onnx
from export.onnx_export import onnx_logits
from export.onnx_parse import DEFAULT_LIMITS, parse_onnx
from export.quantize import quantize_int8

__all__ = [
    "TARGETS",
    "DeployConfig",
    "DeployResult",
    "Target",
    "available_targets",
    "deploy",
    "load_deployable",
]

logger = logging.getLogger("edge_sdk")

TargetName = Literal["onnx", "ort", "tflite", "executorch", "executorch-train", "coreml"]
_CHECK_IMAGES = 64  # seeded images in the input range when no calibration images are given
# fp32 artifacts compute the same graph in another runtime or after graph fusions: float32 rounding
# differences, relative to the logits' scale; far below any gap that changes a prediction
_FP32_RTOL = 1e-4
_MAX_TRAIN_BATCH = 1024  # the training program plans memory for a whole batch: a phone's, not a server's


@dataclass(frozen=True)
class Source:
    """The validated input: its bytes (fp32), what will be converted (fp32 or int8) and its metadata."""

    name: str
    fp32: bytes
    model: bytes
    metadata: DeployMetadata
    props: dict[str, str]
    train_batch_size: int = PersonalizeConfig.batch_size  # executorch-train: its program's batch


Files = dict[str, bytes]  # output suffix ("" = the --out file itself) -> bytes


@dataclass(frozen=True)
class Target:
    """One runtime: how to convert, which module it needs (None: the core install), whether ``--int8``
    applies, and how to run the artifact here (None where its runtime runs only on the phone)."""

    name: str
    suffix: str
    convert: Callable[[Source], Files]
    run: Callable[[Files, np.ndarray], np.ndarray] | None
    module: str | None = None
    extra: str = "mobile"  # the pyproject extra that installs ``module``
    int8: bool = False
    needs: str = ""  # what the phone needs to run it, for the result


@dataclass(frozen=True, kw_only=True)
class DeployConfig:
    """Knobs of :func:`deploy`."""

    # onnx, ort (ONNX Runtime Mobile), tflite, executorch, executorch-train (an ExecuTorch training
    # program: the phone fine-tunes the model on its own images) or coreml
    target: TargetName = "onnx"
    int8: bool = False  # quantize to int8 (static, calibrated on --calibration images; onnx and ort only)
    calibration_size: int = 256  # images of the calibration data that calibrate the int8 quantization
    train_batch_size: int = PersonalizeConfig.batch_size  # executorch-train: images per training step

    def __post_init__(self) -> None:
        if self.target not in TARGETS:
            raise ConfigError(f"target must be one of {sorted(TARGETS)}, got {self.target!r}")
        if self.int8 and not TARGETS[self.target].int8:
            allowed = sorted(n for n, t in TARGETS.items() if t.int8)
            raise ConfigError(
                f"--int8 applies to the targets {allowed}, got target {self.target!r}; fix: drop --int8 "
                "or deploy to one of them"
            )
        if isinstance(self.calibration_size, bool) or not isinstance(self.calibration_size, int):
            raise ConfigError(f"calibration_size must be an int >= 1, got {self.calibration_size!r}")
        if self.calibration_size < 1:
            raise ConfigError(f"calibration_size must be >= 1, got {self.calibration_size}")
        check_int("train_batch_size", self.train_batch_size, 1, _MAX_TRAIN_BATCH)
        if self.train_batch_size != PersonalizeConfig.batch_size and self.target != "executorch-train":
            raise ConfigError(
                f"--train-batch-size applies to the target executorch-train, got target {self.target!r}; "
                "fix: drop --train-batch-size or deploy to executorch-train"
            )


@dataclass(frozen=True)
class DeployResult:
    """What :func:`deploy` wrote and how the artifact compared with the float32 ONNX on the check images."""

    target: str
    files: tuple[Path, ...]
    int8: bool
    class_names: tuple[str, ...]
    input_shape: tuple[int, int, int]
    check_images: int
    top1_agreement: float | None  # None: the runtime does not run here (conversion only)
    max_logit_diff: float | None
    needs: str = ""


def load_deployable(model: str | Path | bytes, *, source: str | None = None) -> Source:
    """The model's bytes once they passed the ONNX contract as a classifier with deployment metadata;
    an ExportError naming the file otherwise (nothing of it is run or converted before)."""
    name = source or ("<bytes>" if isinstance(model, bytes | bytearray) else str(model))
    data = _read_bounded(model, name)
    proto = parse_onnx(data, source=name, error=ExportError)
    entries = ((entry.key, entry.value) for entry in proto.metadata_props)
    props = check_metadata_props(entries, source=name, error=ExportError)
    meta = read_deploy_metadata(props, source=name, error=ExportError)
    if meta is None:
        raise ExportError(
            f"{name}: no deployment metadata (class_names, input_spec), expected a classifier the toolkit "
            "wrote; fix: deploy global.onnx, a personalized deploy.onnx or a bundle's model "
            "(`edge-sdk inspect --extract-onnx`)"
        )
    check_classifier_onnx(
        proto,
        input_shape=meta.input_spec.shape,
        num_classes=len(meta.class_names),
        source=name,
        error=ExportError,
    )
    return Source(name=name, fp32=data, model=data, metadata=meta, props=props)


def deploy(
    model: str | Path | bytes,
    out: str | Path,
    *,
    config: DeployConfig,
    calibration: np.ndarray | None = None,
) -> DeployResult:
    """Convert ``model`` for ``config.target`` and write it to ``out`` (plus the target's side files
    beside it, named after ``out``).

    ``calibration``: float32 pixels in the model's input range, N x C x H x W, the device's own images:
    required by ``int8`` (they set the activation ranges) and, when given, the images the artifact is
    checked on (else seeded uniform images in the input range).
    """
    target = TARGETS[config.target]
    if config.int8 and calibration is None:
        raise ConfigError("--int8 needs calibration images; fix: pass --calibration with this device's data")
    _require(target)
    src = load_deployable(model)
    shape = src.metadata.input_spec.shape
    if calibration is not None:
        calibration = _check_calibration(calibration, shape)
    src = dataclasses.replace(src, train_batch_size=config.train_batch_size)
    if config.int8:
        # every given image checks the agreement; the first calibration_size also set the ranges
        int8 = quantize_int8(src.fp32, calibration[: config.calibration_size], check=calibration)
        src = dataclasses.replace(src, model=int8)
    files = target.convert(src)
    images = calibration if calibration is not None else _check_images(src)
    agreement, diff = _compare(target, src, files, images, exact=not config.int8)
    written = _write(Path(out), files)
    return DeployResult(
        target=target.name,
        files=written,
        int8=config.int8,
        class_names=src.metadata.class_names,
        input_shape=shape,
        check_images=len(images),
        top1_agreement=agreement,
        max_logit_diff=diff,
        needs=target.needs,
    )


# ------------------------------------------------------------------------------------------ the steps


def _read_bounded(model: str | Path | bytes, name: str) -> bytes:
    """The ONNX bytes: the file's, size-checked first, or a client bundle's classifier (read and checked
    by the bundle reader)."""
    limit = DEFAULT_LIMITS.max_model_bytes
    if isinstance(model, bytes | bytearray):
        return bytes(model)
    path = Path(model)
    if path.suffix == ".bundle":
        bundle = read_bundle(path)
        if bundle.kind != "classifier":
            raise ExportError(
                f"{name} is a {bundle.kind} bundle, expected a classifier; fix: deploy a classifier bundle"
            )
        return bundle.model_onnx
    try:
        size = path.stat().st_size
        if size > limit:
            raise ExportError(
                f"{name} is {size} bytes, an ONNX classifier is at most {limit}; fix: pass the model file"
            )
        return path.read_bytes()
    except OSError as err:
        raise ExportError(f"cannot read the model {name}: {err}; fix: pass an ONNX file") from err


def _check_calibration(x: np.ndarray, shape: tuple[int, int, int]) -> np.ndarray:
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim != 4 or len(x) < 1 or tuple(x.shape[1:]) != tuple(shape):
        raise ConfigError(
            f"calibration images must be N x {' x '.join(map(str, shape))} (the model's input), got "
            f"{' x '.join(map(str, x.shape))}; fix: pass this task's data"
        )
    return x


def _check_images(src: Source) -> np.ndarray:
    low, high = src.metadata.input_spec.input_range
    rng = np.random.default_rng(0)
    x = rng.random((_CHECK_IMAGES, *src.metadata.input_spec.shape), dtype=np.float32)
    return (low + (high - low) * x).astype(np.float32)


def _missing(target: Target) -> ImportError | None:
    """Why the target's module cannot be imported here, or None when it can (or needs none)."""
    if target.module is None:
        return None
    try:
        importlib.import_module(target.module)
    except ImportError as err:
        return err
    return None


def available_targets() -> tuple[str, ...]:
    """The targets whose packages this install has, in ``TARGETS`` order."""
    return tuple(name for name, target in TARGETS.items() if _missing(target) is None)


def _require(target: Target) -> None:
    """The target's module, imported now so a missing package is one line before any work."""
    err = _missing(target)
    if err is not None:
        raise ExportError(
            f"target {target.name} needs the package {target.module.split('.')[0]!r}, which this install "
            f"does not have ({type(err).__name__}); fix: pip install 'oneshot-fl-edge[{target.extra}]'"
        ) from err


def _write(out: Path, files: Files) -> tuple[Path, ...]:
    """Each file atomically; a package (keys ``/relative/path``, Core ML's ``.mlpackage`` directory) is
    built in a sibling directory and renamed over ``out``, so a reader sees the old package or the new."""
    if not any(key.startswith("/") for key in files):
        return tuple(
            atomic_write_bytes(out if not suffix else out.with_name(out.stem + suffix), data)
            for suffix, data in sorted(files.items())
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    build = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp"))
    old = build.with_suffix(".old")
    try:
        for key, data in files.items():
            path = build / key.lstrip("/")
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
        if out.exists():
            os.replace(out, old)
        os.replace(build, out)
    finally:
        shutil.rmtree(build, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)
    return (out,)


def _compare(
    target: Target, src: Source, files: Files, images: np.ndarray, *, exact: bool
) -> tuple[float | None, float | None]:
    """Top-1 agreement and the largest logit difference of the artifact against the float32 ONNX; an
    fp32 artifact whose logits differ beyond float32 rounding is refused (int8 ones are measured, the
    accuracy bound is the caller's: its own test data)."""
    if target.run is None:
        return None, None
    want = onnx_logits(src.fp32, images)
    got = target.run(files, images)
    if got.shape != want.shape:
        raise ExportError(
            f"the {target.name} artifact returned logits {list(got.shape)}, the ONNX {list(want.shape)}; "
            "fix: report this model and target"
        )
    diff = float(np.max(np.abs(got - want)))
    agreement = float(np.mean(got.argmax(1) == want.argmax(1)))
    scale = max(1.0, float(np.max(np.abs(want))))
    if exact and diff > _FP32_RTOL * scale:
        raise ExportError(
            f"the {target.name} artifact's logits differ from the float32 ONNX by {diff:.3g} (scale "
            f"{scale:.3g}), expected float32 rounding only; fix: report this model and target"
        )
    return agreement, diff


# ------------------------------------------------------------------------------------------ onnx, ort


def _onnx_files(src: Source) -> Files:
    return {"": src.model}


def _run_onnx(files: Files, images: np.ndarray) -> np.ndarray:
    return onnx_logits(files[""], images)


def _ort_files(src: Source) -> Files:
    """onnxruntime's own converter (fixed optimizations, no NCHWc layout: it runs on ARM too); the ORT
    file plus the operator list a reduced ONNX Runtime Mobile build is compiled for."""
    from onnxruntime.tools.convert_onnx_models_to_ort import OptimizationStyle, convert_onnx_models_to_ort

    with tempfile.TemporaryDirectory(prefix="deploy-ort-") as tmp:
        onnx_path, out_dir = Path(tmp, "model.onnx"), Path(tmp, "out")
        onnx_path.write_bytes(src.model)
        quiet = logging.getLogger("ort_format_model.utils")  # its tools log at DEBUG
        level = quiet.level
        quiet.setLevel(logging.WARNING)
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                convert_onnx_models_to_ort(
                    onnx_path, output_dir=out_dir, optimization_styles=[OptimizationStyle.Fixed]
                )
        except Exception as err:  # onnxruntime raises its own pybind types
            raise ExportError(
                f"{src.name}: onnxruntime cannot convert the model to ORT format: {err}"
            ) from err
        finally:
            quiet.setLevel(level)
        ort = Path(out_dir, "model.ort").read_bytes()
        config = Path(out_dir, "model.required_operators.config").read_text(encoding="utf-8")
    # the converter names its temporary input in the header; the operator lines are what a build reads
    lines = [line for line in config.splitlines() if not line.startswith("#")]
    header = "# operators a reduced ONNX Runtime Mobile build needs for this model (--include_ops_by_config)"
    files = {"": ort, ".required_operators.config": "\n".join([header, *lines]).encode() + b"\n"}
    _check_kept_metadata(src.props, _ort_metadata(ort), "ORT")
    return files


def _ort_metadata(ort: bytes) -> dict[str, str]:
    import onnxruntime

    session = onnxruntime.InferenceSession(ort, providers=["CPUExecutionProvider"])
    return dict(session.get_modelmeta().custom_metadata_map)


def _check_kept_metadata(want: dict[str, str], got: dict[str, str], what: str) -> None:
    lost = sorted(key for key, value in want.items() if got.get(key) != value)
    if lost:
        raise ExportError(
            f"the {what} conversion dropped or changed the metadata {lost}, expected every entry kept; fix: "
            "check the installed onnxruntime"
        )


def _run_ort(files: Files, images: np.ndarray) -> np.ndarray:
    return onnx_logits(files[""], images)


# ------------------------------------------------------------------------------------------ torch-based


def _rebuilt(src: Source):  # -> nn.Module
    meta = src.metadata
    return mobile_targets.rebuild(src.fp32, src.props, meta.input_spec.shape, len(meta.class_names))


def _executorch(src: Source) -> Files:
    program = mobile_targets.executorch_files(_rebuilt(src), src.metadata.input_spec.shape, src.props)
    _check_kept_metadata(
        {k: src.props[k] for k in DEPLOY_KEYS}, mobile_targets.executorch_metadata(program), "ExecuTorch"
    )
    return {"": program}


def _executorch_train(src: Source) -> Files:
    """The training program; its forward is checked as the inference targets are (logits against the
    float32 ONNX), its training steps by tests/edge_sdk/test_deploy.py and benchmarks/deploy_parity.py."""
    meta = src.metadata
    settings = mobile_training.training_settings(
        lr=PersonalizeConfig.lr, momentum=PersonalizeConfig.momentum, batch_size=src.train_batch_size
    )
    program = mobile_training.training_program(
        _rebuilt(src), meta.input_spec.shape, src.props, num_classes=len(meta.class_names), settings=settings
    )
    return {"": program}


def _tflite(src: Source) -> Files:
    return mobile_targets.tflite_files(_rebuilt(src), src.metadata.input_spec.shape, src.props)


def _coreml(src: Source) -> Files:
    return mobile_targets.coreml_files(_rebuilt(src), src.metadata.input_spec.shape, src.props)


TARGETS: dict[str, Target] = {
    "onnx": Target("onnx", ".onnx", _onnx_files, _run_onnx, int8=True, needs="onnxruntime (full or mobile)"),
    "ort": Target(
        "ort", ".ort", _ort_files, _run_ort, int8=True, needs="onnxruntime-mobile (or a reduced build)"
    ),
    "executorch": Target(
        "executorch",
        ".pte",
        _executorch,
        lambda files, images: mobile_targets.run_executorch(files[""], images),
        module="executorch",
        needs="the ExecuTorch runtime with the XNNPACK backend",
    ),
    "executorch-train": Target(
        "executorch-train",
        ".pte",
        _executorch_train,
        lambda files, images: mobile_training.run_training_logits(files[""], images),
        module="executorch.extension.training",
        needs="the ExecuTorch runtime with its training extension (TrainingModule, SGD)",
    ),
    "tflite": Target(
        "tflite",
        ".tflite",
        _tflite,
        lambda files, images: mobile_targets.run_tflite(files[""], images),
        module="litert_torch",
        extra="tflite",
        needs="the LiteRT (TensorFlow Lite) runtime; class names and input spec in the .json beside it",
    ),
    "coreml": Target(
        "coreml",
        ".mlpackage",
        _coreml,
        None,
        module="coremltools",
        needs="iOS 16 / macOS 13 or later (Core ML); converted here, runs on Apple devices only",
    ),
}
