"""FedPD's partial knowledge ensemble (PKE) without public data, and one package per client.

FedPD keeps one server model per client and trains it on that client's knowledge (its logits on a
shared distillation set) with L1, plus a proximal term mu * ||w_n^f - mean_m w_m^f||^2 that pulls every
server model's feature extractor toward the mean extractor ("global basic model", Eq. 5-6); the
trained server model's outputs Z_n^s are the personalised knowledge the client distils from (PKT).
FedPD has a public dataset; we have none, so the distillation set is the aggregation's synthetic set
(``synthetic.npz``), and the client's knowledge is computed by the server from the teacher it already
holds (one-shot: no extra round trip). Server models share the global student's architecture and start
from its weights; the mean extractor is recomputed after every epoch (Algorithm 1, line 8).

Each package (``export.package``) carries the global model, the distillation inputs as uint8, Z_n^s,
the global generator when the aggregation trained one, and the knobs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from tqdm.auto import tqdm

from common.checks import check_number
from common.device import check_device, resolve_device
from common.errors import ConfigError, DataError
from common.loop import adam, fit_terms
from common.seeding import seeded
from common.timing import timed
from common.torch_utils import batched_logits
from edge_sdk.models.arch import build_model
from export.atomic import atomic_write_json
from export.bundle import client_names
from export.onnx_export import read_metadata
from export.package import Package, write_package
from export.weights import initializer_state_dict
from server_kit.synthesis import SYNTHETIC_FILE, load_synthetic
from server_kit.teachers import Teacher, Uploads, load_teachers

__all__ = ["PKEConfig", "PKEResult", "extractor_names", "personalize_server", "train_server_models"]


@dataclass(frozen=True, kw_only=True)
class PKEConfig:
    """PKE knobs. FedPD's best settings: server lr 1e-3, batch 40, mu 0.6, 40 server epochs; ``fast``
    trains 5 epochs on at most 2,000 distillation inputs (server models start from the global student)."""

    # fields renamed, old name -> new (common.configs: the old key and flag are refused naming the new)
    renamed_keys: ClassVar[dict[str, str]] = {"epochs": "train_epochs"}

    train_epochs: int = 5  # epochs of training each client's server model
    lr: float = 1e-3  # server-model Adam learning rate
    batch_size: int = 40
    mu: float = 0.6  # proximal weight to the mean extractor
    max_inputs: int = 2000  # distillation inputs per package
    seed: int = 0
    device: str = "auto"  # auto (CUDA when present), cpu, cuda or cuda:N

    def __post_init__(self) -> None:
        check_device(self.device)
        for name in ("train_epochs", "batch_size", "max_inputs"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ConfigError(f"seed must be an integer >= 0, got {self.seed!r}")
        check_number("lr", self.lr, positive=True)
        check_number("mu", self.mu)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class PKEResult:
    packages: tuple[Path, ...]
    report_path: Path
    seconds: dict[str, float]
    report: dict[str, Any]


def extractor_names(module: nn.Module) -> list[str]:
    """Parameter names of the feature extractor: everything but the classifier head (``module.head``)."""
    head = {id(p) for p in module.head.parameters()}  # type: ignore[union-attr]
    return [name for name, p in module.named_parameters() if id(p) not in head]


def train_server_models(
    models: Sequence[nn.Module],
    x: Tensor,
    knowledge: Sequence[Tensor],
    *,
    config: PKEConfig,
    progress: bool = False,
    device: torch.device | None = None,
) -> list[list[float]]:
    """Train server model n on (x, knowledge[n]) with L1 + mu * ||w_n^f - w_mean^f||^2 (Eq. 5).

    The mean extractor is a constant within an epoch and recomputed after it. Returns each model's mean
    L1 per epoch over the samples it trained on. All models must share one architecture.
    """
    if len(models) != len(knowledge) or not models:
        raise ConfigError(
            f"need one knowledge tensor per server model, got {len(knowledge)} for {len(models)}"
        )
    names = extractor_names(models[0])
    device = resolve_device(config.device) if device is None else device  # the caller's, resolved once
    gen = torch.Generator().manual_seed(config.seed)
    x = x.to(device)
    optimizers = [adam(m.to(device).parameters(), lr=config.lr) for m in models]
    curves: list[list[float]] = [[] for _ in models]
    bar = tqdm(total=config.train_epochs * len(models), desc="PKE", unit="model-epoch", disable=not progress)
    with seeded(config.seed, device):  # the Dropout stream: the same knowledge on every run
        _train_epochs(models, optimizers, names, x, knowledge, gen, config, curves, bar)
    bar.close()
    for model in models:
        model.eval()
    return curves


def _train_epochs(
    models: Sequence[nn.Module],
    optimizers: Sequence[torch.optim.Optimizer],
    names: list[str],
    x: Tensor,
    knowledge: Sequence[Tensor],
    gen: torch.Generator,
    config: PKEConfig,
    curves: list[list[float]],
    bar: tqdm,
) -> None:
    device = x.device
    for _ in range(config.train_epochs):
        with torch.no_grad():
            params = [dict(m.named_parameters()) for m in models]
            mean = {k: torch.stack([p[k].detach() for p in params]).mean(0) for k in names}
        for n, (model, opt) in enumerate(zip(models, optimizers, strict=True)):
            model.train()
            own = dict(model.named_parameters())
            z = knowledge[n].to(device)

            def terms(
                idx: Tensor, model: nn.Module = model, own: dict = own, z: Tensor = z, mean: dict = mean
            ) -> dict[str, Tensor]:
                out = {"l1": F.l1_loss(model(x[idx]), z[idx])}
                if names:  # the proximal term to the mean extractor (none for a head-only model)
                    out["prox"] = config.mu * sum(((own[k] - mean[k]) ** 2).sum() for k in names)
                return out

            # one epoch of this model, then the next model's: the mean extractor moves once per epoch
            epoch = fit_terms(
                terms, opt, n=len(x), batch_size=config.batch_size, epochs=1, generator=gen, device=device,
                lone_last="drop",
            )  # fmt: skip
            curves[n].append(epoch[0]["l1"])
            bar.update(1)


def personalize_server(
    bundle_paths: Uploads,
    aggregate_dir: str | Path,
    out_dir: str | Path,
    *,
    config: PKEConfig,
    progress: bool = False,
) -> PKEResult:
    """PKE for every classifier bundle; writes ``<client>.package`` per client and ``pke_report.json``.

    ``bundle_paths``: the bundle files, or name -> bytes (bundles that arrived as bytes, held to the checks
    of a file, :func:`server_kit.teachers.loading.read_uploads`). ``<client>`` is the stem of the file (the
    name),
    made unique by :func:`export.bundle.client_names` (checked before anything is read or written), and is
    the package's ``client``.

    ``aggregate_dir`` is a ``server-kit aggregate`` output (``global.onnx``, ``synthetic.npz``, and
    ``generator/generator.onnx`` when the generator was a synthesis source).
    """
    agg, out = Path(aggregate_dir), Path(out_dir)
    global_path, synthetic_path = agg / "global.onnx", agg / SYNTHETIC_FILE
    for path in (global_path, synthetic_path):
        if not path.is_file():
            raise DataError(f"{path} not found; pass the output directory of `server-kit aggregate`")
    sources = list(bundle_paths)  # the paths, or the names of the bytes
    names = {Path(p).resolve(): name for p, name in zip(sources, client_names(sources), strict=True)}
    device = resolve_device(config.device)  # once for the run: loading, knowledge and training
    seconds: dict[str, float] = {}
    with timed(seconds, "load"):
        inputs = _load_inputs(bundle_paths, agg, config, device)
        x, teachers = inputs.x, inputs.teachers
        knowledge = [batched_logits(t.module, x, device=device) for t in teachers]  # Z_n: N x L each

    with timed(seconds, "pke"):
        models = []
        for _ in teachers:
            model = build_model(inputs.arch, inputs.input_shape, inputs.num_classes)
            model.load_state_dict(inputs.global_state)
            models.append(model)
        curves = train_server_models(models, x, knowledge, config=config, progress=progress, device=device)
        server_knowledge = [batched_logits(m, x, device=device) for m in models]  # Z_n^s

    with timed(seconds, "write"):
        paths, rows = _write_packages(inputs, names, server_knowledge, knowledge, curves, config, out)
    arch, generator_bytes, skipped = inputs.arch, inputs.generator_bytes, inputs.skipped
    report = {
        "config": config.to_dict(),
        "global_arch": arch,
        "inputs": len(x),
        "generator": generator_bytes is not None,
        "clients": rows,
        "skipped": [{"file": p, "reason": r} for p, r in skipped],
        "seconds": seconds,
    }
    report_path = atomic_write_json(out / "pke_report.json", report)
    return PKEResult(tuple(paths), report_path, seconds, report)


@dataclass(frozen=True)
class _Inputs:
    """What PKE starts from: the teachers, the global model (bytes, arch, weights), the task's shape, the
    synthetic inputs it distils on and the generator a package ships when there is one."""

    teachers: list[Teacher]
    skipped: list[tuple[str, str]]
    global_bytes: bytes
    arch: str
    input_shape: tuple[int, int, int]
    num_classes: int
    global_state: dict[str, Tensor]
    x: Tensor
    generator_bytes: bytes | None


def _load_inputs(bundle_paths: Uploads, agg: Path, config: PKEConfig, device: torch.device) -> _Inputs:
    """The teachers and ``agg``'s global model, synthetic set (up to ``max_inputs``, a seeded draw) and
    generator, each checked against the others."""
    global_path = agg / "global.onnx"
    teachers, skipped = load_teachers(bundle_paths, device=device)
    global_bytes = global_path.read_bytes()
    meta = read_metadata(global_bytes)
    arch = meta.get("arch")
    if not arch:
        raise DataError(f"{global_path} has no arch metadata; it was not written by server-kit aggregate")
    input_shape = tuple(teachers[0].bundle.input_shape)
    num_classes = teachers[0].bundle.num_classes
    template = build_model(arch, input_shape, num_classes)  # type: ignore[arg-type]
    global_state = initializer_state_dict(global_bytes, template)
    synthetic = load_synthetic(agg / SYNTHETIC_FILE)
    if tuple(synthetic.x.shape[1:]) != input_shape:
        raise DataError(
            f"synthetic set is {tuple(synthetic.x.shape[1:])} but the teachers take {input_shape}"
        )
    keep = torch.randperm(len(synthetic), generator=torch.Generator().manual_seed(config.seed))
    x = synthetic.x[keep[: config.max_inputs].sort().values]  # N x C x H x W, multiples of 1/255
    generator_path = agg / "generator" / "generator.onnx"
    generator_bytes = generator_path.read_bytes() if generator_path.is_file() else None
    return _Inputs(
        teachers,
        skipped,
        global_bytes,
        arch,
        input_shape,
        num_classes,
        global_state,
        x,
        generator_bytes,  # type: ignore[arg-type]
    )


def _write_packages(
    inputs: _Inputs,
    names: dict[Path, str],
    server_knowledge: list[Tensor],
    knowledge: list[Tensor],
    curves: list[list[float]],
    config: PKEConfig,
    out: Path,
) -> tuple[list[Path], list[dict[str, Any]]]:
    """One package per client (its personalised knowledge on the shared inputs) and its report row."""
    x = inputs.x
    x_uint8 = (x * 255).round().to(torch.uint8).numpy()
    knobs = {"mu": float(config.mu), "epochs": config.train_epochs, "lr": float(config.lr), "inputs": len(x)}
    paths, rows = [], []
    for teacher, zs, z, curve in zip(inputs.teachers, server_knowledge, knowledge, curves, strict=True):
        client = names[Path(teacher.path).resolve()]  # type: ignore[arg-type]
        package = Package(
            client=client,
            client_sha256=teacher.bundle.model_sha256,
            global_onnx=inputs.global_bytes,
            global_arch=inputs.arch,
            num_classes=inputs.num_classes,
            input_shape=inputs.input_shape,
            inputs=x_uint8,
            knowledge=zs.numpy().astype(np.float32),
            generator_onnx=inputs.generator_bytes,
            knobs=knobs,
            seed=config.seed,
        )
        path = write_package(package, out / f"{client}.package")
        paths.append(path)
        rows.append(
            {
                "client": client,
                "package": path.name,
                "size_bytes": path.stat().st_size,
                "l1_curve": curve,
                # how far the personalised knowledge moved from the client's own (0 = a copy of it)
                "l1_to_client_knowledge": float(F.l1_loss(zs, z)),
                "agreement_with_client": float((zs.argmax(1) == z.argmax(1)).float().mean()),
            }
        )
    return paths, rows
