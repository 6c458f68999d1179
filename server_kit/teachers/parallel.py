"""Per-teacher work spread over the cores: one teacher per thread, every op single-threaded inside it.

The server's heaviest phases (inversion, the vote) run each teacher on its own: ten small CNNs on
28x28 maps. Splitting every op of one teacher over the cores (torch's intra-op threads) makes the
cores meet at a barrier after each small op; running two teachers side by side, one per core, keeps
both busy with no barrier at all (torch releases the GIL inside its kernels). Measured on the 2-core
benchmark machine: benchmarks/RESULTS.md, "Speed".

The results come back in teacher order and each task draws only from its own seeded generators, so
the output does not depend on the schedule; the caller's thread setting is restored afterwards.

How many teachers run at once is torch's thread count unless :func:`teacher_workers` says otherwise.
The server sets it to every core it may run on while torch's own threads get only the free ones: a
core shared with another process slows an intra-op barrier down to that core's share, but a teacher
worker on it just finishes fewer teachers (the pool hands the next teacher to whichever worker is
free), so the shared core's share is a gain, not a stall (measured beside a busy loop:
benchmarks/RESULTS.md, "Speed and memory, second pass").
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import torch

from common.checks import check_int

__all__ = ["map_teachers", "teacher_workers"]

T = TypeVar("T")
_WORKERS: contextvars.ContextVar[int | None] = contextvars.ContextVar("teacher_workers", default=None)


@contextlib.contextmanager
def teacher_workers(count: int | None) -> Iterator[None]:
    """Within the block, :func:`map_teachers` runs up to ``count`` teachers at once (None: torch's
    thread count)."""
    if count is not None:
        check_int("teacher workers", count, 1)
    token = _WORKERS.set(count)
    try:
        yield
    finally:
        _WORKERS.reset(token)


def map_teachers(
    fn: Callable[[int], T],
    modules: Sequence[torch.nn.Module],
    *,
    device: torch.device | str = "cpu",
) -> list[T]:
    """``[fn(0), ..., fn(K - 1)]`` for the K ``modules``, on :func:`teacher_workers` (default
    ``torch.get_num_threads()``) threads of one op-thread each; ``fn(k)`` may touch ``modules[k]`` only
    (its hooks, its flags).

    The teachers with the most parameters (a stand-in for their FLOPs) start first, so the threads
    finish together. On a GPU, with one thread, or when one module object is listed twice (two threads
    would share its hooks), the tasks run in order in the calling thread.
    """
    count = len(modules)
    workers = min(_WORKERS.get() or torch.get_num_threads(), count)
    shared = len({id(m) for m in modules}) < count
    if workers <= 1 or shared or torch.device(device).type != "cpu":
        return [fn(k) for k in range(count)]
    order = sorted(range(count), key=lambda k: (-sum(p.numel() for p in modules[k].parameters()), k))
    grad = torch.is_grad_enabled()  # grad mode is per thread: the workers take the caller's

    def run(k: int) -> T:
        with torch.set_grad_enabled(grad):
            return fn(k)

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with ThreadPoolExecutor(workers, thread_name_prefix="teacher") as pool:
            done = dict(zip(order, pool.map(run, order), strict=True))
    finally:
        torch.set_num_threads(previous)
    return [done[k] for k in range(count)]
