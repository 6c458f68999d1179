"""The teachers' ceilings on real labelled images: how well the uploads' own vote classifies them, the bound
a global model distilled from them is measured against (evaluation only: nothing here reaches training).

Each teacher runs once over the images; the rules are combinations of the same softmax (temperature 1):

* ``mean``: the mean of the teachers' softmax (pFedZKD's consensus);
* ``label_weighted``: each teacher's vote for class c scaled by its share of the classifiers' examples of
  c (the vote the server's labels use, :func:`~server_kit.labelling.labels.consensus`);
* ``label_weighted_masked``: the same with each teacher's softmax over the classes it holds;
* ``label_weighted_abstain`` (teachers with an "unknown" output only): each vote also weighed by the
  teacher's probability that the image is one of its classes;
* ``oracle``: some teacher's own class is right.

The retention of a global model is its accuracy over the label-weighted ceiling: the share of what the
teachers know together that the server kept.
"""

from __future__ import annotations

import torch
from torch import Tensor

from server_kit.teachers import Federation, class_shares, held_classes
from server_kit.teachers.abstain import own_probability

__all__ = ["CEILING_BATCH", "teacher_ceilings"]

CEILING_BATCH = 1024  # images per teacher forward pass


@torch.no_grad()
def teacher_ceilings(fed: Federation, x: Tensor, y: Tensor) -> dict[str, object]:
    """Accuracy of each rule (module docstring) on images ``x`` (float [0, 1]) of classes ``y``, and the
    per-class accuracy of the label-weighted rule and the oracle (``per_class``: rule -> one number per
    class, None for a class with no image)."""
    shares = class_shares(fed.label_counts).double()  # K x L
    held = held_classes(fed.label_counts)  # K x L
    parts = [
        [own_probability(m, x[i : i + CEILING_BATCH]) for i in range(0, len(x), CEILING_BATCH)]
        for m in fed.modules
    ]
    logits = torch.stack([torch.cat([lg.double() for lg, _ in p]) for p in parts])  # K x N x L
    own = torch.stack(
        [torch.cat([torch.ones(len(lg)) if o is None else o for lg, o in p]).double() for p in parts]
    )  # K x N
    probs = logits.softmax(dim=2)
    masked = logits.masked_fill(~held.unsqueeze(1), -torch.inf).softmax(dim=2)
    rules = {
        "mean": probs.mean(0).argmax(1),
        "label_weighted": (probs * shares.unsqueeze(1)).sum(0).argmax(1),
        "label_weighted_masked": (masked * shares.unsqueeze(1)).sum(0).argmax(1),
    }
    if any(o is not None for p in parts for _, o in p):
        rules["label_weighted_abstain"] = (probs * shares.unsqueeze(1) * own.unsqueeze(2)).sum(0).argmax(1)
    right = {name: pred == y for name, pred in rules.items()}
    right["oracle"] = (logits.argmax(2) == y).any(0)
    out: dict[str, object] = {name: float(hit.float().mean()) for name, hit in right.items()}
    out["per_class"] = {
        name: _per_class(right[name], y, fed.num_classes) for name in ("label_weighted", "oracle")
    }
    return out


def _per_class(hit: Tensor, y: Tensor, num_classes: int) -> list[float | None]:
    return [float(hit[y == c].float().mean()) if bool((y == c).any()) else None for c in range(num_classes)]
