"""The loss curves of a device's phases, as its reports record them and as the server reads them back.

A bundle's manifest holds scalar metrics only, and its bytes are what a resume and the server trust, so
the per-epoch curves go to the JSON report beside it (``*.bundle.report.json``; personalization's
``report.json``) under ``curves``: one record per phase of :data:`PHASES`, the columns of
:func:`common.loop.fit_terms`'s history, ``{"epoch": [1, 2, ...], term: [value per epoch], ...}``.

Bounded whatever the training's length: at most :data:`MAX_CURVE_POINTS` epochs (a longer run keeps
evenly spaced ones, the first and last always, hence the explicit ``epoch`` column) of at most
:data:`MAX_CURVE_TERMS` terms, values rounded to :data:`CURVE_DIGITS` significant digits (a curve is for
the eye; the exact final losses stay in the metrics), a non-finite value (a diverged epoch) written as
null. A report comes from a device, so :func:`check_curve` holds a record to all of that before the server
draws it.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from typing import Any

from common.checks import check_ints, check_str, is_number
from common.errors import DataError

__all__ = [
    "CURVE_DIGITS",
    "MAX_CURVE_POINTS",
    "MAX_CURVE_TERMS",
    "PHASES",
    "check_curve",
    "curve_record",
    "curve_records",
]

# search: the best candidate's short training; classifier: the final training of the uploaded model
# (the chosen finalist's epochs, then its remaining ones); cvae: the CVAE's; personalize: on-device
PHASES = ("search", "classifier", "cvae", "personalize")
MAX_CURVE_POINTS = 200
MAX_CURVE_TERMS = 8
MAX_TERM_BYTES = 32
CURVE_DIGITS = 6
MAX_MESSAGE = 300  # characters of a refusal's message before its fix


def curve_record(history: Sequence[Mapping[str, float]]) -> dict[str, list[Any]]:
    """The bounded record of a per-epoch history (a dict of named values per epoch, every epoch the same
    names): the epochs kept (1-based) and one column per name."""
    n = len(history)
    if n <= MAX_CURVE_POINTS:
        kept = list(range(n))
    else:  # evenly spaced, the first and the last included
        kept = sorted({round(i * (n - 1) / (MAX_CURVE_POINTS - 1)) for i in range(MAX_CURVE_POINTS)})
    record: dict[str, list[Any]] = {"epoch": [i + 1 for i in kept]}
    for name in sorted(history[0]) if history else []:
        values = (float(history[i][name]) for i in kept)
        record[name] = [float(f"{v:.{CURVE_DIGITS}g}") if math.isfinite(v) else None for v in values]
    return record


def curve_records(histories: Mapping[str, Sequence[Mapping[str, float]]]) -> dict[str, dict[str, list[Any]]]:
    """``{phase: curve_record(history)}`` of the phases that trained at least one epoch."""
    return {phase: curve_record(history) for phase, history in histories.items() if history}


def check_curve(value: object, what: str) -> dict[str, list[float]]:
    """A record read from a report, held to what :func:`curve_record` writes: a dict of at most
    :data:`MAX_CURVE_TERMS` named columns besides ``epoch`` (strictly increasing ints >= 1, at most
    :data:`MAX_CURVE_POINTS`), each as long as ``epoch`` and of numbers or null (returned as NaN).
    Raises :class:`DataError` naming ``what``."""
    try:
        return _check_curve(value, what)
    except DataError as err:  # cut: a hostile report's values can be long, and the message shows them
        text = str(err) if len(str(err)) <= MAX_MESSAGE else str(err)[: MAX_MESSAGE - 3] + "..."
        raise DataError(f"{text}; fix: write the report with this SDK's curve_record (edge-sdk run)") from err


def _check_curve(value: object, what: str) -> dict[str, list[float]]:
    if not isinstance(value, dict):
        raise DataError(f"{what} must be a dict of per-epoch columns, got {type(value).__name__}")
    if "epoch" not in value or not 1 < len(value) <= MAX_CURVE_TERMS + 1:
        raise DataError(
            f"{what} must hold 'epoch' and 1 to {MAX_CURVE_TERMS} terms, "
            f"got keys {sorted(map(str, value))[:12]}"
        )
    epochs = check_ints(f"{what}.epoch", value["epoch"], 1, max_length=MAX_CURVE_POINTS, error=DataError)
    if not epochs or any(b <= a for a, b in itertools.pairwise(epochs)):
        raise DataError(f"{what}.epoch must be strictly increasing and non-empty, got {list(epochs)}")
    out = {"epoch": [float(e) for e in epochs]}
    for name, column in value.items():
        check_str(f"{what} term name", name, max_bytes=MAX_TERM_BYTES, error=DataError)
        if name == "epoch":
            continue
        if not isinstance(column, list) or len(column) != len(epochs):
            got = len(column) if isinstance(column, list) else type(column).__name__
            raise DataError(
                f"{what}.{name} must be a list of {len(epochs)} values (one per epoch), got {got}"
            )
        if not all(v is None or is_number(v) for v in column):
            raise DataError(f"{what}.{name} must hold finite numbers or null, got {column}")
        out[name] = [math.nan if v is None else float(v) for v in column]
    return out
