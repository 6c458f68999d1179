"""timed(): a phase's wall time lands under its name, phases in the order they ran; Deadline: a budget on
an injectable clock (a fake one here, so nothing depends on this machine's speed)."""

from __future__ import annotations

import math
import time

import pytest

from common.errors import ConfigError
from common.timing import Deadline, timed


def test_phases_are_recorded_in_order() -> None:
    seconds: dict[str, float] = {"load": 1.0}
    with timed(seconds, "train"):
        time.sleep(0.01)
    with timed(seconds, "export"):
        pass
    assert list(seconds) == ["load", "train", "export"]
    assert seconds["train"] >= 0.01 and 0 <= seconds["export"] < seconds["train"]


class Ticking:
    """A fake clock: every reading is one second after the previous one."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


def test_a_deadline_expires_on_its_clock_and_a_share_ends_no_later() -> None:
    deadline = Deadline.after(3.5, Ticking())  # read at 1: ends at 4.5
    assert deadline.end == 4.5
    share = deadline.within(10.0)  # read at 2: 12 is later, so the deadline's own end
    assert share.end == 4.5 and deadline.within(1.0).end == 4.0  # read at 3
    assert [deadline.expired() for _ in range(2)] == [False, True]  # read at 4, 5
    assert deadline.remaining() == -1.5  # read at 6
    assert not Deadline.after(math.inf, Ticking()).expired()


def test_timed_reads_the_clock_it_is_given() -> None:
    seconds: dict[str, float] = {}
    clock = Ticking()
    with timed(seconds, "search", clock):
        clock()
    assert seconds == {"search": 2.0}


@pytest.mark.parametrize("seconds", [0, -1.0, math.nan])
def test_a_deadline_needs_positive_seconds(seconds: float) -> None:
    with pytest.raises(ConfigError, match="must be a finite number > 0"):
        Deadline.after(seconds)
