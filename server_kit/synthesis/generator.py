"""Conditional-generator synthesis (FedKDG section 3.2, with DENSE's optional regularisers).

Instead of optimising every pseudo-image (``server_kit.synthesis.inversion``), the server trains one small
conditional generator G(z, y) against the frozen teacher ensemble and then samples as many images as it
likes. The server knows only each client's label counts n_kc (they travel in the bundles), so:

* labels are drawn from the pooled counts sum_k n_kc, and z ~ N(0, I);
* the teachers' cross entropy on G(z, y) is weighted per client by its share of label y,
  w_ky = n_ky / sum_j n_jy (:func:`label_weighted_ce`): a client that never saw y has weight exactly 0,
  so its arbitrary prediction for y cannot pull the generator. (FedKDG prints a per-client weight
  n_k / N; the per-class share is the finer form of the same idea and the one FedGen uses.)
* a diversity term keeps G from collapsing each class onto one image (:func:`diversity_loss`);
* a noise filter F_g scores every sample by the norm of the teachers' loss gradient w.r.t. the sample,
  min-max normalised, and drops the highest-scoring fraction (:func:`gradient_noise_scores`,
  :func:`filter_noisy`): a large input gradient means the weighted teachers are far from confident in
  the conditioning label, i.e. the sample is ambiguous for the ensemble.

Optional, off unless weighted in: DeepInversion/DENSE BatchNorm-statistics matching on every teacher,
and DENSE's adversarial term (push the ensemble and a given student apart where they still agree).

The generator is exported to ONNX (inputs ``z`` N x nz and ``y`` N x L float, output ``x``) so that
personalization can reuse it; ``y`` is a one-hot row or any label distribution (FedKDG conditions on
p(Y)), which is why it is a float matrix rather than a class index.
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from common.checks import check_int, from_preset, is_number, make_real_dir
from common.device import resolve_device
from common.errors import BundleError, ConfigError
from common.loop import adam, step
from common.seeding import derive_seed, seeded
from common.torch_utils import INFER_BATCH, frozen
from edge_sdk.precision import autocast, resolve_precision
from export.atomic import atomic_write_bytes, atomic_write_json
from export.onnx_export import export_decoder_onnx, read_metadata
from export.weights import initializer_state_dict
from server_kit.synthesis.inversion import SyntheticSet
from server_kit.teachers import batch_statistics_gap, batchnorm_layers, class_shares, held_classes

__all__ = [
    "ConditionalGenerator",
    "GeneratorConfig",
    "diversity_loss",
    "ensemble_ce",
    "export_generator",
    "filter_noisy",
    "gradient_noise_scores",
    "label_weighted_ce",
    "load_generator",
    "sample_generator",
    "synthesize_generator",
    "train_generator",
]

ADAM_BETAS = (0.5, 0.999)  # DENSE / DCGAN: a low beta1 keeps a generator's Adam from overshooting
LEAKY_SLOPE = 0.2
GENERATOR_ROLE = "generator"  # ONNX metadata role of an exported generator
NO_TEACHER = -1  # SyntheticSet.teacher for generated samples: the whole ensemble made them

# fmt: off
_PRESETS: dict[str, dict[str, object]] = {
    # Measured on 10 MNIST teachers (alpha 0.5, 2 CPU threads), benchmarks/results/generator_tuning.md:
    # diversity and BN matching each raised the student's accuracy, the noise filter lowered it, and 60
    # steps of 64 at lr 1e-2 already bring the weighted CE near 0.06. samples = inversion's fast set size.
    # ens_weight 1: at alpha 0.1 the federation's label-weighted ensemble loss lifted the global model
    # with the same labels (benchmarks/RESULTS.md, "Label skew").
    "fast": dict(
        nz=64, width=32, steps=60, batch_size=64, lr=1e-2, ce_weight=1.0, div_weight=1.0, bn_weight=0.1,
        adv_weight=0.0, filter_fraction=0.0, samples=6000, tau=4.0, ens_weight=1.0,
    ),
}
# fmt: on


@dataclass(frozen=True, kw_only=True)
class GeneratorConfig:
    """Options of generator training and sampling.

    ``samples`` images are drawn after training; ``filter_fraction`` of them (floored) are then dropped by
    the noise filter, so ``samples - floor(filter_fraction * samples)`` come back. ``tau`` is the
    temperature of the adversarial KL (DENSE's T). ``filter_during_training`` also applies F_g to every
    training batch (FedKDG trains G on the filtered samples; costs one more backward per step).
    """

    nz: int  # noise size
    width: int  # channel width of the generator
    steps: int  # generator training steps
    batch_size: int
    lr: float  # Adam learning rate
    ce_weight: float  # weight of the teachers' cross entropy against the conditioning label
    div_weight: float  # diversity loss weight
    bn_weight: float  # BN-statistics matching weight
    adv_weight: float  # weight of the adversarial KL (DENSE; 0 = off)
    filter_fraction: float  # fraction of the noisiest generated samples dropped
    samples: int  # samples drawn from the trained generator
    tau: float  # temperature of the adversarial KL
    filter_during_training: bool = False  # the noise filter on every training batch too (FedKDG)
    # each teacher's cross entropy over the classes it holds only: its logits of classes it never trained
    # on are arbitrary on generated images
    mask_teachers: bool = False
    # cross entropy of the federation's label-weighted ensemble (teacher k's vote for class c scaled by
    # its share of c) against the conditioning label: a teacher holding y and one other class calls
    # anything "not the other class" y, so the per-teacher loss alone lets the generator make images
    # that the rest of the federation would call something else
    ens_weight: float = 0.0

    def __post_init__(self) -> None:
        for name in ("nz", "width", "steps", "samples"):
            check_int(name, getattr(self, name), 1)
        check_int("batch_size", self.batch_size, 2)  # BatchNorm and pairwise diversity need 2
        for name in ("lr", "tau"):
            value = getattr(self, name)
            if not is_number(value) or value <= 0:
                raise ConfigError(f"{name} must be a positive number, got {value!r}")
        for name in ("ce_weight", "div_weight", "bn_weight", "adv_weight", "ens_weight"):
            value = getattr(self, name)
            if not is_number(value) or value < 0:
                raise ConfigError(f"{name} must be a number >= 0, got {value!r}")
        if not is_number(self.filter_fraction) or not 0 <= self.filter_fraction < 1:
            raise ConfigError(f"filter_fraction must be in [0, 1), got {self.filter_fraction!r}")
        if not isinstance(self.filter_during_training, bool):
            raise ConfigError(f"filter_during_training must be a bool, got {self.filter_during_training!r}")
        if not isinstance(self.mask_teachers, bool):
            raise ConfigError(f"mask_teachers must be a bool, got {self.mask_teachers!r}")

    @classmethod
    def preset(cls, name: str = "fast", **overrides: object) -> GeneratorConfig:
        """A named preset (``fast``) with keyword overrides."""
        return from_preset(cls, _PRESETS, name, "generator", **overrides)

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


# ------------------------------------------------------------------------------------------- the network


class ConditionalGenerator(nn.Module):
    """G(z, y) -> N x C x H x W pixels in [0, 1] (DENSE's DCGAN-like layout, conditioned on the label).

    [z, y] -> Linear -> 2w x ceil(H/4) x ceil(W/4), BN -> (upsample x2, conv3, BN, LeakyReLU) twice, the
    second to w channels -> conv3 to C -> sigmoid, centre-cropped to H x W (so 28, 30 or 8 all work).
    ``y`` is N int64 class indices or an N x L float label distribution (one-hot for a class).
    """

    def __init__(self, *, nz: int, num_classes: int, input_shape: tuple[int, int, int], width: int) -> None:
        super().__init__()
        c, h, w = _check_shape(input_shape)
        self.nz, self.num_classes, self.input_shape, self.width = nz, num_classes, (c, h, w), width
        h0, w0 = math.ceil(h / 4), math.ceil(w / 4)
        # centre crop when H or W is not a multiple of 4 (a Python constant: nothing for the tracer)
        self._crop = ((4 * h0 - h) // 2, (4 * w0 - w) // 2) if (4 * h0, 4 * w0) != (h, w) else None
        self.project = nn.Linear(nz + num_classes, 2 * width * h0 * w0)
        self.seed_shape = (2 * width, h0, w0)
        self.body = nn.Sequential(
            nn.BatchNorm2d(2 * width),
            nn.Upsample(scale_factor=2, mode="nearest"),
            nn.Conv2d(2 * width, 2 * width, 3, padding=1, bias=False),
            nn.BatchNorm2d(2 * width),
            nn.LeakyReLU(LEAKY_SLOPE),
            nn.Upsample(scale_factor=2, mode="nearest"),
            nn.Conv2d(2 * width, width, 3, padding=1, bias=False),
            nn.BatchNorm2d(width),
            nn.LeakyReLU(LEAKY_SLOPE),
            nn.Conv2d(width, c, 3, padding=1),
        )

    def forward(self, z: Tensor, y: Tensor) -> Tensor:  # z: N x nz, y: N (int64) or N x L (float)
        if y.ndim == 1:
            y = F.one_hot(y, self.num_classes).to(z.dtype)
        seed = self.project(torch.cat([z, y], dim=1)).reshape(-1, *self.seed_shape)  # N x 2w x h0 x w0
        x = torch.sigmoid(self.body(seed))  # N x C x 4h0 x 4w0
        if self._crop is None:
            return x
        top, left = self._crop
        _, h, w = self.input_shape
        return x[:, :, top : top + h, left : left + w]


def _check_shape(input_shape: Sequence[int]) -> tuple[int, int, int]:
    shape = tuple(input_shape)
    if len(shape) != 3 or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in shape):
        raise ConfigError(f"input_shape must be three positive ints (C, H, W), got {input_shape!r}")
    return shape  # type: ignore[return-value]


def build_generator(
    config: GeneratorConfig, *, num_classes: int, input_shape: tuple[int, int, int], seed: int
) -> ConditionalGenerator:
    """A freshly initialised generator; its weights are a function of ``seed`` only."""
    with seeded(seed):  # nn init draws from the global RNG: scope and seed it
        return ConditionalGenerator(
            nz=config.nz, num_classes=num_classes, input_shape=input_shape, width=config.width
        )


# ------------------------------------------------------------------------------------------- losses


def _weighted_ce_per_sample(
    teacher_logits: Tensor, y: Tensor, class_weights: Tensor, held: Tensor | None = None
) -> Tensor:
    """N values sum_k w_k,y_n * CE(T_k(x_n), y_n) for teacher_logits K x N x L, y N, weights K x L.

    With ``held`` (K x L bool) teacher k's softmax runs over the classes it holds only, where it holds
    y_n (a teacher that does not hold y_n has weight 0 on it, unless no teacher holds y_n).
    """
    logits = teacher_logits.float()
    index = y.view(1, -1, 1).expand(logits.shape[0], -1, 1)  # K x N x 1
    nll = -F.log_softmax(logits, dim=2).gather(2, index).squeeze(2)  # K x N
    if held is not None:
        mask = held.to(logits.device).unsqueeze(1)  # K x 1 x L
        masked = -F.log_softmax(logits.masked_fill(~mask, -math.inf), dim=2).gather(2, index).squeeze(2)
        holds_y = held.to(logits.device).index_select(1, y)  # K x N
        nll = torch.where(holds_y, masked, nll)
    weight = class_weights.to(logits).index_select(1, y)  # K x N: teacher k's share of label y_n
    return (weight * nll).sum(dim=0)  # N


def label_weighted_ce(
    teacher_logits: Tensor, y: Tensor, class_weights: Tensor, held: Tensor | None = None
) -> Tensor:
    """Mean over samples of the label-share-weighted teacher cross entropies (FedKDG's L_ce).

    ``class_weights`` is K x L with w_kc = n_kc / sum_j n_jc
    (:func:`server_kit.teachers.counts.class_shares`),
    so for every label seen by some client the weights sum to 1 over teachers, and a teacher that never
    saw c contributes exactly nothing for c. One teacher holding every class gives plain cross entropy.
    ``held`` (K x L bool, :func:`server_kit.teachers.counts.held_classes`) takes each teacher's softmax over
    its own
    classes only.
    """
    if teacher_logits.ndim != 3:
        raise ConfigError(f"teacher_logits must be K x N x L, got shape {tuple(teacher_logits.shape)}")
    k, n, num_classes = teacher_logits.shape
    if tuple(y.shape) != (n,) or y.dtype != torch.int64:
        raise ConfigError(f"y must be {n} int64 class indices, got {y.dtype} {tuple(y.shape)}")
    if tuple(class_weights.shape) != (k, num_classes):
        raise ConfigError(f"class_weights must be {k} x {num_classes}, got {tuple(class_weights.shape)}")
    if held is not None and tuple(held.shape) != (k, num_classes):
        raise ConfigError(f"held must be {k} x {num_classes}, got {tuple(held.shape)}")
    return _weighted_ce_per_sample(teacher_logits, y, class_weights, held).mean()


def ensemble_ce(teacher_logits: Tensor, y: Tensor, class_weights: Tensor) -> Tensor:
    """Mean over samples of -log p_y, p the label-weighted ensemble p_c = sum_k w_kc softmax(T_k)_c
    renormalised over c (the rule that is right on real images; see server_kit.labelling.labels)."""
    probs = F.softmax(teacher_logits.float(), dim=2) * class_weights.to(teacher_logits).unsqueeze(1)
    total = probs.sum(dim=0)  # N x L
    log_p = total.clamp(min=1e-12).log() - total.sum(dim=1, keepdim=True).clamp(min=1e-12).log()
    return -log_p.gather(1, y.view(-1, 1)).mean()


def diversity_loss(x: Tensor, z: Tensor, y: Tensor) -> Tensor:
    """FedKDG's L_div in a bounded mode-seeking form: exp(-mean over same-label pairs of d_x / d_z).

    FedKDG writes L_div as the expected squared distance between two samples of one condition; minimised
    as printed it would collapse G, so the distance must be rewarded. Rewarding it raw is unbounded and
    would drown the cross entropy, so (i) the image distance is divided by the noise distance (mode
    seeking, Mao et al. 2019: nearby noises may give nearby images, far ones must not), with both as mean
    squared differences per element so the value does not depend on resolution or nz, and (ii) it is
    squashed by exp(-.) as FedGen does: 1 for a collapsed class, towards 0 for a diverse one. Only pairs
    with the same label count: different labels differ anyway through the cross entropy.
    """
    n = x.shape[0]
    flat_x = x.reshape(n, -1)
    d_x = torch.cdist(flat_x, flat_x).square() / flat_x.shape[1]  # N x N mean squared pixel difference
    d_z = torch.cdist(z, z).square() / z.shape[1]  # N x N
    same = (y.view(-1, 1) == y.view(1, -1)) & ~torch.eye(n, dtype=torch.bool, device=x.device)
    if not same.any():
        return x.new_zeros(())
    ratio = d_x[same] / d_z[same].clamp(min=1e-8)
    return torch.exp(-ratio.mean())


class _BatchNormMatch:
    """DeepInversion/DENSE: hooks on every teacher's BatchNorm2d comparing the batch statistics of its
    input with the running ones; :meth:`pop` averages sum_l ||mu - mu_run|| + ||var - var_run|| over
    the teachers (averaged, so the weight does not scale with K)."""

    def __init__(self, modules: Sequence[nn.Module]) -> None:
        self.terms: list[Tensor] = []
        self.count = len(modules)
        self.handles = [bn.register_forward_hook(self._hook) for m in modules for bn in batchnorm_layers(m)]

    def _hook(self, bn: nn.Module, inputs: tuple[Tensor, ...], _output: Tensor) -> None:
        self.terms.append(batch_statistics_gap(bn, inputs[0]))  # type: ignore[arg-type]

    def pop(self) -> Tensor | None:
        terms, self.terms = self.terms, []
        return torch.stack(terms).sum() / self.count if terms else None

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def _ensemble_probs(
    teacher_logits: Tensor, y: Tensor, class_weights: Tensor, held: Tensor | None, tau: float
) -> Tensor:
    """N x L conditioned ensemble (server_kit.labelling.labels' "conditioned" rule): teacher k weighted by
    its share
    of the sample's label y_n, its softmax over its held classes when ``held`` is given; rows sum to 1."""
    logits = teacher_logits / tau
    if held is not None:
        logits = logits.masked_fill(~held.unsqueeze(1), -math.inf)
    weight = class_weights.to(logits).index_select(1, y).unsqueeze(2)  # K x N x 1
    total = (F.softmax(logits, dim=2) * weight).sum(dim=0)  # N x L
    return total / total.sum(dim=1, keepdim=True).clamp(min=1e-12)


def _adversarial_loss(student_logits: Tensor, ensemble: Tensor, tau: float) -> Tensor:
    """DENSE: -KL(ensemble || student) on the samples where both still agree on the class.

    Samples the student already gets wrong are masked out: pushing them further only produces noise.
    """
    log_s = F.log_softmax(student_logits / tau, dim=1)
    kl = (ensemble * (ensemble.clamp(min=1e-12).log() - log_s)).sum(dim=1)  # N
    agree = (student_logits.argmax(dim=1) == ensemble.argmax(dim=1)).to(kl)
    return -(kl * agree).mean()


# ------------------------------------------------------------------------------------------- noise filter


def gradient_noise_scores(
    teachers: Sequence[nn.Module],
    x: Tensor,
    y: Tensor,
    class_weights: Tensor,
    *,
    batch_size: int = INFER_BATCH,
    device: str | torch.device = "cpu",
) -> Tensor:
    """FedKDG's F_g: per-sample ||d L_ce / d x_n||_2 of the label-weighted teacher loss, min-max scaled.

    Teachers run in eval mode, so sample n's loss depends on x_n alone and one backward of the summed
    loss yields every per-sample gradient at once. Returns N float32 scores in [0, 1] on the CPU (all
    zeros when every sample scores the same).
    """
    if not teachers:
        raise ConfigError("gradient_noise_scores needs at least one teacher")
    if x.shape[0] != y.shape[0]:
        raise ConfigError(f"x has {x.shape[0]} samples but y {y.shape[0]}")
    check_int("batch_size", batch_size, 1)
    dev = resolve_device(device)
    weights = class_weights.to(dev)
    norms = []
    with contextlib.ExitStack() as stack:
        modules = [stack.enter_context(frozen(m.to(dev))) for m in teachers]
        for i in range(0, x.shape[0], batch_size):
            xb = x[i : i + batch_size].to(dev).float().requires_grad_(True)
            logits = torch.stack([m(xb) for m in modules])  # K x B x L
            loss = _weighted_ce_per_sample(logits, y[i : i + batch_size].to(dev), weights).sum()
            (grad,) = torch.autograd.grad(loss, xb)
            norms.append(torch.linalg.vector_norm(grad.flatten(1), dim=1).detach().cpu())
    raw = torch.cat(norms) if norms else torch.zeros(0)
    return _min_max(raw)


def _min_max(values: Tensor) -> Tensor:
    if values.numel() == 0:
        return values.float()
    low, high = values.min(), values.max()
    if not high > low:
        return torch.zeros_like(values, dtype=torch.float32)
    return ((values - low) / (high - low)).float()


def filter_noisy(scores: Tensor, fraction: float) -> Tensor:
    """Keep mask (N bool) dropping the floor(fraction * N) highest scores; 0 keeps everything.

    Floor, so the filter never removes more than asked. Ties at the cut are dropped in index order
    (a stable sort), which makes the mask a pure function of the scores.
    """
    if scores.ndim != 1:
        raise ConfigError(f"scores must be a 1-D tensor, got shape {tuple(scores.shape)}")
    if not is_number(fraction) or not 0 <= fraction < 1:
        raise ConfigError(f"fraction must be in [0, 1), got {fraction!r}")
    n = scores.shape[0]
    drop = math.floor(fraction * n)
    keep = torch.ones(n, dtype=torch.bool, device=scores.device)
    if drop:
        order = torch.sort(scores, descending=True, stable=True).indices
        keep[order[:drop]] = False
    return keep


# ------------------------------------------------------------------------------------------- training


def _label_inputs(label_counts: Sequence[Sequence[int]], num_teachers: int, num_classes: int) -> Tensor:
    """Validate K x L counts; returns the K x L float64 tensor."""
    counts = torch.as_tensor([list(row) for row in label_counts], dtype=torch.float64)
    if counts.ndim != 2 or tuple(counts.shape) != (num_teachers, num_classes):
        raise ConfigError(
            f"label_counts must be {num_teachers} rows (one per teacher) of {num_classes} counts, "
            f"got shape {tuple(counts.shape)}"
        )
    if (counts < 0).any() or counts.sum() <= 0:
        raise ConfigError("label_counts must be >= 0 with at least one example in total")
    return counts


def _label_distribution(label_counts_pooled: Sequence[int] | Tensor) -> Tensor:
    pooled = torch.as_tensor(label_counts_pooled, dtype=torch.float64).flatten()
    if pooled.numel() < 2 or (pooled < 0).any() or not pooled.sum() > 0 or not torch.isfinite(pooled).all():
        raise ConfigError(
            f"label_counts_pooled must be >= 2 finite counts >= 0 with a positive sum, got {pooled.tolist()}"
        )
    return pooled / pooled.sum()


def train_generator(
    teachers: Sequence[nn.Module],
    label_counts: Sequence[Sequence[int]],
    *,
    input_shape: tuple[int, int, int],
    num_classes: int,
    config: GeneratorConfig,
    seed: int,
    device: str | torch.device = "cpu",
    progress: bool = False,
    student: nn.Module | None = None,
    generator: ConditionalGenerator | None = None,
    steps: int | None = None,
    precision: str = "auto",
) -> tuple[ConditionalGenerator, list[dict[str, float]]]:
    """Train G against the frozen teachers; returns (G in eval mode on ``device``, one loss dict a step).

    ``generator`` continues training a given G (in place) for ``steps`` (default ``config.steps``) instead
    of building one from ``seed``; adversarial distillation alternates such short runs with the student.

    Each step draws labels from the pooled label counts and z ~ N(0, I), and minimises
    ce_weight * L_ce + div_weight * L_div + bn_weight * L_bn + adv_weight * L_adv + ens_weight * L_ens.
    The adversarial term needs ``student`` (used frozen, as it is) and is 0 without one. Every dict holds
    ``total``, ``ce``, ``div``, ``bn``, ``adv``, ``ens`` (and ``kept``, the fraction of the batch the
    in-training filter kept).
    Teachers (and the student) are in eval mode with frozen parameters during the call, restored after;
    their forward passes run at ``precision`` (:mod:`edge_sdk.precision`), G and the losses in float32.
    """
    if not teachers:
        raise ConfigError("train_generator needs at least one teacher")
    shape = _check_shape(input_shape)
    check_int("num_classes", num_classes, 2)
    counts = _label_inputs(label_counts, len(teachers), num_classes)
    dev = resolve_device(device)
    precision = resolve_precision(precision, dev)
    weights = class_shares(counts).to(dev)  # K x L
    held = held_classes(counts).to(dev) if config.mask_teachers else None
    label_probs = (counts.sum(dim=0) / counts.sum()).float()  # L, pooled label distribution
    steps = config.steps if steps is None else check_int("steps", steps, 1)
    if generator is None:
        generator = build_generator(
            config, num_classes=num_classes, input_shape=shape, seed=derive_seed(seed, 0)
        )
    generator.to(dev).train()
    optimizer = adam(generator.parameters(), lr=config.lr, betas=ADAM_BETAS)
    stream = torch.Generator().manual_seed(derive_seed(seed, 1))  # labels and noise, drawn on the CPU
    adversary = student if config.adv_weight > 0 else None
    losses: list[dict[str, float]] = []
    bar = _progress(steps, progress)
    with contextlib.ExitStack() as stack:
        modules = [stack.enter_context(frozen(m.to(dev))) for m in teachers]
        if adversary is not None:
            stack.enter_context(frozen(adversary.to(dev)))
        bn_match = _BatchNormMatch(modules) if config.bn_weight > 0 else None
        if bn_match is not None:
            stack.callback(bn_match.remove)
        for _ in range(steps):
            y = torch.multinomial(label_probs, config.batch_size, replacement=True, generator=stream).to(dev)
            z = torch.randn((config.batch_size, config.nz), generator=stream).to(dev)
            total, terms, kept = _losses(
                generator, modules, adversary, bn_match, y, z, weights, held, config, (precision, dev)
            )
            step(optimizer, total)
            values = torch.stack([total, *terms]).detach().cpu().tolist()  # one sync a step
            names = ("total", "ce", "div", "bn", "adv", "ens")
            losses.append({**dict(zip(names, values, strict=True)), "kept": kept})
            if bar is not None:
                bar.set_postfix(ce=f"{values[1]:.3f}", div=f"{values[2]:.3f}")
                bar.update(1)
    if bar is not None:
        bar.close()
    return generator.eval(), losses


def _losses(
    generator: ConditionalGenerator,
    modules: Sequence[nn.Module],
    adversary: nn.Module | None,
    bn_match: _BatchNormMatch | None,
    y: Tensor,
    z: Tensor,
    weights: Tensor,
    held: Tensor | None,
    config: GeneratorConfig,
    where: tuple[str, torch.device],
) -> tuple[Tensor, list[Tensor], float]:
    """One step's weighted total, its terms (ce, div, bn, adv, ens) and the share of the batch the
    in-training filter kept."""
    precision, dev = where
    x = generator(z, y)  # B x C x H x W
    with autocast(precision, dev):
        logits = torch.stack([m(x) for m in modules]).float()  # K x B x L
    per_sample = _weighted_ce_per_sample(logits, y, weights, held)  # B
    kept = 1.0
    if config.filter_during_training and config.filter_fraction > 0:
        (grad,) = torch.autograd.grad(per_sample.sum(), x, retain_graph=True)
        keep = filter_noisy(
            _min_max(torch.linalg.vector_norm(grad.flatten(1), dim=1)), config.filter_fraction
        )
        per_sample, kept = per_sample[keep], float(keep.float().mean())
    ce = per_sample.mean()
    zero = ce.new_zeros(())
    div = diversity_loss(x, z, y) if config.div_weight > 0 else zero
    ens = ensemble_ce(logits, y, weights) if config.ens_weight > 0 else zero
    bn_term = bn_match.pop() if bn_match is not None else None
    bn = bn_term if bn_term is not None else zero  # None: the teachers have no BatchNorm
    adv = zero
    if adversary is not None:
        with autocast(precision, dev):
            student_logits = adversary(x).float()
        adv = _adversarial_loss(
            student_logits, _ensemble_probs(logits, y, weights, held, config.tau), config.tau
        )
    total = (
        config.ce_weight * ce + config.div_weight * div + config.bn_weight * bn
        + config.adv_weight * adv + config.ens_weight * ens
    )  # fmt: skip
    return total, [ce, div, bn, adv, ens], kept


@torch.no_grad()
def sample_generator(
    generator: ConditionalGenerator,
    label_counts_pooled: Sequence[int] | Tensor,
    *,
    n: int,
    seed: int,
    device: str | torch.device = "cpu",
    batch_size: int = INFER_BATCH,
) -> tuple[Tensor, Tensor]:
    """``n`` samples (x float32 N x C x H x W in [0, 1] on the CPU, y int64 N) from G in eval mode.

    Labels are drawn i.i.d. from the pooled label counts (all the server knows about the data), then
    z ~ N(0, I), both on the CPU from ``seed``, so the draw does not depend on the device. Eval mode
    makes each sample independent of the batch it is generated in. G's train/eval mode is restored.
    """
    check_int("n", n, 1)
    check_int("batch_size", batch_size, 1)
    probs = _label_distribution(label_counts_pooled).float()
    if probs.numel() != generator.num_classes:
        raise ConfigError(
            f"label_counts_pooled has {probs.numel()} classes, the generator {generator.num_classes}"
        )
    stream = torch.Generator().manual_seed(seed)
    y = torch.multinomial(probs, n, replacement=True, generator=stream)  # N
    z = torch.randn((n, generator.nz), generator=stream)  # N x nz
    dev = resolve_device(device)
    was_training = generator.training
    generator.to(dev).eval()
    try:
        x = torch.cat(
            [
                generator(z[i : i + batch_size].to(dev), y[i : i + batch_size].to(dev)).cpu()
                for i in range(0, n, batch_size)
            ]
        )
    finally:
        generator.train(was_training)
    return x.float(), y


def synthesize_generator(
    teachers: Sequence[nn.Module],
    label_counts: Sequence[Sequence[int]],
    *,
    input_shape: tuple[int, int, int],
    num_classes: int,
    config: GeneratorConfig,
    seed: int,
    device: str | torch.device = "cpu",
    progress: bool = False,
    work_dir: str | Path | None = None,
    student: nn.Module | None = None,
    precision: str = "auto",
) -> tuple[SyntheticSet, ConditionalGenerator, list[dict[str, float]]]:
    """Train G, draw ``config.samples``, drop the noisiest ``filter_fraction``; (set, G, loss curve).

    The set's ``target_class`` is the conditioning label and its ``teacher`` is ``NO_TEACHER`` (-1): the
    whole ensemble made every sample. With ``work_dir`` G is written there as ``generator.onnx`` (see
    :func:`export_generator`; reload with :func:`load_generator`) next to ``generator.json`` (config,
    seed, label counts and the loss curve).
    """
    generator, losses = train_generator(
        teachers, label_counts, input_shape=input_shape, num_classes=num_classes, config=config,
        seed=seed, device=device, progress=progress, student=student, precision=precision,
    )  # fmt: skip
    counts = _label_inputs(label_counts, len(teachers), num_classes)
    x, y = sample_generator(
        generator, counts.sum(dim=0), n=config.samples, seed=derive_seed(seed, 2), device=device
    )
    if config.filter_fraction > 0:
        weights = class_shares(counts)
        scores = gradient_noise_scores(teachers, x, y, weights, device=device)
        keep = filter_noisy(scores, config.filter_fraction)
        x, y = x[keep], y[keep]
    synthetic = SyntheticSet(x=x, teacher=torch.full_like(y, NO_TEACHER), target_class=y)
    if work_dir is not None:
        work = make_real_dir(work_dir, what="generator work folder")
        atomic_write_bytes(work / "generator.onnx", export_generator(generator, seed=seed))
        atomic_write_json(
            work / "generator.json",
            {
                "config": config.to_dict(),
                "seed": seed,
                "num_classes": num_classes,
                "input_shape": list(_check_shape(input_shape)),
                "label_counts": counts.long().tolist(),
                "kept": len(synthetic),
                "losses": losses,
            },
        )
    return synthetic, generator, losses


# ------------------------------------------------------------------------------------------- ONNX


def export_generator(generator: ConditionalGenerator, *, seed: int = 0, atol: float = 1e-4) -> bytes:
    """Validated ONNX bytes of G (eval mode): inputs ``z`` (N x nz) and ``y`` (N x L float), output ``x``.

    Goes through :func:`export.onnx_export.export_decoder_onnx` (the CVAE decoder has the same (z, y) -> x
    interface): BatchNorm stays in the graph and every initializer keeps its state_dict name, so
    :func:`load_generator` rebuilds G exactly from the metadata (``role``, ``latent_dim``, ``num_classes``,
    ``output_shape``, ``width``) and :mod:`export.weights`.
    """
    return export_decoder_onnx(
        generator,
        latent_dim=generator.nz,
        num_classes=generator.num_classes,
        output_shape=generator.input_shape,
        metadata={"role": GENERATOR_ROLE, "width": str(generator.width), "producer": "server-kit"},
        seed=seed,
        atol=atol,
    )


def load_generator(model_bytes: bytes) -> ConditionalGenerator:
    """Rebuild G (eval mode, CPU) from an ONNX file written by :func:`export_generator`."""
    meta = read_metadata(model_bytes)
    if meta.get("role") != GENERATOR_ROLE:
        raise BundleError(
            f"not a generator export (metadata role {meta.get('role')!r}); "
            "fix: write it with export_generator"
        )
    try:
        shape = tuple(int(v) for v in json.loads(meta["output_shape"]))
        generator = ConditionalGenerator(
            nz=int(meta["latent_dim"]),
            num_classes=int(meta["num_classes"]),
            input_shape=shape,  # type: ignore[arg-type]
            width=int(meta["width"]),
        )
    except (KeyError, ValueError, TypeError, ConfigError) as err:
        raise BundleError(f"generator metadata is incomplete or malformed ({err}): {meta}") from err
    generator.load_state_dict(initializer_state_dict(model_bytes, generator), strict=True)
    return generator.eval()


# ------------------------------------------------------------------------------------------- progress


def _progress(total: int, enabled: bool):  # -> tqdm | None
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc="generator", unit="step")
