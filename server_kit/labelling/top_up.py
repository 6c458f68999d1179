"""Top-up: every class the vote left below the median class gets more decoder samples, up to the median.

Why: the vote drops the inversion and generator samples of a class one client alone holds (every other
teacher calls them one of its own classes), so that class would reach the student with half the samples
of the rest.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch
from torch import Tensor

from common.seeding import derive_seed
from server_kit.labelling.labels import Labels
from server_kit.labelling.targets import LabellingConfig, vote_labels
from server_kit.synthesis import DecoderPool, Synthesis, SyntheticSet, filter_by_centroid, sample_decoders
from server_kit.teachers import Federation

__all__ = ["TOP_UP_STREAM", "top_up"]

TOP_UP_STREAM = 1  # derive_seed stream of top_up's decoder draws (the first draw uses the seed itself)


def top_up(
    fed: Federation, synthesis: Synthesis, labels: Labels, config: LabellingConfig
) -> tuple[Synthesis, Labels]:
    """Bring every class the vote left below the median class up to it with more decoder samples.

    The new samples come from the decoders that hold the class (by the trusted counts), pass the same
    centroid filter and vote as the first ones, and are inserted at the end of the decoder part, so the
    pooled set stays the parts in order. A class whose decoder samples the vote mostly rejected gets at
    most 4 draws per missing sample. Off (returns its inputs) with ``top_up`` False, without decoders or
    with hard labels.
    """
    pool = synthesis.decoders
    if not config.top_up or pool is None or config.hard_labels:
        return synthesis, labels
    num_classes = fed.num_classes
    kept = torch.bincount(labels.targets.argmax(1)[labels.keep], minlength=num_classes)
    present = torch.tensor(synthesis.label_counts).sum(0) > 0
    if not bool(present.any()):
        return synthesis, labels
    goal = int(kept[present].median())
    holds = torch.tensor(pool.label_counts).sum(0) > 0
    deficit = ((goal - kept).clamp(min=0) * (present & holds)).tolist()
    start, end = _decoder_span(synthesis)
    drawn, xs, ys = _draw(fed, pool, synthesis, labels, config, deficit, (start, end))
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
    new = vote_labels(fed, x, y, constructed, synthesis, config)
    report["added"] = torch.bincount(y[new.keep], minlength=num_classes).tolist()
    return _insert(synthesis, labels, new, x, y, end, report)


def _decoder_span(synthesis: Synthesis) -> tuple[int, int]:
    """Where the decoder part sits in the pooled set (the parts in ``SOURCES`` order)."""
    names = list(synthesis.parts)
    start = sum(len(synthesis.parts[name]) for name in names[: names.index("decoder")])
    return start, start + len(synthesis.parts["decoder"])


def _draw(
    fed: Federation,
    pool: DecoderPool,
    synthesis: Synthesis,
    labels: Labels,
    config: LabellingConfig,
    deficit: list[int],
    span: tuple[int, int],
) -> tuple[list[int], list[Tensor], list[Tensor]]:
    """Per class short of the goal: decoded draws (more where the vote kept few of the first ones) and the
    images and classes the centroid filter kept."""
    start, end = span
    first_y = synthesis.synthetic.target_class[start:end]
    first_keep = labels.keep[start:end]
    drawn = [0] * fed.num_classes
    xs, ys = [], []
    for c in range(fed.num_classes):
        if deficit[c] == 0:
            continue
        made = int((first_y == c).sum())
        rate = int((first_keep & (first_y == c)).sum()) / made * config.decoder.keep if made else 0.0
        drawn[c] = min(4 * deficit[c], math.ceil(deficit[c] / max(rate, 1e-9)))
        rows = [[n if j == c else 0 for j, n in enumerate(row)] for row in pool.label_counts]
        x, y = sample_decoders(
            pool.modules,
            rows,
            total=drawn[c],
            num_classes=fed.num_classes,
            seed=derive_seed(config.seed, TOP_UP_STREAM, c),
            device=fed.device,
            temperature=config.decoder.temperature,
        )
        mask = filter_by_centroid(x, y, keep=config.decoder.keep)
        xs.append(x[mask])
        ys.append(y[mask])
    return drawn, xs, ys


def _insert(
    synthesis: Synthesis, labels: Labels, new: Labels, x: Tensor, y: Tensor, end: int, report: dict
) -> tuple[Synthesis, Labels]:
    """The new samples at the end of the decoder part of the pooled set, their labels beside them."""

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
