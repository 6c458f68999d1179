"""How a device spends its final-training epochs: successive halving over the search's finalists, and a
plateau rule that ends a training once its validation curve has flattened.

Pure functions of counts and curves (no torch), so the rules are tested on made-up curves and the client
(:func:`edge_sdk.client.run_client`) and the device plan (:mod:`edge_sdk.plan`) count the same epochs.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["COSTS", "halving_rungs", "plateaued", "rank_finalists", "schedule_epochs"]


def halving_rungs(finalists: int, shared_epochs: int, keep: float) -> list[tuple[int, int]]:
    """The rungs of successive halving: (finalists training, epochs each) per rung, until one is left.

    After each rung the best ``ceil(keep x n)`` of its ``n`` go on (at least one, always fewer than
    ``n``: ``keep`` 0 decides at once), so a finalist that cannot win stops early. The ``shared_epochs``
    (the epochs the last choice is made after) are spread over the rungs, at least one a rung. One
    finalist: no rung; no shared epochs (no final training): one rung of none.
    """
    if shared_epochs == 0:
        return [(finalists, 0)] if finalists > 1 else []
    counts = [finalists]
    while counts[-1] > 1:
        n = counts[-1]
        counts.append(max(1, min(n - 1, math.ceil(keep * n))))
    rungs = len(counts) - 1
    if rungs == 0:
        return []
    base, extra = divmod(max(shared_epochs, rungs), rungs)
    return [(counts[i], base + (1 if i < extra else 0)) for i in range(rungs)]


def schedule_epochs(finalists: int, shared_epochs: int, keep: float, final_epochs: int) -> int:
    """Epochs of final training in all (every finalist's), at most: the rungs, then the winner's rest up to
    ``final_epochs`` (a plateau stop ends it sooner)."""
    rungs = halving_rungs(finalists, shared_epochs, keep)
    shared = sum(epochs for _, epochs in rungs)
    return sum(n * epochs for n, epochs in rungs) + max(0, final_epochs - shared)


# what a finalist costs the device, in the budgets the search screens it against (edge_sdk.profiling.fits)
COSTS = ("flops", "params", "train_memory_bytes")


def rank_finalists(rows: Sequence[Mapping[str, Any]], n_val: int, incumbent: int | None = None) -> list[int]:
    """Indices of ``rows`` (``val_accuracy``, ``val_loss`` and the :data:`COSTS`), best first: the
    one-standard-error rule, with the hand-made design as the default.

    Rows within one binomial standard error of the best accuracy are the validation split's noise apart.
    Among them the search replaces ``incumbent`` (the row of the design it was warm-started from) only with
    a finalist that costs the device no more in any budget it screens (FLOPs, parameters, training
    memory), cheapest in FLOPs first; then the incumbent; then the other near rows by accuracy. The rungs
    decide a few epochs into the training: a finalist that ties the incumbent there with fewer FLOPs but a
    wide dense head fits fast and can end worse, so a tie is no reason to leave the design the search
    started from (benchmarks/RESULTS.md, "the finalists' rule"). Training memory counts because it is
    mostly saved activations, what a step reads and writes: a design with fewer FLOPs but wide maps at full
    resolution trains slower than its FLOPs say (RESULTS.md, "The device's time, not only its FLOPs").
    Without an incumbent among them (none, or it fell out of the noise), the near rows go cheapest in
    FLOPs first: the device pays for every FLOP. The other rows follow by accuracy (ties: lower loss, the
    search's order). The first index is the choice.
    """
    top = max(r["val_accuracy"] for r in rows)
    margin = math.sqrt(top * (1 - top) / max(n_val, 1))
    near = [i for i, r in enumerate(rows) if r["val_accuracy"] >= top - margin]
    rest = [i for i in range(len(rows)) if i not in near]

    def accurate(i: int) -> tuple[float, float, int]:
        return -rows[i]["val_accuracy"], rows[i]["val_loss"], i

    def cheap(i: int) -> tuple[float, float, float, int]:
        return (rows[i]["flops"], *accurate(i))

    rest.sort(key=accurate)
    if incumbent is None or incumbent not in near:
        return sorted(near, key=cheap) + rest
    base = rows[incumbent]
    cheaper = [i for i in near if i != incumbent and all(rows[i][c] <= base[c] for c in COSTS)]
    others = [i for i in near if i != incumbent and i not in cheaper]
    return [*sorted(cheaper, key=cheap), incumbent, *sorted(others, key=accurate), *rest]


def plateaued(val_losses: Sequence[float], *, patience: int, min_epochs: int, min_delta: float) -> bool:
    """Whether a training whose validation loss after each epoch so far is ``val_losses`` should stop:
    at least ``min_epochs`` trained, and its last ``patience`` epochs did not bring the loss below the best
    before them by more than ``min_delta`` of it (a relative step: a flat curve, or a rising one). A
    non-finite loss counts as no improvement. ``patience`` 0: never.
    """
    n = len(val_losses)
    if patience == 0 or n < max(min_epochs, patience + 1):
        return False
    before = _best(val_losses[: n - patience])
    recent = _best(val_losses[n - patience :])
    if not math.isfinite(before):
        return not math.isfinite(recent)
    return not recent < before - min_delta * abs(before)


def _best(losses: Sequence[float]) -> float:
    return min((v for v in losses if math.isfinite(v)), default=math.inf)
