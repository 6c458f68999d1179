"""Model-specific pseudo-image inversion (pFedZKD Algorithm 3, after ZSKD by Nayak et al. 2019).

For every teacher the server reads the class-similarity matrix C off the classifier head, samples soft
targets y ~ Dir(beta * C_c) for every class c and every beta, and optimises noise images until the
teacher's temperature-softened prediction matches y. Small beta gives near one-hot targets (clean class
prototypes); beta = 1 spreads mass over similar classes (decision-boundary samples).

Choices this module makes (the paper leaves them open):

* Images live in an unconstrained parameter space, x = sigmoid(p) with p ~ N(0, 1) at start (the paper
  initialises from a standard normal): every step yields valid [0, 1] pixels without clipping, and
  gradients never vanish at a clip boundary. Color images start instead from dead-leaves pictures
  (``InversionConfig.start``, :mod:`server_kit.synthesis.leaves`): from noise, the few convolutions of
  a device's model move pixels toward a class without ever making a picture of one.
* Cosine similarities can be negative, Dirichlet concentrations must be positive: each row is min-max
  scaled to [0, 1] (as ZSKD does) and clamped at ``CONCENTRATION_EPS``.
* A teacher's samples are interleaved over (class, beta) groups and cut into chunks of ``batch_size``;
  each chunk is optimised as one batch (classes mixed, which also keeps the batch statistics seen by
  the optional BN-matching loss close to the teacher's training mixture).
* Every (teacher, chunk) draws from its own generator derived from ``seed``, so a resumed run produces
  exactly the tensor an uninterrupted run does. Outputs are rounded to float16 (the storage type of the
  resume chunks) whether or not a ``work_dir`` is used, so both paths agree bit for bit.

Optional regularisers (all off by default, which is the paper's method): DeepInversion BN-statistics
matching, total variation and an l2 pixel prior.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from common.checks import differences, from_preset, is_number, make_real_dir
from common.device import resolve_device
from common.errors import ConfigError, DataError
from common.loop import adam, step
from common.seeding import derive_seed
from common.torch_utils import frozen
from edge_sdk.augment import PAD_SHARE, is_color
from edge_sdk.precision import autocast, resolve_precision
from export.atomic import atomic_write_bytes, atomic_write_json
from server_kit.synthesis.leaves import dead_leaves
from server_kit.teachers import batch_statistics_gap, classifier_weight, map_teachers

__all__ = [
    "CONCENTRATION_EPS",
    "InversionConfig",
    "SyntheticSet",
    "class_similarity",
    "dirichlet_targets",
    "invert_teacher",
    "synthesize_inversion",
]

CONCENTRATION_EPS = 1e-3
STARTS = ("noise", "leaves")  # where inversion's images start (InversionConfig.start)
LEAVES_MARGIN = 0.05  # a dead-leaves start's pixels are clamped to [m, 1 - m] before sigmoid's inverse
NATURAL_JITTER = 1 / PAD_SHARE  # the shift prior on color images: the devices' crop, 1/8 of the side
_WORK_FORMAT = 1

_PRESETS: dict[str, dict[str, object]] = {
    # CPU minutes for 10 MNIST-sized teachers. 200 per teacher with the BN prior is what the measured MNIST
    # rows use (benchmarks/RESULTS.md, "Synthesis sources"); pooled with the generator it is the default.
    # 30 Adam steps at twice the rate travel as far as 60 did, for half the teachers' passes (RESULTS.md,
    # "Half the inversion's steps")
    "fast": dict(samples_per_teacher=200, steps=30, batch_size=200, lr=0.2, tau=4.0, bn_weight=1.0),
    # The paper: N_syn = 4000 per teacher (MNIST), beta {0.1, 1.0}; steps, lr and tau for inversion are
    # not given there and follow ZSKD (1500 Adam iterations, lr 0.01, temperature 20).
    "paper": dict(samples_per_teacher=4000, steps=1500, batch_size=100, lr=0.01, tau=20.0),
}


@dataclass(frozen=True, kw_only=True)
class InversionConfig:
    """Options of Algorithm 3. ``samples_per_teacher`` is the paper's N_syn, ``steps`` its ep."""

    samples_per_teacher: int  # pseudo-samples inverted from each teacher (N_syn)
    steps: int  # optimisation steps per inversion batch (ep)
    batch_size: int  # images optimised together
    lr: float  # Adam learning rate of the images
    tau: float  # temperature of the inversion loss
    betas: tuple[float, ...] = (0.1, 1.0)  # scales beta of the targets y ~ Dir(beta * C_c), samples split
    bn_weight: float = 0.0  # DeepInversion: match BN-input batch mean/var to the running statistics
    tv_weight: float = 0.0  # total variation (mean absolute neighbour difference)
    l2_weight: float = 0.0  # mean squared pixel value: a dark-background prior
    # DeepInversion's image priors, so the images keep their class under the moves a natural image
    # survives rather than fit one pixel grid. The teacher sees each step's batch rolled by a random
    # offset of up to this fraction of the side (0: off); none: 1/8 for color images, else 0
    jitter: float | None = None
    # the teacher sees each step's batch mirrored left-right with probability 1/2; none: for color images
    flip: bool | None = None
    # "all": every teacher is inverted for every class (the paper); "held": only for the classes its label
    # counts hold, in proportion to them (an image a teacher makes for a class it never saw is noise)
    classes: Literal["all", "held"] = "all"
    # where the images start: "noise" (x = sigmoid(p), p ~ N(0, 1): the paper) or "leaves", dead-leaves
    # pictures (server_kit.synthesis.leaves), so the images keep a camera's edges and flat regions while
    # they move toward their class; none: leaves for color images, noise for the rest
    start: Literal["noise", "leaves"] | None = None

    def __post_init__(self) -> None:
        for name in ("samples_per_teacher", "steps", "batch_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        for name in ("lr", "tau"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
                raise ConfigError(f"{name} must be a positive number, got {value!r}")
        if not isinstance(self.betas, tuple) or not self.betas:
            raise ConfigError(f"betas must be a non-empty tuple of positive numbers, got {self.betas!r}")
        for beta in self.betas:
            if not isinstance(beta, int | float) or not math.isfinite(beta) or beta <= 0:
                raise ConfigError(f"every beta must be a positive number, got {self.betas!r}")
        for name in ("bn_weight", "tv_weight", "l2_weight"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
                raise ConfigError(f"{name} must be a number >= 0, got {value!r}")
        if self.classes not in ("all", "held"):
            raise ConfigError(f"classes must be 'all' or 'held', got {self.classes!r}")
        if self.jitter is not None and (not is_number(self.jitter) or not 0 <= self.jitter < 0.5):
            raise ConfigError(f"jitter must be a fraction of the side in [0, 0.5), got {self.jitter!r}")
        if self.flip is not None and not isinstance(self.flip, bool):
            raise ConfigError(f"flip must be true, false or none, got {self.flip!r}")
        if self.start not in (None, *STARTS):
            raise ConfigError(f"start must be one of {STARTS} or none (from the images), got {self.start!r}")

    def for_images(self, input_shape: tuple[int, int, int]) -> InversionConfig:
        """``jitter``, ``flip`` and ``start`` decided where None: for color images
        (:func:`edge_sdk.augment.is_color`) a shift of up to 1/8 of the side (DeepInversion's 30 of 224
        pixels), the flip and dead-leaves starts; for the rest no moves (a mirrored digit is no digit)
        and noise, as the paper starts."""
        color = is_color(input_shape)
        jitter = (NATURAL_JITTER if color else 0.0) if self.jitter is None else self.jitter
        flip = color if self.flip is None else self.flip
        start = ("leaves" if color else "noise") if self.start is None else self.start
        return replace(self, jitter=jitter, flip=flip, start=start)

    @classmethod
    def preset(cls, name: str = "fast", **overrides: object) -> InversionConfig:
        """A named preset (``fast``, ``paper``, ``quality``) with keyword overrides."""
        if "betas" in overrides and isinstance(overrides["betas"], list):
            overrides["betas"] = tuple(overrides["betas"])
        return from_preset(cls, _PRESETS, name, "inversion", **overrides)

    def to_dict(self) -> dict[str, object]:
        """The fields; ``jitter`` and ``flip`` only when on and ``start`` only when not noise, so inversion
        chunks and reports made before they existed still match their settings on resume."""
        out = asdict(self)
        out["betas"] = list(self.betas)
        if out["jitter"] is None or out["jitter"] == 0:
            del out["jitter"]
        if not out["flip"]:  # None (undecided) or False
            del out["flip"]
        if out["start"] in (None, "noise"):
            del out["start"]
        return out


@dataclass(frozen=True)
class SyntheticSet:
    """The global pseudo-image set X: images, which teacher made each one, and its target class."""

    x: Tensor  # N x C x H x W float32 in [0, 1]
    teacher: Tensor  # N int64, index of the generating teacher
    target_class: Tensor  # N int64, the class c whose similarity row the soft target was drawn from

    def __len__(self) -> int:
        return int(self.x.shape[0])


def class_similarity(weight: Tensor) -> Tensor:
    """Cosine similarity between the rows of a classifier weight (L x d -> L x L)."""
    if weight.ndim != 2 or weight.shape[0] < 2:
        raise ConfigError(f"classifier weight must be L x d with L >= 2, got shape {tuple(weight.shape)}")
    unit = F.normalize(weight.detach().double(), dim=1)  # L x d
    return (unit @ unit.T).clamp(-1.0, 1.0).float()  # L x L


def _concentration(similarity_row: Tensor) -> Tensor:
    """Similarity row (values in [-1, 1]) -> positive Dirichlet concentration in [eps, 1]."""
    row = similarity_row.detach().double()
    low, high = row.min(), row.max()
    scaled = (row - low) / (high - low) if high > low else torch.ones_like(row)
    return scaled.clamp(min=CONCENTRATION_EPS)


def dirichlet_targets(similarity_row: Tensor, beta: float, n: int, generator: torch.Generator) -> Tensor:
    """``n`` soft targets (n x L, float32) drawn from Dir(beta * concentration(similarity_row)).

    The row is min-max scaled to [0, 1] and clamped at ``CONCENTRATION_EPS`` (Dirichlet parameters must
    be > 0). torch's Dirichlet sampler cannot take a generator, so one integer is drawn from
    ``generator`` to seed numpy's sampler, which also copes with the tiny concentrations of beta = 0.1.
    """
    if beta <= 0:
        raise ConfigError(f"beta must be > 0, got {beta}")
    alpha = (beta * _concentration(similarity_row)).numpy()  # L
    rng_seed = int(torch.randint(0, 2**62, (1,), generator=generator))
    samples = np.random.default_rng(rng_seed).dirichlet(alpha, size=n)  # n x L
    return torch.from_numpy(samples).float()


# ------------------------------------------------------------------------------------------- planning


def apportion(total: int, weights: Sequence[float]) -> list[int]:
    """``total`` split over ``weights`` (>= 0, positive sum) by largest remainder; lower index wins ties."""
    w = [float(v) for v in weights]
    if not w or any(not math.isfinite(v) or v < 0 for v in w) or not sum(w) > 0:
        raise ConfigError(f"weights must be finite, >= 0 and not all 0, got {list(weights)}")
    exact = [total * v / sum(w) for v in w]
    counts = [math.floor(v) for v in exact]
    order = sorted(range(len(w)), key=lambda i: (-(exact[i] - counts[i]), i))
    for i in order[: total - sum(counts)]:
        counts[i] += 1
    return counts


def _group_counts(
    config: InversionConfig, num_classes: int, class_weights: Sequence[float] | None = None
) -> list[tuple[int, int, int]]:
    """(class, beta index, count) per group with a non-zero count.

    Without ``class_weights`` every (class, beta) group gets an equal share, the remainder going to the
    first groups in order (the paper's plan). With them, the teacher's samples are first split over the
    classes in proportion to the weights (its label counts: a teacher is inverted only for the classes it
    was trained on), then each class's samples over the betas.
    """
    nb = len(config.betas)
    if class_weights is None:
        per_group = apportion(config.samples_per_teacher, [1.0] * (num_classes * nb))
        return [(i // nb, i % nb, n) for i, n in enumerate(per_group) if n]
    if len(class_weights) != num_classes:
        raise ConfigError(f"class_weights has {len(class_weights)} entries for {num_classes} classes")
    groups = []
    for c, n_c in enumerate(apportion(config.samples_per_teacher, class_weights)):
        groups += [(c, b, n) for b, n in enumerate(apportion(n_c, [1.0] * nb)) if n]
    return groups


def _plan(
    config: InversionConfig, num_classes: int, class_weights: Sequence[float] | None = None
) -> list[list[tuple[int, int]]]:
    """Chunks of one teacher: each a list of (class, beta index), one per sample, round-robin over groups."""
    counts = _group_counts(config, num_classes, class_weights)
    order: list[tuple[int, int]] = []
    for r in range(max(n for _, _, n in counts)):
        order += [(c, b) for c, b, n in counts if r < n]
    size = config.batch_size
    return [order[i : i + size] for i in range(0, len(order), size)]


def _head_weight(module: nn.Module) -> Tensor:
    return classifier_weight(module).detach()


class _BNStatLoss:
    """DeepInversion: forward hooks on every BatchNorm2d comparing the batch statistics of its input
    with the running statistics. ``value`` sums ||mu_b - mu_run||_2 + ||var_b - var_run||_2 over layers."""

    def __init__(self, module: nn.Module) -> None:
        self.terms: list[Tensor] = []
        self.handles = [
            m.register_forward_hook(self._hook) for m in module.modules() if isinstance(m, nn.BatchNorm2d)
        ]

    def _hook(self, bn: nn.Module, inputs: tuple[Tensor, ...], _output: Tensor) -> None:
        self.terms.append(batch_statistics_gap(bn, inputs[0]))  # type: ignore[arg-type]

    def pop(self) -> Tensor | None:
        terms, self.terms = self.terms, []
        return torch.stack(terms).sum() if terms else None

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def _total_variation(x: Tensor) -> Tensor:  # x: B x C x H x W
    return (x[..., 1:, :] - x[..., :-1, :]).abs().mean() + (x[..., :, 1:] - x[..., :, :-1]).abs().mean()


def _moved(x: Tensor, shift: tuple[int, int], flip: bool, gen: torch.Generator) -> Tensor:
    """``x`` rolled by one random offset of up to ``shift`` pixels (rows, columns) and, with ``flip``,
    mirrored left-right with probability 1/2: one draw for the whole batch per step, as DeepInversion
    does. Draws nothing when both are off, so such a run's stream is the one before these priors."""
    if shift != (0, 0):
        dy = int(torch.randint(-shift[0], shift[0] + 1, (1,), generator=gen))
        dx = int(torch.randint(-shift[1], shift[1] + 1, (1,), generator=gen))
        x = torch.roll(x, shifts=(dy, dx), dims=(2, 3))
    if flip and bool(torch.rand((1,), generator=gen) < 0.5):
        x = torch.flip(x, dims=(3,))
    return x


def _invert_chunk(
    module: nn.Module,
    concentrations: list[Tensor],
    chunk: list[tuple[int, int]],
    *,
    input_shape: tuple[int, int, int],
    config: InversionConfig,
    seed: int,
    device: torch.device,
    precision: str = "fp32",
) -> tuple[Tensor, Tensor, float]:
    """Optimise one chunk of images as one batch. Returns (x float16-rounded float32 on CPU, class, loss).

    ``precision`` (resolved, :mod:`edge_sdk.precision`) is the teacher's forward pass; the images, the
    loss and Adam stay float32. The images are channels-last, the layout of the teachers' weights."""
    gen = torch.Generator().manual_seed(seed)
    classes = torch.tensor([c for c, _ in chunk], dtype=torch.int64)  # B
    betas = torch.tensor([b for _, b in chunk], dtype=torch.int64)  # B
    targets = torch.empty(len(chunk), len(concentrations))  # B x L
    for c in range(len(concentrations)):  # fixed group order -> reproducible draws
        for b, beta in enumerate(config.betas):
            where = ((classes == c) & (betas == b)).nonzero().flatten()
            if where.numel():
                targets[where] = dirichlet_targets(concentrations[c], beta, where.numel(), gen)
    if config.start is None:
        raise ConfigError("decide the images' start first: InversionConfig.for_images(input_shape)")
    if config.start == "leaves":  # x = sigmoid(p) starts at the picture, kept off sigmoid's flat tails
        p = torch.logit(dead_leaves(len(chunk), input_shape, gen), eps=LEAVES_MARGIN)
    else:
        p = torch.randn((len(chunk), *input_shape), generator=gen)  # B x C x H x W, x = sigmoid(p)
    p = p.to(device, memory_format=torch.channels_last).requires_grad_(True)
    targets = targets.to(device)
    optimizer = adam([p], lr=config.lr)
    bn_loss = _BNStatLoss(module) if config.bn_weight > 0 else None
    if config.jitter is None or config.flip is None:
        raise ConfigError("decide the image priors first: InversionConfig.for_images(input_shape)")
    shift = (int(config.jitter * input_shape[1]), int(config.jitter * input_shape[2]))
    try:
        for _ in range(config.steps):
            x = torch.sigmoid(p)
            with autocast(precision, device):
                logits = module(_moved(x, shift, config.flip, gen))
            log_q = F.log_softmax(logits.float() / config.tau, dim=1)  # B x L
            loss = -(targets * log_q).sum(dim=1).mean()  # CE(y, softmax(T(x) / tau))
            if bn_loss is not None:
                bn_term = bn_loss.pop()
                if bn_term is not None:
                    loss = loss + config.bn_weight * bn_term
            if config.tv_weight > 0:
                loss = loss + config.tv_weight * _total_variation(x)
            if config.l2_weight > 0:
                loss = loss + config.l2_weight * x.square().mean()
            step(optimizer, loss)
    finally:
        if bn_loss is not None:
            bn_loss.remove()
    x = torch.sigmoid(p.detach()).cpu().contiguous().half().float()
    return x, classes, float(loss.detach())


# ------------------------------------------------------------------------------------------- public API


def _check_inputs(num_classes: int, input_shape: Sequence[int]) -> tuple[int, int, int]:
    if num_classes < 2:
        raise ConfigError(f"num_classes must be >= 2, got {num_classes}")
    if len(input_shape) != 3 or any(int(v) < 1 for v in input_shape):
        raise ConfigError(f"input_shape must be (C, H, W) of positive sizes, got {tuple(input_shape)}")
    return (int(input_shape[0]), int(input_shape[1]), int(input_shape[2]))


def _concentrations_of(
    module: nn.Module, num_classes: int, class_counts: Sequence[int] | None = None
) -> list[Tensor]:
    """Class-similarity rows of a teacher (the Dirichlet targets' source). With ``class_counts`` the
    classes it never saw are set to the row's minimum, so their concentration is the floor
    ``CONCENTRATION_EPS`` and a soft target does not ask the teacher for a class it cannot know."""
    weight = _head_weight(module)
    if weight.shape[0] != num_classes:
        raise ConfigError(f"teacher head has {weight.shape[0]} classes, expected {num_classes}")
    rows = list(class_similarity(weight).cpu())
    if class_counts is not None and sum(class_counts) > 0:
        unseen = torch.tensor([v <= 0 for v in class_counts])
        rows = [row.masked_fill(unseen, float(row.min())) for row in rows]
    return rows


def invert_teacher(
    module: nn.Module,
    *,
    num_classes: int,
    input_shape: tuple[int, int, int],
    config: InversionConfig,
    seed: int,
    device: str | torch.device = "cpu",
    progress: bool = False,
    class_counts: Sequence[int] | None = None,
    precision: str = "auto",
) -> tuple[Tensor, Tensor]:
    """Algorithm 3 for one teacher: (x float32 [0, 1] N x C x H x W, target class int64 N).

    ``class_counts`` (the teacher's label counts) is needed by ``config.classes == "held"``. The module is
    put in eval mode with frozen parameters for the call (its flags are restored after).
    """
    shape = _check_inputs(num_classes, input_shape)
    config = config.for_images(shape)  # undecided priors: by the images' channels
    dev = resolve_device(device)
    precision = resolve_precision(precision, dev)
    counts = None if class_counts is None else [list(class_counts)]
    chunks = _teacher_plans(config, 1, num_classes, counts)[0]
    concentrations = _concentrations_of(module, num_classes, None if counts is None else counts[0])
    xs, cs = [], []
    with frozen(module):
        module.to(dev)
        bar = _progress(len(chunks), progress, "inversion")
        for i, chunk in enumerate(chunks):
            x, c, loss = _invert_chunk(
                module, concentrations, chunk, input_shape=shape, config=config,
                seed=derive_seed(seed, i), device=dev, precision=precision,
            )  # fmt: skip
            xs.append(x)
            cs.append(c)
            _advance(bar, loss)
        _close(bar)
    return torch.cat(xs), torch.cat(cs)


def teacher_seed(seed: int, teacher_index: int) -> int:
    """The seed ``synthesize_inversion`` hands teacher ``teacher_index`` (so invert_teacher can replay it)."""
    return derive_seed(seed, 1_000_003, teacher_index)


def _module_hash(module: nn.Module) -> str:
    """sha256 over the state dict (names, dtypes, shapes, values): identifies a teacher across runs."""
    digest = hashlib.sha256()
    for name, tensor in sorted(module.state_dict().items()):
        t = tensor.detach().cpu().contiguous()
        digest.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        digest.update(t.numpy().tobytes() if t.dtype != torch.bfloat16 else t.float().numpy().tobytes())
    return digest.hexdigest()


def _prepare_work_dir(work_dir: Path, manifest: dict[str, object]) -> None:
    """Record the run in ``config.json``; refuse a directory written by a different run.

    A mismatch raises instead of recomputing: the chunks on disk may be the only copy of a long run, and
    deleting them silently would be worse than asking for a fresh directory.
    """
    path = work_dir / "config.json"
    if path.exists():
        try:
            existing = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as err:
            raise DataError(f"{path} is unreadable ({err}); delete {work_dir} to start over") from err
        wanted = json.loads(json.dumps(manifest))  # tuples -> lists, as stored
        if existing != wanted:
            differs = differences(existing, wanted)
            raise ConfigError(
                f"{work_dir} holds synthetic chunks of a different inversion run (differs in: {differs}); "
                "use another work directory / output folder, or delete it to recompute"
            )
        return
    atomic_write_json(path, manifest)


def _chunk_path(work_dir: Path, teacher_index: int, chunk_index: int) -> Path:
    return work_dir / f"teacher_{teacher_index:03d}_chunk_{chunk_index:04d}.npz"


def _save_chunk(path: Path, x: Tensor, teacher_index: int, target_class: Tensor) -> None:
    buf = io.BytesIO()
    np.savez(
        buf,
        x=x.half().numpy(),
        teacher=np.full(len(target_class), teacher_index, dtype=np.int64),
        target_class=target_class.numpy(),
    )
    atomic_write_bytes(path, buf.getvalue())


def _load_chunk(path: Path, expected: int, shape: tuple[int, int, int]) -> tuple[Tensor, Tensor]:
    try:
        with np.load(path) as data:
            x = torch.from_numpy(data["x"].astype(np.float32))
            target_class = torch.from_numpy(data["target_class"].astype(np.int64))
    except (OSError, KeyError, ValueError) as err:
        raise DataError(f"synthetic chunk {path} is unreadable ({err}); delete it to recompute") from err
    if tuple(x.shape) != (expected, *shape) or tuple(target_class.shape) != (expected,):
        raise DataError(
            f"synthetic chunk {path} holds x {tuple(x.shape)}, expected {(expected, *shape)}; "
            "delete it to recompute"
        )
    return x, target_class


def synthesize_inversion(
    modules: Sequence[nn.Module],
    *,
    num_classes: int,
    input_shape: tuple[int, int, int],
    config: InversionConfig,
    seed: int,
    device: str | torch.device = "cpu",
    work_dir: str | Path | None = None,
    progress: bool = False,
    label_counts: Sequence[Sequence[int]] | None = None,
    precision: str = "auto",
) -> SyntheticSet:
    """Algorithm 3 over all teachers: X = union of the per-teacher sets.

    ``label_counts`` (K rows of L counts, from the bundles) is required by ``config.classes == "held"``
    and refused otherwise. With ``work_dir`` every finished (teacher, chunk) is written atomically and
    reused by a rerun with the same config, seed, teachers, counts and precision, so a killed run
    resumes where it stopped with identical output.
    """
    if not modules:
        raise ConfigError("synthesize_inversion needs at least one teacher")
    shape = _check_inputs(num_classes, input_shape)
    config = config.for_images(shape)  # undecided priors: by the images' channels
    dev = resolve_device(device)
    precision = resolve_precision(precision, dev)
    plans = _teacher_plans(config, len(modules), num_classes, label_counts)
    work = Path(work_dir) if work_dir is not None else None
    if work is not None:
        make_real_dir(work, what="inversion work folder")
        manifest: dict[str, object] = {
            "format": _WORK_FORMAT,
            "config": config.to_dict(),
            "seed": seed,
            "num_classes": num_classes,
            "input_shape": list(shape),
            "teachers": [_module_hash(m) for m in modules],
        }
        if precision != "fp32":  # written only when not float32: chunks of earlier runs stay valid
            manifest["precision"] = precision
        if label_counts is not None:
            manifest["label_counts"] = [[int(v) for v in row] for row in label_counts]
        _prepare_work_dir(work, manifest)
    bar = _progress(sum(len(p) for p in plans), progress, "inversion")

    def one(k: int) -> list[tuple[Tensor, Tensor]]:
        module, chunks = modules[k], plans[k]
        row = None if label_counts is None else list(label_counts[k])
        concentrations = _concentrations_of(module, num_classes, row)
        base = teacher_seed(seed, k)
        out: list[tuple[Tensor, Tensor]] = []
        with frozen(module):
            module.to(dev)
            for i, chunk in enumerate(chunks):
                path = _chunk_path(work, k, i) if work is not None else None
                loss = None
                if path is not None and path.exists():
                    x, c = _load_chunk(path, len(chunk), shape)
                else:
                    x, c, loss = _invert_chunk(
                        module, concentrations, chunk, input_shape=shape, config=config,
                        seed=derive_seed(base, i), device=dev, precision=precision,
                    )  # fmt: skip
                    if path is not None:
                        _save_chunk(path, x, k, c)
                out.append((x, c))
                _advance(bar, loss)
        return out

    # teachers side by side, one per core (each chunk has its own seed: the schedule changes nothing)
    per_teacher = map_teachers(one, modules, device=dev)
    xs = [x for chunks in per_teacher for x, _ in chunks]
    classes = [c for chunks in per_teacher for _, c in chunks]
    teachers = [
        torch.full((len(c),), k, dtype=torch.int64) for k, chunks in enumerate(per_teacher) for _, c in chunks
    ]
    _close(bar)
    return SyntheticSet(x=torch.cat(xs), teacher=torch.cat(teachers), target_class=torch.cat(classes))


def _teacher_plans(
    config: InversionConfig,
    num_teachers: int,
    num_classes: int,
    label_counts: Sequence[Sequence[int]] | None,
) -> list[list[list[tuple[int, int]]]]:
    """The chunk plan of every teacher: the same for all (``classes="all"``) or by its own label counts."""
    if config.classes == "all":
        if label_counts is not None:
            raise ConfigError("label_counts only apply with classes='held'; drop them or set classes='held'")
        return [_plan(config, num_classes)] * num_teachers
    if label_counts is None:
        raise ConfigError("classes='held' needs the teachers' label_counts (one row per teacher)")
    rows = [list(row) for row in label_counts]
    if len(rows) != num_teachers or any(len(r) != num_classes for r in rows):
        raise ConfigError(f"label_counts must be {num_teachers} rows of {num_classes} counts")
    # a teacher that reports no examples at all is inverted for every class, as in the paper
    return [_plan(config, num_classes, r if sum(r) > 0 else None) for r in rows]


def _progress(total: int, enabled: bool, desc: str):  # -> tqdm | None
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="chunk")


def _advance(bar, loss: float | None) -> None:
    if bar is not None:
        if loss is not None:
            bar.set_postfix(loss=f"{loss:.3f}")
        bar.update(1)


def _close(bar) -> None:
    if bar is not None:
        bar.close()
