"""The synthesis phase: the registry of sources (``SOURCES``: inversion, decoder, generator), each made from
the federation and its own settings, pooled in registry order.

The claimed label counts are checked as soon as their evidence exists (after the inversion; a decoder's
before it is sampled). Those checks belong to the labelling phase, which comes after this one; the driver
hands them in as :class:`ClaimChecks`.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn.functional as F

from common.checks import check_real_dir, is_number
from common.errors import BundleError, ConfigError, DataError, TeacherError
from common.timing import timed
from edge_sdk.train import release_memory
from server_kit.report import write_grid
from server_kit.synthesis.decoders import check_temperature, filter_by_centroid, load_decoder, sample_decoders
from server_kit.synthesis.generator import ConditionalGenerator, GeneratorConfig, synthesize_generator
from server_kit.synthesis.inversion import InversionConfig, SyntheticSet, synthesize_inversion
from server_kit.teachers import Federation, charge

__all__ = [
    "SOURCES",
    "SYNTH_SOURCES",
    "WORK_DIRS",
    "ClaimChecks",
    "DecoderConfig",
    "DecoderPool",
    "SourceOutput",
    "Synthesis",
    "SynthesisConfig",
    "clear_work_dirs",
    "synthesize",
    "usable_decoders",
]

SYNTH_SOURCES = ("inversion", "generator", "decoder")
WORK_DIRS = ("synthetic", "generator")  # the folders the sources write into under the output folder


def clear_work_dirs(out: Path) -> None:
    """Remove the work folders an attempt wrote under ``out`` (a rerun without a dropped teacher must not
    resume chunks made with it); checked real folders, so no link is followed."""
    for name in WORK_DIRS:
        path = out / name
        check_real_dir(path)
        if path.is_dir():
            shutil.rmtree(path)


@dataclass(frozen=True, kw_only=True)
class DecoderConfig:
    """FedMHO's decoder source: ``samples`` images drawn from the CVAE decoders at ``temperature``, the
    budget split over classes by the decoders' label counts (``examples``) or every upload's
    (``federation``), the ``keep`` share of each class nearest its centroid kept. Errors name the
    aggregate config's fields (``decoder_samples``, ...), the words a user writes."""

    samples: int = 6000
    keep: float = 0.8
    temperature: float = 1.0
    weighting: Literal["examples", "federation"] = "examples"

    def __post_init__(self) -> None:
        if isinstance(self.samples, bool) or not isinstance(self.samples, int) or self.samples < 1:
            raise ConfigError(f"decoder_samples must be a positive integer, got {self.samples!r}")
        if not is_number(self.keep) or not 0 < self.keep <= 1:
            raise ConfigError(f"decoder_keep must be in (0, 1], got {self.keep!r}")
        check_temperature(self.temperature)
        if self.weighting not in ("examples", "federation"):
            raise ConfigError(f"decoder_weighting must be 'examples' or 'federation', got {self.weighting!r}")


@dataclass(frozen=True)
class ClaimChecks:
    """The label-count checks of the labelling phase (its ``verify_claims`` and ``verify_decoders``)."""

    classifiers: Callable[..., Any]
    decoders: Callable[..., Any]


@dataclass(frozen=True, kw_only=True)
class SynthesisConfig:
    """The synthesis phase's settings: the sources that run, each one's config, the seed and precision;
    ``checks`` None takes the label counts as claimed."""

    sources: tuple[str, ...]
    inversion: InversionConfig
    generator: GeneratorConfig
    decoder: DecoderConfig
    seed: int
    precision: str
    checks: ClaimChecks | None = None
    # the generator only fills gaps: where the decoders (their claims checked) hold every class a
    # classifier holds, it does not run and its samples are drawn from the decoders instead, which are
    # trained on the clients' images and labelled by construction (the sources a user leaves to the server)
    generator_fills_gaps: bool = False


def _decoders_cover(decoder_counts: list[list[int]], classifier_counts: list[list[int]]) -> bool:
    """Whether every class a classifier holds is held by a decoder too (label counts, a row an upload)."""
    held = {c for row in classifier_counts for c, n in enumerate(row) if n > 0}
    drawn = {c for row in decoder_counts for c, n in enumerate(row) if n > 0}
    return held <= drawn


def _generator_replaced(config: SynthesisConfig, decoder_counts: list[list[int]], fed: Federation) -> bool:
    """Whether the generator's samples come from the decoders (``generator_fills_gaps``)."""
    return (
        config.generator_fills_gaps
        and "generator" in config.sources
        and _decoders_cover(decoder_counts, fed.label_counts)
    )


@dataclass(frozen=True)
class DecoderPool:
    """The loaded decoders and the label counts they may be sampled by (verified when claims are)."""

    modules: list[torch.nn.Module]
    label_counts: list[list[int]]


@dataclass(frozen=True)
class Synthesis:
    """The pooled synthetic set, each source's part of it, the label counts the later phases may trust
    (the claimed ones, or those that passed the claim checks) and the report."""

    synthetic: SyntheticSet
    parts: dict[str, SyntheticSet]
    label_counts: list[list[int]]
    seconds: dict[str, float]
    report: dict[str, Any]
    generator: ConditionalGenerator | None = None
    decoders: DecoderPool | None = None


@dataclass(frozen=True)
class SourceOutput:
    """What one synthesis source gives: its samples, its report entries, and a generator that can draw
    more (the generator source only; adversarial distillation keeps training it)."""

    samples: SyntheticSet
    report: dict[str, Any] = field(default_factory=dict)
    generator: ConditionalGenerator | None = None
    decoders: DecoderPool | None = None


# A synthesis source: (federation, config, out_dir, progress) -> its output.
SynthesisSource = Callable[[Federation, SynthesisConfig, Path, bool], SourceOutput]


def _inversion_source(fed: Federation, config: SynthesisConfig, out: Path, progress: bool) -> SourceOutput:
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


def _generator_source(fed: Federation, config: SynthesisConfig, out: Path, progress: bool) -> SourceOutput:
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


def _decoder_source(fed: Federation, config: SynthesisConfig, out: Path, progress: bool) -> SourceOutput:
    """FedMHO: samples of the uploaded CVAE decoders, labelled by construction, centroid-filtered; with
    claim checks each decoder's claimed classes are first checked against the teachers."""
    part, report, pool = _decoder_samples(fed, config, out)
    return SourceOutput(part, {"decoders": report}, decoders=pool)


SOURCES: dict[str, SynthesisSource] = {
    "inversion": _inversion_source,
    "decoder": _decoder_source,
    "generator": _generator_source,
}


def synthesize(fed: Federation, config: SynthesisConfig, out: Path, *, progress: bool = False) -> Synthesis:
    """Run every source of ``config.sources`` (in ``SOURCES`` order, so the pooled set does not depend on
    the order the user listed them in) and pool their samples.

    With claim checks the label counts are verified on the inversions as soon as they exist, so the
    generator (and every later phase) weighs the teachers by the verified counts.
    """
    parts: dict[str, SyntheticSet] = {}
    seconds: dict[str, float] = {}
    report: dict[str, Any] = {"claims": None}
    generator = None
    pool = None
    for name, source in SOURCES.items():
        if name not in config.sources:
            continue
        if name == "generator" and pool is not None and _generator_replaced(config, pool.label_counts, fed):
            report["generator_skipped"] = "the decoders hold every class: its samples were drawn from them"
            continue
        with timed(seconds, name):
            output = source(fed, config, out, progress)
            parts[name] = output.samples
            report.update(output.report)
            generator = output.generator or generator
            pool = output.decoders or pool
        release_memory()  # each source's activations are garbage now; keep the process small
        if name == "inversion" and config.checks is not None:
            with timed(seconds, "claims"):
                check = config.checks.classifiers(
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


def usable_decoders(
    decoders: list[tuple[Path, Any]],
    *,
    num_classes: int,
    input_shape: tuple[int, int, int],
    on_error: str,
    device: torch.device,
    skipped: list[tuple[str, str]],
) -> list[tuple[Path, Any]]:
    """The decoder bundles of the teachers' task that rebuild and pass their parity check, each tried once
    before any phase runs (a failure charged to its bundle, as a teacher's is)."""
    kept = []
    for path, bundle in decoders:
        try:
            if (bundle.num_classes, tuple(bundle.input_shape)) != (num_classes, input_shape):
                raise DataError(
                    f"{path}: decoder of {bundle.num_classes} classes of {tuple(bundle.input_shape)}, the "
                    f"teachers are {num_classes} classes of {input_shape}; fix: pass only bundles of the "
                    "same task"
                )
            load_decoder(bundle, device=device)  # the rebuild and parity check _decoder_samples repeats
        except (BundleError, DataError, TeacherError) as err:
            charge(
                on_error,
                skipped,
                path,
                err if str(err).startswith(str(path)) else type(err)(f"{path}: {err}"),
            )
            continue
        kept.append((path, bundle))
    return kept


def _decoder_samples(
    fed: Federation, config: SynthesisConfig, out: Path
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
    settings = config.decoder
    decoders = [load_decoder(b, device=fed.device) for _, b in decoder_bundles]
    counts = [list(b.label_counts) for _, b in decoder_bundles]
    check = None
    if config.checks is not None:  # before the counts decide any decoder's share of the budget
        check = config.checks.decoders(
            fed.modules, fed.label_counts, decoders, counts, seed=config.seed, device=fed.device,
            precision=config.precision,
        )  # fmt: skip
        counts = check.label_counts
    federation = None
    if settings.weighting == "federation":  # every upload's counts: the classifiers' and the decoders'
        federation = [sum(col) for col in zip(*fed.label_counts, *counts, strict=True)]
    total = settings.samples + (config.generator.samples if _generator_replaced(config, counts, fed) else 0)
    x, y = sample_decoders(
        decoders,
        counts,
        total=total,
        num_classes=num_classes,
        seed=config.seed,
        device=fed.device,
        temperature=settings.temperature,
        weighting=settings.weighting,
        class_counts=federation,
    )
    mask = filter_by_centroid(x, y, keep=settings.keep)
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
