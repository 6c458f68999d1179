"""Teachers side by side (server_kit.teachers.parallel): same results as one after the other, in teacher
order."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
import torch
from torch import nn

from server_kit.labelling.labels import consensus
from server_kit.synthesis.inversion import synthesize_inversion
from server_kit.teachers.parallel import map_teachers, teacher_workers
from tests.server_kit.test_inversion import SHAPE, L, _teachers, config


@pytest.fixture
def two_threads() -> Iterator[None]:
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(previous)


def test_map_teachers_keeps_order_threads_and_grad_mode(two_threads: None) -> None:
    modules = [nn.Linear(2, n) for n in (1, 5, 2, 4, 3)]  # the largest start first
    names: set[str] = set()

    def fn(k: int) -> tuple[int, bool, int]:
        names.add(threading.current_thread().name)
        return k, torch.is_grad_enabled(), torch.get_num_threads()

    with torch.no_grad():
        out = map_teachers(fn, modules)
    assert [k for k, _, _ in out] == list(range(5))
    assert not any(grad for _, grad, _ in out)  # the caller's no_grad reaches the workers
    assert all(threads == 1 for _, _, threads in out)  # one op-thread each
    assert all(name.startswith("teacher") for name in names)
    assert torch.get_num_threads() == 2  # restored
    # one module listed twice shares hooks and flags: run in order in the caller's thread
    caller = threading.current_thread().name
    seen = map_teachers(lambda k: threading.current_thread().name, [modules[0], modules[0]])
    assert seen == [caller, caller]


def test_parallel_inversion_and_vote_equal_the_serial_ones(two_threads: None) -> None:
    teachers, cfg = _teachers(), config()
    parallel = synthesize_inversion(teachers, num_classes=L, input_shape=SHAPE, config=cfg, seed=4)
    votes = consensus(teachers, parallel.x, tau=2.0)
    torch.set_num_threads(1)
    serial = synthesize_inversion(teachers, num_classes=L, input_shape=SHAPE, config=cfg, seed=4)
    # bitwise: each teacher's worker runs on one op thread, as the serial run does, so every reduction
    # happens in the same order on any CPU; only the teachers overlap
    assert torch.equal(parallel.x, serial.x) and torch.equal(parallel.teacher, serial.teacher)
    assert torch.equal(parallel.target_class, serial.target_class)
    assert torch.equal(votes, consensus(teachers, serial.x, tau=2.0))


def test_teacher_workers_sets_how_many_teachers_run_at_once() -> None:
    modules = [nn.Linear(2, 2) for _ in range(4)]

    def name(k: int) -> str:
        time.sleep(0.05)  # long enough that both workers take a teacher
        return threading.current_thread().name

    assert torch.get_num_threads() == 1  # the tests' setting: one teacher at a time by default
    with teacher_workers(2):
        names = set(map_teachers(name, modules))
    assert len(names) == 2 and all(n.startswith("teacher") for n in names)
    assert set(map_teachers(name, modules)) == {threading.current_thread().name}  # reset on exit
