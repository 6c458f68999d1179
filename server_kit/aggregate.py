"""The server pipeline: bundles -> teachers -> pseudo-images -> labels -> student -> global.onnx.

Four phases, each a typed function a benchmark can call alone: :func:`synthesize` (pooled synthesis
sources, ``SOURCES``: inversion, decoder, generator), :func:`label` (:mod:`server_kit.labelling.labels`),
:func:`train_global` (distillation, or FedMHO's fusion) and the report :func:`aggregate` writes.

One call runs pFedZKD's server side (Algorithms 3 and 4) and leaves everything needed to audit it in
``out_dir``: ``global.onnx`` (validated, parity-checked), ``report.json`` (config, per-phase seconds,
teachers, skipped bundles, loss curve, accuracy), ``pseudo_images.png``, ``synthetic.npz`` (the
distillation set, reused by ``server-kit personalize``), ``synthetic/`` (the inversion chunks, so a killed
run resumes where it stopped) and ``generator/`` (the trained generator as ONNX). ``server-kit aggregate``
is a thin CLI over it.
"""

from __future__ import annotations

import copy
import io
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from common.checks import check_real_dir, from_preset, is_number
from common.configs import config_from_dict
from common.device import check_device, resolve_device
from common.errors import (
    BundleError,
    ConfigError,
    DataError,
    SpecError,
    TeacherError,
    ToolkitError,
)
from common.seeding import derive_seed, seeded
from common.timing import timed
from edge_sdk.arch import build_model, parse_arch, with_num_classes
from edge_sdk.data import ArrayDataset, deploy_metadata_for
from edge_sdk.precision import Precision, autocast, check_precision, resolve_precision
from edge_sdk.profiling import allowed_cores, usable_threads
from edge_sdk.train import release_memory
from export.atomic import atomic_write_bytes, atomic_write_json
from export.bundle import Bundle
from export.onnx_export import export_onnx
from server_kit.evaluate import evaluate_onnx
from server_kit.labelling.labels import LabelConfig, Labels, label_synthetic
from server_kit.labelling.trust import verify_claims, verify_decoders
from server_kit.report.grid import write_grid
from server_kit.synthesis.decoders import check_temperature, filter_by_centroid, load_decoder, sample_decoders
from server_kit.synthesis.generator import ConditionalGenerator, GeneratorConfig, synthesize_generator
from server_kit.synthesis.inversion import InversionConfig, SyntheticSet, synthesize_inversion
from server_kit.teachers.loading import (
    Teacher,
    Uploads,
    declared_class_names,
    read_uploads,
    teachers_from_bundles,
)
from server_kit.teachers.parallel import teacher_workers
from server_kit.training.adversarial import AdversarialConfig, adversarial_distill
from server_kit.training.distill import DistillConfig, distill
from server_kit.training.fedavg import fedavg_init
from server_kit.training.fusion import FusionConfig, fuse

__all__ = [
    "DEFAULT_STUDENT",
    "SOURCES",
    "SYNTHETIC_FILE",
    "AggregateConfig",
    "AggregateResult",
    "DecoderPool",
    "Federation",
    "Synthesis",
    "Training",
    "aggregate",
    "label",
    "load_synthetic",
    "save_synthetic",
    "split_kinds",
    "synthesize",
    "top_up",
    "train_global",
]

# A small CNN (0.42 M parameters, 8.5 MFLOPs at 28x28): big enough to absorb ten MNIST teachers,
# small enough to distill in under a minute on two CPU cores. The head is resized to the task's classes.
DEFAULT_STUDENT = "C32k3-P-C64k3-P-F128-F10"

_DISTILL_PRESETS: dict[str, dict[str, Any]] = {
    # 10 epochs: on MNIST 20 gave the same uploads no better a student, for twice the time
    # (benchmarks/RESULTS.md, "Speed")
    "fast": dict(epochs=10, batch_size=64, lr=1e-3, tau=4.0),
    # The paper fixes tau = 4 and (client side) Adam 1e-3, batch 64; E_distill is not given: 50 epochs.
    "paper": dict(epochs=50, batch_size=64, lr=1e-3, tau=4.0),
}
SYNTH_SOURCES = ("inversion", "generator", "decoder")
WORK_DIRS = ("synthetic", "generator")  # the folders the sources write into under the output folder
TOP_UP_STREAM = 1  # derive_seed stream of top_up's decoder draws (the first draw uses the seed itself)
SYNTHETIC_FILE = "synthetic.npz"  # the distillation set, kept for personalization (server-kit personalize)


def _fast_inversion() -> InversionConfig:
    return InversionConfig.preset("fast")


def _fast_distill() -> DistillConfig:
    return DistillConfig(**_DISTILL_PRESETS["fast"])


def _check_names(name: str, value: object) -> None:
    """A list of source names from a config file: a tuple of strs (or None), nothing else."""
    if value is not None and not (isinstance(value, tuple) and all(isinstance(v, str) for v in value)):
        raise ConfigError(f"{name} must be a list of {SYNTH_SOURCES}, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class AggregateConfig:
    """Everything the server run needs besides the bundles.

    ``hard_labels`` is the paper's "w/o ZSKD" ablation: the student learns the generating teacher's
    target class with cross entropy, no multi-teacher fusion. It is the one switch: it changes the
    labelling, the top-up and which methods combine, not just the loss, so ``distill.hard_labels`` (the
    loss of :func:`server_kit.training.distill.distill` alone) stays False here and the server sets it from
    this.
    ``labels`` says how the teachers' votes become a soft target (:mod:`server_kit.labelling.labels`); the
    hard
    labels of the ablation ignore it. ``device="auto"`` picks CUDA when present.

    FedMHO: the ``decoder`` source samples ``decoder_samples`` images from the ``cvae_decoder`` bundles
    (labels drawn from each client's label counts) and keeps the ``decoder_keep`` fraction nearest each
    class centroid. With ``fusion`` set, the global model is not distilled by consensus alone: it is
    initialised by FedAvg of the classifier teachers when they share one architecture
    (``fedavg_init``), else by consensus distillation of ``student`` on the whole synthetic set, and then
    trained on the filtered decoder samples with the FedMHO loss of ``fusion.mode`` (ce, md or sd).
    """

    student: str = DEFAULT_STUDENT  # the global model's architecture (an edge-sdk architecture spec)
    device: str = "auto"  # the server's device: auto (CUDA when present), cpu, cuda or cuda:N
    seed: int = 0  # seed of the server's synthesis and training
    inversion: InversionConfig = field(default_factory=_fast_inversion)
    distill: DistillConfig = field(default_factory=_fast_distill)
    # the synthesis sources whose samples are pooled: inversion, generator and decoder, any of them; none:
    # inversion and generator, and the decoders whenever CVAE decoder bundles are among the uploads
    synth: tuple[str, ...] | None = None
    generator: GeneratorConfig = field(default_factory=GeneratorConfig.preset)
    labels: LabelConfig = field(default_factory=LabelConfig)
    # sources whose samples keep the class they were made for as a one-hot target instead of the
    # teachers' vote: a decoder sample of class y comes from a client that holds y, so its label is right
    # by design (FedCVAE/FedMHO); the teachers, voting on blurry decoder images, are not
    construction_labels: tuple[str, ...] = ("decoder",)
    # a constructed sample's target: this weight on its class, the rest on the teachers' vote (dark
    # knowledge; where the vote keeps the sample its argmax is the class anyway). 1: one-hot
    construction_weight: float = 0.5
    # after the vote, each class left with fewer kept samples than the median class gets more decoder
    # samples of it (from the decoders that hold it) until it reaches the median: a class one client
    # alone holds loses most of its inversion and generator samples to the vote (the other teachers call
    # them theirs), and the student would see it far less often than the rest
    top_up: bool = True
    # check each claimed class against the other claimants on the teachers' own inversions before any
    # count weighs anything; none: whenever the inversion source runs
    verify_claims: bool | None = None
    # DENSE-style rounds after the distillation: the generator made adversarial to the student, the
    # student trained on its new samples; needs the generator source
    adversarial: AdversarialConfig | None = None
    decoder_samples: int = 6000  # images drawn from the CVAE decoders (FedMHO's synthetic budget)
    # share of each class's decoder samples kept, those nearest the class centroid (FedMHO's R_th)
    decoder_keep: float = 0.8
    # the decoders' temperature t: z ~ N(0, t^2 I) when they are sampled; 1: the paper
    decoder_temperature: float = 1.0
    # how the decoder budget is split over classes: "examples" by the decoders' label counts (the paper),
    # "federation" by every upload's (the classifiers' too)
    decoder_weighting: Literal["examples", "federation"] = "examples"
    fusion: FusionConfig | None = None
    # FedMHO: initialise by FedAvg when the classifiers share one architecture; False: by consensus
    # distillation always
    fedavg_init: bool = True
    hard_labels: bool = False  # ablation 'w/o ZSKD': train on the generating teacher's hard labels
    on_error: Literal["stop", "skip"] = "stop"  # a bad bundle stops the run, or is skipped with its reason
    threads: int | None = None  # torch threads; none: the cores free at the start
    # auto, fp32 or bf16: the teachers' forward passes in inversion, the generator, the vote and the claim
    # checks, and the student's in distillation, run in bfloat16 autocast where the hardware has it
    # (auto) or as given; FedMHO's fusion and the reported accuracy run in float32
    precision: Precision = "auto"

    def __post_init__(self) -> None:
        check_precision(self.precision)
        try:
            parse_arch(self.student)
        except (SpecError, AttributeError) as err:
            raise ConfigError(f"student must be an architecture spec, got {self.student!r}: {err}") from err
        check_device(self.device)
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ConfigError(f"seed must be an integer >= 0, got {self.seed!r}")
        if isinstance(self.synth, str):
            object.__setattr__(self, "synth", tuple(x.strip() for x in self.synth.split(",") if x.strip()))
        for name in ("synth", "construction_labels"):
            value = getattr(self, name)
            if value is not None and not (
                isinstance(value, tuple) and all(isinstance(v, str) for v in value)
            ):
                raise ConfigError(f"{name} must be a list of {SYNTH_SOURCES}, got {value!r}")
        if not isinstance(self.fedavg_init, bool):
            raise ConfigError(f"fedavg_init must be a bool, got {self.fedavg_init!r}")
        if self.synth is not None:
            bad = sorted(set(self.synth) - set(SYNTH_SOURCES))
            if not self.synth or bad or len(set(self.synth)) != len(self.synth):
                raise ConfigError(
                    f"synth must be None or a non-empty, duplicate-free subset of {SYNTH_SOURCES}, got "
                    f"{self.synth!r}"
                )
        if isinstance(self.construction_labels, str):
            object.__setattr__(
                self,
                "construction_labels",
                tuple(x.strip() for x in self.construction_labels.split(",") if x.strip()),
            )
        _check_names("construction_labels", self.construction_labels)
        bad = sorted(set(self.construction_labels) - set(SYNTH_SOURCES))
        if bad or len(set(self.construction_labels)) != len(self.construction_labels):
            raise ConfigError(
                f"construction_labels must be a duplicate-free subset of {SYNTH_SOURCES}, got "
                f"{self.construction_labels!r}"
            )
        if not is_number(self.construction_weight) or not 0 <= self.construction_weight <= 1:
            raise ConfigError(f"construction_weight must be in [0, 1], got {self.construction_weight!r}")
        if not isinstance(self.top_up, bool):
            raise ConfigError(f"top_up must be a bool, got {self.top_up!r}")
        if not isinstance(self.inversion, InversionConfig):
            raise ConfigError(f"inversion must be an InversionConfig, got {type(self.inversion).__name__}")
        if not isinstance(self.distill, DistillConfig):
            raise ConfigError(f"distill must be a DistillConfig, got {type(self.distill).__name__}")
        if self.distill.hard_labels:
            raise ConfigError(
                "distill.hard_labels must be False in an AggregateConfig, got True; the server's switch "
                "is AggregateConfig(hard_labels=True) (the CLI's --hard-labels)"
            )
        if (
            isinstance(self.decoder_samples, bool)
            or not isinstance(self.decoder_samples, int)
            or (self.decoder_samples < 1)
        ):
            raise ConfigError(f"decoder_samples must be a positive integer, got {self.decoder_samples!r}")
        if not isinstance(self.decoder_keep, int | float) or not 0 < self.decoder_keep <= 1:
            raise ConfigError(f"decoder_keep must be in (0, 1], got {self.decoder_keep!r}")
        check_temperature(self.decoder_temperature)
        if self.decoder_weighting not in ("examples", "federation"):
            raise ConfigError(
                f"decoder_weighting must be 'examples' or 'federation', got {self.decoder_weighting!r}"
            )
        if self.fusion is not None and not isinstance(self.fusion, FusionConfig):
            raise ConfigError(f"fusion must be None or a FusionConfig, got {type(self.fusion).__name__}")
        if self.fusion is not None and self.synth is not None and "decoder" not in self.synth:
            raise ConfigError("FedMHO fusion trains on decoder samples: add 'decoder' to synth")
        if self.fusion is not None and self.hard_labels:
            raise ConfigError("fusion and hard_labels are two different server methods; pick one")
        if self.verify_claims is not None and not isinstance(self.verify_claims, bool):
            raise ConfigError(f"verify_claims must be None, True or False, got {self.verify_claims!r}")
        if self.verify_claims and "inversion" not in self.sources(True):
            raise ConfigError(
                "verify_claims checks label counts on the teachers' own inversions: add 'inversion' to "
                "synth, or set verify_claims=False"
            )
        if self.adversarial is not None and not isinstance(self.adversarial, AdversarialConfig):
            raise ConfigError(f"adversarial must be None or an AdversarialConfig, got {self.adversarial!r}")
        if self.adversarial is not None and "generator" not in self.sources(True):
            raise ConfigError(
                "adversarial distillation keeps training the generator: add 'generator' to synth"
            )
        if self.adversarial is not None and (self.hard_labels or self.fusion is not None):
            raise ConfigError(
                "adversarial distillation refines a consensus-distilled student: drop "
                "hard_labels / fusion, or set adversarial=None"
            )
        if not isinstance(self.labels, LabelConfig):
            raise ConfigError(f"labels must be a LabelConfig, got {type(self.labels).__name__}")
        if not isinstance(self.hard_labels, bool):
            raise ConfigError(f"hard_labels must be a bool, got {self.hard_labels!r}")
        if self.on_error not in ("stop", "skip"):
            raise ConfigError(f"on_error must be 'stop' or 'skip', got {self.on_error!r}")
        if self.threads is not None and (
            isinstance(self.threads, bool)
            or not isinstance(self.threads, int)
            or not 1 <= self.threads <= 4096
        ):
            raise ConfigError(f"threads must be None or an integer in [1, 4096], got {self.threads!r}")

    @classmethod
    def preset(cls, name: str = "fast", **overrides: Any) -> AggregateConfig:
        """``fast`` (CPU minutes, the default) or ``paper`` (pFedZKD as printed: inversion only, N_syn
        4000, its ZSKD settings, the mean consensus, counts taken as claimed), with any field overridden
        by keyword."""
        paper = {
            "synth": ("inversion",),
            "labels": LabelConfig(rule="mean", mask=False, drop_mismatch=False),
            "verify_claims": False,
        }
        presets = {
            key: {
                "inversion": InversionConfig.preset(key),
                "distill": DistillConfig(**_DISTILL_PRESETS[key]),
                **(paper if key == "paper" else {}),
            }
            for key in _DISTILL_PRESETS
        }
        return from_preset(cls, presets, name, "aggregate", **overrides)

    @property
    def checks_claims(self) -> bool:
        """Whether the label counts are verified (``verify_claims``, or by default with inversion)."""
        return "inversion" in self.sources(True) if self.verify_claims is None else self.verify_claims

    def sources(self, has_decoders: bool) -> tuple[str, ...]:
        """The synthesis sources this run uses, in ``SOURCES`` order: ``synth`` as given, or by default
        inversion and generator plus the decoders when there are any. Decoder samples are labelled by
        construction (``construction_labels``): under strong label skew they lift the global model well
        above inversion and generator alone (benchmarks/RESULTS.md, "Label skew")."""
        if self.synth is not None:
            return tuple(name for name in SOURCES if name in self.synth)
        wanted = ("inversion", "generator", "decoder") if has_decoders else ("inversion", "generator")
        return tuple(name for name in SOURCES if name in wanted)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["inversion"] = self.inversion.to_dict()
        out["generator"] = self.generator.to_dict()
        out["synth"] = None if self.synth is None else list(self.synth)
        out["construction_labels"] = list(self.construction_labels)
        out["fusion"] = None if self.fusion is None else self.fusion.to_dict()
        out["labels"] = self.labels.to_dict()
        out["adversarial"] = None if self.adversarial is None else self.adversarial.to_dict()
        out["precision"] = resolve_precision(self.precision, resolve_device(self.device))  # what ran
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> AggregateConfig:
        """The inverse of :meth:`to_dict` (a server report's ``config``), and the table of a TOML file a
        person wrote: keys are the fields, nested tables the nested configs (``[distill]``,
        ``[inversion]``, ...) over their defaults; an unknown key is refused with the valid ones. A
        report records the precision that ran (``auto`` resolved), so a replay runs that one."""
        return config_from_dict(cls, data, what="config")


@dataclass(frozen=True)
class AggregateResult:
    """What :func:`aggregate` wrote, its accuracy (when eval data was given) and timings."""

    out_dir: Path
    global_onnx: Path
    report_path: Path
    grid_path: Path
    accuracy: float | None
    synthetic_size: int
    seconds: dict[str, float]
    report: dict[str, Any]


def _student_spec(text: str, num_classes: int) -> str:
    return str(with_num_classes(parse_arch(text), num_classes))


def aggregate(
    bundle_paths: Uploads,
    out_dir: str | Path,
    *,
    config: AggregateConfig,
    eval_data: ArrayDataset | None = None,
    progress: bool = False,
) -> AggregateResult:
    """Run the server side end to end and write its outputs into ``out_dir`` (see the module docstring).

    ``bundle_paths``: bundle files, or name -> bytes (bundles that arrived over a network, a Flower reply),
    each held to the checks of a bundle file (:func:`server_kit.teachers.loading.read_uploads`) and named in
    the
    report by its name. Bad bundles stop the run or are skipped with their reason (``config.on_error``);
    bundles that disagree on num_classes / input_shape with the majority are refused. ``eval_data`` (uint8
    images, the global test set) is used only to report the accuracy of the written ``global.onnx``.
    """
    out = Path(out_dir)
    for name in WORK_DIRS:  # before any work: a link left there would take the files elsewhere
        check_real_dir(out / name)
    previous_threads = torch.get_num_threads()
    # torch's threads: the cores free now (an intra-op barrier waits for a shared core); teachers side by
    # side: every core this process may run on (a worker on a shared core just does fewer teachers)
    torch.set_num_threads(usable_threads(config.threads))
    workers = config.threads or min(previous_threads, allowed_cores())
    try:
        with teacher_workers(workers):
            return _run(bundle_paths, out, config, eval_data, progress)
    finally:
        torch.set_num_threads(previous_threads)


@dataclass(frozen=True)
class Federation:
    """What every server phase needs to know about the uploads: the teachers (frozen modules) and what
    each says it was trained on, the CVAE decoder bundles, the task's shape, and where to compute."""

    modules: list[torch.nn.Module]
    label_counts: list[list[int]]
    num_classes: int
    input_shape: tuple[int, int, int]
    device: torch.device
    decoders: list[tuple[Path, Any]] = field(default_factory=list)
    class_names: tuple[str, ...] | None = None  # what the teachers agree on; None: index names

    @classmethod
    def from_teachers(
        cls, teachers: Sequence[Teacher], device: torch.device, decoders: list[tuple[Path, Any]] | None = None
    ) -> Federation:
        first = teachers[0].bundle
        return cls(
            modules=[t.module for t in teachers],
            label_counts=[list(t.bundle.label_counts) for t in teachers],
            num_classes=first.num_classes,
            input_shape=tuple(first.input_shape),  # type: ignore[arg-type]
            device=device,
            decoders=list(decoders or []),
            class_names=declared_class_names([t.bundle for t in teachers]),
        )


@dataclass(frozen=True)
class Synthesis:
    """The pooled synthetic set, each source's part of it, the label counts the later phases may trust
    (the claimed ones, or those that passed :func:`server_kit.labelling.trust.verify_claims`) and the
    report."""

    synthetic: SyntheticSet
    parts: dict[str, SyntheticSet]
    label_counts: list[list[int]]
    seconds: dict[str, float]
    report: dict[str, Any]
    generator: ConditionalGenerator | None = None
    decoders: DecoderPool | None = None


@dataclass(frozen=True)
class DecoderPool:
    """The loaded decoders and the label counts they may be sampled by (verified when claims are)."""

    modules: list[torch.nn.Module]
    label_counts: list[list[int]]


@dataclass(frozen=True)
class SourceOutput:
    """What one synthesis source gives: its samples, its report entries, and a generator that can draw
    more (the generator source only; adversarial distillation keeps training it)."""

    samples: SyntheticSet
    report: dict[str, Any] = field(default_factory=dict)
    generator: ConditionalGenerator | None = None
    decoders: DecoderPool | None = None


# A synthesis source: (federation, config, out_dir, progress) -> its output.
SynthesisSource = Callable[[Federation, "AggregateConfig", Path, bool], SourceOutput]


def _inversion_source(fed: Federation, config: AggregateConfig, out: Path, progress: bool) -> SourceOutput:
    """pFedZKD's Multi-ZSKD inversion of every teacher (for its own classes with ``classes="held"``)."""
    part = synthesize_inversion(
        fed.modules,
        num_classes=fed.num_classes,
        input_shape=fed.input_shape,
        config=config.inversion,
        seed=config.seed,
        device=fed.device,
        work_dir=out / WORK_DIRS[0],
        progress=progress,
        label_counts=fed.label_counts if config.inversion.classes == "held" else None,
        precision=config.precision,
    )
    return SourceOutput(part)


def _generator_source(fed: Federation, config: AggregateConfig, out: Path, progress: bool) -> SourceOutput:
    """A conditional generator trained against the label-share-weighted teachers (FedKDG/DENSE/DFDG)."""
    part, generator, losses = synthesize_generator(
        fed.modules,
        fed.label_counts,
        input_shape=fed.input_shape,
        num_classes=fed.num_classes,
        config=config.generator,
        seed=config.seed,
        device=fed.device,
        progress=progress,
        work_dir=out / WORK_DIRS[1],
        precision=config.precision,
    )
    return SourceOutput(part, {"generator_loss": losses[:: max(1, len(losses) // 50)]}, generator)


def _decoder_source(fed: Federation, config: AggregateConfig, out: Path, progress: bool) -> SourceOutput:
    """FedMHO: samples of the uploaded CVAE decoders, labelled by construction, centroid-filtered; with
    ``config.checks_claims`` each decoder's claimed classes are first checked against the teachers."""
    part, report, pool = _decoder_samples(fed, config, out)
    return SourceOutput(part, {"decoders": report}, decoders=pool)


SOURCES: dict[str, SynthesisSource] = {
    "inversion": _inversion_source,
    "decoder": _decoder_source,
    "generator": _generator_source,
}


def synthesize(fed: Federation, config: AggregateConfig, out: Path, *, progress: bool = False) -> Synthesis:
    """Run every source of ``config.sources`` (in ``SOURCES`` order, so the pooled set does not depend on
    the order the user listed them in) and pool their samples.

    With ``config.checks_claims`` the label counts are verified on the inversions as soon as they exist,
    so the generator (and every later phase) weighs the teachers by the verified counts.
    """
    parts: dict[str, SyntheticSet] = {}
    seconds: dict[str, float] = {}
    report: dict[str, Any] = {"claims": None}
    generator = None
    pool = None
    wanted = config.sources(bool(fed.decoders))
    if config.fusion is not None and "decoder" not in wanted:
        raise ConfigError("FedMHO fusion trains on decoder samples: pass cvae_decoder bundles")
    for name, source in SOURCES.items():
        if name not in wanted:
            continue
        with timed(seconds, name):
            output = source(fed, config, out, progress)
            parts[name] = output.samples
            report.update(output.report)
            generator = output.generator or generator
            pool = output.decoders or pool
        release_memory()  # each source's activations are garbage now; keep the process small
        if name == "inversion" and config.checks_claims:
            with timed(seconds, "claims"):
                check = verify_claims(
                    fed.modules, fed.label_counts, parts[name], device=fed.device, precision=config.precision
                )
                fed = replace(fed, label_counts=check.label_counts)
                report["claims"] = check.report()
    pooled = SyntheticSet(
        x=torch.cat([p.x for p in parts.values()]),
        teacher=torch.cat([p.teacher for p in parts.values()]),
        target_class=torch.cat([p.target_class for p in parts.values()]),
    )
    report["synthetic_sources"] = {name: len(p) for name, p in parts.items()}
    return Synthesis(pooled, parts, fed.label_counts, seconds, report, generator, pool)


def label(fed: Federation, synthesis: Synthesis, config: AggregateConfig) -> Labels:
    """Soft targets for the synthetic set (``config.labels``, weighing the teachers by the counts that
    synthesis trusted), or the paper's "w/o ZSKD" ablation: the target class as a hard label, all kept."""
    synthetic = synthesis.synthetic
    if config.hard_labels:
        targets = F.one_hot(synthetic.target_class, fed.num_classes).float()
        n = len(synthetic)
        return Labels(targets=targets, keep=torch.ones(n, dtype=torch.bool), report={"rule": "hard"})
    # the pooled set is the parts in order: one flag per sample says whether its source is labelled
    # by construction (the class it was made for) or by the teachers' vote
    by_construction = torch.cat(
        [
            torch.full((len(part),), name in config.construction_labels, dtype=torch.bool)
            for name, part in synthesis.parts.items()
        ]
    )
    return _vote_labels(fed, synthetic.x, synthetic.target_class, by_construction, synthesis, config)


def _vote_labels(
    fed: Federation,
    x: Tensor,
    y: Tensor,
    by_construction: Tensor,
    synthesis: Synthesis,
    config: AggregateConfig,
) -> Labels:
    """The teachers' vote on every sample (with drop_mismatch it also drops a constructed sample the
    teachers do not call its class: a blurry decode, or a decoder that lies about its labels); a
    constructed sample's target is ``construction_weight`` on its class, the rest on the vote."""
    votes = label_synthetic(
        fed.modules,
        x,
        y,
        synthesis.label_counts,
        config=config.labels,
        tau=config.distill.tau,
        device=fed.device,
        precision=config.precision,
    )
    weight = float(config.construction_weight)
    construction = weight * F.one_hot(y, fed.num_classes).float()
    construction += (1 - weight) * votes.targets
    targets = torch.where(by_construction.unsqueeze(1), construction, votes.targets)
    report = dict(votes.report) | {
        "by_construction": int(by_construction.sum()),
        "by_construction_kept": int((votes.keep & by_construction).sum()),
    }
    return Labels(targets=targets, keep=votes.keep, report=report)


def top_up(
    fed: Federation, synthesis: Synthesis, labels: Labels, config: AggregateConfig
) -> tuple[Synthesis, Labels]:
    """Bring every class the vote left below the median class up to it with more decoder samples.

    Why: the vote drops the inversion and generator samples of a class one client alone holds (every
    other teacher calls them one of its own classes), so that class reaches the student with half the
    samples of the rest. The new samples come from the decoders that hold the class (by the trusted
    counts), pass the same centroid filter and vote as the first ones, and are inserted at the end of
    the decoder part, so the pooled set stays the parts in order. A class whose decoder samples the vote
    mostly rejected gets at most 4 draws per missing sample. Off (returns its inputs) with
    ``top_up=False``, without decoders, with hard labels or FedMHO fusion (their own recipes).
    """
    pool = synthesis.decoders
    if not config.top_up or pool is None or config.hard_labels or config.fusion is not None:
        return synthesis, labels
    num_classes = fed.num_classes
    classes = labels.targets.argmax(1)
    kept = torch.bincount(classes[labels.keep], minlength=num_classes)
    present = torch.tensor(synthesis.label_counts).sum(0) > 0
    if not bool(present.any()):
        return synthesis, labels
    goal = int(kept[present].median())
    holds = torch.tensor(pool.label_counts).sum(0) > 0
    deficit = ((goal - kept).clamp(min=0) * (present & holds)).tolist()
    names = list(synthesis.parts)  # in SOURCES order, the order of the pooled set
    start = sum(len(synthesis.parts[name]) for name in names[: names.index("decoder")])
    end = start + len(synthesis.parts["decoder"])
    first_y = synthesis.synthetic.target_class[start:end]
    first_keep = labels.keep[start:end]
    drawn = [0] * num_classes
    xs, ys = [], []
    for c in range(num_classes):
        if deficit[c] == 0:
            continue
        made = int((first_y == c).sum())
        rate = int((first_keep & (first_y == c)).sum()) / made * config.decoder_keep if made else 0.0
        drawn[c] = min(4 * deficit[c], math.ceil(deficit[c] / max(rate, 1e-9)))
        rows = [[n if j == c else 0 for j, n in enumerate(row)] for row in pool.label_counts]
        x, y = sample_decoders(
            pool.modules,
            rows,
            total=drawn[c],
            num_classes=num_classes,
            seed=derive_seed(config.seed, TOP_UP_STREAM, c),
            device=fed.device,
            temperature=config.decoder_temperature,
        )
        mask = filter_by_centroid(x, y, keep=config.decoder_keep)
        xs.append(x[mask])
        ys.append(y[mask])
    report = {
        "goal": goal,
        "kept_before": kept.tolist(),
        "drawn": drawn,  # decoded
        "filtered": [0] * num_classes,  # left by the centroid filter (all join the decoder part)
        "added": [0] * num_classes,  # of those, kept by the vote
    }
    if not xs:
        return synthesis, replace(labels, report=labels.report | {"top_up": report})
    x, y = torch.cat(xs), torch.cat(ys)
    report["filtered"] = torch.bincount(y, minlength=num_classes).tolist()
    constructed = torch.full((len(y),), "decoder" in config.construction_labels, dtype=torch.bool)
    new = _vote_labels(fed, x, y, constructed, synthesis, config)
    report["added"] = torch.bincount(y[new.keep], minlength=num_classes).tolist()

    def insert(old: Tensor, extra: Tensor) -> Tensor:
        return torch.cat([old[:end], extra, old[end:]])

    teacher = torch.full((len(y),), -1, dtype=synthesis.synthetic.teacher.dtype)
    pooled = SyntheticSet(
        x=insert(synthesis.synthetic.x, x),
        teacher=insert(synthesis.synthetic.teacher, teacher),
        target_class=insert(synthesis.synthetic.target_class, y),
    )
    decoder_part = synthesis.parts["decoder"]
    parts = dict(synthesis.parts) | {
        "decoder": SyntheticSet(
            x=torch.cat([decoder_part.x, x]),
            teacher=torch.cat([decoder_part.teacher, teacher]),
            target_class=torch.cat([decoder_part.target_class, y]),
        )
    }
    keep = insert(labels.keep, new.keep)
    labels_report = labels.report | {"kept": int(keep.sum()), "top_up": report}
    synthesis = replace(
        synthesis,
        synthetic=pooled,
        parts=parts,
        report=synthesis.report | {"synthetic_sources": {k: len(v) for k, v in parts.items()}},
    )
    return synthesis, Labels(targets=insert(labels.targets, new.targets), keep=keep, report=labels_report)


@dataclass(frozen=True)
class Training:
    """The trained global model and how it was made."""

    student: torch.nn.Module
    spec: str
    init: str
    distill_loss: list[float]
    fusion_loss: list[float]
    seconds: dict[str, float]
    adversarial: dict[str, list[float]] | None = None


def train_global(
    fed: Federation,
    synthesis: Synthesis,
    labels: Labels,
    config: AggregateConfig,
    *,
    teachers: Sequence[Teacher] = (),
    progress: bool = False,
) -> Training:
    """Distil the student on the kept labelled samples, then (``config.adversarial``) refine it in DENSE's
    rounds; with ``config.fusion`` (FedMHO) initialise it by FedAvg of the same-architecture ``teachers``
    when possible and fuse it on the decoder samples."""
    seconds: dict[str, float] = {}
    with timed(seconds, "distill"):
        spec = _student_spec(config.student, fed.num_classes)
        init = "consensus-distillation"
        student = fedavg_init(list(teachers)) if config.fusion is not None and config.fedavg_init else None
        losses: list[float] = []
        if student is not None:  # FedMHO Eq. 4: same-architecture classifiers are averaged
            init, spec = "fedavg", teachers[0].bundle.arch
        else:
            keep = labels.keep
            if int(keep.sum()) < 2:
                raise DataError(
                    f"only {int(keep.sum())} of {len(keep)} synthetic samples carry their target class's "
                    "label; the teachers disagree with every source: keep them with drop_mismatch=False"
                )
            hard = config.hard_labels
            targets = synthesis.synthetic.target_class[keep] if hard else labels.targets[keep]
            with seeded(config.seed):  # weight init draws from the global RNG: scope and seed it
                student = build_model(spec, fed.input_shape, fed.num_classes)
            losses = distill(
                student,
                synthesis.synthetic.x[keep],
                targets,
                config=replace(config.distill, hard_labels=hard),
                seed=config.seed,
                device=fed.device,
                progress=progress,
                precision=config.precision,
            )
    curves = None
    if config.adversarial is not None:
        if synthesis.generator is None:
            raise ConfigError("adversarial distillation needs the generator source's generator")
        with timed(seconds, "adversarial"):
            keep = labels.keep
            curves = adversarial_distill(
                student,
                copy.deepcopy(synthesis.generator),  # a phase leaves its inputs as they were
                fed.modules,
                synthesis.label_counts,
                synthesis.synthetic.x[keep],
                labels.targets[keep],
                config=config.adversarial,
                generator_config=config.generator,
                labels=config.labels,
                distill_config=config.distill,
                seed=config.seed,
                device=fed.device,
                progress=progress,
                precision=config.precision,
            )
    fusion_losses: list[float] = []
    if config.fusion is not None:
        decoder_part = synthesis.parts["decoder"]
        with timed(seconds, "fusion"):
            fusion_losses = fuse(
                student,
                decoder_part.x,
                decoder_part.target_class,
                config=config.fusion,
                teachers=fed.modules,
                label_counts=synthesis.label_counts,  # the counts synthesis trusted (verified when checked)
                decoder_counts=synthesis.decoders.label_counts if synthesis.decoders is not None else (),
                seed=config.seed,
                device=fed.device,
                progress=progress,
            )
    return Training(student.cpu().eval(), spec, init, losses, fusion_losses, seconds, curves)


def _run(
    bundle_paths: Uploads,
    out: Path,
    config: AggregateConfig,
    eval_data: ArrayDataset | None,
    progress: bool,
) -> AggregateResult:
    device = resolve_device(config.device)
    seconds: dict[str, float] = {}
    started_at = time.time()  # phases follow in the order of ``seconds`` (benchmarks/speed.py)
    wall = time.perf_counter()

    with timed(seconds, "load"):
        skipped: list[tuple[str, str]] = []
        uploads = read_uploads(bundle_paths, on_error=config.on_error, skipped=skipped)
        classifiers, decoder_bundles = split_kinds(uploads)
        teachers = teachers_from_bundles(
            classifiers, on_error=config.on_error, device=device, skipped=skipped, count=len(bundle_paths)
        )
        teachers, decoder_bundles = _usable(teachers, decoder_bundles, config, device, skipped)
        fed = Federation.from_teachers(teachers, device, decoder_bundles)
        if eval_data is not None and (
            eval_data.num_classes != fed.num_classes or eval_data.input_shape != fed.input_shape
        ):
            raise DataError(
                f"eval data is {eval_data.num_classes} classes of {eval_data.input_shape} but the teachers "
                f"are {fed.num_classes} classes of {fed.input_shape}; pass the test set of the federation's "
                "task"
            )

    out.mkdir(parents=True, exist_ok=True)  # once the uploads are read: a bad one leaves no directory
    synthesis = synthesize(fed, config, out, progress=progress)
    seconds.update(synthesis.seconds)
    with timed(seconds, "labels"):
        labels = label(fed, synthesis, config)
        synthesis, labels = top_up(fed, synthesis, labels, config)
        synthetic = synthesis.synthetic
        save_synthetic(out / SYNTHETIC_FILE, synthetic)
        agreement = {
            # how often the labels name the class a sample was made for ...
            "target_class": float((labels.targets.argmax(1) == synthetic.target_class).float().mean()),
            # ... and how often they agree with the teacher that made the image (does the image transfer?)
            "generating_teacher": _generator_agreement(
                fed.modules, synthetic, labels.targets.argmax(1), device, config.precision
            ),
        }

    training = train_global(fed, synthesis, labels, config, teachers=teachers, progress=progress)
    seconds.update(training.seconds)

    with timed(seconds, "export"):
        metadata = {
            "arch": training.spec,
            "role": "global-student",
            "producer": "server-kit",
            "num_classes": str(fed.num_classes),
            "num_teachers": str(len(teachers)),
            "seed": str(config.seed),
        } | deploy_metadata_for(fed.input_shape, fed.num_classes, fed.class_names)
        model_bytes = export_onnx(training.student, fed.input_shape, metadata=metadata, seed=config.seed)
        global_onnx = atomic_write_bytes(out / "global.onnx", model_bytes)
        keep = labels.keep
        grid_path = write_grid(out / "pseudo_images.png", synthetic.x[keep], labels.targets[keep])

    with timed(seconds, "evaluate"):
        evaluation = None
        if eval_data is not None:
            evaluation = evaluate_onnx(model_bytes, eval_data, threads=torch.get_num_threads())
    seconds["total"] = time.perf_counter() - wall

    report: dict[str, Any] = {
        "config": config.to_dict(),
        "seed": config.seed,
        "device": str(device),
        "threads": torch.get_num_threads(),
        "student": {
            "arch": training.spec,
            "num_classes": fed.num_classes,
            "input_shape": list(fed.input_shape),
            "class_names": list(fed.class_names) if fed.class_names is not None else None,
        },
        "teachers": [
            {
                "file": str(t.path) if t.path is not None else None,
                "arch": t.bundle.arch,
                "method": t.method,
                "sha256": t.bundle.sha256,
                "profile": t.bundle.profile.get("name"),
                "num_examples": t.bundle.num_examples,
                "label_counts": list(t.bundle.label_counts),
                "val_accuracy": _finite_or_none(t.bundle.metrics.get("val_accuracy")),
            }
            for t in teachers
        ],
        "skipped": [{"file": path, "reason": reason} for path, reason in skipped],
        "synthetic_size": len(synthetic),
        "generator_loss": [],
        "decoders": None,
        **synthesis.report,
        "labels": labels.report,
        "distilled_samples": labels.kept,
        "training": "consensus distillation" if config.fusion is None else f"FedMHO-{config.fusion.mode}",
        "init": training.init,
        "fusion_loss": training.fusion_loss,
        "label_agreement": agreement,
        "distill_loss": training.distill_loss,
        "adversarial": training.adversarial,
        "seconds": seconds,
        "started_at": started_at,
        "phase_order": list(seconds),  # the report's keys are written sorted
        "outputs": {
            "global_onnx": global_onnx.name,
            "pseudo_images": grid_path.name,
            "synthetic": SYNTHETIC_FILE,
        },
        "accuracy": None if evaluation is None else evaluation["accuracy"],
        "per_class_accuracy": None if evaluation is None else evaluation["per_class_accuracy"],
        "num_eval_examples": None if evaluation is None else evaluation["num_examples"],
    }
    report_path = atomic_write_json(out / "report.json", report)
    return AggregateResult(
        out_dir=out,
        global_onnx=global_onnx,
        report_path=report_path,
        grid_path=grid_path,
        accuracy=report["accuracy"],
        synthetic_size=len(synthetic),
        seconds=seconds,
        report=report,
    )


def _usable(
    teachers: list[Teacher],
    decoders: list[tuple[Path, Any]],
    config: AggregateConfig,
    device: torch.device,
    skipped: list[tuple[str, str]],
) -> tuple[list[Teacher], list[tuple[Path, Any]]]:
    """The teachers and decoder bundles this run can use, each tried once before any phase runs.

    Loading checks a teacher against onnxruntime, not against its manifest: an ONNX with 11 outputs under
    ``num_classes`` 10 loads, then breaks the labels minutes later. Here every failure is charged to its
    bundle: ``config.on_error="stop"`` raises it, ``"skip"`` appends (file, reason) to ``skipped``.
    """

    def fail(path: object, err: ToolkitError) -> None:
        if config.on_error == "stop":
            raise err
        skipped.append((str(path), str(err)))

    shape, classes = tuple(teachers[0].bundle.input_shape), teachers[0].bundle.num_classes
    probe = torch.rand((2, *shape), generator=torch.Generator().manual_seed(config.seed))
    usable = []
    for teacher in teachers:
        try:
            _probe_teacher(teacher.module, probe, classes, device)
        except TeacherError as err:
            fail(teacher.path, TeacherError(f"{teacher.path}: {err}"))
            continue
        usable.append(teacher)
    if not usable:
        reasons = "; ".join(reason for _, reason in skipped)
        raise TeacherError(f"no usable teacher is left: {reasons}")
    if "decoder" not in config.sources(bool(decoders)):
        return usable, decoders  # not read by this run
    kept = []
    for path, bundle in decoders:
        try:
            if (bundle.num_classes, tuple(bundle.input_shape)) != (classes, shape):
                raise DataError(
                    f"{path}: decoder of {bundle.num_classes} classes of {tuple(bundle.input_shape)}, the "
                    f"teachers are {classes} classes of {shape}; fix: pass only bundles of the same task"
                )
            load_decoder(bundle, device=device)  # the rebuild and parity check _decoder_samples repeats
        except (BundleError, DataError, TeacherError) as err:
            fail(path, err if str(err).startswith(str(path)) else type(err)(f"{path}: {err}"))
            continue
        kept.append((path, bundle))
    return usable, kept


def _probe_teacher(module: torch.nn.Module, x: Tensor, num_classes: int, device: torch.device) -> None:
    """TeacherError unless ``module`` maps ``x`` (B x C x H x W) to finite B x ``num_classes`` logits and
    passes a gradient back to its input (what inversion and the generator need)."""
    x = x.to(device).requires_grad_(True)
    try:
        logits = module(x)
        if tuple(logits.shape) != (len(x), num_classes):
            raise TeacherError(
                f"outputs shape {tuple(logits.shape)} on a batch of {len(x)}, but its manifest says "
                f"num_classes {num_classes}; fix: export the classifier with a {num_classes}-class head"
            )
        if not bool(torch.isfinite(logits).all()):
            raise TeacherError("outputs non-finite logits on inputs in [0, 1]; the model is broken")
        logits.float().sum().backward()
    except RuntimeError as err:  # torch's shape and dtype errors
        raise TeacherError(f"fails on a batch shaped {tuple(x.shape)}: {err}") from err
    if x.grad is None or not bool(torch.isfinite(x.grad).all()):
        raise TeacherError("passes no finite gradient to its input, which inversion needs")


def split_kinds(
    bundles: Sequence[tuple[Path, Bundle]],
) -> tuple[list[tuple[Path, Bundle]], list[tuple[Path, Any]]]:
    """The (name, Bundle) pairs of the classifiers (teachers) and of the cvae_decoder bundles, in order."""
    classifiers = [(path, bundle) for path, bundle in bundles if bundle.kind != "cvae_decoder"]
    decoders = [(path, bundle) for path, bundle in bundles if bundle.kind == "cvae_decoder"]
    return classifiers, decoders


def _decoder_samples(
    fed: Federation, config: AggregateConfig, out: Path
) -> tuple[SyntheticSet, dict[str, Any], DecoderPool]:
    """FedMHO decoder sampling + centroid filter; writes the per-class grids before and after the filter."""
    decoder_bundles, num_classes, input_shape = fed.decoders, fed.num_classes, fed.input_shape
    if not decoder_bundles:
        raise ConfigError("synth 'decoder' needs cvae_decoder bundles among the inputs, got none")
    bad = [str(p) for p, b in decoder_bundles if b.num_classes != num_classes or b.input_shape != input_shape]
    if bad:
        raise DataError(
            f"decoder bundles {bad} do not match the teachers' {num_classes} classes of {input_shape}"
        )
    device = resolve_device(config.device)
    decoders = [load_decoder(b, device=device) for _, b in decoder_bundles]
    counts = [list(b.label_counts) for _, b in decoder_bundles]
    check = None
    if config.checks_claims:  # before the counts decide any decoder's share of the budget
        check = verify_decoders(
            fed.modules, fed.label_counts, decoders, counts, seed=config.seed, device=device,
            precision=config.precision,
        )  # fmt: skip
        counts = check.label_counts
    federation = None
    if config.decoder_weighting == "federation":  # every upload's counts: the classifiers' and the decoders'
        federation = [sum(col) for col in zip(*fed.label_counts, *counts, strict=True)]
    x, y = sample_decoders(
        decoders,
        counts,
        total=config.decoder_samples,
        num_classes=num_classes,
        seed=config.seed,
        device=device,
        temperature=config.decoder_temperature,
        weighting=config.decoder_weighting,
        class_counts=federation,
    )
    mask = filter_by_centroid(x, y, keep=config.decoder_keep)
    write_grid(out / "decoder_samples.png", x, F.one_hot(y, num_classes).float())
    write_grid(out / "decoder_samples_filtered.png", x[mask], F.one_hot(y[mask], num_classes).float())
    part = SyntheticSet(x=x[mask], teacher=torch.full((int(mask.sum()),), -1), target_class=y[mask])
    report = {
        "bundles": [str(p) for p, _ in decoder_bundles],
        "sampled": len(y),
        "kept": int(mask.sum()),
        "grids": ["decoder_samples.png", "decoder_samples_filtered.png"],
        "claims": None if check is None else check.report(),
    }
    return part, report, DecoderPool(decoders, counts)


def save_synthetic(path: Path, synthetic: SyntheticSet) -> Path:
    """Write the synthetic set as uint8 images (what a package ships) plus its provenance columns."""
    buf = io.BytesIO()
    np.savez_compressed(
        buf,
        x=(synthetic.x.clamp(0, 1) * 255).round().to(torch.uint8).numpy(),
        teacher=synthetic.teacher.numpy(),
        target_class=synthetic.target_class.numpy(),
    )
    return atomic_write_bytes(path, buf.getvalue())


def load_synthetic(path: str | Path) -> SyntheticSet:
    """Inverse of :func:`save_synthetic`; images come back as float32 in [0, 1] (multiples of 1/255)."""
    try:
        with np.load(Path(path)) as data:
            x, teacher, target = data["x"], data["teacher"], data["target_class"]
    except (OSError, KeyError, ValueError) as err:
        raise DataError(
            f"{path} is not a synthetic set written by server-kit aggregate ({err}); rerun aggregate"
        ) from err
    if x.dtype != np.uint8 or x.ndim != 4 or not len(x) == len(teacher) == len(target):
        raise DataError(f"{path}: expected uint8 N x C x H x W images with N labels, got {x.dtype} {x.shape}")
    return SyntheticSet(
        x=torch.from_numpy(x).float().div_(255.0),
        teacher=torch.from_numpy(teacher).long(),
        target_class=torch.from_numpy(target).long(),
    )


@torch.no_grad()
def _generator_agreement(
    modules: Sequence[torch.nn.Module],
    synthetic: SyntheticSet,
    labels: Tensor,
    device: torch.device,
    precision: str = "auto",
) -> float:
    """Fraction of pseudo-images whose label equals the argmax of the teacher that generated them."""
    hits = 0
    precision = resolve_precision(precision, device)
    for k, module in enumerate(modules):
        mine = (synthetic.teacher == k).nonzero().flatten()  # indices of teacher k's images
        for i in range(0, mine.numel(), 512):
            idx = mine[i : i + 512]
            with autocast(precision, device):
                own = module(synthetic.x[idx].to(device)).argmax(1).cpu()
            hits += int((own == labels[idx]).sum())
    return hits / max(len(synthetic), 1)


def _finite_or_none(value: Any) -> float | None:
    return float(value) if is_number(value) else None
