"""Checking what each upload claims against how it behaves, before its claims weigh anything.

Every label rule that uses the bundles' label counts (the generator's loss, the conditioned and label-weighted
labels) trusts them: a device that claims 5,000 examples of every class would own every label. The counts
cannot be checked against data the server never sees, but they can be checked against the other teachers:
a teacher that really learned class c makes images of c (its inversions for c) that the other holders of c
recognise as c, and it recognises theirs.

For every class c and every pair of teachers k, j that both claim c, A_c[k, j] is the fraction of j's
inversions for c that k labels c (over all of k's outputs). A claim (k, c) is
scored by the median over the other claimants j of (A_c[k, j] + A_c[j, k]) / 2, so one liar cannot move an
honest teacher's score, and it is kept when that score is at least ``keep_ratio`` times the median score
of all claimants of c (relative, so a harder task, where every teacher recognises less, is judged on its
own scale). This is the coordinate-wise-median idea of Byzantine-robust aggregation (Yin et al., ICML 2018)
applied to pairwise agreement; it assumes an honest majority among the claimants of each class. A class
with one claimant cannot be checked and is kept as claimed; a rejected claim's count becomes 0, and a
teacher whose rejected claims hold more than half of the examples it claims loses all its claims (a
liar that passes on a class where the honest holders agree little with each other is still caught).

Decoders are checked against the teachers instead of each other
(:mod:`server_kit.labelling.decoder_trust`), with the same decision rule (:func:`decide_claims`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from common.errors import ConfigError
from common.torch_utils import INFER_BATCH
from server_kit.labelling.labels import teacher_probs
from server_kit.synthesis import SyntheticSet
from server_kit.teachers import map_teachers

__all__ = ["ClaimCheck", "decide_claims", "median", "verify_claims"]


@dataclass(frozen=True)
class ClaimCheck:
    """The verified label counts (rejected claims set to 0) and the evidence for each decision."""

    label_counts: list[list[int]]
    scores: list[list[float | None]]  # K x L, None where the claim could not be scored
    rejected: list[tuple[int, int]]  # (teacher, class) pairs

    def report(self) -> dict[str, object]:
        return {"rejected": [list(p) for p in self.rejected], "scores": self.scores}


@torch.no_grad()
def verify_claims(
    modules: Sequence[nn.Module],
    label_counts: Sequence[Sequence[int]],
    synthetic: SyntheticSet,
    *,
    keep_ratio: float = 0.5,
    batch_size: int = INFER_BATCH,
    device: str | torch.device = "cpu",
    precision: str = "auto",
) -> ClaimCheck:
    """Score every claim (teacher k has examples of class c) on the teachers' own inversions; see above.

    ``synthetic.teacher`` names the teacher that made each sample (samples with teacher < 0, made by the
    whole ensemble, are not used). The teachers run side by side at ``precision``.
    """
    if not 0 < keep_ratio <= 1 or not math.isfinite(keep_ratio):
        raise ConfigError(f"keep_ratio must be in (0, 1], got {keep_ratio!r}")
    counts = [list(map(int, row)) for row in label_counts]
    k = len(modules)
    if len(counts) != k:
        raise ConfigError(f"label_counts has {len(counts)} rows for {k} teachers")
    num_classes = len(counts[0])
    made_by = synthetic.teacher
    own = made_by >= 0
    x, y, maker = synthetic.x[own], synthetic.target_class[own], made_by[own]
    # says_target[i][n]: does teacher i, over all its outputs, label sample n as the class it was made for.
    # Not masked to i's classes: a teacher holding c and one other class would "agree" on any image
    # that is not the other class, which would make a liar's images pass.
    says_target = torch.stack(
        map_teachers(
            lambda i: teacher_probs(
                modules[i], x, tau=1.0, batch_size=batch_size, device=device, precision=precision
            ).argmax(1) == y,
            modules,
            device=device,
        )
    ) if len(x) else torch.zeros(k, 0, dtype=torch.bool)  # fmt: skip
    scores: list[list[float | None]] = [[None] * num_classes for _ in range(k)]
    rejected: list[tuple[int, int]] = []
    for c in range(num_classes):
        claimants = [i for i in range(k) if counts[i][c] > 0]
        if len(claimants) < 2:
            continue
        # agree[i][j]: fraction of j's samples for c that i labels c (None when j made none)
        agree: dict[tuple[int, int], float] = {}
        for j in claimants:
            mine = (maker == j) & (y == c)
            if not mine.any():
                continue
            for i in claimants:
                if i != j:
                    agree[i, j] = float(says_target[i, mine].float().mean())
        for i in claimants:
            pairs = [
                (agree[i, j] + agree[j, i]) / 2
                for j in claimants
                if j != i and (i, j) in agree and (j, i) in agree
            ]
            scores[i][c] = median(pairs) if pairs else None
        scored = [scores[i][c] for i in claimants if scores[i][c] is not None]
        if len(scored) < 2:
            continue
        bar = keep_ratio * median(scored)
        for i in claimants:
            score = scores[i][c]
            if score is not None and score < bar:
                rejected.append((i, c))
    return decide_claims(counts, scores, rejected)


def decide_claims(
    counts: list[list[int]], scores: list[list[float | None]], rejected: list[tuple[int, int]]
) -> ClaimCheck:
    """Apply the rejections; an upload whose rejected claims hold most of the examples it claims is not
    trusted on the rest."""
    for i, row in enumerate(counts):
        failed = sum(row[c] for j, c in rejected if j == i)
        if 2 * failed > sum(row):
            rejected += [(i, c) for c in range(len(row)) if row[c] > 0 and (i, c) not in rejected]
    verified = [row[:] for row in counts]
    for i, c in rejected:
        verified[i][c] = 0
    return ClaimCheck(label_counts=verified, scores=scores, rejected=sorted(rejected))


def median(values: Sequence[float]) -> float:
    """The median, the mean of the two middle values for an even count (torch.median takes the lower)."""
    return float(torch.tensor(values, dtype=torch.float64).quantile(0.5))
