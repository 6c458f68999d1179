"""Model cost (FLOPs, parameters, memory) and device measurement.

FLOPs follow ``torch.utils.flop_counter.FlopCounterMode``: 2 x MACs, convolutions and matrix products only,
per sample at batch 1. That is the convention of :meth:`edge_sdk.models.chain.spec.ChainSpec.cost` and of the
device profiles' ``max_flops``, so an analytic screen, a measured count and a budget compare directly.

Memory is estimated, not read from the allocator (CPU allocators do not report per-model peaks):

- training = parameters + buffers + gradients + optimizer state + the activations autograd saves for the
  backward pass, measured by a dry forward pass at the training batch size;
- inference = parameters + buffers + the largest (input + output) of any leaf module at batch 1, the
  MCUNet-style peak-activation estimate.
"""

from __future__ import annotations

import copy
import math
import os
import platform
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.flop_counter import FlopCounterMode

from common.errors import ConfigError, ProfileError, SpecError
from edge_sdk.precision import autocast
from profiles import ROLES, DeviceProfile

__all__ = [
    "FINAL_TRAINING_SHARE",
    "OPTIMIZER_STATE",
    "ModelProfile",
    "allowed_cores",
    "budget_pair",
    "count_flops",
    "fits",
    "free_cores",
    "measure_device",
    "measure_throughput",
    "profile_model",
    "train_seconds",
    "trains_in_time",
    "usable_threads",
]

# a core is free when less than this share of it was busy over the sampling window
BUSY_SHARE = 0.5

# Optimizer state per trainable parameter, in parameter-sized tensors (Adam: first and second moments).
OPTIMIZER_STATE = {"sgd": 0, "sgd-momentum": 1, "adam": 2, "adamw": 2}

# measure_device's budget rule (see its docstring).
MEMORY_SHARE = 0.5  # of the available memory, for local training
PARAM_MEMORY_SHARE = 0.25  # of that, for parameters + gradients + Adam state (16 bytes per fp32 parameter)
BYTES_PER_TRAINED_PARAM = 16
LATENCY_MS = 4.0  # one image classified in 4 ms at the measured gflops: the shipped classifiers' rule
TIME_BUDGET_S = 1800.0


@dataclass(frozen=True, kw_only=True)
class ModelProfile:
    """What one model costs: per-sample FLOPs / MACs, parameters and memory in bytes."""

    flops: int
    macs: int
    params: int
    param_bytes: int
    train_memory_bytes: int
    inference_memory_bytes: int

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"{name} must be a non-negative integer, got {value!r}")

    def to_dict(self) -> dict[str, int]:
        return asdict(self)


def _check_shape(input_shape: tuple[int, int, int]) -> tuple[int, int, int]:
    shape = tuple(input_shape)
    if len(shape) != 3 or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in shape):
        raise ConfigError(f"input_shape must be three positive integers (C, H, W), got {input_shape!r}")
    return shape  # type: ignore[return-value]


def _example(model: nn.Module, shape: tuple[int, int, int], batch_size: int) -> torch.Tensor:
    param = next(model.parameters(), None)
    device = param.device if param is not None else torch.device("cpu")
    dtype = param.dtype if param is not None and param.is_floating_point() else torch.float32
    return torch.zeros((batch_size, *shape), device=device, dtype=dtype)


def _run(model: nn.Module, x: torch.Tensor) -> object:
    try:
        return model(x)
    except RuntimeError as err:
        raise SpecError(f"the model cannot run on inputs of shape {tuple(x.shape)}: {err}") from err


def _modes(model: nn.Module) -> dict[nn.Module, bool]:
    return {m: m.training for m in model.modules()}


def _restore_modes(modes: dict[nn.Module, bool]) -> None:
    for module, training in modes.items():
        module.training = training


def count_flops(model: nn.Module, input_shape: tuple[int, int, int]) -> int:
    """Inference FLOPs per sample (2 x MACs, conv/matmul), counted at batch 1 in eval mode."""
    x = _example(model, _check_shape(input_shape), 1)
    modes = _modes(model)
    try:
        model.eval()
        with torch.no_grad(), FlopCounterMode(display=False) as counter:
            _run(model, x)
    finally:
        _restore_modes(modes)
    return int(counter.get_total_flops())


def _storage_key(t: torch.Tensor) -> tuple[int, int]:
    """(address, bytes) of the storage behind ``t``, so views and in-place results count once."""
    try:
        storage = t.untyped_storage()
        return storage.data_ptr(), storage.nbytes()
    except (RuntimeError, NotImplementedError, TypeError):  # tensor subclasses without a plain storage
        return id(t), t.numel() * t.element_size()


def _saved_activation_bytes(probe: nn.Module, x: torch.Tensor) -> int:
    """Bytes of the distinct storages autograd saves for backward during one training-mode forward."""
    state = {_storage_key(t)[0] for t in (*probe.parameters(), *probe.buffers())}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        address, nbytes = _storage_key(t)
        if nbytes and address not in state:
            saved[address] = max(saved.get(address, 0), nbytes)
        # detached: an op's output saved for its own backward would otherwise hold its graph node,
        # a reference cycle outside Python's collector (it leaked every profiled model's activations over a
        # simulation's searches; benchmarks/RESULTS.md, "Speed and memory")
        return t.detach()

    probe.train()
    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = _run(probe, x)
    del out
    return sum(saved.values())


def _tensors(value: object) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, list | tuple):
        for item in value:
            yield from _tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)


def _peak_layer_bytes(probe: nn.Module, x: torch.Tensor) -> int:
    """Largest input + output bytes of any leaf module in one eval forward (an in-place op counts once)."""
    peak = 0

    def hook(module: nn.Module, inputs: object, output: object) -> None:
        nonlocal peak
        seen = {t.data_ptr(): t.numel() * t.element_size() for t in (*_tensors(inputs), *_tensors(output))}
        peak = max(peak, sum(seen.values()))

    leaves = [m for m in probe.modules() if next(m.children(), None) is None]
    handles = [m.register_forward_hook(hook) for m in leaves]
    try:
        probe.eval()
        with torch.no_grad():
            _run(probe, x)
    finally:
        for handle in handles:
            handle.remove()
    return peak


def _activations_at(probe: nn.Module, shape: tuple[int, int, int], batch_size: int) -> int:
    """Saved-activation bytes at ``batch_size``, measured at batches 2 and 4 and extrapolated when it is
    larger: what autograd saves is a part proportional to the batch plus a part that is not (BatchNorm's
    per-channel statistics), so two points give it exactly, and the dry run never allocates the full
    batch's activations (a 128-channel candidate at batch 64 would take hundreds of MB to be screened).
    Batch 2, not 1: BatchNorm cannot train on one 1x1 map."""
    if batch_size <= 4:
        return _saved_activation_bytes(probe, _example(probe, shape, batch_size))
    small, large = (_saved_activation_bytes(probe, _example(probe, shape, b)) for b in (2, 4))
    per_sample = (large - small) // 2
    return small + per_sample * (batch_size - 2)


def profile_model(
    model: nn.Module, input_shape: tuple[int, int, int], *, batch_size: int = 64, optimizer: str = "adam"
) -> ModelProfile:
    """FLOPs, parameters and estimated training / inference memory of ``model`` (unchanged on return).

    The memory dry runs use a deep copy, so the caller's parameters, BatchNorm statistics, modes and hooks
    are untouched; the global torch RNG (which Dropout draws from) is restored afterwards.
    """
    shape = _check_shape(input_shape)
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ConfigError(f"batch_size must be a positive integer, got {batch_size!r}")
    if optimizer not in OPTIMIZER_STATE:
        raise ConfigError(f"optimizer must be one of {sorted(OPTIMIZER_STATE)}, got {optimizer!r}")

    flops = count_flops(model, shape)
    params = list(model.parameters())  # unique (shared parameters once)
    param_bytes = sum(p.numel() * p.element_size() for p in params)
    trained_bytes = sum(p.numel() * p.element_size() for p in params if p.requires_grad)
    buffer_bytes = sum(b.numel() * b.element_size() for b in model.buffers())
    state_bytes = param_bytes + buffer_bytes

    probe = copy.deepcopy(model)
    x = _example(probe, shape, 1)
    cuda = x.device.type == "cuda"
    devices = [x.device.index if x.device.index is not None else torch.cuda.current_device()] if cuda else []
    with torch.random.fork_rng(devices=devices):
        activations = _activations_at(probe, shape, batch_size)
    peak = _peak_layer_bytes(probe, x)
    del probe

    return ModelProfile(
        flops=flops,
        macs=flops // 2,
        params=sum(p.numel() for p in params),
        param_bytes=param_bytes,
        train_memory_bytes=state_bytes + trained_bytes * (1 + OPTIMIZER_STATE[optimizer]) + activations,
        inference_memory_bytes=state_bytes + peak,
    )


_PREFIXES = ("", "k", "M", "G", "T")


def budget_pair(value: float, budget: float, unit: str, *, scaled: bool = True) -> tuple[str, str]:
    """Both numbers in the budget's (SI) scale, with enough decimals that they print differently."""
    exponent = 0
    while scaled and exponent < len(_PREFIXES) - 1 and abs(budget) >= 1000 ** (exponent + 1):
        exponent += 1
    scale = 1000**exponent
    suffix = f" {_PREFIXES[exponent]}{unit}".rstrip()
    for decimals in range(1, 7):
        a, b = f"{value / scale:.{decimals}f}", f"{budget / scale:.{decimals}f}"
        if a != b:
            return a + suffix, b + suffix
    return f"{value:g}", f"{budget:g}"


def fits(model_profile: ModelProfile, profile: DeviceProfile) -> str | None:
    """``None`` when the model fits the device, else a message naming the first exceeded budget.

    Budgets are checked in the order params, flops, training memory (cheapest to fix first).
    """
    where = f"of profile {profile.name!r}"
    if model_profile.params > profile.max_params:
        got, limit = budget_pair(model_profile.params, profile.max_params, "")
        return f"params {got} exceeds max_params {limit} {where}"
    if model_profile.flops > profile.max_flops:
        got, limit = budget_pair(model_profile.flops, profile.max_flops, "FLOP")
        return f"flops {got} exceeds max_flops {limit} {where}"
    if model_profile.train_memory_bytes > profile.memory_bytes:
        mib = 1024 * 1024
        used, budget = model_profile.train_memory_bytes / mib, profile.memory_bytes / mib
        got, limit = budget_pair(used, budget, "MB", scaled=False)
        return f"train memory {got} exceeds memory_mb {limit} {where}"
    return None


# share of a profile's time_budget_s the final training of the chosen model may take; the rest is for
# the search, the finalists' shared epochs, the CVAE and the export
FINAL_TRAINING_SHARE = 0.5
# FLOPs of one training step per image, in forward passes: forward, gradient to the activations, gradient
# to the weights (the usual 3x rule; the first layer's input gradient is not needed, a small saving)
TRAIN_FLOP_FACTOR = 3


def train_seconds(flops: int, samples: int, epochs: int, profile: DeviceProfile) -> float:
    """Seconds the device needs to train a model of ``flops`` per image for ``epochs`` over ``samples``
    images at its sustained throughput (``profile.gflops``)."""
    return TRAIN_FLOP_FACTOR * flops * samples * epochs / (profile.gflops * 1e9)


def trains_in_time(flops: int, samples: int, epochs: int, profile: DeviceProfile) -> str | None:
    """``None`` when the final training fits ``FINAL_TRAINING_SHARE`` of the device's time budget, else
    the message: a model that fits every other budget can still take the device hours to train."""
    need = train_seconds(flops, samples, epochs, profile)
    limit = FINAL_TRAINING_SHARE * profile.time_budget_s
    if need > limit:
        return (
            f"training {epochs} epochs on {samples} images takes ~{need:.0f} s at {profile.gflops:g} GFLOP/s "
            f"over {limit:.0f} s ({FINAL_TRAINING_SHARE:g} of time_budget_s) of profile {profile.name!r}"
        )
    return None


def _available_memory_bytes() -> int:
    """MemAvailable from /proc/meminfo (else free physical pages), capped by a cgroup memory limit."""
    available: int | None = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
                break
    except (OSError, ValueError, IndexError):
        available = None
    if available is None:
        try:
            available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError) as err:
            raise ProfileError(
                f"cannot determine the available memory on this system ({err}); write a profile TOML by hand"
            ) from err
    for limit_file, usage_file in (
        ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
        ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"),
    ):
        try:
            limit = Path(limit_file).read_text().strip()
            usage = int(Path(usage_file).read_text().strip())
        except (OSError, ValueError):
            continue
        if limit.isdigit() and int(limit) < 2**60:  # "max" or a huge number means no limit
            available = min(available, max(int(limit) - usage, 0))
        break
    return available


def _median_seconds(fn: Callable[[], object], seconds: float) -> tuple[float, int]:
    """Median wall time of ``fn`` after two warm-up calls: at least 3 timed runs, more while time is left."""
    with torch.inference_mode():
        fn()
        fn()
        times: list[float] = []
        deadline = time.perf_counter() + seconds
        while len(times) < 3 or (time.perf_counter() < deadline and len(times) < 1000):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
    return statistics.median(times), len(times)


def _gflops(flop: int, median_s: float, what: str) -> float:
    value = flop / median_s / 1e9 if median_s > 0 else math.inf
    if not (math.isfinite(value) and value > 0):
        raise ProfileError(
            f"the {what} benchmark measured a throughput of {value} GFLOP/s (median {median_s} s); "
            "measure again with more seconds, or write a profile TOML by hand"
        )
    return value


def measure_throughput(*, seconds: float = 2.0, precision: str = "fp32") -> dict[str, float]:
    """GFLOP/s of this machine's two micro-benchmarks with torch's current thread count: a 3x3
    convolution (8 x 32 x 28 x 28 input, 32 -> 64 channels, same padding) and a 512 x 512 matmul, each
    timed for half of ``seconds`` (median after two warm-ups), in ``precision`` (``fp32``, or ``bf16``
    through the same autocast as training: the peak that a bf16 run's achieved GFLOP/s compares with).
    Returns ``conv``, ``matmul`` (GFLOP/s) and ``conv_runs``, ``matmul_runs``."""
    # Operand values do not matter; a local generator keeps the global RNG untouched.
    generator = torch.Generator().manual_seed(0)
    image = torch.rand((8, 32, 28, 28), generator=generator)
    kernel = torch.rand((64, 32, 3, 3), generator=generator)
    conv_flop = 2 * 8 * 28 * 28 * 64 * 32 * 3 * 3
    a = torch.rand((512, 512), generator=generator)
    b = torch.rand((512, 512), generator=generator)
    matmul_flop = 2 * 512**3

    def conv() -> object:
        with autocast(precision, "cpu"):
            return F.conv2d(image, kernel, padding=1)

    def matmul() -> object:
        with autocast(precision, "cpu"):
            return a @ b

    conv_s, conv_runs = _median_seconds(conv, seconds / 2)
    matmul_s, matmul_runs = _median_seconds(matmul, seconds / 2)
    return {
        "conv": _gflops(conv_flop, conv_s, "convolution"),
        "matmul": _gflops(matmul_flop, matmul_s, "matmul"),
        "conv_runs": conv_runs,
        "matmul_runs": matmul_runs,
    }


def measure_device(
    *, name: str = "this-device", seconds: float = 2.0, role: str = "classifier"
) -> DeviceProfile:
    """Measure this machine and derive a profile.

    Throughput: two fp32 micro-benchmarks with torch's current thread count (what training will use):
    a 3x3 convolution (8 x 32 x 28 x 28 input, 32 -> 64 channels, same padding: 2 x 8*28*28*64*32*9 FLOP)
    and a 512 x 512 matmul (2 x 512^3 FLOP); each runs twice to warm up, then is timed repeatedly for half of
    ``seconds`` and its median is used; ``gflops`` is the lower of the two. The conv batch is 8 so that one
    call stays well under a second even on a Raspberry Pi Zero-class CPU.

    Budgets (documented rule):
    - ``memory_mb`` = 50 % of the available memory (MemAvailable, capped by a cgroup limit);
    - ``max_flops`` = what the device classifies one image with in ``LATENCY_MS`` milliseconds:
      ``gflops * 1e6 * LATENCY_MS`` (the rule of the shipped classifier profiles; the file states it as
      ``latency_ms``);
    - ``max_params`` = the lower of (a quarter of ``memory_mb`` at 16 bytes per trained fp32 parameter:
      weight, gradient, two Adam moments) and ``max_flops / 2`` (every weight of a conv/FC layer costs at
      least one MAC, so a larger model cannot meet ``max_flops`` anyway);
    - ``time_budget_s`` = 1800.
    """
    if isinstance(seconds, bool) or not isinstance(seconds, int | float) or not (0 < seconds < math.inf):
        raise ConfigError(f"seconds must be a positive number, got {seconds!r}")
    if role not in ROLES:
        raise ConfigError(f"role must be one of {ROLES}, got {role!r}")
    affinity = getattr(os, "sched_getaffinity", None)
    cores = len(affinity(0)) if affinity is not None else (os.cpu_count() or 1)
    available = _available_memory_bytes()
    threads = torch.get_num_threads()

    measured = measure_throughput(seconds=seconds)
    conv_gflops, conv_runs = measured["conv"], measured["conv_runs"]
    matmul_gflops, matmul_runs = measured["matmul"], measured["matmul_runs"]
    gflops = min(conv_gflops, matmul_gflops)

    memory_mb = round(MEMORY_SHARE * available / 2**20, 1)
    max_flops = max(1, round(gflops * 1e6 * LATENCY_MS))
    by_memory = memory_mb * 2**20 * PARAM_MEMORY_SHARE / BYTES_PER_TRAINED_PARAM
    max_params = max(1, int(min(by_memory, max_flops / 2)))
    host = f"{platform.system()} {platform.machine()}".strip()
    return DeviceProfile(
        name=name,
        description=f"measured on this {host} host: {cores} cores, {available / 2**20:.0f} MB available",
        memory_mb=memory_mb,
        gflops=round(gflops, 3),
        gflops_source=(
            "measured by edge_sdk.profiling.measure_device "
            f"(fp32, torch {torch.__version__}, {threads} threads): "
            f"conv3x3 8x32x28x28->64 {conv_gflops:.2f} GFLOP/s (median of {conv_runs} runs), "
            f"matmul 512x512 {matmul_gflops:.2f} GFLOP/s (median of {matmul_runs} runs); gflops = the lower"
        ),
        max_flops=max_flops,
        max_params=max_params,
        role=role,
        time_budget_s=TIME_BUDGET_S,
        cores=cores,
    )


def _core_times() -> dict[int, tuple[int, int]]:
    """(busy, total) clock ticks per core since boot, from /proc/stat; {} where it cannot be read."""
    times: dict[int, tuple[int, int]] = {}
    try:
        with open("/proc/stat", encoding="ascii") as fh:
            for line in fh:
                name, *values = line.split()
                if name.startswith("cpu") and name[3:].isdigit():
                    ticks = [int(v) for v in values[:8]]
                    idle = ticks[3] + ticks[4]  # idle + iowait
                    times[int(name[3:])] = (sum(ticks) - idle, sum(ticks))
    except (OSError, ValueError, IndexError):
        return {}
    return times


def allowed_cores() -> int:
    """How many cores this process may run on (its affinity set; the CPU count where there is none)."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


def free_cores(seconds: float = 0.2) -> int:
    """How many of the cores this process may run on were mostly idle over the last ``seconds``.

    A shared machine (another job, a busy loop) leaves fewer free cores than it has: torch's threads
    placed on a busy core wait at every parallel region's barrier for the slowest one (benchmarks/RESULTS.md,
    "A shared machine": a busy loop on one core slowed the 2-thread server phase). Falls back to the
    affinity size where /proc/stat cannot be read. Never less than 1.
    """
    affinity = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(range(allowed_cores()))
    before = _core_times()
    time.sleep(seconds)
    after = _core_times()
    if not before or not after:
        return max(1, len(affinity))
    free = 0
    for core in affinity:
        if core in before and core in after:
            busy = after[core][0] - before[core][0]
            total = after[core][1] - before[core][1]
            free += total <= 0 or busy / total < BUSY_SHARE
    return max(1, free)


def usable_threads(requested: int | None = None) -> int:
    """Threads for torch: ``requested`` when given, else the free cores, never more than torch's current
    setting (so an outer limit, a worker's share or ``OMP_NUM_THREADS``, still holds)."""
    if requested is not None:
        if isinstance(requested, bool) or not isinstance(requested, int) or requested < 1:
            raise ConfigError(f"threads must be an integer >= 1, got {requested!r}")
        return requested
    return max(1, min(torch.get_num_threads(), free_cores()))
