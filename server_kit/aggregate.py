"""The server pipeline: bundles -> teachers -> pseudo-images -> labels -> student -> global.onnx.

A short driver over the phases, each a package taking only its own settings: ``teachers`` (the uploads
read and probed), ``synthesis`` (its sources, ``SOURCES``), ``labelling`` (the vote, the top-up),
``training`` (distillation, or FedMHO's fusion); then the export and the report.

One call runs pFedZKD's server side (Algorithms 3 and 4) and leaves everything needed to audit it in
``out_dir``: ``global.onnx`` (validated, parity-checked), ``report.json`` (config, per-phase seconds,
teachers, skipped bundles, loss curve, accuracy), ``pseudo_images.png``, ``synthetic.npz`` (the
distillation set, reused by ``server-kit personalize``), ``synthetic/`` (the inversion chunks, so a killed
run resumes where it stopped) and ``generator/`` (the trained generator as ONNX). ``server-kit aggregate``
is a thin CLI over it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from common.checks import check_real_dir
from common.device import resolve_device
from common.errors import DataError
from common.timing import timed
from edge_sdk.data import ArrayDataset
from edge_sdk.profiling import allowed_cores, usable_threads
from export.atomic import atomic_write_bytes, atomic_write_json
from server_kit.aggregate_config import AggregateConfig
from server_kit.aggregate_report import run_report
from server_kit.evaluate import evaluate_onnx
from server_kit.labelling import Labels, agreement, label, top_up
from server_kit.report import write_grid
from server_kit.synthesis import (
    SYNTHETIC_FILE,
    WORK_DIRS,
    Synthesis,
    clear_work_dirs,
    save_synthetic,
    synthesize,
    usable_decoders,
    with_views,
)
from server_kit.teachers import (
    Federation,
    Teacher,
    Uploads,
    read_uploads,
    run_within_budget,
    split_kinds,
    teacher_workers,
    teachers_from_bundles,
    usable_teachers,
    without_clones,
)
from server_kit.training import Training, export_global, train_global

__all__ = ["AggregateResult", "aggregate"]


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


def aggregate(
    bundle_paths: Uploads,
    out_dir: str | Path,
    *,
    config: AggregateConfig,
    eval_data: ArrayDataset | None = None,
    progress: bool = False,
    device: torch.device | None = None,
) -> AggregateResult:
    """Run the server side end to end and write its outputs into ``out_dir`` (see the module docstring).

    ``bundle_paths``: bundle files, or name -> bytes (bundles that arrived over a network, a Flower reply),
    each held to the checks of a bundle file (:func:`server_kit.teachers.read_uploads`) and named in the
    report by its name. Bad bundles stop the run or are skipped with their reason (``config.on_error``);
    bundles that disagree on num_classes / input_shape with the majority are refused. ``eval_data`` (uint8
    images, the global test set) is used only to report the accuracy of the written ``global.onnx``.
    ``device``: ``config.device`` as the caller already resolved it (once per run; None: resolved here).
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
            resolved = resolve_device(config.device) if device is None else device
            return _run(bundle_paths, out, config, eval_data, progress, resolved)
    finally:
        torch.set_num_threads(previous_threads)


def _load(
    bundle_paths: Uploads, config: AggregateConfig, device: torch.device, skipped: list[tuple[str, str]]
) -> tuple[Federation, list[Teacher], AggregateConfig]:
    """The federation of the usable uploads: teachers (and decoders when this run samples them) each
    read, rebuilt and probed once, failures charged to their bundle; and ``config`` with its ``auto``
    settings decided by the teachers' input shape (:meth:`AggregateConfig.for_task`)."""
    uploads = read_uploads(bundle_paths, on_error=config.on_error, skipped=skipped)
    uploads = without_clones(uploads, on_error=config.on_error, skipped=skipped)  # copies count once
    classifiers, decoders = split_kinds(uploads)
    teachers = teachers_from_bundles(
        classifiers, on_error=config.on_error, device=device, skipped=skipped, count=len(bundle_paths)
    )
    teachers = usable_teachers(
        teachers, on_error=config.on_error, seed=config.seed, device=device, skipped=skipped
    )
    config = config.for_task(tuple(teachers[0].bundle.input_shape))
    if "decoder" in config.sources(bool(decoders)):  # else not read by this run
        first = teachers[0].bundle
        decoders = usable_decoders(
            decoders,
            num_classes=first.num_classes,
            input_shape=tuple(first.input_shape),
            on_error=config.on_error,
            device=device,
            skipped=skipped,
        )
    return Federation.from_teachers(teachers, device, decoders), teachers, config


def _check_eval(eval_data: ArrayDataset | None, fed: Federation) -> None:
    if eval_data is not None and (
        eval_data.num_classes != fed.num_classes or eval_data.input_shape != fed.input_shape
    ):
        raise DataError(
            f"eval data is {eval_data.num_classes} classes of {eval_data.input_shape} but the teachers "
            f"are {fed.num_classes} classes of {fed.input_shape}; pass the test set of the federation's task"
        )


def _run(
    bundle_paths: Uploads,
    out: Path,
    config: AggregateConfig,
    eval_data: ArrayDataset | None,
    progress: bool,
    device: torch.device,  # the run's one device: every phase computes on fed.device
) -> AggregateResult:
    seconds: dict[str, float] = {}
    started_at = time.time()  # phases follow in the order of ``seconds`` (benchmarks/speed.py)
    wall = time.perf_counter()
    with timed(seconds, "load"):
        skipped: list[tuple[str, str]] = []
        fed, teachers, config = _load(bundle_paths, config, device, skipped)
        _check_eval(eval_data, fed)
    out.mkdir(parents=True, exist_ok=True)  # once the uploads are read: a bad one leaves no directory
    # every teacher's cost at the batch of each phase this run uses; one over it, or too slow or non-finite
    # while the phases run, stops the run or is dropped (and the phases rerun without it)
    (teachers, fed, synthesis, labels, agreed, training), budget = run_within_budget(
        teachers,
        lambda team: (team, *_phases(team, fed.decoders, config, out, seconds, progress, device)),
        phases=config.budget_phases(bool(fed.decoders)),
        config=config.budget,
        on_error=config.on_error,
        skipped=skipped,
        seed=config.seed,
        device=device,
        precision=config.precision,
        seconds=seconds,
        restart=lambda: clear_work_dirs(out),
    )
    synthetic = synthesis.synthetic
    seconds.update(training.seconds)
    with timed(seconds, "export"):
        model_bytes = export_global(training, fed, num_teachers=len(teachers), seed=config.seed)
        global_onnx = atomic_write_bytes(out / "global.onnx", model_bytes)
        keep = labels.keep
        grid_path = write_grid(out / "pseudo_images.png", synthetic.x[keep], labels.targets[keep])
    with timed(seconds, "evaluate"):
        evaluation = None
        if eval_data is not None:
            evaluation = evaluate_onnx(model_bytes, eval_data, threads=torch.get_num_threads())
    seconds["total"] = time.perf_counter() - wall
    outputs = {"global_onnx": global_onnx.name, "pseudo_images": grid_path.name, "synthetic": SYNTHETIC_FILE}
    report = run_report(
        config, device, fed, teachers, skipped, synthesis, labels, agreed, training, evaluation
    )
    report |= {"seconds": seconds, "started_at": started_at, "phase_order": list(seconds), "outputs": outputs}
    report["budget"] = budget
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


def _phases(
    team: list[Teacher],
    decoders: list[tuple[Path, Any]],
    config: AggregateConfig,
    out: Path,
    seconds: dict[str, float],
    progress: bool,
    device: torch.device,
) -> tuple[Federation, Synthesis, Labels, dict[str, float], Training]:
    """Synthesis, labelling and training on the teachers ``team`` (one attempt of the guarded phases)."""
    fed = Federation.from_teachers(team, device, decoders)
    synthesis = synthesize(fed, config.synthesis_config(bool(fed.decoders)), out, progress=progress)
    seconds.update(synthesis.seconds)
    synthesis = with_views(synthesis, config.views)  # mirrors are new samples: labelled by the vote below
    with timed(seconds, "labels"):
        labelling = config.labelling_config()
        labels = label(fed, synthesis, labelling)
        synthesis, labels = top_up(fed, synthesis, labels, labelling)
        save_synthetic(out / SYNTHETIC_FILE, synthesis.synthetic)
        agreed = agreement(fed, synthesis.synthetic, labels, config.precision)
    training = train_global(
        fed, synthesis, labels, config.training_config(), teachers=team, progress=progress
    )
    return fed, synthesis, labels, agreed, training
