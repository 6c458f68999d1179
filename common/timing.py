"""Wall-clock time of a pipeline's phases, recorded the same way everywhere (the reports' ``seconds``)."""

from __future__ import annotations

import time
from collections.abc import Iterator, MutableMapping
from contextlib import contextmanager

__all__ = ["timed"]


@contextmanager
def timed(seconds: MutableMapping[str, float], phase: str) -> Iterator[None]:
    """Store the block's wall time (``time.perf_counter``) in ``seconds[phase]``."""
    start = time.perf_counter()
    yield
    seconds[phase] = time.perf_counter() - start
