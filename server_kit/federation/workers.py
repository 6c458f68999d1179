"""The worker processes `simulate` trains its clients in: forks of a fork server that has imported the device
pipeline once, one task per fork, each with its share of the free cores and a small oneDNN cache."""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import multiprocessing
import multiprocessing.forkserver
import os
from collections.abc import Iterator

from edge_sdk.profiling import usable_threads

__all__ = ["WORKER_PRELOAD", "WORKER_PRIMITIVE_CACHE", "worker_pool"]

WORKER_PRIMITIVE_CACHE = 128  # oneDNN primitives a client worker keeps (see worker_pool)
# What a client worker imports, loaded once by the fork server so that the workers share those pages:
# torch._dynamo is what torch.optim.Adam's constructor imports (hundreds of modules in every process)
WORKER_PRELOAD = [
    "torch._dynamo",
    "torch.optim",
    "onnx",
    "onnxruntime",
    "edge_sdk.client",
    "edge_sdk.data",
    "export.onnx_export",
    "profiles",
]


def _worker_context() -> multiprocessing.context.BaseContext:
    """Client workers forked from a fork server that has imported the device pipeline (where the
    platform has one; else spawned). A spawned worker imports torch on its own, in private memory, while
    forked workers share the server's copy (copy-on-write; benchmarks/RESULTS.md, "Speed and memory, second
    pass", measures the preloads).
    The fork server never runs a torch op, so no thread pool is forked half-initialised."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(WORKER_PRELOAD)
    return ctx


@contextlib.contextmanager
def worker_pool(jobs: int) -> Iterator[cf.ProcessPoolExecutor]:
    """``jobs`` worker processes of one task each (a fresh fork per client: the heap one client's
    training leaves behind never reaches the next), each with an equal share of the free cores and a
    small oneDNN primitive cache (one client trains one model at a time: 128 primitives hold it; the
    default 1,024 kept more memory per worker at equal speed: benchmarks/RESULTS.md, "Speed and memory,
    second pass").
    The fork server is stopped on the way out."""
    threads = max(1, usable_threads() // jobs)
    try:
        with cf.ProcessPoolExecutor(
            jobs,
            mp_context=_worker_context(),
            initializer=_init_worker,
            initargs=(threads,),
            max_tasks_per_child=1,
        ) as pool:
            yield pool
    finally:
        _stop_fork_server()


def _stop_fork_server() -> None:
    """End the fork server once the clients are done: it would otherwise hold its copy of torch and the
    device pipeline through the server phase. ``ForkServer._stop`` is private (CPython's tests use it);
    without it the server lingers until this process exits, which costs memory, nothing else. A later pool
    starts a fresh one."""
    stop = getattr(getattr(multiprocessing.forkserver, "_forkserver", None), "_stop", None)
    if callable(stop):
        stop()


def _init_worker(threads: int) -> None:
    import torch

    os.environ["OMP_NUM_THREADS"] = str(threads)
    # read by oneDNN when it first runs (no torch op has run in a fresh worker)
    os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", str(WORKER_PRIMITIVE_CACHE))
    torch.set_num_threads(threads)
