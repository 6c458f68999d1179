"""Wall-clock time of a pipeline's phases, recorded the same way everywhere (the reports' ``seconds``), and
the one deadline a time budget is enforced by.

A :class:`Deadline` reads its clock only where a caller asks whether time is left, so a test drives it
with a fake clock (a function that advances by a fixed step per call) and a budget stops the work at the
same point on every run.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator, MutableMapping
from contextlib import contextmanager
from dataclasses import dataclass

from common.checks import check_number

__all__ = ["Clock", "Deadline", "timed"]

Clock = Callable[[], float]  # seconds on a monotonic scale; time.perf_counter, or a test's fake


@contextmanager
def timed(
    seconds: MutableMapping[str, float], phase: str, clock: Clock = time.perf_counter
) -> Iterator[None]:
    """Store the block's time on ``clock`` (wall time by default) in ``seconds[phase]``."""
    start = clock()
    yield
    seconds[phase] = clock() - start


@dataclass(frozen=True)
class Deadline:
    """The moment ``end`` on ``clock`` after which no new work starts; a share of it (:meth:`within`) ends
    no later than it, so a phase that ends early leaves its rest to the next one."""

    end: float
    clock: Clock = time.perf_counter

    @classmethod
    def after(cls, seconds: float, clock: Clock = time.perf_counter) -> Deadline:
        """The deadline ``seconds`` (> 0; ``math.inf``: never) from now on ``clock``."""
        if seconds != math.inf:
            check_number("time budget seconds", seconds, positive=True)
        return cls(clock() + seconds, clock)

    def within(self, seconds: float) -> Deadline:
        """A deadline ``seconds`` from now, or this one if it comes first."""
        return Deadline(min(self.end, self.clock() + seconds), self.clock)

    def remaining(self) -> float:
        """Seconds left (negative once passed)."""
        return self.end - self.clock()

    def expired(self) -> bool:
        """Whether the deadline has passed: the question a loop asks before it starts more work."""
        return self.clock() >= self.end
