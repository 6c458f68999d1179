"""Model cost and device measurement; expected counts are worked out by hand in the tests."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from common.errors import ConfigError, SpecError
from edge_sdk.models.arch import build_model
from edge_sdk.models.chain.spec import ChainSpec
from edge_sdk.profiling import (
    LATENCY_MS,
    ModelProfile,
    _activations_at,
    _example,
    _saved_activation_bytes,
    count_flops,
    fits,
    measure_device,
    profile_model,
    train_seconds,
    trains_in_time,
    usable_threads,
)
from profiles import DeviceProfile


def tiny_net() -> nn.Module:
    torch.manual_seed(0)  # deterministic weights for the test only; the library never seeds globally
    return nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1, bias=False),  # 1x8x8 -> 4x8x8
        nn.ReLU(),
        nn.MaxPool2d(2),  # -> 4x4x4
        nn.Flatten(),  # -> 64
        nn.Linear(64, 10),
    )


# Conv: 8*8 outputs x 4 channels x (1 in-channel x 3*3) = 2304 MACs; Linear: 64 x 10 = 640 MACs.
TINY_MACS = 8 * 8 * 4 * 1 * 9 + 64 * 10
# Conv weight 4*1*3*3 = 36; Linear weight 64*10 = 640 + bias 10.
TINY_PARAMS = 36 + 640 + 10


def test_tiny_net_counts_by_hand() -> None:
    net = tiny_net()
    assert count_flops(net, (1, 8, 8)) == 2 * TINY_MACS == 5888
    mp = profile_model(net, (1, 8, 8), batch_size=64)
    assert (mp.flops, mp.macs) == (5888, 2944)
    assert mp.params == TINY_PARAMS == 686
    assert mp.param_bytes == 4 * 686
    # Training, batch B, Adam: params + grads + 2 moments = 4 x 2744 bytes, plus what autograd saves:
    #   conv input B*1*8*8*4 = 256B; ReLU output B*4*8*8*4 = 1024B (also MaxPool's input: same storage);
    #   MaxPool int64 indices B*4*4*4*8 = 512B; Linear input (flattened pool output) B*64*4 = 256B.
    assert mp.train_memory_bytes == 4 * 2744 + 2048 * 64
    # Inference, batch 1: params + the largest leaf (in + out): ReLU 1024 + 1024 bytes.
    assert mp.inference_memory_bytes == 2744 + 2048
    assert mp.to_dict() == {
        "flops": 5888,
        "macs": 2944,
        "params": 686,
        "param_bytes": 2744,
        "train_memory_bytes": 142048,
        "inference_memory_bytes": 4792,
    }


def test_optimizer_state_and_batch_size() -> None:
    net = tiny_net()
    mem = {
        opt: profile_model(net, (1, 8, 8), optimizer=opt).train_memory_bytes
        for opt in ("sgd", "sgd-momentum")
    }
    adam = profile_model(net, (1, 8, 8)).train_memory_bytes
    assert (
        mem["sgd-momentum"] - mem["sgd"] == adam - mem["sgd-momentum"] == 2744
    )  # one param-sized state each
    small, large = (profile_model(net, (1, 8, 8), batch_size=b).train_memory_bytes for b in (8, 32))
    assert large - small == 2048 * (32 - 8)
    frozen = tiny_net().requires_grad_(False)
    assert profile_model(frozen, (1, 8, 8)).train_memory_bytes == 2744  # no grads, no state, nothing saved


@pytest.mark.parametrize(
    "text",
    [
        "C32k3-P-C64k5-P-F128-F10",
        "C8k3-Pavg-C16k7-C16k1-P-F50-F20-F10",
        "C4k5-C4k1-F10",
        "C128k3-P-P-P-P-F10",
    ],
)
def test_flops_equal_the_analytic_chain_cost(text: str) -> None:
    spec = ChainSpec.parse(text)
    shape = (1, 28, 28) if "C128" not in text else (3, 32, 32)
    model = build_model(spec, shape, 10)
    flops, params = spec.cost(shape)
    mp = profile_model(model, shape, batch_size=4)
    assert (mp.flops, mp.params) == (flops, params)
    # Training memory at least holds the model state: params + grads + Adam moments (+ BN buffers).
    assert mp.train_memory_bytes > 4 * mp.param_bytes
    assert mp.param_bytes < mp.inference_memory_bytes < mp.train_memory_bytes


def test_profiling_leaves_the_model_untouched() -> None:
    model = build_model("C8k3-P-C8k3-F32-F10", (1, 12, 12), 10)
    model.train()
    model.classifier.eval()  # mixed modes must come back as they were
    model.features[1].running_mean.fill_(0.25)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    modes = {name: m.training for name, m in model.named_modules()}
    rng = torch.get_rng_state()
    profile_model(model, (1, 12, 12), batch_size=16)
    count_flops(model, (1, 12, 12))
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in state.items())  # weights and BN stats
    assert {name: m.training for name, m in model.named_modules()} == modes
    assert all(not m._forward_hooks for m in model.modules())
    assert torch.equal(torch.get_rng_state(), rng)  # Dropout's draws did not advance the global RNG
    assert all(p.grad is None for p in model.parameters())


def test_profile_model_errors() -> None:
    net = tiny_net()
    with pytest.raises(ConfigError, match="optimizer must be one of"):
        profile_model(net, (1, 8, 8), optimizer="lion")
    with pytest.raises(ConfigError, match="batch_size must be a positive integer, got 0"):
        profile_model(net, (1, 8, 8), batch_size=0)
    with pytest.raises(ConfigError, match=r"input_shape must be three positive integers \(C, H, W\)"):
        count_flops(net, (8, 8))
    with pytest.raises(SpecError, match=r"cannot run on inputs of shape \(1, 3, 8, 8\)"):
        count_flops(net, (3, 8, 8))
    assert net.training  # restored after the failure
    with pytest.raises(ConfigError, match="flops must be a non-negative integer"):
        ModelProfile(
            flops=-1, macs=0, params=0, param_bytes=0, train_memory_bytes=0, inference_memory_bytes=0
        )


def device(**budgets: float) -> DeviceProfile:
    values = {"memory_mb": 100.0, "gflops": 1.0, "max_flops": 10_000_000, "max_params": 100_000} | budgets
    return DeviceProfile(name="x", **values)  # type: ignore[arg-type]


def cost(params: int = 50_000, flops: int = 5_000_000, memory: int = 50 * 2**20) -> ModelProfile:
    return ModelProfile(
        flops=flops,
        macs=flops // 2,
        params=params,
        param_bytes=4 * params,
        train_memory_bytes=memory,
        inference_memory_bytes=memory // 10,
    )


def test_fits_names_the_first_exceeded_budget() -> None:
    assert fits(cost(), device()) is None
    assert (
        fits(cost(params=100_000, flops=10_000_000, memory=100 * 2**20), device()) is None
    )  # limits inclusive
    assert (
        fits(cost(flops=21_300_000), device())
        == "flops 21.3 MFLOP exceeds max_flops 10.0 MFLOP of profile 'x'"
    )
    assert fits(cost(params=454_506), device()) == "params 454.5 k exceeds max_params 100.0 k of profile 'x'"
    # Params are checked first, then flops, then memory.
    assert fits(cost(params=200_000, flops=50_000_000, memory=2**30), device()).startswith("params 200.0 k")
    assert fits(cost(flops=50_000_000, memory=2**30), device()).startswith("flops 50.0 MFLOP")
    assert fits(cost(memory=150 * 2**20), device()) == (
        "train memory 150.0 MB exceeds memory_mb 100.0 MB of profile 'x'"
    )
    # Just over a budget still prints two different numbers.
    assert fits(cost(flops=10_000_001), device()) == (
        "flops 10.000001 MFLOP exceeds max_flops 10.000000 MFLOP of profile 'x'"
    )


def test_measure_device() -> None:
    rng = torch.get_rng_state()
    profile = measure_device(name="here", seconds=0.2, role="cvae")
    assert torch.equal(torch.get_rng_state(), rng)
    assert (profile.name, profile.role, profile.time_budget_s) == ("here", "cvae", 1800.0)
    assert profile.gflops > 0 and profile.cores >= 1 and profile.memory_mb > 0
    assert "conv3x3" in profile.gflops_source and "matmul" in profile.gflops_source
    # The documented rule: one image in LATENCY_MS at the measured rate; params capped by max_flops / 2.
    assert profile.max_flops == pytest.approx(profile.gflops * 1e6 * LATENCY_MS, rel=1e-3)
    assert profile.latency_ms == pytest.approx(LATENCY_MS, rel=1e-3)
    assert 1 <= profile.max_params <= profile.max_flops / 2
    with pytest.raises(ConfigError, match="seconds must be a positive number"):
        measure_device(seconds=0)
    with pytest.raises(ConfigError, match="role must be one of"):
        measure_device(seconds=0.1, role="server")


def test_train_seconds_and_the_time_budget() -> None:
    profile = device(gflops=2.0, time_budget_s=100.0)
    assert train_seconds(1_000_000, 1000, 10, profile) == pytest.approx(3 * 1e6 * 1000 * 10 / 2e9)  # float64
    assert trains_in_time(1_000_000, 1000, 10, profile) is None  # 15 s of a 50 s share
    message = trains_in_time(10_000_000, 1000, 10, profile)  # 150 s
    assert message is not None and "150 s" in message and "time_budget_s" in message


def test_free_cores_counts_mostly_idle_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    import edge_sdk.profiling as profiling

    readings = iter([{0: (0, 0), 1: (0, 0)}, {0: (95, 100), 1: (10, 100)}])
    monkeypatch.setattr(profiling, "_core_times", lambda: next(readings))
    monkeypatch.setattr(profiling.os, "sched_getaffinity", lambda pid: {0, 1})
    assert profiling.free_cores(0.0) == 1  # core 0 was 95 % busy
    readings = iter([{0: (0, 0), 1: (0, 0)}, {0: (90, 100), 1: (80, 100)}])
    assert profiling.free_cores(0.0) == 1  # never fewer than one
    readings = iter([{}, {}])
    assert profiling.free_cores(0.0) == 2  # /proc/stat unreadable: the affinity


def test_usable_threads() -> None:
    assert usable_threads(3) == 3
    assert 1 <= usable_threads() <= torch.get_num_threads()
    for bad in (0, True, 1.5):
        with pytest.raises(ConfigError, match="threads"):
            usable_threads(bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("spec", ["C16k3-P-C32k5-P-F64-F10", "C8k1-Pavg-C24k7-F10"])
def test_activations_extrapolated_from_two_small_batches_equal_the_full_batch(spec: str) -> None:
    # the screen measures batches 2 and 4 and extrapolates; BatchNorm's per-channel statistics are the
    # part that does not grow with the batch, so a mistake there shows as a difference here
    model = build_model(spec, (1, 16, 16), 10)
    for batch in (5, 64):
        direct = _saved_activation_bytes(model, _example(model, (1, 16, 16), batch))
        assert _activations_at(model, (1, 16, 16), batch) == direct
