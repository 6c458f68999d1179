"""Algorithm 4: consensus soft labels, label-count weighting, KD into the student."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from edge_sdk.arch import build_model
from profiles.errors import ConfigError
from server_kit.distill import DistillConfig, consensus, distill, label_count_weights

SHAPE = (1, 8, 8)
L = 3


def model(spec: str, seed: int) -> nn.Module:
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return build_model(spec, SHAPE, L).eval()


def teachers() -> list[nn.Module]:
    return [model("C4k3-P-F3", 0), model("C6k5-P-F8-F3", 1), model("C4k3-C4k3-P-F3", 2)]


def images(n: int, seed: int = 0) -> torch.Tensor:
    return torch.rand((n, *SHAPE), generator=torch.Generator().manual_seed(seed))


# ----------------------------------------------------------------------------------------- consensus


def test_consensus_is_the_mean_of_teacher_probabilities():
    ts, x = teachers(), images(37)
    with torch.no_grad():
        manual = sum(F.softmax(t(x) / 4.0, dim=1) for t in ts) / 3  # 37 x 3
    got = consensus(ts, x, tau=4.0, batch_size=10)  # several batches, one partial
    torch.testing.assert_close(got, manual, atol=1e-6, rtol=0)
    torch.testing.assert_close(got.sum(1), torch.ones(37))


def test_consensus_temperature_softens():
    ts, x = teachers(), images(20)
    sharp = consensus(ts, x, tau=1.0).max(1).values.mean()
    soft = consensus(ts, x, tau=20.0).max(1).values.mean()
    assert soft < sharp


def test_label_count_weights():
    w = label_count_weights([[10, 0, 0], [30, 5, 0]])
    expected = torch.tensor([[0.25, 0.0, 0.5], [0.75, 1.0, 0.5]])  # no one has class 2: uniform
    torch.testing.assert_close(w, expected)
    with pytest.raises(ConfigError, match=">= 0"):
        label_count_weights([[1, -1, 0]])


class ConstantLogits(nn.Module):
    def __init__(self, logits: list[float]) -> None:
        super().__init__()
        self.register_buffer("logits", torch.tensor(logits))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.logits.expand(x.shape[0], -1)


def test_label_weighted_consensus_ignores_a_teacher_for_classes_it_never_saw():
    # teacher 0 is sure of class 1 but has no examples of it; teachers 1 and 2 are uniform
    ts = [ConstantLogits([0.0, 10.0, 0.0]), ConstantLogits([0.0] * 3), ConstantLogits([0.0] * 3)]
    w = label_count_weights([[5, 0, 5], [5, 5, 5], [5, 5, 5]])
    x = images(4)
    a = 1.0 / (2.0 + torch.e**10)  # teacher 0's probability of classes 0 and 2
    raw = torch.tensor([(a + 2 / 3) / 3, 0.5 / 3 + 0.5 / 3, (a + 2 / 3) / 3])  # class 1: teachers 1, 2 only
    torch.testing.assert_close(consensus(ts, x, tau=1.0, class_weights=w), (raw / raw.sum()).expand(4, -1))
    # unweighted, teacher 0's confident vote for class 1 counts fully
    mean = torch.tensor([(a + 2 / 3) / 3, (1 - 2 * a + 2 / 3) / 3, (a + 2 / 3) / 3])
    torch.testing.assert_close(consensus(ts, x, tau=1.0), mean.expand(4, -1))


def test_consensus_validation():
    ts, x = teachers(), images(4)
    with pytest.raises(ConfigError, match="at least one teacher"):
        consensus([], x, tau=1.0)
    with pytest.raises(ConfigError, match="rows"):
        consensus(ts, x, tau=1.0, class_weights=torch.ones(2, L))
    with pytest.raises(ConfigError, match="classes"):
        consensus([*ts, build_model("C4k3-P-F4", SHAPE, 4)], x, tau=1.0)


# ----------------------------------------------------------------------------------------- distill


def _kd_loss(student: nn.Module, x: torch.Tensor, targets: torch.Tensor, tau: float) -> float:
    student.eval()
    with torch.no_grad():
        log_q = F.log_softmax(student(x) / tau, dim=1)
        return float((targets * (targets.clamp_min(1e-12).log() - log_q)).sum(1).mean() * tau * tau)


def test_distill_reduces_the_kl_to_the_consensus():
    x = images(128, seed=1)
    targets = consensus(teachers(), x, tau=4.0)
    student = model("C8k3-P-F16-F3", seed=5)
    before = _kd_loss(student, x, targets, 4.0)
    history = distill(student, x, targets, config=DistillConfig(epochs=15, batch_size=32, lr=3e-3), seed=0)
    assert len(history) == 15
    assert history[-1] < history[0]
    assert _kd_loss(student, x, targets, 4.0) < 0.5 * before
    assert not student.training


def test_hard_labels_use_cross_entropy():
    x = images(96, seed=2)
    y = torch.arange(96) % L
    student = model("C8k3-P-F16-F3", seed=5)
    student.eval()
    with torch.no_grad():
        ce_before = float(F.cross_entropy(student(x), y))
    cfg = DistillConfig(epochs=20, batch_size=32, lr=3e-3, hard_labels=True)
    history = distill(student, x, y, config=cfg, seed=0)
    with torch.no_grad():
        ce_after = float(F.cross_entropy(student(x), y))
    assert ce_after < ce_before and history[-1] < history[0]
    # the first epoch's mean is a CE value (≈ ln 3 for a fresh student), not a tau^2-scaled KL
    assert abs(history[0] - ce_before) < 0.5


def test_distill_is_deterministic_and_leaves_global_rng_alone():
    x = images(64, seed=3)
    targets = consensus(teachers(), x, tau=4.0)
    cfg = DistillConfig(epochs=2, batch_size=16)
    state = torch.get_rng_state()
    a, b, c = (model("C8k3-P-F16-F3", seed=5) for _ in range(3))
    distill(a, x, targets, config=cfg, seed=7)
    distill(b, x, targets, config=cfg, seed=7)
    distill(c, x, targets, config=cfg, seed=8)
    assert torch.equal(torch.get_rng_state(), state)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert any(not torch.equal(sa[k], sc[k]) for k in sa)


def test_distill_validation():
    x = images(8)
    student = model("C4k3-P-F3", 0)
    soft = torch.full((8, L), 1.0 / L)
    with pytest.raises(ConfigError, match="class indices"):
        distill(student, x, soft, config=DistillConfig(epochs=1, hard_labels=True), seed=0)
    with pytest.raises(ConfigError, match="soft distillation"):
        distill(student, x, torch.zeros(8, dtype=torch.int64), config=DistillConfig(epochs=1), seed=0)
    with pytest.raises(ConfigError, match="targets"):
        distill(student, x, soft[:5], config=DistillConfig(epochs=1), seed=0)


@pytest.mark.parametrize(
    ("overrides", "match"),
    [({"epochs": 0}, "epochs"), ({"batch_size": 0}, "batch_size"), ({"lr": -1.0}, "lr"), ({"tau": 0}, "tau")],
)
def test_distill_config_validation(overrides, match):
    with pytest.raises(ConfigError, match=match):
        DistillConfig(**{"epochs": 1, **overrides})
