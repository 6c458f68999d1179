"""Bundles -> frozen, differentiable teachers for model inversion and distillation.

The server needs gradients w.r.t. the input and BatchNorm running statistics, which onnxruntime cannot
give. A bundle written by our SDK is rebuilt from its architecture string and loaded with the ONNX
initializers by name (exact, and as fast as native torch; BN-preserving exports name every initializer
after its state_dict key). A bundle whose arch is unknown or does not match its weights (a classifier
exported elsewhere) goes through the generic converter in :mod:`server_kit.teachers.onnx_convert`. Either way
the
module is trusted only after a parity check against onnxruntime on seeded inputs, then frozen: eval()
(BN must use its running statistics) and ``requires_grad_(False)``. Before any of that, the ONNX must pass
:func:`export.onnx_check.check_classifier_onnx` against the manifest (input ``[batch, *input_shape]``, output
``[batch, num_classes]``, one more column for a bundle with an "unknown" output): nothing of a file that
fails it is rebuilt, converted or run. A teacher with an unknown output (FedOV) is wrapped in
:class:`server_kit.teachers.abstain.Abstaining`, so it gives ``num_classes`` logits like every other teacher.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor, nn

from common.errors import BundleError, ConfigError, ExportError, SpecError, TeacherError
from edge_sdk.models.arch import build_model
from export.bundle import KINDS, Bundle, bundle_from_bytes, read_bundle
from export.onnx_check import check_classifier_onnx
from export.onnx_export import onnx_session, read_deploy
from export.weights import initializer_state_dict
from server_kit.teachers.abstain import Abstaining
from server_kit.teachers.onnx_convert import convert_onnx

__all__ = [
    "Teacher",
    "Uploads",
    "batch_statistics_gap",
    "batchnorm_layers",
    "classifier_weight",
    "declared_class_names",
    "load_teacher",
    "load_teachers",
    "read_uploads",
    "rebuild_teacher",
    "teachers_from_bundles",
]


def declared_class_names(bundles: Sequence[Bundle]) -> tuple[str, ...] | None:
    """The task's class names the classifier bundles declare in their ONNX metadata, when every bundle
    that declares some (older exports have none) declares the same; None otherwise, and the models made
    from them are labelled with index names. A FedOV bundle's extra "unknown" name is not the task's."""
    declared = set()
    for bundle in bundles:
        if bundle.kind != "classifier":
            continue
        meta = read_deploy(bundle.model_onnx, num_logits=bundle.num_outputs, error=TeacherError)
        if meta is not None:
            declared.add(meta.class_names[: bundle.num_classes])
    return declared.pop() if len(declared) == 1 else None


PARITY_BATCH = 4
PARITY_SEED = 0


@dataclass(frozen=True, eq=False)
class Teacher:
    """A loaded teacher. ``module`` is float32, in eval mode, frozen, on the requested device, its
    convolution weights channels-last.

    ``method`` says how it was built: ``"rebuilt"`` (arch string + initializers) or ``"converted"``
    (generic ONNX converter, used when the arch cannot be rebuilt or does not reproduce the ONNX).
    """

    path: Path | None
    bundle: Bundle
    module: nn.Module
    method: str = "rebuilt"

    @property
    def name(self) -> str:
        return self.path.stem if self.path is not None else self.bundle.arch


def rebuild_teacher(bundle: Bundle) -> nn.Module:
    """``build_model(arch)`` + the ONNX initializers loaded by name, strictly (only ``num_batches_tracked``
    may be absent). Raises TeacherError when the arch is unknown or its state_dict does not match."""
    try:
        module = build_model(bundle.arch, bundle.input_shape, bundle.num_outputs)
    except SpecError as err:
        raise TeacherError(f"cannot rebuild arch {bundle.arch!r}: {err}") from err
    try:
        state = initializer_state_dict(bundle.model_onnx, module)
        module.load_state_dict(state, strict=True)
    except (BundleError, RuntimeError) as err:
        raise TeacherError(f"the ONNX weights do not fit arch {bundle.arch!r}: {err}") from err
    return module.eval()


def load_teacher(
    bundle: Bundle,
    *,
    path: str | Path | None = None,
    device: str | torch.device = "cpu",
    parity_atol: float = 1e-4,
    check_parity: bool = True,
) -> Teacher:
    """Check the bundle's ONNX against its manifest, rebuild (or, failing that, convert) the classifier and
    check it against onnxruntime.

    The converter is tried when the rebuild raises or fails parity, so a wrong arch string never yields a
    wrong teacher. Raises TeacherError naming the file with every attempt's reason.
    """
    path = Path(path) if path is not None else None
    source = str(path) if path is not None else f"bundle (arch {bundle.arch!r})"
    if bundle.kind != "classifier":
        raise TeacherError(f"{source}: kind {bundle.kind!r} is not a classifier teacher")
    if not parity_atol > 0:
        raise ConfigError(f"parity_atol must be > 0, got {parity_atol!r}")
    check_classifier_onnx(
        bundle.model_onnx,
        input_shape=bundle.input_shape,
        num_classes=bundle.num_outputs,
        source=source,
        error=TeacherError,
    )
    builders: list[tuple[str, Callable[[], nn.Module]]] = [
        ("rebuilt", lambda: rebuild_teacher(bundle)),
        ("converted", lambda: convert_onnx(bundle.model_onnx)),
    ]
    reasons = []
    for method, build in builders:
        try:
            # parity on the CPU in exact float32, then to the device: a GPU's TF32 convolutions (cuDNN's
            # default) differ from onnxruntime by ~1e-3, which would refuse every honest teacher there
            module = build().float().eval().requires_grad_(False)
            if check_parity:
                _check_parity(module, bundle, parity_atol)
            module = module.to(device)
        except TeacherError as err:
            reasons.append(f"{method}: {err}")
            continue
        # channels-last conv weights: oneDNN then runs every conv of the teacher in that layout, faster on
        # CPU for inversion and the vote (benchmarks/RESULTS.md, "Speed and memory"); same values
        module = module.to(memory_format=torch.channels_last)
        if bundle.unknown_output:
            module = Abstaining(module, bundle.num_classes).eval().requires_grad_(False)
        return Teacher(path, bundle, module, method)
    raise TeacherError(
        f"{source}: cannot load the teacher ({'; '.join(reasons)}); fix: export the classifier with "
        "export_onnx(keep_batchnorm=True) and its arch string, or use only the supported ONNX operators"
    )


def _check_parity(module: nn.Module, bundle: Bundle, atol: float) -> float:
    """Max abs logit difference of the CPU ``module`` vs onnxruntime on seeded inputs in [0, 1];
    TeacherError above ``atol``."""
    try:
        session = onnx_session(bundle.model_onnx)
    except ExportError as err:
        raise TeacherError(str(err)) from err
    info = session.get_inputs()[0]
    batch = info.shape[0] if isinstance(info.shape[0], int) and info.shape[0] > 0 else PARITY_BATCH
    generator = torch.Generator().manual_seed(PARITY_SEED)
    x = torch.rand((batch, *bundle.input_shape), generator=generator)
    try:
        expected = session.run(None, {info.name: x.numpy()})[0]
    except Exception as err:  # onnxruntime raises its own pybind exception types
        raise TeacherError(f"onnxruntime failed on a batch shaped {tuple(x.shape)}: {err}") from err
    try:
        with torch.no_grad():
            got = module(x).float().numpy()
    except RuntimeError as err:
        raise TeacherError(f"the torch module failed on a batch shaped {tuple(x.shape)}: {err}") from err
    if got.shape != expected.shape:
        raise TeacherError(f"output shape {got.shape} differs from onnxruntime's {expected.shape}")
    diff = float(np.max(np.abs(got.astype(np.float64) - expected))) if got.size else 0.0
    if not diff <= atol:  # also catches NaN
        raise TeacherError(
            f"parity with onnxruntime failed: max abs diff {diff:.3g} > {atol:g} on {batch} seeded inputs"
        )
    return diff


# What the server reads uploads from: bundle files, or bundles that arrived as bytes (a Flower reply), each
# under a name that stands in for its file name in every message and report (``client_00.bundle``)
Uploads = Sequence[str | Path] | Mapping[str, bytes]


def read_uploads(
    uploads: Uploads, *, on_error: str = "stop", skipped: list[tuple[str, str]] | None = None
) -> list[tuple[Path, Bundle]]:
    """Every upload decoded once, in order, as (name, Bundle): a path with :func:`export.bundle.read_bundle`,
    a name -> bytes entry with :func:`export.bundle.bundle_from_bytes`, which is what ``read_bundle`` runs
    on the file's bytes (size bound before any parsing, bounded msgpack, hash, every field), so bytes from
    a device are held to exactly the checks of a bundle file.

    ``on_error="stop"`` raises the first BundleError (it names the upload); ``"skip"`` appends (name,
    reason) to ``skipped`` and goes on.
    """
    _check_on_error(on_error)
    if isinstance(uploads, str | Path):
        uploads = [uploads]
    if isinstance(uploads, Mapping):
        items: list[tuple[Path, bytes | None]] = []
        for name, data in uploads.items():
            if not isinstance(name, str) or not name:
                raise ConfigError(f"an upload's name must be a non-empty str, got {name!r}")
            items.append((Path(name), data))
    else:
        items = [(Path(path), None) for path in uploads]
    if not items:
        raise ConfigError("uploads must hold at least one bundle (paths, or name -> bytes), got none")
    out = []
    for path, data in items:
        try:
            bundle = read_bundle(path) if data is None else bundle_from_bytes(data, source=str(path))
        except BundleError as err:
            if on_error == "stop":
                raise
            if skipped is not None:
                skipped.append((str(path), str(err)))
            continue
        out.append((path, bundle))
    return out


def load_teachers(
    uploads: Uploads,
    *,
    on_error: str = "stop",
    device: str | torch.device = "cpu",
    kinds: Sequence[str] = ("classifier",),
) -> tuple[list[Teacher], list[tuple[str, str]]]:
    """Load every bundle in ``uploads`` (paths, or name -> bytes) as a teacher; returns (teachers, skipped
    as (name, reason)). :func:`read_uploads`, then :func:`teachers_from_bundles`."""
    _check_on_error(on_error)
    skipped: list[tuple[str, str]] = []
    bundles = read_uploads(uploads, on_error=on_error, skipped=skipped)
    count = len(uploads) if not isinstance(uploads, str | Path) else 1
    return teachers_from_bundles(
        bundles, on_error=on_error, device=device, kinds=kinds, skipped=skipped, count=count
    ), skipped


def teachers_from_bundles(
    bundles: Sequence[tuple[Path, Bundle]],
    *,
    on_error: str = "stop",
    device: str | torch.device = "cpu",
    kinds: Sequence[str] = ("classifier",),
    skipped: list[tuple[str, str]],
    count: int | None = None,
) -> list[Teacher]:
    """The teachers of bundles already read (:func:`read_uploads`); refusals go to ``skipped``.

    ``on_error="stop"`` raises the first TeacherError (each names its file); ``"skip"`` records it in
    ``skipped`` and goes on. Bundles whose kind is not in ``kinds`` are always skipped with a reason. All
    teachers must agree on num_classes and input_shape: the most common pair wins (ties: the earliest file)
    and each disagreeing file is an error. Raises TeacherError when no teacher is left (``count``: how many
    uploads there were, for that message).
    """
    _check_on_error(on_error)
    bad_kinds = sorted(set(kinds) - set(KINDS))
    if bad_kinds:
        raise ConfigError(f"kinds must be drawn from {list(KINDS)}, got {bad_kinds}")

    def fail(path: str | Path, err: BundleError | TeacherError) -> None:
        if on_error == "stop":
            raise err
        skipped.append((str(path), str(err)))

    kept: list[tuple[Path, Bundle]] = []
    for path, bundle in bundles:
        if bundle.kind not in kinds:
            reason = f"kind {bundle.kind!r} is not a classifier teacher (teacher kinds: {list(kinds)})"
            skipped.append((str(path), reason))
            continue
        kept.append((path, bundle))

    # agreement first: it is cheap, and conversion plus parity is not
    shapes = Counter((b.num_classes, b.input_shape) for _, b in kept)
    if shapes:
        reference = max(shapes, key=lambda key: shapes[key])  # first maximal key = earliest file on ties
        ref_path = next(p for p, b in kept if (b.num_classes, b.input_shape) == reference)
        agreeing = []
        for path, bundle in kept:
            if (bundle.num_classes, bundle.input_shape) == reference:
                agreeing.append((path, bundle))
                continue
            fail(
                path,
                TeacherError(
                    f"{path}: num_classes {bundle.num_classes} and input_shape {bundle.input_shape} disagree "
                    f"with {ref_path} (num_classes {reference[0]}, input_shape {reference[1]}); fix: pass "
                    "only bundles trained for the same task"
                ),
            )
        kept = agreeing

    teachers = []
    for path, bundle in kept:
        try:
            teachers.append(load_teacher(bundle, path=path, device=device))
        except TeacherError as err:
            fail(path, err)
    if not teachers:
        reasons = "; ".join(f"{p}: {r}" for p, r in skipped)
        total = len(bundles) if count is None else count
        raise TeacherError(f"no teacher could be loaded from {total} bundle(s): {reasons}")
    return teachers


def _check_on_error(on_error: str) -> None:
    if on_error not in ("stop", "skip"):
        raise ConfigError(f"on_error must be 'stop' or 'skip', got {on_error!r}")


def classifier_weight(module: nn.Module) -> torch.Tensor:
    """The L x d weight of the final linear layer (``module.head`` if it is one, else the last nn.Linear;
    converted graphs turn Gemm / MatMul with constant weights into nn.Linear). Detached; an
    :class:`Abstaining` teacher's "unknown" row is left out."""
    if isinstance(module, Abstaining):
        return classifier_weight(module.inner)[: module.num_classes]
    try:
        head = module.head
    except (AttributeError, TeacherError):
        head = None
    if not isinstance(head, nn.Linear):
        linears = [m for m in module.modules() if isinstance(m, nn.Linear)]
        head = linears[-1] if linears else None
    if head is None:
        raise TeacherError(
            f"{type(module).__name__} has no final nn.Linear (expected .head or a Linear/Gemm layer); "
            "fix: end the classifier with a fully connected layer"
        )
    return head.weight.detach()


def batchnorm_layers(module: nn.Module) -> list[nn.BatchNorm2d]:
    """Every BatchNorm2d (in module order): their running stats drive DeepInversion-style losses."""
    return [m for m in module.modules() if isinstance(m, nn.BatchNorm2d)]


class _BatchStatistics(torch.autograd.Function):
    """Per-channel mean and biased variance of an N x C x H x W tensor, in float32, differentiable.

    Autograd through ``x.mean`` and ``x.var`` costs about ten passes over the tensor (and ``var`` over
    dims (0, 2, 3) of a channels-last tensor has no fast kernel): more than the teacher's convolutions on a
    wide layer (benchmarks/RESULTS.md, "Speed and memory, second pass"). Forward here is torch's batch-norm
    statistics kernel (one pass), backward one fused pass: d mean / dx = 1 / n, d var / dx = 2 (x - mean) / n.
    """

    @staticmethod
    def forward(ctx, x: Tensor) -> tuple[Tensor, Tensor]:  # type: ignore[override]
        channels = x.shape[1]
        # float32 buffers make the kernel return float32 statistics for a bfloat16 input too
        mean, var = torch.batch_norm_update_stats(
            x,
            torch.zeros(channels, device=x.device),
            torch.ones(channels, device=x.device),
            0.0,
        )
        ctx.save_for_backward(x, mean)
        return mean, var

    @staticmethod
    def backward(ctx, grad_mean: Tensor, grad_var: Tensor) -> Tensor:  # type: ignore[override]
        x, mean = ctx.saved_tensors
        n = x.numel() // x.shape[1]
        shape = (1, -1) + (1,) * (x.ndim - 2)

        def per_channel(v: Tensor) -> Tensor:
            return v.to(x.dtype).view(shape)

        centered = x - per_channel(mean)
        return torch.addcmul(per_channel(grad_mean / n), centered, per_channel(2 * grad_var / n))


def batch_statistics_gap(bn: nn.BatchNorm2d, x: Tensor) -> Tensor:
    """DeepInversion's prior for one BatchNorm layer: ||mu_b - mu_run||_2 + ||var_b - var_run||_2 between
    the statistics of its input batch ``x`` (N x C x H x W, any float dtype; computed in float32) and its
    running ones. Differentiable in ``x``; used by inversion and the generator."""
    mean, var = _BatchStatistics.apply(x)
    return torch.linalg.vector_norm(mean - bn.running_mean) + torch.linalg.vector_norm(var - bn.running_var)
