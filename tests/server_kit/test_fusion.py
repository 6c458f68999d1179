"""FedMHO fusion: the CE / MD / SD losses, teacher probabilities, the training loop and its config."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from common.errors import ConfigError, DataError
from edge_sdk.models.arch import build_model
from server_kit.training.fusion import FusionConfig, conditioned_targets, fuse, fusion_loss, teacher_probs

SHAPE = (1, 4, 4)


def _logits(seed: int, n: int = 6, k: int = 4) -> torch.Tensor:
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed))


def test_ce_mode_and_md_with_lam_one_equal_cross_entropy() -> None:
    student, y = _logits(0), torch.tensor([0, 1, 2, 3, 0, 1])
    teacher = F.softmax(_logits(1), dim=1)
    ce = F.cross_entropy(student, y)
    # exact: the same op on the same tensor, and lam = 1 gives 1 * ce + 0 * kl, exact in IEEE arithmetic
    assert torch.equal(fusion_loss(student, y, mode="ce"), ce)
    for mode in ("md", "sd"):
        assert torch.equal(fusion_loss(student, y, mode=mode, teacher_probs=teacher, lam=1.0), ce)


def test_kl_term_is_batchmean_and_zero_for_identical_predictions() -> None:
    student, y = _logits(2), torch.tensor([3, 2, 1, 0, 3, 2])
    ce = F.cross_entropy(student, y)
    same = F.softmax(student, dim=1)
    # float32 defaults (rtol 1.3e-6, atol 1e-5) for a few ops on six O(1) rows; KL(p || p) is zero up to
    # log/softmax rounding (~1e-7 per term), hence abs 1e-6
    torch.testing.assert_close(fusion_loss(student, y, mode="md", teacher_probs=same, lam=0.3), 0.3 * ce)
    assert float(fusion_loss(student, y, mode="sd", teacher_probs=same, lam=0.0)) == pytest.approx(
        0.0, abs=1e-6
    )
    teacher = F.softmax(_logits(3), dim=1)
    q = F.softmax(student, dim=1)
    kl = (teacher * (teacher.log() - q.log())).sum() / len(y)  # per-sample KL, averaged over the batch
    # kl_div and this sum differ only in summation order over 24 terms: the float32 defaults hold
    torch.testing.assert_close(fusion_loss(student, y, mode="md", teacher_probs=teacher, lam=0.0), kl)
    torch.testing.assert_close(
        fusion_loss(student, y, mode="md", teacher_probs=teacher, lam=0.5), 0.5 * ce + 0.5 * kl
    )


def test_fusion_loss_validation() -> None:
    student, y = _logits(0), torch.zeros(6, dtype=torch.long)
    with pytest.raises(ConfigError, match="needs teacher_probs"):
        fusion_loss(student, y, mode="md")
    with pytest.raises(ConfigError, match="only used by the md and sd"):
        fusion_loss(student, y, mode="ce", teacher_probs=F.softmax(student, dim=1))
    with pytest.raises(ConfigError, match="lam"):
        fusion_loss(student, y, mode="sd", teacher_probs=F.softmax(student, dim=1), lam=1.5)
    with pytest.raises(ConfigError, match="shape"):
        fusion_loss(student, y, mode="sd", teacher_probs=torch.full((6, 3), 1 / 3))
    with pytest.raises(ConfigError, match="mode"):
        fusion_loss(student, y, mode="kd")


def test_teacher_probs_is_softmax_of_mean_logits() -> None:
    first, second = nn.Linear(16, 4), nn.Linear(16, 4)
    teachers = [nn.Sequential(nn.Flatten(), first).train(), nn.Sequential(nn.Flatten(), second).eval()]
    x = torch.rand(7, *SHAPE)
    flat = x.flatten(1)
    with torch.no_grad():
        expected = F.softmax((first(flat) + second(flat)) / 2, dim=1)
    # batches of 3 vs one batch of 7 may pick different GEMM kernels: 16-term dot products, float32 defaults
    torch.testing.assert_close(teacher_probs(teachers, x, batch_size=3), expected)
    assert teachers[0].training and not teachers[1].training  # flags restored


def _task(n: int = 48) -> tuple[torch.Tensor, torch.Tensor]:
    """Three separable classes: a bright pixel at position 0, 5 or 10 plus noise."""
    gen = torch.Generator().manual_seed(0)
    y = torch.arange(n) % 3
    x = torch.rand(n, *SHAPE, generator=gen) * 0.2
    x.view(n, -1)[torch.arange(n), y * 5] = 1.0
    return x, y


def _student(seed: int = 0) -> nn.Module:
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return build_model("C4k3-P-F8-F3", SHAPE, 3)


def test_fuse_lowers_the_loss_and_is_deterministic() -> None:
    x, y = _task()
    config = FusionConfig(mode="ce", epochs=6, lr=1e-2, batch_size=16)
    student = _student()
    losses = fuse(student, x, y, config=config, seed=1)
    assert len(losses) == 6 and losses[-1] < 0.7 * losses[0]
    again = _student()
    fuse(again, x, y, config=config, seed=1)
    for (key, a), b in zip(student.state_dict().items(), again.state_dict().values(), strict=True):
        assert torch.equal(a, b), key  # the same seeded path run twice: bitwise


def _trained(
    mode: str,
    *,
    lam: float = 0.5,
    teachers: list[nn.Module] | None = None,
    initial=None,
    teacher: str = "mean",
    **counts,
) -> nn.Module:
    x, y = _task()
    student = _student()
    config = FusionConfig(
        mode=mode, lam=lam, epochs=2, batch_size=16, teacher=teacher if mode != "ce" else "agreeing"
    )
    fuse(student, x, y, config=config, teachers=teachers, initial=initial, seed=0, **counts)
    return student


def _same(a: nn.Module, b: nn.Module) -> bool:
    """Bitwise equal weights: used only where both runs compute the same float ops in the same order."""
    return all(
        torch.equal(u, v) for u, v in zip(a.state_dict().values(), b.state_dict().values(), strict=True)
    )


def test_fuse_md_and_sd_use_their_teachers() -> None:
    ce = _trained("ce")
    assert _same(_trained("sd", lam=1.0), ce)  # lam = 1 leaves only the CE term
    assert _same(_trained("md", lam=1.0, teachers=[_student(5)]), ce)
    assert not _same(_trained("md", teachers=[_student(5)]), ce)
    assert not _same(_trained("md", teachers=[_student(5)]), _trained("md", teachers=[_student(6)]))
    # sd without `initial` distils from a frozen copy of the student as it was on entry (w_0).
    assert _same(_trained("sd"), _trained("sd", initial=_student()))
    assert not _same(_trained("sd"), _trained("sd", initial=_student(7)))
    x, y = _task()
    with pytest.raises(ConfigError, match="needs the classifier teachers"):
        fuse(_student(), x, y, config=FusionConfig(mode="md", epochs=1), seed=0)
    with pytest.raises(DataError, match="empty"):
        fuse(_student(), x[:0], y[:0], config=FusionConfig(mode="ce", epochs=1), seed=0)


def test_fusion_config() -> None:
    mnist = FusionConfig.preset("mnist")
    assert (mnist.epochs, mnist.lr, mnist.batch_size, mnist.lam, mnist.mode) == (10, 1e-5, 64, 0.5, "md")
    assert FusionConfig.preset("fashion-mnist", mode="sd").lr == 5e-4
    assert (FusionConfig.preset("emnist").epochs, FusionConfig.preset("svhn").lr) == (30, 5e-5)
    with pytest.raises(ConfigError, match="unknown fusion preset"):
        FusionConfig.preset("cifar100")
    with pytest.raises(ConfigError, match="unknown fusion options"):
        FusionConfig.preset("fast", tau=4)
    with pytest.raises(ConfigError, match="mode"):
        FusionConfig(mode="kd")
    with pytest.raises(ConfigError, match="lam"):
        FusionConfig(lam=-0.1)
    with pytest.raises(ConfigError, match="lr"):
        FusionConfig(lr=0)


def test_conditioned_targets_weigh_the_holders_of_each_class() -> None:
    p0 = torch.tensor([[0.7, 0.2, 0.1]] * 4)
    p1 = torch.tensor([[0.1, 0.1, 0.8]] * 4)
    y = torch.tensor([0, 1, 2, 2])
    # class 0: classifier 0 alone; class 1: the decoders alone; class 2: classifier 1 (3) and decoders (1)
    counts = [[5, 0, 0], [0, 0, 3]]
    target = conditioned_targets([p0, p1], y, counts, decoder_counts=[[0, 2, 1]])
    # a few float32 products and sums of probabilities: the float32 defaults
    torch.testing.assert_close(target[0], p0[0])
    torch.testing.assert_close(target[1], torch.tensor([0.0, 1.0, 0.0]))
    torch.testing.assert_close(target[2], 0.75 * p1[2] + 0.25 * torch.tensor([0.0, 0.0, 1.0]))
    torch.testing.assert_close(target.sum(dim=1), torch.ones(4))
    # agreement: classifier 0 gives class 0 a mean probability 0.7 on 0's samples, so it keeps 0.7 of its
    # share and the rest goes to the label; classifier 1 gives class 2 0.8
    agreed = conditioned_targets([p0, p1], y, counts, decoder_counts=[[0, 2, 1]], agreement=True)
    torch.testing.assert_close(agreed[0], 0.7 * p0[0] + 0.3 * torch.tensor([1.0, 0.0, 0.0]))
    torch.testing.assert_close(agreed[2], 0.75 * 0.8 * p1[2] + (1 - 0.6) * torch.tensor([0.0, 0.0, 1.0]))
    torch.testing.assert_close(agreed.sum(dim=1), torch.ones(4))
    # a class nobody claims is its one-hot label
    torch.testing.assert_close(
        conditioned_targets([p0[:1]], y[:1], [[0, 0, 0]])[0], torch.tensor([1.0, 0.0, 0.0])
    )
    with pytest.raises(ConfigError, match="rows"):
        conditioned_targets([p0, p1], y, [[1, 1, 1]])
    with pytest.raises(DataError, match="counts"):
        conditioned_targets([p0], y, [[-1, 0, 0]])


def test_fuse_with_the_conditioned_teacher() -> None:
    teachers = [_student(5)]
    # a teacher that holds none of the classes has weight 0: the target is the one-hot label and
    # lam CE + (1 - lam) KL(one-hot || p) is the CE loss
    ce = _trained("ce")
    blind = _trained("md", teachers=teachers, teacher="conditioned", label_counts=[[0, 0, 0]],
                     decoder_counts=[[4, 4, 4]])  # fmt: skip
    # lam CE + (1 - lam) KL(one-hot || p) equals CE in exact maths; in float32 the two losses differ by a
    # few ulps, which two epochs on this tiny student keep far below the float32 defaults
    for a, b in zip(ce.state_dict().values(), blind.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b)
    # a teacher holding every class alone is the mean teacher
    sole = _trained("md", teachers=teachers, teacher="conditioned", label_counts=[[4, 4, 4]])
    assert _same(sole, _trained("md", teachers=teachers))
    # agreeing: a random teacher recognises its classes only in part, so it teaches less than its share
    agreeing = _trained("md", teachers=teachers, teacher="agreeing", label_counts=[[4, 4, 4]])
    assert not _same(agreeing, sole)
    # sd: w_0 speaks for the classifiers' summed counts
    assert _same(
        _trained(
            "sd", teacher="conditioned", label_counts=[[4, 0, 1], [0, 4, 1]], decoder_counts=[[1, 1, 1]]
        ),
        _trained("sd", teacher="conditioned", label_counts=[[4, 4, 2]], decoder_counts=[[1, 1, 1]]),
    )
    x, y = _task()
    with pytest.raises(ConfigError, match="label_counts"):
        fuse(_student(), x, y, config=FusionConfig(mode="md", epochs=1), teachers=teachers, seed=0)
    with pytest.raises(ConfigError, match="no teacher"):
        FusionConfig(mode="ce", teacher="mean")
    with pytest.raises(ConfigError, match="teacher"):
        FusionConfig(teacher="vote")
    with pytest.raises(ConfigError, match="no teacher"):
        FusionConfig(mode="ce", teacher="conditioned")
