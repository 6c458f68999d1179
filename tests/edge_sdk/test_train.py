"""Local training: determinism, learning an easy problem, evaluate against a manual computation."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from torch import nn

from common.errors import ConfigError, DataError
from edge_sdk.data import ArrayDataset
from edge_sdk.models.arch import build_model
from edge_sdk.models.chain.spec import ChainSpec
from edge_sdk.train import TrainConfig, evaluate, kd_loss, kd_loss_logits, to_float, train


def _stripes(n: int, seed: int) -> ArrayDataset:
    """Two classes of 1x8x8 noise images: class 0 is brighter on the left half, class 1 on the right."""
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 2, n)
    x = rng.integers(0, 120, (n, 1, 8, 8))
    left = y == 0
    x[left, :, :, :4] += 120
    x[~left, :, :, 4:] += 120
    return ArrayDataset(torch.from_numpy(x.astype(np.uint8)), torch.from_numpy(y.astype(np.int64)), 2)


def _model(spec: str, shape: tuple[int, int, int], classes: int, seed: int = 0) -> nn.Module:
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return build_model(ChainSpec.parse(spec), shape, classes)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("epochs", -1),
        ("epochs", 1.5),
        ("lr", 0.0),
        ("lr", float("nan")),
        ("batch_size", 0),
        ("weight_decay", -1),
        ("precision", "fp16"),
    ],
)
def test_config_validation(field: str, value: object) -> None:
    with pytest.raises(ConfigError, match=field):
        TrainConfig(**{field: value})


def test_to_float() -> None:
    x = torch.tensor([0, 51, 255], dtype=torch.uint8)
    out = to_float(x)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, torch.tensor([0.0, 0.2, 1.0]))  # 51 / 255 rounds to the float32 of 0.2
    with pytest.raises(DataError, match="uint8"):
        to_float(x.float())


def test_same_seed_same_weights_and_caller_rng_untouched() -> None:
    data = _stripes(200, 0)
    base = _model("C8k3-P-F32-F2", (1, 8, 8), 2)  # hidden F: Dropout draws random numbers
    config = TrainConfig(epochs=2, batch_size=32)
    runs = []
    for seed in (5, 5, 6):
        model = copy.deepcopy(base)
        state = torch.get_rng_state()
        losses = train(model, data, config=config, seed=seed)
        assert torch.equal(torch.get_rng_state(), state)
        runs.append((losses, model.state_dict()))
    (loss_a, a), (loss_b, b), (loss_c, c) = runs
    assert loss_a == loss_b  # the same seed on the same kernels: bitwise, on any CPU
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert loss_a != loss_c
    assert not all(torch.equal(a[k], c[k]) for k in a)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_learns_a_separable_problem(precision: str) -> None:
    # bf16 runs emulated where the CPU has no bfloat16; it also guards the per-step autocast: a context
    # held over the whole run would keep computing with the first step's weights
    model = _model("C8k3-P-F2", (1, 8, 8), 2)
    config = TrainConfig(epochs=4, batch_size=32, precision=precision)
    losses = train(model, _stripes(512, 1), config=config, seed=0)
    assert len(losses) == 4
    assert losses[-1] < 0.1 < losses[0]  # stale cast weights would leave the training loss near 0.66
    loss, accuracy = evaluate(model, _stripes(256, 2))
    # the halves differ by 120 grey levels on every pixel: a trained model separates them with margins
    # far beyond bf16 or summation-order rounding, so these bounds do not depend on the kernels
    assert accuracy > 0.95
    assert loss < 0.3


def test_evaluate_matches_manual_computation() -> None:
    data = _stripes(100, 3)
    model = _model("C4k3-P-F16-F2", (1, 8, 8), 2)
    model.train()  # evaluate must switch to eval mode (Dropout off, BatchNorm running statistics)
    loss, accuracy = evaluate(model, data, batch_size=7)  # 15 batches, the last one of 2
    model.eval()
    with torch.no_grad():
        logits = model(data.x.float() / 255)
    want_loss = nn.functional.cross_entropy(logits, data.y).item()
    want_accuracy = (logits.argmax(1) == data.y).float().mean().item()
    # batches of 7 vs one of 100 may block the GEMMs differently (~1e-7 per logit): exact accuracy needs
    # every prediction's top-two gap to be far above that, else an argmax could flip on another CPU
    top2 = logits.topk(2, dim=1).values
    assert float((top2[:, 0] - top2[:, 1]).min()) > 1e-4
    assert loss == pytest.approx(want_loss, rel=1e-5)  # a mean of 100 O(1) terms in another order
    assert accuracy == pytest.approx(want_accuracy)
    assert not model.training


def test_lone_last_image_joins_the_previous_batch() -> None:
    """65 images at batch 64 would leave one image, and BatchNorm cannot normalise a single 1x1 map."""
    rng = np.random.default_rng(0)
    data = ArrayDataset(
        torch.from_numpy(rng.integers(0, 256, (65, 1, 1, 1), dtype=np.uint8)),
        torch.from_numpy(rng.integers(0, 2, 65)),
        2,
    )
    losses = train(_model("C4k1-C4k1-F2", (1, 1, 1), 2), data, config=TrainConfig(epochs=1), seed=0)
    assert len(losses) == 1 and np.isfinite(losses[0])


def test_empty_split_is_rejected() -> None:
    empty = _stripes(10, 0).subset(np.array([], dtype=np.int64))
    model = _model("C4k3-P-F2", (1, 8, 8), 2)
    with pytest.raises(DataError, match="empty"):
        train(model, empty, config=TrainConfig(epochs=1), seed=0)
    with pytest.raises(DataError, match="empty"):
        evaluate(model, empty)


def test_kd_loss_is_zero_on_agreement_and_matches_the_formula():
    g = torch.Generator().manual_seed(0)
    student, teacher = torch.randn(5, 4, generator=g), torch.randn(5, 4, generator=g)
    # KL(p || p) vanishes up to log/softmax rounding of 20 terms (~1e-7 each), scaled by T^2 = 16
    assert float(kd_loss_logits(teacher, teacher, 4.0)) == pytest.approx(0.0, abs=1e-6)
    p = torch.softmax(teacher / 2.0, dim=1)
    manual = (p * (p.log() - torch.log_softmax(student / 2.0, dim=1))).sum(dim=1).mean() * 4.0
    # the same formula with kl_div's summation order: a few ulps of an O(1) value
    assert float(kd_loss(student, p, 2.0)) == pytest.approx(float(manual), rel=1e-5)
    assert float(kd_loss_logits(student, teacher, 2.0)) == pytest.approx(float(manual), rel=1e-5)
