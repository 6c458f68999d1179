"""The server run's one user-facing config (``server-kit aggregate``'s options, a report's ``config``),
and the sub-config it hands each phase: a phase sees only its own settings."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Literal

import torch

from common.checks import from_preset, is_number
from common.configs import config_from_dict
from common.device import check_device, resolve_device
from common.errors import ConfigError, SpecError
from edge_sdk.augment import is_color
from edge_sdk.models.arch import parse_arch
from edge_sdk.precision import Precision, check_precision, resolve_precision
from server_kit.labelling import CLAIM_CHECKS, LabelConfig, LabellingConfig
from server_kit.synthesis import (
    SOURCES,
    SYNTH_SOURCES,
    DecoderConfig,
    GeneratorConfig,
    InversionConfig,
    SynthesisConfig,
    check_views,
)
from server_kit.teachers import BudgetConfig, Phase, server_phases
from server_kit.training import AdversarialConfig, DistillConfig, FusionConfig, TrainingConfig

__all__ = ["COLOR_STUDENT", "DEFAULT_STUDENT", "AggregateConfig"]

# A small CNN (0.42 M parameters, 8.5 MFLOPs at 28x28): big enough to absorb ten MNIST teachers,
# small enough to distill in under a minute on two CPU cores. The head is resized to the task's classes.
DEFAULT_STUDENT = "C32k3-P-C64k3-P-F128-F10"
# Color images (three channels): a residual chain with BatchNorm in every block (25 MFLOPs at 32x32x3),
# the same family the devices' color search draws from; benchmarks/RESULTS.md ("Color images, server side")
# has the comparison with the small CNN on the same uploads
COLOR_STUDENT = "C16k3-R16k3-P-R32k3-P-R64k3-P-F10"

_DISTILL_PRESETS: dict[str, dict[str, Any]] = {
    # epochs decided by the images (DistillConfig.for_images): 10 on one-channel ones, where 20 gave the
    # same MNIST uploads no better a student, for twice the time (benchmarks/RESULTS.md, "Speed"); no
    # mixtures (DistillConfig.mix)
    "fast": dict(epochs=None, batch_size=64, lr=1e-3, tau=4.0, mix=0.0),
    # The paper fixes tau = 4 and (client side) Adam 1e-3, batch 64; E_distill is not given: 50 epochs.
    # No weight average: the paper keeps the student's last weights; no mixtures.
    "paper": dict(epochs=50, batch_size=64, lr=1e-3, tau=4.0, average=0.0, mix=0.0),
}


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
    loss of :func:`server_kit.training.distill.distill` alone) stays False here and the server sets it
    from this. ``labels`` says how the teachers' votes become a soft target
    (:mod:`server_kit.labelling.labels`); the hard labels of the ablation ignore it. ``device="auto"``
    picks CUDA when present.

    FedMHO: the ``decoder`` source samples ``decoder_samples`` images from the ``cvae_decoder`` bundles
    (labels drawn from each client's label counts) and keeps the ``decoder_keep`` fraction nearest each
    class centroid. With ``fusion`` set, the global model is not distilled by consensus alone: it is
    initialised by FedAvg of the classifier teachers when they share one architecture
    (``fedavg_init``), else by consensus distillation of ``student`` on the whole synthetic set, and then
    trained on the filtered decoder samples with the FedMHO loss of ``fusion.mode`` (ce, md or sd).
    """

    # the global model's architecture (an edge-sdk architecture spec), or auto: a residual chain for
    # color images, a small CNN for the rest
    student: str = "auto"
    device: str = "auto"  # the server's device: auto (CUDA when present), cpu, cuda or cuda:N
    seed: int = 0  # seed of the server's synthesis and training
    inversion: InversionConfig = field(default_factory=_fast_inversion)
    distill: DistillConfig = field(default_factory=_fast_distill)
    # the synthesis sources whose samples are pooled: inversion, generator and decoder, any of them; none:
    # inversion and generator, and the decoders whenever CVAE decoder bundles are among the uploads and
    # the images are not color ones (or FedMHO's fusion needs them); the generator then runs only if some
    # class has no decoder, else its samples are drawn from the decoders
    synth: tuple[str, ...] | None = None
    # more views of every synthetic image, each a sample the teachers label like the image itself: flip
    # adds its mirror (a natural image keeps its class under it), none adds nothing; auto: flip for color
    # images, none for the rest (a mirrored digit is no digit)
    views: Literal["auto", "none", "flip"] = "auto"
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
    # images drawn from the CVAE decoders: the one source whose label is right by construction, so the
    # student gains from more of them while the sampling stays cheap (FedMHO's preset keeps its paper's)
    decoder_samples: int = 12_000
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
    # what a teacher may cost at the batch of each phase, relative to the median teacher; one over it, or
    # non-finite while the phases run, stops the run or is dropped (on_error)
    budget: BudgetConfig = field(default_factory=BudgetConfig)
    threads: int | None = None  # torch threads; none: the cores free at the start
    # auto, fp32 or bf16: the teachers' forward passes in inversion, the generator, the vote and the claim
    # checks, and the student's in distillation, run in bfloat16 autocast where the hardware has it
    # (auto) or as given; FedMHO's fusion and the reported accuracy run in float32
    precision: Precision = "auto"

    def __post_init__(self) -> None:
        check_precision(self.precision)
        try:
            if self.student != "auto":
                parse_arch(self.student)
        except (SpecError, AttributeError) as err:
            raise ConfigError(
                f"student must be 'auto' or an architecture spec, got {self.student!r}: {err}"
            ) from err
        check_device(self.device)
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ConfigError(f"seed must be an integer >= 0, got {self.seed!r}")
        self._check_sources()
        check_views(self.views, allow_auto=True)
        self._check_phases()
        self._check_methods()
        if self.on_error not in ("stop", "skip"):
            raise ConfigError(f"on_error must be 'stop' or 'skip', got {self.on_error!r}")
        if self.threads is not None and (
            isinstance(self.threads, bool)
            or not isinstance(self.threads, int)
            or not 1 <= self.threads <= 4096
        ):
            raise ConfigError(f"threads must be None or an integer in [1, 4096], got {self.threads!r}")

    def _check_sources(self) -> None:
        """``synth`` and ``construction_labels``: lists of source names (a comma-separated string split)."""
        for name in ("synth", "construction_labels"):
            value = getattr(self, name)
            if isinstance(value, str):
                object.__setattr__(self, name, tuple(x.strip() for x in value.split(",") if x.strip()))
            _check_names(name, getattr(self, name))
        if self.synth is not None:
            bad = sorted(set(self.synth) - set(SYNTH_SOURCES))
            if not self.synth or bad or len(set(self.synth)) != len(self.synth):
                raise ConfigError(
                    f"synth must be None or a non-empty, duplicate-free subset of {SYNTH_SOURCES}, got "
                    f"{self.synth!r}"
                )
        bad = sorted(set(self.construction_labels) - set(SYNTH_SOURCES))
        if bad or len(set(self.construction_labels)) != len(self.construction_labels):
            raise ConfigError(
                f"construction_labels must be a duplicate-free subset of {SYNTH_SOURCES}, got "
                f"{self.construction_labels!r}"
            )
        if not is_number(self.construction_weight) or not 0 <= self.construction_weight <= 1:
            raise ConfigError(f"construction_weight must be in [0, 1], got {self.construction_weight!r}")

    def _check_phases(self) -> None:
        """Each phase's own config is of its type; the decoder fields make a valid :class:`DecoderConfig`."""
        for name, kind in (
            ("inversion", InversionConfig),
            ("distill", DistillConfig),
            ("labels", LabelConfig),
            ("budget", BudgetConfig),
        ):
            if not isinstance(getattr(self, name), kind):
                raise ConfigError(
                    f"{name} must be a {kind.__name__}, got {type(getattr(self, name)).__name__}"
                )
        for name in ("top_up", "fedavg_init", "hard_labels"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.distill.hard_labels:
            raise ConfigError(
                "distill.hard_labels must be False in an AggregateConfig, got True; the server's switch "
                "is AggregateConfig(hard_labels=True) (the CLI's --hard-labels)"
            )
        self.decoder  # noqa: B018 (validates the decoder fields)
        if self.fusion is not None and not isinstance(self.fusion, FusionConfig):
            raise ConfigError(f"fusion must be None or a FusionConfig, got {type(self.fusion).__name__}")
        if self.verify_claims is not None and not isinstance(self.verify_claims, bool):
            raise ConfigError(f"verify_claims must be None, True or False, got {self.verify_claims!r}")
        if self.adversarial is not None and not isinstance(self.adversarial, AdversarialConfig):
            raise ConfigError(f"adversarial must be None or an AdversarialConfig, got {self.adversarial!r}")

    def _check_methods(self) -> None:
        """The server methods that combine, and the sources each one needs."""
        if self.fusion is not None and self.synth is not None and "decoder" not in self.synth:
            raise ConfigError("FedMHO fusion trains on decoder samples: add 'decoder' to synth")
        if self.fusion is not None and self.hard_labels:
            raise ConfigError("fusion and hard_labels are two different server methods; pick one")
        if self.verify_claims and "inversion" not in self.sources(True):
            raise ConfigError(
                "verify_claims checks label counts on the teachers' own inversions: add 'inversion' to "
                "synth, or set verify_claims=False"
            )
        if self.adversarial is not None and "generator" not in self.sources(True):
            raise ConfigError(
                "adversarial distillation keeps training the generator: add 'generator' to synth"
            )
        if self.adversarial is not None and (self.hard_labels or self.fusion is not None):
            raise ConfigError(
                "adversarial distillation refines a consensus-distilled student: drop "
                "hard_labels / fusion, or set adversarial=None"
            )
        clashes = self._mix_clashes()
        if self.distill.mix and clashes:
            raise ConfigError(
                "distill.mix labels mixtures of synthetic images by the unconditioned soft vote of "
                f"consensus distillation, which {', '.join(clashes)} replaces: set distill.mix=0 or drop them"
            )

    def _mix_clashes(self) -> list[str]:
        """What the mixtures (labelled by the soft, unconditioned vote of consensus distillation) cannot
        run with: hard labels, fusion, the adversarial rounds (whose passes do not mix), or a rule that
        needs the class a sample was made for."""
        return [
            name
            for name, on in (
                ("hard_labels", self.hard_labels),
                ("fusion", self.fusion is not None),
                ("adversarial", self.adversarial is not None),
                ("labels.rule=conditioned", self.labels.rule == "conditioned"),
            )
            if on
        ]

    @property
    def decoder(self) -> DecoderConfig:
        """The decoder source's config, from the flat ``decoder_*`` fields (the names users write)."""
        return DecoderConfig(
            samples=self.decoder_samples,
            keep=self.decoder_keep,
            temperature=self.decoder_temperature,
            weighting=self.decoder_weighting,
        )

    def synthesis_config(self, has_decoders: bool) -> SynthesisConfig:
        """The synthesis phase's settings for uploads with or without decoders (the claim checks of the
        labelling phase run when the claims are checked)."""
        sources = self.sources(has_decoders)
        if self.fusion is not None and "decoder" not in sources:
            raise ConfigError("FedMHO fusion trains on decoder samples: pass cvae_decoder bundles")
        return SynthesisConfig(
            sources=sources,
            inversion=self.inversion,
            generator=self.generator,
            decoder=self.decoder,
            seed=self.seed,
            precision=self.precision,
            checks=CLAIM_CHECKS if self.checks_claims else None,
            # the sources left to the server; the adversarial rounds keep training the generator
            generator_fills_gaps=self.synth is None and self.adversarial is None,
        )

    def budget_phases(self, has_decoders: bool) -> tuple[Phase, ...]:
        """The phases whose batch each teacher's cost is measured at (:mod:`server_kit.teachers.budget`):
        the vote, and those of inversion, the generator and the adversarial rounds when this run has them."""
        sources = self.sources(has_decoders)
        return server_phases(
            inversion=self.inversion.batch_size if "inversion" in sources else None,
            generator=self.generator.batch_size if "generator" in sources else None,
            distillation=self.distill.batch_size if self.adversarial is not None else None,
        )

    def labelling_config(self) -> LabellingConfig:
        """The labelling phase's settings (no top-up under FedMHO fusion: its own recipe)."""
        return LabellingConfig(
            labels=self.labels,
            tau=self.distill.tau,
            hard_labels=self.hard_labels,
            construction_labels=self.construction_labels,
            construction_weight=self.construction_weight,
            top_up=self.top_up and self.fusion is None,
            decoder=self.decoder,
            seed=self.seed,
            precision=self.precision,
        )

    def training_config(self) -> TrainingConfig:
        """The training phase's settings."""
        return TrainingConfig(
            student=self.student,
            distill=self.distill,
            adversarial=self.adversarial,
            generator=self.generator,
            labels=self.labels,
            fusion=self.fusion,
            fedavg_init=self.fedavg_init,
            hard_labels=self.hard_labels,
            seed=self.seed,
            precision=self.precision,
        )

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
        """The synthesis sources this run may use, in ``SOURCES`` order: ``synth`` as given, or by default
        inversion and generator plus the decoders when there are any. Decoder samples are labelled by
        construction (``construction_labels``): under strong label skew they lift the global model well
        above inversion and generator alone (benchmarks/RESULTS.md, "Label skew"). By default the
        generator then only fills gaps: where the decoders hold every class, its samples are drawn from
        them instead (:attr:`~server_kit.synthesis.SynthesisConfig.generator_fills_gaps`)."""
        if self.synth is not None:
            return tuple(name for name in SOURCES if name in self.synth)
        wanted = ("inversion", "generator", "decoder") if has_decoders else ("inversion", "generator")
        return tuple(name for name in SOURCES if name in wanted)

    def for_task(self, input_shape: tuple[int, int, int]) -> AggregateConfig:
        """This config with its ``auto`` settings decided by the teachers' input shape, never by a dataset
        name (:func:`edge_sdk.augment.is_color`): color images get the residual student, the inversion's
        jitter and flip priors, the mirror of every synthetic image as a view of its own, 30 distillation
        epochs, the student's last weights, and no decoder samples unless ``synth`` or FedMHO's fusion
        asks for them (the small MLP decoders draw color blobs the teachers mostly reject); the rest (a
        mirrored digit is no digit) keep the small CNN, no priors, no views, 10 epochs and the decoders,
        and the moving average of the student's weights. What runs and what the report records is the
        resolved config."""
        color = is_color(input_shape)
        student = self.student
        if student == "auto":
            student = COLOR_STUDENT if color else DEFAULT_STUDENT
        synth = self.synth
        if synth is None and color and self.fusion is None:  # FedMHO's fusion trains on decoder samples
            synth = ("inversion", "generator")
        views = self.views
        if views == "auto":
            views = "flip" if color else "none"
        return replace(
            self,
            student=student,
            synth=synth,
            views=views,
            inversion=self.inversion.for_images(input_shape),
            distill=self.distill.for_images(input_shape),
        )

    def to_dict(self, device: torch.device | None = None) -> dict[str, Any]:
        """The config as JSON, with the precision that runs on ``device`` (the run's resolved device;
        None: this config's device, resolved for the record)."""
        out = asdict(self)
        out["inversion"] = self.inversion.to_dict()
        out["distill"] = self.distill.to_dict()
        out["generator"] = self.generator.to_dict()
        out["synth"] = None if self.synth is None else list(self.synth)
        out["construction_labels"] = list(self.construction_labels)
        out["fusion"] = None if self.fusion is None else self.fusion.to_dict()
        out["labels"] = self.labels.to_dict()
        out["adversarial"] = None if self.adversarial is None else self.adversarial.to_dict()
        device = resolve_device(self.device) if device is None else device
        out["precision"] = resolve_precision(self.precision, device)  # what ran
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> AggregateConfig:
        """The inverse of :meth:`to_dict` (a server report's ``config``), and the table of a TOML file a
        person wrote: keys are the fields, nested tables the nested configs (``[distill]``,
        ``[inversion]``, ...) over their defaults; an unknown key is refused with the valid ones. A
        report records the precision that ran (``auto`` resolved), so a replay runs that one."""
        return config_from_dict(cls, data, what="config")
