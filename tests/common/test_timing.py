"""timed(): a phase's wall time lands under its name, phases in the order they ran."""

from __future__ import annotations

import time

from common.timing import timed


def test_phases_are_recorded_in_order() -> None:
    seconds: dict[str, float] = {"load": 1.0}
    with timed(seconds, "train"):
        time.sleep(0.01)
    with timed(seconds, "export"):
        pass
    assert list(seconds) == ["load", "train", "export"]
    assert seconds["train"] >= 0.01 and 0 <= seconds["export"] < seconds["train"]
