"""Checking each CVAE decoder's claimed classes against what it draws, before its counts buy it any of the
sampling budget.

A decoder trained on shifted labels draws class y - 1 when asked for y, and claims honest-looking counts
(or all of them). Its samples cannot be checked against real data, but they can be checked against the
teachers that hold the class: decoder d's claim on class c is scored by a probe of its samples for c,
labelled by every teacher whose (verified) counts claim c, each over all its outputs; the score is the
median over those teachers of the fraction they label c. A median over the holders, not a vote weighted by
the claimed counts: the shifted decoder's own device uploads a classifier trained on the same labels,
whose claimed counts would own the weighted vote, and colluding devices upload several; the median holds
while they are a minority among the holders of c (the assumption :mod:`server_kit.labelling.trust` makes).

Two relative rules then refuse what honest decoders do not do (relative, so a task where every decoder is
blurrier is judged on its own scale):

* a claim (d, c) scoring under ``keep_ratio`` times the median score of the decoders claiming c, when at
  least three decoders claim c (of two, the median is the mean, which a liar moves: the second rule
  judges those) and the claim weighs at least as much as the median claim of c: the budget is split by
  the counts, so a smaller claim buys less than a typical holder's share, and a decoder that saw a
  handful of examples of c draws them badly without lying (on small clients, most of the honest claims
  under the bar are such);
* every claim of decoder d when its score over all its claims (weighted by its claimed counts) is under
  ``keep_ratio`` times the median decoder's, when there are at least three decoders: a shifted decoder
  fails on every class it draws, an honest one with a blurry class or two does not.

A decoder whose refused claims hold most of the examples it claims loses the rest (as in
:func:`server_kit.labelling.trust.verify_claims`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn

from common.checks import check_int
from common.errors import ConfigError
from server_kit.labelling.labels import teacher_probs
from server_kit.labelling.trust import ClaimCheck, decide_claims, median
from server_kit.teachers import map_teachers

__all__ = ["MIN_JUDGED", "verify_decoders"]

MIN_JUDGED = 3  # decoders needed before a median can tell a liar from an honest one


@torch.no_grad()
def verify_decoders(
    modules: Sequence[nn.Module],
    label_counts: Sequence[Sequence[int]],
    decoders: Sequence[nn.Module],
    decoder_counts: Sequence[Sequence[int]],
    *,
    probe: int = 32,
    keep_ratio: float = 0.5,
    seed: int = 0,
    device: str | torch.device = "cpu",
    precision: str = "auto",
) -> ClaimCheck:
    """Score every decoder claim (decoder d has examples of class c) on ``probe`` of its samples for c by
    the teachers that claim c in ``label_counts`` (the verified classifier counts); see above.

    ``decoders`` map (z, one-hot y) to images and have a ``latent_dim``; z is drawn from ``seed``.
    """
    if not 0 < keep_ratio <= 1 or not math.isfinite(keep_ratio):
        raise ConfigError(f"keep_ratio must be in (0, 1], got {keep_ratio!r}")
    check_int("probe", probe, 1)
    counts = [list(map(int, row)) for row in decoder_counts]
    if len(counts) != len(decoders):
        raise ConfigError(f"decoder_counts has {len(counts)} rows for {len(decoders)} decoders")
    holders = torch.tensor([[int(v) > 0 for v in row] for row in label_counts], dtype=torch.bool)  # K x L
    num_classes = holders.shape[1]
    x, y, owner = _probe_samples(decoders, counts, num_classes, probe, seed)

    # says[k, n]: teacher k labels probe sample n as the class it was drawn for
    def labels_of(k: int) -> torch.Tensor:
        return teacher_probs(modules[k], x, tau=1.0, device=device, precision=precision).argmax(1) == y

    says = (
        torch.stack(map_teachers(labels_of, modules, device=device))
        if len(x)
        else torch.zeros(len(modules), 0, dtype=torch.bool)
    )
    scores: list[list[float | None]] = [[None] * num_classes for _ in counts]
    for d, row in enumerate(counts):
        for c in range(num_classes):
            judges = holders[:, c].nonzero().flatten().tolist()
            mine = (owner == d) & (y == c)
            if row[c] > 0 and judges and bool(mine.any()):
                scores[d][c] = median([float(says[k, mine].double().mean()) for k in judges])
    return decide_claims(counts, scores, _refused(counts, scores, keep_ratio))


def _probe_samples(
    decoders: Sequence[nn.Module], counts: list[list[int]], num_classes: int, probe: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``probe`` samples of every class each decoder claims: images, their classes, their decoder."""
    generator = torch.Generator().manual_seed(seed)
    xs, ys, owners = [], [], []
    for d, decoder in enumerate(decoders):
        claimed = [c for c in range(num_classes) if counts[d][c] > 0]
        if not claimed:
            continue
        y = torch.tensor(claimed).repeat_interleave(probe)
        z = torch.randn((len(y), int(decoder.latent_dim)), generator=generator)
        onehot = torch.nn.functional.one_hot(y, num_classes).float()
        param = next(iter(decoder.parameters()), None)
        dev = param.device if param is not None else torch.device("cpu")
        was_training = decoder.training
        decoder.eval()
        xs.append(decoder(z.to(dev), onehot.to(dev)).float().clamp(0, 1).cpu())
        decoder.train(was_training)
        ys.append(y)
        owners.append(torch.full((len(y),), d))
    if not xs:
        empty = torch.zeros(0, dtype=torch.long)
        return torch.zeros(0), empty, empty
    return torch.cat(xs), torch.cat(ys), torch.cat(owners)


def _refused(
    counts: list[list[int]], scores: list[list[float | None]], keep_ratio: float
) -> list[tuple[int, int]]:
    """The claims the two rules of the module docstring refuse."""
    refused: set[tuple[int, int]] = set()
    for c in range(len(scores[0]) if scores else 0):
        scored = [(d, row[c]) for d, row in enumerate(scores) if row[c] is not None]
        if len(scored) >= MIN_JUDGED:
            bar = keep_ratio * median([s for _, s in scored])  # type: ignore[misc]
            weighs = median([counts[d][c] for d, _ in scored])
            refused |= {(d, c) for d, s in scored if s < bar and counts[d][c] >= weighs}  # type: ignore[operator]
    overall: dict[int, float] = {}
    for d, row in enumerate(scores):
        weights = [(counts[d][c], s) for c, s in enumerate(row) if s is not None]
        if weights and sum(w for w, _ in weights) > 0:
            overall[d] = sum(w * s for w, s in weights) / sum(w for w, _ in weights)
    if len(overall) >= MIN_JUDGED:
        bar = keep_ratio * median(list(overall.values()))
        for d, score in overall.items():
            if score < bar:
                refused |= {(d, c) for c, s in enumerate(scores[d]) if s is not None}
    return sorted(refused)
