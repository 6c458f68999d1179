"""On-device personalization after aggregation, and the deployable (fp32 / int8) export.

The device holds its own trained model (the ONNX inside its bundle: code-free, weights reload exactly)
and its data; the server's package (``export.package``) brings the global model, the distillation
inputs with the personalised server knowledge Z_n^s (FedPD PKE) and, when trained, the global generator.
Three methods:

* ``finetune`` starts from the global model and trains on local data (the baseline every user tries).
* ``pkt`` is FedPD's partial knowledge transfer (Eq. 1-4): the device's own model minimises
  CE(local data) + lambda * L_D, where L_D = mean_i alpha_i * L1(f(x_i), z_i^s) + tau/2 ||alpha - 1||^2.
  alpha and the weights are updated alternately, one step each per batch: alpha by a gradient step on
  L_D with the weights fixed (:func:`update_alpha`), then the weights with alpha fixed. A sample the
  model disagrees with (large L1) gets alpha below 1; the regulariser pulls alpha back toward 1. alpha is
  kept >= 0 (a negative weight would reward moving away from the knowledge).
* ``kdg`` is FedKDG's local objective (section 3.3), each term switchable:
  ``pre`` CE on real data; ``dis`` KL to the global model on real data; ``lat`` the latent constraint:
  the local prediction on real sample i is matched to the global prediction on a global-generator sample
  of the same label; ``tea`` CE of the local model on those generated samples with their labels;
  ``disg`` generative distillation on P_A = softmax((P_l W_l)(P_g W_g)^T / sqrt(d)) P_g + P_g, the
  global-local cross-attention of global-generator samples P_g and local-generator samples P_l for the
  same uniformly drawn labels (W_l, W_g learnt with the model). The local generator (a small MLP,
  FedMHO's CVAE decoder layout) is first trained against the frozen local model with CE plus a
  mode-seeking diversity term. FedKDG's local noise filter is not applied.

The package comes from the server, so its ONNX is held to :mod:`export.onnx_check`'s contract before
anything of it is loaded or run: the global model must map ``[batch, *input_shape]`` to ``[batch,
num_classes]`` of this device's bundle, the generator ``z``, ``y`` one-hot to ``[batch, *input_shape]``.

The result is exported twice: fp32 ONNX with BatchNorm kept (initializer names = state_dict keys, so
``edge-sdk deploy`` rebuilds it for the torch-based phone targets; onnxruntime folds BatchNorm into the
convolutions when it loads the model, int8's pre-processing before it quantizes), and int8 static QDQ
quantized with onnxruntime, calibrated on local images. int8 is kept only when its local validation
accuracy is within ``int8_tolerance`` of fp32; the report says which was kept, with sizes and onnxruntime
latencies.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal, get_args

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from common.checks import check_int, check_number
from common.device import check_device, resolve_device
from common.errors import BundleError, ConfigError, DataError
from common.loop import adam, fit_terms, sgd, step
from common.seeding import seeded
from common.timing import timed
from common.torch_utils import INFER_BATCH, frozen
from edge_sdk.curves import curve_records
from edge_sdk.cvae import build_cvae
from edge_sdk.data import ArrayDataset, deploy_metadata_for, split_train_val
from edge_sdk.models.arch import build_model
from edge_sdk.train import evaluate, kd_loss_logits, to_float
from export.atomic import atomic_write_bytes, atomic_write_json
from export.bundle import Bundle
from export.onnx_check import check_classifier_onnx, check_decoder_onnx
from export.onnx_export import export_onnx, onnx_logits, onnx_session
from export.package import Package
from export.quantize import latency_ms, quantize_int8
from export.weights import initializer_state_dict

__all__ = [
    "KDG_TERMS",
    "METHODS",
    "PersonalizeConfig",
    "PersonalizeResult",
    "personalize",
    "pkt_loss",
    "update_alpha",
]

Method = Literal["finetune", "pkt", "kdg"]
METHODS: tuple[str, ...] = get_args(Method)
KDG_TERMS = ("pre", "dis", "lat", "tea", "disg")


@dataclass(frozen=True, kw_only=True)
class PersonalizeConfig:
    """Knobs of :func:`personalize`.

    SGD with momentum as FedPD's clients (lr 0.01 for (E)MNIST); batch 64 and 2 epochs keep a 3 M parameter
    model within minutes on a 2-core CPU (FedPD: batch 20, 5 local epochs per round).
    ``pkt_weight_pull`` (FedPD's tau) 0.5 and ``pkt_weight_lr`` (its learning rate of alpha) 0.05 are
    FedPD's best values (Tables 7, 12); FedPD does not give lambda, 1.0 here. ``seed`` None uses the
    bundle's seed, so the train/validation split is the one ``edge-sdk run`` used. ``kdg_dis_weight`` and
    ``kdg_disg_weight`` scale the two distillation terms of ``kdg`` (the other terms weigh 1): FedKDG's
    ablation adds them with weight 0.01, and at weight 1 the global model (weaker than the local one on the
    local distribution) dominated, far below the local-only accuracy at alpha 0.1 (benchmarks/RESULTS.md).
    """

    # fields renamed, old name -> new (common.configs: the old key and flag are refused naming the new)
    renamed_keys: ClassVar[dict[str, str]] = {
        "epochs": "train_epochs",
        "tau": "pkt_weight_pull",
        "alpha_lr": "pkt_weight_lr",
        "kd_temperature": "distill_tau",
    }

    method: Method = "pkt"  # pkt (FedPD), kdg (FedKDG) or finetune
    train_epochs: int = 2  # epochs of the local training
    lr: float = 0.01  # SGD learning rate
    momentum: float = 0.9  # SGD momentum
    batch_size: int = 64
    lam: float = 1.0  # PKT distillation weight lambda
    # PKT: how strongly each distillation sample's weight is pulled back toward 1 (FedPD's tau)
    pkt_weight_pull: float = 0.5
    pkt_weight_lr: float = 0.05  # PKT: learning rate of the distillation samples' weights (FedPD's alpha)
    distill_batch_size: int = 64  # distillation inputs per step
    kdg_terms: tuple[str, ...] = KDG_TERMS  # kdg's loss terms, any of pre, dis, lat, tea, disg
    distill_tau: float = 1.0  # distillation temperature
    kdg_dis_weight: float = 0.01  # weight of kdg's dis term (FedKDG: 0.01)
    kdg_disg_weight: float = 0.01  # weight of kdg's disg term (FedKDG: 0.01)
    local_generator_steps: int = 100  # kdg: training steps of the local generator
    attention_dim: int = 64  # kdg: width of the attention over local and global features
    val_fraction: float = 0.2  # local validation split
    seed: int | None = None  # seed of the split and training; none: the bundle's (edge-sdk run's split)
    int8_tolerance: float = 0.005  # the int8 model is kept when its accuracy is within this of fp32's
    calibration_size: int = 256  # training images that calibrate the int8 quantization
    device: str = "auto"  # auto (CUDA when present), cpu, cuda or cuda:N

    def __post_init__(self) -> None:
        check_device(self.device)
        if self.method not in METHODS:
            raise ConfigError(f"method must be one of {METHODS}, got {self.method!r}")
        if isinstance(self.kdg_terms, str):
            object.__setattr__(
                self, "kdg_terms", tuple(t.strip() for t in self.kdg_terms.split(",") if t.strip())
            )
        bad = sorted(set(self.kdg_terms) - set(KDG_TERMS))
        if bad or not self.kdg_terms:
            raise ConfigError(f"kdg_terms must be a non-empty subset of {KDG_TERMS}, got {self.kdg_terms!r}")
        for name in ("train_epochs", "batch_size", "distill_batch_size", "attention_dim", "calibration_size"):
            check_int(name, getattr(self, name), 1)
        check_int("local_generator_steps", self.local_generator_steps, 0)
        if self.seed is not None:
            check_int("seed", self.seed, 0)
        for name in ("lr", "distill_tau"):
            check_number(name, getattr(self, name), positive=True)
        for name in (
            "momentum",
            "lam",
            "pkt_weight_pull",
            "pkt_weight_lr",
            "int8_tolerance",
            "kdg_dis_weight",
            "kdg_disg_weight",
        ):
            check_number(name, getattr(self, name), positive=False)
        if not 0 < self.val_fraction < 1:
            raise ConfigError(f"val_fraction must be in (0, 1), got {self.val_fraction!r}")

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["kdg_terms"] = list(self.kdg_terms)
        return out


@dataclass(frozen=True)
class PersonalizeResult:
    out_dir: Path
    deploy_onnx: Path
    kept: str  # "int8" or "fp32"
    report: dict[str, Any]


# ----------------------------------------------------------------------------------------------- PKT


def update_alpha(alpha: Tensor, per_sample_l1: Tensor, *, lr: float, tau: float) -> Tensor:
    """One gradient step of L_D in alpha with the weights fixed (FedPD Eq. 3), clamped at 0.

    On a batch of B distillation samples L_D = (1/B) sum_i alpha_i l_i + tau/2 sum_i (alpha_i - 1)^2,
    so dL_D/dalpha_i = l_i / B + tau (alpha_i - 1): a large disagreement l_i lowers alpha_i, and
    the regulariser pulls alpha_i back toward 1 (equilibrium 1 - l_i / (B tau)).
    """
    grad = per_sample_l1 / per_sample_l1.numel() + tau * (alpha - 1.0)
    return (alpha - lr * grad).clamp_(min=0.0)


def pkt_loss(outputs: Tensor, knowledge: Tensor, alpha: Tensor) -> tuple[Tensor, Tensor]:
    """(mean_i alpha_i * L1_i, per-sample L1): L1 averaged over the L outputs of each sample."""
    per_sample = (outputs - knowledge).abs().mean(dim=1)  # B
    return (alpha * per_sample).mean(), per_sample


# --------------------------------------------------------------------------------------------- models


def _load_classifier(
    model_onnx: bytes,
    arch: str,
    input_shape: tuple[int, int, int],
    num_classes: int,
    *,
    unknown_output: bool = False,
) -> nn.Module:
    """The classifier rebuilt from its arch and ONNX weights. A model with an "unknown" output (FedOV)
    comes back without it: the personalized model answers over the task's classes like the global one,
    so its final layer keeps the first ``num_classes`` rows."""
    module = build_model(arch, input_shape, num_classes + int(unknown_output))
    module.load_state_dict(initializer_state_dict(model_onnx, module), strict=True)
    if unknown_output:
        head = [m for m in module.modules() if isinstance(m, nn.Linear)][-1]
        head.weight = nn.Parameter(head.weight.detach()[:num_classes].clone())
        if head.bias is not None:
            head.bias = nn.Parameter(head.bias.detach()[:num_classes].clone())
        head.out_features = num_classes
        with torch.no_grad():
            got = module(torch.zeros((1, *input_shape))).shape[1]
        if got != num_classes:
            raise ConfigError(f"{arch}: dropping the unknown output left {got} outputs, not {num_classes}")
    return module


class _OnnxGenerator:
    """The server's global generator run with onnxruntime: (z, y one-hot) -> pixels, no gradient needed.

    Checked first (:func:`export.onnx_check.check_decoder_onnx`): z [batch, nz] with the nz it declares,
    y [batch, num_classes], output [batch, *input_shape], within the per-file budget.
    """

    def __init__(self, model_bytes: bytes, num_classes: int, input_shape: tuple[int, int, int]) -> None:
        proto = check_decoder_onnx(
            model_bytes,
            latent_dim=None,
            num_classes=num_classes,
            output_shape=input_shape,
            source="the package's generator",
        )
        z = next(i for i in proto.graph.input if i.name == "z")
        self.nz = z.type.tensor_type.shape.dim[1].dim_value
        self.num_classes = num_classes
        self.session = onnx_session(model_bytes, threads=max(1, torch.get_num_threads()))

    def __call__(self, y: Tensor, gen: torch.Generator) -> Tensor:
        z = torch.randn(len(y), self.nz, generator=gen)
        onehot = F.one_hot(y, self.num_classes).float()
        try:
            out = self.session.run(None, {"z": z.numpy(), "y": onehot.numpy()})[0]
        except Exception as err:  # onnxruntime raises its own pybind exception types
            raise BundleError(
                f"the package's generator failed on a batch of {len(y)}: {err}; fix: aggregate again with "
                "server-kit (--synth generator) and use the package it writes"
            ) from err
        return torch.from_numpy(out)


def _train_local_generator(
    local: nn.Module,
    label_share: Tensor,
    shape: tuple[int, int, int],
    num_classes: int,
    steps: int,
    gen: torch.Generator,
) -> nn.Module:
    """FedKDG's local generator: CE of the frozen local model on G_l(z, y) + a mode-seeking diversity term.
    The generator stays on the CPU with the stream's draws; only its images go to the model's device."""
    device = next(local.parameters()).device
    g_local = build_cvae("cvae-small", shape, num_classes, latent_dim=16).decoder
    opt = adam(g_local.parameters(), lr=1e-3)
    with frozen(local):
        for _ in range(steps):
            y = torch.multinomial(label_share, 64, replacement=True, generator=gen)
            z = torch.randn(64, 16, generator=gen)
            x = g_local(z, F.one_hot(y, num_classes).float())
            ce = F.cross_entropy(local(x.to(device)), y.to(device))
            # mode seeking: pixel distance per unit of noise distance between pairs, to be maximised
            dx = (x[:32] - x[32:]).abs().flatten(1).mean(1)
            dz = (z[:32] - z[32:]).abs().mean(1)
            step(opt, ce - (dx / dz).mean())
    return g_local.eval()


# ------------------------------------------------------------------------------------------- training


@dataclass
class _Fit:
    """What one personalization run's loss terms share: the models, the data on the device, the
    package's distillation set and knowledge, PKT's per-sample alpha, the generators, the one stream."""

    model: nn.Module
    global_model: nn.Module
    package: Package
    config: PersonalizeConfig
    terms: set[str]
    gen: torch.Generator
    device: torch.device
    x_real: Tensor
    y_real: Tensor
    inputs: Tensor
    knowledge: Tensor
    alpha: Tensor
    g_global: Any = None
    g_local: Any = None
    extra: list[nn.Parameter] = field(default_factory=list)

    def batch_terms(self, idx: Tensor) -> dict[str, Tensor]:
        """The loss terms of one batch of real samples (and of the samples drawn alongside)."""
        config, terms, t = self.config, self.terms, self.config.distill_tau
        x, y = to_float(self.x_real[idx]), self.y_real[idx]
        logits = self.model(x)
        parts: dict[str, Tensor] = {}
        if config.method != "kdg" or "pre" in terms:
            parts["ce"] = F.cross_entropy(logits, y)
        if config.method == "pkt":
            parts["pkt"] = self._pkt()
        if "dis" in terms:
            with torch.no_grad():
                g_real = self.global_model(x)
            parts["dis"] = config.kdg_dis_weight * kd_loss_logits(logits, g_real, t)
        if terms & {"lat", "tea"}:
            assert self.g_global is not None
            p_i = self.g_global(y.cpu(), self.gen).to(self.device)  # same labels as the real batch
            with torch.no_grad():
                g_pi = self.global_model(p_i)
            if "lat" in terms:
                parts["lat"] = kd_loss_logits(logits, g_pi, t)
            if "tea" in terms:
                parts["tea"] = F.cross_entropy(self.model(p_i), y)
        if "disg" in terms:
            parts["disg"] = self._disg(len(idx))
        return parts

    def _pkt(self) -> Tensor:
        """PKT on a batch of the distillation set: alpha with the weights fixed, then the weights."""
        config = self.config
        d_idx = torch.randint(len(self.inputs), (config.distill_batch_size,), generator=self.gen).to(
            self.device
        )
        out = self.model(to_float(self.inputs[d_idx]))
        with torch.no_grad():
            per = (out.detach() - self.knowledge[d_idx]).abs().mean(dim=1)
            self.alpha[d_idx] = update_alpha(
                self.alpha[d_idx], per, lr=config.pkt_weight_lr, tau=config.pkt_weight_pull
            )
        return config.lam * pkt_loss(out, self.knowledge[d_idx], self.alpha[d_idx])[0]

    def _disg(self, n: int) -> Tensor:
        """FedKDG's DisG: the global generator's samples attended by the local generator's."""
        assert self.g_global is not None and self.g_local is not None
        config, package = self.config, self.package
        y_u = torch.randint(package.num_classes, (n,), generator=self.gen)
        p_g = self.g_global(y_u, self.gen).to(self.device).flatten(1)  # B x D
        with torch.no_grad():
            p_l = self.g_local(
                torch.randn(n, 16, generator=self.gen), F.one_hot(y_u, package.num_classes).float()
            )
        scores = (p_l.to(self.device).flatten(1) @ self.extra[0]) @ (p_g @ self.extra[1]).T  # B x B
        attn = F.softmax(scores / math.sqrt(config.attention_dim), dim=1)
        p_a = (attn @ p_g + p_g).clamp(0, 1).reshape(-1, *package.input_shape)
        with torch.no_grad():
            g_pa = self.global_model(p_a)
        return config.kdg_disg_weight * kd_loss_logits(self.model(p_a), g_pa, config.distill_tau)


def _generators(state: _Fit, train: ArrayDataset, stats: dict[str, Any]) -> None:
    """The global generator (from the package) and, for DisG, a local one and the attention weights."""
    package, config, terms = state.package, state.config, state.terms
    label_share = torch.bincount(train.y.long(), minlength=package.num_classes).float()
    generated = sorted(terms & {"lat", "tea", "disg"})
    if generated:
        if package.generator_onnx is None:
            raise DataError(
                f"kdg terms {generated} need the global generator, but the package has none; aggregate "
                "with --synth generator, or pass --kdg-terms pre,dis"
            )
        state.g_global = _OnnxGenerator(package.generator_onnx, package.num_classes, package.input_shape)
    pixels = math.prod(package.input_shape)
    if "disg" in terms:
        t0 = time.perf_counter()
        state.g_local = _train_local_generator(
            state.model, label_share, package.input_shape, package.num_classes, config.local_generator_steps,
            state.gen,
        )  # fmt: skip
        state.model.train()
        stats["local_generator_seconds"] = time.perf_counter() - t0
        gen = state.gen
        w_l = torch.randn(pixels, config.attention_dim, generator=gen) / math.sqrt(pixels)  # drawn on the CPU
        w_g = torch.randn(pixels, config.attention_dim, generator=gen) / math.sqrt(pixels)
        state.extra = [nn.Parameter(w.to(state.device)) for w in (w_l, w_g)]


def _fit(
    model: nn.Module,
    train: ArrayDataset,
    package: Package,
    global_model: nn.Module,
    config: PersonalizeConfig,
    seed: int,
    progress: bool,
) -> dict[str, Any]:
    """Train ``model`` in place by ``config.method``; returns training statistics for the report."""
    device = resolve_device(config.device)
    gen = torch.Generator().manual_seed(seed)
    model.to(device).train()
    global_model.to(device).eval()
    x_real, y_real = train.x.to(device), train.y.to(device=device, dtype=torch.long)
    stats: dict[str, Any] = {}
    terms = set(config.kdg_terms) if config.method == "kdg" else set()
    inputs = torch.from_numpy(package.inputs)  # distillation set, uint8
    state = _Fit(
        model, global_model, package, config, terms, gen, device, x_real, y_real,
        inputs, torch.from_numpy(package.knowledge), torch.ones(len(inputs)),
    )  # fmt: skip
    _generators(state, train, stats)
    optimizer = sgd([*model.parameters(), *state.extra], lr=config.lr, momentum=config.momentum)
    state.inputs = inputs.to(device)
    state.knowledge = state.knowledge.to(device)
    state.alpha = torch.ones(len(inputs), device=device)
    with seeded(seed, device):  # the permutation of each epoch is drawn before the batch's own draws
        history = fit_terms(
            state.batch_terms,
            optimizer,
            n=len(x_real),
            batch_size=config.batch_size,
            epochs=config.train_epochs,
            generator=gen,
            device=device,
            lone_last="drop",  # BatchNorm needs >= 2 samples
            desc=f"personalize ({config.method})",
            progress=progress,
        )
    model.eval()
    stats["loss"] = [dict(sorted(epoch.items())) for epoch in history]
    if config.method == "pkt":
        alpha = state.alpha
        stats["alpha"] = {
            "mean": float(alpha.mean()),
            "min": float(alpha.min()),
            "below_1": float((alpha < 1).float().mean()),
        }
    return stats


def _onnx_accuracy(model_bytes: bytes, data: ArrayDataset, batch_size: int = INFER_BATCH) -> float:
    if len(data.y) == 0:
        return 0.0
    threads = max(1, torch.get_num_threads())
    logits = onnx_logits(model_bytes, to_float(data.x).numpy(), batch_size=batch_size, threads=threads)
    return int((logits.argmax(1) == data.y.numpy()).sum()) / len(data.y)


def _check_inputs(data: ArrayDataset, bundle: Bundle, package: Package) -> tuple[tuple[int, ...], int]:
    """The task's (input shape, classes), once the data, the bundle and the package are of it and the
    package's global model holds to the ONNX contract."""
    package.check_for(bundle.model_onnx)
    if bundle.kind != "classifier":
        raise ConfigError(f"personalization needs a classifier bundle, got kind {bundle.kind!r}")
    shape, classes = tuple(bundle.input_shape), bundle.num_classes
    if data.input_shape != shape or data.num_classes != classes:
        raise DataError(
            f"data is {data.num_classes} classes of {data.input_shape}, the bundle {classes} of {shape}; "
            "pass this client's own data file"
        )
    if package.input_shape != shape or package.num_classes != classes:
        raise BundleError(
            f"the package is for {package.num_classes} classes of {package.input_shape} (knowledge "
            f"{package.knowledge.shape[1]} columns), this device's model for {classes} of {shape}; fix: use "
            "the package server-kit personalize wrote for this client's bundle"
        )
    check_classifier_onnx(
        package.global_onnx, input_shape=shape, num_classes=classes, source="the package's global model"
    )
    return shape, classes


def _start(
    bundle: Bundle, package: Package, config: PersonalizeConfig, val_split: ArrayDataset
) -> tuple[nn.Module, str, nn.Module, dict[str, float]]:
    """(the model to personalise, its arch, the global model, both starting points' val accuracy): the
    global model for ``finetune``, else this device's own."""
    shape, classes = tuple(bundle.input_shape), bundle.num_classes
    global_model = _load_classifier(package.global_onnx, package.global_arch, shape, classes)  # type: ignore[arg-type]
    if config.method == "finetune":
        model = _load_classifier(package.global_onnx, package.global_arch, shape, classes)  # type: ignore[arg-type]
        arch = package.global_arch
    else:
        model = _load_classifier(
            bundle.model_onnx, bundle.arch, shape, classes, unknown_output=bundle.unknown_output
        )  # type: ignore[arg-type]
        arch = bundle.arch
    before = {
        "own_model": evaluate(
            _load_classifier(
                bundle.model_onnx, bundle.arch, shape, classes, unknown_output=bundle.unknown_output
            ),  # type: ignore[arg-type]
            val_split,
        )[1],
        "global_model": evaluate(global_model, val_split)[1],
    }
    return model, arch, global_model, before


def _compare(
    fp32: bytes, int8: bytes, val_split: ArrayDataset, shape: tuple[int, ...], tolerance: float
) -> tuple[dict[str, float], str, dict[str, dict[str, float]]]:
    """Both exports' val accuracy, the one kept (int8 unless it loses more than ``tolerance``), latency."""
    acc = {"fp32": _onnx_accuracy(fp32, val_split), "int8": _onnx_accuracy(int8, val_split)}
    kept = "int8" if acc["int8"] >= acc["fp32"] - tolerance else "fp32"
    latency = {
        name: {
            f"batch_{b}_ms": latency_ms(blob, shape, batch=b, repeats=20 if b > 1 else 50) for b in (1, 64)
        }  # type: ignore[arg-type]
        for name, blob in (("fp32", fp32), ("int8", int8))
    }
    return acc, kept, latency


def personalize(
    data: ArrayDataset,
    bundle: Bundle,
    package: Package,
    out_dir: str | Path,
    *,
    config: PersonalizeConfig,
    progress: bool = False,
) -> PersonalizeResult:
    """Personalise this device's model with ``package`` and write the deployable models to ``out_dir``.

    ``bundle`` is the device's own upload (its model and seed); the package must have been made for it
    (:meth:`Package.check_for`). Writes ``personal.fp32.onnx``, ``personal.int8.onnx``, ``deploy.onnx``
    (the kept one) and ``report.json``.
    """
    shape, classes = _check_inputs(data, bundle, package)
    seed = int(bundle.seed) if config.seed is None else config.seed
    out = Path(out_dir)
    train_split, val_split = split_train_val(data, val_fraction=config.val_fraction, seed=seed)
    seconds: dict[str, float] = {}
    with timed(seconds, "train"):
        model, arch, global_model, before = _start(bundle, package, config, val_split)
        with seeded(seed):
            stats = _fit(model, train_split, package, global_model, config, seed, progress)

    with timed(seconds, "export"):
        meta = {"arch": arch, "producer": "edge-sdk personalize", "method": config.method}
        meta |= deploy_metadata_for(shape, classes, data.class_names)  # type: ignore[arg-type]
        fp32 = export_onnx(model.cpu(), shape, metadata=meta, keep_batchnorm=True, seed=seed)  # type: ignore[arg-type]
        calib = to_float(train_split.x[: config.calibration_size]).numpy()
        # kept or not by its validation accuracy (int8_tolerance in _compare), so no agreement rule here
        int8 = quantize_int8(fp32, calib, min_agreement=None)
    acc, kept, latency = _compare(fp32, int8, val_split, shape, config.int8_tolerance)
    atomic_write_bytes(out / "personal.fp32.onnx", fp32)
    atomic_write_bytes(out / "personal.int8.onnx", int8)
    deploy = atomic_write_bytes(out / "deploy.onnx", int8 if kept == "int8" else fp32)
    report = {
        "client": package.client,
        "method": config.method,
        "arch": arch,
        "config": config.to_dict(),
        "seed": seed,
        "val_accuracy_before": before,
        "val_accuracy": acc,
        "kept": kept,
        "size_bytes": {"fp32": len(fp32), "int8": len(int8)},
        "latency": latency,
        "training": stats,
        "curves": curve_records({"personalize": stats["loss"]}),  # the report's figure (edge_sdk.curves)
        "seconds": seconds,
        "num_train": len(train_split),
        "num_val": len(val_split),
    }
    atomic_write_json(out / "report.json", report)
    return PersonalizeResult(out, deploy, kept, report)
