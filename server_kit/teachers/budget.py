"""What each teacher may cost the server, at the batch and in the phase the server runs, and the guard that
holds it to that while the phases run.

The load contract (:mod:`export.onnx_check`) bounds a model per sample. The server multiplies that by its
own batch, and a model can be cheap per sample and ruinous at the batch (a cost that grows faster than the
batch), or within the contract and still hundreds of times slower than its peers (dozens of convolutions
sharing one weight: a small file, hours of inversion). No constant fits every task: a 32x32 RGB teacher
costs what a hostile 8x8 one does. So the budget is relative, derived from the teachers themselves: each
phase's step (inversion and generator: forward and backward at their batch; the vote: forward at its
batch; distillation's adversarial rounds: forward and backward) is measured on every teacher, and a
teacher costing more than ``factor`` times the median teacher (in seconds, or in the bytes autograd keeps
for the backward pass) is dropped. The median assumes an honest majority, as the claim checks do.

The batch is reached by doubling from 1, and before each doubling every teacher's cost at the next size
is predicted from its last two (a cost growing faster than the batch is extrapolated at its own rate): a
teacher predicted over the budget is dropped before it can allocate or stall. The cheapest honest
models are never dropped for time below ``min_seconds`` per step or for memory below ``min_bytes``
(timer noise at a millisecond is not evidence).

While the phases run, :func:`guarded` times every forward pass of every teacher and checks its output: a
call slower than the per-sample budget at its batch (never less than ``call_seconds``) or a non-finite
output (a model finite on noise but NaN on image-like inputs) raises :class:`TeacherDropped` at once,
and :func:`run_guarded` reruns the phases without that teacher (``on_error="skip"``) or stops the round
with the project's error (``"stop"``).
"""

from __future__ import annotations

import contextlib
import logging
import math
import statistics
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode

from common.checks import check_int, is_number
from common.errors import ConfigError, TeacherError
from common.timing import timed
from common.torch_utils import INFER_BATCH
from edge_sdk.precision import autocast
from server_kit.teachers.abstain import Abstaining
from server_kit.teachers.loading import Teacher

__all__ = [
    "BudgetConfig",
    "Costs",
    "Phase",
    "TeacherDropped",
    "guarded",
    "measure_costs",
    "run_guarded",
    "run_within_budget",
    "server_phases",
]

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True, kw_only=True)
class BudgetConfig:
    """How far a teacher may exceed the median teacher before it is dropped; see the module docstring.

    The floors keep noise from deciding: a step under ``min_seconds`` costs minutes over a phase's steps,
    not hours, and timer noise and a shared core's pauses stay far below it."""

    factor: float = 20.0  # a teacher may cost this many times the median teacher (seconds, bytes) per phase
    min_seconds: float = 0.5  # no teacher is dropped for time when its step takes less than this many seconds
    min_bytes: int = 64 * 2**20  # no teacher is dropped for memory when its step needs fewer bytes than this
    call_seconds: float = 1.0  # while the phases run, no forward pass is too slow under this many seconds

    def __post_init__(self) -> None:
        for name in ("factor", "min_seconds", "call_seconds"):
            value = getattr(self, name)
            if not is_number(value) or not math.isfinite(value) or value <= 0:
                raise ConfigError(f"{name} must be a finite number > 0, got {value!r}")
        if self.factor < 1:
            raise ConfigError(f"factor must be >= 1 (the median teacher must fit), got {self.factor!r}")
        check_int("min_bytes", self.min_bytes, 1)


@dataclass(frozen=True)
class Phase:
    """One phase the teachers run in: its name, the batch it runs them at, and whether it backpropagates
    through them."""

    name: str
    batch: int
    backward: bool


def server_phases(
    *, inversion: int | None, generator: int | None, distillation: int | None, vote: int = INFER_BATCH
) -> tuple[Phase, ...]:
    """The phases a run will use (None: that phase does not run), each at the batch the server runs it."""
    phases = [Phase("vote", vote, False)]
    for name, batch in (("inversion", inversion), ("generator", generator), ("distillation", distillation)):
        if batch is not None:
            phases.append(Phase(name, check_int(f"{name} batch", batch, 1), True))
    return tuple(phases)


@dataclass(frozen=True)
class Costs:
    """Each teacher's measured step (seconds, bytes) per phase, the teachers dropped (index -> reason) and
    each kept teacher's forward-pass budget in seconds per sample."""

    seconds: list[dict[str, float]]
    bytes: list[dict[str, int]]
    dropped: dict[int, str]
    per_sample_seconds: list[float]
    limits: dict[str, dict[str, float]] = field(default_factory=dict)  # phase -> seconds, bytes

    def report(self) -> dict[str, object]:
        return {
            "seconds": self.seconds,
            "bytes": self.bytes,
            "dropped": {str(k): v for k, v in self.dropped.items()},
            "limits": self.limits,
        }


class TeacherDropped(TeacherError):
    """Teacher ``index`` broke its budget or gave a non-finite output while a phase ran."""

    def __init__(self, index: int, reason: str) -> None:
        super().__init__(reason)
        self.index = index
        self.reason = reason


class _Largest(TorchDispatchMode):
    """The bytes of the largest tensor any op makes (a transient peak autograd does not keep)."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, tuple | list) else (out,):
            if isinstance(t, Tensor):
                self.largest = max(self.largest, t.numel() * t.element_size())
        return out


def _step(
    module: nn.Module, x: Tensor, backward: bool, precision: str, device: torch.device, *, count: bool
) -> tuple[float, int]:
    """(seconds, bytes) of one step of ``module`` on ``x``: forward, and backward to the input when
    ``backward`` (without gradients otherwise). Bytes (with ``count``; 0 otherwise, and the step is timed
    without the op hooks): what autograd keeps for the backward pass (shared storage, one weight used by
    many layers, counted once) plus the largest tensor any op makes."""
    seen: set[tuple[int, int]] = set()
    kept = 0

    def pack(t: Tensor) -> Tensor:
        nonlocal kept
        key = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        if key not in seen:
            seen.add(key)
            kept += key[1]
        return t

    x = x.to(device).requires_grad_(backward)
    largest = _Largest() if count else contextlib.nullcontext()
    start = time.perf_counter()
    with (
        torch.set_grad_enabled(backward),
        largest,
        torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
        autocast(precision, device),
    ):
        out = module(x)
        if backward:
            out.float().sum().backward()
    seconds = time.perf_counter() - start
    return seconds, (kept + largest.largest if isinstance(largest, _Largest) else 0)


def _sizes(batch: int) -> list[int]:
    sizes, s = [], 1
    while s < batch:
        sizes.append(s)
        s *= 2
    return [*sizes, batch]


def _predict(history: list[tuple[int, float]], size: int, noise: float) -> float:
    """A cost at ``size`` from the last two measured: linear in the batch, or growing faster at its own
    measured rate once the costs are above ``noise`` (timer noise at microseconds is no rate)."""
    (s1, c1), rate = history[-1], 1.0
    if len(history) > 1 and history[-2][1] >= noise:
        s0, c0 = history[-2]
        rate = max(1.0, (c1 / c0) / (s1 / s0))
    return c1 * size / s1 * rate


@torch.no_grad()
def measure_costs(
    modules: Sequence[nn.Module],
    phases: Sequence[Phase],
    input_shape: Sequence[int],
    *,
    config: BudgetConfig | None = None,
    seed: int = 0,
    device: str | torch.device = "cpu",
    precision: str = "fp32",
) -> Costs:
    """Measure every teacher's step in every phase at the phase's batch, dropping those over budget as
    soon as they are (or are predicted to be); see the module docstring."""
    config = config or BudgetConfig()
    dev = torch.device(device)
    k = len(modules)
    seconds: list[dict[str, float]] = [{} for _ in range(k)]
    kept_bytes: list[dict[str, int]] = [{} for _ in range(k)]
    dropped: dict[int, str] = {}
    limits: dict[str, dict[str, float]] = {}
    gen = torch.Generator().manual_seed(seed)
    for phase in phases:
        times: dict[int, list[tuple[int, float]]] = {i: [] for i in range(k)}
        sizes_bytes: dict[int, list[tuple[int, float]]] = {i: [] for i in range(k)}
        for size in _sizes(phase.batch):
            alive = [i for i in range(k) if i not in dropped]
            if times[alive[0]]:  # predicted over the budget at this size: dropped before it runs
                for i in alive:
                    reason = _over(phase, size, times, sizes_bytes, alive, config, i, predicted=True)
                    if reason:
                        dropped[i] = reason
            alive = [i for i in range(k) if i not in dropped]
            x = torch.rand((size, *input_shape), generator=gen)
            for i in alive:
                # bytes counted on one run; the time is the faster of two (a shared core's pause is no cost)
                try:
                    counted = _step(modules[i], x, phase.backward, precision, dev, count=True)[1]
                    runs = [
                        _step(modules[i], x, phase.backward, precision, dev, count=False)[0] for _ in range(2)
                    ]
                except (RuntimeError, MemoryError) as err:  # torch's shape errors, an allocation refused
                    dropped[i] = f"fails on a {phase.name} step at batch {size}: {err}"
                    continue
                times[i].append((size, min(runs)))
                sizes_bytes[i].append((size, float(counted)))
            alive = [i for i in alive if i not in dropped]
            for i in alive:
                reason = _over(phase, size, times, sizes_bytes, alive, config, i, predicted=False)
                if reason:
                    dropped[i] = reason
        alive = [i for i in range(k) if i not in dropped]
        for i in alive:
            seconds[i][phase.name] = times[i][-1][1]
            kept_bytes[i][phase.name] = int(sizes_bytes[i][-1][1])
        limits[phase.name] = {
            "seconds": _limit([times[i][-1][1] for i in alive], config.factor, config.min_seconds),
            "bytes": _limit([sizes_bytes[i][-1][1] for i in alive], config.factor, config.min_bytes),
        }
    per_sample = [max((limits[p.name]["seconds"] / p.batch for p in phases), default=0.0) for _ in range(k)]
    return Costs(seconds, kept_bytes, dropped, per_sample, limits)


def _limit(values: Sequence[float], factor: float, floor: float) -> float:
    return max(floor, factor * statistics.median(values)) if values else floor


def _over(
    phase: Phase,
    size: int,
    times: dict[int, list[tuple[int, float]]],
    sizes_bytes: dict[int, list[tuple[int, float]]],
    alive: list[int],
    config: BudgetConfig,
    i: int,
    *,
    predicted: bool,
) -> str | None:
    """Why teacher ``i`` is over the budget at ``size`` (measured, or predicted from the sizes before)."""
    for what, history, floor, unit in (
        ("seconds", times, config.min_seconds, "s"),
        ("bytes", sizes_bytes, float(config.min_bytes), "B"),
    ):
        if predicted:
            costs = {j: _predict(history[j], size, floor / config.factor) for j in alive}
        else:
            costs = {j: history[j][-1][1] for j in alive}
        limit = _limit(list(costs.values()), config.factor, floor)
        if costs[i] > limit:
            how = "would take" if predicted else "takes"
            return (
                f"{how} {costs[i]:.3g} {unit} per {phase.name} step at batch {size}, over its budget of "
                f"{limit:.3g} {unit} ({config.factor:g} x the median teacher's {what}); fix: upload a "
                "model of the cost of the federation's other models"
            )
    return None


@contextlib.contextmanager
def guarded(
    modules: Sequence[nn.Module],
    per_sample_seconds: Sequence[float],
    *,
    names: Sequence[int] | None = None,
    call_seconds: float = BudgetConfig.call_seconds,
) -> Iterator[None]:
    """Within the block every forward pass of ``modules[k]`` is timed and its output checked: slower than
    ``per_sample_seconds[k]`` times its batch (and than ``call_seconds``), or non-finite, raises
    :class:`TeacherDropped` naming ``names[k]`` (default k). Hooks are removed on exit."""
    names = list(range(len(modules))) if names is None else list(names)
    started: dict[tuple[int, int], float] = {}
    handles = []

    def hooks(k: int, limit: float, target: nn.Module) -> tuple[Callable[..., None], Callable[..., None]]:
        # a deep copy of a teacher (FedAvg's initial student) copies its hooks: they judge only the teacher
        def before(module: nn.Module, _inputs: tuple[object, ...]) -> None:
            if module is target:
                started[k, threading.get_ident()] = time.perf_counter()

        def after(module: nn.Module, inputs: tuple[object, ...], output: object) -> None:
            if module is not target or torch.jit.is_tracing():
                return
            elapsed = time.perf_counter() - started.pop((k, threading.get_ident()), time.perf_counter())
            batch = inputs[0].shape[0] if inputs and isinstance(inputs[0], Tensor) and inputs[0].dim() else 1
            allowed = max(call_seconds, limit * batch)
            if elapsed > allowed:
                raise TeacherDropped(
                    names[k],
                    f"took {elapsed:.3g} s for a forward pass of {batch} samples while the phases ran, over "
                    f"its budget of {allowed:.3g} s; fix: upload a model of the federation's cost",
                )
            if (
                isinstance(output, Tensor)
                and output.is_floating_point()
                and not bool(output.isfinite().all())
            ):
                raise TeacherDropped(
                    names[k],
                    f"gave non-finite outputs on {batch} synthetic samples while the phases ran (it was "
                    "finite on noise); fix: upload a model that is finite on every input in [0, 1]",
                )

        return before, after

    try:
        for k, (module, limit) in enumerate(zip(modules, per_sample_seconds, strict=True)):
            target = module.inner if isinstance(module, Abstaining) else module  # split() calls inner
            before, after = hooks(k, float(limit), target)
            handles += [target.register_forward_pre_hook(before), target.register_forward_hook(after)]
        yield
    finally:
        for handle in handles:
            handle.remove()


def run_guarded(
    attempt: Callable[[list[int]], T],
    modules: Sequence[nn.Module],
    per_sample_seconds: Sequence[float],
    *,
    on_error: str,
    labels: Sequence[str],
    call_seconds: float = BudgetConfig.call_seconds,
    restart: Callable[[], None] | None = None,
) -> tuple[T, list[tuple[int, str]]]:
    """``attempt(kept)`` (the phases, on the teachers of indices ``kept``) under :func:`guarded`; a teacher
    it drops is named in one log line and the phases rerun without it (``on_error="skip"``, after
    ``restart()`` clears what the failed attempt left) or the round stops with a TeacherError ("stop").
    Returns the result and the (index, reason) of every teacher dropped."""
    kept = list(range(len(modules)))
    dropped: list[tuple[int, str]] = []
    while True:
        try:
            with guarded(
                [modules[i] for i in kept],
                [per_sample_seconds[i] for i in kept],
                names=kept,
                call_seconds=call_seconds,
            ):
                return attempt(list(kept)), dropped
        except TeacherDropped as err:
            message = f"{labels[err.index]}: {err.reason}"
            if on_error != "skip":
                raise TeacherError(message) from err
            log.info("dropped teacher %s", message)  # as it happens; the CLI warns with the skipped
            kept.remove(err.index)
            dropped.append((err.index, err.reason))
            if not kept:
                raise TeacherError(f"no usable teacher is left: {message}") from err
            if restart is not None:
                restart()


def run_within_budget(
    teachers: list[Teacher],
    attempt: Callable[[list[Teacher]], T],
    *,
    phases: Sequence[Phase],
    config: BudgetConfig,
    on_error: str,
    skipped: list[tuple[str, str]],
    seed: int,
    device: torch.device,
    precision: str,
    seconds: dict[str, float],
    restart: Callable[[], None] | None = None,
) -> tuple[T, dict[str, object]]:
    """Every teacher's cost measured at the batch of each of ``phases`` (:func:`measure_costs`, timed as
    ``seconds["budget"]``), one over the budget the others set stopping the run or left out with its reason
    (``on_error``); then ``attempt(team)`` (the phases) under :func:`run_guarded`. Every teacher dropped is
    appended to ``skipped``. Returns the attempt's result and the budget's report."""
    with timed(seconds, "budget"):
        costs = measure_costs(
            [t.module for t in teachers],
            phases,
            tuple(teachers[0].bundle.input_shape),
            config=config,
            seed=seed,
            device=device,
            precision=precision,
        )
        for i, reason in sorted(costs.dropped.items()):
            message = f"{teachers[i].path}: {reason}"
            if on_error == "stop":
                raise TeacherError(message)
            log.info("dropped teacher %s", message)  # as it happens; the CLI warns with the skipped
            skipped.append((str(teachers[i].path), reason))
        kept = [i for i in range(len(teachers)) if i not in costs.dropped]
        if not kept:
            raise TeacherError(f"no usable teacher is left: {'; '.join(costs.dropped.values())}")
    candidates = [teachers[i] for i in kept]
    result, dropped = run_guarded(
        lambda team: attempt([candidates[i] for i in team]),
        [t.module for t in candidates],
        [costs.per_sample_seconds[i] for i in kept],
        on_error=on_error,
        labels=[str(t.path) for t in candidates],
        call_seconds=config.call_seconds,
        restart=restart,
    )
    skipped += [(str(candidates[i].path), reason) for i, reason in dropped]
    return result, costs.report() | {"dropped_while_running": [str(candidates[i].path) for i, _ in dropped]}
