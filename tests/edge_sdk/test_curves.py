"""The curves a device's reports record: bounded records of a training's per-epoch history, and the check
the server holds a record from a report to before it draws it."""

from __future__ import annotations

import itertools
import json
import math

import pytest

from common.errors import DataError
from edge_sdk.curves import MAX_CURVE_POINTS, MAX_CURVE_TERMS, check_curve, curve_record


def test_a_record_is_the_history_by_column_and_reads_back() -> None:
    history = [{"recon": 40.123456789, "kl": 0.5}, {"recon": 30.0, "kl": float("nan")}]
    record = curve_record(history)
    assert record == {
        "epoch": [1, 2],
        "kl": [0.5, None],
        "recon": [40.1235, 30.0],
    }  # CURVE_DIGITS (6) significant digits
    back = check_curve(json.loads(json.dumps(record)), "cvae")
    assert back["recon"] == [40.1235, 30.0] and math.isnan(
        back["kl"][1]
    )  # null: not recorded, drawn as a gap


def test_a_long_training_keeps_evenly_spaced_epochs_first_and_last_included() -> None:
    history = [{"loss": float(i)} for i in range(1000)]
    record = curve_record(history)
    epochs = record["epoch"]
    assert len(epochs) == MAX_CURVE_POINTS and epochs[0] == 1 and epochs[-1] == 1000
    assert record["loss"] == [float(e - 1) for e in epochs]  # the values of the epochs kept
    gaps = {b - a for a, b in itertools.pairwise(epochs)}
    assert gaps <= {5, 6}  # 999 / 199 epochs apart, rounded
    assert len(json.dumps(record)) < 4000  # a few KB whatever the length of the training
    assert check_curve(record, "long")["epoch"][-1] == 1000


@pytest.mark.parametrize(
    ("record", "message"),
    [
        ([1.0, 2.0], "must be a dict"),
        ({"loss": [1.0]}, "must hold 'epoch'"),
        ({"epoch": [1]}, "must hold 'epoch'"),
        ({"epoch": [1], **{f"t{i}": [1.0] for i in range(MAX_CURVE_TERMS + 1)}}, "must hold 'epoch'"),
        ({"epoch": [2, 1], "loss": [1.0, 2.0]}, "strictly increasing"),
        ({"epoch": [0], "loss": [1.0]}, r"epoch\[0\] must be an integer >= 1"),
        ({"epoch": [1.5], "loss": [1.0]}, "must be an integer"),
        ({"epoch": list(range(1, MAX_CURVE_POINTS + 2)), "loss": [1.0] * (MAX_CURVE_POINTS + 1)}, "at most"),
        ({"epoch": [1, 2], "loss": [1.0]}, "must be a list of 2 values"),
        ({"epoch": [1], "loss": "1.0"}, "must be a list of 1 values"),
        ({"epoch": [1], "loss": ["1.0"]}, "finite numbers or null"),
        ({"epoch": [1], "loss": [True]}, "finite numbers or null"),
        ({"epoch": [1], "x" * 40: [1.0]}, "term name must be a non-empty str of at most 32 bytes"),
    ],
)
def test_a_malformed_record_is_refused_with_what_and_the_fix(record: object, message: str) -> None:
    with pytest.raises(DataError, match=message) as err:
        check_curve(record, "client 3: curves.classifier")
    assert str(err.value).startswith("client 3: curves.classifier") and "fix:" in str(err.value)


def test_a_refusal_shows_a_hostile_value_cut() -> None:
    with pytest.raises(DataError, match=r"\.\.\.; fix:") as err:
        check_curve({"epoch": ["x" * 100_000], "loss": [1.0]}, "client 0: curves.cvae")
    assert len(str(err.value)) < 400
