"""Conditional-generator synthesis: weighted CE, diversity, noise filter, training, sampling, ONNX."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from common.errors import ConfigError
from edge_sdk.models.arch import build_model
from export.onnx_export import onnx_session, read_metadata
from server_kit.synthesis.generator import (
    NO_TEACHER,
    ConditionalGenerator,
    GeneratorConfig,
    diversity_loss,
    export_generator,
    filter_noisy,
    gradient_noise_scores,
    label_weighted_ce,
    load_generator,
    sample_generator,
    synthesize_generator,
    train_generator,
)
from server_kit.teachers.counts import class_shares, held_classes

SHAPE = (1, 8, 8)
L = 3
COUNTS = [[6, 4, 0], [0, 3, 9]]  # teacher 0 never saw class 2, teacher 1 never saw class 0


def tiny_teacher(seed: int, spec: str = "C4k3-P-F3") -> nn.Module:
    with torch.random.fork_rng(), torch.no_grad():  # seeded, whatever ran before
        torch.manual_seed(seed)
        model = build_model(spec, SHAPE, L)
        for m in model.modules():  # non-trivial running statistics, as a trained teacher has
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.uniform_(-0.5, 0.5)
                m.running_var.uniform_(0.5, 2.0)
    return model.eval()


def config(**overrides) -> GeneratorConfig:
    base = dict(
        nz=8, width=4, steps=4, batch_size=12, lr=1e-2, ce_weight=1.0, div_weight=1.0, bn_weight=0.0,
        adv_weight=0.0, filter_fraction=0.0, samples=20, tau=4.0,
    )  # fmt: skip
    return GeneratorConfig(**{**base, **overrides})


def generator(seed: int = 0, shape: tuple[int, int, int] = SHAPE) -> ConditionalGenerator:
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return ConditionalGenerator(nz=8, num_classes=L, input_shape=shape, width=4)


# ----------------------------------------------------------------------------------------- config


def test_config_validation_and_presets():
    fast = GeneratorConfig.preset("fast")
    assert GeneratorConfig.preset("fast", steps=3).steps == 3
    assert fast.to_dict()["nz"] == fast.nz
    with pytest.raises(ConfigError, match="unknown generator preset"):
        GeneratorConfig.preset("slow")
    with pytest.raises(ConfigError, match="unknown generator options"):
        GeneratorConfig.preset("fast", stepz=3)
    with pytest.raises(ConfigError, match="steps must be an integer >= 1"):
        config(steps=0)
    with pytest.raises(ConfigError, match="batch_size must be an integer >= 2"):
        config(batch_size=1)
    with pytest.raises(ConfigError, match="lr must be a positive number"):
        config(lr=0.0)
    with pytest.raises(ConfigError, match="div_weight must be a number >= 0"):
        config(div_weight=-1.0)
    with pytest.raises(ConfigError, match=r"filter_fraction must be in \[0, 1\)"):
        config(filter_fraction=1.0)
    with pytest.raises(ConfigError, match="filter_during_training must be a bool"):
        config(filter_during_training=1)


# ----------------------------------------------------------------------------------------- losses


def test_label_weighted_ce_ignores_a_teacher_for_a_class_it_never_saw():
    weights = class_shares(COUNTS)  # class 0: (1, 0); class 1: (4/7, 3/7); class 2: (0, 1)
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn((2, 6, L), generator=gen, requires_grad=True)
    y = torch.tensor([0, 0, 1, 1, 2, 2])
    loss = label_weighted_ce(logits, y, weights)
    ce = F.cross_entropy(logits.permute(1, 2, 0), y.view(-1, 1).expand(-1, 2), reduction="none")  # N x K
    expected = (ce[:2, 0].sum() + (4 / 7 * ce[2:4, 0] + 3 / 7 * ce[2:4, 1]).sum() + ce[4:, 1].sum()) / 6
    torch.testing.assert_close(loss, expected)  # twelve O(1) terms summed in another order: float32 defaults
    loss.backward()
    # teacher 1 on the class-0 samples and teacher 0 on the class-2 samples get exactly no gradient (a
    # weight of exactly 0 times a finite gradient is 0 in IEEE arithmetic, whatever the kernel)
    assert torch.equal(logits.grad[1, :2], torch.zeros(2, L))
    assert torch.equal(logits.grad[0, 4:], torch.zeros(2, L))
    assert logits.grad[0, :4].abs().sum() > 0 and logits.grad[1, 2:].abs().sum() > 0


def test_label_weighted_ce_is_plain_ce_for_one_teacher_with_every_class():
    logits = torch.randn((1, 9, L), generator=torch.Generator().manual_seed(1))
    y = torch.tensor([0, 1, 2] * 3)
    loss = label_weighted_ce(logits, y, class_shares([[5, 1, 7]]))
    # weight 1 per sample, nine O(1) terms in another order: the float32 defaults
    torch.testing.assert_close(loss, F.cross_entropy(logits[0], y))


def test_masked_ce_ignores_a_teachers_logits_of_classes_it_never_saw():
    weights = class_shares(COUNTS)  # teacher 0 holds classes 0, 1; teacher 1 holds 1, 2
    held = held_classes(COUNTS)
    logits = torch.randn((2, 6, L), generator=torch.Generator().manual_seed(3), requires_grad=True)
    y = torch.tensor([0, 0, 1, 1, 2, 2])
    loss = label_weighted_ce(logits, y, weights, held)
    own = []  # teacher k's CE over its own classes; the index of y among them (clamped where not held)
    for k in range(2):
        index = torch.tensor([min(int(held[k][: int(c)].sum()), int(held[k].sum()) - 1) for c in y])
        own.append(F.cross_entropy(logits[k][:, held[k]], index, reduction="none"))
    expected = (own[0][:2].sum() + (4 / 7 * own[0][2:4] + 3 / 7 * own[1][2:4]).sum() + own[1][4:].sum()) / 6
    torch.testing.assert_close(loss, expected)  # as above: a reordered float32 sum of O(1) terms
    # unheld logits never enter the loss, so their gradient is exactly 0
    loss.backward()
    assert torch.equal(logits.grad[0, :, 2], torch.zeros(6))  # teacher 0's class-2 logit: no pull at all
    assert torch.equal(logits.grad[1, :, 0], torch.zeros(6))
    with pytest.raises(ConfigError, match="held must be 2 x 3"):
        label_weighted_ce(logits, y, weights, held.T)


def test_ensemble_ce_is_the_label_weighted_ensembles_cross_entropy():
    from server_kit.synthesis.generator import ensemble_ce

    weights = class_shares(COUNTS)  # teacher 1 never saw class 0, teacher 0 never saw class 2
    logits = torch.randn((2, 6, L), generator=torch.Generator().manual_seed(4))
    y = torch.tensor([0, 1, 2, 0, 1, 2])
    probs = F.softmax(logits, dim=2) * weights.unsqueeze(1)  # K x N x L
    ensemble = probs.sum(0) / probs.sum(0).sum(1, keepdim=True)
    # the same maths as log-sum-exp or as probabilities: a few float32 roundings, the float32 defaults
    torch.testing.assert_close(ensemble_ce(logits, y, weights), F.nll_loss(ensemble.log(), y))


def test_label_weighted_ce_rejects_bad_shapes():
    weights = class_shares(COUNTS)
    with pytest.raises(ConfigError, match="K x N x L"):
        label_weighted_ce(torch.zeros(4, L), torch.zeros(4, dtype=torch.int64), weights)
    with pytest.raises(ConfigError, match="int64 class indices"):
        label_weighted_ce(torch.zeros(2, 4, L), torch.zeros(4), weights)
    with pytest.raises(ConfigError, match="class_weights must be 2 x 3"):
        label_weighted_ce(torch.zeros(2, 4, L), torch.zeros(4, dtype=torch.int64), weights.T)


def test_diversity_loss_is_one_when_collapsed_and_falls_with_spread():
    gen = torch.Generator().manual_seed(2)
    z = torch.randn((6, 8), generator=gen)
    y = torch.tensor([0, 0, 0, 1, 1, 1])
    collapsed = torch.full((6, 1, 4, 4), 0.5)
    assert float(diversity_loss(collapsed, z, y)) == pytest.approx(1.0)  # exp(-0 / d_z) = 1 exactly
    spread = torch.rand((6, 1, 4, 4), generator=gen)
    assert float(diversity_loss(spread, z, y)) < float(diversity_loss(0.5 + 0.1 * (spread - 0.5), z, y)) < 1.0
    # the ratio form: image distance over noise distance, mean squared per element, same-label pairs only
    d_x = (spread[0] - spread[1]).square().mean()
    d_z = (z[0] - z[1]).square().mean()
    pair = diversity_loss(spread[:2], z[:2], torch.tensor([0, 0]))
    torch.testing.assert_close(pair, torch.exp(-d_x / d_z))  # 16- and 8-term means: float32 defaults
    assert float(diversity_loss(spread[:3], z[:3], torch.tensor([0, 1, 2]))) == 0.0  # no same-label pair


# ----------------------------------------------------------------------------------------- noise filter


def test_filter_drops_exactly_the_highest_fraction():
    scores = torch.tensor([0.5, 0.9, 0.1, 1.0, 0.0, 0.7, 0.3, 0.8, 0.2, 0.6])
    keep = filter_noisy(scores, 0.2)
    assert keep.dtype == torch.bool and int((~keep).sum()) == 2
    assert set((~keep).nonzero().flatten().tolist()) == {1, 3}  # the two highest scores
    keep = filter_noisy(scores, 0.35)  # floor(3.5) = 3 dropped
    assert set((~keep).nonzero().flatten().tolist()) == {1, 3, 7}
    assert bool(filter_noisy(scores, 0.0).all())
    assert bool(filter_noisy(scores, 0.09).all())  # floor(0.9) = 0
    ties = filter_noisy(torch.ones(5), 0.4)  # ties: dropped in index order
    assert ties.tolist() == [False, False, True, True, True]
    with pytest.raises(ConfigError, match="fraction must be in"):
        filter_noisy(scores, 1.0)
    with pytest.raises(ConfigError, match="1-D"):
        filter_noisy(scores.view(2, 5), 0.1)


def test_gradient_noise_scores_are_min_max_scaled_per_sample_gradient_norms():
    teachers = [tiny_teacher(0), tiny_teacher(1)]
    weights = class_shares(COUNTS)
    gen = torch.Generator().manual_seed(3)
    x = torch.rand((7, *SHAPE), generator=gen)
    y = torch.tensor([0, 1, 2, 1, 0, 2, 1])
    scores = gradient_noise_scores(teachers, x, y, weights, batch_size=3)
    raw = []
    for n in range(7):  # one sample at a time: the reference the batched computation must match
        xn = x[n : n + 1].clone().requires_grad_(True)
        loss = sum(weights[k, y[n]] * F.cross_entropy(t(xn), y[n : n + 1]) for k, t in enumerate(teachers))
        (grad,) = torch.autograd.grad(loss, xn)
        raw.append(float(grad.norm()))
    raw_t = torch.tensor(raw)
    expected = (raw_t - raw_t.min()) / (raw_t.max() - raw_t.min())
    # batched vs per-sample gradients sum in other orders (~1e-6 relative on each norm); min-max scaling
    # divides by the norms' spread, which can magnify that tenfold: rtol 1e-4 covers it
    torch.testing.assert_close(scores, expected, atol=1e-5, rtol=1e-4)
    # min-max scaling maps the smallest and largest norms to exactly 0 and 1
    assert float(scores.min()) == 0.0 and float(scores.max()) == 1.0
    assert all(p.requires_grad for t in teachers for p in t.parameters())  # the caller's flags restored
    assert all(p.grad is None for t in teachers for p in t.parameters())  # no gradient leaked into them


# ----------------------------------------------------------------------------------------- generator


@pytest.mark.parametrize("shape", [(1, 8, 8), (1, 28, 28), (3, 32, 32), (2, 30, 13)])
def test_generator_output_is_in_unit_range_with_the_teacher_shape(shape):
    g = generator(shape=shape).eval()
    z = torch.randn((5, 8), generator=torch.Generator().manual_seed(4)) * 10  # saturate on purpose
    y = torch.tensor([0, 1, 2, 0, 1])
    with torch.no_grad():
        x = g(z, y)
        assert x.shape == (5, *shape) and x.dtype == torch.float32
        assert float(x.min()) >= 0.0 and float(x.max()) <= 1.0
        # class index == one-hot row, bitwise: a one-hot row times a matrix adds exact zeros to one weight
        assert torch.equal(x, g(z, F.one_hot(y, L).float()))


def test_sample_generator_is_seeded_and_follows_the_pooled_counts():
    g = generator()
    pooled = [5, 0, 15]
    x1, y1 = sample_generator(g, pooled, n=200, seed=7, batch_size=64)
    x2, y2 = sample_generator(g, pooled, n=200, seed=7, batch_size=200)  # batching must not matter
    # labels come from the seeded RNG alone; images are sigmoid outputs in [0, 1] whose GEMM blocking can
    # change with the batch size: a few ulps of 1 (~1e-7), so atol 1e-6
    assert torch.equal(y1, y2) and torch.allclose(x1, x2, atol=1e-6)
    _, y3 = sample_generator(g, pooled, n=200, seed=8)
    assert not torch.equal(y1, y3)
    assert x1.shape == (200, *SHAPE) and y1.dtype == torch.int64
    assert int((y1 == 1).sum()) == 0  # a class nobody holds is never drawn
    assert 0.6 < float((y1 == 2).float().mean()) < 0.9  # 15 / 20 expected; 0.15 is five binomial sd at n=200
    assert g.training  # the caller's mode is restored
    with pytest.raises(ConfigError, match="classes, the generator"):
        sample_generator(g, [1, 2], n=4, seed=0)


# ----------------------------------------------------------------------------------------- training


def test_training_is_deterministic_and_restores_the_teachers():
    teachers = [tiny_teacher(0), tiny_teacher(1)]
    cfg = config(bn_weight=0.1, filter_fraction=0.25, filter_during_training=True)
    g1, losses1 = train_generator(teachers, COUNTS, input_shape=SHAPE, num_classes=L, config=cfg, seed=3)
    g2, losses2 = train_generator(teachers, COUNTS, input_shape=SHAPE, num_classes=L, config=cfg, seed=3)
    assert losses1 == losses2 and len(losses1) == cfg.steps  # the same seeded path twice: bitwise
    assert set(losses1[0]) == {"total", "ce", "div", "bn", "adv", "ens", "kept"}
    assert losses1[0]["bn"] > 0 and losses1[0]["kept"] == 9 / 12  # floor(0.25 * 12) = 3 dropped
    for (name, a), b in zip(g1.state_dict().items(), g2.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    _, losses3 = train_generator(teachers, COUNTS, input_shape=SHAPE, num_classes=L, config=cfg, seed=4)
    assert losses3 != losses1
    assert not g1.training
    for t in teachers:  # eval and requires_grad as they came, no gradient, no BN hook left behind
        assert not t.training and all(p.requires_grad and p.grad is None for p in t.parameters())
        assert all(not m._forward_hooks for m in t.modules())


def test_training_lowers_the_weighted_ce():
    teachers = [tiny_teacher(0), tiny_teacher(1)]
    cfg = config(steps=40, batch_size=24, lr=2e-2, div_weight=0.0)
    _, losses = train_generator(teachers, COUNTS, input_shape=SHAPE, num_classes=L, config=cfg, seed=0)
    first = sum(step["ce"] for step in losses[:5]) / 5
    last = sum(step["ce"] for step in losses[-5:]) / 5
    # measured ~0.5-0.55 over seeds 0-3: a summation-order change moves it by far less than the 0.15 margin
    assert last < 0.7 * first, (first, last)
    assert all(step["div"] == 0.0 and step["adv"] == 0.0 for step in losses)


def test_adversarial_term_needs_a_student_and_leaves_it_untouched():
    teachers = [tiny_teacher(0), tiny_teacher(1)]
    cfg = config(adv_weight=1.0)
    _, without = train_generator(teachers, COUNTS, input_shape=SHAPE, num_classes=L, config=cfg, seed=0)
    assert all(step["adv"] == 0.0 for step in without)
    student = tiny_teacher(1).train()  # the weights of the teacher that dominates the ensemble: they agree
    before = {k: v.clone() for k, v in student.state_dict().items()}
    _, with_student = train_generator(
        teachers, COUNTS, input_shape=SHAPE, num_classes=L, config=cfg, seed=0, student=student
    )
    assert any(step["adv"] < 0 for step in with_student)  # -KL on agreeing samples
    assert all(torch.equal(before[k], v) for k, v in student.state_dict().items())  # untouched: bitwise
    assert student.training and all(p.requires_grad for p in student.parameters())


def test_train_generator_rejects_mismatched_label_counts():
    teachers = [tiny_teacher(0), tiny_teacher(1)]
    with pytest.raises(ConfigError, match="one per teacher"):
        train_generator(teachers, COUNTS[:1], input_shape=SHAPE, num_classes=L, config=config(), seed=0)
    with pytest.raises(ConfigError, match="at least one example"):
        train_generator(teachers, [[0] * L] * 2, input_shape=SHAPE, num_classes=L, config=config(), seed=0)


# ----------------------------------------------------------------------------------------- synthesis + ONNX


def test_synthesize_filters_and_saves_a_generator_that_reloads_identically(tmp_path):
    teachers = [tiny_teacher(0), tiny_teacher(1)]
    cfg = config(samples=30, filter_fraction=0.2)
    syn, g, _ = synthesize_generator(
        teachers, COUNTS, input_shape=SHAPE, num_classes=L, config=cfg, seed=1, work_dir=tmp_path
    )
    assert len(syn) == 30 - math.floor(0.2 * 30)
    assert syn.x.shape == (24, *SHAPE) and float(syn.x.min()) >= 0 and float(syn.x.max()) <= 1
    assert bool((syn.teacher == NO_TEACHER).all())
    again, _, _ = synthesize_generator(teachers, COUNTS, input_shape=SHAPE, num_classes=L, config=cfg, seed=1)
    assert torch.equal(syn.x, again.x) and torch.equal(syn.target_class, again.target_class)  # same path

    record = json.loads((tmp_path / "generator.json").read_text())
    assert record["seed"] == 1 and record["config"] == cfg.to_dict() and len(record["losses"]) == cfg.steps
    model_bytes = (tmp_path / "generator.onnx").read_bytes()
    meta = read_metadata(model_bytes)
    assert meta["role"] == "generator" and json.loads(meta["output_shape"]) == list(SHAPE)
    reloaded = load_generator(model_bytes)
    pooled = [sum(col) for col in zip(*COUNTS, strict=True)]
    x1, y1 = sample_generator(g, pooled, n=16, seed=9)
    x2, y2 = sample_generator(reloaded, pooled, n=16, seed=9)
    assert torch.equal(y1, y2) and torch.equal(x1, x2)  # rebuilt from config + initializers: exact

    session = onnx_session(model_bytes)
    assert [i.name for i in session.get_inputs()] == ["z", "y"]
    z = torch.randn((5, 8), generator=torch.Generator().manual_seed(0))
    y = F.one_hot(torch.tensor([0, 1, 2, 2, 1]), L).float()
    got = session.run(None, {"z": z.numpy(), "y": y.numpy()})[0]
    with torch.no_grad():
        # onnxruntime vs torch on sigmoid outputs in [0, 1]: summation order costs ~1e-7, 1e-5 is ample
        torch.testing.assert_close(torch.from_numpy(got), g(z, y), atol=1e-5, rtol=0)


def test_export_of_a_fresh_generator_keeps_every_weight_by_name():
    g = generator(shape=(1, 28, 28)).eval()  # fresh BN layers share values: the exporter would merge them
    reloaded = load_generator(export_generator(g))
    for (name, a), b in zip(g.state_dict().items(), reloaded.state_dict().values(), strict=True):
        assert torch.equal(a, b), name  # weights are copied bytes
