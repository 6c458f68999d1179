"""CVAE decoder bundles -> synthetic labelled images (FedMHO data generation, section 4.2.2 + Algorithm 2).

A ``cvae_decoder`` bundle carries ``decoder(z, y) -> x`` as ONNX plus the client's label counts. The
server rebuilds the decoder from its arch string (``cvae-small-z2``) and loads the ONNX initializers by
name (exact, and fast in torch on any device); a decoder that cannot be rebuilt (a foreign arch, or
weights that do not fit) runs through onnxruntime instead. Either way it is trusted only after a parity
check against onnxruntime on seeded inputs. Sampling needs no gradients, so the onnxruntime path loses
nothing but speed. Before either, the ONNX must pass :func:`export.onnx_check.check_decoder_onnx` against the
manifest: inputs ``z`` [batch, latent_dim] and ``y`` [batch, num_classes], output ``x`` [batch, C, H, W].

How the synthetic budget is split (:func:`allocate_samples`):

- ``"examples"`` (default): sample (client k, class c) cells in proportion to the count n_kc of class c
  in client k's training split. Each decoder thus gets a share of ``total`` proportional to its client's
  example count, and within it labels follow that client's label distribution, as section 4.2.2 says;
  the synthetic label distribution equals the pooled label distribution of the CVAE clients, and no
  decoder is ever asked for a class its client never saw.
- ``"squared"`` (the reference code): every class present at some CVAE client gets an equal share of
  ``total``, split across clients with weights n_kc ** 2, favouring the decoder that saw a class most.
  Unlike the reference, a class no CVAE client holds gets no samples (the reference spreads it uniformly
  over decoders that never saw it).

- ``"federation"``: each class's share of ``total`` follows the federation's label counts (``class_counts``:
  every upload's counts, the classifiers' too), over the classes some decoder holds; within a class, the
  decoders by their counts, as ``"examples"``. In FedMHO the global model is fused on decoder samples
  alone, so a class held mostly by classifier devices gets almost no samples under ``"examples"`` and the
  fusion erodes what FedAvg gave it (benchmarks/RESULTS.md, "FedMHO at the paper's numbers").

All round with the largest-remainder method, so exactly ``total`` samples are drawn and a cell gets
``floor(quota)`` or ``floor(quota) + 1``. Labels are these quotas (not random draws), z ~ N(0, I) from a
per-client seeded stream.

Filtering (:func:`filter_by_centroid`, Algorithm 2): per class, K-means with one cluster is the class
mean in pixel space; keep the ``floor(keep * n_c)`` samples nearest to it (``int()`` as the reference
does), but at least one, so a class with a single sample is not erased.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from common.errors import BundleError, ConfigError, ExportError, SpecError, TeacherError
from edge_sdk.cvae import build_cvae, modeled_label_counts
from export.bundle import Bundle, read_bundle
from export.onnx_check import check_decoder_onnx
from export.onnx_export import DECODER_INPUT_NAMES, onnx_session
from export.weights import initializer_state_dict

__all__ = [
    "WEIGHTINGS",
    "OnnxDecoder",
    "allocate_samples",
    "filter_by_centroid",
    "load_decoder",
    "sample_decoders",
]

WEIGHTINGS = ("examples", "squared", "federation")
PARITY_BATCH = 8
PARITY_SEED = 0
_CENTROID_EPS = 1e-9  # guards floor(keep * n) against 0.29 * 100 = 28.999...


class OnnxDecoder(nn.Module):
    """A decoder run by onnxruntime on CPU (no gradients): the fallback of :func:`load_decoder`.

    The bytes must pass :func:`check_decoder_onnx` for the given sizes before a session is made.
    """

    def __init__(
        self, model_bytes: bytes, *, latent_dim: int, num_classes: int, output_shape: tuple[int, ...]
    ):
        super().__init__()
        self.latent_dim, self.num_classes = int(latent_dim), int(num_classes)
        self.output_shape = tuple(int(v) for v in output_shape)
        check_decoder_onnx(
            model_bytes,
            latent_dim=self.latent_dim,
            num_classes=self.num_classes,
            output_shape=self.output_shape,
            source="decoder ONNX",
            error=TeacherError,
        )
        self.session = onnx_session(model_bytes)

    def forward(self, z: Tensor, y_onehot: Tensor) -> Tensor:
        feed = {
            DECODER_INPUT_NAMES[0]: z.detach().cpu().float().numpy(),
            DECODER_INPUT_NAMES[1]: y_onehot.detach().cpu().float().numpy(),
        }
        try:
            out = self.session.run(None, feed)[0]
        except Exception as err:  # onnxruntime raises its own pybind exception types
            raise TeacherError(f"onnxruntime failed to decode a batch of {len(z)}: {err}") from err
        return torch.from_numpy(out).to(z.device)


def _as_bundle(bundle: Bundle | str | Path) -> tuple[Bundle, str]:
    if isinstance(bundle, Bundle):
        return bundle, f"bundle (arch {bundle.arch!r})"
    return read_bundle(bundle), str(bundle)


def _rebuild(bundle: Bundle) -> nn.Module:
    try:
        cvae = build_cvae(bundle.arch, bundle.input_shape, bundle.num_classes)
    except SpecError as err:
        raise TeacherError(f"cannot rebuild arch {bundle.arch!r}: {err}") from err
    if cvae.latent_dim != bundle.latent_dim:
        raise TeacherError(
            f"arch {bundle.arch!r} has latent_dim {cvae.latent_dim}, the bundle {bundle.latent_dim}"
        )
    decoder = cvae.decoder
    try:
        decoder.load_state_dict(initializer_state_dict(bundle.model_onnx, decoder), strict=True)
    except (BundleError, RuntimeError) as err:
        raise TeacherError(f"the ONNX weights do not fit arch {bundle.arch!r}: {err}") from err
    return decoder


def _parity_inputs(latent_dim: int, num_classes: int) -> tuple[Tensor, Tensor]:
    generator = torch.Generator().manual_seed(PARITY_SEED)
    z = torch.randn((PARITY_BATCH, latent_dim), generator=generator)
    y = F.one_hot(torch.arange(PARITY_BATCH) % num_classes, num_classes).float()  # no L x L matrix
    return z, y


def _check_parity(module: nn.Module, bundle: Bundle, atol: float) -> float:
    """Max abs output difference of the CPU ``module`` vs onnxruntime; TeacherError above ``atol``."""
    assert bundle.latent_dim is not None
    z, y = _parity_inputs(bundle.latent_dim, bundle.num_classes)
    try:
        expected = OnnxDecoder(
            bundle.model_onnx,
            latent_dim=bundle.latent_dim,
            num_classes=bundle.num_classes,
            output_shape=bundle.input_shape,
        )(z, y).numpy()
    except ExportError as err:
        raise TeacherError(str(err)) from err
    try:
        with torch.no_grad():
            got = module(z, y).float().numpy()
    except RuntimeError as err:
        raise TeacherError(
            f"the torch decoder failed on z {tuple(z.shape)}, y {tuple(y.shape)}: {err}"
        ) from err
    want = (PARITY_BATCH, *bundle.input_shape)
    if got.shape != want or expected.shape != want:
        raise TeacherError(
            f"decoder output shapes torch {got.shape} / onnxruntime {expected.shape}, expected {want}"
        )
    diff = float(np.max(np.abs(got.astype(np.float64) - expected.astype(np.float64))))
    if not diff <= atol:  # also catches NaN
        raise TeacherError(f"parity with onnxruntime failed: max abs diff {diff:.3g} > {atol:g}")
    return diff


def load_decoder(
    bundle: Bundle | str | Path,
    *,
    device: str | torch.device = "cpu",
    parity_atol: float = 1e-4,
) -> nn.Module:
    """A frozen decoder module (eval, no grad) from a ``cvae_decoder`` bundle (or its path).

    Rebuilt from the arch string when possible, else an :class:`OnnxDecoder`; either must match
    onnxruntime within ``parity_atol``. The module has ``latent_dim``, ``num_classes`` and
    ``output_shape`` attributes. Raises TeacherError with every attempt's reason.
    """
    bundle, source = _as_bundle(bundle)
    if bundle.kind != "cvae_decoder":
        raise TeacherError(f"{source}: kind {bundle.kind!r} is not a cvae_decoder")
    if not parity_atol > 0:
        raise ConfigError(f"parity_atol must be > 0, got {parity_atol!r}")
    assert bundle.latent_dim is not None  # a cvae_decoder bundle always has one
    check_decoder_onnx(
        bundle.model_onnx,
        latent_dim=bundle.latent_dim,
        num_classes=bundle.num_classes,
        output_shape=bundle.input_shape,
        source=source,
        error=TeacherError,
    )
    dev = torch.device(device)
    reasons = []
    try:  # parity on the CPU in exact float32 (a GPU's TF32 convolutions differ by ~1e-3), then to the device
        module = _rebuild(bundle).float().eval().requires_grad_(False)
        _check_parity(module, bundle, parity_atol)
        return module.to(dev)
    except TeacherError as err:
        reasons.append(f"rebuilt: {err}")
    try:
        module = OnnxDecoder(
            bundle.model_onnx,
            latent_dim=bundle.latent_dim,
            num_classes=bundle.num_classes,
            output_shape=bundle.input_shape,
        )
        _check_parity(module, bundle, parity_atol)
        return module
    except (TeacherError, ExportError) as err:
        reasons.append(f"onnxruntime: {err}")
    raise TeacherError(
        f"{source}: cannot load the decoder ({'; '.join(reasons)}); fix: export it with "
        "export.onnx_export.export_decoder_onnx"
    )


def allocate_samples(
    label_counts_per_client: Sequence[Sequence[int]],
    total: int,
    *,
    weighting: str = "examples",
    class_counts: Sequence[float] | None = None,
) -> np.ndarray:
    """K x L int64 sample counts summing to ``total`` (see the module docstring for the weightings;
    ``class_counts``, L per-class counts of the whole federation, only and always with ``"federation"``)."""
    if weighting not in WEIGHTINGS:
        raise ConfigError(f"weighting must be one of {WEIGHTINGS}, got {weighting!r}")
    if (class_counts is None) != (weighting != "federation"):
        raise ConfigError(
            f"class_counts goes with weighting 'federation' only, got weighting {weighting!r} and "
            f"class_counts {'given' if class_counts is not None else 'absent'}"
        )
    if isinstance(total, bool) or not isinstance(total, int) or total < 1:
        raise ConfigError(f"total must be an integer >= 1, got {total!r}")
    counts = np.asarray([list(row) for row in label_counts_per_client], dtype=np.float64)
    if counts.ndim != 2 or counts.shape[0] < 1 or counts.shape[1] < 1:
        raise ConfigError(f"label counts must be K x L with K, L >= 1, got shape {counts.shape}")
    if not np.isfinite(counts).all() or (counts < 0).any():
        raise ConfigError("label counts must be finite and >= 0")
    if counts.sum() <= 0:
        raise ConfigError("label counts are all zero: no decoder has seen any class")
    if weighting == "examples":
        weights = counts / counts.sum()
    elif weighting == "federation":
        assert class_counts is not None
        federation = np.asarray(list(class_counts), dtype=np.float64)
        bad = not np.isfinite(federation).all() or (federation < 0).any()
        if federation.shape != (counts.shape[1],) or bad:
            raise ConfigError(
                f"class_counts must be {counts.shape[1]} finite counts >= 0, got shape {federation.shape}"
            )
        held = counts.sum(axis=0) > 0  # classes some decoder can draw
        share = np.where(held, federation, 0.0)
        if share.sum() <= 0:
            raise ConfigError("class_counts are zero on every class the decoders hold")
        within = np.where(held, counts / np.where(held, counts.sum(axis=0, keepdims=True), 1.0), 0.0)
        weights = within * (share / share.sum())
    else:
        squared = counts**2
        per_class = squared.sum(axis=0, keepdims=True)  # 1 x L
        present = per_class > 0
        weights = np.where(present, squared / np.where(present, per_class, 1.0), 0.0) / present.sum()
    quota = weights * total
    cells = np.floor(quota).astype(np.int64)
    remainder = total - int(cells.sum())
    if remainder:
        order = np.argsort(-(quota - cells).ravel(), kind="stable")  # largest fraction first, ties by index
        cells.ravel()[order[:remainder]] += 1
    return cells


def _drawn_counts(decoders: Sequence[nn.Module], rows: Sequence[Sequence[int]]) -> list[list[int]]:
    """The label counts samples are allocated by: a class is drawn from the decoders that model it
    (:func:`edge_sdk.cvae.modeled_label_counts`), or, when none does, from every decoder holding it, as
    without class priors, so no class the decoders hold goes missing."""
    raw = [[int(n) for n in row] for row in rows]
    modeled = [modeled_label_counts(d, row) for d, row in zip(decoders, raw, strict=True)]
    for c in range(len(raw[0]) if raw else 0):
        if not any(row[c] for row in modeled):
            for k, row in enumerate(modeled):
                row[c] = raw[k][c]
    return modeled


def check_temperature(temperature: float) -> float:
    """A sampling temperature: a finite number in (0, 1] (above 1 only draws further off the prior)."""
    if (
        isinstance(temperature, bool)
        or not isinstance(temperature, int | float)
        or not (math.isfinite(temperature) and 0.0 < temperature <= 1.0)
    ):
        raise ConfigError(f"the decoder sampling temperature must be in (0, 1], got {temperature!r}")
    return float(temperature)


def _stream(seed: int, client: int) -> torch.Generator:
    entropy = np.random.SeedSequence([seed, client]).generate_state(2, dtype=np.uint32)
    return torch.Generator().manual_seed((int(entropy[0]) << 32) | int(entropy[1]))


@torch.no_grad()
def sample_decoders(
    decoders: Sequence[nn.Module],
    label_counts_per_client: Sequence[Sequence[int]],
    *,
    total: int,
    num_classes: int,
    seed: int,
    device: str | torch.device = "cpu",
    weighting: str = "examples",
    batch_size: int = 1024,
    temperature: float = 1.0,
    class_counts: Sequence[float] | None = None,
) -> tuple[Tensor, Tensor]:
    """Decode ``total`` synthetic images: (x float32 N x C x H x W in [0, 1], y int64 N), on CPU.

    Decoder k gets the label counts of :func:`allocate_samples` for client k (same order; a class-prior
    decoder only for the classes it modelled, see :func:`_drawn_counts`) and decodes
    z ~ N(0, temperature^2 I) drawn from its own seeded stream (on CPU, so the draw is
    device-independent); a temperature under 1 draws nearer the prior's mode, where the decoder leans
    on the label more than on z (the truncation trick of generative models). Samples
    are grouped by client, then class. Values outside [0, 1] (a foreign decoder) are clipped.
    """
    if len(decoders) != len(label_counts_per_client) or not decoders:
        raise ConfigError(
            f"need one label-count row per decoder, got {len(decoders)} decoders and "
            f"{len(label_counts_per_client)} rows"
        )
    if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 1:
        raise ConfigError(f"num_classes must be a positive integer, got {num_classes!r}")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ConfigError(f"batch_size must be a positive integer, got {batch_size!r}")
    check_temperature(temperature)
    for k, row in enumerate(label_counts_per_client):
        if len(row) != num_classes:
            raise ConfigError(
                f"label counts of client {k} have {len(row)} entries, num_classes is {num_classes}"
            )
    shapes = set()
    for k, decoder in enumerate(decoders):
        latent = getattr(decoder, "latent_dim", None)
        if not isinstance(latent, int) or latent < 1:
            raise ConfigError(f"decoder {k} has no int latent_dim attribute; load it with load_decoder")
        if getattr(decoder, "num_classes", num_classes) != num_classes:
            raise ConfigError(
                f"decoder {k} is conditioned on {decoder.num_classes} classes, not {num_classes}"
            )
        shapes.add(tuple(getattr(decoder, "output_shape", ())))
    if len(shapes) > 1:
        raise ConfigError(
            f"decoders produce different image shapes {sorted(shapes)}; pass one task's decoders"
        )
    drawn = _drawn_counts(decoders, label_counts_per_client)
    cells = allocate_samples(drawn, total, weighting=weighting, class_counts=class_counts)
    dev = torch.device(device)
    xs: list[Tensor] = []
    ys: list[Tensor] = []
    for k, decoder in enumerate(decoders):
        labels = torch.repeat_interleave(torch.arange(num_classes), torch.from_numpy(cells[k]))
        if len(labels) == 0:
            continue
        z = torch.randn((len(labels), decoder.latent_dim), generator=_stream(seed, k))
        if temperature != 1.0:
            z *= temperature
        was_training = decoder.training
        decoder.eval()
        for start in range(0, len(labels), batch_size):
            zb = z[start : start + batch_size].to(dev)
            yb = F.one_hot(labels[start : start + batch_size], num_classes).float().to(dev)
            xs.append(decoder(zb, yb).float().clamp_(0.0, 1.0).cpu())
        decoder.train(was_training)
        ys.append(labels)
    return torch.cat(xs), torch.cat(ys).to(torch.int64)


def filter_by_centroid(x: Tensor, y: Tensor, *, keep: float = 0.8) -> Tensor:
    """Boolean mask (N) of the samples to keep: per class, the ``max(1, floor(keep * n_c))`` nearest to the
    class mean in flattened pixel space (Euclidean, float64; ties go to the earlier sample)."""
    if isinstance(keep, bool) or not isinstance(keep, int | float) or not 0.0 < keep <= 1.0:
        raise ConfigError(f"keep must be a fraction in (0, 1], got {keep!r}")
    if (
        not isinstance(x, Tensor)
        or not isinstance(y, Tensor)
        or x.ndim < 2
        or y.ndim != 1
        or len(x) != len(y)
    ):
        raise ConfigError("x must be N x ... and y a length-N label vector")
    features = x.detach().reshape(len(x), -1).double().cpu()  # N x F
    labels = y.detach().cpu()
    mask = torch.zeros(len(y), dtype=torch.bool)
    for c in torch.unique(labels).tolist():
        idx = torch.nonzero(labels == c).flatten()  # ascending sample order
        members = features[idx]
        distance = torch.linalg.vector_norm(members - members.mean(dim=0, keepdim=True), dim=1)
        count = max(1, math.floor(keep * len(idx) + _CENTROID_EPS))
        order = torch.sort(distance, stable=True).indices
        mask[idx[order[:count]]] = True
    return mask
