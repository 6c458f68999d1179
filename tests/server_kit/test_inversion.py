"""Algorithm 3: class similarity, Dirichlet targets, inversion, resume."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from common.errors import ConfigError
from edge_sdk.models.arch import build_model
from server_kit.synthesis.inversion import (
    CONCENTRATION_EPS,
    InversionConfig,
    class_similarity,
    dirichlet_targets,
    invert_teacher,
    synthesize_inversion,
    teacher_seed,
)
from server_kit.synthesis.leaves import dead_leaves

SHAPE = (1, 8, 8)
L = 3


def tiny_teacher(spec: str = "C4k3-P-F3", seed: int = 0) -> nn.Module:
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = build_model(spec, SHAPE, L)
    # give the BN layers non-trivial running statistics, as a trained teacher has
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.uniform_(-0.5, 0.5)
                m.running_var.uniform_(0.5, 2.0)
    return model.eval()


def config(**overrides) -> InversionConfig:
    base = dict(samples_per_teacher=14, steps=5, batch_size=8, lr=0.1, tau=2.0)
    return InversionConfig(**{**base, **overrides})


# ----------------------------------------------------------------------------------------- similarity


def test_class_similarity_is_cosine():
    w = torch.tensor([[1.0, 0.0], [1.0, 1.0], [-2.0, 0.0]])
    sim = class_similarity(w)
    expected = torch.tensor([[1.0, 2**-0.5, -1.0], [2**-0.5, 1.0, -(2**-0.5)], [-1.0, -(2**-0.5), 1.0]])
    torch.testing.assert_close(sim, expected)  # 2-term dot products and norms: the float32 defaults
    torch.testing.assert_close(sim, sim.T)
    torch.testing.assert_close(sim.diagonal(), torch.ones(3))


def test_class_similarity_rejects_bad_shapes():
    with pytest.raises(ConfigError, match="L x d"):
        class_similarity(torch.ones(5))
    with pytest.raises(ConfigError, match="L >= 2"):
        class_similarity(torch.ones(1, 4))


def test_dirichlet_targets_follow_the_similarity_row():
    row = torch.tensor([1.0, 0.5, 0.0, -0.5, -1.0])  # min-max -> [1, .75, .5, .25, eps]
    gen = torch.Generator().manual_seed(0)
    samples = dirichlet_targets(row, 1.0, 40_000, gen)
    assert samples.shape == (40_000, 5) and samples.dtype == torch.float32
    torch.testing.assert_close(samples.sum(1), torch.ones(40_000))  # normalised rows: ulps of 1
    alpha = torch.tensor([1.0, 0.75, 0.5, 0.25, CONCENTRATION_EPS])
    # the mean of Dir(beta * a) is a / sum(a), independently of beta; a component's sd is at most 0.5, so
    # the sd of a 40k-sample mean is below 0.0025: 0.01 is four of them (the seeded draw is kernel-free)
    torch.testing.assert_close(samples.mean(0), alpha / alpha.sum(), atol=0.01, rtol=0)


def test_smaller_beta_gives_peakier_targets():
    row = torch.tensor([1.0, 0.8, 0.6, 0.4])
    gen = torch.Generator().manual_seed(1)
    peaky = dirichlet_targets(row, 0.1, 5000, gen).max(1).values.mean()
    smooth = dirichlet_targets(row, 1.0, 5000, gen).max(1).values.mean()
    assert peaky > smooth + 0.2  # seeded draws of 5000: the means' sd is below 0.01


def test_dirichlet_targets_are_seeded():
    row = torch.tensor([1.0, 0.2, -0.3])
    a = dirichlet_targets(row, 0.1, 10, torch.Generator().manual_seed(7))
    b = dirichlet_targets(row, 0.1, 10, torch.Generator().manual_seed(7))
    c = dirichlet_targets(row, 0.1, 10, torch.Generator().manual_seed(8))
    assert torch.equal(a, b) and not torch.equal(a, c)


# ----------------------------------------------------------------------------------------- config


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"samples_per_teacher": 0}, "samples_per_teacher"),
        ({"steps": -1}, "steps"),
        ({"batch_size": 1.5}, "batch_size"),
        ({"lr": 0}, "lr"),
        ({"tau": float("nan")}, "tau"),
        ({"betas": ()}, "betas"),
        ({"betas": (0.1, -1.0)}, "beta"),
        ({"bn_weight": -0.1}, "bn_weight"),
        ({"jitter": 0.5}, "jitter"),
        ({"jitter": -0.1}, "jitter"),
        ({"flip": 1}, "flip"),
    ],
)
def test_config_validation(overrides, match):
    with pytest.raises(ConfigError, match=match):
        config(**overrides)


def test_presets():
    fast = InversionConfig.preset("fast")
    paper = InversionConfig.preset("paper")
    assert paper.samples_per_teacher == 4000 and paper.betas == (0.1, 1.0)
    assert fast.samples_per_teacher * fast.steps < paper.samples_per_teacher * paper.steps
    assert InversionConfig.preset("fast", steps=3).steps == 3
    with pytest.raises(ConfigError, match="unknown inversion preset"):
        InversionConfig.preset("nope")
    with pytest.raises(ConfigError, match="unknown inversion options"):
        InversionConfig.preset("fast", stepz=3)


# ----------------------------------------------------------------------------------------- inversion


def test_invert_teacher_shapes_range_and_counts():
    teacher = tiny_teacher()
    cfg = config(samples_per_teacher=14)  # 14 = 6 groups * 2 + 2: the first two groups get one more
    x, cls = invert_teacher(teacher, num_classes=L, input_shape=SHAPE, config=cfg, seed=0)
    assert x.shape == (14, *SHAPE) and x.dtype == torch.float32
    assert cls.dtype == torch.int64
    assert float(x.min()) >= 0.0 and float(x.max()) <= 1.0
    # class 0 holds groups (0, beta 0) and (0, beta 1), both of which got the remainder
    assert torch.bincount(cls, minlength=L).tolist() == [6, 4, 4]


def test_invert_teacher_restores_module_flags():
    teacher = tiny_teacher()
    teacher.train()
    invert_teacher(teacher, num_classes=L, input_shape=SHAPE, config=config(steps=1), seed=0)
    assert teacher.training
    assert all(p.requires_grad for p in teacher.parameters())
    assert all(p.grad is None for p in teacher.parameters())


@torch.no_grad()
def _target_agreement(teacher: nn.Module, x: torch.Tensor, cls: torch.Tensor) -> float:
    return float((teacher(x).argmax(1) == cls).float().mean())


@pytest.mark.parametrize(
    "regularisers",
    [{}, {"bn_weight": 0.1, "tv_weight": 0.01, "l2_weight": 0.01}, {"jitter": 0.125, "flip": True}],
)
def test_inversion_makes_the_teacher_agree_with_the_target(regularisers):
    teacher = tiny_teacher("C8k3-P-F3", seed=1)
    d = teacher.head.weight.shape[1]
    with torch.no_grad():  # head rows at 120 degrees: similarity rows [1, eps, eps] -> ~one-hot targets
        q = torch.linalg.qr(torch.randn(d, L, generator=torch.Generator().manual_seed(0)))[0].T  # L x d
        teacher.head.weight.copy_(3.0 * (torch.eye(L) - 1.0 / L) @ q)
    base = dict(samples_per_teacher=60, batch_size=60, tau=1.0, betas=(0.1,), **regularisers)
    at_init = config(**base, steps=1, lr=1e-9)  # one negligible step: the noise images themselves
    x0, cls0 = invert_teacher(teacher, num_classes=L, input_shape=SHAPE, config=at_init, seed=5)
    x1, cls1 = invert_teacher(
        teacher, num_classes=L, input_shape=SHAPE, config=config(**base, steps=80), seed=5
    )
    assert torch.equal(cls0, cls1)
    before, after = _target_agreement(teacher, x0, cls0), _target_agreement(teacher, x1, cls1)
    # before is chance on noise (~1/3; it moves by a few of the 60 samples between instruction sets, whose
    # convolutions round differently); after reaches every target on AVX-512, AVX2 and SSE4.1 kernels alike
    assert after >= 0.9 and after > before + 0.3
    with torch.no_grad():
        assert F.cross_entropy(teacher(x1), cls1) < F.cross_entropy(teacher(x0), cls0)


def test_bn_hooks_are_removed():
    teacher = tiny_teacher()
    invert_teacher(teacher, num_classes=L, input_shape=SHAPE, config=config(steps=2, bn_weight=1.0), seed=0)
    assert all(not m._forward_hooks for m in teacher.modules())


def test_inversion_is_seeded():
    teacher = tiny_teacher()
    a = invert_teacher(teacher, num_classes=L, input_shape=SHAPE, config=config(), seed=1)[0]
    b = invert_teacher(teacher, num_classes=L, input_shape=SHAPE, config=config(), seed=1)[0]
    c = invert_teacher(teacher, num_classes=L, input_shape=SHAPE, config=config(), seed=2)[0]
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_image_priors_are_seeded_and_off_by_default():
    """The jitter and flip draws come from the chunk's own stream: same seed, same images; and with both
    off the stream (and so every image) is the one a run before these priors made."""
    teacher = tiny_teacher()
    moved = config(jitter=0.25, flip=True)
    a = invert_teacher(teacher, num_classes=L, input_shape=SHAPE, config=moved, seed=1)[0]
    b = invert_teacher(teacher, num_classes=L, input_shape=SHAPE, config=moved, seed=1)[0]
    plain = invert_teacher(teacher, num_classes=L, input_shape=SHAPE, config=config(), seed=1)[0]
    assert torch.equal(a, b) and not torch.equal(a, plain)
    assert "jitter" not in config().to_dict() and config(flip=True).to_dict()["flip"] is True


def test_wrong_head_size_is_refused():
    with pytest.raises(ConfigError, match="classes"):
        invert_teacher(tiny_teacher(), num_classes=4, input_shape=SHAPE, config=config(), seed=0)


# --------------------------------------------------------------------------------- synthesize + resume


def _teachers() -> list[nn.Module]:
    return [tiny_teacher("C4k3-P-F3", 0), tiny_teacher("C6k5-P-F8-F3", 1), tiny_teacher("C4k3-C4k3-P-F3", 2)]


def test_synthesize_concatenates_teachers_and_matches_invert_teacher():
    teachers = _teachers()
    cfg = config()
    syn = synthesize_inversion(teachers, num_classes=L, input_shape=SHAPE, config=cfg, seed=4)
    assert len(syn) == 3 * 14 and syn.x.shape == (42, *SHAPE)
    assert syn.teacher.tolist() == [0] * 14 + [1] * 14 + [2] * 14
    x1, c1 = invert_teacher(
        teachers[1], num_classes=L, input_shape=SHAPE, config=cfg, seed=teacher_seed(4, 1)
    )
    # the same seeded optimisation with the same chunking: bitwise on any CPU
    assert torch.equal(syn.x[14:28], x1) and torch.equal(syn.target_class[14:28], c1)


def test_resume_reproduces_the_uninterrupted_run(tmp_path):
    teachers = _teachers()
    cfg = config()  # 14 samples in chunks of 8 -> 2 chunks per teacher
    plain = synthesize_inversion(teachers, num_classes=L, input_shape=SHAPE, config=cfg, seed=9)
    work = tmp_path / "syn"
    first = synthesize_inversion(
        teachers, num_classes=L, input_shape=SHAPE, config=cfg, seed=9, work_dir=work
    )
    chunks = sorted(work.glob("teacher_*_chunk_*.npz"))
    assert len(chunks) == 6
    manifest = json.loads((work / "config.json").read_text())
    assert (
        manifest["seed"] == 9 and manifest["config"]["steps"] == cfg.steps and len(manifest["teachers"]) == 3
    )
    (work / "teacher_001_chunk_0001.npz").unlink()  # "killed" before this chunk was written
    stamp = chunks[0].stat().st_mtime_ns
    resumed = synthesize_inversion(
        teachers, num_classes=L, input_shape=SHAPE, config=cfg, seed=9, work_dir=work
    )
    assert chunks[0].stat().st_mtime_ns == stamp  # finished chunks are reused, not rewritten
    for a, b in ((plain, first), (first, resumed)):  # every chunk is recomputed on the same path: bitwise
        assert torch.equal(a.x, b.x)
        assert torch.equal(a.teacher, b.teacher)
        assert torch.equal(a.target_class, b.target_class)


def test_resume_refuses_a_different_run(tmp_path):
    teachers = _teachers()
    work = tmp_path / "syn"
    synthesize_inversion(teachers, num_classes=L, input_shape=SHAPE, config=config(), seed=0, work_dir=work)
    with pytest.raises(ConfigError, match="steps"):
        synthesize_inversion(
            teachers, num_classes=L, input_shape=SHAPE, config=config(steps=6), seed=0, work_dir=work
        )
    with pytest.raises(ConfigError, match="seed"):
        synthesize_inversion(
            teachers, num_classes=L, input_shape=SHAPE, config=config(), seed=1, work_dir=work
        )
    other = [*teachers[:2], tiny_teacher("C4k3-C4k3-P-F3", 99)]
    with pytest.raises(ConfigError, match="teachers"):
        synthesize_inversion(other, num_classes=L, input_shape=SHAPE, config=config(), seed=0, work_dir=work)


def test_dead_leaves_are_seeded_pictures_of_flat_regions():
    gen = lambda: torch.Generator().manual_seed(3)  # noqa: E731
    a, b = dead_leaves(6, (3, 16, 16), gen()), dead_leaves(6, (3, 16, 16), gen())
    assert torch.equal(a, b) and a.shape == (6, 3, 16, 16) and a.dtype == torch.float32
    assert float(a.min()) >= 0 and float(a.max()) <= 1
    # occluding shapes: most neighbouring pixels are equal (noise has none equal), and the images differ
    assert float((a[..., 1:] == a[..., :-1]).float().mean()) > 0.5
    assert not torch.equal(a[0], a[1])
    assert dead_leaves(0, (1, 4, 4), gen()).shape == (0, 1, 4, 4)
    with pytest.raises(ConfigError, match="positive"):
        dead_leaves(2, (3, 0, 4), gen())


def test_color_inversion_starts_from_dead_leaves_and_grayscale_from_noise():
    color, gray = (3, 8, 8), (1, 8, 8)
    assert InversionConfig.preset().for_images(color).start == "leaves"
    assert InversionConfig.preset().for_images(gray).start == "noise"
    assert InversionConfig.preset(start="noise").for_images(color).start == "noise"
    # a record of before the field matches on resume: noise is left out, leaves recorded
    assert "start" not in config(start="noise").to_dict()
    assert config(start="leaves").to_dict()["start"] == "leaves"
    with pytest.raises(ConfigError, match="start must be one of"):
        config(start="fractal")
    with torch.random.fork_rng():
        torch.manual_seed(0)
        teacher = build_model("C4k3-P-F3", color, L).eval()
    # one tiny step: the images are still the pictures they started from (flat regions kept)
    step = config(steps=1, lr=1e-4, start="leaves", jitter=0.0, flip=False)
    x = invert_teacher(teacher, num_classes=L, input_shape=color, config=step, seed=1)[0]
    assert float((x[..., 1:] - x[..., :-1]).abs().lt(1e-2).float().mean()) > 0.5
    noisy = dataclasses.replace(step, start="noise")
    noise = invert_teacher(teacher, num_classes=L, input_shape=color, config=noisy, seed=1)[0]
    assert float((noise[..., 1:] - noise[..., :-1]).abs().lt(1e-2).float().mean()) < 0.1
