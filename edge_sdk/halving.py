"""How a device spends its final-training epochs: successive halving over the search's finalists, and a
plateau rule that ends a training once its validation curve has flattened.

Pure functions of counts and curves (no torch), so the rules are tested on made-up curves and the client
(:func:`edge_sdk.client.run_client`) and the device plan (:mod:`edge_sdk.plan`) count the same epochs.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["halving_rungs", "plateaued", "rank_finalists", "schedule_epochs"]


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


def rank_finalists(rows: Sequence[Mapping[str, Any]], n_val: int) -> list[int]:
    """Indices of ``rows`` (``val_accuracy``, ``val_loss``, ``flops``), best first: the rows within one
    binomial standard error of the best accuracy, cheapest (FLOPs) first, then the others by accuracy.

    The one-standard-error rule of model selection: a difference that small is the validation split's
    noise, and the device pays for every FLOP of a larger model (ties: higher accuracy, lower loss, the
    search's order). The first index is the one-standard-error choice.
    """
    top = max(r["val_accuracy"] for r in rows)
    margin = math.sqrt(top * (1 - top) / max(n_val, 1))
    near = [i for i, r in enumerate(rows) if r["val_accuracy"] >= top - margin]
    rest = [i for i in range(len(rows)) if i not in near]
    near.sort(key=lambda i: (rows[i]["flops"], -rows[i]["val_accuracy"], rows[i]["val_loss"], i))
    rest.sort(key=lambda i: (-rows[i]["val_accuracy"], rows[i]["val_loss"], i))
    return near + rest


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
