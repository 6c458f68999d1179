"""Conditional VAEs for resource-constrained clients (FedMHO, section 4.2.1): models, loss and training.

A device too small for a useful classifier trains a CVAE on its local split and uploads only the decoder
(``decoder(z, y_onehot) -> x``, pixels in [0, 1]) plus its label counts; the server samples synthetic
labelled images from it. Two architectures, after the FedMHO reference code (YXShi2000/FedMHO):

- ``cvae-small``: the MLP of the reference's MNIST/Fashion CVAE, sized from the input shape for any
  (C, H, W) and class count. Encoder Linear(C*H*W + K -> 256) ReLU, then Linear(256 -> z) for the mean
  and for the log-variance; decoder Linear(z + K -> 256) ReLU Linear(256 -> C*H*W) Sigmoid. The label
  enters both halves as a one-hot vector. (The reference's separate conv "small" CVAEs for SVHN, EMNIST
  and CIFAR-10 are not reproduced: this MLP is used for every shape.)
- ``cvae-large``: the reference's convolutional CVAE-large. Encoder Conv3x3(C -> 64) ReLU Conv3x3(64 ->
  128) ReLU MaxPool2 Conv3x3(128 -> 256) ReLU MaxPool2 Linear(256*h*w -> 256) ReLU with h, w = H//4, W//4,
  then Linear(256 + K -> z) for mean and log-variance (the label joins after the convolutions); decoder
  Linear(z + K -> 256) ReLU Linear(256 -> 256*h*w) ReLU, ConvT3x3(256 -> 128) ReLU, bilinear upsampling to
  (H//2, W//2), ConvT3x3(128 -> 64) ReLU, upsampling to (H, W), ConvT3x3(64 -> C) Sigmoid. Upsampling to
  explicit sizes (the reference doubles twice) keeps odd sizes working; at 28x28 and 32x32 it is the same.
  The reference fixes z = 20 for this model; here ``latent_dim`` applies to both.

Cost (FlopCounterMode convention: 2 x MACs of matmuls/convolutions, per sample): ``cvae-small`` at
z = 2 on 1x28x28 with 10 classes is 816,128 FLOPs for the training forward (encoder + decoder), exactly
twice the 408.06 K of the paper's Table 2, which therefore counts MACs of the whole CVAE; its decoder
alone is 407,552 FLOPs. ``cvae-large`` at z = 20 on 1x28x28 is 303,701,792 FLOPs = 151.85 M MACs against
the paper's 152.67 M: the 0.5 % gap is most plausibly the two bilinear upsamplings, which FlopCounterMode
does not count and the thop profiler does (11 operations per output element would give 152.68 M). See
:func:`profile_cvae`.

Loss (Eq. 3): binary cross-entropy summed over pixels plus the KL divergence to N(0, I), averaged over
the batch, as the reference computes it. The decoder's pre-sigmoid logits are trained with
``binary_cross_entropy_with_logits`` (same value, numerically stable at the large learning rates of
Table 3). Optimiser: Adam.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, get_args

import numpy as np
import torch
from torch import Tensor, nn
from torch.nn import functional as F
from torch.utils.flop_counter import FlopCounterMode

from common.checks import check_int, from_preset
from common.device import resolve_device
from common.errors import BudgetError, ConfigError, DataError, SpecError
from common.loop import adam, fit_terms
from common.seeding import seeded
from edge_sdk.data import ArrayDataset
from edge_sdk.profiling import ModelProfile, fits, profile_model
from edge_sdk.train import to_float
from export.wire import MAX_LATENT_DIM  # the bundle's bound: a decoder trained here is always shippable
from profiles import DeviceProfile

__all__ = [
    "CVAE",
    "HIDDEN_UNITS",
    "MAX_WIDTH",
    "MODELS",
    "WIDTHS",
    "CVAEConfig",
    "CVAEProfile",
    "ClassPrior",
    "Decoder",
    "build_cvae",
    "class_prior_min_examples",
    "cvae_arch",
    "cvae_cost",
    "cvae_loss",
    "evaluate_cvae",
    "fit_class_prior",
    "fit_width",
    "modeled_label_counts",
    "parse_cvae_arch",
    "profile_cvae",
    "train_cvae",
]

CVAEModel = Literal["cvae-small", "cvae-large"]
MODELS: tuple[str, ...] = get_args(CVAEModel)
HIDDEN_UNITS = 256  # both reference CVAEs: the width of their dense hidden layer
# the widths a device steps down through, widest first, when the reference's does not fit its budget: on
# 32x32x3 images the MLP's first layer is 3,072 inputs wide, four times 28x28x1's
WIDTHS: tuple[int, ...] = (HIDDEN_UNITS, 128, 64, 32, 16)
MAX_WIDTH = 4096  # a decoder bundle's width is bounded before any layer is allocated
CLASS_PRIOR_SUFFIX = "-classprior"
# e.g. cvae-small-z20, cvae-small-w64-z20-classprior (no -w: the reference's 256); 4 / 9 digits at most
_ARCH_RE = re.compile(r"^(cvae-small|cvae-large)(?:-w([1-9][0-9]{0,3}))?-z([1-9][0-9]{0,8})(-classprior)?$")

# Per-dataset settings. From the paper (Table 3 / section 5.1.4): batch 64, Adam, and the CVAE learning rate
# and local epochs of MNIST (5e-2, 30), Fashion (5e-2, 40), SVHN (1e-3, 40), EMNIST (3e-3, 50). cifar10 is
# not in the paper: its values (1e-3, 30) come from the reference code. latent_dim 2 is the reference's
# default (its README runs use 20). One change: MNIST and Fashion train at 3e-3 (the paper's EMNIST rate),
# not 5e-2. At 5e-2 Adam collapses the posterior of our cvae-small (a validation KL near zero; every
# sample near its class prototype), and the FedMHO-MD global model trained on such samples is far worse
# (benchmarks/RESULTS.md, "FedMHO at the paper's numbers").
_PRESETS: dict[str, dict[str, Any]] = {
    "fast": {},
    "mnist": {"epochs": 30, "lr": 3e-3, "batch_size": 64},
    "fashionmnist": {"epochs": 40, "lr": 3e-3, "batch_size": 64},
    "svhn": {"epochs": 40, "lr": 1e-3, "batch_size": 64},
    "emnist": {"epochs": 50, "lr": 3e-3, "batch_size": 64},
    "cifar10": {"epochs": 30, "lr": 1e-3, "batch_size": 64},
}


@dataclass(frozen=True, kw_only=True)
class CVAEConfig:
    """Local CVAE training. The defaults are the ``fast`` preset (seconds on a CPU for a small split): our
    choice, not the paper's: lr 3e-3 (the paper's EMNIST rate; a lower one trained cvae-small on digits
    to a worse validation loss, a higher one collapsed the KL term) and z = 20 (the reference's README
    setting); benchmarks/RESULTS.md ("Label skew") records what they gave the server.

    Attributes:
        model: the CVAE's architecture.
        latent_dim: size of the latent code z.
        epochs: passes over the training split.
        lr: Adam learning rate.
        batch_size: images per step.
        kl_weight: beta of the training loss recon + beta * KL (1: the paper's ELBO). Above 1, z carries
            less of each image and the decoder leans on the label; validation reports the ELBO either way.
        class_prior: after training, fit each class's latent distribution (a full-covariance Gaussian of
            where the encoder put its training images) into the decoder, so the server's z ~ N(0, I) is
            mapped to that class's region; without it a class drawn from N(0, I) can come out as another
            one. The architecture's name then ends in -classprior. On by default: a plain device's
            decoder samples are then recognised as the class they were drawn for far more often, and a
            device should not need to know which server method will read its decoder.
        width: units of the hidden layer of the encoder and of the decoder; none: 256 (the reference's)
            where the whole CVAE fits the device's budget, else the widest of 128, 64, 32 and 16 that
            does. The architecture's name then says it (cvae-small-w64-z20).
    """

    model: CVAEModel = "cvae-small"
    latent_dim: int = 20
    epochs: int = 20
    lr: float = 3e-3
    batch_size: int = 64
    kl_weight: float = 1.0
    class_prior: bool = True
    width: int | None = None

    def __post_init__(self) -> None:
        if self.model not in MODELS:
            raise ConfigError(f"model must be one of {MODELS}, got {self.model!r}")
        check_int("latent_dim", self.latent_dim, 1, MAX_LATENT_DIM)
        if self.width is not None:
            check_int("width", self.width, 1, MAX_WIDTH)
        check_int("epochs", self.epochs, 0, None)
        check_int("batch_size", self.batch_size, 1, None)
        if (
            isinstance(self.lr, bool)
            or not isinstance(self.lr, int | float)
            or not (math.isfinite(self.lr) and self.lr > 0)
        ):
            raise ConfigError(f"lr must be a positive finite number, got {self.lr!r}")
        if (
            isinstance(self.kl_weight, bool)
            or not isinstance(self.kl_weight, int | float)
            or not (math.isfinite(self.kl_weight) and self.kl_weight > 0)
        ):
            raise ConfigError(f"kl_weight must be a positive finite number, got {self.kl_weight!r}")
        if not isinstance(self.class_prior, bool):
            raise ConfigError(f"class_prior must be true or false, got {self.class_prior!r}")

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> CVAEConfig:
        """``fast`` or a dataset's paper settings (``mnist``, ``fashionmnist``, ``svhn``, ``emnist``; and
        ``cifar10`` from the reference code), with any field overridden by keyword."""
        return from_preset(cls, _PRESETS, name, "CVAE", **overrides)

    def to_dict(self) -> dict[str, Any]:
        """The fields; ``kl_weight`` only when it is not 1, ``class_prior`` only when on and ``width`` only
        when given, so reports written before they existed still match their settings on resume."""
        out = dataclasses.asdict(self)
        if out["kl_weight"] == 1.0:
            del out["kl_weight"]
        if not out["class_prior"]:
            del out["class_prior"]
        if out["width"] is None:
            del out["width"]
        return out

    @property
    def arch(self) -> str:
        """The architecture's name; at ``width`` None, the reference's (:func:`fit_width` tries it first)."""
        width = HIDDEN_UNITS if self.width is None else self.width
        return cvae_arch(self.model, self.latent_dim, width=width, class_prior=self.class_prior)


def cvae_arch(model: str, latent_dim: int, *, width: int = HIDDEN_UNITS, class_prior: bool = False) -> str:
    """The arch string a decoder bundle carries, e.g. ``cvae-small-z2``, ``cvae-small-w64-z20`` or
    ``cvae-small-z20-classprior`` (the width is written only when it is not the reference's)."""
    if model not in MODELS:
        raise SpecError(f"unknown CVAE model {model!r}; expected one of {MODELS}")
    wide = "" if int(width) == HIDDEN_UNITS else f"-w{int(width)}"
    return f"{model}{wide}-z{int(latent_dim)}{CLASS_PRIOR_SUFFIX if class_prior else ''}"


def parse_cvae_arch(arch: str) -> tuple[str, int]:
    """``"cvae-small-z2"`` -> ``("cvae-small", 2)``; :func:`build_cvae` reads the width and the
    ``-classprior`` suffix."""
    return _parse_arch(arch)[:2]


def _parse_arch(arch: str) -> tuple[str, int, int, bool]:
    """(model, latent_dim, width, class prior) of an arch string, each bounded before anything is built."""
    match = _ARCH_RE.match(str(arch).strip())
    if match is None:
        raise SpecError(
            f"not a CVAE arch string: {arch!r}; expected e.g. 'cvae-small-z2', 'cvae-large-z20', "
            "'cvae-small-w64-z20' or 'cvae-small-z20-classprior'"
        )
    width = HIDDEN_UNITS if match.group(2) is None else int(match.group(2))
    if width > MAX_WIDTH:
        raise SpecError(f"CVAE width must be at most {MAX_WIDTH}, got {width} in {arch!r}")
    return match.group(1), int(match.group(3)), width, match.group(4) is not None


# ------------------------------------------------------------------------------------------------ models


def class_prior_min_examples(latent_dim: int) -> int:
    """The fewest training images of a class for :func:`fit_class_prior` to fit its latent Gaussian.

    latent_dim + 1: fewer codes cannot span the latent space, so the covariance would be singular and
    mostly the shrinkage target; and the fitted mean is an average of at least that many codes, never
    one image's. The server samples a class-prior decoder only for the classes it modelled
    (:func:`modeled_label_counts`), the device and the server reading this one rule.
    """
    return int(latent_dim) + 1


class ClassPrior(nn.Module):
    """``prior(eps, y_onehot) = mean[y] + L[y] @ eps``: the server's N(0, I) noise mapped to each class's
    fitted latent Gaussian N(mean[y], L[y] L[y]^T). Identity (mean 0, L = I) until fitted, and for the
    classes :func:`fit_class_prior` leaves unfitted. Two buffers, ``mean`` (K x z) and ``scale``
    (K x z*z, each row a flattened L), that travel as ONNX initializers like the weights."""

    def __init__(self, num_classes: int, latent_dim: int) -> None:
        super().__init__()
        self.latent_dim = latent_dim
        self.register_buffer("mean", torch.zeros(num_classes, latent_dim))
        self.register_buffer("scale", torch.eye(latent_dim).repeat(num_classes, 1, 1).flatten(1))

    def forward(self, eps: Tensor, y_onehot: Tensor) -> Tensor:
        chol = (y_onehot @ self.scale).reshape(-1, self.latent_dim, self.latent_dim)  # N x z x z
        return y_onehot @ self.mean + torch.bmm(chol, eps.unsqueeze(2)).squeeze(2)


class Decoder(nn.Module):
    """``decoder(z, y_onehot) -> x``: z (N x latent), one-hot y (N x K) -> pixels in [0, 1], N x C x H x W.

    ``logits`` maps a latent code to pre-sigmoid pixels (training uses it, on posterior codes, for a
    stable BCE); ``forward`` is what the server samples: its z is the N(0, I) draw, first mapped through
    the class prior when the decoder has one (``prior``, see :class:`ClassPrior`). ``latent_dim``,
    ``num_classes`` and ``output_shape`` are plain ints so the server's sampler can read them.
    """

    latent_dim: int
    num_classes: int
    output_shape: tuple[int, int, int]
    prior: ClassPrior | None

    def logits(self, z: Tensor, y_onehot: Tensor) -> Tensor:
        raise NotImplementedError

    def forward(self, z: Tensor, y_onehot: Tensor) -> Tensor:
        if self.prior is not None:
            z = self.prior(z, y_onehot)
        return torch.sigmoid(self.logits(z, y_onehot))


class _MLPEncoder(nn.Module):
    def __init__(self, pixels: int, num_classes: int, latent_dim: int, width: int) -> None:
        super().__init__()
        self.hidden = nn.Linear(pixels + num_classes, width)
        self.mean = nn.Linear(width, latent_dim)
        self.logvar = nn.Linear(width, latent_dim)

    def forward(self, x: Tensor, y_onehot: Tensor) -> tuple[Tensor, Tensor]:
        h = F.relu(self.hidden(torch.cat((torch.flatten(x, 1), y_onehot), dim=1)))  # N x width
        return self.mean(h), self.logvar(h)


class _MLPDecoder(Decoder):
    def __init__(
        self,
        output_shape: tuple[int, int, int],
        num_classes: int,
        latent_dim: int,
        class_prior: bool,
        width: int,
    ) -> None:
        super().__init__()
        self.latent_dim, self.num_classes, self.output_shape = latent_dim, num_classes, output_shape
        self.prior = ClassPrior(num_classes, latent_dim) if class_prior else None
        self.hidden = nn.Linear(latent_dim + num_classes, width)
        self.out = nn.Linear(width, math.prod(output_shape))

    def logits(self, z: Tensor, y_onehot: Tensor) -> Tensor:
        h = F.relu(self.hidden(torch.cat((z, y_onehot), dim=1)))  # N x width
        return self.out(h).reshape(-1, *self.output_shape)  # N x C x H x W (one constant ONNX Reshape)


def _large_grid(input_shape: tuple[int, int, int]) -> tuple[int, int]:
    _, h, w = input_shape
    if h < 4 or w < 4:
        raise SpecError(
            f"cvae-large pools twice and needs images of at least 4x4, got {h}x{w}; use cvae-small"
        )
    return h // 4, w // 4


class _ConvEncoder(nn.Module):
    def __init__(
        self, input_shape: tuple[int, int, int], num_classes: int, latent_dim: int, width: int
    ) -> None:
        super().__init__()
        gh, gw = _large_grid(input_shape)
        self.features = nn.Sequential(
            nn.Conv2d(input_shape[0], 64, 3, padding=1),
            nn.ReLU(inplace=True),
            nn.Conv2d(64, 128, 3, padding=1),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(2),
            nn.Conv2d(128, 256, 3, padding=1),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(2),
            nn.Flatten(),
            nn.Linear(256 * gh * gw, width),
            nn.ReLU(inplace=True),
        )
        self.mean = nn.Linear(width + num_classes, latent_dim)
        self.logvar = nn.Linear(width + num_classes, latent_dim)

    def forward(self, x: Tensor, y_onehot: Tensor) -> tuple[Tensor, Tensor]:
        h = torch.cat((self.features(x), y_onehot), dim=1)  # N x (width + K)
        return self.mean(h), self.logvar(h)


class _ConvDecoder(Decoder):
    def __init__(
        self,
        output_shape: tuple[int, int, int],
        num_classes: int,
        latent_dim: int,
        class_prior: bool,
        width: int,
    ) -> None:
        super().__init__()
        self.latent_dim, self.num_classes, self.output_shape = latent_dim, num_classes, output_shape
        self.prior = ClassPrior(num_classes, latent_dim) if class_prior else None
        c, h, w = output_shape
        gh, gw = _large_grid(output_shape)
        self.hidden = nn.Sequential(
            nn.Linear(latent_dim + num_classes, width),
            nn.ReLU(inplace=True),
            nn.Linear(width, 256 * gh * gw),
            nn.ReLU(inplace=True),
        )
        self.grid = (256, gh, gw)
        self.upsample = nn.Sequential(
            nn.ConvTranspose2d(256, 128, 3, padding=1),
            nn.ReLU(inplace=True),
            nn.Upsample(size=(h // 2, w // 2), mode="bilinear", align_corners=False),
            nn.ConvTranspose2d(128, 64, 3, padding=1),
            nn.ReLU(inplace=True),
            nn.Upsample(size=(h, w), mode="bilinear", align_corners=False),
            nn.ConvTranspose2d(64, c, 3, padding=1),
        )

    def logits(self, z: Tensor, y_onehot: Tensor) -> Tensor:
        h = self.hidden(torch.cat((z, y_onehot), dim=1)).reshape(-1, *self.grid)  # N x 256 x H/4 x W/4
        return self.upsample(h)  # N x C x H x W


class CVAE(nn.Module):
    """``encoder(x, y_onehot) -> (mean, logvar)``; ``decoder(z, y_onehot) -> x``.

    ``forward(x, y_onehot, eps)`` returns (reconstruction in [0, 1], mean, logvar) with z = mean +
    eps * exp(logvar / 2); pass ``eps`` from a seeded generator (``None`` draws from the global RNG).
    ``class_prior`` gives the decoder a :class:`ClassPrior` (fitted after training by :func:`train_cvae`).
    """

    def __init__(
        self,
        model: str,
        input_shape: tuple[int, int, int],
        num_classes: int,
        latent_dim: int,
        *,
        class_prior: bool = False,
        width: int = HIDDEN_UNITS,
    ) -> None:
        super().__init__()
        if model not in MODELS:
            raise SpecError(f"unknown CVAE model {model!r}; expected one of {MODELS}")
        shape = tuple(int(v) for v in input_shape)
        if len(shape) != 3 or min(shape) < 1:
            raise SpecError(f"input_shape must be three positive ints (C, H, W), got {input_shape!r}")
        if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 1:
            raise SpecError(f"num_classes must be a positive int, got {num_classes!r}")
        if (
            isinstance(latent_dim, bool)
            or not isinstance(latent_dim, int)
            or not 1 <= latent_dim <= MAX_LATENT_DIM
        ):
            raise SpecError(f"latent_dim must be an int in [1, {MAX_LATENT_DIM}], got {latent_dim!r}")
        if isinstance(width, bool) or not isinstance(width, int) or not 1 <= width <= MAX_WIDTH:
            raise SpecError(f"width must be an int in [1, {MAX_WIDTH}], got {width!r}")
        self.model, self.input_shape = model, shape
        self.num_classes, self.latent_dim, self.width = num_classes, latent_dim, width
        self.encoder: nn.Module
        self.decoder: Decoder
        prior = bool(class_prior)
        if model == "cvae-small":
            self.encoder = _MLPEncoder(math.prod(shape), num_classes, latent_dim, width)
            self.decoder = _MLPDecoder(shape, num_classes, latent_dim, prior, width)  # type: ignore[arg-type]
        else:
            self.encoder = _ConvEncoder(shape, num_classes, latent_dim, width)  # type: ignore[arg-type]
            self.decoder = _ConvDecoder(shape, num_classes, latent_dim, prior, width)  # type: ignore[arg-type]

    @property
    def class_prior(self) -> bool:
        return self.decoder.prior is not None

    @property
    def arch(self) -> str:
        return cvae_arch(self.model, self.latent_dim, width=self.width, class_prior=self.class_prior)

    def forward(
        self, x: Tensor, y_onehot: Tensor, eps: Tensor | None = None
    ) -> tuple[Tensor, Tensor, Tensor]:
        mean, logvar = self.encoder(x, y_onehot)
        if eps is None:
            eps = torch.randn_like(mean)
        z = mean + eps * torch.exp(0.5 * logvar)
        return torch.sigmoid(self.decoder.logits(z, y_onehot)), mean, logvar  # a posterior code: no prior


def build_cvae(
    model: str,
    input_shape: tuple[int, int, int],
    num_classes: int,
    latent_dim: int | None = None,
    *,
    class_prior: bool = False,
    width: int = HIDDEN_UNITS,
) -> CVAE:
    """Build a CVAE by model name (``latent_dim`` required) or by arch string (``cvae-small-z2``,
    ``cvae-small-w64-z20-classprior``: the arch string then says its width and whether it has a class
    prior)."""
    if model not in MODELS:
        name, from_arch, width, prior = _parse_arch(model)
        if latent_dim is not None and latent_dim != from_arch:
            raise SpecError(f"arch {model!r} says latent_dim {from_arch}, got latent_dim={latent_dim}")
        model, latent_dim, class_prior = name, from_arch, prior
    if latent_dim is None:
        raise SpecError(f"latent_dim is required to build {model!r} by model name")
    return CVAE(model, input_shape, num_classes, latent_dim, class_prior=class_prior, width=width)


@torch.no_grad()
def fit_class_prior(model: CVAE, data: ArrayDataset, *, batch_size: int = 1024) -> tuple[int, ...]:
    """Fit the decoder's :class:`ClassPrior` to ``data`` (the training split); returns the classes fitted.

    For each class with at least :func:`class_prior_min_examples` images: the mean and covariance of its
    aggregate posterior, q(z | y) = the average over its images of N(mean(x), diag(exp(logvar(x)))), i.e.
    the covariance of the posterior means plus the mean posterior variance, shrunk toward its diagonal by
    z / (n + z) (a sample covariance of n codes in z dimensions is noisy when n is near z); L is its
    Cholesky factor. Ex-post density estimation (Ghosh et al., 2020) with one Gaussian per class: the
    decoder is left as trained, only where the server's noise lands changes. Other classes keep N(0, I).
    """
    prior = model.decoder.prior
    if prior is None:
        raise ConfigError(f"{model.arch} has no class prior; build it with class_prior=True")
    _check_data(data, "training")
    was_training = model.training
    model.eval()
    param = next(model.parameters())
    means, variances = [], []
    for start in range(0, len(data), batch_size):
        xb = to_float(data.x[start : start + batch_size].to(param.device))
        yb = F.one_hot(data.y[start : start + batch_size].to(param.device), data.num_classes).float()
        mean, logvar = model.encoder(xb, yb)
        means.append(mean.double().cpu())
        variances.append(logvar.double().exp().cpu())
    model.train(was_training)
    mu, var = torch.cat(means), torch.cat(variances)
    z = model.latent_dim
    prior.mean.zero_()  # a refit starts from N(0, I) for every class
    prior.scale.copy_(torch.eye(z).repeat(data.num_classes, 1, 1).flatten(1))
    fitted = []
    for c in range(data.num_classes):
        rows = data.y == c
        n = int(rows.sum())
        if n < class_prior_min_examples(z):
            continue
        codes = mu[rows]
        cov = torch.cov(codes.T, correction=0).reshape(z, z) + torch.diag(var[rows].mean(0))
        shrink = z / (n + z)
        cov = (1.0 - shrink) * cov + shrink * torch.diag(torch.diag(cov))
        chol, info = torch.linalg.cholesky_ex(cov)
        if int(info) != 0 or not torch.isfinite(chol).all():
            continue  # not positive definite (a degenerate class): keep N(0, I) for it
        prior.mean[c] = codes.mean(0).to(prior.mean)
        prior.scale[c] = chol.flatten().to(prior.scale)
        fitted.append(c)
    return tuple(fitted)


def modeled_label_counts(decoder: nn.Module, label_counts: Sequence[int]) -> list[int]:
    """``label_counts`` with the classes a class-prior decoder did not fit set to 0, so the server draws a
    class only from decoders that model it (:func:`class_prior_min_examples`); any other decoder (no
    prior, a foreign ONNX one) keeps every count."""
    counts = [int(n) for n in label_counts]
    if getattr(decoder, "prior", None) is None:
        return counts
    least = class_prior_min_examples(int(decoder.latent_dim))
    return [n if n >= least else 0 for n in counts]


# ---------------------------------------------------------------------------------------------- the cost


@dataclass(frozen=True, kw_only=True)
class CVAEProfile:
    """Cost of a CVAE. ``model`` covers the training forward (encoder + decoder: FLOPs, parameters and
    training memory, compared with the device budget); ``decoder_*`` is what the server runs per sample."""

    model: ModelProfile
    decoder_flops: int
    decoder_params: int

    def to_metrics(self) -> dict[str, int]:
        return {
            "flops": self.model.flops,
            "params": self.model.params,
            "train_memory_bytes": self.model.train_memory_bytes,
            "decoder_flops": self.decoder_flops,
            "decoder_params": self.decoder_params,
        }


class _LabelledProbe(nn.Module):
    """``probe(x) = cvae(x, one-hot(0), eps=0)[0]``: a single-input view for edge_sdk.profiling."""

    def __init__(self, cvae: CVAE) -> None:
        super().__init__()
        self.cvae = cvae

    def forward(self, x: Tensor) -> Tensor:
        y = torch.zeros((x.shape[0], self.cvae.num_classes), device=x.device, dtype=x.dtype)
        y[:, 0] = 1.0
        eps = torch.zeros((x.shape[0], self.cvae.latent_dim), device=x.device, dtype=x.dtype)
        return self.cvae(x, y, eps)[0]


def profile_cvae(model: CVAE, *, batch_size: int = 64, optimizer: str = "adam") -> CVAEProfile:
    """FLOPs / parameters / training memory of the whole CVAE (via :func:`edge_sdk.profiling.profile_model`)
    and FLOPs / parameters of the decoder alone (batch 1, FlopCounterMode)."""
    whole = profile_model(
        _LabelledProbe(model), model.input_shape, batch_size=batch_size, optimizer=optimizer
    )
    decoder = model.decoder
    param = next(decoder.parameters())
    z = torch.zeros((1, model.latent_dim), device=param.device, dtype=param.dtype)
    y = torch.zeros((1, model.num_classes), device=param.device, dtype=param.dtype)
    was_training = decoder.training
    try:
        decoder.eval()
        with torch.no_grad(), FlopCounterMode(display=False) as counter:
            decoder(z, y)
    finally:
        decoder.train(was_training)
    return CVAEProfile(
        model=whole,
        decoder_flops=int(counter.get_total_flops()),
        decoder_params=sum(p.numel() for p in decoder.parameters()),
    )


def cvae_cost(config: CVAEConfig, input_shape: tuple[int, int, int], num_classes: int) -> CVAEProfile:
    """What the CVAE of ``config`` (at its arch's width) costs, training at ``config.batch_size``: the probe a
    device's budget checks and plan read. Its weights do not matter, so the caller's RNG is left untouched."""
    with seeded(0):
        probe = build_cvae(config.arch, input_shape, num_classes)
    return profile_cvae(probe, batch_size=config.batch_size)


def fit_width(
    config: CVAEConfig, profile: DeviceProfile, input_shape: tuple[int, int, int], num_classes: int
) -> CVAEConfig:
    """``config`` with its width decided for ``profile``: a given width as it is (the training refuses it
    if it does not fit), else the widest of :data:`WIDTHS` whose whole CVAE fits (FLOPs, parameters,
    training memory at ``config.batch_size``). Raises ``BudgetError`` naming the narrowest one's excess
    when none does."""
    if config.width is not None:
        return config
    problem = None
    for width in WIDTHS:
        candidate = dataclasses.replace(config, width=width)
        problem = fits(cvae_cost(candidate, input_shape, num_classes).model, profile)
        if problem is None:
            return candidate
    raise BudgetError(
        f"no CVAE width of {list(WIDTHS)} fits the device: at {WIDTHS[-1]}, {problem}; fix: a smaller "
        "--cvae-latent-dim, --cvae-model cvae-small or a larger profile"
    )


# -------------------------------------------------------------------------------------- loss and training


def cvae_loss(model: CVAE, x: Tensor, y_onehot: Tensor, eps: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(loss, reconstruction, KL), each a per-sample mean over the batch (Eq. 3, reference reduction).

    x: N x C x H x W in [0, 1]; eps: N x latent. Reconstruction = BCE summed over pixels; KL =
    KL(N(mean, exp(logvar)) || N(0, I)) summed over latent dimensions.
    """
    mean, logvar = model.encoder(x, y_onehot)
    z = mean + eps * torch.exp(0.5 * logvar)
    logits = model.decoder.logits(z, y_onehot)
    n = x.shape[0]
    recon = F.binary_cross_entropy_with_logits(logits, x, reduction="sum") / n
    kl = -0.5 * torch.sum(1.0 + logvar - mean.pow(2) - logvar.exp()) / n
    return recon + kl, recon, kl


def _noise_generator(seed: int, stream: int, device: torch.device) -> torch.Generator:
    """A generator on ``device`` for the reparameterisation noise, independent of the batch-order stream."""
    entropy = np.random.SeedSequence([seed, stream]).generate_state(2, dtype=np.uint32)
    return torch.Generator(device=device).manual_seed((int(entropy[0]) << 32) | int(entropy[1]))


def _check_data(data: ArrayDataset, what: str) -> None:
    if not isinstance(data, ArrayDataset):
        raise DataError(f"{what} data must be an ArrayDataset, got {type(data).__name__}")
    if len(data) == 0:
        raise DataError(f"{what} split is empty; give it at least one image")


def train_cvae(
    data: ArrayDataset,
    *,
    config: CVAEConfig,
    seed: int,
    device: str | torch.device = "cpu",
    progress: bool = False,
) -> tuple[CVAE, list[dict[str, float]]]:
    """Build (seeded init) and train a CVAE on ``data`` (then fit its class prior, when the config has one);
    returns (the model, in eval mode on CPU, and per epoch the mean training ``loss`` = ``recon`` +
    ``kl_weight`` x ``kl``, with its two parts).

    Batches are slices of a seeded permutation of the preloaded uint8 split; the noise comes from a
    generator seeded from ``seed`` too, so the same data, config and seed give the same weights. The
    caller's global RNG is left as it was.
    """
    _check_data(data, "training")
    if not isinstance(config, CVAEConfig):
        raise ConfigError(f"config must be a CVAEConfig, got {type(config).__name__}")
    dev = resolve_device(device)
    with seeded(seed):
        model = build_cvae(config.arch, data.input_shape, data.num_classes)
    model.to(dev).train()
    x = data.x.to(dev)  # N x C x H x W uint8, converted per batch
    y = F.one_hot(data.y.to(dev), data.num_classes).float()  # N x K
    optimizer = adam(model.parameters(), lr=config.lr)
    noise = _noise_generator(seed, 1, dev)

    def batch_terms(idx: Tensor) -> dict[str, Tensor]:
        eps = torch.randn((len(idx), config.latent_dim), generator=noise, device=dev)
        _, recon, kl = cvae_loss(model, to_float(x[idx]), y[idx], eps)
        return {"loss": recon + config.kl_weight * kl, "recon": recon.detach(), "kl": kl.detach()}

    history = fit_terms(
        batch_terms,
        optimizer,
        n=len(data),
        batch_size=config.batch_size,
        epochs=config.epochs,
        generator=torch.Generator().manual_seed(seed),
        device=dev,
        desc="cvae",
        progress=progress,
        logged=("recon", "kl"),  # the parts get their own curves; the step is on their weighted sum
    )
    if config.class_prior:
        fit_class_prior(model, data)
    return model.cpu().eval(), history


@torch.no_grad()
def evaluate_cvae(
    model: CVAE,
    data: ArrayDataset,
    *,
    seed: int = 0,
    batch_size: int = 1024,
    device: str | torch.device = "cpu",
) -> dict[str, float]:
    """Per-sample mean ``loss``, ``recon`` and ``kl`` on ``data`` with seeded noise (eval mode)."""
    _check_data(data, "evaluation")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ConfigError(f"batch_size must be an integer >= 1, got {batch_size!r}")
    dev = resolve_device(device)
    was_training = model.training
    model.to(dev).eval()
    noise = _noise_generator(seed, 2, dev)
    sums = torch.zeros(3, dtype=torch.float64, device=dev)
    for start in range(0, len(data), batch_size):
        xb = to_float(data.x[start : start + batch_size].to(dev))
        yb = F.one_hot(data.y[start : start + batch_size].to(dev), data.num_classes).float()
        eps = torch.randn((len(xb), model.latent_dim), generator=noise, device=dev)
        terms = torch.stack(cvae_loss(model, xb, yb, eps)).double()
        sums += terms * len(xb)
    model.train(was_training)
    loss, recon, kl = (float(v) / len(data) for v in sums.cpu())
    return {"loss": loss, "recon": recon, "kl": kl}
